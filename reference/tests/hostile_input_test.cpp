// Hostile inputs to the format library, each one a regression: deep JSON nesting, many tensors,
// NUL padding, text that is not UTF-8, files that are not regular, temporary names planted.
#include <algorithm>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "attnoracle/reference/error.hpp"
#include "attnoracle/reference/file.hpp"
#include "attnoracle/reference/limits.hpp"
#include "attnoracle/reference/manifest.hpp"
#include "attnoracle/reference/safetensors.hpp"
#include "cli_run.hpp"

namespace attnoracle::testing {
namespace {

using Bytes = std::vector<unsigned char>;

Bytes with_header(const std::string& header, std::size_t data_bytes = 0) {
  // One allocation, the header copied in: GCC 12 at -O3 reports a false -Warray-bounds on insert
  // after a vector of 8.
  Bytes out(8 + header.size() + data_bytes, 0);
  for (std::size_t b = 0; b < 8; ++b) out[b] = static_cast<unsigned char>(header.size() >> (8 * b));
  std::copy(header.begin(), header.end(), out.begin() + 8);
  return out;
}

std::string refusal(const Bytes& bytes) {
  try {
    parse_safetensors("t.safetensors", bytes);
  } catch (const InputError& e) {
    return e.message();
  }
  return "accepted";
}

std::string nested(std::size_t depth) { return std::string(depth, '[') + std::string(depth, ']'); }

TEST(HostileJson, DepthIsCountedOutsideStrings) {
  EXPECT_EQ(limits::json_depth(R"({"a": [1, {"b": []}]})"), 4);
  EXPECT_EQ(limits::json_depth(R"({"a": "[[[[{{{{"})"), 1);
  EXPECT_EQ(limits::json_depth(R"({"a": "\"[[[["})"), 1);
  EXPECT_EQ(limits::json_depth(nested(100000)), limits::kJsonDepth + 1);  // stops counting
  EXPECT_EQ(limits::json_top_level_members(R"({"a": {"x": 1, "y": 2}, "b:c": "d:e", "c": [{"z": 0}]})"), 3u);
  EXPECT_EQ(limits::json_top_level_members("{}"), 0u);
}

TEST(HostileJson, DeepNestingInEveryFieldIsRefused) {
  for (std::size_t depth : {30000u, 200000u})
    for (const std::string& header :
         {R"({"q":{"dtype":)" + nested(depth) + R"(,"shape":[1],"data_offsets":[0,4]}})",
          R"({"q":{"dtype":"F32","shape":)" + nested(depth) + R"(,"data_offsets":[0,4]}})",
          R"({"q":{"dtype":"F32","shape":[1],"data_offsets":)" + nested(depth) + "}}"}) {
      const std::string m = refusal(with_header(header, 4));
      EXPECT_NE(m.find("t.safetensors: header: JSON nested deeper than 64 levels"), std::string::npos) << m;
    }
}

TEST(HostileJson, NestingAtTheLimitStillParses) {
  // 64 levels are allowed: the refusal is the format's own, not the limit's.
  const std::string m = refusal(with_header(R"({"__metadata__":)" + nested(63) + "}"));
  EXPECT_EQ(m.find("nested deeper"), std::string::npos) << m;
}

TEST(HostileJson, DeepManifestIsRefused) {
  std::string problem;
  try {
    vectors::parse_manifest("manifest.json", R"({"cases":)" + nested(200000) + "}", problem);
    ADD_FAILURE() << "accepted";
  } catch (const InputError& e) {
    EXPECT_EQ(e.message(), "manifest.json: invalid JSON: nested deeper than 64 levels");
  }
}

TEST(HostileJson, NumbersPastDoubleAreInvalidJson) {
  // A regression found by fuzz/manifest_fuzz.cpp (fuzz/regressions/manifest/): nlohmann throws
  // out_of_range, not parse_error, for a number that overflows a double.
  std::string problem;
  try {
    vectors::parse_manifest("manifest.json", R"({"seed": 4e741})", problem);
    ADD_FAILURE() << "accepted";
  } catch (const InputError& e) {
    EXPECT_NE(e.message().find("manifest.json: invalid JSON: number overflow"), std::string::npos) << e.message();
  }
  const std::string m = refusal(with_header(R"({"q":{"dtype":"F32","shape":[1e999],"data_offsets":[0,4]}})", 4));
  EXPECT_NE(m.find("t.safetensors: header: invalid JSON: number overflow"), std::string::npos) << m;
}

TEST(HostileJson, ManifestWithTooManyCasesIsAProblem) {
  std::string text = R"({"format": "attnoracle-vectors/1", "suite": "s", "generator": "g", "seed": 1, "cases": [)";
  for (std::uint64_t k = 0; k <= limits::kCases; ++k) text += k ? ",{}" : "{}";
  text += "]}";
  std::string problem;
  const auto t0 = std::chrono::steady_clock::now();
  vectors::parse_manifest("manifest.json", text, problem);
  EXPECT_EQ(problem, "cases: 100001 cases, over the limit of 100000");
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(20));
}

TEST(HostileTensors, ManyTensorsAreRefusedAtOnce) {
  std::string header = "{";
  for (int k = 0; k < 100000; ++k) {
    if (k) header += ',';  // appended: GCC 12's false -Wrestrict on "," + std::string&&
    header += "\"t";
    header += std::to_string(k);
    header += R"(":{"dtype":"F32","shape":[0],"data_offsets":[0,0]})";
  }
  header += "}";
  const auto t0 = std::chrono::steady_clock::now();
  const std::string m = refusal(with_header(header));
  EXPECT_EQ(m, "t.safetensors: header: 100000 entries, over the limit of 4096 tensors");
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(20));
}

TEST(HostileTensors, ManyTensorsBelowTheLimitAreFast) {
  std::string header = "{";
  for (std::uint64_t k = 0; k < limits::kTensors; ++k) {
    if (k) header += ',';  // appended: GCC 12's false -Wrestrict on "," + std::string&&
    header += "\"t";
    header += std::to_string(k);
    header += R"(":{"dtype":"F32","shape":[0],"data_offsets":[0,0]})";
  }
  header += "}";
  const auto t0 = std::chrono::steady_clock::now();
  const SafeTensorsFile f = parse_safetensors("t.safetensors", with_header(header));
  EXPECT_EQ(f.tensors.size(), limits::kTensors);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(20));
}

TEST(HostileHeader, NulPaddingIsRefused) {
  std::string header = R"({"q":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  const std::string m = refusal(with_header(header + std::string(6, '\0'), 4));
  EXPECT_NE(m.find("t.safetensors: header: invalid JSON: a NUL byte at offset"), std::string::npos) << m;
  EXPECT_EQ(refusal(with_header(header + std::string(6, ' '), 4)).find("NUL"), std::string::npos);
}

TEST(Printable, InvalidUtf8IsEscaped) {
  EXPECT_EQ(printable("caf\xc3\xa9"), "caf\xc3\xa9");           // valid: kept
  EXPECT_EQ(printable("a\xff" "b"), "a\\xffb");                 // not UTF-8
  EXPECT_EQ(printable("\xc3"), "\\xc3");                       // cut short
  EXPECT_EQ(printable("\xed\xa0\x80"), "\\xed\\xa0\\x80");     // a surrogate
  EXPECT_EQ(printable("\xc0\xaf"), "\\xc0\\xaf");               // overlong
  EXPECT_EQ(printable("\x1b[31mred"), "\\x1b[31mred");         // terminal escape
  EXPECT_EQ(printable("\xc2\x9b" "2J"), "\\xc2\\x9b2J");        // C1 control (CSI)
}

TEST(Printable, CutsBetweenCharacters) {
  // 499 ASCII bytes then a 2-byte character, cut at 500: the character is dropped whole.
  const std::string s = std::string(499, 'a') + "\xc3\xa9" + "tail";
  const std::string p = printable(s, 500);
  EXPECT_EQ(p, std::string(499, 'a') + "...");
  EXPECT_EQ(printable("ab", 2), "ab");
  EXPECT_EQ(printable("abc", 2), "ab...");
}

class HostileFiles : public ::testing::Test {
 protected:
  TempDir dir;
};

TEST_F(HostileFiles, DirectoryFifoAndDeviceAreRefusedWithoutBlocking) {
  const std::string fifo = (dir / "fifo").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  auto message = [](const std::string& p) {
    try {
      read_regular_file(p);
    } catch (const InputError& e) {
      return e.message();
    }
    return std::string("accepted");
  };
  EXPECT_EQ(message(dir.path().string()), dir.path().string() + ": is a directory, not a regular file");
  EXPECT_EQ(message(fifo), fifo + ": is a FIFO, not a regular file");
  EXPECT_EQ(message("/dev/zero"), "/dev/zero: is a device, not a regular file");
  EXPECT_FALSE(is_regular_file(fifo));
}

TEST_F(HostileFiles, SizeLimit) {
  const fs::path p = dir / "big";
  write_text(p, std::string(100, 'x'));
  EXPECT_EQ(read_regular_file(p.string(), 100).size(), 100u);
  try {
    read_regular_file(p.string(), 99);
    ADD_FAILURE() << "accepted";
  } catch (const InputError& e) {
    EXPECT_EQ(e.message(), p.string() + ": is 100 bytes, over the limit of 99");
  }
}

TEST_F(HostileFiles, SparseHugeFileIsRefusedBeforeReading) {
  const fs::path p = dir / "sparse";
  { std::ofstream(p.string()).put('x'); }
  fs::resize_file(p, 1ULL << 40);  // sparse: no disk used
  EXPECT_THROW(read_regular_file(p.string()), InputError);
}

TEST_F(HostileFiles, PlantedTemporaryNameIsNotWrittenThrough) {
  // The old predictable name <out>.tmp.<pid>, planted as a link to a file outside.
  const fs::path victim = dir / "victim", out = dir / "out.safetensors";
  write_text(victim, "precious");
  fs::create_symlink(victim, out.string() + ".tmp." + std::to_string(::getpid()));
  write_file_atomic(out.string(), Bytes{1, 2, 3});
  EXPECT_EQ(read_text(victim), "precious");
  EXPECT_EQ(read_text(out), std::string("\x01\x02\x03"));
  struct stat st {};
  ASSERT_EQ(::stat(out.c_str(), &st), 0);
  const mode_t mask = ::umask(022);
  ::umask(mask);
  EXPECT_EQ(st.st_mode & 0777, 0666 & ~mask);  // not mkstemp's 0600
}

}  // namespace
}  // namespace attnoracle::testing
