// Errors that reach the user as one line: "attnoracle: error: <file>: <field>: <what>".
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

namespace attnoracle {

// The length of the valid UTF-8 sequence at the start of `s` (1 to 4), or 0 when it is not
// one (a stray continuation byte, an overlong form, a surrogate, past U+10FFFF, cut short).
inline std::size_t utf8_sequence(std::string_view s) {
  const auto b = [&](std::size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(0);
  if (c < 0x80) return 1;
  std::size_t n;
  unsigned lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (c >= 0xC2 && c <= 0xDF) n = 2;
  else if (c == 0xE0) n = 3, lo = 0xA0;
  else if (c == 0xED) n = 3, hi = 0x9F;
  else if (c >= 0xE1 && c <= 0xEF) n = 3;
  else if (c == 0xF0) n = 4, lo = 0x90;
  else if (c == 0xF4) n = 4, hi = 0x8F;
  else if (c >= 0xF1 && c <= 0xF3) n = 4;
  else return 0;
  if (s.size() < n || b(1) < lo || b(1) > hi) return 0;
  for (std::size_t k = 2; k < n; ++k)
    if (b(k) < 0x80 || b(k) > 0xBF) return 0;
  return n;
}

// User text made safe for a one-line message and for JSON: control bytes (C0, DEL, and the C1
// controls U+0080 to U+009F) and bytes that are not valid UTF-8 escaped as \xNN; text longer
// than `limit` bytes cut with "...", never inside a character.
inline std::string printable(std::string_view s, std::size_t limit = 60) {
  static constexpr char hex[] = "0123456789abcdef";
  std::string out;
  std::size_t k = 0;
  auto escape = [&](unsigned char ch) {
    out += "\\x";
    out += hex[ch >> 4];
    out += hex[ch & 15];
  };
  while (k < s.size()) {
    const auto ch = static_cast<unsigned char>(s[k]);
    const std::size_t n = utf8_sequence(s.substr(k));
    if (k + (n ? n : 1) > limit) break;
    if (n == 0 || ch < 0x20 || ch == 0x7f) {
      escape(ch);
      k += 1;
    } else if (n == 2 && ch == 0xC2 && static_cast<unsigned char>(s[k + 1]) < 0xA0) {
      escape(ch);  // a C1 control, U+0080 to U+009F: two escapes
      escape(static_cast<unsigned char>(s[k + 1]));
      k += 2;
    } else {
      out.append(s.substr(k, n));
      k += n;
    }
  }
  return k < s.size() ? out + "..." : out;
}

// Bad input or bad usage: the command exits with status 2 and writes nothing.
class InputError : public std::runtime_error {
 public:
  InputError(std::string file, std::string field, const std::string& what)
      : std::runtime_error(what), file_(std::move(file)), field_(std::move(field)) {}
  const std::string& file() const { return file_; }
  const std::string& field() const { return field_; }
  // The full line, without the "attnoracle: error: " prefix.
  std::string message() const {
    std::string m = file_;
    if (!field_.empty()) m += ": " + field_;
    return m + ": " + what();
  }

 private:
  std::string file_;
  std::string field_;
};

}  // namespace attnoracle
