// The HTML report: one self-contained page (inline style and script, no network) that draws the
// JSON report embedded in it: the cases with filters and sorting, and per failing case its
// findings and pictures.
#include <cmath>
#include <string>

#include <nlohmann/json.hpp>

#include "attnoracle/conformance/gate.hpp"
#include "attnoracle/reference/error.hpp"

namespace attnoracle::conformance {
namespace {

using J = nlohmann::ordered_json;

// kPageHead (up to the data) and kPageTail (the script that draws it).
#include "html_page.inc"

// Checks the fields of a JSON report the page reads; InputError(path, field, what) for the first
// one that is missing or of the wrong type.
struct Checker {
  const std::string& path;

  [[noreturn]] void bad(const std::string& field, const std::string& what) const { throw InputError(path, field, what); }
  const J& get(const J& o, const std::string& where, const char* key) const {
    const auto it = o.find(key);
    if (it == o.end()) bad(where + key, "missing");
    return *it;
  }
  void string(const J& o, const std::string& where, const char* key) const {
    if (!get(o, where, key).is_string()) bad(where + key, "not a string");
  }
  void count(const J& o, const std::string& where, const char* key) const {
    if (!get(o, where, key).is_number_unsigned()) bad(where + key, "not a non-negative integer");
  }
  // a number, or null (not finite)
  void number(const J& v, const std::string& field) const {
    if (!v.is_number() && !v.is_null()) bad(field, "not a number or null");
  }
  void optional_string(const J& o, const std::string& where, const char* key) const {
    if (o.contains(key)) string(o, where, key);
  }
  const J& array(const J& o, const std::string& where, const char* key) const {
    const J& a = get(o, where, key);
    if (!a.is_array()) bad(where + key, "not an array");
    return a;
  }
  void object(const J& v, const std::string& field) const {
    if (!v.is_object()) bad(field, "not an object");
  }
  // an integer, or null (no head axis)
  void head(const J& v, const std::string& field) const {
    if (!v.is_number_integer() && !v.is_null()) bad(field, "not an integer or null");
  }

  void pictures(const J& p, const std::string& at) const {
    object(p, at);
    const std::string w = at + ".";
    const J& maps = array(p, w, "maps");
    for (std::size_t k = 0; k < maps.size(); ++k) {
      const J& m = maps[k];
      const std::string mw = w + "maps[" + std::to_string(k) + "].";
      object(m, mw.substr(0, mw.size() - 1));
      string(m, mw, "tensor");
      count(m, mw, "batch");
      head(get(m, mw, "head"), mw + "head");
      head(get(m, mw, "kv_head"), mw + "kv_head");
      for (const char* key : {"rows", "cols", "cell_rows", "cell_cols"}) count(m, mw, key);
      const auto rows = m["rows"].get<std::uint64_t>(), cols = m["cols"].get<std::uint64_t>();
      const auto cr = m["cell_rows"].get<std::uint64_t>(), cc = m["cell_cols"].get<std::uint64_t>();
      if (cr == 0 || cr > rows || cr > static_cast<std::uint64_t>(Pictures::kMaxCells))
        bad(mw + "cell_rows", "must be 1 to min(rows, " + std::to_string(Pictures::kMaxCells) + ")");
      if (cc == 0 || cc > cols || cc > static_cast<std::uint64_t>(Pictures::kMaxCells))
        bad(mw + "cell_cols", "must be 1 to min(cols, " + std::to_string(Pictures::kMaxCells) + ")");
      number(get(m, mw, "worst_limit_ratio"), mw + "worst_limit_ratio");
      // cells, and means where the report has them (those written before means have not)
      for (const char* key : {"cells", "means"}) {
        if (std::string(key) == "means" && !m.contains(key)) continue;
        const J& cells = array(m, mw, key);
        if (cells.size() != cr * cc)
          bad(mw + key, std::to_string(cells.size()) + " values, cell_rows x cell_cols is " + std::to_string(cr * cc));
        for (const J& v : cells)
          if (!(v.is_null() || (v.is_number() && v.get<double>() >= 0))) bad(mw + key, "a value neither a non-negative number nor null");
      }
    }
    const J& rows = array(p, w, "rows");
    for (std::size_t k = 0; k < rows.size(); ++k) {
      const std::string rw = w + "rows[" + std::to_string(k) + "].";
      object(rows[k], rw.substr(0, rw.size() - 1));
      string(rows[k], rw, "tensor");
      count(rows[k], rw, "rows");
      const J& pts = array(rows[k], rw, "points");
      for (std::size_t q = 0; q < pts.size(); ++q) {
        const J& pt = pts[q];
        const std::string f = rw + "points[" + std::to_string(q) + "]";
        if (!pt.is_array() || pt.size() != 6) bad(f, "not [batch, head, query, keys, score magnitude, ratio]");
        if (!pt[0].is_number_unsigned() || !pt[2].is_number_unsigned() || !pt[3].is_number_unsigned())
          bad(f, "batch, query and keys must be non-negative integers");
        head(pt[1], f);
        number(pt[4], f);
        number(pt[5], f);
      }
    }
    const J& hists = array(p, w, "histograms");
    for (std::size_t k = 0; k < hists.size(); ++k) {
      const J& h = hists[k];
      const std::string hw = w + "histograms[" + std::to_string(k) + "].";
      object(h, hw.substr(0, hw.size() - 1));
      string(h, hw, "tensor");
      if (!get(h, hw, "log2_from").is_number_integer()) bad(hw + "log2_from", "not an integer");
      for (const J& v : array(h, hw, "bins"))
        if (!v.is_number_unsigned()) bad(hw + "bins", "a count that is not a non-negative integer");
      for (const char* key : {"zero", "below", "above", "infinite"}) count(h, hw, key);
    }
  }

  void report(const J& j) const {
    if (!j.is_object()) bad("", "not a JSON object");
    const J& schema = get(j, "", "schema");
    if (!schema.is_string() || schema.get<std::string>() != "attnoracle-report/1")
      bad("schema", "not attnoracle-report/1");
    for (const char* key : {"suite", "dir", "implementation", "profile", "verdict"}) string(j, "", key);
    for (const char* key : {"passed", "failed", "skipped"}) count(j, "", key);
    if (!get(j, "", "seconds").is_number()) bad("seconds", "not a number");
    optional_string(j, "", "note");
    const J& cases = array(j, "", "cases");
    for (std::size_t k = 0; k < cases.size(); ++k) {
      const J& c = cases[k];
      const std::string cw = "cases[" + std::to_string(k) + "].";
      object(c, cw.substr(0, cw.size() - 1));
      for (const char* key : {"id", "status", "dtype", "reason"}) string(c, cw, key);
      const std::string st = c["status"].get<std::string>();
      if (st != "pass" && st != "fail" && st != "skip") bad(cw + "status", "not pass, fail or skip");
      optional_string(c, cw, "profile");
      for (const J& t : array(c, cw, "tags"))
        if (!t.is_string()) bad(cw + "tags", "a tag that is not a string");
      count(c, cw, "failed_elements");
      const J& tensors = array(c, cw, "tensors");
      for (std::size_t t = 0; t < tensors.size(); ++t) {
        const std::string tw = cw + "tensors[" + std::to_string(t) + "].";
        object(tensors[t], tw.substr(0, tw.size() - 1));
        string(tensors[t], tw, "tensor");
        count(tensors[t], tw, "compared");
        for (const char* key : {"worst_ulp", "worst_limit_ratio"}) number(get(tensors[t], tw, key), tw + key);
      }
      if (c.contains("worst")) {
        const J& w = c["worst"];
        object(w, cw + "worst");
        string(w, cw + "worst.", "tensor");
        if (!get(w, cw + "worst.", "index").is_array()) bad(cw + "worst.index", "not an array");
        for (const char* key : {"expected", "actual", "ulp", "limit_ratio"}) number(get(w, cw + "worst.", key), cw + "worst." + key);
      }
      if (c.contains("diagnosis")) {
        const J& d = c["diagnosis"];
        object(d, cw + "diagnosis");
        const J& f = array(d, cw + "diagnosis.", "findings");
        for (std::size_t q = 0; q < f.size(); ++q) {
          const std::string fw = cw + "diagnosis.findings[" + std::to_string(q) + "].";
          object(f[q], fw.substr(0, fw.size() - 1));
          string(f[q], fw, "name");
          string(f[q], fw, "text");
        }
      }
      if (c.contains("pictures")) pictures(c["pictures"], cw + "pictures");
    }
  }
};

// The data as a script element's text: inside its strings "<", ">", "&", "/" and ":" escaped,
// so that nothing in it ends the script ("</script>") or reads as an address ("https://").
std::string embedded(const J& j) {
  const std::string s = j.dump(-1, ' ', true, J::error_handler_t::replace);  // ASCII only
  std::string o;
  o.reserve(s.size() + s.size() / 16);
  bool in_string = false, escaped = false;
  for (char ch : s) {
    if (in_string && !escaped) {
      switch (ch) {
        case '<': o += "\\u003c"; continue;
        case '>': o += "\\u003e"; continue;
        case '&': o += "\\u0026"; continue;
        case '/': o += "\\/"; continue;
        case ':': o += "\\u003a"; continue;
        default: break;
      }
    }
    if (in_string && escaped) escaped = false;
    else if (in_string && ch == '\\') escaped = true;
    else if (ch == '"') in_string = !in_string;
    o += ch;
  }
  return o;
}

std::string page(const J& j) { return kPageHead + embedded(j) + kPageTail; }

}  // namespace

std::string html_report(const GateReport& r) { return page(J::parse(json_report(r))); }

std::string html_report_from_json(const std::string& path, const std::string& text) {
  J j = J::parse(text, nullptr, false);
  if (j.is_discarded()) throw InputError(path, "", "not JSON (a report written by run or check with --json)");
  Checker{path}.report(j);
  return page(j);
}

}  // namespace attnoracle::conformance
