// safetensors headers: parse with every check the reference loader makes, and serialize.
//
// File layout: u64 little-endian N, N bytes of UTF-8 JSON, then the data buffer. Every
// tensor's data_offsets are relative to the data buffer and, sorted, tile it exactly.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ckptfs/format/dtype.hpp"
#include "ckptfs/util/result.hpp"

namespace ckptfs::format {

// The reference loader's cap on the JSON header.
inline constexpr uint64_t kMaxHeaderSize = 100'000'000;
inline constexpr uint64_t kHeaderLenBytes = 8;

// The one reader and writer of safetensors' length prefix: an unsigned 64-bit little-endian
// number. read_length_prefix needs at least kHeaderLenBytes bytes at `p`.
[[nodiscard]] inline uint64_t read_length_prefix(const void* p) {
  const auto* b = static_cast<const unsigned char*>(p);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | b[i];
  return n;
}
inline void store_le64(char* out, uint64_t n) {
  for (size_t i = 0; i < kHeaderLenBytes; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
}
// `json` with its length prefix in front: the serialized form of a header.
[[nodiscard]] std::string with_length_prefix(std::string_view json);

struct TensorEntry {
  std::string name;
  DType dtype = DType::U8;
  std::vector<uint64_t> shape;
  uint64_t begin = 0;  // [begin, end) relative to the data buffer
  uint64_t end = 0;

  [[nodiscard]] uint64_t nbytes() const { return end - begin; }
};

struct Header {
  uint64_t json_len = 0;                        // N: bytes of JSON (padding included)
  uint64_t data_size = 0;                       // bytes in the data buffer
  std::vector<TensorEntry> tensors;             // sorted by data offset
  std::map<std::string, std::string> metadata;  // __metadata__

  [[nodiscard]] uint64_t data_start() const { return kHeaderLenBytes + json_len; }
  [[nodiscard]] uint64_t file_size() const { return data_start() + data_size; }
  // A linear scan, for one-off lookups: to look up many names, index `tensors` by name.
  [[nodiscard]] const TensorEntry* find(std::string_view name) const;
  [[nodiscard]] const std::string* find_metadata(std::string_view key) const;
};

// Parses the JSON bytes of a header. `file_size` is the size of the whole file, which must
// equal 8 + json.size() + the data buffer exactly. `what` names the file in errors.
Result<Header> parse_header_json(std::string_view json, uint64_t file_size, std::string_view what);

// Reads and parses the header of an open file of size `file_size`.
Result<Header> read_header(int fd, uint64_t file_size, std::string_view what);

// The header read from a descriptor, in two steps for a caller that decides something between
// them (the write path takes its big-header lock): the announced length, checked against
// kMaxHeaderSize and the file's size (EINVAL), then the file's first kHeaderLenBytes + n bytes.
// read_header is these two and parse_header_json.
Result<uint64_t> read_header_length(int fd, uint64_t file_size, std::string_view what);
Result<std::string> read_header_prefix(int fd, uint64_t n, std::string_view what);

// Parses a whole in-memory file (header and data); used by the fuzzer and tests.
Result<Header> parse_file_bytes(std::string_view bytes, std::string_view what);

// Appends `e` to `list` packed after the entries already there (its data right after the last
// one's, as every writer of a safetensors file here lays them out): sets e.begin and e.end.
// EOVERFLOW when the data would pass 2^64 bytes.
Status append_packed(std::vector<TensorEntry>& list, TensorEntry e, uint64_t bytes);

// Serializes a header: the 8-byte length followed by compact JSON with `__metadata__` first
// (omitted when empty) and the tensors in the given order, padded with spaces so the data
// buffer starts at a multiple of `align`. Offsets must already be set.
std::string serialize_header(std::span<const TensorEntry> tensors,
                             const std::map<std::string, std::string>& metadata, size_t align = 8);

}  // namespace ckptfs::format
