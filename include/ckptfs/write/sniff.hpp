// Content detection for files written into the mount: is this a consolidated safetensors file
// we should split into rank shards, a rank shard, or anything else?
//
// Writers put data in a temp name (.tmpXXXXXX) and rename it later, so the name tells us
// nothing; the first WRITE (offset 0) carries the 8-byte length and the whole JSON header.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "ckptfs/format/safetensors.hpp"
#include "ckptfs/util/result.hpp"

namespace ckptfs::write {

enum class Kind {
  NeedMore,      // not enough bytes yet, and nothing rules safetensors out
  Consolidated,  // a strict safetensors header without DCP_SHARDING_INFO: split it
  RankShard,     // a strict safetensors header with DCP_SHARDING_INFO
  Other,         // anything else, stored and read back as written
};

struct Sniffed {
  Kind kind = Kind::Other;
  uint64_t header_len = 0;               // N, once the first 8 bytes were seen and were plausible
  std::optional<format::Header> header;  // set for Consolidated and RankShard
  std::string why;                       // for Other: why it is not a checkpoint file
};

// Smallest N we accept: "{}".
inline constexpr uint64_t kMinHeaderLen = 2;

// `prefix` is the first bytes of the file; `file_size` its final size, or 0 when unknown (no
// ftruncate yet). `what` names the file in messages.
Sniffed sniff(std::string_view prefix, uint64_t file_size, std::string_view what);

// Parses a header's JSON when the file size is not known yet: offsets are validated against the
// data size the header itself describes (its tensors must still tile the buffer from 0).
Result<format::Header> parse_header_unsized(std::string_view json, std::string_view what);

}  // namespace ckptfs::write
