// Errors that reach the user as one line: "attnoracle: error: <file>: <field>: <what>".
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

namespace attnoracle {

// User text made safe for a one-line message: control bytes escaped as \xNN, text longer than
// `limit` cut with "...".
inline std::string printable(std::string_view s, std::size_t limit = 60) {
  static constexpr char hex[] = "0123456789abcdef";
  std::string out;
  for (unsigned char ch : s.substr(0, limit)) {
    if (ch < 0x20 || ch == 0x7f) {
      out += "\\x";
      out += hex[ch >> 4];
      out += hex[ch & 15];
    } else {
      out += static_cast<char>(ch);
    }
  }
  return s.size() > limit ? out + "..." : out;
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
