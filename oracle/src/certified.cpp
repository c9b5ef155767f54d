// The oracle over a whole case, and the reference with the oracle wired in.
#include <optional>

#include "attnoracle/oracle/oracle.hpp"
#include "attnoracle/reference/detail/progress.hpp"
#include "attnoracle/reference/parallel.hpp"
#include "attnoracle/reference/split_kv.hpp"

namespace attnoracle::oracle {

namespace {

class ReferenceRows : public RowSource {
 public:
  ReferenceRows(const Case& c, mpfr_prec_t p) : ev_(c), p_(p) {}
  RowEnclosures row(std::int64_t b, std::int64_t h, std::int64_t i) override {
    return ev_.row(b, h, i, p_);
  }

 private:
  RowEvaluator ev_;
  mpfr_prec_t p_;
};

class TieredRows : public RowSource {
 public:
  TieredRows(const Case& c, mpfr_prec_t p, RowParts parts) : ev_(c, parts), p_(p) {}
  RowEnclosures row(std::int64_t b, std::int64_t h, std::int64_t i) override {
    return ev_.row(b, h, i, p_);
  }

 private:
  TieredRowEvaluator ev_;
  mpfr_prec_t p_;
};

}  // namespace

RowSourceFactory reference_rows(mpfr_prec_t p) {
  return [p](const Case& c) { return std::make_unique<ReferenceRows>(c, p); };
}

RowSourceFactory tiered_rows(mpfr_prec_t p) {
  return [p](const Case& c) { return std::make_unique<TieredRows>(c, p, RowParts::All); };
}

std::int64_t unit_count(const Case& c) {
  return c.kind == Kind::Mha ? c.B * c.Nq : c.B * c.Hq * c.Nq;
}

void unit_position(const Case& c, std::int64_t u, std::int64_t& b, std::int64_t& h,
                   std::int64_t& i) {
  if (c.kind == Kind::Mha) {
    b = u / c.Nq, h = 0, i = u % c.Nq;
  } else {
    b = u / (c.Hq * c.Nq), h = (u / c.Nq) % c.Hq, i = u % c.Nq;
  }
}

std::vector<std::int64_t> sample_units(std::int64_t units, std::int64_t n) {
  std::vector<std::int64_t> s;
  if (units <= 0 || n <= 0) return s;
  if (units <= n) {
    for (std::int64_t u = 0; u < units; ++u) s.push_back(u);
    return s;
  }
  for (std::int64_t k = 0; k < n; ++k) {
    const std::int64_t u = n == 1 ? 0 : k * (units - 1) / (n - 1);
    if (s.empty() || s.back() != u) s.push_back(u);
  }
  return s;
}

std::vector<Violation> check_case(const Case& c, const RowSourceFactory& rows,
                                  const CheckOptions& opt) {
  std::vector<Violation> all;
  auto src = rows(c);
  const std::int64_t units = unit_count(c);
  TwinBuffers buffers;
  for (std::int64_t u = 0; u < units; ++u) {
    std::int64_t b, h, i;
    unit_position(c, u, b, h, i);
    try {
      auto v = check_row(c, b, h, i, src->row(b, h, i));
      all.insert(all.end(), v.begin(), v.end());
    } catch (const FullyMaskedRow&) {
      // the refusal that policy `error` asks for
    }
  }
  const std::optional<Case> plain = c.dropout ? std::optional<Case>(without_dropout(c)) : std::nullopt;
  for (std::int64_t u : sample_units(units, opt.twin_units)) {
    std::int64_t b, h, i;
    unit_position(c, u, b, h, i);
    auto v = check_twins(plain ? *plain : c, b, h, i, rows, &buffers);
    all.insert(all.end(), v.begin(), v.end());
    if (plain) {
      v = check_dropout(c, *plain, b, h, i, opt.twin_precision);
      all.insert(all.end(), v.begin(), v.end());
    }
  }
  return all;
}

EvalResult certified_evaluate(const Case& c, const EvalOptions& eval, const CheckOptions& check) {
  if (auto v = check_paged(c); !v.empty()) throw InvariantViolation(std::move(v));
  if (auto v = check_stored_kv(c); !v.empty()) throw InvariantViolation(std::move(v));
  if (c.kind == Kind::Merge) {  // the sdpa case of the merge, under every check of sdpa
    const Case inner = merge_sdpa_case(c);
    try {
      return merge_result(c, certified_evaluate(inner, eval, check));
    } catch (const FullyMaskedRow& e) {
      throw merge_row(c, e);
    }
  }
  EvalOptions opt = eval;
  if (c.wants_partials())  // each split's rows under the row checks of its own case
    opt.split_options = [](const Case& t, EvalOptions& o) {
      o.row_check = [&t](std::int64_t b, std::int64_t h, std::int64_t i, const RowEnclosures& r) {
        auto v = check_row(t, b, h, i, r);
        if (!v.empty()) throw InvariantViolation(std::move(v));
      };
      o.row_check_fast = [&t](std::int64_t b, std::int64_t h, std::int64_t i, const RowIntervals& r) {
        auto v = check_row_fast(t, b, h, i, r);
        if (!v.empty()) throw InvariantViolation(std::move(v));
      };
    };
  auto outer = eval.row_check;
  opt.row_check = [&c, outer](std::int64_t b, std::int64_t h, std::int64_t i,
                              const RowEnclosures& r) {
    if (outer) outer(b, h, i, r);
    auto v = check_row(c, b, h, i, r);
    if (!v.empty()) throw InvariantViolation(std::move(v));
  };
  const KeyGroups groups = c.kind == Kind::Sdpa ? key_groups(c) : KeyGroups{};
  opt.row_check_fast = [&c, &groups](std::int64_t b, std::int64_t h, std::int64_t i, const RowIntervals& r) {
    auto v = check_row_fast(c, b, h, i, r, &groups);
    if (!v.empty()) throw InvariantViolation(std::move(v));
  };
  std::unique_ptr<GradientChecks> grads;
  if (c.wants_gradients()) {
    grads = std::make_unique<GradientChecks>(c);
    auto outer_g = eval.gradient_check;
    opt.gradient_check = [&grads, outer_g](const std::string& t, std::int64_t flat, const Enclosure& v,
                                           const Enclosure& bd) {
      if (outer_g) outer_g(t, flat, v, bd);
      grads->element(t, flat, v);
    };
  }
  EvalResult res = evaluate(c, opt);
  if (grads)
    if (auto v = grads->finish(); !v.empty()) throw InvariantViolation(std::move(v));
  if (c.wants_partials())
    if (auto v = check_partials(c, res); !v.empty()) throw InvariantViolation(std::move(v));

  // The twin checks, spread over the same number of threads, on eval's tiers. Why they stay as
  // strict: a fast row is used only where its balls decide every rounding of out, weights and
  // lse, so a relation is checked at least at the resolution that fixes the golden bytes; and
  // each ball holds its exact value, so disjoint balls prove the exact values differ: every
  // violation found on them is one of the exact values too, as on MPFR enclosures.
  const std::vector<std::int64_t> units = sample_units(unit_count(c), check.twin_units);
  // The twins compare out, weights and lse only: their fast rows carry just those parts.
  const mpfr_prec_t tp = check.twin_precision;
  const RowSourceFactory rows = [tp](const Case& t) {
    return std::make_unique<TieredRows>(t, tp, RowParts::Compared);
  };
  // A dropout case's twins are those of the case without dropout, which check_dropout ties to it.
  const std::optional<Case> plain = c.dropout ? std::optional<Case>(without_dropout(c)) : std::nullopt;
  const Case& tc = plain ? *plain : c;
  const TieredRowEvaluator whole(tc, RowParts::Compared);  // the units' own rows, on the case itself
  std::vector<std::vector<Violation>> found(units.size());
  TwinBuffers buffers;
  // Each thread holds one twin at a time: for kind sdpa, the keys and values of up to two kv
  // heads in F64 (a unit's slice); for mha, a copy of the case. Above 16 MB per twin, one thread
  // keeps the peak memory near that of the evaluation itself.
  std::size_t twin_bytes = 0;
  if (c.kind == Kind::Mha) {
    for (const FloatTensor* t : {&c.x_q, &c.x_kv, &c.w_q, &c.w_k, &c.w_v, &c.w_o})
      twin_bytes += t->values.size() * sizeof(double);
  } else {
    twin_bytes = 2 * static_cast<std::size_t>(c.Nk * (c.Dk + c.Dv)) * sizeof(double);
  }
  const bool one = twin_bytes > (16u << 20);
  detail::PassProgress twins_done(eval, "oracle rows", units.size());
  parallel_for(units.size(), one ? 1 : eval.threads, [&](std::size_t k) {
    std::int64_t b, h, i;
    unit_position(c, units[k], b, h, i);
    RowEnclosures base;
    try {
      base = whole.row(b, h, i, check.twin_precision);
    } catch (const FullyMaskedRow&) {
      twins_done.unit_done();
      return;  // refused: the policy, checked elsewhere
    }
    found[k] = check_twins(tc, b, h, i, rows, std::move(base), &buffers);
    if (plain) {
      auto d = check_dropout(c, *plain, b, h, i, check.twin_precision);
      found[k].insert(found[k].end(), d.begin(), d.end());
    }
    twins_done.unit_done();
  });
  std::vector<Violation> all;
  for (auto& f : found) all.insert(all.end(), f.begin(), f.end());

  // The gradient twins, on a sample of (batch, kv head) slices, by the same evaluation.
  if (c.wants_gradients()) {
    EvalOptions twin;
    twin.threads = eval.threads;
    twin.start_precision = eval.start_precision;
    twin.max_precision = eval.max_precision;
    twin.fast_path = eval.fast_path;
    int evaluations = 0;  // the twin evaluations so far, to name each one's passes
    for (std::int64_t s : sample_units(c.B * c.Hkv, check.gradient_twin_slices)) {
      auto v = check_gradient_twins(c, res, s / c.Hkv, s % c.Hkv, [&](const Case& t) {
        if (eval.progress) {
          const std::string of = " of oracle twin " + std::to_string(++evaluations);
          twin.progress = [&eval, of](const std::string& unit, std::uint64_t done, std::uint64_t total) {
            eval.progress(unit + of, done, total);
          };
        }
        return evaluate(t, twin);
      });
      all.insert(all.end(), v.begin(), v.end());
    }
  }
  if (!all.empty()) throw InvariantViolation(std::move(all));
  return res;
}

}  // namespace attnoracle::oracle
