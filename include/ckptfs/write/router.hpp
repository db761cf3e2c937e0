// The stream router: routes the bytes of a consolidated safetensors file, as they are written,
// straight into the rank shard files of a Plan. It holds no data, only the original header
// (to check it) and the layout geometry of the plan's chunks: the same layout::Checkpoint and
// map_range that serve the file once it is committed, so a byte goes to exactly the place it
// will be read back from.
#pragma once

#include <cerrno>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "ckptfs/format/safetensors.hpp"
#include "ckptfs/io/shard_io.hpp"
#include "ckptfs/layout/checkpoint.hpp"
#include "ckptfs/layout/extent_map.hpp"
#include "ckptfs/util/result.hpp"
#include "ckptfs/write/plan.hpp"

namespace ckptfs::write {

using io::ShardSink;  // ckptfs/io/shard_io.hpp

// The error code of a write the router cannot take in stream order: backwards, a hole, a
// rewrite, header bytes that differ from the original, or bytes past the described end. The
// caller falls back to staging the whole file and splitting it at close. Once returned, the
// router refuses every later write with it too (some bytes may already be in the sink).
inline constexpr int kNeedsStaging = EAGAIN;
[[nodiscard]] inline bool needs_staging(const Error& e) { return e.code == kNeedsStaging; }

// Not thread-safe, and holds no lock: write order is the whole contract, so the caller (one
// open file's state) serializes writes under the lock that guards that file.
class StreamRouter {
 public:
  // `header_bytes` is the file's first 8 + N bytes and `h` their parse (kept, not copied); `p`
  // and `s` the plan and shard headers made from it. `sink` must outlive the router. `what`
  // names the file.
  static Result<StreamRouter> create(std::string header_bytes,
                                     std::shared_ptr<const format::Header> hp, const Plan& p,
                                     const layout::ShardSet& s, ShardSink& sink, std::string what);

  // Accepts the next bytes of the file; they must start exactly where the last write ended.
  // The shard headers go to the sink once the original header has fully arrived and matched.
  // Errors: kNeedsStaging (see above), or the sink's own error (an EAGAIN from the sink is
  // reported as EIO so that kNeedsStaging keeps its one meaning).
  Status write(uint64_t file_offset, std::string_view bytes);
  // Takes the rest of the file, bytes [received(), file_size()), from the same offsets of the
  // file `fd` (one that holds the whole file): each run of a shard by the sink's in-kernel copy
  // where it has one (ShardSink::copy_in), else read here and written as write() does. The
  // header must have arrived through write() first.
  Status copy_rest(int fd);

  // Reads bytes [off, off + len) of the file back (clamped to its size): the header from
  // memory, the data from the shards through `pread(rank, shard_offset, dst, n)`, which must
  // fill all n bytes. Bytes not received yet read as whatever the shard holds there. The
  // inverse of write(), for readers of a file still open and for staging it whole.
  using ShardRead = std::function<Status(uint32_t rank, uint64_t off, char* dst, size_t n)>;
  Result<size_t> read(uint64_t off, size_t len, char* dst, const ShardRead& pread) const;
  // The file's header, as written (8 + N bytes) and as parsed.
  [[nodiscard]] const std::string& header() const { return header_; }
  [[nodiscard]] const std::shared_ptr<const format::Header>& parsed() const { return parsed_; }
  // Each rank's shard header as parsed (the plan's, layout::ShardLayout::parsed), rank order.
  [[nodiscard]] const std::vector<std::shared_ptr<const format::Header>>& shard_parsed() const {
    return shard_parsed_;
  }

  [[nodiscard]] bool complete() const { return pos_ == file_size_; }
  [[nodiscard]] bool failed() const { return failed_; }
  [[nodiscard]] uint64_t received() const { return pos_; }
  [[nodiscard]] uint64_t file_size() const { return file_size_; }
  // The geometry both directions use: output 0 is this file, shard r is rank r's shard. Null
  // for a file of no tensors (all header).
  [[nodiscard]] const layout::Checkpoint* geometry() const { return geo_.get(); }

 private:
  StreamRouter() = default;
  Status fail(Error e);
  Status route_data(std::string_view bytes);
  // "tensor 'name'" holding byte `x` of the file, or "header": for messages.
  [[nodiscard]] std::string tensor_at(uint64_t x) const;

  std::string what_;
  std::string header_;  // the original 8 + N bytes, to check the writer sends them unchanged
  std::shared_ptr<const format::Header> parsed_;  // header_ parsed; the geometry's too
  // Each rank's shard header: the bytes until they are sent to the sink, then only the parse.
  std::vector<std::string> shard_headers_;
  std::vector<std::shared_ptr<const format::Header>> shard_parsed_;
  // The one byte geometry (layout's): the file as the checkpoint its shards will read back as,
  // built from the plan's chunks and this header. Shard index = rank. Null: no tensors.
  std::shared_ptr<const layout::Checkpoint> geo_;
  std::vector<layout::Segment> segs_;  // write()'s scratch
  std::vector<int> no_fds_;            // -1 per rank: read() reads shards through `pread`
  ShardSink* sink_ = nullptr;
  uint64_t file_size_ = 0;
  uint64_t pos_ = 0;  // next byte expected
  bool failed_ = false;
};

// The chunk in which the write path copies a whole file (through a router, or back from one).
inline constexpr size_t kCopyChunk = 1 << 20;

// Feeds bytes [0, size) of the file `fd` through `r` in order: the split of a file that is
// already whole (at close, or after it). The header goes through write(), which checks it; the
// data by StreamRouter::copy_rest. `what` names the file in errors.
Status route_file(int fd, uint64_t size, StreamRouter& r, std::string_view what);

}  // namespace ckptfs::write
