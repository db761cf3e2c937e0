// A checkpoint opened for loading: its tensors and a way to produce any byte range of one.
//
// Two inputs are accepted:
//  - a directory of rank shards (shard-R-model-K-of-M.safetensors): built and validated by
//    source::load_checkpoint_path exactly as the mount does; a checkpoint with problems is
//    refused with every problem listed (file and tensor). Bytes come through the extent map
//    (layout::map_range over the tensor's range of its consolidated output file) and
//    io::gather (one preadv per shard span; column-sharded runs gathered on the host; cast
//    views converted).
//  - a consolidated HuggingFace directory (model.safetensors, or model-K-of-M.safetensors
//    with model.safetensors.index.json): every header parsed with format::read_header (all
//    of the reference loader's checks), the index checked against the files, duplicate
//    names refused.
// The files are opened once and checked against the stamps the build saw (ESTALE otherwise);
// reads are thread-safe (pread/preadv at explicit offsets).
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "ckptfs/format/dtype.hpp"
#include "ckptfs/io/gather.hpp"
#include "ckptfs/layout/checkpoint.hpp"
#include "ckptfs/layout/extent_map.hpp"
#include "ckptfs/util/fd.hpp"
#include "ckptfs/util/result.hpp"

namespace ckptfs::load {

struct TensorInfo {
  std::string name;
  format::DType dtype = format::DType::U8;
  std::vector<uint64_t> shape;
  uint64_t nbytes = 0;
};

struct SourceOptions {
  // Dtypes served from rank shards (layout::set_dtype_policy): "auto" as the mount does,
  // "stored", or a cast view ("bf16", "fp16", "fp32"). Ignored for consolidated input.
  std::string dtype = "auto";
  // The model map and config.json (source::set_map_options): as the mount's -o map= and
  // -o hf_config=; empty: built-ins detected, the directory's own config.json.
  std::string map;
  std::string hf_config;
  // Also open every file with O_DIRECT; long contiguous runs are then read through an
  // aligned bounce buffer, bypassing the page cache. Where O_DIRECT is refused (tmpfs) the
  // buffered descriptor is used and `direct_fallback()` says so.
  bool direct = false;
};

// Per-thread scratch for Source::read (no allocation once warm).
struct ReadScratch {
  std::vector<layout::Segment> segs;
  char* bounce = nullptr;  // aligned, kBounceBytes (allocated on first direct read)
  ~ReadScratch();
  ReadScratch() = default;
  ReadScratch(const ReadScratch&) = delete;
  ReadScratch& operator=(const ReadScratch&) = delete;
};

class Source {
 public:
  enum class Kind : uint8_t { RankShards, Consolidated };

  static Result<std::unique_ptr<Source>> open(const std::string& dir,
                                              const SourceOptions& opts = {});
  ~Source();
  Source(const Source&) = delete;
  Source& operator=(const Source&) = delete;

  [[nodiscard]] Kind kind() const { return kind_; }
  [[nodiscard]] const std::string& dir() const { return dir_; }
  [[nodiscard]] const std::vector<TensorInfo>& tensors() const { return tensors_; }
  // Index of a tensor by name, or -1.
  [[nodiscard]] int64_t find(std::string_view name) const;
  [[nodiscard]] uint64_t total_bytes() const;

  // Produces bytes [off, off + len) of tensor `t` into dst. Counts the source bytes read.
  Status read(uint32_t t, uint64_t off, uint64_t len, char* dst, ReadScratch& s) const;

  // Bytes read from storage so far (shard runs, cast sources, gaps read through excluded).
  [[nodiscard]] uint64_t bytes_read() const { return bytes_read_.load(); }
  // Direct I/O was asked for and at least one file or read fell back to buffered I/O.
  [[nodiscard]] bool direct_fallback() const { return direct_fallback_.load(); }

  // Bytes of the aligned bounce buffer of a direct read.
  static constexpr uint64_t kBounceBytes = 4ull << 20;
  static constexpr uint64_t kDirectAlign = 4096;
  // Shard runs at least this long are read with O_DIRECT in direct mode.
  static constexpr uint64_t kDirectMinRun = 256ull << 10;

 private:
  Source() = default;
  Status read_direct(uint32_t file, uint64_t src, uint64_t len, char* dst, ReadScratch& s) const;
  [[nodiscard]] std::string file_name(uint32_t file) const;

  Kind kind_ = Kind::RankShards;
  std::string dir_;
  std::vector<TensorInfo> tensors_;
  std::unordered_map<std::string, uint32_t> by_name_;
  // Rank shards: the checkpoint model. Consolidated: each tensor's file and absolute offset.
  std::shared_ptr<const layout::Checkpoint> ck_;
  struct Place {
    uint32_t file = 0;
    uint64_t offset = 0;
  };
  std::vector<Place> places_;
  std::vector<std::string> names_;  // consolidated file names
  std::vector<UniqueFd> fds_;
  std::vector<int> raw_;
  mutable io::StridedWindows windows_;        // transposed tensors' matrices (internally locked)
  std::vector<UniqueFd> direct_fds_;          // O_DIRECT descriptors (invalid where refused)
  std::map<std::string, std::string> index_;  // consolidated: weight_map of the index
  bool has_index_ = false;
  bool direct_ = false;
  mutable std::atomic<uint64_t> bytes_read_{0};
  mutable std::atomic<bool> direct_fallback_{false};
};

}  // namespace ckptfs::load
