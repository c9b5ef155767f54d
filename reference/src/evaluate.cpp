// The Ziv driver: evaluates every row unit at rising precision until every golden element of
// the row is proven correctly rounded (or the cap is reached), across threads.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <cmath>
#include <exception>
#include <mutex>
#include <thread>

#include "attnoracle/reference/detail/row_evaluator.hpp"
#include "attnoracle/reference/evaluate.hpp"
#include "attnoracle/reference/round.hpp"
#include "attnoracle/version.hpp"
#include "fast/fast_row.hpp"


namespace attnoracle {
namespace {

// One golden tensor being filled: its bytes, and the elements that could not be decided.
struct GoldenBuffer {
  std::string name;
  DType dtype;
  std::vector<std::int64_t> shape;
  std::vector<unsigned char> bytes;
  std::mutex mu;
  std::vector<std::pair<std::int64_t, double>> undecided;  // flat index, other candidate

  GoldenBuffer(std::string n, DType t, std::vector<std::int64_t> s)
      : name(std::move(n)), dtype(t), shape(std::move(s)) {
    std::int64_t count = 1;
    for (auto d : shape) count *= d;
    bytes.assign(static_cast<std::size_t>(count) * dtype_size(t), 0);
  }
  void set(std::int64_t idx, double v) {
    encode_float(dtype, v, bytes.data() + static_cast<std::size_t>(idx) * dtype_size(dtype));
  }
  RawTensor take() {
    RawTensor t;
    t.name = name;
    t.dtype = dtype;
    t.shape = shape;
    t.data = std::move(bytes);
    return t;
  }
};

// The result of one rounded element, before it is committed.
struct Pending {
  GoldenBuffer* buf;
  std::int64_t idx;
  RoundedEnclosure r;
};

struct Buffers {
  std::unique_ptr<GoldenBuffer> out, out_ref, out_ref_lo, out_bound, weights, weights_ref, lse,
      lse_ref;
  std::vector<unsigned char> row_valid;
};

// Working precision to start from: enough for the .ref tensors (F64), with room for the
// rounding errors of sums over Nk and Dk terms; F64 outputs also need out.ref_lo, which is
// about 53 bits further down.
mpfr_prec_t start_precision(const Case& c) {
  auto lg = [](std::int64_t n) { return static_cast<mpfr_prec_t>(std::ceil(std::log2(static_cast<double>(n) + 1.0))); };
  mpfr_prec_t p = 96 + 2 * lg(c.Nk) + lg(c.Dk) + lg(c.Dv);
  if (c.output_dtype == DType::F64) p += 64;
  return p;
}

// A double-double as an MPFR enclosure end, rounded the given way at 128 bits.
void set_dd(mpfr_ptr x, fast::DD d, mpfr_rnd_t rnd) {
  mpfr_set_d(x, d.hi, rnd);
  mpfr_add_d(x, x, d.lo, rnd);
}
Enclosure ball_enclosure(const fast::Ball& b) {
  Enclosure e(128);
  set_dd(e.lo, fast::lower(b), MPFR_RNDD);
  set_dd(e.hi, fast::upper(b), MPFR_RNDU);
  return e;
}
Enclosure point_enclosure(double lo, double hi) {
  Enclosure e(128);
  mpfr_set_d(e.lo, lo, MPFR_RNDD);
  mpfr_set_d(e.hi, hi, MPFR_RNDU);
  return e;
}

// Rounded down and up to F64.
double down(fast::DD x) {
  const fast::DD s = fast::two_sum(x.hi, x.lo);
  return s.lo < 0 ? std::nextafter(s.hi, -INFINITY) : s.hi;
}
double up(fast::DD x) {
  const fast::DD s = fast::two_sum(x.hi, x.lo);
  return s.lo > 0 ? std::nextafter(s.hi, INFINITY) : s.hi;
}

RowIntervals fast_intervals(const fast::FastRow& fr, const Enclosure& lse) {
  RowIntervals r;
  r.allowed = fr.allowed;
  const std::size_t n = fr.weights.size(), m = fr.out.size();
  r.dot_lo.resize(n), r.dot_hi.resize(n), r.w_lo.resize(n), r.w_hi.resize(n);
  for (std::size_t j = 0; j < n; ++j) {
    r.dot_lo[j] = down(fast::lower(fr.dots[j]));
    r.dot_hi[j] = up(fast::upper(fr.dots[j]));
    r.w_lo[j] = down(fast::lower(fr.weights[j]));
    r.w_hi[j] = up(fast::upper(fr.weights[j]));
  }
  r.out_lo.resize(m), r.out_hi.resize(m);
  for (std::size_t e = 0; e < m; ++e) {
    r.out_lo[e] = down(fast::lower(fr.out[e]));
    r.out_hi[e] = up(fast::upper(fr.out[e]));
  }
  r.lse_lo = mpfr_get_d(lse.lo, MPFR_RNDD);
  r.lse_hi = mpfr_get_d(lse.hi, MPFR_RNDU);
  return r;
}

// The ends of a ball intersected with [lo, hi], as an enclosure.
Enclosure clamped_enclosure(const fast::Ball& b, double lo, double hi) {
  fast::DD l, h;
  fast::ends(b, l, h, lo, hi);
  Enclosure e(128);
  set_dd(e.lo, l, MPFR_RNDD);
  set_dd(e.hi, h, MPFR_RNDU);
  return e;
}

// The fast row as the enclosures the oracle checks (used when no interval check is given).
RowEnclosures fast_enclosures(const fast::FastRow& fr, const Enclosure& lse) {
  RowEnclosures r;
  HeadDetail d;
  d.allowed = fr.allowed;
  std::vector<Enclosure> w;
  for (std::size_t j = 0; j < fr.weights.size(); ++j) {
    d.dots.push_back(ball_enclosure(fr.dots[j]));
    w.push_back(ball_enclosure(fr.weights[j]));
  }
  for (std::size_t e = 0; e < fr.out.size(); ++e) {
    d.raw_out.push_back(ball_enclosure(fr.out[e]));
    d.hull.push_back(point_enclosure(fr.vmin[e], fr.vmax[e]));
    d.out.push_back(clamped_enclosure(fr.out[e], fr.vmin[e], fr.vmax[e]));
    r.out.push_back(clamped_enclosure(fr.out[e], fr.vmin[e], fr.vmax[e]));
    r.bound.push_back(ball_enclosure(fr.bound[e]));
  }
  Enclosure l(128);
  mpfr_set(l.lo, lse.lo, MPFR_RNDD);
  mpfr_set(l.hi, lse.hi, MPFR_RNDU);
  r.weights.push_back(std::move(w));
  r.lse.push_back(std::move(l));
  r.head_valid.push_back(true);
  r.heads.push_back(std::move(d));
  return r;
}

}  // namespace

EvalResult evaluate(const Case& c, const EvalOptions& opt) {
  const auto t0 = std::chrono::steady_clock::now();
  const bool mha = c.kind == Kind::Mha;
  const std::int64_t H = c.Hq, Nq = c.Nq, Nk = c.Nk;
  const std::int64_t width = mha ? c.Dout : c.Dv;
  std::vector<std::int64_t> out_shape =
      mha ? std::vector<std::int64_t>{c.B, Nq, c.Dout} : std::vector<std::int64_t>{c.B, H, Nq, c.Dv};
  const std::vector<std::int64_t> w_shape{c.B, H, Nq, Nk}, row_shape{c.B, H, Nq};
  const DType odt = c.output_dtype;

  Buffers bufs;
  bufs.out = std::make_unique<GoldenBuffer>("out", odt, out_shape);
  bufs.out_ref = std::make_unique<GoldenBuffer>("out.ref", DType::F64, out_shape);
  if (odt == DType::F64)
    bufs.out_ref_lo = std::make_unique<GoldenBuffer>("out.ref_lo", DType::F64, out_shape);
  bufs.out_bound = std::make_unique<GoldenBuffer>("out.bound", DType::F64, out_shape);
  if (c.want_weights) {
    bufs.weights = std::make_unique<GoldenBuffer>("weights", odt, w_shape);
    bufs.weights_ref = std::make_unique<GoldenBuffer>("weights.ref", DType::F64, w_shape);
  }
  if (c.want_lse) {
    bufs.lse = std::make_unique<GoldenBuffer>("lse", odt, row_shape);
    bufs.lse_ref = std::make_unique<GoldenBuffer>("lse.ref", DType::F64, row_shape);
  }
  bufs.row_valid.assign(static_cast<std::size_t>(c.B * H * Nq), 0);

  // Refuse before any work, naming the first fully masked row in (b, h, i) order.
  if (c.masked_rows == MaskedRows::Error)
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t i = 0; i < Nq; ++i)
          if (c.query_valid(b, i) && !c.row_has_key(b, h, i)) throw FullyMaskedRow(b, h, i);

  RowEvaluator ev(c);
  const std::int64_t units = mha ? c.B * Nq : c.B * H * Nq;
  const mpfr_prec_t p0 = opt.start_precision > 0 ? opt.start_precision : start_precision(c);
  const mpfr_prec_t cap = std::max(opt.max_precision, p0);

  std::atomic<std::int64_t> next{0};
  std::atomic<bool> stop{false};
  std::mutex err_mu;
  std::int64_t err_unit = units;
  std::exception_ptr err;
  std::atomic<std::uint64_t> n_elements{0}, n_undecided{0}, n_raised{0};
  std::atomic<mpfr_prec_t> max_reached{0};

  // The fast path: the row in double-double balls; committed only when every element of it is
  // decided (the same values the MPFR path proves, since a correct rounding is unique).
  const fast::Setup fast_setup = opt.fast_path ? fast::prepare(c) : fast::Setup{};
  std::atomic<std::uint64_t> n_fast{0}, n_fallback{0};
  auto try_fast = [&](std::int64_t b, std::int64_t h, std::int64_t i) -> bool {
    const fast::FastRow fr = fast::fast_row(c, fast_setup, b, h, i);
    if (!fr.ok) return false;
    struct Item {
      GoldenBuffer* buf;
      std::int64_t idx;
      double value;
    };
    std::vector<Item> items;
    // Both ends round alike: the rounding is proven (zeros: +0 unless the whole ball is < 0).
    auto decide = [&](GoldenBuffer* buf, std::int64_t idx, fast::DD lo, fast::DD hi, double& value) {
      const double a = fast::round_dd(lo, buf->dtype), z = fast::round_dd(hi, buf->dtype);
      if (a == 0 && z == 0) value = (hi.hi < 0 || (hi.hi == 0 && hi.lo < 0)) ? -0.0 : 0.0;
      else if (a == z) value = a;
      else return false;
      items.push_back({buf, idx, value});
      return true;
    };
    const std::int64_t obase = ((b * H + h) * Nq + i) * width;
    std::vector<double> bounds(static_cast<std::size_t>(width));
    for (std::int64_t e = 0; e < width; ++e) {
      const auto ei = static_cast<std::size_t>(e);
      fast::DD lo, hi;
      fast::ends(fr.out[ei], lo, hi, fr.vmin[ei], fr.vmax[ei]);
      double v, ref;
      if (!decide(bufs.out.get(), obase + e, lo, hi, v)) return false;
      if (!decide(bufs.out_ref.get(), obase + e, lo, hi, ref)) return false;
      if (bufs.out_ref_lo) {  // exact - ref: x.hi - ref is exact (Sterbenz) or we give up
        const fast::DD dl = fast::two_sum(lo.hi, -ref), dh = fast::two_sum(hi.hi, -ref);
        if (dl.lo != 0 || dh.lo != 0) return false;
        if (!decide(bufs.out_ref_lo.get(), obase + e, fast::DD{dl.hi, lo.lo}, fast::DD{dh.hi, hi.lo}, v))
          return false;
      }
      fast::ends(fr.bound[ei], lo, hi, fr.absmin[ei], fr.absmax[ei]);  // within the |v| range
      bounds[ei] = fast::round_up_dd(hi) + 0.0;  // a zero bound is +0
      if (fast::round_up_dd(lo) != bounds[ei]) return false;
    }
    const std::int64_t rbase = (b * H + h) * Nq + i;
    if (c.want_weights)
      for (std::int64_t j = 0; j < Nk; ++j) {
        if (!fr.allowed[static_cast<std::size_t>(j)]) {  // exactly 0
          items.push_back({bufs.weights.get(), rbase * Nk + j, 0.0});
          items.push_back({bufs.weights_ref.get(), rbase * Nk + j, 0.0});
          continue;
        }
        fast::DD lo, hi;
        fast::ends(fr.weights[static_cast<std::size_t>(j)], lo, hi, 0, 1);
        double v;
        if (!decide(bufs.weights.get(), rbase * Nk + j, lo, hi, v)) return false;
        if (!decide(bufs.weights_ref.get(), rbase * Nk + j, lo, hi, v)) return false;
      }
    // lse = m + log Z, enclosed with MPFR from the ends of Z's ball (one log per row).
    Enclosure lse(128);
    {
      const fast::DD zl = fast::lower(fr.z), zh = fast::upper(fr.z);
      mpfr_set_d(lse.lo, zl.hi, MPFR_RNDD);
      mpfr_add_d(lse.lo, lse.lo, zl.lo, MPFR_RNDD);
      mpfr_log(lse.lo, lse.lo, MPFR_RNDD);
      mpfr_add_d(lse.lo, lse.lo, fr.m, MPFR_RNDD);
      mpfr_set_d(lse.hi, zh.hi, MPFR_RNDU);
      mpfr_add_d(lse.hi, lse.hi, zh.lo, MPFR_RNDU);
      mpfr_log(lse.hi, lse.hi, MPFR_RNDU);
      mpfr_add_d(lse.hi, lse.hi, fr.m, MPFR_RNDU);
    }
    if (c.want_lse) {
      for (GoldenBuffer* buf : {bufs.lse.get(), bufs.lse_ref.get()}) {
        const RoundedEnclosure re = round_enclosure(lse.lo, lse.hi, buf->dtype);
        if (!re.decided) return false;
        items.push_back({buf, rbase, re.value});
      }
    }
    if (opt.row_check_fast) opt.row_check_fast(b, h, i, fast_intervals(fr, lse));
    else if (opt.row_check) opt.row_check(b, h, i, fast_enclosures(fr, lse));
    for (const Item& it : items) it.buf->set(it.idx, it.value);
    for (std::int64_t e = 0; e < width; ++e) bufs.out_bound->set(obase + e, bounds[static_cast<std::size_t>(e)]);
    bufs.row_valid[static_cast<std::size_t>(rbase)] = 1;
    n_elements.fetch_add(items.size());
    return true;
  };

  auto work = [&]() {
    std::vector<Pending> pend;
    while (!stop.load(std::memory_order_relaxed)) {
      const std::int64_t u = next.fetch_add(1);
      if (u >= units) break;
      const std::int64_t b = mha ? u / Nq : u / (H * Nq);
      const std::int64_t h = mha ? 0 : (u / Nq) % H;
      const std::int64_t i = u % Nq;
      try {
        if (fast_setup.applies && !mha && try_fast(b, h, i)) {
          n_fast.fetch_add(1);
          continue;
        }
        for (mpfr_prec_t p = p0;; p = std::min(2 * p, cap)) {
          RowEnclosures r = ev.row(b, h, i, p);
          pend.clear();
          bool all = true;
          auto add = [&](GoldenBuffer* buf, std::int64_t idx, const Enclosure& e) {
            pend.push_back({buf, idx, round_enclosure(e.lo, e.hi, buf->dtype)});
            all = all && pend.back().r.decided;
            return pend.back().r.value;
          };
          const std::int64_t obase = mha ? (b * Nq + i) * width : ((b * H + h) * Nq + i) * width;
          for (std::int64_t e = 0; e < width; ++e) {
            const Enclosure& enc = r.out[static_cast<std::size_t>(e)];
            add(bufs.out.get(), obase + e, enc);
            const double ref = add(bufs.out_ref.get(), obase + e, enc);
            if (bufs.out_ref_lo) {  // the exact value minus out.ref, enclosed
              Enclosure d(p);
              mpfr_sub_d(d.lo, enc.lo, ref, MPFR_RNDD);
              mpfr_sub_d(d.hi, enc.hi, ref, MPFR_RNDU);
              add(bufs.out_ref_lo.get(), obase + e, d);
            }
          }
          for (std::size_t hh = 0; hh < r.lse.size(); ++hh) {
            const std::int64_t head = mha ? static_cast<std::int64_t>(hh) : h;
            const std::int64_t rbase = (b * H + head) * Nq + i;
            if (c.want_lse) {
              add(bufs.lse.get(), rbase, r.lse[hh]);
              add(bufs.lse_ref.get(), rbase, r.lse[hh]);
            }
            if (c.want_weights)
              for (std::int64_t j = 0; j < Nk; ++j) {
                add(bufs.weights.get(), rbase * Nk + j, r.weights[hh][static_cast<std::size_t>(j)]);
                add(bufs.weights_ref.get(), rbase * Nk + j,
                    r.weights[hh][static_cast<std::size_t>(j)]);
              }
          }
          // out.bound: the exact bound rounded up, decided the same way (at the cap, the upper
          // end rounded up: still an upper bound).
          std::vector<double> bounds(static_cast<std::size_t>(width));
          for (std::int64_t e = 0; e < width; ++e) {
            const Enclosure& bd = r.bound[static_cast<std::size_t>(e)];
            const double blo = mpfr_get_d(bd.lo, MPFR_RNDU), bhi = mpfr_get_d(bd.hi, MPFR_RNDU);
            all = all && blo == bhi;
            bounds[static_cast<std::size_t>(e)] = bhi == 0 ? 0.0 : bhi;  // a zero bound is +0
          }
          if (!all && p < cap) continue;
          if (opt.row_check) opt.row_check(b, h, i, r);
          // Commit: every element is proven, or the cap is reached and the rest is recorded.
          if (p > p0) n_raised.fetch_add(1);
          mpfr_prec_t cur = max_reached.load();
          while (p > cur && !max_reached.compare_exchange_weak(cur, p)) {
          }
          std::uint64_t und = 0;
          for (const Pending& x : pend) {
            x.buf->set(x.idx, x.r.value);
            if (!x.r.decided) {
              ++und;
              std::lock_guard<std::mutex> lk(x.buf->mu);
              x.buf->undecided.emplace_back(x.idx, x.r.alt);
            }
          }
          n_elements.fetch_add(pend.size());
          n_undecided.fetch_add(und);
          for (std::int64_t e = 0; e < width; ++e)
            bufs.out_bound->set(obase + e, bounds[static_cast<std::size_t>(e)]);
          if (fast_setup.applies && !mha) n_fallback.fetch_add(1);
          for (std::size_t hh = 0; hh < r.head_valid.size(); ++hh) {
            const std::int64_t head = mha ? static_cast<std::int64_t>(hh) : h;
            bufs.row_valid[static_cast<std::size_t>((b * H + head) * Nq + i)] =
                r.head_valid[hh] ? 1 : 0;
          }
          break;
        }
      } catch (...) {
        std::lock_guard<std::mutex> lk(err_mu);
        if (u < err_unit) {  // report the first failing row, whatever the thread count
          err_unit = u;
          err = std::current_exception();
        }
        stop = true;
      }
    }
    mpfr_free_cache();
  };

  const int nthreads = std::max(1, std::min<int>(opt.threads, static_cast<int>(std::max<std::int64_t>(units, 1))));
  if (nthreads == 1) {
    work();
  } else {
    std::vector<std::thread> pool;
    for (int t = 0; t < nthreads; ++t) pool.emplace_back(work);
    for (auto& t : pool) t.join();
  }
  if (err) std::rethrow_exception(err);

  EvalResult res;
  auto finish = [&](std::unique_ptr<GoldenBuffer>& g) {
    if (!g) return;
    std::vector<std::pair<std::int64_t, double>> und = std::move(g->undecided);
    std::sort(und.begin(), und.end());
    if (!und.empty()) {
      RawTensor idx{g->name + ".undecided", DType::I64, {static_cast<std::int64_t>(und.size())}, {}};
      RawTensor alt{g->name + ".alt", g->dtype, {static_cast<std::int64_t>(und.size())}, {}};
      idx.data.resize(und.size() * 8);
      alt.data.resize(und.size() * dtype_size(g->dtype));
      for (std::size_t k = 0; k < und.size(); ++k) {
        std::memcpy(idx.data.data() + 8 * k, &und[k].first, 8);
        encode_float(g->dtype, und[k].second, alt.data.data() + k * dtype_size(g->dtype));
      }
      res.golden.push_back(std::move(idx));
      res.golden.push_back(std::move(alt));
    }
    res.golden.push_back(g->take());
  };
  finish(bufs.out);
  finish(bufs.out_ref);
  finish(bufs.out_ref_lo);
  finish(bufs.out_bound);
  finish(bufs.weights);
  finish(bufs.weights_ref);
  finish(bufs.lse);
  finish(bufs.lse_ref);
  res.golden.push_back(RawTensor{"row.valid", DType::BOOL, row_shape, std::move(bufs.row_valid)});

  res.stats.elements = n_elements.load();
  res.stats.undecided = n_undecided.load();
  res.stats.rows = static_cast<std::uint64_t>(units);
  res.stats.rows_raised = n_raised.load();
  res.stats.rows_fast = n_fast.load();
  res.stats.rows_fallback = n_fallback.load();
  res.stats.fast_path_note = opt.fast_path ? (fast_setup.applies ? "" : fast_setup.why_not) : "off";
  res.stats.max_precision_reached = max_reached.load();
  res.stats.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return res;
}

void write_golden_file(const std::string& path, const Case& c, const EvalResult& r) {
  std::map<std::string, std::string> md = c.file.metadata;
  md["attn.reference"] = std::string(kNameAndVersion);
  md["attn.undecided"] = std::to_string(r.stats.undecided);
  std::vector<const RawTensor*> tensors;
  for (const RawTensor& t : r.golden) tensors.push_back(&t);
  for (const RawTensor& t : c.file.tensors)  // inputs, unless a golden tensor replaces one
    if (std::none_of(r.golden.begin(), r.golden.end(), [&](const RawTensor& g) { return g.name == t.name; }))
      tensors.push_back(&t);
  write_safetensors_atomic(path, md, std::move(tensors));
}

SafeTensorsFile golden_file(const Case& c, const EvalResult& r) {
  SafeTensorsFile f = c.file;
  for (const RawTensor& t : r.golden) f.put(t);
  f.metadata["attn.reference"] = std::string(kNameAndVersion);
  f.metadata["attn.undecided"] = std::to_string(r.stats.undecided);
  return f;
}

}  // namespace attnoracle
