// The floor: scaled dot-product attention in plain float64, uncertified, for timing only.
//
//   attnoracle_floor CASE [--threads N] [--compare GOLDEN]
//
// out[b,h,i,:] = softmax(scale q.k + bias) V, kind sdpa (no softcap, no sinks), with the
// certified fast path's layout and SIMD lanes (Highway, dispatched at run time): keys
// transposed into blocks of 8, dots 8 keys at a time with MulAdd, max, exp(s - max), sum,
// P V with the columns in lanes, divided by the sum. Masked keys are skipped; a row without
// an allowed key gets zeros. Prints one line:
//   CASE: R rows, evaluation X s, whole Y s on T threads, checksum S
// --compare GOLDEN (an `attnoracle eval` output) adds the error against its out.ref.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "floor.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>
#include <hwy/contrib/math/math-inl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>

#include "attnoracle/reference/case_file.hpp"
#include "attnoracle/reference/error.hpp"
#include "attnoracle/reference/parallel.hpp"
#include "attnoracle/reference/safetensors.hpp"

#include "fast/simd.hpp"  // the transposed keys' layout (kKeyBlock, transpose_keys)

#ifndef ATTNORACLE_FLOOR_CONSTANTS
#define ATTNORACLE_FLOOR_CONSTANTS  // once, not per target
namespace attnfloor {
using attnoracle::fast::kKeyBlock;
}
#endif

HWY_BEFORE_NAMESPACE();
namespace attnfloor {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using D = hn::ScalableTag<double>;
using V = hn::Vec<D>;

// s[j] = scale (q . key j) for the keys of `blocks` blocks of kt[(block * len + e) * 8 + l].
void DotBlocks(const double* HWY_RESTRICT q, const double* HWY_RESTRICT kt, std::int64_t len,
               std::int64_t blocks, double scale, double* HWY_RESTRICT s) {
  const D d;
  const std::size_t n = hn::Lanes(d);
  const auto blk = static_cast<std::size_t>(len) * kKeyBlock;  // doubles per block
  std::int64_t b = 0;
  if (kKeyBlock % n == 0) {
    const V vs = hn::Set(d, scale);
    for (; b + 4 <= blocks; b += 4) {  // four blocks at once: independent MulAdd chains
      const double* k = kt + static_cast<std::size_t>(b) * blk;
      for (std::size_t l = 0; l < kKeyBlock; l += n) {
        V a0 = hn::Zero(d), a1 = hn::Zero(d), a2 = hn::Zero(d), a3 = hn::Zero(d);
        for (std::int64_t e = 0; e < len; ++e) {
          const V qe = hn::Set(d, q[e]);
          const std::size_t o = static_cast<std::size_t>(e) * kKeyBlock + l;
          a0 = hn::MulAdd(qe, hn::LoadU(d, k + o), a0);
          a1 = hn::MulAdd(qe, hn::LoadU(d, k + blk + o), a1);
          a2 = hn::MulAdd(qe, hn::LoadU(d, k + 2 * blk + o), a2);
          a3 = hn::MulAdd(qe, hn::LoadU(d, k + 3 * blk + o), a3);
        }
        double* out = s + static_cast<std::size_t>(b) * kKeyBlock + l;
        hn::StoreU(hn::Mul(a0, vs), d, out);
        hn::StoreU(hn::Mul(a1, vs), d, out + kKeyBlock);
        hn::StoreU(hn::Mul(a2, vs), d, out + 2 * kKeyBlock);
        hn::StoreU(hn::Mul(a3, vs), d, out + 3 * kKeyBlock);
      }
    }
    for (; b < blocks; ++b) {
      const double* k = kt + static_cast<std::size_t>(b) * blk;
      for (std::size_t l = 0; l < kKeyBlock; l += n) {
        V a = hn::Zero(d);
        for (std::int64_t e = 0; e < len; ++e)
          a = hn::MulAdd(hn::Set(d, q[e]), hn::LoadU(d, k + static_cast<std::size_t>(e) * kKeyBlock + l), a);
        hn::StoreU(hn::Mul(a, vs), d, s + static_cast<std::size_t>(b) * kKeyBlock + l);
      }
    }
    return;
  }
  for (; b < blocks; ++b)  // lanes wider than a block
    for (std::size_t l = 0; l < kKeyBlock; ++l) {
      double a = 0;
      for (std::int64_t e = 0; e < len; ++e)
        a += q[e] * kt[static_cast<std::size_t>(b) * blk + static_cast<std::size_t>(e) * kKeyBlock + l];
      s[static_cast<std::size_t>(b) * kKeyBlock + l] = a * scale;
    }
}

// s[0, count) replaced by exp(s - max s) (-inf gives 0); returns their sum.
double SoftmaxNumerators(double* HWY_RESTRICT s, std::size_t count) {
  const D d;
  const std::size_t n = hn::Lanes(d);
  std::size_t i = 0;
  V vm = hn::Set(d, -HUGE_VAL);
  for (; i + n <= count; i += n) vm = hn::Max(vm, hn::LoadU(d, s + i));
  double m = hn::GetLane(hn::MaxOfLanes(d, vm));
  for (; i < count; ++i) m = std::max(m, s[i]);
  const V vmax = hn::Set(d, m);
  V sum = hn::Zero(d);
  for (i = 0; i + n <= count; i += n) {
    const V p = hn::Exp(d, hn::Sub(hn::LoadU(d, s + i), vmax));
    hn::StoreU(p, d, s + i);
    sum = hn::Add(sum, p);
  }
  double z = hn::GetLane(hn::SumOfLanes(d, sum));
  for (; i < count; ++i) {
    s[i] = std::exp(s[i] - m);
    z += s[i];
  }
  return z;
}

// out[0, cols) = sum over a of w[a] V[key a] / z; key a is keys[a], or a when keys is null.
template <bool kIndexed>
HWY_INLINE void PVImpl(const double* HWY_RESTRICT w, const std::int64_t* HWY_RESTRICT keys, std::size_t nkeys,
                       const double* HWY_RESTRICT values, std::size_t cols, double z, double* HWY_RESTRICT out) {
  const D d;
  const std::size_t n = hn::Lanes(d);
  constexpr std::size_t kChunk = 128;  // keys per pass: their rows stay in cache
  const std::size_t vec_end = cols / n * n;
  std::fill(out, out + cols, 0.0);
  auto row = [&](std::size_t a) {
    return values + (kIndexed ? static_cast<std::size_t>(keys[a]) : a) * cols;
  };
  for (std::size_t a0 = 0; a0 < nkeys; a0 += kChunk) {
    const std::size_t a1 = std::min(nkeys, a0 + kChunk);
    std::size_t c = 0;
    for (; c + 4 * n <= vec_end; c += 4 * n) {  // four vectors of columns in registers
      V s0 = hn::LoadU(d, out + c), s1 = hn::LoadU(d, out + c + n), s2 = hn::LoadU(d, out + c + 2 * n),
        s3 = hn::LoadU(d, out + c + 3 * n);
      for (std::size_t a = a0; a < a1; ++a) {
        const double* y = row(a) + c;
        const V wa = hn::Set(d, w[a]);
        s0 = hn::MulAdd(wa, hn::LoadU(d, y), s0);
        s1 = hn::MulAdd(wa, hn::LoadU(d, y + n), s1);
        s2 = hn::MulAdd(wa, hn::LoadU(d, y + 2 * n), s2);
        s3 = hn::MulAdd(wa, hn::LoadU(d, y + 3 * n), s3);
      }
      hn::StoreU(s0, d, out + c);
      hn::StoreU(s1, d, out + c + n);
      hn::StoreU(s2, d, out + c + 2 * n);
      hn::StoreU(s3, d, out + c + 3 * n);
    }
    for (; c < vec_end; c += n) {
      V s0 = hn::LoadU(d, out + c);
      for (std::size_t a = a0; a < a1; ++a) s0 = hn::MulAdd(hn::Set(d, w[a]), hn::LoadU(d, row(a) + c), s0);
      hn::StoreU(s0, d, out + c);
    }
    for (; c < cols; ++c)
      for (std::size_t a = a0; a < a1; ++a) out[c] += w[a] * row(a)[c];
  }
  const V vz = hn::Set(d, z);
  std::size_t c = 0;
  for (; c < vec_end; c += n) hn::StoreU(hn::Div(hn::LoadU(d, out + c), vz), d, out + c);
  for (; c < cols; ++c) out[c] /= z;
}

void PV(const double* w, const std::int64_t* keys, std::size_t nkeys, const double* values, std::size_t cols,
        double z, double* out) {
  if (keys)
    PVImpl<true>(w, keys, nkeys, values, cols, z, out);
  else
    PVImpl<false>(w, keys, nkeys, values, cols, z, out);
}

const char* TargetHere() { return hwy::TargetName(HWY_TARGET); }

}  // namespace HWY_NAMESPACE
}  // namespace attnfloor
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace attnfloor {

HWY_EXPORT(DotBlocks);
HWY_EXPORT(SoftmaxNumerators);
HWY_EXPORT(PV);
HWY_EXPORT(TargetHere);

using namespace attnoracle;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

[[noreturn]] void fail(const std::string& line) {
  std::fprintf(stderr, "attnoracle_floor: error: %s\n", line.c_str());
  std::exit(2);
}

std::vector<double> evaluate(const Case& c, int threads) {
  const auto kb = static_cast<std::int64_t>(kKeyBlock);
  const std::int64_t blocks = attnoracle::fast::key_blocks(c.Nk), Dk = c.Dk;
  const auto Dv = static_cast<std::size_t>(c.Dv);
  const std::vector<double> kt = attnoracle::fast::transpose_keys(c.k.values.data(), c.B * c.Hkv, c.Nk, Dk);
  double scale = 1.0 / std::sqrt(static_cast<double>(Dk));
  if (c.scale) scale = std::strtod(c.scale->c_str(), nullptr);
  // Every key of every row: no mask, bias, causal option, window or key lengths.
  const bool dense = !c.mask && !c.bias && c.causal == Causal::None && !c.window && !c.seqlens_k;
  const std::int64_t rows = c.B * c.Hq * c.Nq;
  std::vector<double> out(static_cast<std::size_t>(rows) * Dv, 0.0);
  constexpr std::int64_t kRowsPerTask = 8;
  const auto tasks = static_cast<std::size_t>((rows + kRowsPerTask - 1) / kRowsPerTask);
  parallel_for(tasks, threads, [&](std::size_t t) {
    std::vector<double> s(static_cast<std::size_t>(blocks * kb)), w;
    std::vector<std::int64_t> keys;
    const std::int64_t r0 = static_cast<std::int64_t>(t) * kRowsPerTask, r1 = std::min(rows, r0 + kRowsPerTask);
    for (std::int64_t r = r0; r < r1; ++r) {
      const std::int64_t i = r % c.Nq, h = (r / c.Nq) % c.Hq, b = r / (c.Nq * c.Hq);
      const std::int64_t bg = b * c.Hkv + c.kv_head(h);
      const double* q = c.q.values.data() + r * Dk;
      const double* values = c.v.values.data() + static_cast<std::size_t>(bg * c.Nk) * Dv;
      double* o = out.data() + static_cast<std::size_t>(r) * Dv;
      std::int64_t first = 0, last = c.Nk - 1;
      if (!dense) {
        const Case::KeyRange kr = c.key_range(b, i);
        first = kr.first;
        last = kr.last;
        keys.clear();
        for (std::int64_t j = first; j <= last; ++j)
          if (c.allowed(b, h, i, j)) keys.push_back(j);
        if (keys.empty()) continue;  // fully masked: zeros
        first = keys.front();
        last = keys.back();
      }
      const std::int64_t b0 = first / kb, nb = last / kb - b0 + 1;
      HWY_DYNAMIC_DISPATCH(DotBlocks)(q, kt.data() + static_cast<std::size_t>((bg * blocks + b0) * Dk * kb), Dk, nb,
                                      scale, s.data());
      const auto count = static_cast<std::size_t>(nb * kb), base = static_cast<std::size_t>(b0 * kb);
      if (dense) {
        for (std::size_t a = static_cast<std::size_t>(c.Nk) - base; a < count; ++a) s[a] = -HUGE_VAL;
      } else {
        std::size_t a = 0;  // masked keys -inf, bias added to the others
        for (std::size_t o2 = 0; o2 < count; ++o2) {
          const auto j = static_cast<std::int64_t>(base + o2);
          if (a < keys.size() && keys[a] == j) {
            if (c.bias) s[o2] += c.bias_at(b, h, i, j);
            ++a;
          } else {
            s[o2] = -HUGE_VAL;
          }
        }
      }
      const double z = HWY_DYNAMIC_DISPATCH(SoftmaxNumerators)(s.data(), count);
      if (dense) {
        HWY_DYNAMIC_DISPATCH(PV)(s.data(), nullptr, static_cast<std::size_t>(c.Nk), values, Dv, z, o);
      } else {
        w.resize(keys.size());
        for (std::size_t a = 0; a < keys.size(); ++a) w[a] = s[static_cast<std::size_t>(keys[a]) - base];
        HWY_DYNAMIC_DISPATCH(PV)(w.data(), keys.data(), keys.size(), values, Dv, z, o);
      }
    }
  });
  return out;
}

// Max error of out against the golden file's out.ref (else out): relative to |out.ref| and to
// out.bound where present; rows with row.valid false are skipped.
void compare(const Case& c, const std::vector<double>& out, const std::string& path) {
  const SafeTensorsFile g = read_safetensors(path);
  const RawTensor* ref = g.find("out.ref");
  if (!ref) ref = g.find("out");
  if (!ref) fail(path + ": no tensor out.ref or out");
  if (ref->shape != c.out_shape() || !is_float_format(ref->dtype))
    fail(path + ": " + ref->name + ": shape " + shape_string(ref->shape) + " " + std::string(dtype_name(ref->dtype)) +
         ", expected a float tensor of shape " + shape_string(c.out_shape()));
  const RawTensor* bound = g.find("out.bound");
  if (bound && (bound->shape != ref->shape || bound->dtype != DType::F64)) bound = nullptr;
  const RawTensor* valid = g.find("row.valid");
  if (valid && (valid->shape != c.row_shape() || valid->dtype != DType::BOOL)) valid = nullptr;
  const auto Dv = static_cast<std::size_t>(c.Dv);
  const std::size_t es = dtype_size(ref->dtype);
  double rel = 0, vs_bound = 0;
  std::size_t compared = 0;
  for (std::size_t e = 0; e < out.size(); ++e) {
    if (valid && valid->data[e / Dv] == 0) continue;
    const double r = decode_float(ref->dtype, ref->data.data() + e * es), err = std::fabs(out[e] - r);
    ++compared;
    if (!(err == 0)) rel = std::max(rel, r != 0 ? err / std::fabs(r) : HUGE_VAL);  // NaN: inf
    if (bound) {
      const double bd = decode_float(DType::F64, bound->data.data() + e * 8);
      if (bd > 0) vs_bound = std::max(vs_bound, err / bd);
    }
  }
  std::printf("compare %s (%s): %zu elements, max relative error %.3g", path.c_str(), ref->name.c_str(), compared, rel);
  if (bound) std::printf(", max error / out.bound %.3g", vs_bound);
  std::printf("\n");
}

int run(int argc, char** argv) {
  const auto t0 = Clock::now();
  std::string path, golden;
  const unsigned hc = std::thread::hardware_concurrency();
  int threads = hc == 0 ? 1 : static_cast<int>(hc);  // attnoracle eval's default
  CLI::App app{"Plain float64 SIMD attention (uncertified, for timing); see bench/README.md.", "attnoracle_floor"};
  app.add_option("CASE", path, "case file (safetensors)")->required();
  app.add_option("--threads", threads, "worker threads")->check(CLI::Range(1, 1024));
  app.add_option("--compare", golden, "an attnoracle eval output: the error against its out.ref");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    fail(std::string("usage: ") + e.what() + " (see attnoracle_floor --help)");
  }

  std::optional<Case> c;
  try {
    c.emplace(read_case(path));
  } catch (const InputError& e) {
    fail(e.message());
  } catch (const std::exception& e) {
    fail(path + ": " + e.what());
  }
  if (c->kind != Kind::Sdpa) fail(path + ": kind mha: the floor evaluates kind sdpa only");
  if (c->softcap) fail(path + ": softcap: not supported by the floor");
  if (c->sinks) fail(path + ": sinks: not supported by the floor");

  const auto t1 = Clock::now();
  const std::vector<double> out = evaluate(*c, threads);
  const double evaluation = seconds_since(t1);
  double checksum = 0;
  for (double x : out) checksum += x;
  const double whole = seconds_since(t0);
  std::printf("%s: %lld rows, evaluation %.6f s, whole %.6f s on %d thread%s, checksum %.17g\n", path.c_str(),
              static_cast<long long>(c->B * c->Hq * c->Nq), evaluation, whole, threads, threads == 1 ? "" : "s",
              checksum);
  std::fflush(stdout);
  if (!golden.empty()) {
    try {
      compare(*c, out, golden);
    } catch (const InputError& e) {
      fail(e.message());
    }
  }
  std::fprintf(stderr, "attnoracle_floor: SIMD target %s\n", HWY_DYNAMIC_DISPATCH(TargetHere)());
  return 0;
}

}  // namespace attnfloor

int main(int argc, char** argv) { return attnfloor::run(argc, argv); }
#endif
