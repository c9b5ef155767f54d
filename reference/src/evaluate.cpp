// The Ziv driver: evaluates every row unit at rising precision until every golden element of
// the row is proven correctly rounded (or the cap is reached), across threads.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string_view>

#include "attnoracle/reference/detail/progress.hpp"
#include "attnoracle/reference/detail/row_evaluator.hpp"
#include "attnoracle/reference/evaluate.hpp"
#include "attnoracle/reference/parallel.hpp"
#include "attnoracle/reference/round.hpp"
#include "attnoracle/reference/scaled_output.hpp"
#include "attnoracle/version.hpp"
#include "fast/decide.hpp"
#include "fast/fast_row.hpp"
#include "golden_buffer.hpp"
#include "amax.hpp"
#include "backward.hpp"
#include "attnoracle/reference/split_kv.hpp"

namespace attnoracle {
namespace {

using detail::GoldenBuffer;
using detail::Pending;

// The golden tensors of Case::golden_tensors(), in its order; row.valid apart.
struct Buffers {
  std::vector<std::unique_ptr<GoldenBuffer>> rounded;
  GoldenBuffer *out = nullptr, *out_ref = nullptr, *out_ref_lo = nullptr, *out_bound = nullptr,
               *weights = nullptr, *weights_ref = nullptr, *lse = nullptr, *lse_ref = nullptr,
               *scores = nullptr, *scores_ref = nullptr, *amax = nullptr;
  GoldenSpec row_valid_spec;
  std::vector<unsigned char> row_valid;

  explicit Buffers(const Case& c) {
    for (const GoldenSpec& g : c.golden_tensors()) {
      if (is_gradient_golden(g.name)) continue;  // filled by the backward evaluation
      if (is_partial_golden(g.name)) continue;   // filled split by split (split_kv.cpp)
      if (g.name == "row.valid") {
        row_valid_spec = g;
        row_valid.assign(static_cast<std::size_t>(c.B * c.Hq * c.Nq), 0);
        continue;
      }
      rounded.push_back(std::make_unique<GoldenBuffer>(g));
      GoldenBuffer* b = rounded.back().get();
      for (auto [name, slot] : {std::pair{"out", &out}, {"out.ref", &out_ref},
                                {"out.ref_lo", &out_ref_lo}, {"out.bound", &out_bound},
                                {"weights", &weights}, {"weights.ref", &weights_ref},
                                {"lse", &lse}, {"lse.ref", &lse_ref}, {"scores", &scores},
                                {"scores.ref", &scores_ref}, {"amax", &amax}})
        if (g.name == name) *slot = b;
    }
  }
};

// Working precision to start from: enough for the .ref tensors (F64), with room for the
// rounding errors of sums over Nk and Dk terms; F64 outputs also need out.ref_lo, which is
// about 53 bits further down.
mpfr_prec_t start_precision(const Case& c) {
  auto lg = [](std::int64_t n) { return static_cast<mpfr_prec_t>(std::ceil(std::log2(static_cast<double>(n) + 1.0))); };
  mpfr_prec_t p = 96 + 2 * lg(c.Nk) + lg(c.Dk) + lg(c.Dv);
  if (c.dtype_of("out") == DType::F64) p += 64;
  return p;
}

// Rows per tile of the fast path: each chunk of a head's keys and values is read once per tile
// (fast_rows), which keeps rows of many thousand keys from streaming them from memory per row.
constexpr std::int64_t kRowTile = 4;

// The counters of EvalStats, shared by the workers.
struct Counters {
  std::atomic<std::uint64_t> elements{0}, undecided{0}, raised{0}, fast{0}, fallback{0};
  std::atomic<mpfr_prec_t> max_reached{0};
  void reached(mpfr_prec_t p) {
    mpfr_prec_t cur = max_reached.load();
    while (p > cur && !max_reached.compare_exchange_weak(cur, p)) {
    }
  }
};

// One evaluation: the buffers, the kernels, and the steps of a row unit.
class Driver {
 public:
  Driver(const Case& c, const EvalOptions& opt)
      : c_(c), opt_(opt), mha_(c.kind == Kind::Mha), width_(mha_ ? c.Dout : c.Dv), bufs_(c),
        ev_(c), p0_(opt.start_precision > 0 ? opt.start_precision : start_precision(c)),
        cap_(std::max(opt.max_precision, p0_)),
        fast_(opt.fast_path ? fast::prepare(c) : fast::Setup{}) {
    if (c.want_amax) abs_lo_.assign(static_cast<std::size_t>(units() * width_), 0.0), abs_hi_ = abs_lo_;
  }

  std::int64_t units() const { return mha_ ? c_.B * c_.Nq : c_.B * c_.Hq * c_.Nq; }
  // Tiles of consecutive rows of one head (one row unit each for kind mha), in unit order.
  std::int64_t tiles() const { return mha_ ? units() : c_.B * c_.Hq * tiles_per_head(); }
  // The tile's rows one after the other; done(row) after each. Returns nothing: the rows'
  // results go to the buffers.
  template <class Done>
  void run_tile(std::int64_t t, Done&& done);
  EvalResult finish(double seconds);

 private:
  std::int64_t out_base(std::int64_t b, std::int64_t h, std::int64_t i) const {
    return (mha_ ? b * c_.Nq + i : (b * c_.Hq + h) * c_.Nq + i) * width_;
  }
  std::int64_t row_base(std::int64_t b, std::int64_t h, std::int64_t i) const {
    return (b * c_.Hq + h) * c_.Nq + i;
  }
  std::int64_t tiles_per_head() const { return (c_.Nq + kRowTile - 1) / kRowTile; }
  bool commit_fast(const fast::FastRow& fr, std::int64_t b, std::int64_t h, std::int64_t i);
  void evaluate_mpfr(std::int64_t b, std::int64_t h, std::int64_t i);
  bool round_row(const RowEnclosures& r, std::int64_t b, std::int64_t h, std::int64_t i,
                 mpfr_prec_t p, std::vector<Pending>& pend, std::vector<double>& bounds) const;
  void commit_row(const RowEnclosures& r, std::int64_t b, std::int64_t h, std::int64_t i,
                  mpfr_prec_t p, const std::vector<Pending>& pend, const std::vector<double>& bounds);
  void take(std::unique_ptr<GoldenBuffer>& g, EvalResult& res) const;
  void record_magnitude(std::int64_t base, std::int64_t e, double lo, double hi);
  void finish_amax();

  const Case& c_;
  const EvalOptions& opt_;
  const bool mha_;
  const std::int64_t width_;
  Buffers bufs_;
  RowEvaluator ev_;
  const mpfr_prec_t p0_, cap_;
  const fast::Setup fast_;
  Counters n_;
  std::vector<double> abs_lo_, abs_hi_;  // bounds of every |O_e| (amax asked)
};

void Driver::record_magnitude(std::int64_t base, std::int64_t e, double lo, double hi) {
  const auto at = static_cast<std::size_t>(base + e);
  detail::magnitude(lo, hi, abs_lo_[at], abs_hi_[at]);
}

// amax from the rows' bounds, the candidate rows evaluated again by MPFR where needed.
void Driver::finish_amax() {
  const auto out_at = [&](std::int64_t row, mpfr_prec_t p) {
    const std::int64_t i = row % c_.Nq, bh = row / c_.Nq;
    return ev_.row(bh / c_.Hq, bh % c_.Hq, i, p).out;
  };
  const detail::AmaxResult a = detail::decide_amax(abs_lo_, abs_hi_, width_, out_at, p0_, cap_);
  n_.reached(a.precision);
  bufs_.amax->set(0, a.r.value);
  n_.elements.fetch_add(1);
  if (!a.r.decided) {
    n_.undecided.fetch_add(1);
    bufs_.amax->undecided.emplace_back(0, a.r.alt);
  }
}

template <class Done>
void Driver::run_tile(std::int64_t t, Done&& done) {
  if (mha_) {  // a tile is a unit: row i of batch b, MPFR (no fast path for mha)
    evaluate_mpfr(t / c_.Nq, 0, t % c_.Nq);
    done();
    return;
  }
  const std::int64_t bh = t / tiles_per_head(), i0 = (t % tiles_per_head()) * kRowTile;
  const std::int64_t n = std::min(kRowTile, c_.Nq - i0), b = bh / c_.Hq, h = bh % c_.Hq;
  if (!fast_.applies) {
    for (std::int64_t k = 0; k < n; ++k) {
      evaluate_mpfr(b, h, i0 + k);
      done();
    }
    return;
  }
  std::vector<fast::FastRow> frs = fast::fast_rows(c_, fast_, b, h, i0, n);
  for (std::int64_t k = 0; k < n; ++k) {
    fast::FastRow& fr = frs[static_cast<std::size_t>(k)];
    if (fr.ok && commit_fast(fr, b, h, i0 + k)) n_.fast.fetch_add(1);
    else evaluate_mpfr(b, h, i0 + k);
    fr = fast::FastRow{};  // its memory back before the next row's
    done();
  }
}

// A row of the fast path written to the buffers, when every element is decided.
bool Driver::commit_fast(const fast::FastRow& fr, std::int64_t b, std::int64_t h, std::int64_t i) {
  const Enclosure lse = fast::lse_enclosure(fr);
  fast::DecidedRow d;
  if (!fast::decide_row(c_, fr, lse, d)) return false;
  if (opt_.row_check_fast) opt_.row_check_fast(b, h, i, fast::row_intervals(fr, lse));
  else if (opt_.row_check) opt_.row_check(b, h, i, fast::row_enclosures(fr, lse));
  const std::int64_t obase = out_base(b, h, i), rbase = row_base(b, h, i);
  bufs_.out->set_all(obase, d.out);
  bufs_.out_ref->set_all(obase, d.out_ref);
  if (bufs_.out_ref_lo) bufs_.out_ref_lo->set_all(obase, d.out_ref_lo);
  if (c_.want_weights) {
    bufs_.weights->set_all(rbase * c_.Nk, d.weights);
    bufs_.weights_ref->set_all(rbase * c_.Nk, d.weights_ref);
  }
  if (c_.want_lse) {
    bufs_.lse->set_all(rbase, d.lse);
    bufs_.lse_ref->set_all(rbase, d.lse_ref);
  }
  if (c_.want_scores) {
    bufs_.scores->set_all(rbase * c_.Nk, d.scores);
    bufs_.scores_ref->set_all(rbase * c_.Nk, d.scores_ref);
  }
  bufs_.out_bound->set_all(obase, d.bound);
  bufs_.row_valid[static_cast<std::size_t>(rbase)] = 1;
  if (c_.want_amax)
    for (std::size_t e = 0; e < fr.out.size(); ++e) {
      fast::DD lo, hi;
      fast::ends(fr.out[e], lo, hi, fr.vmin[e], fr.vmax[e]);
      record_magnitude(obase, static_cast<std::int64_t>(e), fast::round_down_dd(lo), fast::round_up_dd(hi));
    }
  n_.elements.fetch_add(d.rounded());
  return true;
}

// Ziv's loop: the row at rising precision until every element is decided or the cap is reached.
void Driver::evaluate_mpfr(std::int64_t b, std::int64_t h, std::int64_t i) {
  std::vector<Pending> pend;
  std::vector<double> bounds;
  for (mpfr_prec_t p = p0_;; p = std::min(2 * p, cap_)) {
    RowEnclosures r = ev_.row(b, h, i, p);
    if (!round_row(r, b, h, i, p, pend, bounds) && p < cap_) continue;
    if (opt_.row_check) opt_.row_check(b, h, i, r);
    commit_row(r, b, h, i, p, pend, bounds);
    return;
  }
}

// Every golden element of the row rounded from its enclosure; true when all are decided.
bool Driver::round_row(const RowEnclosures& r, std::int64_t b, std::int64_t h, std::int64_t i,
                       mpfr_prec_t p, std::vector<Pending>& pend,
                       std::vector<double>& bounds) const {
  pend.clear();
  bool all = true;
  auto add = [&](GoldenBuffer* buf, std::int64_t idx, const Enclosure& e) {
    pend.push_back({buf, idx, round_enclosure(e.lo, e.hi, buf->dtype)});
    all = all && pend.back().r.decided;
    return pend.back().r.value;
  };
  const std::int64_t obase = out_base(b, h, i);
  for (std::int64_t e = 0; e < width_; ++e) {
    const Enclosure& enc = r.out[static_cast<std::size_t>(e)];
    pend.push_back({bufs_.out, obase + e, round_out_enclosure(c_, enc.lo, enc.hi)});
    all = all && pend.back().r.decided;
    const double ref = add(bufs_.out_ref, obase + e, enc);
    if (bufs_.out_ref_lo) {  // the exact value minus out.ref, enclosed
      Enclosure d(p);
      mpfr_sub_d(d.lo, enc.lo, ref, MPFR_RNDD);
      mpfr_sub_d(d.hi, enc.hi, ref, MPFR_RNDU);
      add(bufs_.out_ref_lo, obase + e, d);
    }
  }
  for (std::size_t hh = 0; hh < r.lse.size(); ++hh) {
    const std::int64_t rbase = row_base(b, mha_ ? static_cast<std::int64_t>(hh) : h, i);
    if (c_.want_lse) {
      add(bufs_.lse, rbase, r.lse[hh]);
      add(bufs_.lse_ref, rbase, r.lse[hh]);
    }
    if (c_.want_weights)
      for (std::int64_t j = 0; j < c_.Nk; ++j) {
        add(bufs_.weights, rbase * c_.Nk + j, r.weights[hh][static_cast<std::size_t>(j)]);
        add(bufs_.weights_ref, rbase * c_.Nk + j, r.weights[hh][static_cast<std::size_t>(j)]);
      }
    if (c_.want_scores)
      for (std::int64_t j = 0; j < c_.Nk; ++j) {
        add(bufs_.scores, rbase * c_.Nk + j, r.scores[hh][static_cast<std::size_t>(j)]);
        add(bufs_.scores_ref, rbase * c_.Nk + j, r.scores[hh][static_cast<std::size_t>(j)]);
      }
  }
  // out.bound: the exact bound rounded up, decided the same way (at the cap, the upper end
  // rounded up: still an upper bound).
  bounds.assign(static_cast<std::size_t>(width_), 0.0);
  for (std::int64_t e = 0; e < width_; ++e) {
    const Enclosure& bd = r.bound[static_cast<std::size_t>(e)];
    const double blo = mpfr_get_d(bd.lo, MPFR_RNDU), bhi = mpfr_get_d(bd.hi, MPFR_RNDU);
    all = all && blo == bhi;
    bounds[static_cast<std::size_t>(e)] = bhi == 0 ? 0.0 : bhi;  // a zero bound is +0
  }
  return all;
}

// Commit: every element is proven, or the cap is reached and the rest is recorded.
void Driver::commit_row(const RowEnclosures& r, std::int64_t b, std::int64_t h, std::int64_t i,
                        mpfr_prec_t p, const std::vector<Pending>& pend,
                        const std::vector<double>& bounds) {
  if (p > p0_) n_.raised.fetch_add(1);
  n_.reached(p);
  std::uint64_t und = 0;
  for (const Pending& x : pend) {
    x.buf->set(x.idx, x.r.value);
    if (!x.r.decided) {
      ++und;
      std::lock_guard<std::mutex> lk(x.buf->mu);
      x.buf->undecided.emplace_back(x.idx, x.r.alt);
    }
  }
  n_.elements.fetch_add(pend.size());
  n_.undecided.fetch_add(und);
  bufs_.out_bound->set_all(out_base(b, h, i), bounds);
  if (c_.want_amax)
    for (std::int64_t e = 0; e < width_; ++e) {
      const Enclosure& o = r.out[static_cast<std::size_t>(e)];
      record_magnitude(out_base(b, h, i), e, mpfr_get_d(o.lo, MPFR_RNDD), mpfr_get_d(o.hi, MPFR_RNDU));
    }
  if (fast_.applies && !mha_) n_.fallback.fetch_add(1);
  for (std::size_t hh = 0; hh < r.head_valid.size(); ++hh) {
    const std::int64_t head = mha_ ? static_cast<std::int64_t>(hh) : h;
    bufs_.row_valid[static_cast<std::size_t>(row_base(b, head, i))] = r.head_valid[hh] ? 1 : 0;
  }
}

void Driver::take(std::unique_ptr<GoldenBuffer>& g, EvalResult& res) const {
  detail::append_golden(*g, res.golden);
}

// The tensors in the order of Case::golden_tensors() with row.valid last, and the stats.
EvalResult Driver::finish(double seconds) {
  if (c_.want_amax) finish_amax();
  EvalResult res;
  for (auto& g : bufs_.rounded) take(g, res);
  const GoldenSpec& rv = bufs_.row_valid_spec;
  res.golden.push_back(RawTensor{rv.name, rv.dtype, rv.shape, std::move(bufs_.row_valid)});
  res.stats.elements = n_.elements.load();
  res.stats.undecided = n_.undecided.load();
  res.stats.rows = static_cast<std::uint64_t>(units());
  res.stats.rows_raised = n_.raised.load();
  res.stats.rows_fast = n_.fast.load();
  res.stats.rows_fallback = n_.fallback.load();
  res.stats.fast_path_note = opt_.fast_path ? (fast_.applies ? "" : fast_.why_not) : "off";
  res.stats.max_precision_reached = n_.max_reached.load();
  res.stats.seconds = seconds;
  return res;
}

}  // namespace

EvalResult evaluate(const Case& c, const EvalOptions& opt) {
  if (c.kind == Kind::Merge) return evaluate_merge(c, opt);
  if (c.rotary && c.rotary->exact) {  // the same scores through doubles (rotary.hpp); MPFR rows
    EvalOptions o = opt;
    o.fast_path = false;
    return evaluate(exact_rotation_case(c), o);
  }
  const auto t0 = std::chrono::steady_clock::now();
  // Refuse before any work, naming the first fully masked row in (b, h, i) order.
  if (const auto r = c.first_refused_row()) throw FullyMaskedRow(r->b, r->h, r->i);
  EvalResult res;
  {
    Driver d(c, opt);
    // The error of the first failing unit in unit order is reported, whatever the thread count.
    detail::PassProgress done(opt, "rows", static_cast<std::uint64_t>(d.units()));
    parallel_for(static_cast<std::size_t>(d.tiles()), opt.threads, [&](std::size_t t) {
      d.run_tile(static_cast<std::int64_t>(t), [&] { done.unit_done(); });
    });
    mpfr_free_cache();
    res = d.finish(0);
  }
  if (c.wants_gradients()) {
    // The gradients go before row.valid, which stays last.
    RawTensor row_valid = std::move(res.golden.back());
    res.golden.pop_back();
    evaluate_gradients(c, opt, res);
    res.golden.push_back(std::move(row_valid));
  }
  if (c.wants_partials()) {  // after the gradients, before row.valid
    RawTensor row_valid = std::move(res.golden.back());
    res.golden.pop_back();
    evaluate_partials(c, opt, res);
    res.golden.push_back(std::move(row_valid));
  }
  res.stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
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
