// io/gather: executes an extent-map plan: copies the bytes of a list of segments into one buffer.
//
// Segments of the same shard are read with one preadv per shard span (runs separated by
// small gaps are merged, the gap bytes going to a scratch sink), so a column-sharded range
// costs one system call per shard rather than one per run. Cast segments are read in blocks
// of kCastBlock source bytes and converted into place (format/cast.hpp).
#pragma once

#include <functional>
#include <span>
#include <string_view>

#include "ckptfs/io/shard_io.hpp"
#include "ckptfs/layout/extent_map.hpp"
#include "ckptfs/util/result.hpp"

namespace ckptfs::io {

struct GatherSource {
  const layout::Checkpoint* ckpt = nullptr;  // names shards in errors (else `file` does)
  std::span<const int> fds;                  // fd of each shard, indexed like ckpt->shards
  std::string_view header;                   // bytes for memory segments
  std::string_view file;                     // name for errors when there is no checkpoint
  // Reads the shards that are not files here (layout::ShardFile::remote(); their fd is -1):
  // the OpenMPI flusher's node-local targets. Null: such a shard cannot be read (EIO).
  const ShardReader* remote = nullptr;
  // Reads the shards that have no fd here and no owner elsewhere: those of a file still being
  // written, through its flusher's transaction (write::StreamRouter::read). Must fill all n.
  std::function<Status(uint32_t shard, uint64_t off, char* dst, size_t n)> staged = nullptr;

  [[nodiscard]] std::string name_of(uint32_t shard) const;
};

// Source bytes of a cast segment read and converted at a time (per thread): a cast read
// holds no more than this beyond the reply buffer, whatever the tensor's size.
inline constexpr uint64_t kCastBlock = 256 * 1024;

// Largest gap between two runs of a shard that is read through rather than split.
inline constexpr uint64_t kGatherMaxGap = 64 * 1024;

Status gather(const GatherSource& src, std::span<const layout::Segment> segs, char* dst);

}  // namespace ckptfs::io
