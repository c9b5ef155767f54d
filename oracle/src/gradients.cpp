// The invariants of the gradients, on the reference's enclosures of every gradient element:
// exact zeros where nothing contributes (dq, dk, dv; for kind mha dx_q and dx_kv), and the rows of dbias summing to 0 (with sinks: dbias
// and dsinks summing to 0 together).
#include <mutex>

#include "attnoracle/oracle/oracle.hpp"

namespace attnoracle::oracle {

GradientChecks::GradientChecks(const Case& c) : c_(c) {
  // Keys no query (other than padding) of any head of their kv head may attend.
  seen_.assign(static_cast<std::size_t>(c.B * c.Hkv * c.Nk), 0);
  head_has_key_.assign(static_cast<std::size_t>(c.Hq), 0);
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t h = 0; h < c.Hq; ++h)
      for (std::int64_t i = 0; i < c.Nq; ++i) {
        if (!c.query_valid(b, i)) continue;
        const Case::KeyRange r = c.key_range(b, i);
        for (std::int64_t j = r.first; j <= r.last; ++j)
          if (c.allowed(b, h, i, j)) {
            seen_[static_cast<std::size_t>((b * c.Hkv + c.kv_head(h)) * c.Nk + j)] = 1;
            head_has_key_[static_cast<std::size_t>(h)] = 1;
          }
      }
  if (c.want_dbias) dbias_.resize(static_cast<std::size_t>(c.bias->values.size()));
  if (c.want_dsinks) dsinks_.resize(static_cast<std::size_t>(c.Hq));
}

void GradientChecks::element(const std::string& tensor, std::int64_t flat, const Enclosure& value) {
  const bool zero = mpfr_zero_p(value.lo) && mpfr_zero_p(value.hi);
  auto fail = [&](std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j, std::int64_t cc,
                  const std::string& what) {
    throw InvariantViolation({Violation{Invariant::GradientZero, b, h, i, j, cc, tensor + ": " + what}});
  };
  if (tensor == "dq") {
    const std::int64_t row = flat / c_.Dk, cc = flat % c_.Dk;
    const std::int64_t b = row / (c_.Hq * c_.Nq), h = row / c_.Nq % c_.Hq, i = row % c_.Nq;
    if (!zero && (!c_.query_valid(b, i) || !c_.row_has_key(b, h, i)))
      fail(b, h, i, -1, cc, "a padding or fully masked row has a gradient other than exactly 0");
  } else if (tensor == "dk" || tensor == "dv") {
    const std::int64_t width = tensor == "dk" ? c_.Dk : c_.Dv;
    const std::int64_t key = flat / width, cc = flat % width;
    if (!zero && !seen_[static_cast<std::size_t>(key)])
      fail(key / (c_.Hkv * c_.Nk), key / c_.Nk % c_.Hkv, -1, key % c_.Nk, cc,
           "a key no query may see has a gradient other than exactly 0 (h is the kv head)");
  } else if (tensor == "dx_q" && !c_.self_attention) {  // kind mha: dx_q sums dq_h over the heads
    const std::int64_t row = flat / c_.D, b = row / c_.Nq, i = row % c_.Nq;
    bool any = false;
    for (std::int64_t h = 0; h < c_.Hq && !any; ++h) any = c_.query_valid(b, i) && c_.row_has_key(b, h, i);
    if (!zero && !any)
      fail(b, -1, i, -1, flat % c_.D, "a row that is padding or fully masked in every head has a gradient other than exactly 0");
  } else if (tensor == "dx_kv") {  // kind mha: dx_kv sums dk_h and dv_h over the heads
    const std::int64_t key = flat / c_.D, b = key / c_.Nk, j = key % c_.Nk;
    bool any = false;
    for (std::int64_t h = 0; h < c_.Hkv && !any; ++h) any = seen_[static_cast<std::size_t>((b * c_.Hkv + h) * c_.Nk + j)];
    if (!zero && !any) fail(b, -1, -1, j, flat % c_.D, "a key no query of any head may see has a gradient other than exactly 0");
  } else if (tensor == "dbias" || tensor == "dsinks") {
    // A head whose rows have no key (padding, masked, or only the sink: O = 0) has dsinks 0.
    if (tensor == "dsinks" && !zero && !head_has_key_[static_cast<std::size_t>(flat)])
      fail(-1, flat, -1, -1, -1, "a head no row of which has a key has a gradient other than exactly 0");
    std::lock_guard<std::mutex> lk(mu_);
    auto& slot = (tensor == "dbias" ? dbias_ : dsinks_)[static_cast<std::size_t>(flat)];
    slot = std::make_unique<Enclosure>(std::max(mpfr_get_prec(value.lo), mpfr_get_prec(value.hi)));
    mpfr_set(slot->lo, value.lo, MPFR_RNDD);
    mpfr_set(slot->hi, value.hi, MPFR_RNDU);
  }
}

std::vector<Violation> GradientChecks::finish() const {
  std::vector<Violation> v;
  if (!c_.want_dbias) return v;
  if (c_.sinks) return sums_with_sinks();
  // Each row of dS sums to 0 over the keys, so does each row of dbias over its last dimension
  // when the bias has the keys' extent (a bias broadcast along the keys gives dbias = 0).
  const auto& shape = c_.bias->shape;
  if (shape.empty() || shape.back() != c_.Nk || c_.Nk == 1) return v;
  const auto n = static_cast<std::int64_t>(dbias_.size()) / c_.Nk;
  mpfr_t lo, hi;
  mpfr_init2(lo, 64);
  mpfr_init2(hi, 64);
  for (std::int64_t r = 0; r < n; ++r) {
    std::vector<mpfr_ptr> los, his;
    for (std::int64_t j = 0; j < c_.Nk; ++j) {
      const auto& e = dbias_[static_cast<std::size_t>(r * c_.Nk + j)];
      if (!e) continue;
      los.push_back(e->lo);
      his.push_back(e->hi);
    }
    mpfr_sum(lo, los.data(), los.size(), MPFR_RNDD);
    mpfr_sum(hi, his.data(), his.size(), MPFR_RNDU);
    if (mpfr_sgn(lo) > 0 || mpfr_sgn(hi) < 0)
      v.push_back(Violation{Invariant::GradientRowSum, -1, -1, r, -1, -1,
                            "dbias row " + std::to_string(r) + " (flat, over the bias's leading dimensions) sums to [" +
                                std::to_string(mpfr_get_d(lo, MPFR_RNDD)) + ", " +
                                std::to_string(mpfr_get_d(hi, MPFR_RNDU)) + "], not 0"});
  }
  mpfr_clear(lo);
  mpfr_clear(hi);
  return v;
}

// With sinks, a row of dS sums to P_sink_i D_i, the opposite of the row's share of dsinks: the
// dbias elements of a head (of all heads when the bias is broadcast over them) and dsinks of
// those heads sum to 0. Checked when both are asked.
std::vector<Violation> GradientChecks::sums_with_sinks() const {
  std::vector<Violation> v;
  if (!c_.want_dsinks) return v;
  const auto& shape = c_.bias->shape;
  const std::int64_t Eh = shape.size() >= 3 ? shape[shape.size() - 3] : 1;
  // Element flat of dbias lies in head (flat / inner) % Eh, inner = the extents after the head's.
  std::int64_t inner = 1;
  for (std::size_t a = shape.size() >= 2 ? shape.size() - 2 : 0; a < shape.size(); ++a) inner *= shape[a];
  const std::int64_t groups = Eh > 1 ? c_.Hq : 1;
  mpfr_t lo, hi;
  mpfr_init2(lo, 64);
  mpfr_init2(hi, 64);
  for (std::int64_t grp = 0; grp < groups; ++grp) {
    std::vector<mpfr_ptr> los, his;
    for (std::size_t f = 0; f < dbias_.size(); ++f) {
      const auto& e = dbias_[f];
      if (!e || (groups > 1 && static_cast<std::int64_t>(f) / inner % Eh != grp)) continue;
      los.push_back(e->lo);
      his.push_back(e->hi);
    }
    for (std::int64_t h = 0; h < c_.Hq; ++h) {
      const auto& e = dsinks_[static_cast<std::size_t>(h)];
      if (!e || (groups > 1 && h != grp)) continue;
      los.push_back(e->lo);
      his.push_back(e->hi);
    }
    mpfr_sum(lo, los.data(), los.size(), MPFR_RNDD);
    mpfr_sum(hi, his.data(), his.size(), MPFR_RNDU);
    if (mpfr_sgn(lo) > 0 || mpfr_sgn(hi) < 0)
      v.push_back(Violation{Invariant::GradientRowSum, -1, groups > 1 ? grp : -1, -1, -1, -1,
                            "dbias and dsinks" + std::string(groups > 1 ? " of head " + std::to_string(grp) : "") +
                                " sum to [" + std::to_string(mpfr_get_d(lo, MPFR_RNDD)) + ", " +
                                std::to_string(mpfr_get_d(hi, MPFR_RNDU)) + "], not 0"});
  }
  mpfr_clear(lo);
  mpfr_clear(hi);
  return v;
}

}  // namespace attnoracle::oracle
