// layout/shard_set: one consolidated file as the rank shards it is stored as (each shard's
// header, serialized and parsed, and where each chunk sits), the data write/ and flush/ share.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ckptfs/format/safetensors.hpp"

namespace ckptfs::layout {

// One rank's shard file: its header as written (8-byte length + JSON padded to 8) and as parsed.
// `parsed` is what format::parse_header_json gives for `header` (tests/unit/test_write.cpp
// holds the two equal), so nothing downstream parses bytes this process serialized.
struct ShardLayout {
  uint32_t rank = 0;
  std::string header;
  std::shared_ptr<const format::Header> parsed;
  uint64_t data_size = 0;
  [[nodiscard]] uint64_t file_size() const { return header.size() + data_size; }
};

struct ShardSet {
  std::vector<ShardLayout> shards;  // one per rank, index = rank
  // [tensor][chunk] -> absolute offset of the chunk's bytes in its rank's shard file.
  std::vector<std::vector<uint64_t>> chunk_offset;
};

}  // namespace ckptfs::layout
