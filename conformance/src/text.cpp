// Words and figures shared by the gate's messages and reports.
#include "attnoracle/conformance/text.hpp"

#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace attnoracle::conformance {
namespace {

// x with 3 significant digits, without trailing zeros ("5", "1.5", "12.3", "250").
std::string three_digits(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g", x);
  return buf;
}

}  // namespace

std::string duration_text(double s) {
  if (std::isnan(s)) return "an unknown time";
  if (std::isinf(s)) return s > 0 ? "forever" : "an unknown time";
  if (s <= 0) return "0 s";
  // below a second in ms, below a minute in s, each unless the rounding reaches the next unit
  if (s < 1 && std::strtod(three_digits(s * 1e3).c_str(), nullptr) < 1000) return three_digits(s * 1e3) + " ms";
  if (s < 60 && std::strtod(three_digits(s).c_str(), nullptr) < 60) return three_digits(s) + " s";
  if (s < 3600 - 0.5) {
    const long long t = std::llround(s), m = t / 60, r = t % 60;
    return std::to_string(m) + " min" + (r ? " " + std::to_string(r) + " s" : "");
  }
  const long long t = std::llround(s / 60), h = t / 60, m = t % 60;
  return std::to_string(h) + " h" + (m ? " " + std::to_string(m) + " min" : "");
}

std::string short_list(const std::vector<std::string>& names, std::size_t shown) {
  std::string s;
  // all of them when naming them costs no more than "and 1 more"
  const std::size_t n = names.size() <= shown + 1 ? names.size() : shown;
  for (std::size_t k = 0; k < n; ++k) {
    if (k) s += ", ";
    s += names[k];
  }
  if (n < names.size()) s += " and " + std::to_string(names.size() - n) + " more";
  return s;
}

}  // namespace attnoracle::conformance
