// Merging the JSON reports of the shards of one run (run or check --shard k/n --json) into the
// report of one run over them all.
#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <string>

#include <nlohmann/json.hpp>

#include "attnoracle/conformance/gate.hpp"
#include "attnoracle/reference/dtype.hpp"
#include "attnoracle/reference/error.hpp"

namespace attnoracle::conformance {
namespace {

using J = nlohmann::ordered_json;

// A number of the report, null (not finite: JSON has no infinity) read as infinity.
double number_of(const J& o, const char* key) {
  const auto it = o.find(key);
  if (it == o.end() || !it->is_number()) return it != o.end() && it->is_null() ? std::numeric_limits<double>::infinity() : 0;
  return it->get<double>();
}
std::int64_t integer_of(const J& o, const char* key) {
  const auto it = o.find(key);
  return it != o.end() && it->is_number_integer() ? it->get<std::int64_t>() : 0;
}
std::string string_of(const J& o, const char* key) {
  const auto it = o.find(key);
  return it != o.end() && it->is_string() ? it->get<std::string>() : std::string();
}
bool bool_of(const J& o, const char* key, bool otherwise) {
  const auto it = o.find(key);
  return it != o.end() && it->is_boolean() ? it->get<bool>() : otherwise;
}

// "0x3c00": the bits; the dtype, when the report does not name it, one of their width (the text
// shows only the width).
std::uint64_t bits_of(const J& o, const char* key, DType& t, bool named) {
  const std::string s = string_of(o, key);
  if (s.size() < 3 || s.size() > 18 || s.compare(0, 2, "0x") != 0) return 0;
  if (!named) t = s.size() == 4 ? DType::F8_E4M3 : s.size() == 6 ? DType::F16 : s.size() == 18 ? DType::F64 : DType::F32;
  return std::strtoull(s.c_str() + 2, nullptr, 16);
}

// A value the report gives as null (not finite): what its bits are, NaN or an infinity, where
// the dtype is known; infinity otherwise.
double value_of(const J& o, const char* key, std::uint64_t bits, DType t, bool named) {
  const double v = number_of(o, key);
  if (std::isfinite(v) || !named || !is_input_format(t)) return v;
  unsigned char bytes[8];
  for (std::size_t k = 0; k < 8; ++k) bytes[k] = static_cast<unsigned char>(bits >> (8 * k));
  return decode_float(t, bytes);
}

ElementReport element_of(const J& w) {
  ElementReport e;
  e.tensor = string_of(w, "tensor");
  if (const auto it = w.find("index"); it != w.end() && it->is_array())
    for (const J& v : *it) e.index.push_back(v.is_number_integer() ? v.get<std::int64_t>() : 0);
  const auto named = dtype_from_name(string_of(w, "dtype"));
  if (named) e.dtype = *named;
  e.expected_bits = bits_of(w, "expected_bits", e.dtype, named.has_value());
  e.actual_bits = bits_of(w, "actual_bits", e.dtype, named.has_value());
  e.expected = value_of(w, "expected", e.expected_bits, e.dtype, named.has_value());
  e.actual = value_of(w, "actual", e.actual_bits, e.dtype, named.has_value());
  e.ulp = number_of(w, "ulp");
  e.bound_error = number_of(w, "bound_error");
  e.limit_ratio = number_of(w, "limit_ratio");
  e.error = number_of(w, "error");
  e.limit = number_of(w, "limit");
  return e;
}

// What the text and JUnit reports show of a case (its pictures are only drawn from the JSON).
CaseReport case_of(const J& c) {
  CaseReport r;
  r.id = string_of(c, "id");
  r.position = static_cast<std::size_t>(integer_of(c, "position"));
  const std::string st = string_of(c, "status");
  r.status = st == "fail" ? CaseStatus::Fail : st == "skip" ? CaseStatus::Skip : CaseStatus::Pass;
  if (const auto t = dtype_from_name(string_of(c, "dtype"))) r.dtype = *t;
  r.profile = string_of(c, "profile");
  for (const J& t : c["tags"]) r.tags.push_back(t.get<std::string>());
  r.reason = string_of(c, "reason");
  r.failed_elements = integer_of(c, "failed_elements");
  for (const J& t : c["tensors"]) {
    TensorReport tr;
    tr.tensor = string_of(t, "tensor");
    if (const auto d = dtype_from_name(string_of(t, "dtype"))) tr.dtype = *d;
    tr.compared = integer_of(t, "compared");
    tr.worst_ulp = number_of(t, "worst_ulp");
    tr.worst_bound_error = number_of(t, "worst_bound_error");
    tr.worst_ratio = number_of(t, "worst_limit_ratio");
    tr.mean_bound_error = number_of(t, "mean_bound_error");
    tr.rms_bound_error = number_of(t, "rms_bound_error");
    tr.mean_toward_zero = number_of(t, "mean_toward_zero");
    tr.statistics_ok = bool_of(t, "statistics_ok", true);
    tr.largest_limit = number_of(t, "largest_limit");
    tr.over_limit = integer_of(t, "over_limit");
    if (const auto it = t.find("tier"); it != t.end() && it->is_object()) {
      const J& s = *it;
      tr.tier.tested = bool_of(s, "tested", false);
      tr.tier.ok = bool_of(s, "ok", true);
      tr.tier.n = integer_of(s, "elements");
      tr.tier.rows = integer_of(s, "rows");
      tr.tier.rms = number_of(s, "rms");
      tr.tier.rms_limit = number_of(s, "rms_limit");
      tr.tier.q99 = number_of(s, "q99");
      tr.tier.q99_limit = number_of(s, "q99_limit");
      tr.tier.mean = number_of(s, "mean");
      tr.tier.mean_limit = number_of(s, "mean_limit");
      tr.tier.headroom = number_of(s, "headroom");
      // the bias test ran where its limit is given (always finite)
      if (const auto b = s.find("bias_limit"); b != s.end() && b->is_number()) {
        tr.tier.bias_tested = true;
        tr.tier.bias_limit = b->get<double>();
        tr.tier.bias = number_of(s, "bias");
      }
    }
    if (const auto it = t.find("worst"); it != t.end() && it->is_object()) tr.worst = element_of(*it);
    r.tensors.push_back(std::move(tr));
  }
  if (const auto it = c.find("worst"); it != c.end() && it->is_object()) r.worst = element_of(*it);
  if (const auto it = c.find("diagnosis"); it != c.end()) {
    r.diagnosis.failing_rows = integer_of(*it, "failing_rows");
    for (const J& f : (*it)["findings"])
      r.diagnosis.findings.push_back({string_of(f, "name"), string_of(f, "text"), integer_of(f, "elements")});
  }
  return r;
}

struct Shard {
  const std::string* path;
  J j;
  std::int64_t index = 0, count = 0, selected = 0;
};

std::string quoted(const J& v) { return v.dump(-1, ' ', false, J::error_handler_t::replace); }

}  // namespace

MergedReport merge_reports(const std::vector<std::string>& paths, const std::vector<std::string>& texts) {
  if (paths.empty()) throw InputError("merge", "", "no report given");
  std::vector<Shard> shards;
  for (std::size_t k = 0; k < paths.size(); ++k) {
    const std::string& path = paths[k];
    html_report_from_json(path, texts[k]);  // every field the page reads present and of its type
    Shard s{&path, J::parse(texts[k]), 0, 0, 0};
    const auto it = s.j.find("shard");
    if (it == s.j.end())
      throw InputError(path, "shard", "missing: not the report of one shard (run or check with --shard and --json)");
    for (const char* key : {"index", "count", "selected"})
      if (!it->is_object() || !it->contains(key) || !(*it)[key].is_number_unsigned())
        throw InputError(path, std::string("shard.") + key, "missing or not a non-negative integer");
    s.index = (*it)["index"].get<std::int64_t>();
    s.count = (*it)["count"].get<std::int64_t>();
    s.selected = (*it)["selected"].get<std::int64_t>();
    if (s.count < 1 || s.index >= s.count) throw InputError(path, "shard", "index not below count");
    const J& cases = s.j["cases"];
    for (std::size_t c = 0; c < cases.size(); ++c)
      if (!cases[c].contains("position") || !cases[c]["position"].is_number_unsigned())
        throw InputError(path, "cases[" + std::to_string(c) + "].position", "missing or not a non-negative integer");
    shards.push_back(std::move(s));
  }

  // One run's shards: the same set, judged the same way, each shard once.
  const Shard& first = shards.front();
  std::vector<const Shard*> by_index(static_cast<std::size_t>(first.count), nullptr);
  std::map<std::string, const Shard*> ids;
  for (const Shard& s : shards) {
    for (const char* key : {"suite", "implementation", "profile", "require_all"}) {
      const J a = s.j.value(key, J()), b = first.j.value(key, J());
      if (a != b) throw InputError(*s.path, key, quoted(a) + " differs from " + quoted(b) + " in " + *first.path);
    }
    if (s.count != first.count)
      throw InputError(*s.path, "shard.count", std::to_string(s.count) + " shards, " + *first.path + " has " +
                                                   std::to_string(first.count) + ": not shards of one run");
    if (s.selected != first.selected)
      throw InputError(*s.path, "shard.selected", std::to_string(s.selected) + " cases selected, " + *first.path +
                                                      " has " + std::to_string(first.selected) + ": other selectors");
    const Shard*& slot = by_index[static_cast<std::size_t>(s.index)];
    if (slot)
      throw InputError(*s.path, "shard", "shard " + std::to_string(s.index) + "/" + std::to_string(s.count) +
                                             " is also " + *slot->path);
    slot = &s;
    for (const J& c : s.j["cases"]) {
      const std::string id = c["id"].get<std::string>();
      if (const auto [at, fresh] = ids.emplace(id, &s); !fresh)
        throw InputError(*s.path, "cases", "case " + printable(id) + " is also in " + *at->second->path);
    }
  }
  std::vector<std::string> missing;
  for (std::size_t k = 0; k < by_index.size(); ++k)
    if (!by_index[k]) missing.push_back(std::to_string(k));
  if (!missing.empty()) {
    std::string list;
    for (std::size_t k = 0; k < missing.size() && k < 12; ++k) list += (k ? ", " : "") + missing[k];
    if (missing.size() > 12) list += " and " + std::to_string(missing.size() - 12) + " more";
    throw InputError(*first.path, "shard", (missing.size() == 1 ? "shard " : "shards ") + list + " of " +
                                               std::to_string(first.count) + (missing.size() == 1 ? " is" : " are") +
                                               " missing: give every shard's report");
  }

  // The cases in the manifest's order, as one run lists them.
  std::vector<const J*> cases;
  for (const Shard& s : shards)
    for (const J& c : s.j["cases"]) cases.push_back(&c);
  std::stable_sort(cases.begin(), cases.end(), [](const J* a, const J* b) {
    return (*a)["position"].get<std::uint64_t>() < (*b)["position"].get<std::uint64_t>();
  });

  MergedReport m;
  GateReport& r = m.report;
  r.suite = first.j["suite"].get<std::string>();
  r.dir = first.j["dir"].get<std::string>();
  r.implementation = first.j["implementation"].get<std::string>();
  r.profile = first.j["profile"].get<std::string>();
  r.require_all = bool_of(first.j, "require_all", false);
  for (const Shard* s : by_index) {
    r.seconds += s->j["seconds"].get<double>();
    if (const std::string note = string_of(s->j, "note"); !note.empty())
      r.adapter_note += (r.adapter_note.empty() ? "" : "; ") + ("shard " + std::to_string(s->index) + ": " + note);
  }
  J skipped = J::array(), all = J::array();
  for (const J* c : cases) {
    r.cases.push_back(case_of(*c));
    switch (r.cases.back().status) {
      case CaseStatus::Pass: ++r.passed; break;
      case CaseStatus::Fail: ++r.failed; break;
      case CaseStatus::Skip: ++r.skipped; skipped.push_back({{"id", (*c)["id"]}, {"reason", (*c)["reason"]}}); break;
    }
    all.push_back(*c);
  }

  // The first report's fields in its order, with the merged values; no shard.
  J out;
  for (const auto& [key, value] : first.j.items()) {
    if (key == "shard" || key == "note") continue;
    if (key == "passed") out[key] = r.passed;
    else if (key == "failed") out[key] = r.failed;
    else if (key == "skipped") out[key] = r.skipped;
    else if (key == "seconds") out[key] = r.seconds;
    else if (key == "skipped_cases") out[key] = skipped;
    else if (key == "cases") out[key] = all;
    else out[key] = value;
    if (key == "verdict") {
      out[key] = gate_exit_status(r, r.require_all) == 0 ? "pass" : "fail";
      if (!r.adapter_note.empty()) out["note"] = r.adapter_note;
    }
  }
  m.json = out.dump(2, ' ', false, J::error_handler_t::replace) + "\n";
  return m;
}

}  // namespace attnoracle::conformance
