// Rows evaluated again, on the same tiers as eval: the fast path first, MPFR for what it cannot
// decide. Without a transposed copy of the keys: the oracle's twins evaluate one row of each
// case, where that copy would cost as much memory as the keys and as much time as the row.
#include "attnoracle/reference/detail/row_evaluator.hpp"
#include "fast/decide.hpp"
#include "fast/fast_row.hpp"

namespace attnoracle {

struct TieredRowEvaluator::Impl {
  const Case& c;
  const fast::Setup fast;
  const RowEvaluator mpfr;
  const RowParts parts;
  Impl(const Case& cs, RowParts p) : c(cs), fast(fast::prepare(cs, false)), mpfr(cs), parts(p) {}
};

TieredRowEvaluator::TieredRowEvaluator(const Case& c, RowParts parts) : impl_(new Impl(c, parts)) {}
TieredRowEvaluator::~TieredRowEvaluator() { delete impl_; }

RowEnclosures TieredRowEvaluator::row(std::int64_t b, std::int64_t h, std::int64_t i,
                                      mpfr_prec_t p) const {
  if (impl_->fast.applies) {
    const fast::FastRow fr = fast::fast_row(impl_->c, impl_->fast, b, h, i);
    if (fr.ok) {
      const Enclosure lse = fast::lse_enclosure(fr);
      fast::DecidedRow d;
      if (fast::decide_row(impl_->c, fr, lse, d, true, true)) return fast::row_enclosures(fr, lse, impl_->parts);
    }
  }
  return impl_->mpfr.row(b, h, i, p);
}

}  // namespace attnoracle
