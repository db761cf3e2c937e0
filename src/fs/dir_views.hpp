// fs/dir_views: a checkpoint directory's versions (View), the shard fds a View's open files hold,
// and the per-directory state a View is revalidated from (DirState).
#pragma once

#include <sys/stat.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "ckptfs/flush/flusher.hpp"
#include "ckptfs/fs/access.hpp"
#include "ckptfs/fs/seams.hpp"
#include "ckptfs/io/gather.hpp"
#include "ckptfs/layout/checkpoint.hpp"
#include "ckptfs/source/scanner.hpp"
#include "ckptfs/util/fd.hpp"

namespace ckptfs::fs {

struct ShardFds;

// One version of a checkpoint directory.
struct View {
  std::shared_ptr<const layout::Checkpoint> ckpt;
  uint64_t generation = 0;
  int64_t mtime_ns = 0;
  bool complete = false;  // valid and settled: consolidated files are shown
  // Not complete and not settled: lookups of consolidated names wait for it, and listings
  // show names::kPending, whose content is `pending`.
  bool settling = false;
  std::string pending;
  std::string rel;  // checkpoint directory, relative to the source root
  uint64_t dir_dev = 0, dir_ino = 0;
  std::vector<Perm> inputs;  // owner and mode of every shard: who may read the synthesized files
  Perm shown;                // owner and mode shown for them (see shown_perm)
  // The directory holds commit records: files written through the mount show as written to
  // everyone, so the writer's view (rank shards listed) is only for directories without.
  bool records = false;

  mutable std::mutex fd_mu;  // guards fds; a leaf
  mutable std::weak_ptr<const ShardFds> fds;
};

// The files a view serves from memory (Kind::Index nodes, told apart by Node::output): the
// synthesized index, config.json when it came from -o hf_config (a mapped checkpoint with no
// config.json of its own), and a LoRA adapter's adapter_config.json (in its folder).
inline constexpr uint32_t kIndexFile = 0;
inline constexpr uint32_t kConfigFile = 1;
inline constexpr uint32_t kAdapterConfigFile = 2;
inline constexpr std::string_view kConfigName = "config.json";
inline const std::string& memory_file(const View& v, uint32_t which) {
  static const std::string none;
  if (which == kAdapterConfigFile) return v.ckpt->adapter ? v.ckpt->adapter->config_json : none;
  return which == kConfigFile ? v.ckpt->config_json : v.ckpt->index_json;
}

// Shard fds of one View, opened on first open of a consolidated file and verified against
// the stamps the View was built from (Impl::open_view_shards).
struct ShardFds {
  std::vector<UniqueFd> owned;
  std::vector<int> raw;                           // -1 where not needed
  std::shared_ptr<const io::ShardReader> remote;  // reads the shards whose raw fd is -1
  std::atomic<int64_t>* counter = nullptr;        // Impl::open_shard_fds, released on destruction
  // The matrices transposed tensors read, shared by the threads reading this View (internally
  // locked; mutable because readers hold the fds const).
  mutable io::StridedWindows windows;
  int64_t count = 0;
  ShardFds() = default;
  ShardFds(const ShardFds&) = delete;
  ShardFds& operator=(const ShardFds&) = delete;
  ~ShardFds() {
    if (counter) counter->fetch_sub(count);
  }
};

// What a caller of view_of needs.
enum class Need : uint8_t {
  Any,      // whether the directory is a checkpoint, and its mtime: never reads a header (a
            // view being rebuilt, or a placeholder, may be returned)
  Current,  // the current model: builds it if the inputs changed, or waits for the thread that
            // is building it (consolidated names, listings)
};

struct DirState {
  // Guards every field below; taken before NodeTable::mu_, never after (node_table.hpp).
  std::mutex mu;
  std::condition_variable built;  // signalled (with mu) when `building` ends
  bool checked = false;
  bool building = false;  // a thread is reading the shards' headers, without holding mu
  // Requests parked until `building` ends (Filesystem::when_ready): handed back, to run with
  // mu released, by the thread that ends the build.
  std::vector<std::function<void()>> parked;
  bool needs_build = false;  // the inputs listed last differ from those `view` was built from
  Clock::TimePoint next_check;
  // The inputs as listed last: what a build reads, and what settle is timed against.
  std::vector<source::DirEntry> entries;
  source::Signature sig;
  struct stat dst {};
  bool settled = false;
  // The shards as the daemon first saw them (empty when there were none): unchanged since, a
  // shard is at rest. Taken at the first check.
  std::map<std::string, layout::FileStamp> first_seen;
  int64_t mtime_ns = INT64_MIN;    // shown mtime of the directory: its own or its newest input's
  int64_t changed_ns = INT64_MIN;  // newest stamped change of the inputs or the directory
  Clock::TimePoint seen_since;     // when the daemon first saw this signature and stamp
  bool skew_logged = false;
  std::shared_ptr<const View> view;  // null: no checkpoint
  // What `view` was built from; empty for the placeholder shown until a reader needs the
  // model (a checkpoint always has at least one shard, so a real view's is never empty).
  source::Signature view_sig;
};

}  // namespace ckptfs::fs
