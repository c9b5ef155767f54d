// Reports of the gate: for people (terminal), for tools (JSON) and for CI dashboards (JUnit).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "attnoracle/conformance/adapter.hpp"
#include "attnoracle/conformance/gate.hpp"
#include "attnoracle/conformance/text.hpp"

namespace attnoracle::conformance {
namespace {

constexpr std::size_t kFoldedIds = 8;  // ids named in a folded entry

std::string hex_bits(std::uint64_t bits, DType t) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%0*llx", static_cast<int>(2 * dtype_size(t)), static_cast<unsigned long long>(bits));
  return buf;
}
std::string num(double x) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.9g", x);
  return buf;
}
std::string index_text(const std::vector<std::int64_t>& ix) {
  std::string s = "[";  // appended: GCC 12 at -O3 reports a false -Wrestrict on "," + std::string&&
  for (std::size_t k = 0; k < ix.size(); ++k) {
    if (k) s += ',';
    s += std::to_string(ix[k]);
  }
  return s + "]";
}
// The figures of an element's error that mean something (exact_is_normal): ulps, the bound
// error and the error over the limit; at an exact 0 or subnormal, the error, limit and bound error.
std::string error_figures(const ElementReport& w) {
  if (!std::isfinite(w.error)) return "infinite error (a NaN or an infinity where none is exact)";
  if (!exact_is_normal(w)) return "error " + num(w.error) + ", limit " + num(w.limit) + ", bound error " + num(w.bound_error);
  if (!(w.limit > 0)) return "error " + num(w.error) + " beyond a limit of 0";
  return num(w.ulp) + " ulp, bound error " + num(w.bound_error) + ", " + num(w.limit_ratio) + " x limit";
}
std::string worst_text(const ElementReport& w) {
  return w.tensor + index_text(w.index) + ": expected " + num(w.expected) + " (" + hex_bits(w.expected_bits, w.dtype) +
         "), got " + num(w.actual) + " (" + hex_bits(w.actual_bits, w.dtype) + "); " + error_figures(w);
}
std::string g3(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g", x);
  return buf;
}
// The worst element in a few words for a case's first line: its error over its limit and its
// ulps, or where these say nothing its error, limit and bound error.
std::string worst_brief(const ElementReport& w) {
  if (w.error == 0) return "no error";
  if (!std::isfinite(w.error)) return "worst: infinite error";
  if (!exact_is_normal(w))
    return "worst: error " + g3(w.error) + " at exact " + g3(w.expected) + " (limit " + g3(w.limit) + "), bound error " +
           g3(w.bound_error);
  if (!(w.limit > 0)) return "worst: error " + g3(w.error) + ", limit 0";
  return "worst " + g3(w.limit_ratio) + " x limit (" + g3(w.ulp) + " ulp)";
}
// The statistical finding of a case that fails on its statistics alone, or "": its reason (the
// first statistical test failed) after the test's kind. From the report's fields alone, as a
// merged report has them.
std::string statistical_finding(const CaseReport& c) {
  if (c.status != CaseStatus::Fail || c.failed_elements > 0) return "";
  for (const auto& t : c.tensors) {
    if (!t.statistics_ok) return "rounding statistics, " + c.reason;  // judged before the tier
    if (t.tier.tested && !t.tier.ok) return "statistical tier, " + c.reason;
  }
  return "";
}
const char* verdict_word(CaseStatus s) { return s == CaseStatus::Pass ? "PASS" : s == CaseStatus::Fail ? "FAIL" : "SKIP"; }
// A case's first line: verdict, id, input dtype, then what decided it. Nothing compared (a
// crash, a timeout, no output, a refusal): no figures.
std::string head_text(const CaseReport& c) {
  char head[256];
  std::snprintf(head, sizeof head, "%-4s  %-40s %-4s", verdict_word(c.status), c.id.c_str(),
                std::string(dtype_name(c.dtype)).c_str());
  std::string s = head;
  if (c.tensors.empty()) {
    while (!s.empty() && s.back() == ' ') s.pop_back();
    return s;
  }
  const std::string stat = statistical_finding(c);
  if (!stat.empty()) return s + "  " + stat;
  return s + "  " + (c.worst ? worst_brief(*c.worst) : std::string("no error"));
}

// The statistical tier of each tensor tested: headroom, then observed / limit of each test.
std::string tier_text(const CaseReport& c) {
  std::string s;
  for (const auto& t : c.tensors) {
    if (!t.tier.tested) continue;
    char buf[240];
    std::snprintf(buf, sizeof buf, "      %s: headroom %.3g (rms %.3g / %.3g, q99 %.3g / %.3g, mean %.3g / %.3g",
                  t.tensor.c_str(), t.tier.headroom, t.tier.rms, t.tier.rms_limit, t.tier.q99, t.tier.q99_limit,
                  t.tier.mean, t.tier.mean_limit);
    s += buf;
    if (t.tier.bias_tested) {
      std::snprintf(buf, sizeof buf, ", bias %.3g / %.3g", t.tier.bias, t.tier.bias_limit);
      s += buf;
    }
    s += ")\n";
  }
  return s;
}

// A ratio with 3 significant digits (what a picture can show), 0 as an integer, null when infinite.
nlohmann::ordered_json ratio_json(double x) {
  if (x == 0) return 0;
  if (!std::isfinite(x)) return nullptr;
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g", x);
  return std::strtod(buf, nullptr);
}

nlohmann::ordered_json pictures_json(const Pictures& p) {
  using J = nlohmann::ordered_json;
  auto head = [](std::int64_t h) { return h < 0 ? J(nullptr) : J(h); };
  J maps = J::array();
  for (const auto& m : p.maps) {
    J cells = J::array(), means = J::array();
    for (float v : m.cells) cells.push_back(ratio_json(v));
    for (float v : m.means) means.push_back(ratio_json(v));
    maps.push_back({{"tensor", m.tensor}, {"batch", m.b}, {"head", head(m.h)}, {"kv_head", head(m.kv)},
                    {"rows", m.rows}, {"cols", m.cols}, {"cell_rows", m.cell_rows}, {"cell_cols", m.cell_cols},
                    {"worst_limit_ratio", ratio_json(m.worst)}, {"cells", std::move(cells)}, {"means", std::move(means)}});
  }
  J rows = J::array();
  for (const auto& s : p.rows) {
    J pts = J::array();  // [batch, head, query, keys, score magnitude, worst ratio]
    for (const auto& r : s.points)
      pts.push_back(J::array({r.b, head(r.h), r.i, r.keys, ratio_json(r.score_abs), ratio_json(r.ratio)}));
    rows.push_back({{"tensor", s.tensor}, {"rows", s.rows}, {"points", std::move(pts)}});
  }
  J hists = J::array();
  for (const auto& h : p.histograms)
    hists.push_back({{"tensor", h.tensor}, {"log2_from", Histogram::kLog2From}, {"bins", h.bins}, {"zero", h.zero},
                     {"below", h.below}, {"above", h.above}, {"infinite", h.infinite}});
  return J{{"maps", std::move(maps)}, {"rows", std::move(rows)}, {"histograms", std::move(hists)}};
}

}  // namespace

std::string text_report(const GateReport& r, bool all_cases) {
  std::ostringstream os;
  os << "suite " << r.suite << " (" << r.dir << "), implementation: " << r.implementation << ", profile " << r.profile
     << "\n";
  if (r.shards > 0)
    os << "shard " << r.shard << "/" << r.shards << ": " << r.cases.size() << " of the " << r.selected
       << " cases selected (those whose position in the manifest is " << r.shard << " modulo " << r.shards << ")\n";
  if (!r.adapter_note.empty()) os << "note: " << r.adapter_note << "\n";
  std::map<std::string, std::size_t> skips;  // reason -> count, when skips are not listed
  // Under --require-all a skip is a failure: each one is listed with its reason.
  const bool list_skips = all_cases || r.require_all;
  // Cases that compared nothing and failed (or were listed) for the same reason: one entry with
  // their count and ids, where the first of them stands.
  std::vector<std::vector<const CaseReport*>> entries;
  std::map<std::pair<CaseStatus, std::string>, std::size_t> folded;  // (status, reason) -> entry
  for (const auto& c : r.cases) {
    if (!list_skips && c.status == CaseStatus::Skip) ++skips[c.reason];
    if (!all_cases && c.status == CaseStatus::Pass) continue;
    if (!list_skips && c.status == CaseStatus::Skip) continue;
    if (c.tensors.empty() && c.diagnosis.findings.empty()) {
      const auto [it, fresh] = folded.try_emplace({c.status, c.reason}, entries.size());
      if (!fresh) {
        entries[it->second].push_back(&c);
        continue;
      }
    }
    entries.push_back({&c});
  }
  for (const auto& e : entries) {
    const CaseReport& c = *e.front();
    if (e.size() > 1) {
      std::vector<std::string> ids;
      for (const CaseReport* x : e) ids.push_back(x->id);
      os << verdict_word(c.status) << "  " << e.size()
         << " cases: " << (c.reason.empty() ? "no reason given" : c.reason) << "\n";
      // under --require-all every skipped case is named: each is a failure
      const bool every = c.status == CaseStatus::Skip && r.require_all;
      os << "      " << short_list(ids, every ? ids.size() : kFoldedIds) << "\n";
      if (c.status == CaseStatus::Skip && r.require_all) os << "      failures under --require-all\n";
      continue;
    }
    const std::string head = head_text(c), stat = statistical_finding(c);
    os << head << "\n";
    if (!c.reason.empty() && stat.empty()) os << "      " << c.reason << "\n";  // else the first line says it
    if (!stat.empty() && c.worst) os << "      every element within its limit: " << worst_brief(*c.worst) << "\n";
    if (c.status == CaseStatus::Skip && r.require_all) os << "      a failure under --require-all\n";
    if (c.status == CaseStatus::Fail && c.worst && c.worst->limit_ratio > 1) os << "      worst: " << worst_text(*c.worst) << "\n";
    if (c.status != CaseStatus::Skip) os << tier_text(c);
    for (const auto& f : c.diagnosis.findings) os << "      finding: " << f.text << "\n";
  }
  for (const auto& [reason, n] : skips) os << "skipped " << n << ": " << reason << "\n";
  {  // the statistical tier over the suite: median and smallest headroom of the tensors tested
    std::vector<std::pair<double, std::string>> h;
    for (const auto& c : r.cases)
      for (const auto& t : c.tensors)
        if (t.tier.tested) h.emplace_back(t.tier.headroom, c.id + " " + t.tensor);
    if (!h.empty()) {
      std::sort(h.begin(), h.end());
      const std::size_t m = h.size() / 2;
      const double median = h.size() % 2 ? h[m].first : (h[m - 1].first + h[m].first) / 2;
      char buf[300];
      std::snprintf(buf, sizeof buf, "statistical tier: %zu tensors tested, median headroom %.3g, smallest %.3g (%s)\n",
                    h.size(), median, h.front().first, h.front().second.c_str());
      os << buf;
    }
  }
  char tail[200];
  std::snprintf(tail, sizeof tail, "%zu cases in %s: %zu passed, %zu failed, %zu skipped%s\n", r.cases.size(),
                duration_text(r.seconds).c_str(), r.passed, r.failed, r.skipped,
                r.require_all && r.skipped > 0 ? " (failures under --require-all)" : "");
  os << tail;
  return os.str();
}

std::string json_report(const GateReport& r) {
  using J = nlohmann::ordered_json;
  J j;
  j["schema"] = "attnoracle-report/1";
  j["suite"] = r.suite;
  j["dir"] = r.dir;
  j["implementation"] = r.implementation;
  j["profile"] = r.profile;
  j["passed"] = r.passed;
  j["failed"] = r.failed;
  j["skipped"] = r.skipped;
  j["seconds"] = r.seconds;
  j["require_all"] = r.require_all;
  j["verdict"] = gate_exit_status(r, r.require_all) == 0 ? "pass" : "fail";
  if (!r.adapter_note.empty()) j["note"] = r.adapter_note;
  if (r.shards > 0) j["shard"] = {{"index", r.shard}, {"count", r.shards}, {"selected", r.selected}};
  auto finite = [](double x) { return std::isfinite(x) ? J(x) : J(nullptr); };  // JSON has no infinity
  auto element = [&](const ElementReport& w) {
    return J{{"tensor", w.tensor},
             {"index", w.index},
             {"dtype", std::string(dtype_name(w.dtype))},
             {"expected", finite(w.expected)},
             {"expected_bits", hex_bits(w.expected_bits, w.dtype)},
             {"actual", finite(w.actual)},
             {"actual_bits", hex_bits(w.actual_bits, w.dtype)},
             {"ulp", finite(w.ulp)},
             {"bound_error", finite(w.bound_error)},
             {"limit_ratio", finite(w.limit_ratio)},
             {"error", finite(w.error)},
             {"limit", finite(w.limit)},
             {"exact_normal", exact_is_normal(w)}};
  };
  auto tier_json = [&](const Tier& s) {
    return J{{"tested", s.tested}, {"ok", s.ok},       {"elements", s.n},
             {"rows", s.rows},     {"rms", finite(s.rms)}, {"rms_limit", finite(s.rms_limit)},
             {"q99", finite(s.q99)}, {"q99_limit", finite(s.q99_limit)}, {"mean", finite(s.mean)},
             {"mean_limit", finite(s.mean_limit)}, {"headroom", s.tested ? finite(s.headroom) : J(nullptr)},
             {"bias", s.bias_tested ? finite(s.bias) : J(nullptr)},
             {"bias_limit", s.bias_tested ? finite(s.bias_limit) : J(nullptr)}};
  };
  j["skipped_cases"] = J::array();
  for (const auto& c : r.cases)
    if (c.status == CaseStatus::Skip) j["skipped_cases"].push_back({{"id", c.id}, {"reason", c.reason}});
  j["cases"] = J::array();
  for (const auto& c : r.cases) {
    J cj;
    cj["id"] = c.id;
    cj["position"] = c.position;
    cj["status"] = std::string(status_name(c.status));
    cj["dtype"] = std::string(dtype_name(c.dtype));
    if (!c.profile.empty()) cj["profile"] = c.profile;
    cj["tags"] = c.tags;
    cj["reason"] = c.reason;
    cj["failed_elements"] = c.failed_elements;
    cj["tensors"] = J::array();
    for (const auto& t : c.tensors) {
      J heads = J::array();  // per (batch, head): worst limit ratio and failed count
      for (const auto& h : c.diagnosis.heads)
        if (h.tensor == t.tensor)
          heads.push_back({{"batch", h.b}, {"head", h.h < 0 ? J(nullptr) : J(h.h)}, {"failed", h.failed},
                           {"worst_limit_ratio", finite(h.worst_ratio)}});
      cj["tensors"].push_back({{"tensor", t.tensor},
                               {"dtype", std::string(dtype_name(t.dtype))},
                               {"compared", t.compared},
                               {"worst_ulp", finite(t.worst_ulp)},
                               {"worst_bound_error", finite(t.worst_bound_error)},
                               {"worst_limit_ratio", finite(t.worst_ratio)},
                               {"mean_bound_error", finite(t.mean_bound_error)},
                               {"rms_bound_error", finite(t.rms_bound_error)},
                               {"mean_toward_zero", finite(t.mean_toward_zero)},
                               {"statistics_ok", t.statistics_ok},
                               {"largest_limit", finite(t.largest_limit)},
                               {"over_limit", t.over_limit},
                               {"tier", tier_json(t.tier)},
                               {"worst", t.worst ? element(*t.worst) : J(nullptr)},
                               {"heads", std::move(heads)}});
    }
    if (c.worst) cj["worst"] = element(*c.worst);
    const Diagnosis& d = c.diagnosis;
    if (d.failing_rows > 0 || !d.findings.empty()) {
      J dj;
      dj["failing_rows"] = d.failing_rows;
      dj["rows"] = J::array();
      for (const auto& w : d.rows)
        dj["rows"].push_back({{"tensor", w.tensor}, {"batch", w.b}, {"head", w.h < 0 ? J(nullptr) : J(w.h)},
                              {"query", w.i}, {"failed", w.failed}, {"worst_limit_ratio", finite(w.worst_ratio)}});
      dj["rows_listed_at_most"] = Diagnosis::kMaxRows;
      dj["findings"] = J::array();
      for (const auto& f : d.findings) dj["findings"].push_back({{"name", f.name}, {"text", f.text}, {"elements", f.elements}});
      cj["diagnosis"] = std::move(dj);
    }
    if (!c.pictures.empty()) cj["pictures"] = pictures_json(c.pictures);
    j["cases"].push_back(std::move(cj));
  }
  return j.dump(2, ' ', false, J::error_handler_t::replace) + "\n";  // bytes that are not UTF-8: U+FFFD
}

namespace {
std::string xml_escape(const std::string& s) {
  std::string o;
  for (unsigned char ch : valid_text(s)) {  // XML is UTF-8 throughout
    switch (ch) {
      case '&': o += "&amp;"; break;
      case '<': o += "&lt;"; break;
      case '>': o += "&gt;"; break;
      case '"': o += "&quot;"; break;
      case '\'': o += "&apos;"; break;
      default:
        if (ch < 0x20 && ch != '\n' && ch != '\t') o += ' ';  // not allowed in XML 1.0
        else o += static_cast<char>(ch);
    }
  }
  return o;
}
}  // namespace

std::string junit_report(const GateReport& r) {
  std::ostringstream os;
  os << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  // Under --require-all a skipped case is a failure here too.
  const std::size_t failures = r.failed + (r.require_all ? r.skipped : 0), skipped = r.require_all ? 0 : r.skipped;
  os << "<testsuites name=\"attnoracle\" tests=\"" << r.cases.size() << "\" failures=\"" << failures << "\" skipped=\""
     << skipped << "\" time=\"" << r.seconds << "\">\n";
  const std::string shard = r.shards > 0 ? " shard " + std::to_string(r.shard) + "/" + std::to_string(r.shards) : "";
  os << "  <testsuite name=\"" << xml_escape(r.suite + " [" + r.profile + "]" + shard) << "\" tests=\"" << r.cases.size()
     << "\" failures=\"" << failures << "\" skipped=\"" << skipped << "\">\n";
  for (const auto& c : r.cases) {
    os << "    <testcase classname=\"" << xml_escape(r.suite) << "\" name=\"" << xml_escape(c.id) << "\">";
    if (c.status == CaseStatus::Fail) {
      std::string body = c.reason;
      if (c.worst) body += "\nworst: " + worst_text(*c.worst);
      for (const auto& f : c.diagnosis.findings) body += "\nfinding: " + f.text;
      os << "\n      <failure message=\"" << xml_escape(c.reason) << "\">" << xml_escape(body) << "</failure>\n    ";
    } else if (c.status == CaseStatus::Skip && r.require_all) {
      const std::string msg = "skipped, a failure under --require-all: " + c.reason;
      os << "\n      <failure message=\"" << xml_escape(msg) << "\">" << xml_escape(msg) << "</failure>\n    ";
    } else if (c.status == CaseStatus::Skip) {
      os << "\n      <skipped message=\"" << xml_escape(c.reason) << "\"/>\n    ";
    }
    os << "</testcase>\n";
  }
  os << "  </testsuite>\n</testsuites>\n";
  return os.str();
}

}  // namespace attnoracle::conformance
