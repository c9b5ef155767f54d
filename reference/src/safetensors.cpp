#include "attnoracle/reference/safetensors.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <set>
#include <stdexcept>
#include <string_view>

#include <nlohmann/json.hpp>

#include "attnoracle/reference/error.hpp"
#include "attnoracle/reference/file.hpp"
#include "attnoracle/reference/limits.hpp"

namespace attnoracle {
namespace {

using nlohmann::json;

constexpr std::uint64_t kMaxHeaderBytes = limits::kHeaderBytes;

std::string brief(const json& j) { return printable(j.dump()); }

std::string shape_string(const std::vector<std::int64_t>& shape) {
  // Appended piece by piece: GCC 12 at -O3 reports a false -Wrestrict on "," + std::string&&
  // (GCC bug 105329).
  std::string s = "[";
  for (std::size_t a = 0; a < shape.size(); ++a) {
    if (a) s += ',';
    s += std::to_string(shape[a]);
  }
  return s + "]";
}

std::string offsets_string(std::uint64_t begin, std::uint64_t end) {
  std::string s = "[";  // appended, as in shape_string (GCC bug 105329)
  s += std::to_string(begin);
  s += ',';
  s += std::to_string(end);
  return s + "]";
}

// A tensor entry of the header, validated except for its place among the others.
struct Entry {
  RawTensor tensor;
  std::uint64_t begin = 0, end = 0;
};

class HeaderParser {
 public:
  HeaderParser(const std::string& path, std::uint64_t data_size)
      : path_(path), data_size_(data_size) {}

  [[noreturn]] void fail(const std::string& field, const std::string& what) const {
    throw InputError(path_, field, what);
  }

  json parse(std::string_view text) {
    // Duplicate keys: nlohmann keeps the last one silently, so watch keys per object.
    std::vector<std::set<std::string>> seen;
    std::string duplicate, duplicate_in, top_key;
    auto callback = [&](int, json::parse_event_t event, json& parsed) {
      switch (event) {
        case json::parse_event_t::object_start:
          seen.emplace_back();
          break;
        case json::parse_event_t::object_end:
          seen.pop_back();
          break;
        case json::parse_event_t::key: {
          const auto& key = parsed.get_ref<const std::string&>();
          if (seen.size() == 1) top_key = key;
          if (!seen.back().insert(key).second && duplicate.empty()) {
            duplicate = key;
            duplicate_in = seen.size() == 1 ? "" : top_key;
          }
          break;
        }
        default:
          break;
      }
      return true;
    };
    // The header may be padded with spaces only (as the safetensors writer pads it).
    const std::size_t end = text.find_last_not_of(' ');
    if (end != std::string_view::npos)
      for (std::size_t k = 0; k <= end; ++k)
        if (text[k] == '\0')
          fail("header", "invalid JSON: a NUL byte at offset " + std::to_string(k));
    if (limits::json_depth(text) > limits::kJsonDepth)
      fail("header", "JSON nested deeper than " + std::to_string(limits::kJsonDepth) + " levels");
    // Counted before parsing: the parser's callback mode costs time quadratic in the members.
    if (const auto n = limits::json_top_level_members(text); n > limits::kTensors + 1)
      fail("header", std::to_string(n) + " entries, over the limit of " +
                         std::to_string(limits::kTensors) + " tensors");
    json header;
    try {
      header = json::parse(text.begin(), text.end(), callback);
    } catch (const json::exception& e) {  // parse_error; out_of_range for a number past double
      std::string what = e.what();
      if (auto pos = what.find("] "); pos != std::string::npos) what.erase(0, pos + 2);
      fail("header", "invalid JSON: " + printable(what, 200));
    }
    if (!duplicate.empty()) {
      if (duplicate_in.empty()) fail(printable(duplicate), "appears twice in the header");
      fail(printable(duplicate_in), "duplicate key \"" + printable(duplicate) + "\"");
    }
    if (!header.is_object())
      fail("header", std::string("header is a JSON ") + header.type_name() + ", not an object");
    return header;
  }

  std::map<std::string, std::string> metadata(const json& j) const {
    if (!j.is_object())
      fail("__metadata__", std::string("is a JSON ") + j.type_name() + ", not an object");
    std::map<std::string, std::string> out;
    for (const auto& [key, value] : j.items()) {
      if (!value.is_string())
        fail(printable(key),
             std::string("metadata value is a JSON ") + value.type_name() + ", not a string");
      out[key] = value.get<std::string>();
    }
    return out;
  }

  Entry entry(const std::string& name, const json& j) const {
    const std::string field = printable(name);
    if (!j.is_object())
      fail(field, std::string("header entry is a JSON ") + j.type_name() + ", not an object");
    for (const auto& [key, value] : j.items())
      if (key != "dtype" && key != "shape" && key != "data_offsets")
        fail(field,
             "unknown field \"" + printable(key) + "\" (expected dtype, shape, data_offsets)");
    for (const char* key : {"dtype", "shape", "data_offsets"})
      if (!j.contains(key)) fail(field, std::string("header entry has no \"") + key + "\"");

    Entry e;
    e.tensor.name = name;
    const json& dtype = j["dtype"];
    if (!dtype.is_string()) fail(field, "dtype " + brief(dtype) + " is not a string");
    auto type = dtype_from_name(dtype.get_ref<const std::string&>());
    if (!type) fail(field, "unknown dtype " + brief(dtype));
    e.tensor.dtype = *type;

    const json& shape = j["shape"];
    bool shape_ok = shape.is_array();
    if (shape_ok)
      for (const auto& d : shape)
        shape_ok = shape_ok && d.is_number_unsigned() &&
                   d.get<std::uint64_t>() <= std::numeric_limits<std::int64_t>::max();
    if (!shape_ok)
      fail(field, "shape " + brief(shape) + " is not an array of non-negative integers");
    std::uint64_t bytes = dtype_size(*type);
    bool overflow = false;
    for (const auto& d : shape) {
      auto n = d.get<std::uint64_t>();
      e.tensor.shape.push_back(static_cast<std::int64_t>(n));
      overflow = overflow || __builtin_mul_overflow(bytes, n, &bytes);
    }

    const json& offsets = j["data_offsets"];
    if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
        !offsets[1].is_number_unsigned())
      fail(field, "data_offsets " + brief(offsets) + " is not two non-negative integers");
    e.begin = offsets[0].get<std::uint64_t>();
    e.end = offsets[1].get<std::uint64_t>();
    const std::string range = "data_offsets " + offsets_string(e.begin, e.end);
    if (e.begin > e.end) fail(field, range + " begin after end");
    if (e.end > data_size_)
      fail(field, range + " go beyond the data area of " + std::to_string(data_size_) + " bytes");
    if (overflow)
      fail(field, "shape " + shape_string(e.tensor.shape) + " is too large for data_offsets " +
                      offsets_string(e.begin, e.end));
    if (bytes != e.end - e.begin)
      fail(field, "shape " + shape_string(e.tensor.shape) + " needs " + std::to_string(bytes) +
                      " bytes but data_offsets cover " + std::to_string(e.end - e.begin));
    return e;
  }

 private:
  const std::string& path_;
  std::uint64_t data_size_;
};

}  // namespace

std::int64_t RawTensor::numel() const {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

const RawTensor* SafeTensorsFile::find(const std::string& name) const {
  for (const auto& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

RawTensor* SafeTensorsFile::find(const std::string& name) {
  for (auto& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

void SafeTensorsFile::put(RawTensor t) {
  if (RawTensor* old = find(t.name))
    *old = std::move(t);
  else
    tensors.push_back(std::move(t));
}

namespace {

// The header length of a file of `size` bytes from its first 8 (`first`, present when size >= 8).
std::uint64_t header_length(const std::string& path, const unsigned char* first, std::uint64_t size) {
  if (size < 8)
    throw InputError(path, "header",
                     "file is " + std::to_string(size) + " bytes, too short for the 8-byte header length");
  std::uint64_t n = 0;
  for (int b = 7; b >= 0; --b) n = (n << 8) | first[b];
  const std::uint64_t rest = size - 8;
  // No real file has such a header: its first 8 bytes are something else (text, another format).
  if (n > kMaxHeaderBytes)
    throw InputError(path, "header",
                     "not a safetensors file: header length " + std::to_string(n) + " is over the limit of " +
                         std::to_string(kMaxHeaderBytes) + " bytes");
  if (n > rest)
    throw InputError(path, "header",
                     "header length " + std::to_string(n) + " exceeds the " + std::to_string(rest) +
                         " bytes after it");
  return n;
}

// The metadata and the tensors' entries (without their bytes, in offset order) of a header
// whose data area is `data_size` bytes: checked that they tile it.
std::vector<Entry> layout(const std::string& path, std::string_view text, std::uint64_t data_size,
                          SafeTensorsFile& file) {
  HeaderParser parser(path, data_size);
  // A header is a JSON object (an array is refused below, by name); anything else is another format.
  const auto start = text.find_first_not_of(" \t\r\n");
  if (start != std::string_view::npos && text[start] != '{' && text[start] != '[')
    parser.fail("header", "not a safetensors file: the header does not start with '{'");
  const json header = parser.parse(text);
  std::vector<Entry> entries;
  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      file.metadata = parser.metadata(value);
      continue;
    }
    if (name.empty()) parser.fail("header", "a tensor has an empty name");
    entries.push_back(parser.entry(name, value));
  }

  // Tensors must tile the data area: no overlap, no hole (as the safetensors reader demands).
  std::stable_sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  std::uint64_t covered = 0;
  const Entry* previous = nullptr;
  for (const auto& e : entries) {
    if (e.begin < covered)
      parser.fail(printable(e.tensor.name), "data_offsets " + offsets_string(e.begin, e.end) +
                                                " overlap those of " +
                                                printable(previous->tensor.name) + " " +
                                                offsets_string(previous->begin, previous->end));
    if (e.begin > covered)
      parser.fail("header", "data bytes [" + std::to_string(covered) + "," +
                                std::to_string(e.begin) + ") are not covered by any tensor");
    covered = e.end;
    previous = &e;
  }
  if (covered != data_size)
    parser.fail("header", "data bytes [" + std::to_string(covered) + "," +
                              std::to_string(data_size) + ") are not covered by any tensor");
  return entries;
}

// Exactly n bytes of fd into p, observed as they come; a file that ends first has shrunk.
void read_exactly(const std::string& path, int fd, unsigned char* p, std::size_t n, const ByteObserver& observe) {
  std::size_t done = 0;
  while (done < n) {
    const ssize_t r = ::read(fd, p + done, n - done);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw InputError(path, "", std::string("cannot read: ") + std::strerror(errno));
    if (r == 0) throw InputError(path, "", "shrank while it was read");
    done += static_cast<std::size_t>(r);
  }
  if (observe) observe(p, n);
}

}  // namespace

SafeTensorsFile parse_safetensors(const std::string& path,
                                  const std::vector<unsigned char>& bytes) {
  const std::uint64_t n = header_length(path, bytes.data(), bytes.size());
  const std::size_t data_start = 8 + static_cast<std::size_t>(n);
  SafeTensorsFile file;
  std::vector<Entry> entries =
      layout(path, std::string_view(reinterpret_cast<const char*>(bytes.data()) + 8, static_cast<std::size_t>(n)),
             bytes.size() - data_start, file);
  for (auto& e : entries) {
    const auto* first = bytes.data() + data_start + e.begin;
    reserve_large(e.tensor.data, static_cast<std::size_t>(e.end - e.begin));
    e.tensor.data.assign(first, first + (e.end - e.begin));
    file.tensors.push_back(std::move(e.tensor));
  }
  return file;
}

SafeTensorsFile read_safetensors(const std::string& path, int fd, std::uint64_t size, const ByteObserver& observe) {
  unsigned char first[8] = {};
  if (size >= 8) read_exactly(path, fd, first, 8, observe);
  const std::uint64_t n = header_length(path, first, size);
  std::string text(static_cast<std::size_t>(n), '\0');
  read_exactly(path, fd, reinterpret_cast<unsigned char*>(text.data()), text.size(), observe);
  SafeTensorsFile file;
  std::vector<Entry> entries = layout(path, text, size - 8 - n, file);
  text = std::string();
  // The tensors tile the data area in offset order: each one's bytes are the next ones.
  for (auto& e : entries) {
    const auto bytes = static_cast<std::size_t>(e.end - e.begin);
    reserve_large(e.tensor.data, bytes);
    e.tensor.data.resize(bytes);
    read_exactly(path, fd, e.tensor.data.data(), bytes, observe);
    file.tensors.push_back(std::move(e.tensor));
  }
  return file;
}

SafeTensorsFile read_safetensors(const std::string& path) {
  const OpenFile f = open_regular_file(path);
  return read_safetensors(path, f.fd, f.size);
}

namespace {

// Tensors sorted by name, checked, and the file's first part: the 8-byte length and the header.
std::vector<unsigned char> header_bytes(const std::map<std::string, std::string>& metadata,
                                        std::vector<const RawTensor*>& sorted) {
  std::sort(sorted.begin(), sorted.end(),
            [](const RawTensor* a, const RawTensor* b) { return a->name < b->name; });
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::uint64_t offset = 0;
  for (std::size_t i = 0; i < sorted.size(); ++i) {
    const RawTensor& t = *sorted[i];
    if (t.name.empty() || t.name == "__metadata__" || (i && sorted[i - 1]->name == t.name))
      throw std::logic_error("serialize_safetensors: bad or repeated tensor name '" + t.name + "'");
    for (auto d : t.shape)
      if (d < 0) throw std::logic_error("serialize_safetensors: negative dimension in " + t.name);
    if (t.data.size() != static_cast<std::uint64_t>(t.numel()) * dtype_size(t.dtype))
      throw std::logic_error("serialize_safetensors: data size does not match shape of " + t.name);
    header[t.name] = {{"dtype", std::string(dtype_name(t.dtype))},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + t.data.size()}}};
    offset += t.data.size();
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::vector<unsigned char> out;
  out.reserve(8 + text.size());
  for (int b = 0; b < 8; ++b) out.push_back(static_cast<unsigned char>(text.size() >> (8 * b)));
  out.insert(out.end(), text.begin(), text.end());
  return out;
}

// The process's umask, read without changing it (umask(2) would, for every thread).
mode_t process_umask() {
  static const mode_t mask = [] {
    std::FILE* f = std::fopen("/proc/self/status", "r");
    unsigned m = 022;
    if (f) {
      char line[256];
      while (std::fgets(line, sizeof line, f))
        if (std::sscanf(line, "Umask: %o", &m) == 1) break;
      std::fclose(f);
    }
    return static_cast<mode_t>(m);
  }();
  return mask;
}

// Writes the parts one after the other to a temporary name beside `path`, then renames it.
void write_parts_atomic(const std::string& path,
                        const std::vector<std::pair<const unsigned char*, std::size_t>>& parts) {
  // mkstemp creates the name exclusively: nothing planted there is written through.
  std::string tmp = path + ".tmp.XXXXXX";
  auto fail = [&](int err, bool remove_tmp) {
    if (remove_tmp) ::unlink(tmp.c_str());
    throw InputError(path, "", std::string("cannot write: ") + std::strerror(err));
  };
  const int fd = ::mkostemp(tmp.data(), O_CLOEXEC);
  if (fd < 0) fail(errno, false);
  // mkstemp gives 0600; a finished file gets the usual 0666 less the umask.
  if (::fchmod(fd, 0666 & ~process_umask()) != 0) {
    const int err = errno;
    ::close(fd);
    fail(err, true);
  }
  for (const auto& [data, size] : parts) {
    std::size_t done = 0;
    while (done < size) {
      const ssize_t w = ::write(fd, data + done, size - done);
      if (w < 0) {
        if (errno == EINTR) continue;
        const int err = errno;
        ::close(fd);
        fail(err, true);
      }
      done += static_cast<std::size_t>(w);
    }
  }
  if (::close(fd) != 0) fail(errno, true);
  if (::rename(tmp.c_str(), path.c_str()) != 0) fail(errno, true);
}

}  // namespace

std::vector<unsigned char> serialize_safetensors(const SafeTensorsFile& f) {
  std::vector<const RawTensor*> sorted;
  for (const auto& t : f.tensors) sorted.push_back(&t);
  std::vector<unsigned char> out = header_bytes(f.metadata, sorted);
  for (const RawTensor* t : sorted) out.insert(out.end(), t->data.begin(), t->data.end());
  return out;
}

void write_safetensors_atomic(const std::string& path, const std::map<std::string, std::string>& metadata,
                              std::vector<const RawTensor*> tensors) {
  const std::vector<unsigned char> head = header_bytes(metadata, tensors);
  std::vector<std::pair<const unsigned char*, std::size_t>> parts{{head.data(), head.size()}};
  for (const RawTensor* t : tensors) parts.emplace_back(t->data.data(), t->data.size());
  write_parts_atomic(path, parts);
}

void write_file_atomic(const std::string& path, const std::vector<unsigned char>& bytes) {
  write_parts_atomic(path, {{bytes.data(), bytes.size()}});
}

}  // namespace attnoracle
