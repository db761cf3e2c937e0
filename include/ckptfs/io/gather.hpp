// io/gather: executes an extent-map plan: copies the bytes of a list of segments into one buffer.
//
// Segments of the same shard are read with one preadv per shard span (runs separated by
// small gaps are merged, the gap bytes going to a scratch sink), so a column-sharded range
// costs one system call per shard rather than one per run. Cast segments are read in blocks
// of kCastBlock source bytes and converted into place (format/cast.hpp); strided segments
// (transposed matrices) column group by column group from a window of their matrix shared by
// the threads reading the view (StridedWindows); merge segments (merged LoRA weights) like cast
// ones, merged with their factors (io/merge.hpp), which are read first through this same plan.
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ckptfs/io/merge.hpp"
#include "ckptfs/io/shard_io.hpp"
#include "ckptfs/layout/extent_map.hpp"
#include "ckptfs/util/result.hpp"

namespace ckptfs::io {

// The largest source span of a strided segment (a transposed matrix's column) read whole and
// kept for the next columns: a matrix up to this size is read from its shard once.
// gpt-oss's experts ([2880, 5760] bf16) are 33,177,600 bytes.
inline constexpr uint64_t kStridedWindow = 32 * 1024 * 1024;
// How many such windows one StridedWindows keeps (the least recently used is let go).
inline constexpr size_t kStridedWindows = 4;

// The source windows of strided segments, shared by every thread reading one view (fs's
// ShardFds, the loader, consolidate): the kernel's readahead sends one file's reads to several
// threads at once, and a matrix read by one serves the columns the others are asked for.
class StridedWindows {
 public:
  struct Window {
    std::unique_ptr<char[]> bytes;
    uint64_t size = 0;      // bytes held
    uint64_t capacity = 0;  // bytes allocated
  };
  // The window of shard `stamp` holding bytes [off, off + len), or null; `base` is the shard
  // offset of its first byte.
  [[nodiscard]] std::shared_ptr<const Window> find(const layout::FileStamp& stamp, uint64_t off,
                                                   uint64_t len, uint64_t& base) const;
  // A window of at least `size` bytes to fill: a let-go one no reader holds any more when there
  // is one (its pages are already touched), else a new one.
  [[nodiscard]] std::shared_ptr<Window> take(uint64_t size);
  void add(const layout::FileStamp& stamp, uint64_t off, std::shared_ptr<const Window> w);

 private:
  struct Entry {
    layout::FileStamp stamp;
    uint64_t off = 0;
    std::shared_ptr<const Window> window;
    uint64_t used = 0;
  };
  mutable std::mutex mu_;  // guards entries_, spare_ and tick_ (a window's bytes are immutable
                           // once added)
  mutable std::vector<Entry> entries_;
  std::shared_ptr<const Window> spare_;  // the last window let go, for take()
  mutable uint64_t tick_ = 0;
};

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
  // Where strided segments keep the matrices they read (null: each is read for itself, in
  // kCastBlock pieces).
  StridedWindows* windows = nullptr;
  // Where merge segments keep the LoRA factors they read (null: read for each gather).
  FactorCache* factors = nullptr;

  [[nodiscard]] std::string name_of(uint32_t shard) const;
};

// Source bytes of a cast segment read and converted at a time (per thread): a cast read
// holds no more than this beyond the reply buffer, whatever the tensor's size.
inline constexpr uint64_t kCastBlock = 256 * 1024;

// Largest gap between two runs of a shard that is read through rather than split.
inline constexpr uint64_t kGatherMaxGap = 64 * 1024;

Status gather(const GatherSource& src, std::span<const layout::Segment> segs, char* dst);

}  // namespace ckptfs::io
