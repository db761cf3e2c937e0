// The consolidate engine: materializes the consolidated HuggingFace checkpoint of a
// directory of rank shards (model-0000k-of-0000m.safetensors, the index, and the
// checkpoint's side files) through the same extent map the mount serves.
//
// Everything is written to a hidden staging directory on the destination file system
// first. When DST does not exist, the staging directory is renamed to DST at the end
// (atomic); when it exists, the files are moved in one by one, the index last. A failure
// or a stop before that point never leaves a model*.safetensors under its final name, and
// the staging directory is removed; staging left by a killed run is removed by the next.
//
// Bytes move with copy_file_range where a window's runs are long, and otherwise with
// io::gather (one preadv per shard span) into a 512 KiB buffer and one buffered pwrite per
// block. Writeback of each window is started at once (sync_file_range), so the disk writes
// while the next windows are read and the final fsync is short. Memory is bounded by
// threads x (512 KiB + a 1 MiB copy buffer), whatever the checkpoint size.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "ckptfs/layout/checkpoint.hpp"
#include "ckptfs/util/result.hpp"

namespace ckptfs::engine {

// Bytes per job (one window of one output file).
inline constexpr uint64_t kDefaultWindow = 16ull << 20;

// Copy threads when none is asked for: one per core, at least 2 (one gathers while another
// waits on the disk's queue), at most 8.
unsigned default_threads();

struct ConsolidateOptions {
  std::string src;       // the checkpoint directory (rank shards)
  std::string dst;       // the output directory (created, or filled when it exists)
  unsigned threads = 0;  // copy threads; 0: default_threads()
  uint64_t window = 0;   // bytes per job; 0: kDefaultWindow
  bool force = false;    // replace model*.safetensors / index files already in DST
  // How the model is built when it is loaded here: dtypes served (layout::set_dtype_policy;
  // the CLI passes "auto", as the mount does: NeMo's fqn_to_dtype_mapping.json applies).
  layout::BuildOptions build;
  // The model of `src` when the caller has loaded it already (the CLI does, to print its
  // problems); null: it is loaded here.
  std::shared_ptr<const layout::Checkpoint> checkpoint;
  // Told about things skipped but not fatal (a side file that is a symlink); may be empty.
  std::function<void(std::string_view)> on_warning;
};

struct ConsolidateStats {
  size_t tensors = 0;
  size_t files = 0;       // consolidated model files written
  size_t side_files = 0;  // other files copied (config.json, tokenizer files, ...)
  uint64_t bytes = 0;     // bytes of the model files
  double seconds = 0;     // from the start of the copy to the final rename
};

struct Progress {
  uint64_t done = 0;   // model-file bytes written so far
  uint64_t total = 0;  // model-file bytes in all
};

// Called on the calling thread of consolidate(): once when the copy workers have started
// (done == 0), about every 250 ms while model files are written, and once at the end of that
// phase (done == total).
using ProgressFn = std::function<void(const Progress&)>;

// Consolidates opts.src into opts.dst. `stop` (may be null) is polled by every worker: once
// it reads true the run ends with EINTR "interrupted", its staging removed and no final name
// written. Errors name the file (and the shard or tensor) concerned:
//   ENOTDIR  DST exists and is not a directory
//   EEXIST   DST already holds outputs and `force` is not set
//   EINVAL   SRC is not a complete, valid checkpoint (each problem in the message)
//   ESTALE   a shard changed between the load and the copy
//   EIO      a shard shrank while being read, or another I/O error
Result<ConsolidateStats> consolidate(const ConsolidateOptions& opts,
                                     const std::atomic<bool>* stop = nullptr,
                                     const ProgressFn& progress = {});

}  // namespace ckptfs::engine
