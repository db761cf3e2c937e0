// Test helpers: build rank shard files in memory or on disk, and slice full tensors into
// chunks element by element (the naive reference the extent map is checked against).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "ckptfs/format/dtype.hpp"
#include "ckptfs/layout/checkpoint.hpp"

namespace ckptfs::test {

struct ChunkSpec {
  std::string name;
  format::DType dtype = format::DType::F32;
  std::vector<uint64_t> offsets;                    // saved_offsets
  std::vector<uint64_t> sizes;                      // chunk shape
  std::optional<std::vector<uint64_t>> full_shape;  // written as DCP "shape" when set
  std::string data;                                 // chunk bytes; zero-filled when empty
};

struct ShardSpec {
  std::string file_name;
  std::vector<ChunkSpec> chunks;
  bool sharding_info = true;  // write __metadata__["DCP_SHARDING_INFO"]
};

// The whole safetensors file for a shard.
std::string make_shard_bytes(const ShardSpec& spec);

// Writes a file (creating parent directories).
void write_file(const std::string& path, const std::string& bytes);

// A temporary directory removed on destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  [[nodiscard]] const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Bit-level copy of `nbits` bits (LSB-first within bytes, as safetensors packs sub-byte types).
void copy_bits(const std::string& src, uint64_t src_bit, std::string& dst, uint64_t dst_bit,
               uint64_t nbits);

// Slices a chunk out of a full tensor, element by element.
std::string slice_chunk(const std::string& full, const std::vector<uint64_t>& shape,
                        format::DType dtype, const std::vector<uint64_t>& offsets,
                        const std::vector<uint64_t>& sizes);

// Parses shard bytes into a ShardInput (as the source layer would).
layout::ShardInput shard_input(const std::string& name, const std::string& bytes);

std::string random_bytes(std::mt19937_64& rng, size_t n);

// Adds each spec's shard (its bytes made by make_shard_bytes) to `in`; returns the bytes by file
// name, for the test to put where it reads them from.
std::map<std::string, std::string> add_shards(layout::BuildInput& in,
                                              const std::vector<ShardSpec>& specs);

// A consolidated safetensors file as save_pretrained writes one (tensors "<prefix>z.weight"
// [rows, 64], "<prefix>a.bias" [64], "<prefix>m.embed" [3], F32, random bytes from `seed`),
// with a header laid out unlike ckptfs's own (keys out of order, __metadata__ last, spaces,
// extra padding), so an exact read-back proves the header bytes were kept rather than
// re-synthesized.
std::string consolidated(uint64_t seed, uint64_t rows = 96, std::string_view prefix = "");

}  // namespace ckptfs::test
