// Words and figures shared by the gate's messages and reports.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace attnoracle::conformance {

// A duration as people write it: "250 ms", "5 s", "1.5 s", "2 min 5 s", "1 h 5 min" (3
// significant digits below a minute, then whole seconds, from an hour on whole minutes).
std::string duration_text(double seconds);

// Names joined by ", ", the first `shown` of them, then "and N more" for the rest.
std::string short_list(const std::vector<std::string>& names, std::size_t shown);

}  // namespace attnoracle::conformance
