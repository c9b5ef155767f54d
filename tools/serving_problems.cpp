// Serving problems for `attnoracle invariants --shapes serving`; each option cycles with k so
// that a few problems cover page sizes, layouts, page orders, sequence kinds and group sizes.
#include "serving_problems.hpp"

#include <algorithm>
#include <iterator>
#include <utility>

namespace attnoracle::cli {

vectors::ProblemSpec serving_problem(int k, DType dtype, const conformance::Profile& profile,
                                     const std::function<std::int64_t(std::int64_t, std::int64_t)>& draw) {
  using vectors::ProblemSpec;
  const auto n = static_cast<std::size_t>(k);
  vectors::ProblemSpec p;
  p.kind = Kind::Sdpa;
  p.dtype = dtype;
  // page sizes of serving systems (1: token-level), with 1 to 40, 8, 4 and 4 pages a row
  static constexpr std::pair<std::int64_t, std::int64_t> kPages[] = {{16, 8}, {1, 40}, {64, 4}, {48, 4}};
  const auto [page, most] = kPages[n % std::size(kPages)];
  p.page_size = page;
  p.Nk = page * draw(1, most);
  p.kv_layout_hnd = (k / 2) % 2 == 1;
  static constexpr ProblemSpec::Pages kOrders[] = {ProblemSpec::Pages::Shuffled, ProblemSpec::Pages::Shared,
                                                   ProblemSpec::Pages::Ordered};
  p.pages = kOrders[(n + n / 3) % std::size(kOrders)];
  // decode (Nq = 1), chunked prefill, and varlen prefill; batch 0 full, batch 1 at most two
  // keys, the others random lengths: last pages partly filled
  static constexpr vectors::SeqlensKind kSeqlens[] = {vectors::SeqlensKind::Decode, vectors::SeqlensKind::Chunked,
                                                      vectors::SeqlensKind::Varlen};
  p.seqlens = kSeqlens[n % std::size(kSeqlens)];
  p.Nq = p.seqlens == vectors::SeqlensKind::Decode ? 1 : std::min<std::int64_t>(draw(2, 16), p.Nk);
  if (p.Nq < 1) p.Nq = 1;
  p.B = draw(2, 4);
  static constexpr std::int64_t kGroups[] = {1, 2, 3, 4, 5, 6, 7, 8};
  p.Hkv = draw(1, 2);
  p.Hq = p.Hkv * kGroups[n % std::size(kGroups)];
  static constexpr std::int64_t kDims[] = {64, 128, 96, 256};
  p.Dk = p.Dv = kDims[(n / 2) % std::size(kDims)];
  static constexpr Causal kCausal[] = {Causal::BottomRight, Causal::BottomRight, Causal::None, Causal::TopLeft};
  p.causal = kCausal[n % std::size(kCausal)];
  if (k % 5 == 4) p.window = std::make_pair(draw(0, 40), p.causal == Causal::None ? draw(0, 8) : std::int64_t{0});
  if (k % 4 == 1) p.sinks = "near";
  if (k % 6 == 3 && p.seqlens == vectors::SeqlensKind::Decode) p.softcap = "5";
  p.poison = k % 2 == 1;  // NaN in the unused slots and the spare page
  // every other problem split into kv splits (a kernel without splits ignores the size)
  static constexpr std::int64_t kSplits[] = {16, 64, 24, 128};
  if (k % 2 == 0) p.kv_split_size = kSplits[(n / 2) % std::size(kSplits)];
  p.want_out_partial = p.want_lse_partial = p.kv_split_size > 0 && profile.partials.has_value();
  p.masked_rows = MaskedRows::Zero;
  p.want_weights = profile.returns_weights;
  p.want_lse = profile.returns_lse;
  p.generator = "normal";
  return p;
}

}  // namespace attnoracle::cli
