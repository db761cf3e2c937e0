// io/shard_io: the two interfaces shard bytes move through: ShardSink (the write router's
// output, a flusher's transaction) and ShardReader (shards stored off this node). One header, so
// that write/, flush/ and io/gather share them without including each other.
#pragma once

#include <cstdint>
#include <string_view>

#include "ckptfs/util/result.hpp"

namespace ckptfs::io {

// Where routed bytes go: the stream router writes each rank's shard through it (a flusher's
// Transaction in the daemon, memory in tests).
class ShardSink {
 public:
  virtual ~ShardSink() = default;
  virtual Status pwrite(uint32_t rank, uint64_t offset, std::string_view bytes) = 0;
};

// Reads shards that a Flusher stored outside the source: on the node-local targets of the
// OpenMPI flusher (-o target=), named by version 2 commit records. Thread-safe.
class ShardReader {
 public:
  virtual ~ShardReader() = default;
  // Reads exactly n bytes at `off` of the shard at `path` below rank `owner`'s target, whose
  // size must be `size` (a shard changed under its record is an error, never other bytes).
  virtual Status read(int32_t owner, std::string_view path, uint64_t size, uint64_t off, char* dst,
                      size_t n) const = 0;
};

}  // namespace ckptfs::io
