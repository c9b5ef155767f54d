// One case's verdict: every compared element within its limit, and unbiased on average.
#include "attnoracle/conformance/compare.hpp"

#include <cmath>
#include <optional>
#include <string>
#include <utility>

#include "attnoracle/conformance/keep_mask.hpp"
#include "attnoracle/reference/dropout.hpp"
#include "comparer.hpp"

namespace attnoracle::conformance {

std::string_view status_name(CaseStatus s) {
  switch (s) {
    case CaseStatus::Pass: return "pass";
    case CaseStatus::Fail: return "fail";
    case CaseStatus::Skip: return "skip";
  }
  return "?";
}

namespace {

// A fully masked row that is not padding: the contract refuses it under policy error.
bool has_refusable_row(const Case& c) {
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t h = 0; h < c.Hq; ++h)
      for (std::int64_t i = 0; i < c.Nq; ++i)
        if (c.query_valid(b, i) && !c.row_has_key(b, h, i)) return true;
  return false;
}

// A keep mask the implementation drew and returned (CONTRACT section 5): checked, and the golden
// file of the case with it in place of the given one; nullopt with `why` when it cannot serve.
std::optional<SafeTensorsFile> golden_with_mask(const Case& c, const SafeTensorsFile& golden, const RawTensor& mask,
                                                std::string& why) {
  const std::vector<std::int64_t> shape{c.B, c.Hq, c.Nq, c.Nk};
  if (mask.dtype != DType::BOOL || mask.shape != shape) {
    why = std::string(kDropoutMaskName) + ": returned as " + std::string(dtype_name(mask.dtype)) + " " +
          shape_string(mask.shape) + ", expected BOOL " + shape_string(shape);
    return std::nullopt;
  }
  if (!case_evaluator()) {
    why = std::string(kDropoutMaskName) + ": returned, but this program has no evaluator for its golden values";
    return std::nullopt;
  }
  SafeTensorsFile f = strip_golden(golden);
  f.put(mask);
  try {
    return case_evaluator()(f);
  } catch (const std::exception& e) {
    why = std::string(kDropoutMaskName) + ": returned, and the case with it is refused: " + e.what();
    return std::nullopt;
  }
}

}  // namespace

using comparing::Comparer;
using comparing::value_of;

bool exact_is_normal(const ElementReport& w) { return std::isfinite(w.expected) && std::fabs(w.expected) >= min_normal(w.dtype); }

CaseReport compare_plain_case(const std::string& id, const SafeTensorsFile& golden, const std::string& expect,
                              const JobResult& result, const Profile& profile, bool pictures) {
  CaseReport rep;
  rep.id = id;
  const Case c = comparing::declared_case(id, golden, profile);
  rep.dtype = c.input_dtype;
  if (!profile.covers(c.input_dtype)) {
    rep.status = CaseStatus::Skip;
    rep.reason = "profile " + profile.name + " does not cover " + std::string(dtype_name(c.input_dtype)) + " inputs";
    return rep;
  }
  const bool refusable = has_refusable_row(c);
  switch (result.outcome) {
    case Outcome::Unsupported:
      rep.status = CaseStatus::Skip;
      rep.reason = "unsupported: " + result.reason;
      return rep;
    case Outcome::Refused:
      if (expect == "error" || (refusable && profile.masked_rows == MaskedRowConvention::Error)) {
        rep.reason = "refused as required: " + result.reason;
        return rep;
      }
      rep.status = CaseStatus::Fail;
      rep.reason = "refused a case it must evaluate: " + result.reason;
      return rep;
    case Outcome::Output:
      break;
    default:
      rep.status = CaseStatus::Fail;
      rep.reason = std::string(outcome_name(result.outcome)) + (result.reason.empty() ? "" : ": " + result.reason);
      return rep;
  }
  if (expect == "error") {
    if (profile.masked_rows == MaskedRowConvention::Error) {
      rep.status = CaseStatus::Fail;
      rep.reason = "evaluated a case with a fully masked row, which must be refused";
      return rep;
    }
    // No golden values: only the declared treatment of the fully masked rows can be checked.
    const RawTensor* out = result.output.find("out");
    const bool mha = c.kind == Kind::Mha;
    if (!out || out->dtype != c.dtype_of("out")) {
      rep.status = CaseStatus::Fail;
      rep.reason = "the result has no out of dtype " + std::string(dtype_name(c.dtype_of("out")));
      return rep;
    }
    const std::int64_t W = mha ? c.Dout : c.Dv;
    std::int64_t checked = 0;
    for (std::int64_t b = 0; b < c.B && !mha; ++b)
      for (std::int64_t h = 0; h < c.Hq; ++h)
        for (std::int64_t i = 0; i < c.Nq; ++i) {
          if (!c.query_valid(b, i) || c.row_has_key(b, h, i)) continue;
          for (std::int64_t e = 0; e < W; ++e) {
            const auto k = static_cast<std::size_t>(((b * c.Hq + h) * c.Nq + i) * W + e);
            if (k >= out->data.size() / dtype_size(out->dtype)) break;
            const double y = value_of(*out, k);
            const bool ok = profile.masked_rows == MaskedRowConvention::Zero ? y == 0
                            : profile.masked_rows == MaskedRowConvention::Nan ? std::isnan(y)
                                                                               : std::isfinite(y);
            ++checked;
            if (!ok) {
              rep.status = CaseStatus::Fail;
              rep.reason = "a fully masked row gives " + std::to_string(y) + ", not what masked_rows=" +
                           std::string(convention_name(profile.masked_rows)) + " declares";
              return rep;
            }
          }
        }
    rep.reason = "no golden values (policy error): " + std::to_string(checked) +
                 " elements of fully masked rows checked against the declared convention";
    return rep;
  }
  // A mask the implementation drew: judged against the golden values of the case with that mask,
  // and tested as a draw of independent keeps of probability 1 - p.
  const RawTensor* drawn = c.dropout ? result.output.find(kDropoutMaskName) : nullptr;
  std::optional<SafeTensorsFile> redone;
  std::optional<Case> with_mask;
  if (drawn) {
    std::string why;
    redone = golden_with_mask(c, golden, *drawn, why);
    if (!redone) {
      rep.status = CaseStatus::Fail;
      rep.reason = why;
      return rep;
    }
    with_mask.emplace(comparing::declared_case(id, *redone, profile));
  }
  const Case& cc = with_mask ? *with_mask : c;
  const SafeTensorsFile& gold = redone ? *redone : golden;
  Comparer cmp{cc, gold, result.output, profile, rep, {}, 0, 0, {}, {}, {}, nullptr};
  std::optional<PictureCollector> collector;
  if (pictures) {
    collector.emplace(cc);
    cmp.pictures = &*collector;
  }
  cmp.run();
  diagnose(cc, gold, result.output, rep);
  if (drawn)
    if (std::string why = keep_mask_verdict(keep_mask_tests(cc, *drawn)); !why.empty()) {
      rep.status = CaseStatus::Fail;
      rep.reason = why + (rep.reason.empty() ? "" : "; " + rep.reason);
    }
  if (collector && rep.status == CaseStatus::Fail) {
    std::int64_t compared[3] = {-1, -1, -1};
    for (const auto& t : rep.tensors)
      compared[t.tensor == "out" ? 0 : t.tensor == "weights" ? 1 : 2] = t.compared;
    rep.pictures = collector->finish(cmp.mags, compared);
  }
  return rep;
}

}  // namespace attnoracle::conformance