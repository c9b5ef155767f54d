#include "attnoracle/reference/limits.hpp"

namespace attnoracle::limits {

int json_depth(std::string_view text, int cap) {
  int depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (const char ch : text) {
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (ch == '\\')
        escaped = true;
      else if (ch == '"')
        in_string = false;
      continue;
    }
    if (ch == '"') {
      in_string = true;
    } else if (ch == '[' || ch == '{') {
      if (++depth > deepest && (deepest = depth) >= cap) return deepest;
    } else if (ch == ']' || ch == '}') {
      if (depth > 0) --depth;
    }
  }
  return deepest;
}

std::uint64_t json_top_level_members(std::string_view text) {
  int depth = 0;
  std::uint64_t members = 0;
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
    } else if (ch == '[' || ch == '{') {
      ++depth;
    } else if (ch == ']' || ch == '}') {
      --depth;
    } else if (ch == ':' && depth == 1) {
      ++members;
    }
  }
  return members;
}

}  // namespace attnoracle::limits
