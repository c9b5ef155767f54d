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
using attnoracle::fast::kDotChunkBlocks;
using attnoracle::fast::kKeyBlock;
using attnoracle::fast::kSumChunk;
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

// out[0, cols) += sum over a of w[a] V[key a]; key a is keys[a], or a when keys is null.
template <bool kIndexed>
HWY_INLINE void PVImpl(const double* HWY_RESTRICT w, const std::int64_t* HWY_RESTRICT keys, std::size_t nkeys,
                       const double* HWY_RESTRICT values, std::size_t cols, double* HWY_RESTRICT out) {
  const D d;
  const std::size_t n = hn::Lanes(d);
  const std::size_t vec_end = cols / n * n;
  auto row = [&](std::size_t a) {
    return values + (kIndexed ? static_cast<std::size_t>(keys[a]) : a) * cols;
  };
  std::size_t c = 0;
  for (; c + 4 * n <= vec_end; c += 4 * n) {  // four vectors of columns in registers
    V s0 = hn::LoadU(d, out + c), s1 = hn::LoadU(d, out + c + n), s2 = hn::LoadU(d, out + c + 2 * n),
      s3 = hn::LoadU(d, out + c + 3 * n);
    for (std::size_t a = 0; a < nkeys; ++a) {
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
    for (std::size_t a = 0; a < nkeys; ++a) s0 = hn::MulAdd(hn::Set(d, w[a]), hn::LoadU(d, row(a) + c), s0);
    hn::StoreU(s0, d, out + c);
  }
  for (; c < cols; ++c)
    for (std::size_t a = 0; a < nkeys; ++a) out[c] += w[a] * row(a)[c];
}

void PV(const double* w, const std::int64_t* keys, std::size_t nkeys, const double* values, std::size_t cols,
        double* out) {
  if (keys)
    PVImpl<true>(w, keys, nkeys, values, cols, out);
  else
    PVImpl<false>(w, keys, nkeys, values, cols, out);
}

// out[0, cols) /= z.
void Divide(double* HWY_RESTRICT out, std::size_t cols, double z) {
  const D d;
  const std::size_t n = hn::Lanes(d);
  const V vz = hn::Set(d, z);
  std::size_t c = 0;
  for (; c + n <= cols; c += n) hn::StoreU(hn::Div(hn::LoadU(d, out + c), vz), d, out + c);
  for (; c < cols; ++c) out[c] /= z;
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
HWY_EXPORT(Divide);
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
  // Tiles of 4 rows, as the certified path's: the dots and P V run over a chunk of the keys and
  // values (its chunks, simd.hpp) for every row of the tile while the chunk is in cache.
  constexpr std::int64_t kRowsPerTask = 4, kChunkBlocks = kDotChunkBlocks;
  constexpr std::size_t kChunk = kSumChunk;
  const auto tasks = static_cast<std::size_t>((rows + kRowsPerTask - 1) / kRowsPerTask);
  parallel_for(tasks, threads, [&](std::size_t t) {
    struct Row {
      std::int64_t b = 0, h = 0, i = 0, bg = 0, b0 = 0, nb = 0;
      bool live = false;
      std::vector<double> s, w;
      std::vector<std::int64_t> keys;
      double z = 0;
    };
    const std::int64_t r0 = static_cast<std::int64_t>(t) * kRowsPerTask, r1 = std::min(rows, r0 + kRowsPerTask);
    std::vector<Row> tile(static_cast<std::size_t>(r1 - r0));
    std::int64_t lo = blocks, hi = 0;
    for (std::int64_t r = r0; r < r1; ++r) {
      Row& w = tile[static_cast<std::size_t>(r - r0)];
      w.i = r % c.Nq, w.h = (r / c.Nq) % c.Hq, w.b = r / (c.Nq * c.Hq);
      w.bg = w.b * c.Hkv + c.kv_head(w.h);
      std::int64_t first = 0, last = c.Nk - 1;
      if (!dense) {
        const Case::KeyRange kr = c.key_range(w.b, w.i);
        for (std::int64_t j = kr.first; j <= kr.last; ++j)
          if (c.allowed(w.b, w.h, w.i, j)) w.keys.push_back(j);
        if (w.keys.empty()) continue;  // fully masked: zeros
        first = w.keys.front();
        last = w.keys.back();
      }
      w.live = true;
      w.b0 = first / kb, w.nb = last / kb - w.b0 + 1;
      w.s.resize(static_cast<std::size_t>(w.nb * kb));
      lo = std::min(lo, w.b0);
      hi = std::max(hi, w.b0 + w.nb);
    }
    for (std::int64_t c0 = lo; c0 < hi; c0 += kChunkBlocks)
      for (std::int64_t r = r0; r < r1; ++r) {
        Row& w = tile[static_cast<std::size_t>(r - r0)];
        const std::int64_t a = std::max(c0, w.b0), e = std::min(c0 + kChunkBlocks, w.b0 + w.nb);
        if (!w.live || a >= e) continue;
        HWY_DYNAMIC_DISPATCH(DotBlocks)(c.q.values.data() + r * Dk,
                                        kt.data() + static_cast<std::size_t>((w.bg * blocks + a) * Dk * kb), Dk,
                                        e - a, scale, w.s.data() + (a - w.b0) * kb);
      }
    std::size_t most = 0;
    for (Row& w : tile) {
      if (!w.live) continue;
      const std::size_t count = w.s.size(), base = static_cast<std::size_t>(w.b0 * kb);
      if (dense) {
        for (std::size_t a = static_cast<std::size_t>(c.Nk) - base; a < count; ++a) w.s[a] = -HUGE_VAL;
      } else {
        std::size_t a = 0;  // masked keys -inf, bias added to the others
        for (std::size_t o2 = 0; o2 < count; ++o2) {
          const auto j = static_cast<std::int64_t>(base + o2);
          if (a < w.keys.size() && w.keys[a] == j) {
            if (c.bias) w.s[o2] += c.bias_at(w.b, w.h, w.i, j);
            ++a;
          } else {
            w.s[o2] = -HUGE_VAL;
          }
        }
      }
      w.z = HWY_DYNAMIC_DISPATCH(SoftmaxNumerators)(w.s.data(), count);
      if (!dense) {
        w.w.resize(w.keys.size());
        for (std::size_t a = 0; a < w.keys.size(); ++a) w.w[a] = w.s[static_cast<std::size_t>(w.keys[a]) - base];
      }
      most = std::max(most, dense ? static_cast<std::size_t>(c.Nk) : w.keys.size());
    }
    for (std::size_t a0 = 0; a0 < most; a0 += kChunk)
      for (std::int64_t r = r0; r < r1; ++r) {
        Row& w = tile[static_cast<std::size_t>(r - r0)];
        const std::size_t n = dense ? static_cast<std::size_t>(c.Nk) : w.keys.size();
        if (!w.live || a0 >= n) continue;
        // dense rows index the chunk's values from its first key, the others by key
        const double* values = c.v.values.data() + static_cast<std::size_t>(w.bg * c.Nk) * Dv + (dense ? a0 * Dv : 0);
        HWY_DYNAMIC_DISPATCH(PV)((dense ? w.s.data() : w.w.data()) + a0, dense ? nullptr : w.keys.data() + a0,
                                 std::min(kChunk, n - a0), values, Dv, out.data() + static_cast<std::size_t>(r) * Dv);
      }
    for (std::int64_t r = r0; r < r1; ++r) {
      const Row& w = tile[static_cast<std::size_t>(r - r0)];
      if (w.live) HWY_DYNAMIC_DISPATCH(Divide)(out.data() + static_cast<std::size_t>(r) * Dv, Dv, w.z);
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
