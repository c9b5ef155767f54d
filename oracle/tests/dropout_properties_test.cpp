// Properties of dropout with a given keep mask (CONTRACT section 10) over generated problems
// (gen_case.hpp), each evaluated under the oracle (certified_evaluate: every row check, the
// twins on the case without dropout, invariant dropout):
//   1. any keep mask and p leave weights and lse bit for bit those of the case without dropout;
//      every key kept with p = 0 leaves every golden tensor so; every key kept with p = 1/2
//      doubles out.ref bit for bit (1 / (1 - p) = 2, and doubling commutes with rounding to
//      F64 away from overflow and the subnormal range);
//   2. the gradient twins (linearity in dout, dependence on the queries that see a key) find
//      nothing in the gradients of dropout cases, on every batch entry and kv head.
#include <gtest/gtest.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "attnoracle/oracle/oracle.hpp"
#include "gen_case.hpp"

namespace attnoracle::testing {
namespace {

using I = std::int64_t;
namespace gen = rc::gen;
const char* const kPath = "generated.safetensors";

// A keep mask of shape [B,Hq,Nq,Nk] (or broadcast [Nq,Nk]): all kept, or about `keep` in 4 kept.
RawTensor keep_mask(const Spec& s, bool full, bool all) {
  RawTensor t{"dropout_mask", DType::BOOL, full ? std::vector<I>{s.B, s.Hq, s.Nq, s.Nk} : std::vector<I>{s.Nq, s.Nk}, {}};
  const auto n = static_cast<std::size_t>(t.numel());
  t.data = all ? std::vector<unsigned char>(n, 1) : *gen::container<std::vector<unsigned char>>(n, gen::element<unsigned char>(0, 1, 1, 1));
  return t;
}

const RawTensor* find(const EvalResult& r, const std::string& name) {
  for (const RawTensor& t : r.golden)
    if (t.name == name) return &t;
  return nullptr;
}
std::set<std::size_t> undecided(const EvalResult& r, const std::string& name) {
  std::set<std::size_t> u;
  if (const RawTensor* t = find(r, name + ".undecided"))
    for (std::size_t e = 0; e < t->data.size() / 8; ++e) {
      std::int64_t x;
      std::memcpy(&x, t->data.data() + 8 * e, 8);
      u.insert(static_cast<std::size_t>(x));
    }
  return u;
}
double f64_at(const RawTensor& t, std::size_t e) {
  double x;
  std::memcpy(&x, t.data.data() + 8 * e, 8);
  return x;
}

// The case evaluated under the oracle; nullopt where policy error refuses it.
std::optional<EvalResult> certified(const SafeTensorsFile& f) {
  const Case c = case_from_file(kPath, f);
  if (c.first_refused_row()) return std::nullopt;
  oracle::CheckOptions co;
  co.twin_units = 4;
  return oracle::certified_evaluate(c, EvalOptions{}, co);
}

RC_GTEST_PROP(DropoutProperties, WeightsAndLseUnchangedOutScaled, ()) {
  Spec spec = *gen_spec();
  spec.kind = Kind::Sdpa;
  spec.Nq = std::min<I>(spec.Nq, 6), spec.Nk = std::min<I>(spec.Nk, 8);
  spec.outputs = "out,weights,lse";
  RC_LOG() << "spec: " << summary(spec) << "\n";
  const SafeTensorsFile f = *gen_file(spec);
  const std::optional<EvalResult> base = certified(f);
  if (!base) RC_DISCARD("refused: a fully masked row under policy error");
  const int mode = *gen::inRange(0, 3);  // 0: a random mask, 1: all kept with p = 0, 2: with p = 1/2
  SafeTensorsFile d = f;
  d.put(keep_mask(spec, *gen::arbitrary<bool>(), mode != 0));
  d.metadata["attn.dropout_p"] = mode == 1 ? "0" : mode == 2 ? "0.5" : *gen::element<std::string>("0", "0.1", "0.5", "0x1.cp-1", "0.999");
  RC_TAG(mode == 0 ? "random mask" : mode == 1 ? "all kept, p = 0" : "all kept, p = 1/2");
  const EvalResult r = *certified(d);  // InvariantViolation fails the property
  for (const char* name : {"weights", "lse", "row.valid"}) RC_ASSERT(find(r, name)->data == find(*base, name)->data);
  if (mode == 1)
    for (const RawTensor& t : base->golden) RC_ASSERT(find(r, t.name) && find(r, t.name)->data == t.data);
  if (mode == 2) {
    const RawTensor &a = *find(*base, "out.ref"), &z = *find(r, "out.ref");
    const auto ua = undecided(*base, "out.ref"), uz = undecided(r, "out.ref");
    for (std::size_t e = 0; e < a.data.size() / 8; ++e) {
      const double x = f64_at(a, e);
      if (ua.count(e) || uz.count(e) || std::fabs(x) < 0x1p-1020 || std::fabs(x) > 0x1p1020) continue;
      RC_ASSERT(f64_at(z, e) == 2 * x);
    }
  }
}

RC_GTEST_PROP(DropoutProperties, GradientTwinsFindNothing, ()) {
  Spec spec = *gen_spec();
  spec.kind = Kind::Sdpa;
  spec.Nq = std::min<I>(spec.Nq, 6), spec.Nk = std::min<I>(spec.Nk, 6);
  spec.Dk = std::min<I>(spec.Dk, 4), spec.Dv = std::min<I>(spec.Dv, 4);
  spec.outputs = spec.bias_rank > 0 ? "out,dq,dk,dv,dbias" : "out,dq,dk,dv";
  RC_LOG() << "spec: " << summary(spec) << "\n";
  SafeTensorsFile f = *gen_file(spec);
  f.put(*gen_float_tensor("dout", spec.input, {spec.B, spec.Hq, spec.Nq, spec.Dv},
                          *gen::element(Values::Normal, Values::Dyadic, Values::Mixed)));
  f.put(keep_mask(spec, *gen::arbitrary<bool>(), false));
  f.metadata["attn.dropout_p"] = *gen::element<std::string>("0", "0.2", "0.5");
  const Case c = case_from_file(kPath, f);
  if (c.first_refused_row()) RC_DISCARD("refused: a fully masked row under policy error");
  const EvalResult res = evaluate(c, {});
  for (I b = 0; b < c.B; ++b)
    for (I g = 0; g < c.Hkv; ++g) {
      const auto v = oracle::check_gradient_twins(c, res, b, g, [](const Case& t) { return evaluate(t, {}); });
      for (const oracle::Violation& x : v) RC_LOG() << "violation: " << x.message() << "\n";
      RC_ASSERT(v.empty());
    }
}

}  // namespace
}  // namespace attnoracle::testing
