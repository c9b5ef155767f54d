// The safetensors container: round trips, deterministic bytes, and every refusal of the reader.
#include "attnoracle/reference/safetensors.hpp"

#include <algorithm>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <rapidcheck/gtest.h>

#include "attnoracle/reference/error.hpp"

namespace attnoracle::testing {
namespace {

namespace fs = std::filesystem;
using Bytes = std::vector<unsigned char>;
const std::string kPath = "t.safetensors";

RawTensor tensor(const std::string& name, DType dtype, std::vector<std::int64_t> shape) {
  RawTensor t;
  t.name = name;
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.data.resize(static_cast<std::size_t>(t.numel()) * dtype_size(dtype));
  for (std::size_t b = 0; b < t.data.size(); ++b) t.data[b] = static_cast<unsigned char>(b * 7 + 1);
  return t;
}

// A file from header text and data bytes, as a careless writer might produce it.
Bytes raw_file(const std::string& header, std::size_t data_bytes = 0) {
  // One allocation, the header copied in: GCC 12 at -O3 reports a false -Warray-bounds on insert
  // after a vector of 8.
  Bytes out(8 + header.size() + data_bytes, 0);
  std::uint64_t n = header.size();
  for (std::size_t b = 0; b < 8; ++b) out[b] = static_cast<unsigned char>(n >> (8 * b));
  std::copy(header.begin(), header.end(), out.begin() + 8);
  return out;
}

std::uint64_t header_length(const Bytes& bytes) {
  std::uint64_t n = 0;
  for (int b = 7; b >= 0; --b) n = (n << 8) | bytes[static_cast<std::size_t>(b)];
  return n;
}

// An in-memory file holding `bytes`, open at its start.
struct MemFile {
  int fd;
  explicit MemFile(const Bytes& bytes) : fd(::memfd_create("t.safetensors", MFD_CLOEXEC)) {
    EXPECT_GE(fd, 0);
    EXPECT_EQ(::write(fd, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
    EXPECT_EQ(::lseek(fd, 0, SEEK_SET), 0);
  }
  ~MemFile() { ::close(fd); }
};

// The file read tensor by tensor from a file of those bytes (said to be `size` bytes long),
// the bytes it saw appended to `seen`.
SafeTensorsFile read_streamed(const Bytes& bytes, Bytes* seen = nullptr, std::uint64_t size = ~0ull) {
  const MemFile f(bytes);
  return read_safetensors(kPath, f.fd, size == ~0ull ? bytes.size() : size, [&](const unsigned char* p, std::size_t n) {
    if (seen) seen->insert(seen->end(), p, p + n);
  });
}

// Refused alike by parse_safetensors and by read_safetensors from a file.
void expect_refused(const Bytes& bytes, const std::string& field, const std::string& what) {
  for (int streamed = 0; streamed < 2; ++streamed) try {
      if (streamed) read_streamed(bytes);
      else parse_safetensors(kPath, bytes);
      ADD_FAILURE() << "accepted; expected " << field << ": " << what << (streamed ? " (streamed)" : "");
    } catch (const InputError& e) {
      EXPECT_EQ(e.file(), kPath);
      EXPECT_EQ(e.field(), field) << e.message();
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.message();
      EXPECT_EQ(e.message().find('\n'), std::string::npos) << e.message();
    }
}

void expect_same(const SafeTensorsFile& a, const SafeTensorsFile& b) {
  EXPECT_EQ(a.metadata, b.metadata);
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  for (std::size_t i = 0; i < a.tensors.size(); ++i) {
    EXPECT_EQ(a.tensors[i].name, b.tensors[i].name);
    EXPECT_EQ(a.tensors[i].dtype, b.tensors[i].dtype);
    EXPECT_EQ(a.tensors[i].shape, b.tensors[i].shape);
    EXPECT_EQ(a.tensors[i].data, b.tensors[i].data);
  }
}

SafeTensorsFile sample() {
  SafeTensorsFile f;
  f.metadata = {{"attn.format", "1"}, {"note", "héllo"}};
  f.tensors = {tensor("v", DType::F16, {1, 2, 3}), tensor("mask", DType::BOOL, {3, 5}),
               tensor("q", DType::F32, {1, 2, 3, 4}), tensor("scalar", DType::F64, {})};
  return f;
}

// ---- RawTensor and SafeTensorsFile ----

TEST(SafetensorsTensor, Numel) {
  EXPECT_EQ(tensor("a", DType::F32, {2, 3, 4}).numel(), 24);
  EXPECT_EQ(tensor("a", DType::F32, {}).numel(), 1);
  EXPECT_EQ(tensor("a", DType::F32, {5, 0}).numel(), 0);
}

TEST(SafetensorsFile, FindAndPut) {
  SafeTensorsFile f;
  f.put(tensor("a", DType::F32, {2}));
  f.put(tensor("b", DType::F64, {1}));
  f.put(tensor("a", DType::F16, {3}));
  ASSERT_EQ(f.tensors.size(), 2u);
  EXPECT_EQ(f.tensors[0].name, "a");
  EXPECT_EQ(f.tensors[0].dtype, DType::F16);
  EXPECT_EQ(f.find("b")->dtype, DType::F64);
  EXPECT_EQ(f.find("c"), nullptr);
  const SafeTensorsFile& cf = f;
  EXPECT_EQ(cf.find("a")->shape, std::vector<std::int64_t>{3});
}

// ---- Writing ----

TEST(SafetensorsWrite, RoundTrip) {
  SafeTensorsFile f = sample();
  SafeTensorsFile back = parse_safetensors(kPath, serialize_safetensors(f));
  // Laid out by name, read back in offset order: sorted by name.
  std::sort(f.tensors.begin(), f.tensors.end(),
            [](const RawTensor& a, const RawTensor& b) { return a.name < b.name; });
  expect_same(f, back);
}

TEST(SafetensorsWrite, DeterministicWhateverTheOrder) {
  SafeTensorsFile a = sample(), b = sample();
  std::reverse(b.tensors.begin(), b.tensors.end());
  EXPECT_EQ(serialize_safetensors(a), serialize_safetensors(a));
  EXPECT_EQ(serialize_safetensors(a), serialize_safetensors(b));
}

TEST(SafetensorsWrite, HeaderPaddedWithSpacesTo8) {
  for (std::string name : {"a", "ab", "abc", "abcd", "abcde", "abcdef", "abcdefg", "abcdefgh"}) {
    SafeTensorsFile f;
    f.tensors = {tensor(name, DType::F32, {2})};
    const Bytes bytes = serialize_safetensors(f);
    const std::uint64_t n = header_length(bytes);
    EXPECT_EQ(n % 8, 0u) << name;
    ASSERT_EQ(bytes.size(), 8 + n + 8);
    const std::string header(bytes.begin() + 8, bytes.begin() + 8 + static_cast<long>(n));
    const auto end = header.find_last_not_of(' ');
    EXPECT_EQ(header[end], '}');
    EXPECT_LT(n - (end + 1), 8u);
  }
}

TEST(SafetensorsWrite, ExactHeaderText) {
  SafeTensorsFile f;
  f.metadata = {{"k", "v"}};
  f.tensors = {tensor("b", DType::BF16, {1}), tensor("a", DType::BOOL, {2})};
  const Bytes bytes = serialize_safetensors(f);
  const std::string header(bytes.begin() + 8, bytes.end() - 4);
  EXPECT_EQ(header,
            R"({"__metadata__":{"k":"v"},"a":{"data_offsets":[0,2],"dtype":"BOOL","shape":[2]},)"
            R"("b":{"data_offsets":[2,4],"dtype":"BF16","shape":[1]}}  )");  // 134 + 2
}

TEST(SafetensorsWrite, NoMetadataWhenEmpty) {
  SafeTensorsFile f;
  f.tensors = {tensor("a", DType::F32, {1})};
  const Bytes bytes = serialize_safetensors(f);
  EXPECT_EQ(std::string(bytes.begin(), bytes.end()).find("__metadata__"), std::string::npos);
  EXPECT_TRUE(parse_safetensors(kPath, bytes).metadata.empty());
}

TEST(SafetensorsWrite, EmptyFile) {
  const Bytes bytes = serialize_safetensors(SafeTensorsFile{});
  EXPECT_EQ(bytes.size(), 16u);  // "{}" padded to 8
  EXPECT_TRUE(parse_safetensors(kPath, bytes).tensors.empty());
}

TEST(SafetensorsWrite, RejectsInconsistentTensors) {
  SafeTensorsFile f;
  f.tensors = {tensor("a", DType::F32, {2})};
  f.tensors[0].data.pop_back();
  EXPECT_THROW(serialize_safetensors(f), std::logic_error);
  f.tensors = {tensor("a", DType::F32, {2}), tensor("a", DType::F32, {2})};
  EXPECT_THROW(serialize_safetensors(f), std::logic_error);
}

RC_GTEST_PROP(SafetensorsWrite, RandomRoundTrip, ()) {
  SafeTensorsFile f;
  const auto count = *rc::gen::inRange<std::size_t>(0, 6);
  for (std::size_t i = 0; i < count; ++i) {
    const auto dtype = static_cast<DType>(*rc::gen::inRange(0, 15));
    const auto shape = *rc::gen::container<std::vector<std::int64_t>>(
        *rc::gen::inRange<std::size_t>(0, 4), rc::gen::inRange<std::int64_t>(0, 4));
    std::string name = "t";  // appended: GCC 12's false -Wrestrict on "t" + std::string&&
    name += std::to_string(i);
    f.put(tensor(name, dtype, shape));
  }
  if (*rc::gen::arbitrary<bool>())
    f.metadata["key"] = *rc::gen::container<std::string>(rc::gen::inRange<char>(32, 127));
  const Bytes bytes = serialize_safetensors(f);
  RC_ASSERT(header_length(bytes) % 8 == 0);
  const SafeTensorsFile back = parse_safetensors(kPath, bytes);
  RC_ASSERT(serialize_safetensors(back) == bytes);
  RC_ASSERT(back.tensors.size() == f.tensors.size());
}

// Any corrupted byte gives a file or an InputError, nothing else; reading it from a file
// tensor by tensor gives the same file, or the same refusal.
RC_GTEST_PROP(SafetensorsRead, CorruptedBytesRefusedCleanly, ()) {
  Bytes bytes = serialize_safetensors(sample());
  const auto at = *rc::gen::inRange<std::size_t>(0, bytes.size());
  bytes[at] = *rc::gen::arbitrary<unsigned char>();
  std::string parsed, streamed;
  SafeTensorsFile a, b;
  try {
    a = parse_safetensors(kPath, bytes);
  } catch (const InputError& e) {
    RC_ASSERT(e.message().find('\n') == std::string::npos);
    parsed = e.message();
  }
  try {
    b = read_streamed(bytes);
  } catch (const InputError& e) {
    streamed = e.message();
  }
  RC_ASSERT(parsed == streamed);
  RC_ASSERT(serialize_safetensors(a) == serialize_safetensors(b));
}

TEST(SafetensorsRead, StreamedSeesEveryByteInOrder) {
  const Bytes bytes = serialize_safetensors(sample());
  Bytes seen;
  expect_same(read_streamed(bytes, &seen), parse_safetensors(kPath, bytes));
  EXPECT_EQ(seen, bytes);
}

TEST(SafetensorsRead, StreamedFileThatGrewIsReadAsItsFirstBytes) {
  Bytes bytes = serialize_safetensors(sample());
  const std::size_t size = bytes.size();
  bytes.resize(size + 5, 9);
  Bytes seen;
  expect_same(read_streamed(bytes, &seen, size), parse_safetensors(kPath, serialize_safetensors(sample())));
  EXPECT_EQ(seen.size(), size);
}

TEST(SafetensorsRefuse, StreamedFileThatShrank) {
  const Bytes bytes = serialize_safetensors(sample());
  try {  // fstat said the whole size, 3 bytes were gone when they were read
    read_streamed(Bytes(bytes.begin(), bytes.end() - 3), nullptr, bytes.size());
    ADD_FAILURE() << "read";
  } catch (const InputError& e) {
    EXPECT_EQ(e.message(), kPath + ": shrank while it was read");
  }
}

// ---- Reading valid files ----

TEST(SafetensorsRead, TensorsInOffsetOrder) {
  const std::string header = R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[3,5]},)"
                             R"("b":{"dtype":"U8","shape":[3],"data_offsets":[0,3]},)"
                             R"("c":{"dtype":"U8","shape":[0],"data_offsets":[5,5]}})";
  Bytes bytes = raw_file(header, 5);
  for (std::size_t i = 0; i < 5; ++i) bytes[bytes.size() - 5 + i] = static_cast<unsigned char>(i);
  const SafeTensorsFile f = parse_safetensors(kPath, bytes);
  ASSERT_EQ(f.tensors.size(), 3u);
  EXPECT_EQ(f.tensors[0].name, "b");
  EXPECT_EQ(f.tensors[0].data, (Bytes{0, 1, 2}));
  EXPECT_EQ(f.tensors[1].name, "a");
  EXPECT_EQ(f.tensors[1].data, (Bytes{3, 4}));
  EXPECT_EQ(f.tensors[2].name, "c");
}

TEST(SafetensorsRead, AcceptsWhitespaceAndUnpaddedHeader) {
  const auto f = parse_safetensors(
      kPath, raw_file(" {\"__metadata__\" : {}, \"x\": {\"dtype\": \"I64\", \"shape\": [1], "
                      "\"data_offsets\": [0, 8]}}\n",
                      8));
  ASSERT_EQ(f.tensors.size(), 1u);
  EXPECT_EQ(f.tensors[0].dtype, DType::I64);
}

// ---- Refusals: framing ----

TEST(SafetensorsRefuse, FileShorterThan8) {
  expect_refused({}, "header", "file is 0 bytes, too short");
  expect_refused(Bytes(7, 0), "header", "file is 7 bytes, too short");
}

TEST(SafetensorsRefuse, HeaderLengthBeyondFile) {
  Bytes bytes = raw_file("{}");
  bytes[0] = 3;
  expect_refused(bytes, "header", "header length 3 exceeds the 2 bytes after it");
}

TEST(SafetensorsRefuse, HeaderLengthAbsurd) {
  Bytes bytes = raw_file("{}");
  bytes[7] = 1;  // 2^56 + 2
  expect_refused(bytes, "header", "not a safetensors file: header length 72057594037927938 is over the limit of 100000000 bytes");
}

// Another format altogether: said plainly, not as a damaged safetensors file.
TEST(SafetensorsRefuse, NotSafetensorsAtAll) {
  const std::string text = "name,value\nq,1\n";  // a CSV file: "name,val" is a header length of 3.4e18
  expect_refused(Bytes(text.begin(), text.end()), "header",
                 "not a safetensors file: header length 7809653161889456494 is over the limit");
  // 8 plausible length bytes, then no JSON object: a header must start with '{'
  Bytes bytes = raw_file("PK\x03\x04 zip");
  expect_refused(bytes, "header", "not a safetensors file: the header does not start with '{'");
  expect_refused(raw_file(" \n 12"), "header", "not a safetensors file: the header does not start with '{'");
  // a real file with a damaged header keeps its precise message
  expect_refused(raw_file(" {\"a\":"), "header", "invalid JSON");
}

TEST(SafetensorsRefuse, BadJson) {
  expect_refused(raw_file("{\"a\":"), "header", "invalid JSON");
  expect_refused(raw_file(""), "header", "invalid JSON");
  expect_refused(raw_file("{} x"), "header", "invalid JSON");
  expect_refused(raw_file("{\"a\x01\":1}"), "header", "invalid JSON");
  expect_refused(raw_file("{\"\xff\":{}}"), "header", "invalid JSON");  // not UTF-8
}

TEST(SafetensorsRefuse, HeaderNotObject) {
  expect_refused(raw_file("[1,2]"), "header", "header is a JSON array, not an object");
}

TEST(SafetensorsRefuse, DuplicateTensor) {
  expect_refused(raw_file(R"({"q":{},"q":{}})"), "q", "appears twice in the header");
}

TEST(SafetensorsRefuse, DuplicateKeyInEntry) {
  expect_refused(
      raw_file(R"({"q":{"dtype":"U8","dtype":"U8","shape":[1],"data_offsets":[0,1]}})", 1), "q",
      "duplicate key \"dtype\"");
}

TEST(SafetensorsRefuse, EmptyName) {
  expect_refused(raw_file(R"({"":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}})"), "header",
                 "empty name");
}

// ---- Refusals: entries ----

std::string entry(const std::string& dtype, const std::string& shape, const std::string& offsets,
                  const std::string& extra = "") {
  return R"({"q":{"dtype":)" + dtype + R"(,"shape":)" + shape + R"(,"data_offsets":)" + offsets +
         extra + "}}";
}

TEST(SafetensorsRefuse, EntryNotObject) {
  expect_refused(raw_file(R"({"q":[1]})"), "q", "header entry is a JSON array, not an object");
}

TEST(SafetensorsRefuse, EntryMissingField) {
  expect_refused(raw_file(R"({"q":{"dtype":"U8","shape":[0]}})"), "q",
                 "header entry has no \"data_offsets\"");
}

TEST(SafetensorsRefuse, EntryExtraField) {
  expect_refused(raw_file(entry(R"("U8")", "[1]", "[0,1]", R"(,"offset":3)"), 1), "q",
                 "unknown field \"offset\"");
}

TEST(SafetensorsRefuse, DtypeNotString) {
  expect_refused(raw_file(entry("4", "[1]", "[0,1]"), 1), "q", "dtype 4 is not a string");
}

TEST(SafetensorsRefuse, UnknownDtype) {
  expect_refused(raw_file(entry(R"("F128")", "[1]", "[0,16]"), 16), "q", "unknown dtype \"F128\"");
  expect_refused(raw_file(entry(R"("f32")", "[1]", "[0,4]"), 4), "q", "unknown dtype \"f32\"");
}

TEST(SafetensorsRefuse, BadShape) {
  for (const char* shape : {"[1,-2]", "3", "[1.0]", "[\"2\"]", "null", "[9223372036854775808]"})
    expect_refused(raw_file(entry(R"("U8")", shape, "[0,1]"), 1), "q",
                   "is not an array of non-negative integers");
}

TEST(SafetensorsRefuse, BadOffsets) {
  for (const char* offsets :
       {"[0]", "[0,1,2]", "[-1,1]", "[0,1.5]", "{}", "[0,18446744073709551616]"})
    expect_refused(raw_file(entry(R"("U8")", "[1]", offsets), 1), "q",
                   "is not two non-negative integers");
}

TEST(SafetensorsRefuse, OffsetsBeginAfterEnd) {
  expect_refused(raw_file(entry(R"("U8")", "[1]", "[2,1]"), 2), "q",
                 "data_offsets [2,1] begin after end");
}

TEST(SafetensorsRefuse, OffsetsBeyondData) {
  expect_refused(raw_file(entry(R"("F32")", "[4]", "[0,16]"), 12), "q",
                 "data_offsets [0,16] go beyond the data area of 12 bytes");
}

TEST(SafetensorsRefuse, ShapeAgainstBytes) {
  expect_refused(raw_file(entry(R"("F32")", "[1,2,3,4]", "[0,90]"), 90), "q",
                 "shape [1,2,3,4] needs 96 bytes but data_offsets cover 90");
}

TEST(SafetensorsRefuse, ShapeOverflow) {
  expect_refused(raw_file(entry(R"("F64")", "[4294967296,4294967296]", "[0,8]"), 8), "q",
                 "is too large");
}

TEST(SafetensorsRefuse, Overlap) {
  expect_refused(raw_file(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                          R"("b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})",
                          6),
                 "b", "data_offsets [2,6] overlap those of a [0,4]");
  // A tensor of size 0 inside another also breaks the tiling.
  expect_refused(raw_file(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                          R"("b":{"dtype":"U8","shape":[0],"data_offsets":[2,2]}})",
                          4),
                 "b", "overlap");
}

TEST(SafetensorsRefuse, HoleBetweenTensors) {
  expect_refused(raw_file(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
                          R"("b":{"dtype":"U8","shape":[2],"data_offsets":[3,5]}})",
                          5),
                 "header", "data bytes [2,3) are not covered by any tensor");
}

TEST(SafetensorsRefuse, HoleAtEnd) {
  expect_refused(raw_file(entry(R"("U8")", "[2]", "[0,2]"), 5), "header",
                 "data bytes [2,5) are not covered by any tensor");
}

TEST(SafetensorsRefuse, HoleAtStart) {
  expect_refused(raw_file(entry(R"("U8")", "[2]", "[1,3]"), 3), "header",
                 "data bytes [0,1) are not covered by any tensor");
}

TEST(SafetensorsRefuse, MetadataNotObject) {
  expect_refused(raw_file(R"({"__metadata__":["a"]})"), "__metadata__",
                 "is a JSON array, not an object");
}

TEST(SafetensorsRefuse, MetadataValueNotString) {
  expect_refused(raw_file(R"({"__metadata__":{"attn.window":3}})"), "attn.window",
                 "metadata value is a JSON number, not a string");
}

TEST(SafetensorsRefuse, ControlCharactersEscapedInMessages) {
  expect_refused(raw_file(R"({"a\nb":[]})"), "a\\x0ab", "not an object");
}

// ---- Files on disk ----

class SafetensorsDisk : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "attnoracle-st-XXXXXX").string();
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir = tmpl;
  }
  void TearDown() override { fs::remove_all(dir); }
  std::vector<std::string> entries() const {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename());
    std::sort(names.begin(), names.end());
    return names;
  }
  fs::path dir;
};

TEST_F(SafetensorsDisk, WriteThenRead) {
  const std::string path = dir / "a.safetensors";
  const Bytes bytes = serialize_safetensors(sample());
  write_file_atomic(path, bytes);
  write_file_atomic(path, bytes);  // replaces
  EXPECT_EQ(entries(), std::vector<std::string>{"a.safetensors"});
  EXPECT_EQ(serialize_safetensors(read_safetensors(path)), bytes);
}

TEST_F(SafetensorsDisk, WriteIntoMissingDirectory) {
  const std::string path = dir / "missing" / "a.safetensors";
  try {
    write_file_atomic(path, {1, 2, 3});
    ADD_FAILURE() << "written";
  } catch (const InputError& e) {
    EXPECT_EQ(e.file(), path);
    EXPECT_EQ(e.field(), "");
    EXPECT_STREQ(e.what(), "cannot write: No such file or directory");
  }
  EXPECT_TRUE(entries().empty());
}

TEST_F(SafetensorsDisk, WriteOverDirectoryLeavesNoTemp) {
  fs::create_directory(dir / "d");
  fs::create_directory(dir / "d" / "x");
  fs::create_directory(dir / "d" / "x" / "y");  // a non-empty directory: rename fails
  EXPECT_THROW(write_file_atomic(dir / "d" / "x", {1}), InputError);
  EXPECT_EQ(entries(), std::vector<std::string>{"d"});
  EXPECT_EQ(std::distance(fs::directory_iterator(dir / "d"), fs::directory_iterator{}), 1);
}

TEST_F(SafetensorsDisk, ReadMissingFile) {
  const std::string path = dir / "none.safetensors";
  try {
    read_safetensors(path);
    ADD_FAILURE() << "read";
  } catch (const InputError& e) {
    EXPECT_EQ(e.field(), "");
    EXPECT_STREQ(e.what(), "cannot open: No such file or directory");
  }
}

TEST_F(SafetensorsDisk, ReadDirectory) { EXPECT_THROW(read_safetensors(dir), InputError); }

TEST_F(SafetensorsDisk, ReadTruncatedFile) {
  const std::string path = dir / "a.safetensors";
  Bytes bytes = serialize_safetensors(sample());
  bytes.resize(bytes.size() - 1);
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(bytes.data()), static_cast<long>(bytes.size()));
  try {
    read_safetensors(path);
    ADD_FAILURE() << "read";
  } catch (const InputError& e) {
    EXPECT_EQ(e.file(), path);
    EXPECT_EQ(e.field(), "v");  // the last tensor in the data area
    EXPECT_NE(std::string(e.what()).find("go beyond the data area"), std::string::npos);
  }
}

}  // namespace
}  // namespace attnoracle::testing
