// The serving kernels at the gate (CONTRACT section 8): a case of kind merge is judged as its sdpa
// case (the combine is a softmax over the splits), and each split of out_partial and lse_partial
// as the case of that split (its keys alone, no sink, a split without a key 0 with lse -inf).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "attnoracle/conformance/compare.hpp"
#include "attnoracle/reference/merge_case.hpp"
#include "diagnosis_serving.hpp"

namespace attnoracle::conformance {
namespace {

std::int64_t numel(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

// Elements [s n, (s + 1) n) of t (n the size of `shape`) as a tensor `name` of that shape.
RawTensor slice(const RawTensor& t, std::int64_t s, const std::string& name, const std::vector<std::int64_t>& shape) {
  const auto bytes = static_cast<std::size_t>(numel(shape)) * dtype_size(t.dtype);
  const auto at = t.data.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(s) * bytes);
  return RawTensor{name, t.dtype, shape, std::vector<unsigned char>(at, at + static_cast<std::ptrdiff_t>(bytes))};
}

// The .undecided and .alt companions of `from` within split s, as those of `to`.
void slice_undecided(const SafeTensorsFile& g, const std::string& from, const std::string& to, std::int64_t s,
                     std::int64_t n, SafeTensorsFile& out) {
  const RawTensor *idx = g.find(from + ".undecided"), *alt = g.find(from + ".alt");
  if (!idx || !alt) return;
  const std::size_t w = dtype_size(alt->dtype);
  RawTensor i2{to + ".undecided", DType::I64, {0}, {}}, a2{to + ".alt", alt->dtype, {0}, {}};
  for (std::size_t k = 0; k < idx->data.size() / 8; ++k) {
    std::int64_t e;
    std::memcpy(&e, idx->data.data() + 8 * k, 8);
    if (e < s * n || e >= (s + 1) * n) continue;
    e -= s * n;
    const auto* b = reinterpret_cast<const unsigned char*>(&e);
    i2.data.insert(i2.data.end(), b, b + 8);
    a2.data.insert(a2.data.end(), alt->data.begin() + static_cast<std::ptrdiff_t>(k * w),
                   alt->data.begin() + static_cast<std::ptrdiff_t>((k + 1) * w));
    ++i2.shape[0], ++a2.shape[0];
  }
  if (i2.shape[0] == 0) return;
  out.put(std::move(i2));
  out.put(std::move(a2));
}

bool is_shape(const RawTensor* t, DType dtype, const std::vector<std::int64_t>& shape) {
  return t && t->dtype == dtype && t->shape == shape;
}

// Split s of case c (read from `golden`) as a case file: the keys outside the split masked out,
// no sinks, policy zero, asking out (and lse when lse_partial is asked) in the partials' dtypes.
SafeTensorsFile split_inputs(const Case& c, const SafeTensorsFile& golden, std::int64_t s) {
  SafeTensorsFile f = strip_golden(golden);
  std::erase_if(f.tensors, [](const RawTensor& t) { return t.name == "sinks" || t.name == "mask"; });
  f.metadata.erase("attn.kv_split_size");
  f.metadata["attn.masked_rows"] = "zero";
  f.metadata["attn.outputs"] = c.want_lse_partial ? "out,lse" : "out";
  f.metadata["attn.output_dtypes"] = "out:" + std::string(dtype_name(c.dtype_of("out_partial"))) +
                                     (c.want_lse_partial ? ",lse:" + std::string(dtype_name(c.dtype_of("lse_partial"))) : "");
  // The mask (the case's, as read) with its last dimension Nk, false outside the split.
  std::vector<std::int64_t> p = c.mask ? c.mask->shape : std::vector<std::int64_t>{};
  while (p.size() < 4) p.insert(p.begin(), 1);
  const std::vector<std::int64_t> shape = {p[0], p[1], p[2], c.Nk};
  RawTensor m{"mask", DType::BOOL, shape, std::vector<unsigned char>(static_cast<std::size_t>(numel(shape)))};
  const std::int64_t lo = s * c.kv_split_size, hi = std::min(c.Nk, lo + c.kv_split_size);
  for (std::int64_t r = 0; r < p[0] * p[1] * p[2]; ++r)
    for (std::int64_t j = lo; j < hi; ++j)
      m.data[static_cast<std::size_t>(r * c.Nk + j)] =
          !c.mask || c.mask->values[static_cast<std::size_t>(r * p[3] + (p[3] == 1 ? 0 : j))];
  f.put(std::move(m));
  return f;
}

// One split's report folded into the case's: its tensors become out_partial and lse_partial.
void fold(CaseReport& rep, CaseReport sub, std::int64_t s, const Case& c) {
  auto renamed = [](const std::string& t) { return t == "out" ? "out_partial" : t == "lse" ? "lse_partial" : t; };
  // The statistical tier is reported on the partials but not enforced: correct kernels (P
  // rounded to BF16, F32 partials) fail it on splits holding two or three keys of a row
  // (conformance/TOLERANCE.md, "Split-KV partial states"); every element is still within its limit.
  // Only when both tensors came back in their dtypes (else the first reason may hide that).
  bool tier_only = sub.status == CaseStatus::Fail && sub.failed_elements == 0 &&
                   sub.tensors.size() == (c.want_lse_partial ? 2u : 1u);
  for (const TensorReport& t : sub.tensors)
    tier_only = tier_only && t.statistics_ok &&
                t.dtype == c.dtype_of(t.tensor == "out" ? "out_partial" : "lse_partial");
  if (tier_only) {
    sub.status = CaseStatus::Pass;
    sub.reason.clear();
  }
  if (sub.status == CaseStatus::Fail) {
    rep.status = CaseStatus::Fail;
    rep.reason += (rep.reason.empty() ? "" : "; ") + ("split " + std::to_string(s) + ": " + sub.reason);
  }
  rep.failed_elements += sub.failed_elements;
  for (TensorReport& t : sub.tensors) {
    t.tensor = renamed(t.tensor);
    if (t.worst) {
      t.worst->tensor = t.tensor;
      t.worst->index.insert(t.worst->index.begin(), s);
    }
    auto it = std::find_if(rep.tensors.begin(), rep.tensors.end(), [&](const TensorReport& x) { return x.tensor == t.tensor; });
    if (it == rep.tensors.end()) {
      rep.tensors.push_back(t);
      it = rep.tensors.end() - 1;
    } else {
      it->compared += t.compared;
      it->over_limit += t.over_limit;
      it->worst_ulp = std::max(it->worst_ulp, t.worst_ulp);
      it->worst_bound_error = std::max(it->worst_bound_error, t.worst_bound_error);
      it->largest_limit = std::max(it->largest_limit, t.largest_limit);
      it->statistics_ok = it->statistics_ok && t.statistics_ok;
      if (t.worst && (!it->worst || t.worst->limit_ratio > it->worst->limit_ratio)) {
        it->worst = t.worst;
        it->worst_ratio = t.worst_ratio;
      }
    }
    if (t.worst && (!rep.worst || t.worst->limit_ratio > rep.worst->limit_ratio)) rep.worst = t.worst;
  }
}

CaseReport compare_merge(const std::string& id, const SafeTensorsFile& golden, const std::string& expect,
                         const JobResult& result, const Profile& profile, bool pictures) {
  const Case m = case_from_file(id, strip_golden(golden));
  const Case inner = merge_sdpa_case(m);
  const std::vector<std::int64_t> out{inner.B, inner.Hq, 1, inner.Dv}, rows{inner.B, inner.Hq, 1};
  SafeTensorsFile g = inner.file;
  for (const auto& [k, v] : golden.metadata)
    if (k == "attn.reference" || k == "attn.undecided") g.metadata[k] = v;
  for (RawTensor t : golden.tensors) {
    if (!is_golden_tensor_name(t.name)) continue;
    if (t.shape == m.out_shape()) t.shape = out;
    else if (t.shape == m.row_shape()) t.shape = rows;
    g.put(std::move(t));
  }
  JobResult r = result;
  for (RawTensor& t : r.output.tensors) {  // the merge's shapes only; others stay, to fail
    if (t.name == "out" && t.shape == m.out_shape()) t.shape = out;
    if (t.name == "lse" && t.shape == m.row_shape()) t.shape = rows;
  }
  CaseReport rep = compare_plain_case(id, g, expect, r, profile, pictures);
  if (rep.status != CaseStatus::Fail || rep.diagnosis.failed_total == 0) return rep;
  // The sdpa case's rows (b, h * Nq + i) are the merge's rows (b, h, i) in the same order; its
  // findings on heads, keys and masks speak of that case's geometry and give way to the merge's.
  auto& fs = rep.diagnosis.findings;
  std::erase_if(fs, [](const Finding& f) {
    for (const char* n : {"one_head", "some_heads", "one_kv_group", "kv_groups", "other_head", "rows_beyond_keys",
                          "max_past_block", "masked_rows", "masked_weight", "large_scores"})
      if (f.name == n) return true;
    return false;
  });
  const auto mf = merge_findings(m, row_flags(inner, rep.diagnosis, true), result.output.find("lse"), rep.diagnosis.failed_total);
  fs.insert(fs.begin(), mf.begin(), mf.end());
  return rep;
}

}  // namespace

CaseReport compare_case(const std::string& id, const SafeTensorsFile& golden, const std::string& expect,
                        const JobResult& result, const Profile& profile, bool pictures) {
  const auto kind = golden.metadata.find("attn.kind");
  if (kind != golden.metadata.end() && kind->second == "merge")
    return compare_merge(id, golden, expect, result, profile, pictures);
  CaseReport rep = compare_plain_case(id, golden, expect, result, profile, pictures);
  if (rep.status == CaseStatus::Skip || result.outcome != Outcome::Output || expect == "error") return rep;
  const Case c = case_from_file(id, strip_golden(golden));
  if (!c.wants_partials()) return rep;
  auto fail = [&](const std::string& why) {
    rep.status = CaseStatus::Fail;
    rep.reason += (rep.reason.empty() ? "" : "; ") + why;
    return rep;
  };
  const RawTensor *go = golden.find("out_partial"), *gl = golden.find("lse_partial"), *glr = golden.find("lse_partial.ref");
  if (!go || !gl || !glr) return fail("the golden file has no out_partial and lse_partial");
  const std::vector<std::int64_t> po = c.partial_out_shape(), pr = c.partial_row_shape(), o1(po.begin() + 1, po.end()),
                                  r1(pr.begin() + 1, pr.end());
  const RawTensor *yo = result.output.find("out_partial"), *yl = result.output.find("lse_partial");
  if (c.want_out_partial && !is_shape(yo, c.dtype_of("out_partial"), po))
    return fail("the result has no out_partial of dtype " + std::string(dtype_name(c.dtype_of("out_partial"))) +
                " and shape " + shape_string(po));
  if (c.want_lse_partial && !is_shape(yl, c.dtype_of("lse_partial"), pr))
    return fail("the result has no lse_partial of dtype " + std::string(dtype_name(c.dtype_of("lse_partial"))) +
                " and shape " + shape_string(pr));
  // A split without a key has lse -inf, exactly, whatever the convention for fully masked rows.
  const std::int64_t S = c.splits(), nr = numel(pr) / std::max<std::int64_t>(S, 1);
  SplitFailures sf{std::vector<std::vector<char>>(static_cast<std::size_t>(S)), std::vector<std::int64_t>(static_cast<std::size_t>(S)), {}, true, 0};
  if (c.want_lse_partial) {
    std::string first;
    for (std::int64_t e = 0; e < numel(pr); ++e) {
      double x, y = decode_float(yl->dtype, yl->data.data() + static_cast<std::size_t>(e) * dtype_size(yl->dtype));
      std::memcpy(&x, glr->data.data() + 8 * static_cast<std::size_t>(e), 8);
      if ((x == -INFINITY) == (y == -INFINITY)) continue;
      if (first.empty()) {
        sf.inf_mismatch_example = y;
        first = "lse_partial element " + std::to_string(e) + " is " + std::to_string(y) + " where the exact value is " +
                std::to_string(x) + (x == -INFINITY ? " (a split without a key: -inf exactly)" : "");
      }
      if (sf.inf_mismatch.empty()) sf.inf_mismatch.assign(static_cast<std::size_t>(S), std::vector<char>(static_cast<std::size_t>(nr)));
      sf.inf_mismatch[static_cast<std::size_t>(e / nr)][static_cast<std::size_t>(e % nr)] = 1;
      sf.inf_mismatch_nan = sf.inf_mismatch_nan && std::isnan(y);
    }
    if (!first.empty()) {
      fail(first);
      for (auto& f : split_findings(c, sf)) rep.diagnosis.findings.push_back(std::move(f));
      return rep;
    }
  }
  Profile sp = profile;
  sp.masked_rows = MaskedRowConvention::Zero;  // the contract's: 0, lse -inf
  sp.lse_dtype.reset();
  sp.returns_lse = true;
  const std::int64_t n = numel(o1);
  for (std::int64_t s = 0; s < S; ++s) {
    SafeTensorsFile g = split_inputs(c, golden, s);
    const Case sc = case_from_file(id, g);
    for (const char* k : {"attn.reference", "attn.undecided"})
      if (auto it = golden.metadata.find(k); it != golden.metadata.end()) g.metadata[k] = it->second;
    for (const char* t : {"", ".ref", ".ref_lo", ".bound"})
      if (const RawTensor* x = golden.find(std::string("out_partial") + t)) g.put(slice(*x, s, std::string("out") + t, o1));
    g.put(slice(*gl, s, "lse", r1));
    g.put(slice(*glr, s, "lse.ref", r1));
    slice_undecided(golden, "out_partial", "out", s, n, g);
    slice_undecided(golden, "lse_partial", "lse", s, nr, g);
    RawTensor valid{"row.valid", DType::BOOL, r1, std::vector<unsigned char>(static_cast<std::size_t>(nr))};
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t h = 0; h < c.Hq; ++h)
        for (std::int64_t i = 0; i < c.Nq; ++i)
          valid.data[static_cast<std::size_t>((b * c.Hq + h) * c.Nq + i)] = sc.row_has_key(b, h, i);
    g.put(std::move(valid));
    JobResult r;
    r.outcome = Outcome::Output;
    // out_partial not asked: the golden one in its place (judged exact), so that lse is judged
    r.output.put(c.want_out_partial ? slice(*yo, s, "out", o1) : slice(*go, s, "out", o1));
    if (c.want_lse_partial) r.output.put(slice(*yl, s, "lse", r1));
    CaseReport sub = compare_plain_case(id, g, "ok", r, sp, false);
    sf.failing[static_cast<std::size_t>(s)] = row_flags(sc, sub.diagnosis, true).failing;  // empty splits too
    sf.elements[static_cast<std::size_t>(s)] = sub.failed_elements;
    fold(rep, std::move(sub), s, c);
  }
  if (rep.status == CaseStatus::Fail) {
    for (auto& f : split_findings(c, sf)) rep.diagnosis.findings.push_back(std::move(f));
    // the sink left out of the merge, the exact partial lse_s taken for the kernel's
    const auto lse_s = [&](std::int64_t s, std::size_t k) {
      double x;
      std::memcpy(&x, glr->data.data() + 8 * (static_cast<std::size_t>(s * nr) + k), 8);
      return x;
    };
    if (auto f = lse_without_sink(c, row_flags(c, rep.diagnosis, false), lse_s, S, result.output.find("lse"), rep.diagnosis.failed_total))
      rep.diagnosis.findings.push_back(std::move(*f));
  }
  return rep;
}

}  // namespace attnoracle::conformance
