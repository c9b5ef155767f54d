#include "attnoracle/reference/limits.hpp"

namespace attnoracle::limits {
namespace {

// Calls visit(ch) for every character of a JSON text outside its strings, until it returns false.
template <class Visit>
void outside_strings(std::string_view text, Visit&& visit) {
  bool in_string = false, escaped = false;
  for (const char ch : text) {
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (ch == '\\')
        escaped = true;
      else if (ch == '"')
        in_string = false;
    } else if (ch == '"') {
      in_string = true;
    } else if (!visit(ch)) {
      return;
    }
  }
}

}  // namespace

int json_depth(std::string_view text, int cap) {
  int depth = 0, deepest = 0;
  outside_strings(text, [&](char ch) {
    if (ch == '[' || ch == '{') {
      if (++depth > deepest) deepest = depth;
    } else if ((ch == ']' || ch == '}') && depth > 0) {
      --depth;
    }
    return deepest < cap;
  });
  return deepest;
}

std::uint64_t json_top_level_members(std::string_view text) {
  int depth = 0;
  std::uint64_t members = 0;
  outside_strings(text, [&](char ch) {
    if (ch == '[' || ch == '{')
      ++depth;
    else if (ch == ']' || ch == '}')
      --depth;
    else if (ch == ':' && depth == 1)
      ++members;
    return true;
  });
  return members;
}

}  // namespace attnoracle::limits
