// Reading and writing safetensors files: 8-byte little-endian header length, JSON header,
// row-major data. The reader validates the container completely; the case layer
// (case_file.hpp) validates what a case means.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "attnoracle/reference/dtype.hpp"

namespace attnoracle {

struct RawTensor {
  std::string name;
  DType dtype = DType::F64;
  std::vector<std::int64_t> shape;
  std::vector<unsigned char> data;  // row-major, little-endian elements

  std::int64_t numel() const;
};

struct SafeTensorsFile {
  std::map<std::string, std::string> metadata;  // "__metadata__"
  std::vector<RawTensor> tensors;               // in the order of their data offsets

  const RawTensor* find(const std::string& name) const;
  RawTensor* find(const std::string& name);
  void put(RawTensor t);  // replaces a tensor of the same name, else appends
};

// Reads and validates a file. Throws InputError(path, <tensor or key>, <what>) on anything wrong:
// short file, header length against file size, JSON syntax, non-string metadata, unknown dtype,
// shape against byte range, offsets outside the data area, overlapping or uncovered bytes.
SafeTensorsFile read_safetensors(const std::string& path);
SafeTensorsFile parse_safetensors(const std::string& path_for_messages,
                                  const std::vector<unsigned char>& bytes);
// The same from the regular file of `size` bytes open on fd at its start: each tensor's bytes
// are read from the file straight into the tensor, without the whole file in memory first.
// `observe` (when set) sees every byte read, in the file's order (to hash the file). A file that
// ends before `size` bytes is refused; one that grew is read as its first `size` bytes.
using ByteObserver = std::function<void(const unsigned char*, std::size_t)>;
SafeTensorsFile read_safetensors(const std::string& path_for_messages, int fd, std::uint64_t size,
                                 const ByteObserver& observe = {});

// Serialises deterministically: tensors sorted by name, header keys sorted, header padded with
// spaces to a multiple of 8 bytes.
std::vector<unsigned char> serialize_safetensors(const SafeTensorsFile& f);

// The bytes serialize_safetensors would give for these metadata and tensors, written straight
// to `path` the way write_file_atomic does, without assembling the file in memory.
void write_safetensors_atomic(const std::string& path, const std::map<std::string, std::string>& metadata,
                              std::vector<const RawTensor*> tensors);

// Writes to a temporary name beside `path` and renames it into place, so that a reader never
// sees a half-written file. Throws InputError(path, "", ...) when the file cannot be written.
void write_file_atomic(const std::string& path, const std::vector<unsigned char>& bytes);

}  // namespace attnoracle
