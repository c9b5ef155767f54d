// Properties of the reference and its oracle over generated attention problems (gen_case.hpp).
//
// RapidCheck runs 100 cases per property by default; RC_PARAMS="max_success=2000" runs more.
// A failure prints the shrunk case and RC_PARAMS="reproduce=..." that replays it.
//
//   1. The oracle finds no violation in the reference, and the reference refuses exactly the
//      rows that this test's own reading of the case finds fully masked under policy error.
//   2. certified_evaluate succeeds (or refuses as in 1) and its golden tensors obey the
//      relations that survive rounding: sdpa outputs within the rounded hull of the allowed
//      values, weights in [0, 1] and exactly 0 where not allowed, row.valid false exactly on
//      fully masked rows (zero outputs, lse -inf), out/weights/lse the rounding of a value next
//      to their F64 golden, |out.ref| <= out.bound, the undecided bookkeeping; identical keys
//      have weights in the ratio exp(bias difference), and an exact tie gives weights 1/n and
//      the correctly rounded mean of the values.
//   3. Evaluations are deterministic: twice, and with 1 or 2 threads, byte-identical files.
//   4. Metamorphic relations on GOLDEN values, one per invariant, with the twin case built here:
//      key permutation, score shift, causal dependence, head independence, batch duplication.
//      Golden values are compared bit for bit (+0 and -0 are the same golden value, CONTRACT);
//      elements undecided in either evaluation are skipped.
//   5. The gradient twins (linearity in dout, dependence on only the queries that see a key)
//      find nothing in the reference's gradients, on every batch entry and kv head.
#include <gtest/gtest.h>
#include <mpfr.h>
#include <rapidcheck.h>
#include <rapidcheck/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <numeric>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "attnoracle/oracle/oracle.hpp"
#include "gen_case.hpp"

namespace attnoracle::testing {
namespace {

using namespace attnoracle::oracle;

namespace gen = rc::gen;
using I = std::int64_t;

const char* const kPath = "generated.safetensors";

std::string hex(double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%a", x);
  return buf;
}

std::string where(I b, I h, I i) {
  return "b=" + std::to_string(b) + " h=" + std::to_string(h) + " i=" + std::to_string(i);
}

// The golden tensors of one evaluation, decoded.
struct Golden {
  std::map<std::string, RawTensor> raw;
  std::map<std::string, std::vector<double>> v;    // floating tensors
  std::map<std::string, std::set<I>> undecided;    // T -> flat indices of T.undecided
  std::map<std::string, std::vector<double>> alt;  // T -> T.alt

  bool has(const std::string& n) const { return v.count(n) > 0; }
  const std::vector<double>& at(const std::string& n) const { return v.at(n); }
  bool is_undecided(const std::string& n, I idx) const {
    auto it = undecided.find(n);
    return it != undecided.end() && it->second.count(idx) > 0;
  }
  bool valid(I idx) const { return raw.at("row.valid").data.at(static_cast<std::size_t>(idx)) != 0; }
};

const std::string kUndecided = ".undecided", kAlt = ".alt";

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() > suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

Golden golden_of(const std::vector<RawTensor>& tensors) {
  Golden g;
  for (const RawTensor& t : tensors) g.raw[t.name] = t;
  for (const auto& [name, t] : g.raw) {
    if (ends_with(name, kUndecided)) {
      std::set<I> s;
      for (std::size_t k = 0; k < t.data.size() / 8; ++k)
        s.insert(static_cast<I>(bits_of(DType::I64, t.data.data() + 8 * k)));
      g.undecided[name.substr(0, name.size() - kUndecided.size())] = s;
    } else if (ends_with(name, kAlt)) {
      g.alt[name.substr(0, name.size() - kAlt.size())] = decode_all(t);
    } else if (is_float_format(t.dtype)) {
      g.v[name] = decode_all(t);
    }
  }
  return g;
}

// One evaluation of a case file: its golden tensors, or the row it was refused on.
struct Outcome {
  bool refused = false;
  std::array<I, 3> at{};
  Golden golden;
  std::uint64_t undecided = 0;
};

Outcome evaluate_file(const SafeTensorsFile& f) {
  const Case c = case_from_file(kPath, f);
  Outcome o;
  try {
    EvalResult r = evaluate(c, {});
    o.golden = golden_of(r.golden);
    o.undecided = r.stats.undecided;
  } catch (const FullyMaskedRow& e) {
    o.refused = true;
    o.at = {e.b, e.h, e.i};
  }
  return o;
}

// Both evaluations refuse the same row, or neither refuses; true when both refused.
bool same_refusal(const Outcome& a, const Outcome& b, const std::string& relation) {
  if (a.refused != b.refused)
    RC_FAIL(std::string("the case was ") + (a.refused ? "refused" : "evaluated") + " but its twin was " +
            (b.refused ? "refused" : "evaluated") + " " + relation);
  if (a.refused && a.at != b.at)
    RC_FAIL("refused at " + where(a.at[0], a.at[1], a.at[2]) + " but the twin at " +
            where(b.at[0], b.at[1], b.at[2]) + " " + relation);
  return a.refused;
}

bool same_golden_value(double x, double y) {
  if (x == 0 && y == 0) return true;  // the sign of a zero result is not part of the contract
  if (std::isnan(x) || std::isnan(y)) return false;
  return x == y;
}

// Element ia of a's tensor `name` and element ib of b's must be the same golden value.
void expect_same(const Golden& a, I ia, const Golden& b, I ib, const std::string& name,
                 const std::string& relation) {
  RC_ASSERT(a.has(name) == b.has(name));
  if (!a.has(name) || a.is_undecided(name, ia) || b.is_undecided(name, ib)) return;
  const double x = a.at(name).at(static_cast<std::size_t>(ia));
  const double y = b.at(name).at(static_cast<std::size_t>(ib));
  if (!same_golden_value(x, y))
    RC_FAIL(name + "[" + std::to_string(ia) + "] = " + hex(x) + " became " + name + "[" +
            std::to_string(ib) + "] = " + hex(y) + " " + relation);
}

// Output elements of a row unit: (b, h, i) for sdpa, (b, i) for mha.
void compare_out(const Reading& r, const Golden& a, I ba, I ha, I ia, const Golden& z, I bz, I hz,
                 I iz, const std::string& relation) {
  const bool mha = r.kind == Kind::Mha;
  const I width = mha ? r.Dout : r.Dv;
  const I oa = mha ? (ba * r.Nq + ia) * width : ((ba * r.Hq + ha) * r.Nq + ia) * width;
  const I oz = mha ? (bz * r.Nq + iz) * width : ((bz * r.Hq + hz) * r.Nq + iz) * width;
  for (I e = 0; e < width; ++e)
    for (const char* name : {"out", "out.ref", "out.ref_lo"})
      expect_same(a, oa + e, z, oz + e, name, relation + " (at " + where(ba, ha, ia) + ")");
}

// Per-head elements of a row: row.valid, weights (key j of a is key perm[j] of z), lse.
void compare_head_row(const Reading& r, const Golden& a, I ba, I h, I ia, const Golden& z, I bz,
                      I iz, const std::vector<I>* perm, const std::string& relation) {
  const I ra = (ba * r.Hq + h) * r.Nq + ia, rz = (bz * r.Hq + h) * r.Nq + iz;
  const std::string rel = relation + " (at " + where(ba, h, ia) + ")";
  if (a.valid(ra) != z.valid(rz)) RC_FAIL("row.valid changed " + rel);
  for (const char* name : {"lse", "lse.ref"}) expect_same(a, ra, z, rz, name, rel);
  for (I j = 0; j < r.Nk; ++j) {
    const I jz = perm ? (*perm)[static_cast<std::size_t>(j)] : j;
    for (const char* name : {"weights", "weights.ref"}) expect_same(a, ra * r.Nk + j, z, rz * r.Nk + jz, name, rel);
  }
}

void log_case(const SafeTensorsFile& f) { RC_LOG() << "case: " << summary(f) << "\n"; }

// Fails the case unless cond holds, saying what and where; the message is built on failure only.
#define CHECK_OR_FAIL(cond, what) \
  do {                            \
    if (!(cond)) RC_FAIL(std::string(#cond) + " does not hold: " + (what)); \
  } while (false)

// ---------------------------------------------------------------------------------------------
// 1. The oracle passes the reference; refusals happen exactly on fully masked rows.

RC_GTEST_PROP(OracleProperties, OracleFindsNoViolationInTheReference, ()) {
  const SafeTensorsFile f = *gen_case();
  log_case(f);
  const Case c = case_from_file(kPath, f);
  const Reading rd = read(f);

  const std::vector<Violation> v = check_case(c, reference_rows(), {});
  for (const Violation& x : v) RC_LOG() << "violation: " << x.message() << "\n";
  RC_ASSERT(v.empty());

  // Row by row: the reference refuses a row unit exactly when, under policy error, a head of a
  // non-padding row has no allowed key (for mha, the first such head is named).
  RowEvaluator ev(c);
  const bool mha = rd.kind == Kind::Mha;
  for (I b = 0; b < rd.B; ++b)
    for (I h = 0; h < (mha ? 1 : rd.Hq); ++h)
      for (I i = 0; i < rd.Nq; ++i) {
        I expect = -1;  // the head expected in the refusal
        if (rd.policy == MaskedRows::Error && rd.query_valid(b, i)) {
          for (I hh = mha ? 0 : h; hh < (mha ? rd.Hq : h + 1) && expect < 0; ++hh)
            if (!rd.has_key(b, hh, i)) expect = hh;
        }
        bool refused = false;
        I named_h = -1, named_b = -1, named_i = -1;
        try {
          (void)ev.row(b, h, i, 64);
        } catch (const FullyMaskedRow& e) {
          refused = true;
          named_b = e.b, named_h = e.h, named_i = e.i;
        }
        const std::string at = "row unit " + where(b, h, i) + ": " + (expect >= 0 ? "refusal" : "evaluation") +
                               " expected, got " + (refused ? "a refusal naming " + where(named_b, named_h, named_i) : "an evaluation");
        CHECK_OR_FAIL(refused == (expect >= 0), at);
        if (refused) CHECK_OR_FAIL(named_b == b && named_h == expect && named_i == i, at);
      }
}

// Keys j1 and j2 seen by head h of batch b are the same vector: rows of k (sdpa, kv head g(h))
// or of x_kv (mha, projected alike by every head).
bool same_key(const Reading& rd, const std::vector<double>& keys, I b, I h, I j1, I j2) {
  const bool mha = rd.kind == Kind::Mha;
  const I E = mha ? rd.D : rd.Dk;
  const I base = mha ? b * rd.Nk : (b * rd.Hkv + rd.group(h)) * rd.Nk;
  for (I d = 0; d < E; ++d)
    if (keys[static_cast<std::size_t>((base + j1) * E + d)] != keys[static_cast<std::size_t>((base + j2) * E + d)])
      return false;
  return true;
}

// The rounding of a real y known to lie strictly between the F64 neighbours of its F64 rounding
// y64, when that neighbourhood rounds to one value of t (else nothing: a double rounding could
// decide).
std::optional<double> unambiguous(DType t, double y64, bool exact) {
  if (exact) return round_to(t, y64);
  const double a = round_to(t, std::nextafter(y64, -INFINITY));
  const double z = round_to(t, std::nextafter(y64, INFINITY));
  if (a == z) return a;
  return std::nullopt;
}

// An exact tie in row (b, h, i) of an sdpa case over the allowed keys `on`.
void exact_tie(const Reading& rd, const Golden& g, I b, I h, I i, const std::vector<I>& on) {
  const I row = (b * rd.Hq + h) * rd.Nq + i;
  const auto n = static_cast<unsigned long>(on.size());
  const std::string rel = "in an exact tie of " + std::to_string(n) + " keys (" + where(b, h, i) + ")";
  auto expect = [&](const std::string& name, I idx, double want) {
    if (g.is_undecided(name, idx)) return;
    const double got = g.at(name)[static_cast<std::size_t>(idx)];
    if (!same_golden_value(got, want)) RC_FAIL(name + "[" + std::to_string(idx) + "] = " + hex(got) + ", not " + hex(want) + " " + rel);
  };
  if (g.has("weights.ref")) {
    const double w = 1.0 / static_cast<double>(n);  // IEEE division: 1/n correctly rounded
    const auto w_out = unambiguous(rd.output, w, n == 1 || n == 2 || n == 4 || n == 8);
    for (I j : on) {
      expect("weights.ref", row * rd.Nk + j, w);
      if (w_out) expect("weights", row * rd.Nk + j, *w_out);
    }
  }
  mpfr_t s;
  mpfr_init2(s, 2400);  // holds any sum of 12 doubles exactly
  for (I col = 0; col < rd.Dv; ++col) {
    mpfr_set_zero(s, 1);
    for (I j : on) mpfr_add_d(s, s, rd.value(b, rd.group(h), j, col), MPFR_RNDN);
    mpfr_div_ui(s, s, n, MPFR_RNDN);
    const double y = mpfr_get_d(s, MPFR_RNDN);
    const bool exact = mpfr_cmp_d(s, y) == 0;
    const auto o = unambiguous(rd.output, y, exact);
    const I e = row * rd.Dv + col;
    if (g.is_undecided("out.ref", e) || g.is_undecided("out", e)) continue;
    const double got_ref = g.at("out.ref")[static_cast<std::size_t>(e)], got = g.at("out")[static_cast<std::size_t>(e)];
    if (!same_golden_value(got_ref, y) || (o && !same_golden_value(got, *o))) {
      mpfr_clear(s);
      RC_FAIL("out[" + std::to_string(e) + "] = " + hex(got) + " (ref " + hex(got_ref) + "), but the mean of the values is " +
              hex(y) + (exact ? "" : " (rounded)") + " " + rel);
    }
  }
  mpfr_clear(s);
}

// ---------------------------------------------------------------------------------------------
// 2. certified_evaluate: refusal as the reading says; golden tensors obey rounded relations.

RC_GTEST_PROP(OracleProperties, CertifiedGoldenTensorsObeyRoundedRelations, ()) {
  Spec spec = *gen_spec();
  if (*gen::weightedElement<bool>({{1, false}, {3, true}})) spec.outputs = "out,weights,lse";
  RC_LOG() << "spec: " << summary(spec) << "\n";
  const SafeTensorsFile f = *gen_file(spec);
  log_case(f);
  const Case c = case_from_file(kPath, f);
  const Reading rd = read(f);
  const auto refuse = rd.first_refused();

  EvalResult res;
  try {
    res = certified_evaluate(c, {}, {});
  } catch (const FullyMaskedRow& e) {
    RC_LOG() << "refused at " << where(e.b, e.h, e.i) << "\n";
    RC_ASSERT(refuse.has_value());
    RC_ASSERT((std::array<I, 3>{e.b, e.h, e.i}) == *refuse);
    RC_SUCCEED("refused as expected");
  } catch (const InvariantViolation& e) {
    for (const Violation& x : e.violations()) RC_LOG() << "violation: " << x.message() << "\n";
    RC_FAIL(std::string("certified_evaluate: ") + e.what());
  }
  if (refuse) RC_FAIL("not refused, but " + where((*refuse)[0], (*refuse)[1], (*refuse)[2]) + " has no allowed key");

  const Golden g = golden_of(res.golden);
  const bool mha = rd.kind == Kind::Mha;
  const DType odt = rd.output;
  const I H = rd.Hq, width = mha ? rd.Dout : rd.Dv;
  const I out_n = mha ? rd.B * rd.Nq * width : rd.B * H * rd.Nq * width;
  const I rows = rd.B * H * rd.Nq;

  // Presence, dtypes and sizes.
  auto expect_tensor = [&](const std::string& name, bool present, DType dt, I n) {
    CHECK_OR_FAIL((g.raw.count(name) > 0) == present, "golden tensor " + name);
    if (!present) return;
    CHECK_OR_FAIL(g.raw.at(name).dtype == dt, "golden tensor " + name);
    CHECK_OR_FAIL(g.raw.at(name).numel() == n, "golden tensor " + name);
  };
  expect_tensor("out", true, odt, out_n);
  expect_tensor("out.ref", true, DType::F64, out_n);
  expect_tensor("out.ref_lo", odt == DType::F64, DType::F64, out_n);
  expect_tensor("out.bound", true, DType::F64, out_n);
  expect_tensor("row.valid", true, DType::BOOL, rows);
  expect_tensor("weights", rd.want_weights, odt, rows * rd.Nk);
  expect_tensor("weights.ref", rd.want_weights, DType::F64, rows * rd.Nk);
  expect_tensor("lse", rd.want_lse, odt, rows);
  expect_tensor("lse.ref", rd.want_lse, DType::F64, rows);

  // Undecided elements: listed ascending, in range, with another candidate; the count agrees.
  std::uint64_t listed = 0;
  for (const auto& [name, idx] : g.undecided) {
    RC_LOG() << name << ".undecided: " << idx.size() << " elements\n";
    RC_ASSERT(g.has(name));
    RC_ASSERT(g.raw.at(name + ".undecided").dtype == DType::I64);
    RC_ASSERT(g.raw.at(name + ".undecided").numel() == static_cast<I>(idx.size()));  // no repeats
    RC_ASSERT(g.alt.count(name) > 0);
    RC_ASSERT(g.raw.at(name + ".alt").dtype == g.raw.at(name).dtype);
    RC_ASSERT(g.alt.at(name).size() == idx.size());
    std::vector<I> order;
    for (std::size_t k = 0; k < idx.size(); ++k)
      order.push_back(static_cast<I>(bits_of(DType::I64, g.raw.at(name + ".undecided").data.data() + 8 * k)));
    RC_ASSERT(std::is_sorted(order.begin(), order.end()));
    std::size_t k = 0;
    for (I e : idx) {
      RC_ASSERT(e >= 0 && e < static_cast<I>(g.at(name).size()));
      RC_ASSERT(!same_golden_value(g.at(name)[static_cast<std::size_t>(e)], g.alt.at(name)[k++]));
    }
    listed += idx.size();
  }
  RC_ASSERT(g.alt.size() == g.undecided.size());
  RC_ASSERT(res.stats.undecided == listed);
  RC_ASSERT(golden_file(c, res).metadata.at("attn.undecided") == std::to_string(listed));

  // The output-dtype golden is the F64 golden's neighbourhood rounded: RN_out is monotone and the
  // exact value lies strictly between the F64 neighbours of its F64 rounding.
  auto rounded_from_ref = [&](const std::string& lo, const std::string& ref, I idx) {
    const double x = g.at(lo)[static_cast<std::size_t>(idx)], y = g.at(ref)[static_cast<std::size_t>(idx)];
    const std::string at = lo + "[" + std::to_string(idx) + "] = " + hex(x) + ", " + ref + " = " + hex(y);
    if (std::isinf(y)) {
      CHECK_OR_FAIL(x == y, at);
      return;
    }
    if (odt == DType::F64) {
      CHECK_OR_FAIL(same_golden_value(x, y), at);
      return;
    }
    const double a = round_to(odt, std::nextafter(y, -INFINITY));
    const double z = round_to(odt, std::nextafter(y, INFINITY));
    if (!(a <= x && x <= z))
      RC_FAIL(lo + "[" + std::to_string(idx) + "] = " + hex(x) + " is not the rounding of a value near " + ref +
              " = " + hex(y));
  };

  const std::vector<double> keys = decode_all(*f.find(mha ? "x_kv" : "k"));
  for (I b = 0; b < rd.B; ++b)
    for (I h = 0; h < H; ++h)
      for (I i = 0; i < rd.Nq; ++i) {
        const I row = (b * H + h) * rd.Nq + i;
        const bool has = rd.has_key(b, h, i);
        const std::string at = "at " + where(b, h, i) + (has ? "" : ", a fully masked row");
        CHECK_OR_FAIL(g.valid(row) == has, "row.valid " + at);
        if (rd.want_lse) {
          const double l = g.at("lse")[static_cast<std::size_t>(row)], lr = g.at("lse.ref")[static_cast<std::size_t>(row)];
          if (!has) {
            CHECK_OR_FAIL(l == -INFINITY && lr == -INFINITY, "lse " + hex(l) + ", lse.ref " + hex(lr) + " " + at);
          } else {
            CHECK_OR_FAIL(std::isfinite(lr), "lse.ref " + hex(lr) + " " + at);
            rounded_from_ref("lse", "lse.ref", row);
          }
        }
        if (rd.want_weights) {
          double sum = 0;
          for (I j = 0; j < rd.Nk; ++j) {
            const I e = row * rd.Nk + j;
            const double w = g.at("weights")[static_cast<std::size_t>(e)];
            const double wr = g.at("weights.ref")[static_cast<std::size_t>(e)];
            const std::string atj = "weights " + hex(w) + ", weights.ref " + hex(wr) + " of key " + std::to_string(j) + " " + at;
            CHECK_OR_FAIL(0 <= w && w <= 1 && 0 <= wr && wr <= 1, atj);
            if (!rd.allowed(b, h, i, j)) CHECK_OR_FAIL(w == 0 && wr == 0, "a key that is not allowed: " + atj);
            rounded_from_ref("weights", "weights.ref", e);
            sum += wr;
          }
          // each weights.ref is within half an F64 ulp (<= 2^-53 relative) of its weight
          if (has) CHECK_OR_FAIL(std::fabs(sum - 1) <= static_cast<double>(rd.Nk + 1) * 0x1p-52, "weights.ref sum to " + hex(sum) + " " + at);
          // Identical keys (sdpa: k rows; mha: x_kv rows) have equal dot products, so their
          // exact weights have the ratio exp(bias1 - bias2): equal golden weights for equal bias,
          // and otherwise the ratio of the F64 goldens within a few ulps of it.
          for (I j1 = 0; j1 < rd.Nk; ++j1)
            for (I j2 = j1 + 1; j2 < rd.Nk; ++j2) {
              if (!rd.allowed(b, h, i, j1) || !rd.allowed(b, h, i, j2) || !same_key(rd, keys, b, h, j1, j2)) continue;
              const std::string rel = "for identical keys " + std::to_string(j1) + " and " + std::to_string(j2) +
                                      " (" + where(b, h, i) + ")";
              const double b1 = rd.bias_value(b, h, i, j1), b2 = rd.bias_value(b, h, i, j2);
              if (b1 == b2) {
                expect_same(g, row * rd.Nk + j1, g, row * rd.Nk + j2, "weights.ref", rel);
                expect_same(g, row * rd.Nk + j1, g, row * rd.Nk + j2, "weights", rel);
                continue;
              }
              if (std::fabs(b1 - b2) > 40 || g.is_undecided("weights.ref", row * rd.Nk + j1) ||
                  g.is_undecided("weights.ref", row * rd.Nk + j2))
                continue;
              const double w1 = g.at("weights.ref")[static_cast<std::size_t>(row * rd.Nk + j1)];
              const double w2 = g.at("weights.ref")[static_cast<std::size_t>(row * rd.Nk + j2)];
              if (w1 < 0x1p-1000 || w2 < 0x1p-1000) continue;  // subnormal goldens: no relative bound
              const double want = std::exp(b1 - b2);
              if (!(std::fabs(w1 / w2 - want) <= 0x1p-48 * want))
                RC_FAIL("weights.ref " + hex(w1) + " and " + hex(w2) + " do not have the ratio exp(" + hex(b1) +
                        " - " + hex(b2) + ") " + rel);
            }
        }
        // sdpa, every allowed key the same vector with the same bias: an exact tie, so the
        // weights are exactly 1/n and the output is the mean of the allowed values, rounded once.
        if (!mha && has) {
          std::vector<I> keys_on;
          for (I j = 0; j < rd.Nk; ++j)
            if (rd.allowed(b, h, i, j)) keys_on.push_back(j);
          bool tie = true;
          for (I j : keys_on)
            tie = tie && same_key(rd, keys, b, h, keys_on[0], j) &&
                  rd.bias_value(b, h, i, j) == rd.bias_value(b, h, i, keys_on[0]);
          if (tie) exact_tie(rd, g, b, h, i, keys_on);
        }
        if (mha) continue;
        // sdpa outputs: zero on fully masked rows; else within the rounded hull of the values
        for (I col = 0; col < rd.Dv; ++col) {
          const I e = row * rd.Dv + col;
          const double o = g.at("out")[static_cast<std::size_t>(e)];
          const double oref = g.at("out.ref")[static_cast<std::size_t>(e)];
          if (!has) {
            CHECK_OR_FAIL(o == 0 && oref == 0 && g.at("out.bound")[static_cast<std::size_t>(e)] == 0,
                          "out " + hex(o) + ", out.ref " + hex(oref) + " at column " + std::to_string(col) + " " + at);
            continue;
          }
          double lo = INFINITY, hi = -INFINITY;
          for (I j = 0; j < rd.Nk; ++j)
            if (rd.allowed(b, h, i, j)) {
              lo = std::min(lo, rd.value(b, rd.group(h), j, col));
              hi = std::max(hi, rd.value(b, rd.group(h), j, col));
            }
          const double rlo = round_to(odt, lo), rhi = round_to(odt, hi);
          const std::string atc = "out " + hex(o) + ", out.ref " + hex(oref) + " at column " + std::to_string(col) +
                                  " with the allowed values in [" + hex(lo) + ", " + hex(hi) + "] " + at;
          CHECK_OR_FAIL(rlo <= o && o <= rhi, atc);
          CHECK_OR_FAIL(lo <= oref && oref <= hi, atc);
        }
      }

  for (I e = 0; e < out_n; ++e) {
    const double oref = g.at("out.ref")[static_cast<std::size_t>(e)];
    const double bound = g.at("out.bound")[static_cast<std::size_t>(e)];
    CHECK_OR_FAIL(std::fabs(oref) <= bound, "out.ref[" + std::to_string(e) + "] = " + hex(oref) + ", out.bound " + hex(bound));
    rounded_from_ref("out", "out.ref", e);
    if (odt == DType::F64) {
      const double lo = g.at("out.ref_lo")[static_cast<std::size_t>(e)];
      CHECK_OR_FAIL(std::fabs(lo) <= spacing(DType::F64, oref) / 2,
                    "out.ref_lo[" + std::to_string(e) + "] = " + hex(lo) + " for out.ref " + hex(oref));
    }
  }
  // mha: a row unit whose heads are all fully masked has an output of exact zeros
  if (mha)
    for (I b = 0; b < rd.B; ++b)
      for (I i = 0; i < rd.Nq; ++i) {
        bool any = false;
        for (I h = 0; h < H; ++h) any = any || rd.has_key(b, h, i);
        if (any) continue;
        for (I e = 0; e < width; ++e) {
          CHECK_OR_FAIL(g.at("out")[static_cast<std::size_t>((b * rd.Nq + i) * width + e)] == 0 &&
                            g.at("out.ref")[static_cast<std::size_t>((b * rd.Nq + i) * width + e)] == 0,
                        "mha row " + where(b, 0, i) + " has no allowed key in any head, column " + std::to_string(e));
        }
      }
  // sdpa: the alternative candidates also lie in the rounded hull (checked through the values
  // themselves: both candidates round an enclosure intersected with the hull)
  if (!mha && g.alt.count("out")) {
    std::size_t k = 0;
    for (I e : g.undecided.at("out")) {
      const I row = e / rd.Dv, col = e % rd.Dv;
      const I i = row % rd.Nq, h = (row / rd.Nq) % H, b = row / (rd.Nq * H);
      double lo = INFINITY, hi = -INFINITY;
      for (I j = 0; j < rd.Nk; ++j)
        if (rd.allowed(b, h, i, j)) {
          lo = std::min(lo, rd.value(b, rd.group(h), j, col));
          hi = std::max(hi, rd.value(b, rd.group(h), j, col));
        }
      const double a = g.alt.at("out")[k++];
      CHECK_OR_FAIL(round_to(odt, lo) <= a && a <= round_to(odt, hi),
                    "out.alt " + hex(a) + " of out[" + std::to_string(e) + "], values in [" + hex(lo) + ", " + hex(hi) + "]");
    }
  }
}

// ---------------------------------------------------------------------------------------------
// 3. Determinism: byte-identical files, evaluated twice and with 1 or 2 threads.

RC_GTEST_PROP(OracleProperties, EvaluationIsDeterministic, ()) {
  const SafeTensorsFile f = *gen_case();
  log_case(f);
  const Case c = case_from_file(kPath, f);
  auto run = [&](int threads, bool certified) -> std::vector<unsigned char> {
    EvalOptions opt;
    opt.threads = threads;
    try {
      const EvalResult r = certified ? certified_evaluate(c, opt, {}) : evaluate(c, opt);
      return serialize_safetensors(golden_file(c, r));
    } catch (const std::runtime_error& e) {  // a refusal or a violation: also deterministic
      const std::string m = "refused: " + std::string(e.what());
      return std::vector<unsigned char>(m.begin(), m.end());
    }
  };
  const auto first = run(1, true);
  const std::vector<std::pair<const char*, std::vector<unsigned char>>> others = {
      {"certified, 1 thread, again", run(1, true)},
      {"certified, 2 threads", run(2, true)},
      {"evaluate, 2 threads", run(2, false)},
  };
  for (const auto& [what, bytes] : others) {
    if (bytes == first) continue;
    std::size_t k = 0;
    while (k < bytes.size() && k < first.size() && bytes[k] == first[k]) ++k;
    RC_FAIL(std::string("the file differs (") + what + ", first difference at byte " + std::to_string(k) +
            " of " + std::to_string(first.size()) + ")");
  }
}

// ---------------------------------------------------------------------------------------------
// 4. Metamorphic relations on golden values.

rc::Gen<std::vector<I>> gen_permutation(I n) {
  return gen::exec([n] {
    std::vector<I> p(static_cast<std::size_t>(n));
    std::iota(p.begin(), p.end(), I{0});
    for (I k = n - 1; k > 0; --k)  // shrinks towards the identity
      std::swap(p[static_cast<std::size_t>(k)], p[static_cast<std::size_t>(k - *uniform<I>(0, k + 1))]);
    return p;
  });
}

RawTensor& tensor(SafeTensorsFile& f, const char* name) {
  RawTensor* t = f.find(name);
  RC_ASSERT(t != nullptr);
  return *t;
}

// Permuting keys and values (with the mask's and bias's key columns) permutes the weights and
// leaves out and lse alone. Without causal or window, whose rules do not follow the keys.
RC_GTEST_PROP(OracleProperties, KeyPermutationPermutesWeightsOnly, ()) {
  Spec spec = *gen_spec();
  spec.causal = *gen::element(std::string(), std::string("none"));
  spec.window = *gen::element(std::string(), std::string("none"));
  spec.outputs = "out,weights,lse";
  RC_LOG() << "spec: " << summary(spec) << "\n";
  const SafeTensorsFile f = *gen_file(spec);
  const std::vector<I> perm = *gen_permutation(spec.Nk);
  log_case(f);
  SafeTensorsFile t = f;
  if (spec.kind == Kind::Sdpa) {
    t.put(permute_axis(tensor(t, "k"), 2, perm));
    t.put(permute_axis(tensor(t, "v"), 2, perm));
  } else {
    t.put(permute_axis(tensor(t, "x_kv"), 1, perm));
  }
  if (RawTensor* m = t.find("mask"); m && m->shape.back() == spec.Nk)  // else constant over keys
    t.put(permute_axis(*m, m->shape.size() - 1, perm));
  if (RawTensor* b = t.find("bias"); b && b->shape.back() == spec.Nk)
    t.put(permute_axis(*b, b->shape.size() - 1, perm));

  const Outcome a = evaluate_file(f), z = evaluate_file(t);
  const std::string rel = "when keys and values are permuted";
  if (same_refusal(a, z, rel)) RC_SUCCEED("both refused");
  const Reading rd = read(f);
  for (I b = 0; b < rd.B; ++b)
    for (I i = 0; i < rd.Nq; ++i)
      for (I h = 0; h < rd.Hq; ++h) {
        if (rd.kind == Kind::Sdpa || h == 0) compare_out(rd, a.golden, b, h, i, z.golden, b, h, i, rel);
        compare_head_row(rd, a.golden, b, h, i, z.golden, b, i, &perm, rel);
      }
}

// Adding a power of two to every score (through an F64 bias, where the addition is exact)
// changes neither out nor weights, and shifts the exact lse by the constant.
RC_GTEST_PROP(OracleProperties, ScoreShiftChangesOnlyLse, ()) {
  Spec spec = *gen_spec();
  spec.outputs = "out,weights,lse";
  RC_LOG() << "spec: " << summary(spec) << "\n";
  const SafeTensorsFile f = *gen_file(spec);
  double cst = *gen::element(1.0, 0.5, 2.0, 0.25, -1.0, -0.5, 4.0, 0x1p-6);
  log_case(f);
  std::vector<double> bias;
  std::vector<I> shape = {1};
  if (const RawTensor* b = f.find("bias")) {
    bias = decode_all(*b);
    shape = b->shape;
  } else {
    bias = {0.0};
  }
  // the first of cst, cst/2, cst/4, ... whose addition to every finite bias entry is exact
  auto exact = [&](double c0) {
    for (double x : bias)
      if (std::isfinite(x)) {
        const double s = x + c0, bb = s - x;  // Knuth's TwoSum: the rounding error of x + c0
        if ((x - (s - bb)) + (c0 - bb) != 0) return false;
      }
    return true;
  };
  while (!exact(cst) && std::fabs(cst) > 0x1p-40) cst /= 2;
  if (!exact(cst)) RC_DISCARD("no power of two adds exactly to the bias");
  RC_LOG() << "constant " << hex(cst) << "\n";
  SafeTensorsFile t = f;
  RawTensor nb{"bias", DType::F64, shape, std::vector<unsigned char>(bias.size() * 8)};
  for (std::size_t k = 0; k < bias.size(); ++k) store_bits(DType::F64, encode(DType::F64, bias[k] + cst), nb.data.data() + 8 * k);
  t.put(std::move(nb));

  const Outcome a = evaluate_file(f), z = evaluate_file(t);
  const std::string rel = "when " + hex(cst) + " is added to every score";
  if (same_refusal(a, z, rel)) RC_SUCCEED("both refused");
  const Reading rd = read(f);
  mpfr_t d, u, x;
  mpfr_inits2(2200, d, u, x, static_cast<mpfr_ptr>(nullptr));
  for (I b = 0; b < rd.B; ++b)
    for (I i = 0; i < rd.Nq; ++i)
      for (I h = 0; h < rd.Hq; ++h) {
        if (rd.kind == Kind::Sdpa || h == 0) compare_out(rd, a.golden, b, h, i, z.golden, b, h, i, rel);
        const I row = (b * rd.Hq + h) * rd.Nq + i;
        const std::string at = rel + " (at " + where(b, h, i) + ")";
        if (a.golden.valid(row) != z.golden.valid(row)) RC_FAIL("row.valid changed " + at);
        for (I j = 0; j < rd.Nk; ++j)
          for (const char* name : {"weights", "weights.ref"})
            expect_same(a.golden, row * rd.Nk + j, z.golden, row * rd.Nk + j, name, at);
        if (a.golden.is_undecided("lse.ref", row) || z.golden.is_undecided("lse.ref", row)) continue;
        // |lse.ref' - (lse.ref + c)| <= (ulp(lse.ref') + ulp(lse.ref)) / 2, computed exactly
        const double l0 = a.golden.at("lse.ref")[static_cast<std::size_t>(row)];
        const double l1 = z.golden.at("lse.ref")[static_cast<std::size_t>(row)];
        if (std::isinf(l0) || std::isinf(l1)) {
          CHECK_OR_FAIL(l0 == l1, "lse.ref " + hex(l0) + " became " + hex(l1) + " " + at);
          continue;
        }
        mpfr_set_d(d, l1, MPFR_RNDN);
        mpfr_sub_d(d, d, l0, MPFR_RNDN);
        mpfr_sub_d(d, d, cst, MPFR_RNDN);  // exact at 2200 bits
        mpfr_abs(d, d, MPFR_RNDN);
        mpfr_set_d(u, spacing(DType::F64, l0), MPFR_RNDN);
        mpfr_set_d(x, spacing(DType::F64, l1), MPFR_RNDN);
        mpfr_add(u, u, x, MPFR_RNDN);
        mpfr_div_2ui(u, u, 1, MPFR_RNDN);
        const bool ok = mpfr_lessequal_p(d, u);
        if (!ok) {
          mpfr_clears(d, u, x, static_cast<mpfr_ptr>(nullptr));
          RC_FAIL("lse.ref " + hex(l0) + " became " + hex(l1) + ", not within an ulp of the shift " + at);
        }
      }
  mpfr_clears(d, u, x, static_cast<mpfr_ptr>(nullptr));
}

// Under causal, changing the keys and values after key J (or the inputs they are projected
// from) leaves every row whose last visible key is at most J unchanged.
RC_GTEST_PROP(OracleProperties, CausalRowsIgnoreLaterKeys, ()) {
  Spec spec = *gen_spec();
  spec.causal = *gen::element(std::string("top_left"), std::string("bottom_right"));
  spec.outputs = "out,weights,lse";
  spec.Nk = std::max<I>(spec.Nk, 2);
  RC_LOG() << "spec: " << summary(spec) << "\n";
  const SafeTensorsFile f = *gen_file(spec);
  const I J = *uniform<I>(0, spec.Nk - 1);
  log_case(f);
  RC_LOG() << "keys " << J + 1 << ".." << spec.Nk - 1 << " change\n";
  SafeTensorsFile t = f;
  if (spec.kind == Kind::Sdpa) {
    for (const char* name : {"k", "v"}) {
      const RawTensor& old = tensor(t, name);
      const RawTensor fresh = *gen_float_tensor(name, old.dtype, old.shape, name[0] == 'k' ? spec.k_values : spec.v_values);
      splice_axis(tensor(t, name), fresh, 2, J + 1, spec.Nk);
    }
  } else {
    const RawTensor& old = tensor(t, "x_kv");
    const RawTensor fresh = *gen_float_tensor("x_kv", old.dtype, old.shape, spec.x_values);
    splice_axis(tensor(t, "x_kv"), fresh, 1, J + 1, spec.Nk);
  }
  const Outcome a = evaluate_file(f), z = evaluate_file(t);
  const std::string rel = "when keys after " + std::to_string(J) + " change";
  if (same_refusal(a, z, rel)) RC_SUCCEED("both refused");
  const Reading rd = read(f);
  for (I i = 0; i < rd.Nq; ++i) {
    I last = -1;
    for (I j = 0; j < rd.Nk; ++j)
      if (rd.positional(i, j)) last = j;
    if (last > J) continue;
    for (I b = 0; b < rd.B; ++b)
      for (I h = 0; h < rd.Hq; ++h) {
        if (rd.kind == Kind::Sdpa || h == 0) compare_out(rd, a.golden, b, h, i, z.golden, b, h, i, rel);
        compare_head_row(rd, a.golden, b, h, i, z.golden, b, i, nullptr, rel);
      }
  }
}

// sdpa: changing one query head's queries leaves the other heads alone; changing one kv head's
// keys and values leaves the query heads of the other groups alone (g(h) = h / (Hq/Hkv)).
RC_GTEST_PROP(OracleProperties, HeadsAreIndependent, ()) {
  Spec spec = *gen_spec();
  spec.kind = Kind::Sdpa;
  spec.Hq = *gen::weightedElement<I>({{1, 2}, {1, 3}, {2, 4}});
  spec.Hkv = *gen::weightedElement<I>({{1, 1}, {1, spec.Hq}, {2, spec.Hq == 4 ? 2 : 1}});  // GQA, MHA, MQA
  spec.outputs = "out,weights,lse";
  RC_LOG() << "spec: " << summary(spec) << "\n";
  const SafeTensorsFile f = *gen_file(spec);
  const bool kv = spec.Hkv > 1 && *gen::element(false, true);
  const I changed = *uniform<I>(0, kv ? spec.Hkv : spec.Hq);
  log_case(f);
  SafeTensorsFile t = f;
  for (const char* name : kv ? std::vector<const char*>{"k", "v"} : std::vector<const char*>{"q"}) {
    const RawTensor& old = tensor(t, name);
    const Values style = name[0] == 'q' ? spec.q_values : name[0] == 'k' ? spec.k_values : spec.v_values;
    const RawTensor fresh = *gen_float_tensor(name, old.dtype, old.shape, style);
    splice_axis(tensor(t, name), fresh, 1, changed, changed + 1);
  }
  const Outcome a = evaluate_file(f), z = evaluate_file(t);
  const std::string rel = std::string("when the ") + (kv ? "keys and values of kv head " : "queries of head ") +
                          std::to_string(changed) + " change";
  const Reading rd = read(f);
  if (same_refusal(a, z, rel)) RC_SUCCEED("both refused");
  for (I h = 0; h < rd.Hq; ++h) {
    if (kv ? rd.group(h) == changed : h == changed) continue;
    for (I b = 0; b < rd.B; ++b)
      for (I i = 0; i < rd.Nq; ++i) {
        compare_out(rd, a.golden, b, h, i, z.golden, b, h, i, rel);
        compare_head_row(rd, a.golden, b, h, i, z.golden, b, i, nullptr, rel);
      }
  }
}

// The problem twice along the batch dimension: each copy gets the original's golden values.
RC_GTEST_PROP(OracleProperties, BatchCopiesAreIdentical, ()) {
  Spec spec = *gen_spec();
  spec.outputs = "out,weights,lse";
  RC_LOG() << "spec: " << summary(spec) << "\n";
  const SafeTensorsFile f = *gen_file(spec);
  log_case(f);
  SafeTensorsFile t = f;
  for (const char* name : {"q", "k", "v", "x_q", "x_kv", "query_mask"})
    if (const RawTensor* x = t.find(name)) t.put(repeat_axis0(*x));
  for (const char* name : {"mask", "bias"})
    if (const RawTensor* x = t.find(name); x && x->shape.size() == 4 && x->shape[0] == spec.B && spec.B > 1)
      t.put(repeat_axis0(*x));
  const Outcome a = evaluate_file(f), z = evaluate_file(t);
  const std::string rel = "in a copy along the batch dimension";
  if (same_refusal(a, z, rel)) RC_SUCCEED("both refused");
  const Reading rd = read(f);
  for (I bz = 0; bz < 2 * rd.B; ++bz)
    for (I i = 0; i < rd.Nq; ++i)
      for (I h = 0; h < rd.Hq; ++h) {
        const I b = bz % rd.B;
        if (rd.kind == Kind::Sdpa || h == 0) compare_out(rd, a.golden, b, h, i, z.golden, bz, h, i, rel);
        compare_head_row(rd, a.golden, b, h, i, z.golden, bz, i, nullptr, rel);
      }
}

// ---------------------------------------------------------------------------------------------
// 5. The gradient twins pass the reference (small sdpa shapes, gradients asked).

RC_GTEST_PROP(OracleProperties, GradientTwinsFindNothingInTheReference, ()) {
  Spec spec = *gen_spec();
  spec.kind = Kind::Sdpa;
  spec.Nq = std::min<I>(spec.Nq, 6), spec.Nk = std::min<I>(spec.Nk, 6);
  spec.Dk = std::min<I>(spec.Dk, 4), spec.Dv = std::min<I>(spec.Dv, 4);
  spec.outputs = spec.bias_rank > 0 ? "out,dq,dk,dv,dbias" : "out,dq,dk,dv";
  RC_LOG() << "spec: " << summary(spec) << "\n";
  SafeTensorsFile f = *gen_file(spec);
  f.put(*gen_float_tensor("dout", spec.input, {spec.B, spec.Hq, spec.Nq, spec.Dv},
                          *gen::element(Values::Normal, Values::Dyadic, Values::Mixed)));
  log_case(f);
  const Case c = case_from_file(kPath, f);
  if (c.first_refused_row()) RC_DISCARD("refused: a fully masked row under policy error");
  const EvalResult res = evaluate(c, {});
  int twins = 0;
  for (I b = 0; b < c.B; ++b)
    for (I g = 0; g < c.Hkv; ++g) {
      const auto v = check_gradient_twins(c, res, b, g, [&twins](const Case& t) {
        ++twins;
        return evaluate(t, {});
      });
      for (const Violation& x : v) RC_LOG() << "violation: " << x.message() << "\n";
      RC_ASSERT(v.empty());
    }
  RC_ASSERT(twins >= c.B * c.Hkv);  // the linearity twin of every slice ran
  RC_TAG(twins > c.B * c.Hkv ? "dependence twins" : "linearity only");
}

}  // namespace
}  // namespace attnoracle::testing
