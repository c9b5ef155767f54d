// Errors that reach the user as one line: "attnoracle: error: <file>: <field>: <what>".
#pragma once

#include <stdexcept>
#include <string>

namespace attnoracle {

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
