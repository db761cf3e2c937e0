// fs/dir_views: the checkpoint directories' views as a component (DirViews: each directory
// checked when its TTL passes, built off the FUSE workers' path when its inputs change, settle
// timed, announced to the kernel), and what it hands out: a directory's versions (View), the
// shard fds a View's open files hold, and the per-directory state a View is revalidated from
// (DirState). Implemented in dir_views.cpp, builds.cpp (builds) and liveness.cpp (settle).
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
#include <string_view>
#include <vector>

#include "builds.hpp"
#include "ckptfs/flush/flusher.hpp"
#include "ckptfs/fs/access.hpp"
#include "ckptfs/fs/seams.hpp"
#include "ckptfs/io/gather.hpp"
#include "ckptfs/layout/checkpoint.hpp"
#include "ckptfs/source/scanner.hpp"
#include "ckptfs/util/fd.hpp"
#include "ckptfs/util/log_limit.hpp"
#include "node_table.hpp"
#include "status.hpp"
#include "write_registry.hpp"

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
  mutable io::FactorCache factors;  // merged LoRA weights' factors (-o lora=merged), as windows
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

// The views of SRC's checkpoint directories: the component the rest of fs/ asks for a View. It
// owns the close watch and the builder threads (made at the first check, so after a daemon's
// fork) and keeps each directory's DirState in the NodeTable it is given.
class DirViews {
 public:
  // What views are made from: owned by the Filesystem, and outliving this.
  struct Deps {
    const Options& opts;
    std::string source;  // SRC's path, for messages
    int root = -1;       // SRC, open
    std::shared_ptr<const Clock> clock;
    NodeTable& nodes;              // each directory's DirState, and the kernel's names
    source::HeaderCache& headers;  // the shard headers builds read through
    flush::Flusher& flusher;       // recovers what a crashed writer left in a directory
    WriteRegistry& writes;         // evidence that a directory's changes were this daemon's
    StatusFile& status;            // build and refusal counts
  };
  explicit DirViews(Deps d) : d_(std::move(d)) {}
  DirViews(const DirViews&) = delete;
  DirViews& operator=(const DirViews&) = delete;
  // Set before the mount serves requests (null: no kernel to tell).
  void set_notifier(Notifier* n) { notifier_ = n; }

  // The view of directory `rel` (stat `dst`, FUSE inode `dir_ino`); null when it is no
  // checkpoint. `need`: see Need. `mtime_out`, when given, receives the directory's shown mtime.
  std::shared_ptr<const View> view_of(const std::string& rel, const struct stat& dst, Ino dir_ino,
                                      Need need, int64_t* mtime_out = nullptr);
  // A consolidated name looked up while `v` settles: waits, at most the settle time, until it
  // is shown or stops settling (woken early by a writer's close).
  std::shared_ptr<const View> wait_settled(const Node& dir, std::shared_ptr<const View> v);
  // Filesystem::when_ready (filesystem.hpp): whether a request for `name` in `dir_ino` can run
  // now; if not, it is parked and `resume_fn` runs once the directory's build has ended.
  bool when_ready(Ino dir_ino, std::string_view name, const std::function<void()>& resume_fn);
  // Directory (dev, ino) is checked again on its next access.
  void recheck(uint64_t dev, uint64_t ino);
  void force_revalidate(const View& v) { recheck(v.dir_dev, v.dir_ino); }
  // Every directory is checked again on its next access.
  void invalidate_all();
  void stop_builds();

 private:
  // --- dir_views.cpp: a directory checked, its View made and announced ----------------------
  void start();
  void check_locked(DirState& st, const std::string& rel, const struct stat& dst, Ino dir_ino);
  std::shared_ptr<const View> make_view(std::shared_ptr<const layout::Checkpoint> ck,
                                        const std::string& rel, const struct stat& dst,
                                        const source::Signature& sig,
                                        const std::vector<source::DirEntry>& entries, bool settled);
  void log_build(const std::string& rel, const layout::Checkpoint& ck);
  void announce(const std::shared_ptr<const View>& old, const std::shared_ptr<const View>& now,
                const std::string& rel, Ino dir_ino);
  void changed(const std::shared_ptr<const View>& old, const std::shared_ptr<const View>& now,
               Ino dir_ino);
  void drop_hidden_kids(Ino dir_ino);
  std::string source_path(const std::string& rel) const {
    return rel.empty() ? d_.source : d_.source + "/" + rel;
  }

  // --- builds.cpp: builds off the FUSE workers' path ----------------------------------------
  // What one build reads, taken under the directory's lock when it is claimed.
  struct BuildJob {
    std::vector<source::DirEntry> entries;
    source::Signature sig;
    struct stat dst {};
    bool settled = false;
    std::shared_ptr<const View> old;
    std::string rel;
    Ino dir_ino = 0;
  };
  using Resumes = std::vector<std::function<void()>>;
  // Under st.mu, with st.needs_build and no build running: sets `building`.
  BuildJob claim_locked(DirState& st, const std::string& rel, Ino dir_ino);
  // Builds the claimed view with no lock held, installs it and ends the build, however it
  // ends (an exception too): `resumes` then holds the requests parked on the directory.
  std::shared_ptr<const View> run_build(const std::shared_ptr<DirState>& st, const BuildJob& job,
                                        Resumes& resumes);
  // Runs parked requests on the builder threads (here, without them).
  void resume(Resumes& resumes);

  // --- liveness.cpp: when a checkpoint has settled -------------------------------------------
  void time_settle(DirState& st, const std::string& rel, const struct stat& dst,
                   const source::Signature& sig, bool fresh, Clock::TimePoint now);
  bool at_rest(const DirState& st, uint64_t dev, uint64_t ino, const source::Signature& sig) const;
  std::string pending_text(const layout::Checkpoint& ck, const std::string& dir) const;
  void on_close(uint64_t dev, uint64_t ino);

  Deps d_;
  Notifier* notifier_ = nullptr;
  LogLimiter logs_;                       // repeated lines about one directory
  std::atomic<uint64_t> generations_{0};  // View numbers, unique for the life of the mount
  std::once_flag started_;                // start(): the watch and the builders, made once
  // Last: destroyed first, so their threads never call into a half-destroyed DirViews.
  std::unique_ptr<CloseWatch> watcher_;
  std::unique_ptr<BuildPool> builders_;  // null: builds run on their caller (build_threads 0)
};

}  // namespace ckptfs::fs
