// Split-KV partial states (CONTRACT section 8): each split evaluated as a case of its own, the
// keys outside it not allowed, by the certified evaluator; the results laid split after split.
#include "attnoracle/reference/split_kv.hpp"

#include <algorithm>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace attnoracle {
namespace {

// The golden tensors of one split case and the partial tensor each one fills.
constexpr std::pair<std::string_view, std::string_view> kParts[] = {
    {"out", "out_partial"},         {"out.ref", "out_partial.ref"}, {"out.ref_lo", "out_partial.ref_lo"},
    {"out.bound", "out_partial.bound"}, {"lse", "lse_partial"},     {"lse.ref", "lse_partial.ref"}};

// A partial tensor being laid out, split after split, with its undecided elements.
struct Partial {
  std::vector<unsigned char> bytes;
  std::vector<std::pair<std::int64_t, std::vector<unsigned char>>> undecided;  // index, alt bytes
};

}  // namespace

bool is_partial_golden(std::string_view name) {
  return name.rfind("out_partial", 0) == 0 || name.rfind("lse_partial", 0) == 0;
}

Case split_template(const Case& c) {
  Case t = c;
  t.file = SafeTensorsFile{};
  t.sinks.reset();  // sinks enter at the merge
  t.masked_rows = MaskedRows::Zero;
  t.want_weights = t.want_scores = false;
  t.want_lse = true;
  t.want_out_partial = t.want_lse_partial = false;
  t.want_amax = false;
  t.o_scale.reset();  // a split's out is out_partial, of a float dtype
  t.want_dq = t.want_dk = t.want_dv = t.want_dbias = t.want_dsinks = false;
  t.dout.reset();
  t.output_dtypes = {{"out", c.dtype_of("out_partial")}, {"lse", c.dtype_of("lse_partial")}};
  return t;
}

void select_split(const Case& c, Case& t, std::int64_t s) {
  t.key_begin = s * c.kv_split_size;  // s < S: below Nk
  t.key_end = std::min(c.Nk, t.key_begin + c.kv_split_size);  // n < 10^18, Nk < 2^62: no overflow
}

void evaluate_partials(const Case& c, const EvalOptions& opt, EvalResult& res) {
  Case t = split_template(c);
  const std::int64_t S = c.splits();
  std::map<std::string, Partial, std::less<>> parts;
  for (std::int64_t s = 0; s < S; ++s) {
    select_split(c, t, s);
    EvalOptions o;
    o.threads = opt.threads;
    o.start_precision = opt.start_precision;
    o.max_precision = opt.max_precision;
    o.fast_path = opt.fast_path;
    if (opt.progress) {
      const std::string of = " of split " + std::to_string(s + 1) + "/" + std::to_string(S);
      o.progress = [&opt, of](const std::string& unit, std::uint64_t done, std::uint64_t total) {
        opt.progress(unit + of, done, total);
      };
    }
    if (opt.split_options) opt.split_options(t, o);
    EvalResult r = evaluate(t, o);
    res.stats.elements += r.stats.elements;
    res.stats.undecided += r.stats.undecided;
    res.stats.max_precision_reached = std::max(res.stats.max_precision_reached, r.stats.max_precision_reached);
    for (const auto& [from, to] : kParts) {
      const RawTensor* g = nullptr;
      for (const RawTensor& x : r.golden)
        if (x.name == from) g = &x;
      if (!g) continue;
      Partial& p = parts[std::string(to)];
      const auto offset = static_cast<std::int64_t>(g->data.size() / dtype_size(g->dtype)) * s;
      p.bytes.insert(p.bytes.end(), g->data.begin(), g->data.end());
      const RawTensor *idx = nullptr, *alt = nullptr;
      for (const RawTensor& x : r.golden) {
        if (x.name == std::string(from) + ".undecided") idx = &x;
        if (x.name == std::string(from) + ".alt") alt = &x;
      }
      if (!idx) continue;
      const std::size_t w = dtype_size(alt->dtype);
      for (std::size_t k = 0; k < idx->data.size() / 8; ++k) {
        std::int64_t e;
        std::memcpy(&e, idx->data.data() + 8 * k, 8);
        p.undecided.emplace_back(e + offset, std::vector<unsigned char>(alt->data.begin() + static_cast<std::ptrdiff_t>(k * w),
                                                                        alt->data.begin() + static_cast<std::ptrdiff_t>((k + 1) * w)));
      }
    }
  }
  // In the order of Case::golden_tensors, each after its .undecided and .alt companions.
  for (const GoldenSpec& g : c.golden_tensors()) {
    if (!is_partial_golden(g.name)) continue;
    Partial& p = parts[g.name];
    if (!p.undecided.empty()) {
      const auto n = static_cast<std::int64_t>(p.undecided.size());
      RawTensor idx{g.name + ".undecided", DType::I64, {n}, {}}, alt{g.name + ".alt", g.dtype, {n}, {}};
      for (const auto& [e, bytes] : p.undecided) {
        const auto* b = reinterpret_cast<const unsigned char*>(&e);
        idx.data.insert(idx.data.end(), b, b + 8);
        alt.data.insert(alt.data.end(), bytes.begin(), bytes.end());
      }
      res.golden.push_back(std::move(idx));
      res.golden.push_back(std::move(alt));
    }
    res.golden.push_back(RawTensor{g.name, g.dtype, g.shape, std::move(p.bytes)});
  }
}

}  // namespace attnoracle
