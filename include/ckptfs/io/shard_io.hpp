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
  // Copies `n` bytes at `src_off` of the file `src_fd` to `offset` of rank's shard, inside the
  // kernel (util's copy_range). False, with nothing copied, where this sink cannot (its shards
  // are no local files, or the kernel offers no such copy): the caller sends them by pwrite.
  virtual Result<bool> copy_in(uint32_t /*rank*/, uint64_t /*offset*/, int /*src_fd*/,
                               uint64_t /*src_off*/, uint64_t /*n*/) {
    return false;
  }
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
