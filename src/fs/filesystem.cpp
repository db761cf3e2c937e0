#include "ckptfs/fs/filesystem.hpp"

#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <unordered_map>

#include <spdlog/spdlog.h>
#include <nlohmann/json.hpp>

#include "ckptfs/format/names.hpp"
#include "ckptfs/format/record.hpp"
#include "ckptfs/fs/writers.hpp"
#include "ckptfs/layout/extent_map.hpp"
#include "ckptfs/source/scanner.hpp"
#include "ckptfs/source/watcher.hpp"
#include "ckptfs/util/fd.hpp"
#include "ckptfs/util/log_limit.hpp"
#include "ckptfs/util/path.hpp"
#include "ckptfs/write/budget.hpp"
#include "ckptfs/write/file.hpp"
#include "ckptfs/write/sniff.hpp"

namespace ckptfs::fs {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int64_t kNsPerSec = 1'000'000'000;

int64_t now_realtime_ns() {
  struct timespec ts {};
  ::clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<int64_t>(ts.tv_sec) * kNsPerSec + ts.tv_nsec;
}

int64_t saturating_sub(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_sub_overflow(a, b, &r)) return b < 0 ? INT64_MAX : INT64_MIN;
  return r;
}

// Nanoseconds since the epoch as a timespec. Times before 1970 are negative and keep tv_nsec
// in [0, 1e9), as POSIX requires (plain division would give a negative tv_nsec).
struct timespec to_timespec(int64_t ns) {
  int64_t sec = ns / kNsPerSec;
  int64_t rem = ns % kNsPerSec;
  if (rem < 0) {
    rem += kNsPerSec;
    --sec;
  }
  return timespec{static_cast<time_t>(sec), static_cast<long>(rem)};
}

void set_times(struct stat& st, int64_t ns) {
  st.st_mtim = st.st_ctim = st.st_atim = to_timespec(ns);
}

using format::is_model_output_name;

// Names a checkpoint directory hides: its shards, .hf_metadata, real files that the
// synthesized ones replace, and, with show_shards, a real entry named like the .shards folder
// (it is listed inside that folder instead, so no name is shown twice).
// The write path's state directory: hidden everywhere, and a reserved name.
bool is_state_name(std::string_view n) { return n == format::kStateDirName; }

// NeMo AutoModel writes this script beside its shards to make the consolidated checkpoint
// the view already is; NeMo's own consolidated output leaves it out, and so does the view.
constexpr std::string_view kNemoConsolidateScript = "consolidate.sh";

// Listed in a checkpoint directory while it settles: a read-only file saying what it waits for.
constexpr std::string_view kPendingName = ".ckptfs-pending";

bool hidden_in_checkpoint(const source::DirEntry& e, bool show_shards) {
  return source::is_shard_entry(e) || e.name == format::kHfMetadataDir ||
         e.name == kNemoConsolidateScript || e.name == kPendingName ||
         is_model_output_name(e.name) || (show_shards && e.name == kShardsDirName);
}

// The last component of a path relative to the source root.
std::string last_of(std::string_view rel) {
  auto slash = rel.rfind('/');
  return std::string(slash == std::string_view::npos ? rel : rel.substr(slash + 1));
}

std::string parent_of(std::string_view rel) {
  auto slash = rel.rfind('/');
  return slash == std::string_view::npos ? std::string() : std::string(rel.substr(0, slash));
}

uint64_t mix64(uint64_t x) {  // splitmix64's finalizer
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// --- readers --------------------------------------------------------------------------

class MemoryReader final : public FileReader {
 public:
  MemoryReader(std::shared_ptr<const void> owner, std::string_view bytes)
      : owner_(std::move(owner)), bytes_(bytes) {}
  uint64_t size() const override { return bytes_.size(); }
  void plan(uint64_t off, uint64_t len, ReadPlan& out) const override {
    out.segs.clear();
    out.direct = nullptr;
    out.src = GatherSource{nullptr, {}, bytes_, "index"};
    out.size = 0;
    if (off >= bytes_.size()) return;
    uint64_t n = std::min<uint64_t>(len, bytes_.size() - off);
    out.segs.push_back(layout::Segment{layout::Segment::kMemory, off, n});
    out.size = n;
  }

 private:
  std::shared_ptr<const void> owner_;
  std::string_view bytes_;
};

class PassthroughReader final : public FileReader {
 public:
  PassthroughReader(UniqueFd fd, uint64_t size, std::string name)
      : fd_(std::move(fd)), raw_(fd_.get()), size_(size), name_(std::move(name)) {}
  uint64_t size() const override { return size_; }
  [[nodiscard]] int fd() const { return raw_; }
  void plan(uint64_t off, uint64_t len, ReadPlan& out) const override {
    out.segs.clear();
    out.direct = nullptr;
    out.src = GatherSource{nullptr, std::span<const int>(&raw_, 1), {}, name_};
    // The file may have grown or shrunk since open: read what is there, like a plain file.
    out.size = len;
    out.segs.push_back(layout::Segment{0, off, len});
  }

 private:
  UniqueFd fd_;
  int raw_;
  uint64_t size_;
  std::string name_;
};

}  // namespace

// One version of a checkpoint directory.
struct View {
  std::shared_ptr<const layout::Checkpoint> ckpt;
  uint64_t generation = 0;
  int64_t mtime_ns = 0;
  bool complete = false;  // valid and settled: consolidated files are shown
  // Not complete and not settled: lookups of consolidated names wait for it, and listings
  // show kPendingName, whose content is `pending`.
  bool settling = false;
  std::string pending;
  std::string rel;  // checkpoint directory, relative to the source root
  uint64_t dir_dev = 0, dir_ino = 0;
  std::vector<Perm> inputs;  // owner and mode of every shard: who may read the synthesized files
  Perm shown;                // owner and mode shown for them (see shown_perm)
  // The directory holds commit records: files written through the mount show as written to
  // everyone, so the writer's view (rank shards listed) is only for directories without.
  bool records = false;

  mutable std::mutex fd_mu;  // guards fds
  mutable std::weak_ptr<const struct ShardFds> fds;
};

// Shard fds of one View, opened on first open of a consolidated file and verified against
// the stamps the View was built from.
struct ShardFds {
  std::vector<UniqueFd> owned;
  std::vector<int> raw;                              // -1 where not needed
  std::shared_ptr<const flush::ShardReader> remote;  // reads the shards whose raw fd is -1
  std::atomic<int64_t>* counter = nullptr;  // Impl::open_shard_fds, released on destruction
  int64_t count = 0;
  ShardFds() = default;
  ShardFds(const ShardFds&) = delete;
  ShardFds& operator=(const ShardFds&) = delete;
  ~ShardFds() {
    if (counter) counter->fetch_sub(count);
  }
};

namespace {

class OutputReader final : public FileReader {
 public:
  OutputReader(std::shared_ptr<const View> view, std::shared_ptr<const ShardFds> fds,
               uint32_t output)
      : view_(std::move(view)), fds_(std::move(fds)), output_(output) {}
  uint64_t size() const override { return view_->ckpt->outputs[output_].size; }
  void plan(uint64_t off, uint64_t len, ReadPlan& out) const override {
    const auto& ck = *view_->ckpt;
    layout::map_range(ck, output_, off, len, out.segs);
    out.direct = nullptr;
    out.src = GatherSource{&ck, fds_->raw, ck.outputs[output_].header, {}, fds_->remote.get()};
    out.size = 0;
    for (const auto& s : out.segs) out.size += s.len;
  }

 private:
  std::shared_ptr<const View> view_;
  std::shared_ptr<const ShardFds> fds_;
  uint32_t output_;
};

// StatusDir, StatusFile: .ckptfs/ at the root of the mount and its status.json.
enum class Kind : uint8_t {
  Dir,
  File,
  Symlink,
  Other,
  Output,
  Index,
  ShardsDir,
  Pending,
  StatusDir,
  StatusFile
};

// What a FUSE inode number stands for. Numbers are handed out on lookup and retired when the
// kernel forgets them, so the table holds only what the kernel holds.
struct Key {
  uint8_t type = 0;  // 0 real, 1 virtual file, 2 .shards, 3 the status directory and file
  uint32_t fmt = 0;  // S_IFMT of a real node: a backing number reused for another type is another
                     // node (ext4 gives a deleted file's number to the next directory)
  uint64_t dev = 0, ino = 0, gen = 0;
  std::string name;
  auto operator<=>(const Key&) const = default;
};

struct Node {
  Ino ino = 0;
  Key key;
  Kind kind = Kind::Other;
  std::string rel;  // backing path (real nodes) or the checkpoint directory (virtual, .shards)
  uint64_t dev = 0, bino = 0;        // backing identity (real nodes and .shards' directory)
  std::shared_ptr<const View> view;  // Output / Index
  uint32_t output = 0;
  uint64_t nlookup = 0;
  layout::FileStamp cached;  // stamp when last opened: decides keep_cache
  // (parent, name) pairs it was looked up under: the entries the kernel may cache for it.
  std::vector<std::pair<Ino, std::string>> links;
  // Its backing file is gone for good (unlinked through the mount, or a placeholder removed
  // at commit): its number may name another file now, which must never take this node over.
  bool retired = false;
};

// What a caller of view_of needs.
enum class Need : uint8_t {
  Any,      // whether the directory is a checkpoint, and its mtime: never reads a header (a
            // view being rebuilt, or a placeholder, may be returned)
  Current,  // the current model: builds it if the inputs changed, or waits for the thread that
            // is building it (consolidated names, listings)
};

struct DirState {
  std::mutex mu;                  // guards every field below; taken before Impl::mu_, never after
  std::condition_variable built;  // signalled (with mu) when `building` ends
  bool checked = false;
  bool building = false;     // a thread is reading the shards' headers, without holding mu
  bool needs_build = false;  // the inputs listed last differ from those `view` was built from
  Clock::time_point next_check;
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
  Clock::time_point seen_since;    // when the daemon first saw this signature and stamp
  bool skew_logged = false;
  std::shared_ptr<const View> view;  // null: no checkpoint
  // What `view` was built from; empty for the placeholder shown until a reader needs the
  // model (a checkpoint always has at least one shard, so a real view's is never empty).
  source::Signature view_sig;
};

struct DirHandle {
  std::vector<DirEntryOut> entries;
};

struct FileHandle {
  std::shared_ptr<const FileReader> reader;
  std::shared_ptr<write::WriteFile> wf;  // open for writing (or a file being written)
  Ino ino = 0;
  bool writable = false;
};

// Reads of a file that is being written: whatever the WriteFile holds now.
class WriteFileReader final : public FileReader {
 public:
  explicit WriteFileReader(std::shared_ptr<write::WriteFile> wf) : wf_(std::move(wf)) {}
  uint64_t size() const override {
    auto st = wf_->stat();
    return st ? static_cast<uint64_t>(st->st_size) : 0;
  }
  void plan(uint64_t off, uint64_t len, ReadPlan& out) const override {
    out.segs.clear();
    out.src = GatherSource{};
    out.direct = this;
    out.direct_off = off;
    out.size = len;
  }
  Result<size_t> read_direct(uint64_t off, size_t len, char* dst) const override {
    return wf_->read(off, len, dst);
  }

 private:
  std::shared_ptr<write::WriteFile> wf_;
};

}  // namespace

Result<size_t> execute(const ReadPlan& p, char* dst) {
  if (p.direct) return p.direct->read_direct(p.direct_off, static_cast<size_t>(p.size), dst);
  if (p.passthrough()) {
    const auto& seg = p.segs[0];
    size_t done = 0;
    while (done < seg.len) {
      ssize_t n =
          ::pread(p.src.fds[0], dst + done, seg.len - done, static_cast<off_t>(seg.src + done));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        int e = errno;
        return make_error(e, "{}: read failed: {}", p.src.file, std::strerror(e));
      }
      if (n == 0) break;
      done += static_cast<size_t>(n);
    }
    return done;
  }
  CKPTFS_CHECK(gather(p.src, p.segs, dst));
  return static_cast<size_t>(p.size);
}

Status check_extents(const ReadPlan& p) {
  if (p.src.ckpt == nullptr) return {};  // a plain file reads like the file: short at its end
  // Segments per request are few (the splice path takes at most 16); a pass per shard is fine.
  for (size_t i = 0; i < p.segs.size(); ++i) {
    const auto& g = p.segs[i];
    if (g.is_memory() || p.src.fds[g.shard] < 0) continue;  // remote: its owner checks
    bool seen = false;
    for (size_t j = 0; j < i && !seen; ++j)
      seen = !p.segs[j].is_memory() && p.segs[j].shard == g.shard;
    if (seen) continue;
    uint64_t end = 0;
    for (const auto& h : p.segs) {
      if (!h.is_memory() && h.shard == g.shard) end = std::max(end, h.src + h.src_len());
    }
    struct stat st {};
    if (::fstat(p.src.fds[g.shard], &st) != 0) {
      return make_error(errno, "{}: stat failed: {}", p.src.name_of(g.shard), std::strerror(errno));
    }
    if (static_cast<uint64_t>(st.st_size) < end) {
      return make_error(EIO, "{}: shrank to {} bytes under an open file that reads up to {}",
                        p.src.name_of(g.shard), st.st_size, end);
    }
  }
  return {};
}

Result<size_t> FileReader::read_direct(uint64_t, size_t, char*) const {
  return make_error(EIO, "this file has no direct reads");
}

Result<size_t> FileReader::read(uint64_t off, size_t len, char* dst) const {
  ReadPlan p;
  plan(off, len, p);
  return execute(p, dst);
}

struct Filesystem::Impl {
  Options opts;
  std::string source;
  UniqueFd root;
  uint64_t root_dev = 0, root_ino = 0;
  source::HeaderCache headers;
  // Shard fds held by open consolidated files, bounded by RLIMIT_NOFILE less a reserve for
  // FUSE, plain files and header scans that scales with the limit.
  std::atomic<int64_t> open_shard_fds{0};
  int64_t fd_budget = 0;
  std::atomic<uint64_t> generations{0};  // View numbers, unique for the life of the mount
  Notifier* notifier = nullptr;
  std::shared_ptr<flush::Flusher> flusher;
  std::unique_ptr<write::MemoryBudget> budget;  // the write path's memory (Options::write_memory)
  int protected_regular = 0;                    // Options::protected_regular, resolved
  LogLimiter logs;                              // repeated lines about one directory
  std::unique_ptr<WriterViews> writers;         // who sees which directory as written

  // Directory node `dir` as the writer's view tells directories apart (its birth time too).
  WriterViews::DirId dir_id(const Node& dir) {
    struct statx sx {};
    const bool top = dir.rel.empty();
    int64_t birth = 0;
    if (::statx(root.get(), top ? "" : dir.rel.c_str(),
                AT_SYMLINK_NOFOLLOW | (top ? AT_EMPTY_PATH : 0), STATX_BTIME, &sx) == 0 &&
        (sx.stx_mask & STATX_BTIME)) {
      birth = static_cast<int64_t>(sx.stx_btime.tv_sec) * kNsPerSec + sx.stx_btime.tv_nsec;
    }
    return WriterViews::DirId{dir.dev, dir.bino, birth};
  }
  // The parent of directory node `dir` in SRC (none for the root).
  std::optional<WriterViews::DirId> parent_id(const Node& dir) {
    if (dir.links.empty()) return std::nullopt;
    auto p = get(dir.links.front().first);
    if (!p) return std::nullopt;
    return dir_id(*p);
  }
  // `who` wrote in directory `dir`.
  void note_writer(const Node& dir, const Caller& who) {
    if (who.pid > 0) writers->note(dir_id(dir), parent_id(dir), who.pid);
  }
  // `who` wrote in the directory of file node `ino`.
  void note_writer_of(Ino ino, const Caller& who) {
    if (who.pid <= 0) return;
    auto n = get(ino);
    if (!n || n->links.empty()) return;
    if (auto d = get(n->links.front().first)) note_writer(*d, who);
  }
  // Whether `who` sees checkpoint directory `dir` as written.
  bool sees_written(const Node& dir, const Caller& who) {
    if (who.pid <= 0 || writers->none()) return false;
    return writers->sees_written(dir_id(dir), parent_id(dir), who.pid);
  }

  // What .ckptfs/status.json reports beyond the current state of each directory.
  const int64_t started_ns = now_realtime_ns();
  std::atomic<uint64_t> reads{0}, bytes_read{0};  // read requests, and the bytes they return
  std::atomic<uint64_t> builds{0}, refusals{0};   // checkpoint models read; of those invalid
  std::atomic<uint64_t> errors{0};                // operations failed with an unexpected errno
  std::mutex status_mu_;  // guards status_extra_ and errors_by_errno_; a leaf
  StatusExtra status_extra_;
  std::map<int, uint64_t> errors_by_errno_;

  // Files open for writing, by backing identity (the state of a file is keyed by its inode:
  // its final name only arrives with a rename), and when this daemon last changed each
  // directory: a checkpoint written through the view shows at once, with no settle wait.
  struct Writing {
    std::weak_ptr<write::WriteFile> wf;
    std::pair<uint64_t, uint64_t> dir;  // the directory it was opened in
    bool shard_named = false;           // named like a rank shard (a DCP save into the view)
  };
  using DevIno = std::pair<uint64_t, uint64_t>;
  std::mutex writes_mu_;  // guards writes_, touched_ns_ and produced_; a leaf
  std::map<DevIno, Writing> writes_;
  std::map<DevIno, int64_t> touched_ns_;

  std::shared_ptr<write::WriteFile> writing(uint64_t dev, uint64_t ino) {
    std::lock_guard lock(writes_mu_);
    auto it = writes_.find({dev, ino});
    if (it == writes_.end()) return nullptr;
    auto wf = it->second.wf.lock();
    if (!wf) writes_.erase(it);
    return wf;
  }

  // Records that this daemon just changed directory (dev, ino).
  void touched(uint64_t dev, uint64_t ino) {
    std::lock_guard lock(writes_mu_);
    if (touched_ns_.size() > 4096) touched_ns_.clear();  // only recent changes matter
    touched_ns_[{dev, ino}] = now_realtime_ns();
  }

  // Whether every shard of directory (dev, ino) is at rest: unchanged since the daemon first
  // looked at the directory, or closed by its writer since its last change (inotify). Commit
  // records and the mapping file (names with a '/') need no such evidence: the first is renamed
  // into place whole, the second is proven whole by parsing.
  bool at_rest(const DirState& st, uint64_t dev, uint64_t ino, const source::Signature& sig) const {
    bool any = false;
    for (const auto& [name, stamp] : sig.files) {
      if (name.find('/') != std::string::npos) continue;
      any = true;
      auto f = st.first_seen.find(name);
      if (f != st.first_seen.end() && f->second == stamp) continue;
      if (watcher && watcher->closed(dev, ino, name, stamp.mtime_ns)) continue;
      return false;
    }
    return any;
  }

  // The content of kPendingName: why a checkpoint directory shows no consolidated file yet.
  std::string pending_text(const layout::Checkpoint& ck, const std::string& dir) const {
    const double settle_s = std::chrono::duration<double>(opts.settle).count();
    std::string t = fmt::format("{}: not shown yet.\n", dir);
    if (ck.valid()) {
      t += fmt::format(
          "Its shards are complete, but they changed less than {} s ago and the close of every "
          "shard's writer was not seen. It is shown once each shard is closed, or after {} s "
          "without changes.\n",
          settle_s, settle_s);
      return t;
    }
    t += fmt::format(
        "Incomplete so far (it is shown once every shard is complete and closed, or quiet for "
        "{} s):\n",
        settle_s);
    size_t n = 0;
    for (const auto& p : ck.problems) {
      if (++n > 32) {
        t += fmt::format("  ... and {} more\n", ck.problems.size() - 32);
        break;
      }
      t += "  " + p.to_string() + "\n";
    }
    return t;
  }

  // A writer closed a file of directory (dev, ino): check it again now, and wake lookups
  // waiting for it to settle. Runs on the watcher's thread.
  void on_close(uint64_t dev, uint64_t ino) {
    std::shared_ptr<DirState> st;
    {
      std::lock_guard lock(mu_);
      auto it = dirs_.find({dev, ino});
      if (it == dirs_.end()) return;
      st = it->second;
    }
    {
      std::lock_guard lock(st->mu);
      st->next_check = Clock::now();
    }
    st->built.notify_all();
  }

  // Whether every change of directory (dev, ino) up to `changed_ns` was this daemon's, and no
  // rank shard is still being written there.
  // ...and every input of the checkpoint (`sig`) is a file this daemon finished writing, as
  // it is now: shards another writer put there (another node, a job writing SRC directly)
  // still wait for settle.
  bool quiet_by_us(uint64_t dev, uint64_t ino, int64_t changed_ns, const source::Signature& sig) {
    std::vector<std::shared_ptr<write::WriteFile>> seen;  // released after the lock
    std::lock_guard lock(writes_mu_);
    auto t = touched_ns_.find({dev, ino});
    if (t == touched_ns_.end() || changed_ns > t->second) return false;
    for (const auto& [name, stamp] : sig.files) {
      if (!produced_.count(stamp_key(stamp))) return false;
    }
    for (auto it = writes_.begin(); it != writes_.end();) {
      auto wf = it->second.wf.lock();
      if (!wf) {
        it = writes_.erase(it);
        continue;
      }
      // A consolidated file being written changes nothing shown until its commit, which is
      // atomic; a rank shard written in place (a DCP save) does.
      const bool busy = it->second.dir == DevIno{dev, ino} && it->second.shard_named && wf->dirty();
      seen.push_back(std::move(wf));
      if (busy) return false;
      ++it;
    }
    return true;
  }

  using StampKey = std::tuple<uint64_t, uint64_t, uint64_t, int64_t, int64_t>;
  static StampKey stamp_key(const layout::FileStamp& s) {
    return {s.dev, s.ino, s.size, s.mtime_ns, s.ctime_ns};
  }
  // Records that this daemon finished writing these files of directory `dirfd`, as they are.
  void produced(int dirfd, const std::vector<std::string>& names) {
    std::vector<StampKey> keys;
    for (const auto& n : names) {
      struct stat st {};
      if (::fstatat(dirfd, n.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) {
        keys.push_back(stamp_key(source::stamp_of(st)));
      }
    }
    std::lock_guard lock(writes_mu_);
    if (produced_.size() > 65536) produced_.clear();  // only recent writes matter
    produced_.insert(keys.begin(), keys.end());
  }
  std::set<StampKey> produced_;  // files this daemon finished writing, by stamp (writes_mu_)

  // Lock order: DirState::mu -> mu_. The header cache has its own leaf lock.
  mutable std::mutex mu_;  // guards nodes_, keys_, next_ino_, dirs_
  std::unordered_map<Ino, std::shared_ptr<Node>> nodes_;
  std::map<Key, Ino> keys_;      // the inode number of every node the kernel holds
  Ino next_ino_ = kRootIno + 1;  // never reused: a retired number never names another file
  std::map<std::pair<uint64_t, uint64_t>, std::shared_ptr<DirState>> dirs_;
  // (parent, name) -> the node the kernel may hold under that name: a listing that no
  // longer shows it tells the kernel to drop the entry (see drop_vanished).
  std::map<std::pair<Ino, std::string>, Ino> kids_;

  // Open handles, owned here: the kernel releases them asynchronously, and one a signal or
  // an unmount overtakes is freed when the Filesystem goes rather than leaked.
  std::mutex handles_mu_;  // guards files_ and dirs_open_; a leaf
  std::unordered_map<uint64_t, std::unique_ptr<FileHandle>> files_;
  std::unordered_map<uint64_t, std::unique_ptr<DirHandle>> dirs_open_;

  template <typename H>
  static uint64_t adopt(std::mutex& mu, std::unordered_map<uint64_t, std::unique_ptr<H>>& m,
                        std::unique_ptr<H> h) {
    const auto id = reinterpret_cast<uint64_t>(h.get());
    std::lock_guard lock(mu);
    m.emplace(id, std::move(h));
    return id;
  }
  template <typename H>
  static void drop(std::mutex& mu, std::unordered_map<uint64_t, std::unique_ptr<H>>& m,
                   uint64_t id) {
    std::unique_ptr<H> gone;  // destroyed after the lock is released
    std::lock_guard lock(mu);
    if (auto it = m.find(id); it != m.end()) {
      gone = std::move(it->second);
      m.erase(it);
    }
  }

  // --- inode numbers and nodes ---------------------------------------------------------

  // st_ino of a real file: its backing number on the source's own device, so it is stable
  // for as long as the file exists whatever the kernel forgets; a hash on other devices.
  uint64_t shown_ino(uint64_t dev, uint64_t ino) const {
    if (dev == root_dev) return ino;
    return (mix64(dev * 0x9e3779b97f4a7c15ull ^ ino) & ~(3ull << 62)) | (1ull << 62);
  }
  // st_ino of a synthesized entry: one number per version of each name.
  static uint64_t virtual_ino(uint64_t dev, uint64_t ino, uint64_t gen, std::string_view name) {
    uint64_t h = mix64(dev ^ mix64(ino ^ mix64(gen)));
    for (unsigned char c : name) h = mix64(h ^ c);
    return h | (1ull << 63);
  }

  // st_ino of a directory node as stat shows it.
  uint64_t dir_ino_shown(const Node& n) const {
    if (n.kind == Kind::ShardsDir) return virtual_ino(n.dev, n.bino, 0, kShardsDirName);
    if (n.kind == Kind::StatusDir) return status_attr(n).st_ino;
    return shown_ino(n.dev, n.bino);
  }

  // A copy of the node, taken under the lock (rel may change when the source is renamed).
  std::optional<Node> get(Ino ino) {
    std::lock_guard lock(mu_);
    auto it = nodes_.find(ino);
    if (it == nodes_.end()) return std::nullopt;
    return *it->second;
  }

  // Registers (or finds) the node for `key`, looked up as `name` in directory `parent`, counts
  // one lookup, and returns a copy.
  Node remember(const Key& key, Node proto, Ino parent, std::string_view name) {
    std::lock_guard lock(mu_);
    auto [it, inserted] = keys_.emplace(key, 0);
    if (inserted) it->second = next_ino_++;
    auto& slot = nodes_[it->second];
    if (!slot) {
      proto.ino = it->second;
      proto.key = key;
      slot = std::make_shared<Node>(std::move(proto));
    } else {
      slot->rel = proto.rel;  // the inode (or its directory) may have moved within the source
    }
    slot->nlookup++;
    std::pair<Ino, std::string> link{parent, std::string(name)};
    if (std::find(slot->links.begin(), slot->links.end(), link) == slot->links.end()) {
      slot->links.push_back(link);
    }
    kids_[std::move(link)] = slot->ino;
    return *slot;
  }

  // Tells the kernel to drop the entries of `dir` whose real file is gone from SRC, or was
  // replaced by another (a step deleted and its name reused): nothing else would, since SRC
  // changes behind the kernel's back, and each such entry keeps a node, its view and the
  // directory's state alive in the daemon until the kernel forgets it. `entries` is the new
  // listing of `dir`, sorted by name.
  void drop_vanished(const Node& dir, const std::vector<source::DirEntry>& entries) {
    if (!notifier) return;
    std::vector<std::string> gone;
    {
      std::lock_guard lock(mu_);
      for (auto it = kids_.lower_bound({dir.ino, std::string()});
           it != kids_.end() && it->first.first == dir.ino; ++it) {
        auto n = nodes_.find(it->second);
        // Synthesized names are announced by their views; lifted .hf_metadata files live
        // elsewhere than the listing shows.
        if (n == nodes_.end() || n->second->key.type != 0) continue;
        const std::string& name = it->first.second;
        if (n->second->rel != join_rel(dir.rel, name)) continue;
        auto e = std::lower_bound(
            entries.begin(), entries.end(), name,
            [](const source::DirEntry& a, const std::string& b) { return a.name < b; });
        if (e == entries.end() || e->name != name || !(real_key(e->st) == n->second->key)) {
          gone.push_back(name);
        }
      }
    }
    for (const auto& name : gone) notifier->inval_entry(dir.ino, name);
  }

  // Records the stamp a plain file was opened with; returns whether it matches the last one.
  bool swap_cached_stamp(Ino ino, const layout::FileStamp& stamp) {
    std::lock_guard lock(mu_);
    auto it = nodes_.find(ino);
    if (it == nodes_.end()) return false;
    bool same = it->second->cached == stamp;
    it->second->cached = stamp;
    return same;
  }

  static Kind kind_of(mode_t m) {
    if (S_ISDIR(m)) return Kind::Dir;
    if (S_ISREG(m)) return Kind::File;
    if (S_ISLNK(m)) return Kind::Symlink;
    return Kind::Other;
  }

  static Key real_key(const struct stat& st) {
    return Key{0,
               static_cast<uint32_t>(st.st_mode & S_IFMT),
               static_cast<uint64_t>(st.st_dev),
               static_cast<uint64_t>(st.st_ino),
               0,
               {}};
  }

  // --- directory state (the checkpoint view of a real directory) ------------------------

  std::shared_ptr<DirState> dir_state(uint64_t dev, uint64_t ino) {
    std::lock_guard lock(mu_);
    auto& s = dirs_[{dev, ino}];
    if (!s) s = std::make_shared<DirState>();
    return s;
  }

  std::shared_ptr<const View> make_view(std::shared_ptr<const layout::Checkpoint> ck,
                                        const std::string& rel, const struct stat& dst,
                                        const source::Signature& sig,
                                        const std::vector<source::DirEntry>& entries,
                                        bool settled) {
    auto v = std::make_shared<View>();
    v->ckpt = std::move(ck);
    v->generation = ++generations;
    v->mtime_ns = std::max(sig.newest_mtime_ns, mtime_ns(dst));
    v->complete = (settled || v->ckpt->all_written()) && v->ckpt->valid();
    v->settling = !v->complete && !settled;
    if (v->settling) v->pending = pending_text(*v->ckpt, source_path(rel));
    v->rel = rel;
    v->records = std::any_of(sig.files.begin(), sig.files.end(), [](const auto& f) {
      return f.first.starts_with(std::string(format::kStateDirName) + "/");
    });
    v->dir_dev = static_cast<uint64_t>(dst.st_dev);
    v->dir_ino = static_cast<uint64_t>(dst.st_ino);
    for (const auto& e : entries) {
      if (source::is_input_entry(e) && !S_ISDIR(e.st.st_mode)) v->inputs.push_back(Perm::of(e.st));
    }
    // A folder the inputs are in (accelerate's): reaching them takes searching it. Last, so
    // that the first input is a file (a new version of a model file takes its owner and mode).
    for (const auto& e : entries) {
      if (source::is_input_entry(e) && S_ISDIR(e.st.st_mode)) {
        v->inputs.push_back(Perm::searching(e.st));
      }
    }
    // Node-local shards have no file here: their owner and mode are their record's.
    for (const auto& sh : v->ckpt->shards) {
      if (sh.remote()) {
        v->inputs.push_back(Perm{sh.access.uid, sh.access.gid,
                                 static_cast<mode_t>(S_IFREG | (sh.access.mode & 07777))});
      }
    }
    v->shown = shown_perm(v->inputs, dst.st_uid, dst.st_gid);
    return v;
  }

  // Returns the view of directory `rel` (null when it is no checkpoint), revalidating it when
  // its TTL has passed. `dir_ino` is its FUSE inode, for invalidation. `mtime_out`, when
  // given, receives the directory's shown mtime.
  //
  // Two phases. The check (list the directory, stat the inputs, time settle) is cheap and
  // runs under the directory's lock. Reading the shards' headers can be slow (a hostile header
  // is up to 100 MB), so only a Need::Current caller does it, with the lock released and
  // `building` set: callers of other names and of attributes (Need::Any) never read a header
  // and never wait; they get the previous view, or a placeholder that shows nothing
  // consolidated yet. (The kernel serializes lookups of one name, so a header read during the
  // lookup of the checkpoint directory itself would stall every path through it.)
  std::shared_ptr<const View> view_of(const std::string& rel, const struct stat& dst, Ino dir_ino,
                                      Need need, int64_t* mtime_out = nullptr) {
    auto st = dir_state(static_cast<uint64_t>(dst.st_dev), static_cast<uint64_t>(dst.st_ino));
    std::unique_lock lock(st->mu);
    if (need == Need::Current) st->built.wait(lock, [&] { return !st->building; });
    if (!st->building) check_locked(*st, rel, dst, dir_ino);
    if (mtime_out) *mtime_out = st->view ? st->mtime_ns : mtime_ns(dst);
    if (need == Need::Any || !st->needs_build) return st->view;

    st->building = true;
    const auto entries = st->entries;
    const auto sig = st->sig;
    const auto ddst = st->dst;
    const bool settled = st->settled;
    std::shared_ptr<const View> old = st->view;
    lock.unlock();
    std::shared_ptr<const View> v;
    if (auto dirfd = open_beneath(root.get(), rel, O_RDONLY | O_DIRECTORY); dirfd) {
      auto ck =
          source::load_checkpoint(dirfd->get(), entries, source_path(rel), headers, opts.build);
      builds.fetch_add(1, std::memory_order_relaxed);
      if (!ck->valid()) refusals.fetch_add(1, std::memory_order_relaxed);
      log_build(rel, *ck);
      v = make_view(std::move(ck), rel, ddst, sig, entries, settled);
    }
    lock.lock();
    st->building = false;
    st->built.notify_all();
    if (!v) return st->view;  // the directory went away: try again on the next access
    // The check is skipped while building, so the inputs are still those just read.
    st->view = v;
    st->view_sig = sig;
    st->needs_build = false;
    announce(old, v, rel, dir_ino);
    return v;
  }

  // The cheap phase of view_of, under the directory's lock: lists the directory when its TTL
  // has passed, records its inputs and settle state, and updates the view where no header
  // needs reading (no checkpoint any more, only the settle state changed, first sight).
  void check_locked(DirState& st, const std::string& rel, const struct stat& dst, Ino dir_ino) {
    auto now = Clock::now();
    if (st.checked && now < st.next_check) return;
    const bool first = !st.checked;
    st.checked = true;
    st.next_check = now + opts.revalidate;

    auto dirfd = open_beneath(root.get(), rel, O_RDONLY | O_DIRECTORY);
    if (!dirfd) return;  // vanished: open files keep their own views
    // Watched before it is listed: a shard closed after the listing is never missed.
    if (first && watcher) {
      watcher->watch(dirfd->get(), static_cast<uint64_t>(dst.st_dev),
                     static_cast<uint64_t>(dst.st_ino));
    }
    auto entries = source::list_checkpoint_dir(dirfd->get(), hidden_child(rel));
    if (!entries) return;
    if (!opts.read_only &&
        std::any_of(entries->begin(), entries->end(), [](const source::DirEntry& e) {
          return is_state_name(e.name) && S_ISDIR(e.st.st_mode);
        })) {
      // What a crashed writer or daemon left: finish its commit, or drop its staging.
      if (flusher->recover(flush::Target{dirfd->get(), source_path(rel)})) {
        auto again = source::list_checkpoint_dir(dirfd->get(), hidden_child(rel));
        if (!again) return;
        entries = std::move(again);
      }
    }
    std::shared_ptr<const View> old = st.view;
    if (!source::is_checkpoint_dir(dirfd->get(), *entries)) {
      st.entries.clear();
      st.sig = {};
      st.view_sig = {};
      st.needs_build = false;
      st.view = nullptr;
      if (old) changed(old, nullptr, dir_ino);
      return;
    }
    auto sig = source::signature_of(dirfd->get(), *entries);
    if (first) {
      for (const auto& [name, stamp] : sig.files) st.first_seen.emplace(name, stamp);
    }
    // Settle: quiet since the newest change of any shard (written: mtime; moved in: ctime)
    // and of the directory (created or renamed into place). Stamps can lie (clock skew, a
    // future mtime): the daemon's own observation counts too, so a checkpoint whose stamps
    // say "in the future" shows once nothing changed for `settle` while the daemon watched.
    const int64_t changed_ns = std::max({sig.newest_change_ns, mtime_ns(dst), ctime_ns(dst)});
    if (!(sig == st.sig) || changed_ns != st.changed_ns || !old) st.seen_since = now;
    st.changed_ns = changed_ns;
    const int64_t stamp_age = saturating_sub(now_realtime_ns(), changed_ns);
    if (stamp_age < -kNsPerSec && !st.skew_logged) {
      st.skew_logged = true;
      spdlog::warn(
          "{}: shard or directory times lie {} s in the future (clock skew?); settle is timed "
          "from when the daemon saw them",
          source_path(rel), -stamp_age / kNsPerSec);
    }
    const int64_t seen_age =
        std::chrono::duration_cast<std::chrono::nanoseconds>(now - st.seen_since).count();
    const int64_t quiet_ns = std::max(stamp_age, seen_age);
    const int64_t settle_ns =
        std::chrono::duration_cast<std::chrono::nanoseconds>(opts.settle).count();
    st.settled =
        quiet_ns >= settle_ns ||
        quiet_by_us(static_cast<uint64_t>(dst.st_dev), static_cast<uint64_t>(dst.st_ino),
                    changed_ns, sig) ||
        at_rest(st, static_cast<uint64_t>(dst.st_dev), static_cast<uint64_t>(dst.st_ino), sig);
    if (!st.settled) {
      st.next_check = std::min(st.next_check, now + std::chrono::nanoseconds(settle_ns - quiet_ns));
    }
    st.mtime_ns = std::max(sig.newest_mtime_ns, mtime_ns(dst));
    st.entries = std::move(*entries);
    st.sig = std::move(sig);
    st.dst = dst;
    const bool built_from_these = old && st.view_sig == st.sig;
    st.needs_build = !built_from_these;
    const bool complete_now =
        built_from_these && (st.settled || old->ckpt->all_written()) && old->ckpt->valid();
    if (built_from_these &&
        (old->complete != complete_now || old->settling != (!complete_now && !st.settled))) {
      // Only the settle state changed: the same model, shown or hidden.
      auto v = make_view(old->ckpt, rel, dst, st.sig, st.entries, st.settled);
      st.view = v;
      announce(old, v, rel, dir_ino);
    } else if (!old) {
      // Until a reader needs the model: a checkpoint with nothing consolidated to show, so its
      // shard names stay hidden meanwhile.
      auto pending = std::make_shared<layout::Checkpoint>();
      pending->dir = source_path(rel);
      pending->problems.push_back({"", "", "shard headers not read yet"});
      st.view = make_view(std::move(pending), rel, dst, st.sig, st.entries, st.settled);
      drop_hidden_kids(dir_ino);
    }
  }

  // What a build found, in one line per checkpoint: a refusal names its first problems and
  // how many more there are (ckptfs inspect lists them all), then the source layer's notes.
  // A directory that keeps changing logs at most a few such lines a minute (logs).
  void log_build(const std::string& rel, const layout::Checkpoint& ck) {
    constexpr size_t kShown = 4;
    if (!ck.valid()) {
      if (auto v = logs.allow("refused:" + rel); v.log) {
        std::string first;
        for (size_t i = 0; i < ck.problems.size() && i < kShown; ++i) {
          first += (i ? "; " : "") + ck.problems[i].to_string();
        }
        spdlog::error("{}: checkpoint not shown: {}{}{}", source_path(rel), first,
                      ck.problems.size() > kShown
                          ? fmt::format("; and {} more problem(s) (ckptfs inspect lists them)",
                                        ck.problems.size() - kShown)
                          : std::string(),
                      v.suppressed
                          ? fmt::format(" ({} earlier refusal(s) not logged)", v.suppressed)
                          : std::string());
      }
    }
    for (const auto& note : ck.notes) {
      if (auto v = logs.allow("note:" + rel); v.log) spdlog::warn("{}", note);
    }
  }

  void announce(const std::shared_ptr<const View>& old, const std::shared_ptr<const View>& now,
                const std::string& rel, Ino dir_ino) {
    if (now->complete) {
      spdlog::info("{}: serving {} consolidated file(s), {} tensors", source_path(rel),
                   now->ckpt->outputs.size(), now->ckpt->tensors.size());
    }
    changed(old, now, dir_ino);
  }

  // Tells the kernel to drop what it may cache of the previous version of directory `dir_ino`:
  // the consolidated names `old` showed (their inodes belong to that version) and the
  // directory's attributes. Names only `now` shows need nothing: before, they answered ENOENT,
  // which is not cached. Dropping them would even hurt: the build often runs in the lookup of
  // one of them, and an entry dropped right after that lookup takes the new inode and its page
  // cache with it once the file is closed.
  void changed(const std::shared_ptr<const View>& old, const std::shared_ptr<const View>& now,
               Ino dir_ino) {
    if (!notifier || old == now) return;
    if (old && old->complete) {
      for (const auto& o : old->ckpt->outputs) notifier->inval_entry(dir_ino, o.name);
      notifier->inval_entry(dir_ino, std::string(format::kIndexFileName));
    }
    if (old && old->settling) notifier->inval_entry(dir_ino, std::string(kPendingName));
    notifier->inval_inode(dir_ino);
  }

  // A directory just became a checkpoint: real names the kernel may cache under it that the
  // view now hides (a real model.safetensors, a shard) must go, or they would stay reachable.
  void drop_hidden_kids(Ino dir_ino) {
    if (!notifier) return;
    std::vector<std::string> gone;
    {
      std::lock_guard lock(mu_);
      for (auto it = kids_.lower_bound({dir_ino, std::string()});
           it != kids_.end() && it->first.first == dir_ino; ++it) {
        const std::string& name = it->first.second;
        if (is_model_output_name(name) || format::looks_like_shard_name(name) ||
            name == format::kHfMetadataDir) {
          gone.push_back(name);
        }
      }
    }
    for (const auto& name : gone) notifier->inval_entry(dir_ino, name);
  }

  std::string source_path(const std::string& rel) const {
    return rel.empty() ? source : source + "/" + rel;
  }

  // --- attributes ----------------------------------------------------------------------

  // Fresh attributes of a real node, or ESTALE when its path now names another file (or the
  // same number reused for another type).
  Result<struct stat> real_attr(const Node& n) {
    auto found = n.retired ? Result<struct stat>(make_error(ENOENT, "{}: gone", n.rel))
                           : stat_beneath(root.get(), n.rel);
    if (!found || !(real_key(*found) == n.key)) {
      if (n.ino == kRootIno) return found;
      // The path the node had no longer names it: another of its names (a hard link), or a
      // handle still open on it (an unlinked file), or ESTALE: the kernel looks it up again.
      if (auto st = by_other_link(n)) return *st;
      if (auto st = by_open_handle(n)) return *st;
      return make_error(ESTALE, "{}: {}", n.rel, found ? "replaced" : "gone");
    }
    struct stat st = *found;
    decorate_real(n.ino, n.rel, st);
    if (S_ISREG(st.st_mode)) {
      if (auto wf = writing(n.dev, n.bino)) {
        if (auto ws = wf->stat(); ws) {
          st.st_size = ws->st_size;
          st.st_blocks = ws->st_blocks;
        }
      }
    }
    return st;
  }

  // Attributes of node `n` under another name it was looked up by (its hard links), which it
  // takes as its path from now on.
  std::optional<struct stat> by_other_link(const Node& n) {
    if (n.retired) return std::nullopt;  // its number may name another file under those names
    for (const auto& [parent, name] : n.links) {
      auto p = get(parent);
      if (!p || p->kind != Kind::Dir) continue;
      const std::string rel = join_rel(p->rel, name);
      auto st = stat_beneath(root.get(), rel);
      if (!st || !(real_key(*st) == n.key)) continue;
      {
        std::lock_guard lock(mu_);
        if (auto it = nodes_.find(n.ino); it != nodes_.end()) it->second->rel = rel;
      }
      decorate_real(n.ino, rel, *st);
      return *st;
    }
    return std::nullopt;
  }

  // Attributes of node `n` through a handle still open on it (fstat of an unlinked file).
  std::optional<struct stat> by_open_handle(const Node& n) {
    std::shared_ptr<write::WriteFile> wf;
    struct stat st {};
    bool found = false;
    {
      std::lock_guard lock(handles_mu_);
      for (const auto& [id, h] : files_) {
        if (h->ino != n.ino) continue;
        if (h->wf) {
          wf = h->wf;
          break;
        }
        const auto* pr = dynamic_cast<const PassthroughReader*>(h->reader.get());
        if (pr && ::fstat(pr->fd(), &st) == 0 && real_key(st) == n.key) {
          found = true;
          break;
        }
      }
    }
    if (wf) {  // outside the handles' lock: its own mutex may be held through a long copy
      auto ws = wf->stat();
      if (!ws) return std::nullopt;
      st = *ws;
      found = true;
    }
    if (!found) return std::nullopt;
    st.st_ino = shown_ino(n.dev, n.bino);
    return st;
  }

  // Attributes of a real entry as shown: a checkpoint directory's mtime follows its shards.
  void decorate_real(Ino ino, const std::string& rel, struct stat& st) {
    if (S_ISDIR(st.st_mode)) {
      int64_t shown = INT64_MIN;
      view_of(rel, st, ino, Need::Any, &shown);
      if (shown > mtime_ns(st)) st.st_mtim = to_timespec(shown);
    }
    st.st_ino = shown_ino(static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino));
  }

  struct stat virtual_attr(const Node& n) const {
    struct stat st {};
    st.st_ino = virtual_ino(n.key.dev, n.key.ino, n.key.gen, n.key.name);
    st.st_mode = S_IFREG | (n.kind == Kind::Pending ? mode_t{0444} : n.view->shown.mode);
    st.st_nlink = 1;
    uint64_t size = n.kind == Kind::Index     ? n.view->ckpt->index_json.size()
                    : n.kind == Kind::Pending ? n.view->pending.size()
                                              : n.view->ckpt->outputs[n.output].size;
    st.st_size = static_cast<off_t>(size);
    st.st_blocks = static_cast<blkcnt_t>((size + 511) / 512);
    st.st_blksize = 1 << 20;
    set_times(st, n.view->mtime_ns);
    st.st_uid = n.view->shown.uid;
    st.st_gid = n.view->shown.gid;
    if (n.kind == Kind::Output && n.view->ckpt->outputs[n.output].written) written_attr(n, st);
    return st;
  }

  // A file written through the mount shows what its writer gave it (carried by its shards,
  // each set alike at commit and by setattr): its owner, its mode (write bits included) and
  // its mtime. Shards that disagree (changed in SRC) show as a synthesized file does.
  static void written_attr(const Node& n, struct stat& st) {
    const auto& ck = *n.view->ckpt;
    const auto& out = ck.outputs[n.output];
    if (out.shards.empty()) return;
    const layout::Access& a = ck.shards[out.shards.front()].access;
    int64_t mtime = INT64_MIN, atime = INT64_MIN;
    for (uint32_t s : out.shards) {
      if (!(ck.shards[s].access == a)) return;
      mtime = std::max(mtime, ck.shards[s].stamp.mtime_ns);
      atime = std::max(atime, ck.shards[s].atime_ns);
    }
    st.st_mode = S_IFREG | (a.mode & 07777);
    st.st_uid = a.uid;
    st.st_gid = a.gid;
    set_times(st, mtime);
    st.st_atim = to_timespec(atime);
  }

  // --- the status directory --------------------------------------------------------------

  static constexpr std::string_view kStatusKeyDir = "dir";

  struct stat status_attr(const Node& n) const {
    struct stat st {};
    st.st_ino = virtual_ino(0, 0, 0, n.key.name) | (1ull << 62);
    st.st_uid = ::geteuid();
    st.st_gid = ::getegid();
    set_times(st, started_ns);
    st.st_blksize = 4096;
    if (n.kind == Kind::StatusDir) {
      st.st_mode = S_IFDIR | 0555;
      st.st_nlink = 2;
    } else {
      // The mount's owner's alone (and root's): it names what the daemon serves, private
      // directories included. Size 0: made at open, read with direct I/O.
      st.st_mode = S_IFREG | 0400;
      st.st_nlink = 1;
    }
    return st;
  }

  Result<EntryOut> lookup_status(Ino parent, Kind kind, std::string_view name) {
    Node proto;
    proto.kind = kind;
    const std::string key_name(kind == Kind::StatusDir ? kStatusKeyDir : kStatusFileName);
    Node n = remember(Key{3, 0, 0, 0, 0, key_name}, std::move(proto), parent, name);
    return EntryOut{n.ino, status_attr(n)};
  }

  std::string status_json();

  // --- lookups ---------------------------------------------------------------------------

  Result<EntryOut> lookup_real(const std::string& rel, Ino parent, std::string_view name) {
    CKPTFS_TRY(struct stat st, stat_beneath(root.get(), rel));
    Node proto;
    proto.kind = kind_of(st.st_mode);
    proto.rel = rel;
    proto.dev = static_cast<uint64_t>(st.st_dev);
    proto.bino = static_cast<uint64_t>(st.st_ino);
    Node n = remember(real_key(st), std::move(proto), parent, name);
    decorate_real(n.ino, rel, st);
    return EntryOut{n.ino, st};
  }

  Result<EntryOut> lookup_virtual(const std::shared_ptr<const View>& v, const std::string& dir_rel,
                                  Ino dir_ino, Kind kind, uint32_t output,
                                  const std::string& name) {
    Node proto;
    proto.kind = kind;
    proto.rel = dir_rel;  // where the checkpoint directory is now (it may have been renamed)
    proto.view = v;
    proto.output = output;
    Node n = remember(Key{1, 0, v->dir_dev, v->dir_ino, v->generation, name}, std::move(proto),
                      dir_ino, name);
    return EntryOut{n.ino, virtual_attr(n)};
  }

  // The name in directory `rel` that must never be stat'ed (see Options::hide_rel).
  std::string_view hidden_child(const std::string& rel) const {
    const auto& h = opts.hide_rel;
    if (h.empty()) return {};
    if (rel.empty())
      return h.find('/') == std::string::npos ? std::string_view(h) : std::string_view();
    if (h.size() > rel.size() + 1 && h.starts_with(rel) && h[rel.size()] == '/' &&
        h.find('/', rel.size() + 1) == std::string::npos) {
      return std::string_view(h).substr(rel.size() + 1);
    }
    return {};
  }

  Result<EntryOut> lookup_in_dir(const Node& dir, std::string_view name_sv, const Caller& who) {
    std::string name(name_sv);
    if (name == hidden_child(dir.rel)) return make_error(ENOENT, "the mount point itself");
    if (dir.ino == kRootIno && name == kStatusDirName) {
      return lookup_status(dir.ino, Kind::StatusDir, name);
    }
    if (is_state_name(name)) return make_error(ENOENT, "{}: the write path's own state", name);
    CKPTFS_TRY(struct stat dst, stat_beneath(root.get(), dir.rel));
    const std::string rel = join_rel(dir.rel, name);
    if (auto w = is_model_output_name(name) ? nullptr : view_of(dir.rel, dst, dir.ino, Need::Any);
        w && !w->records && sees_written(dir, who)) {
      // The writer's view: the names it wrote resolve to what it wrote, for it alone.
      auto real = lookup_real(rel, dir.ino, name);
      if (real.ok()) real->uncached = true;
      if (real.ok() || real.error().code != ENOENT) return real;
    }
    const bool consolidated_name = is_model_output_name(name);
    auto v = view_of(dir.rel, dst, dir.ino, consolidated_name ? Need::Current : Need::Any);
    if (consolidated_name) v = wait_settled(dir, std::move(v));
    if (!v) return lookup_real(rel, dir.ino, name);
    if (name == kPendingName && v->settling) {
      return lookup_virtual(v, dir.rel, dir.ino, Kind::Pending, 0, name);
    }
    if (v->complete) {
      const auto& ck = *v->ckpt;
      for (uint32_t i = 0; i < ck.outputs.size(); ++i) {
        if (ck.outputs[i].name == name) {
          return lookup_virtual(v, dir.rel, dir.ino, Kind::Output, i, name);
        }
      }
      if (name == format::kIndexFileName) {
        if (ck.written) return lookup_real(rel, dir.ino, name);
        return lookup_virtual(v, dir.rel, dir.ino, Kind::Index, 0, name);
      }
    }
    if (name == kShardsDirName && opts.show_shards) {
      Node proto;
      proto.kind = Kind::ShardsDir;
      proto.rel = dir.rel;
      proto.dev = static_cast<uint64_t>(dst.st_dev);
      proto.bino = static_cast<uint64_t>(dst.st_ino);
      Node n = remember(Key{2, 0, proto.dev, proto.bino, 0, {}}, std::move(proto), dir.ino, name);
      struct stat st = dst;
      st.st_ino = virtual_ino(n.dev, n.bino, 0, kShardsDirName);
      st.st_mode = S_IFDIR | 0555;
      return EntryOut{n.ino, st};
    }
    if (name == format::kHfMetadataDir || consolidated_name || name == kNemoConsolidateScript ||
        name == kPendingName || format::looks_like_shard_name(name)) {
      return make_error(ENOENT, "{}: hidden in a checkpoint directory", rel);
    }
    auto real = lookup_real(rel, dir.ino, name);
    if (real.ok() || real.error().code != ENOENT) return real;
    // Lifted from .hf_metadata/ (never the mapping files) or verl's huggingface/, the first
    // that has it. No symlink is followed on the way.
    if (name == format::kFqnMappingFileName || name == format::kFqnDtypeMappingFileName)
      return real;
    for (std::string_view from : format::kLiftedDirs) {
      const std::string lifted = join_rel(join_rel(dir.rel, from), name);
      auto st = stat_beneath(root.get(), lifted);
      if (st && S_ISREG(st->st_mode)) return lookup_real(lifted, dir.ino, name);
    }
    return real;
  }

  Result<EntryOut> lookup_in_shards(const Node& dir, std::string_view name) {
    const std::string rel = join_rel(dir.rel, name);
    CKPTFS_TRY(struct stat st, stat_beneath(root.get(), rel));
    source::DirEntry e{std::string(name), st};
    if (!hidden_in_checkpoint(e, opts.show_shards) || e.name == format::kHfMetadataDir) {
      return make_error(ENOENT, "{}: not a hidden file", rel);
    }
    return lookup_real(rel, dir.ino, name);
  }

  // --- listings --------------------------------------------------------------------------

  Result<std::vector<DirEntryOut>> list(const Node& dir, const Caller& who = {}) {
    CKPTFS_TRY(struct stat dst, stat_beneath(root.get(), dir.rel));
    CKPTFS_TRY(UniqueFd fd, open_beneath(root.get(), dir.rel, O_RDONLY | O_DIRECTORY));
    CKPTFS_TRY(auto entries, source::list_dir(fd.get(), hidden_child(dir.rel)));
    drop_vanished(dir, entries);
    std::vector<DirEntryOut> out;
    auto real = [&](const source::DirEntry& e) {
      out.push_back(DirEntryOut{
          e.name, shown_ino(static_cast<uint64_t>(e.st.st_dev), static_cast<uint64_t>(e.st.st_ino)),
          static_cast<mode_t>(e.st.st_mode & S_IFMT)});
    };
    if (dir.kind == Kind::ShardsDir) {
      for (const auto& e : entries) {
        if (hidden_in_checkpoint(e, opts.show_shards) && e.name != format::kHfMetadataDir) real(e);
      }
      return out;
    }
    // The writer's view lists what was written, as in SRC (the view's own check first: it
    // also watches the directory and recovers what a crash left).
    const bool writer = dir.kind == Kind::Dir && sees_written(dir, who);
    auto v = view_of(dir.rel, dst, dir.ino, writer ? Need::Any : Need::Current);
    const bool as_written = writer && v && !v->records;
    if (as_written) {  // the writer's view: rank shards and side files as in SRC
      for (const auto& e : entries) {
        if (!is_state_name(e.name)) real(e);
      }
      return out;
    }
    if (writer && v) v = view_of(dir.rel, dst, dir.ino, Need::Current);
    if (!v) {
      for (const auto& e : entries) {
        if (!is_state_name(e.name)) real(e);
      }
      return out;
    }
    // A directory written through the view shows its own index file, and none synthesized.
    const bool written = v->complete && v->ckpt->written;
    std::set<std::string> names;
    for (const auto& e : entries) {
      if (is_state_name(e.name)) continue;
      if (hidden_in_checkpoint(e, opts.show_shards) &&
          !(written && e.name == format::kIndexFileName && S_ISREG(e.st.st_mode))) {
        continue;
      }
      real(e);
      names.insert(e.name);
    }
    for (std::string_view from : format::kLiftedDirs) {
      auto meta = open_beneath(fd.get(), std::string(from), O_RDONLY | O_DIRECTORY | O_NOFOLLOW);
      if (!meta) continue;
      if (auto lifted = source::list_dir(meta->get()); lifted.ok()) {
        for (const auto& e : *lifted) {
          if (!S_ISREG(e.st.st_mode) || e.name == format::kFqnMappingFileName ||
              names.count(e.name) || is_model_output_name(e.name) ||
              format::looks_like_shard_name(e.name) || e.name == kShardsDirName ||
              e.name == kNemoConsolidateScript || e.name == kPendingName) {
            continue;
          }
          if (e.name == format::kFqnDtypeMappingFileName) continue;  // hidden, as NeMo's export
          real(e);
          names.insert(e.name);
        }
      }
    }
    if (v->complete) {
      const auto& ck = *v->ckpt;
      for (const auto& o : ck.outputs) {
        out.push_back(DirEntryOut{
            o.name, virtual_ino(v->dir_dev, v->dir_ino, v->generation, o.name), S_IFREG});
      }
      if (!written) {
        out.push_back(DirEntryOut{
            std::string(format::kIndexFileName),
            virtual_ino(v->dir_dev, v->dir_ino, v->generation, format::kIndexFileName), S_IFREG});
      }
    }
    if (v->settling) {
      out.push_back(DirEntryOut{std::string(kPendingName),
                                virtual_ino(v->dir_dev, v->dir_ino, v->generation, kPendingName),
                                S_IFREG});
    }
    if (opts.show_shards) {
      out.push_back(DirEntryOut{std::string(kShardsDirName),
                                virtual_ino(static_cast<uint64_t>(dst.st_dev),
                                            static_cast<uint64_t>(dst.st_ino), 0, kShardsDirName),
                                S_IFDIR});
    }
    std::sort(out.begin(), out.end(),
              [](const DirEntryOut& a, const DirEntryOut& b) { return a.name < b.name; });
    return out;
  }

  // --- opening ---------------------------------------------------------------------------

  // Opens the shards of View `v`, whose directory is now at `rel` (it may have been renamed
  // since the View was built; its identity is checked).
  Result<std::shared_ptr<const ShardFds>> shard_fds(const std::shared_ptr<const View>& v,
                                                    const std::string& rel) {
    std::lock_guard lock(v->fd_mu);
    if (auto f = v->fds.lock()) return f;
    const auto& ck = *v->ckpt;
    const auto n = static_cast<int64_t>(ck.shards.size());
    if (open_shard_fds.fetch_add(n) + n > fd_budget) {
      open_shard_fds.fetch_sub(n);
      spdlog::error(
          "{}: opening its {} shards would pass the daemon's fd limit ({} shard fds already "
          "open, budget {}); raise the daemon's `ulimit -n`",
          source_path(rel), n, open_shard_fds.load(), fd_budget);
      // ENFILE rather than EMFILE: the limit is the daemon's, not the reader's.
      return make_error(ENFILE, "shard fd budget exhausted");
    }
    auto fds = std::make_shared<ShardFds>();
    fds->counter = &open_shard_fds;
    fds->count = n;
    fds->owned.resize(ck.shards.size());
    fds->raw.assign(ck.shards.size(), -1);
    auto dir = open_beneath(root.get(), rel, O_RDONLY | O_DIRECTORY);
    struct stat dst {};
    if (!dir || ::fstat(dir->get(), &dst) != 0 || static_cast<uint64_t>(dst.st_dev) != v->dir_dev ||
        static_cast<uint64_t>(dst.st_ino) != v->dir_ino) {
      return make_error(ESTALE, "{}: checkpoint directory moved", rel);
    }
    fds->remote = flusher->reader();
    for (uint32_t s = 0; s < ck.shards.size(); ++s) {
      if (ck.shards[s].remote()) continue;  // on a node-local target: read through `remote`
      // Never blocks (a FIFO swapped in is refused, not opened) and is a regular file.
      struct stat st {};
      // A name in a folder (accelerate's pytorch_model_fsdp_0/) is resolved without
      // following a symlink on the way, as the build listed it.
      const std::string& sn = ck.shards[s].name;
      auto fd = sn.find('/') == std::string::npos
                    ? open_regular_at(dir->get(), sn, sn, &st)
                    : open_regular_beneath(dir->get(), sn, Resolve::Auto, &st);
      if (!fd || source::stamp_of(st) != ck.shards[s].stamp) {
        spdlog::warn("{}/{}: changed since the view was built ({}); revalidating", source_path(rel),
                     ck.shards[s].name, fd ? std::string("new stamp") : fd.error().message);
        return make_error(ESTALE, "{}: shard changed", ck.shards[s].name);
      }
      fds->raw[s] = fd->get();
      fds->owned[s] = std::move(fd).value();
    }
    v->fds = fds;
    return std::shared_ptr<const ShardFds>(fds);
  }

  // --- writes ------------------------------------------------------------------------------

  // A directory being changed: its node, an open descriptor and its identity.
  struct DirRef {
    Impl* impl = nullptr;
    Node node;
    UniqueFd fd;
    uint64_t dev = 0, ino = 0;
    struct stat st {};
    std::shared_ptr<DirState> state() const { return impl->dir_state(dev, ino); }
    flush::Target target(std::string display) const {
      return flush::Target{fd.get(), std::move(display), st.st_uid, st.st_gid, 0644};
    }
  };

  // The directory `parent`, about to get or lose `name`. The write path's own name is refused
  // (`reserved`: EPERM to make it, ENOENT to use it), as is the mount point itself.
  Result<DirRef> dir_for_change(Ino parent, std::string_view name, int reserved = EPERM) {
    if (name.size() > NAME_MAX) {
      return make_error(ENAMETOOLONG, "a name of {} bytes", name.size());
    }
    if (!is_valid_component(name)) return make_error(EINVAL, "invalid name");
    auto n = get(parent);
    if (!n) return make_error(ESTALE, "unknown inode {}", parent);
    if (n->kind != Kind::Dir) {
      return make_error(n->kind == Kind::ShardsDir || n->kind == Kind::StatusDir ? EPERM : ENOTDIR,
                        "not a writable directory");
    }
    if (is_state_name(name)) {
      return make_error(reserved, "{}: the name {} is reserved for ckptfs", source_path(n->rel),
                        format::kStateDirName);
    }
    if (name == hidden_child(n->rel)) return make_error(EPERM, "the mount point itself");
    DirRef d;
    d.impl = this;
    d.node = std::move(*n);
    CKPTFS_TRY(d.fd, open_beneath(root.get(), d.node.rel, O_RDONLY | O_DIRECTORY));
    if (::fstat(d.fd.get(), &d.st) != 0) {
      return make_error(errno, "{}: stat failed: {}", source_path(d.node.rel),
                        std::strerror(errno));
    }
    d.dev = static_cast<uint64_t>(d.st.st_dev);
    d.ino = static_cast<uint64_t>(d.st.st_ino);
    return d;
  }

  // --- the kernel's checks, for what it cannot see (fs/access.hpp) -------------------------

  // May `who` remove entry `name` of directory `d` as it is in SRC (ENOENT: nothing to check).
  Status may_delete_entry(const DirRef& d, const std::string& name, const Caller& who) {
    if (who.root()) return {};
    struct stat st {};
    if (::fstatat(d.fd.get(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) return {};
    return may_delete(Perm::of(d.st), Perm::of(st), who, source_path(join_rel(d.node.rel, name)));
  }

  // chmod, chown and utimens of a consolidated file written through the mount (it has a commit
  // record): they are its shards' (every one of them, alike), as written_attr shows them. The
  // shards change, so the view is a new version. Node-local shards live elsewhere: EPERM.
  Result<struct stat> set_written_attr(const Node& n, const SetAttr& a,
                                       const struct timespec times[2]) {
    const auto& ck = *n.view->ckpt;
    const auto& out = ck.outputs[n.output];
    const std::string where = source_path(join_rel(n.rel, n.key.name));
    CKPTFS_TRY(UniqueFd dir, open_beneath(root.get(), n.rel, O_RDONLY | O_DIRECTORY));
    for (uint32_t s : out.shards) {
      const auto& sh = ck.shards[s];
      if (sh.remote()) {
        return make_error(EPERM,
                          "{}: its shards are on node-local targets; its attributes are "
                          "its commit record's",
                          where);
      }
      const char* name = sh.name.c_str();
      if ((a.mode && ::fchmodat(dir.get(), name, *a.mode & 07777, 0) != 0) ||
          ((a.uid || a.gid) &&
           ::fchownat(dir.get(), name, a.uid ? *a.uid : static_cast<uid_t>(-1),
                      a.gid ? *a.gid : static_cast<gid_t>(-1), AT_SYMLINK_NOFOLLOW) != 0) ||
          ((a.atime || a.mtime) && ::utimensat(dir.get(), name, times, AT_SYMLINK_NOFOLLOW) != 0)) {
        return errno_error(fmt::format("{}: {}", where, sh.name));
      }
    }
    force_revalidate(*n.view);
    // What the next version shows, from the shards as they are now (another change made since
    // the view was built, a chmod before this utimens, is theirs too).
    struct stat st = virtual_attr(n);
    int64_t mtime = INT64_MIN, atime = INT64_MIN, ctime = INT64_MIN;
    for (uint32_t s : out.shards) {
      struct stat sh {};
      if (::fstatat(dir.get(), ck.shards[s].name.c_str(), &sh, AT_SYMLINK_NOFOLLOW) != 0) {
        return errno_error(fmt::format("{}: {}", where, ck.shards[s].name));
      }
      st.st_mode = S_IFREG | (sh.st_mode & 07777);
      st.st_uid = sh.st_uid;
      st.st_gid = sh.st_gid;
      mtime = std::max(mtime, mtime_ns(sh));
      ctime = std::max(ctime, ctime_ns(sh));
      atime =
          std::max(atime, static_cast<int64_t>(sh.st_atim.tv_sec) * kNsPerSec + sh.st_atim.tv_nsec);
    }
    st.st_mtim = to_timespec(mtime);
    st.st_atim = to_timespec(atime);
    st.st_ctim = to_timespec(ctime);
    return st;
  }

  // Owner and mode of every shard output `o` of view `v` is made of.
  static std::vector<Perm> output_perms(const View& v, const layout::OutputFile& o) {
    std::vector<Perm> out;
    for (uint32_t s : o.shards) {
      const auto& a = v.ckpt->shards[s].access;
      out.push_back(Perm{a.uid, a.gid, static_cast<mode_t>(S_IFREG | (a.mode & 07777))});
    }
    return out;
  }

  // May `who` remove every input of a consolidated file (its shards) from directory `d`.
  Status may_delete_all(const DirRef& d, const std::vector<Perm>& inputs, const Caller& who,
                        const std::string& what) {
    for (const auto& p : inputs)
      CKPTFS_CHECK(may_delete(Perm::of(d.st), p, who, source_path(what)));
    return {};
  }

  // Whether `who` could empty directory `dirfd` (at `rel`) entry by entry, subdirectories
  // first: what rmdir removes with a directory whose view is empty. The daemon's own .ckptfs
  // counts as one entry (nobody but the daemon writes inside it).
  Status may_empty(int dirfd, const Caller& who, const std::string& rel, int depth) {
    if (who.root()) return {};
    if (depth > 8) return make_error(ENOTEMPTY, "{}: too deep", rel);
    struct stat dst {};
    if (::fstat(dirfd, &dst) != 0) return errno_error(rel);
    CKPTFS_TRY(auto entries, source::list_dir(dirfd));
    for (const auto& e : entries) {
      const std::string what = join_rel(rel, e.name);
      CKPTFS_CHECK(may_delete(Perm::of(dst), Perm::of(e.st), who, what));
      if (S_ISDIR(e.st.st_mode) && !is_state_name(e.name)) {
        CKPTFS_TRY(UniqueFd sub, open_at(dirfd, e.name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW));
        CKPTFS_CHECK(may_empty(sub.get(), who, what, depth + 1));
      }
    }
    return {};
  }

  struct Shown {
    std::shared_ptr<const View> v;  // set when the view shows `name` as a consolidated file
    const layout::OutputFile* output = nullptr;  // null: the synthesized index
  };
  Shown shown_output(const DirRef& d, std::string_view name) {
    if (!is_model_output_name(name)) return {};
    auto v = view_of(d.node.rel, d.st, d.node.ino, Need::Current);
    if (!v || !v->complete) return {};
    if (const auto* o = v->ckpt->find_output(name)) return {v, o};
    if (name == format::kIndexFileName && !v->ckpt->written) return {v, nullptr};
    return {};
  }
  bool shown_virtual(const DirRef& d, std::string_view name) {
    return shown_output(d, name).v != nullptr;
  }

  // A new entry made for a caller other than root belongs to the caller (the daemon makes it
  // as root); its group is the directory's when that has the set-group-ID bit.
  void give_to(int fd, const DirRef& d, const std::string& name, const Caller& who, bool by_name) {
    if (::geteuid() != 0 || who.uid == 0) return;
    const gid_t gid = (d.st.st_mode & S_ISGID) ? d.st.st_gid : who.gid;
    int rc = by_name ? ::fchownat(d.fd.get(), name.c_str(), who.uid, gid, AT_SYMLINK_NOFOLLOW)
                     : ::fchown(fd, who.uid, gid);
    if (rc != 0) {
      spdlog::warn("{}: cannot give it to uid {}: {}", source_path(join_rel(d.node.rel, name)),
                   who.uid, std::strerror(errno));
    }
  }

  // `display`: the directory's path, which its messages name.
  write::PlanOptions plan_options(int dirfd, const std::string& display) {
    write::PlanOptions p;
    p.ranks = opts.ranks ? opts.ranks : flusher->default_ranks();
    p.split = opts.split;
    if (p.split == write::PlanOptions::TpPlan) {
      if (auto text = read_small_file_beneath(dirfd, "config.json", 16u << 20); text) {
        if (auto plan = format::parse_tp_plan(*text, display + "/config.json"); plan) {
          p.tp_plan = std::move(plan).value();
        } else {
          spdlog::warn("{}; splitting on dim 0", plan.error().message);
        }
      }
    }
    return p;
  }

  // The state of a regular file opened for writing, shared by every handle on it.
  Result<std::shared_ptr<write::WriteFile>> start_writing(UniqueFd fd, const DirRef& d,
                                                          const std::string& name, bool fresh) {
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0) return make_error(errno, "stat failed");
    const DevIno key{static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino)};
    // The state registered under this number, unless it belongs to a file since unlinked
    // (committed, or removed while open) whose number this one reuses.
    if (auto wf = writing(key.first, key.second); wf && wf->linked()) return wf;
    CKPTFS_TRY(auto wf,
               write::WriteFile::open(std::move(fd), d.fd.get(), source_path(d.node.rel), fresh,
                                      *flusher, plan_options(d.fd.get(), source_path(d.node.rel)),
                                      source_path(join_rel(d.node.rel, name)), budget.get()));
    std::lock_guard lock(writes_mu_);
    auto& w = writes_[key];
    if (auto other = w.wf.lock(); other && other->linked()) return other;  // opened meanwhile
    w = Writing{wf, {d.dev, d.ino}, format::looks_like_shard_name(name)};
    return wf;
  }

  Result<OpenOut> open_for_write(const Node& n, int flags) {
    std::string dir_rel, name;
    UniqueFd fd;
    bool fresh = (flags & O_TRUNC) != 0;
    if (n.kind == Kind::File) {
      dir_rel = parent_of(n.rel);
      name = last_of(n.rel);
    } else if (n.kind == Kind::Output && (flags & O_TRUNC)) {
      // Replacing a consolidated file: a new file under its name, committed at close.
      dir_rel = n.rel;
      name = n.key.name;
    } else if (n.kind == Kind::Dir || n.kind == Kind::ShardsDir || n.kind == Kind::StatusDir) {
      return make_error(EISDIR, "is a directory");
    } else if (n.kind == Kind::Pending || n.kind == Kind::StatusFile) {
      return make_error(EACCES, "{}: written by ckptfs only", n.key.name);
    } else if (n.kind == Kind::Output || n.kind == Kind::Index) {
      return make_error(EPERM,
                        "{}: a consolidated file is not changed in place; write it anew (O_TRUNC) "
                        "or write a new file and rename it over",
                        source_path(join_rel(n.rel, n.key.name)));
    } else {
      return make_error(EACCES, "special files cannot be opened through the view");
    }
    DirRef d;
    d.impl = this;
    CKPTFS_TRY(d.fd, open_beneath(root.get(), dir_rel, O_RDONLY | O_DIRECTORY));
    if (::fstat(d.fd.get(), &d.st) != 0) return make_error(errno, "stat failed");
    d.dev = static_cast<uint64_t>(d.st.st_dev);
    d.ino = static_cast<uint64_t>(d.st.st_ino);
    d.node.rel = dir_rel;
    const int oflags = O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC;
    if (n.kind == Kind::File) {
      int raw = ::openat(d.fd.get(), name.c_str(), oflags);
      if (raw < 0) return make_error(errno, "{}: {}", source_path(n.rel), std::strerror(errno));
      struct stat st {};
      CKPTFS_TRY(fd, require_regular(UniqueFd(raw), source_path(n.rel), &st));
      if (!(real_key(st) == n.key)) return make_error(ESTALE, "{}: replaced", n.rel);
      fresh = fresh || st.st_size == 0;
    } else {
      int raw = ::openat(d.fd.get(), name.c_str(), oflags | O_CREAT | O_TRUNC, 0600);
      if (raw < 0) return make_error(errno, "{}: {}", source_path(n.rel), std::strerror(errno));
      fd.reset(raw);
      // The new version keeps the owner and mode of the one it replaces (its shards'), which
      // its own shards then take at commit.
      if (!n.view->inputs.empty()) {
        const Perm& p = n.view->inputs.front();
        if ((::geteuid() == 0 && ::fchown(raw, p.uid, p.gid) != 0) ||
            ::fchmod(raw, p.mode & 07777) != 0) {
          return make_error(errno, "{}: cannot keep the owner and mode: {}", source_path(n.rel),
                            std::strerror(errno));
        }
      }
      fresh = true;
    }
    CKPTFS_TRY(auto wf, start_writing(std::move(fd), d, name, fresh));
    if (flags & O_TRUNC) CKPTFS_CHECK(wf->truncate(0));
    touched(d.dev, d.ino);
    OpenOut out;
    out.fh = adopt_writer(std::move(wf), n.ino);
    return out;
  }

  // A handle open for writing on `wf`, for the kernel's inode `ino`.
  uint64_t adopt_writer(std::shared_ptr<write::WriteFile> wf, Ino ino) {
    wf->writers.fetch_add(1);
    auto h = std::make_unique<FileHandle>();
    h->reader = std::make_shared<WriteFileReader>(wf);
    h->wf = std::move(wf);
    h->ino = ino;
    h->writable = true;
    return adopt(handles_mu_, files_, std::move(h));
  }

  // Runs `fn` (finalize or fsync) on the file of handle `h` where it is now, under its
  // directory's lock (the view never lists a commit half done), and makes the view show the
  // result at once.
  template <typename Fn>
  Status settle_file(FileHandle& h, Fn fn) {
    auto n = get(h.ino);
    if (!n) return make_error(ESTALE, "unknown inode {}", h.ino);
    const bool real = n->kind == Kind::File;
    const std::string dir_rel = real ? parent_of(n->rel) : n->rel;
    const std::string name = real ? last_of(n->rel) : n->key.name;
    auto dfd = open_beneath(root.get(), dir_rel, O_RDONLY | O_DIRECTORY);
    struct stat dst {};
    if (!dfd || ::fstat(dfd->get(), &dst) != 0) {
      // The directory is gone from where the file was: keep the bytes in the file itself.
      return fn(*h.wf, write::Place{-1, "", source_path(dir_rel)});
    }
    auto st = dir_state(static_cast<uint64_t>(dst.st_dev), static_cast<uint64_t>(dst.st_ino));
    Status result;
    {
      std::unique_lock lock(st->mu);
      st->built.wait(lock, [&] { return !st->building; });
      result = fn(*h.wf, write::Place{dfd->get(), name, source_path(dir_rel)});
      st->next_check = Clock::now();
      if (result.ok()) {
        auto names = h.wf->stored_names();
        if (names.empty() && format::looks_like_shard_name(name)) names.push_back(name);
        produced(dfd->get(), names);
      }
    }
    touched(static_cast<uint64_t>(dst.st_dev), static_cast<uint64_t>(dst.st_ino));
    if (h.wf->state() == write::WriteFile::State::Committed) retire(*n);
    if (notifier &&
        (h.wf->state() == write::WriteFile::State::Committed || format::parse_model_name(name))) {
      // The name now shows the consolidated file (committed, or still the older one when this
      // one was cut short and stays hidden behind it): the kernel's entry still holds the file
      // as it was being written.
      for (const auto& [parent, link] : n->links) notifier->inval_entry(parent, link);
      // Before close() returns: an open of the name right after it must not find the entry
      // of the file as it was being written (its placeholder is gone: ENOENT).
      notifier->sync(std::chrono::seconds(2));
    }
    return result;
  }

  void recheck(const DirRef& d) {
    auto st = d.state();
    std::lock_guard lock(st->mu);
    st->next_check = Clock::now();
  }

  // The backing file of real node `n` is gone for good: ext4 hands its number to the next
  // file made, which must get a node of its own (with the key kept, a lookup of that file
  // would take this node over, and the kernel's names for this one would show that file).
  void retire(const Node& n) {
    std::lock_guard lock(mu_);
    auto it = nodes_.find(n.ino);
    if (it == nodes_.end() || it->second->retired || it->second->key.type != 0) return;
    it->second->retired = true;
    if (auto k = keys_.find(it->second->key); k != keys_.end() && k->second == n.ino)
      keys_.erase(k);
  }
  void retire_key(const Key& key) {
    std::optional<Node> n;
    {
      std::lock_guard lock(mu_);
      if (auto k = keys_.find(key); k != keys_.end()) {
        if (auto it = nodes_.find(k->second); it != nodes_.end()) n = *it->second;
      }
    }
    if (n) retire(*n);
  }
  // The same for the file `name` of directory `dirfd` as it is now, when this is its last name.
  void retire_if_last(int dirfd, const std::string& name) {
    struct stat st {};
    if (::fstatat(dirfd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 || st.st_nlink > 1 ||
        S_ISDIR(st.st_mode)) {
      return;
    }
    retire_key(real_key(st));
  }

  // --- a model name holds a consolidated file or nothing ------------------------------------
  //
  // In a checkpoint directory the view shows, under a model name, the consolidated file its
  // shards make: a real file of that name is hidden. So a file that ends up whole under such a
  // name (not a consolidated safetensors file, cut short, too large a header to split, no
  // memory or staging for it) must not be reported stored when nobody could read it back.

  struct NameState {
    bool stored = false;  // the name has a stored form (its record and shards, or DCP shards)
    bool others = false;  // the directory holds rank shards or records of other files
  };
  NameState name_state(int dirfd, const std::vector<source::DirEntry>& entries,
                       std::string_view name) {
    NameState ns;
    const auto mn = format::parse_model_name(name);
    if (!mn) return ns;
    bool mine_recorded = false, other_same_km = false;
    for (const auto& [rel, st] : source::record_files(dirfd, entries)) {
      const std::string_view file = std::string_view(rel).substr(
          format::kStateDirName.size() + 1,
          rel.size() - format::kStateDirName.size() - 1 - format::kRecordSuffix.size());
      if (file == name) {
        mine_recorded = true;
        continue;
      }
      ns.others = true;
      if (auto om = format::parse_model_name(file); om && om->k == mn->k && om->m == mn->m) {
        other_same_km = true;
      }
    }
    // Shards of (k, m) are this name's when its record names them, or when the name is the
    // one the view synthesizes for them and no record gives them another name.
    const bool km_mine = mine_recorded || (!mn->single && !other_same_km);
    for (const auto& e : entries) {
      auto p = format::parse_shard_name(e.name);
      if (!p) continue;
      if (p->k == mn->k && p->m == mn->m && km_mine) {
        ns.stored = true;
      } else {
        ns.others = true;
      }
    }
    ns.stored = ns.stored || mine_recorded;
    return ns;
  }

  // After a close left file `name` of directory `dirfd` whole for reason `why`: the name keeps
  // its stored consolidated file if it has one (a writer killed mid-save must not cost the
  // version it was replacing), and a directory of rank shards would hide it; either way close()
  // fails with `why`. Otherwise it is a plain file of a plain directory, shown as written.
  Status place_whole(int dirfd, const std::string& display, const std::string& name,
                     const Error& why) {
    if (why.code == EIO) {
      // Cut short: kept as the bytes received (a consolidated file that ends early must never
      // read as complete), which is not what the writer made; close() says so.
      return Error{EIO, why.message + "; kept as the bytes received"};
    }
    auto entries = source::list_dir(dirfd);
    if (!entries) return std::move(entries).error().context(display);
    const NameState ns = name_state(dirfd, *entries, name);
    if (!ns.stored && !ns.others) return {};
    const std::string msg = fmt::format(
        "{}; not stored: {}", why.message,
        ns.stored ? "the name keeps the consolidated file stored under it (write a complete "
                    "consolidated safetensors file, or rename a file over it)"
                  : "in a directory of rank shards a model name shows a consolidated file, and "
                    "this one would be hidden");
    spdlog::warn("{}", msg);
    return Error{why.code ? why.code : EINVAL, msg};
  }

  // Whether storing file `name` of directory `dirfd` as rank shards would hide plain files: the
  // directory is no checkpoint yet, and regular files under other model names (not being
  // written through the mount) are shown there now. Such a file is stored whole instead.
  bool split_hides_plain(int dirfd, std::string_view name) {
    auto entries = source::list_dir(dirfd);
    if (!entries || source::is_checkpoint_dir(dirfd, *entries)) return false;
    for (const auto& e : *entries) {
      if (!S_ISREG(e.st.st_mode) || e.name == name || !format::parse_model_name(e.name)) continue;
      auto w = writing(static_cast<uint64_t>(e.st.st_dev), static_cast<uint64_t>(e.st.st_ino));
      if (!w || w->writers.load() == 0) return true;
    }
    return false;
  }

  // Whether the directory's checkpoint stays valid with file `name` stored as the rank shards of
  // `p`, in place of what the name (its file number) stores now: the same builder the view
  // uses, on the directory's other shards and records plus these. EINVAL names the first
  // problem (another file count, a tensor already in another file, no tensor at all, ...).
  Status validate_store(int dirfd, const std::string& display, std::string_view name,
                        const write::Prospect& p) {
    const auto mn = format::parse_model_name(name);
    if (!mn) return make_error(EINVAL, "{}: not a model name", name);
    CKPTFS_TRY(auto entries, source::list_dir(dirfd));
    std::erase_if(entries, [&](const source::DirEntry& e) {
      auto sh = format::parse_shard_name(e.name);
      return sh && sh->k == mn->k && sh->m == mn->m;  // what the commit replaces
    });
    auto in = source::read_input(dirfd, entries, display, headers, opts.build);
    // ...and what the records of that file number name (node-local shards are no entries).
    std::erase_if(in.shards, [&](const layout::ShardInput& si) {
      auto sh = format::parse_shard_name(si.name);
      return sh && sh->k == mn->k && sh->m == mn->m;
    });
    std::erase_if(in.overrides, [&](const layout::OutputOverride& o) {
      auto om = format::parse_model_name(o.name);
      return om && om->k == mn->k && om->m == mn->m;
    });
    const auto unsized = [](std::string_view bytes, const std::string& what) {
      return write::parse_header_unsized(bytes.substr(format::kHeaderLenBytes), what);
    };
    for (uint32_t r = 0; r < p.shard_headers.size(); ++r) {
      layout::ShardInput si;
      si.name = format::shard_file_name(r + 1, mn->k, mn->m);
      CKPTFS_TRY(auto h, unsized(p.shard_headers[r], si.name));
      si.header = std::make_shared<const format::Header>(std::move(h));
      in.shards.push_back(std::move(si));
    }
    layout::OutputOverride o;
    o.k = mn->k;
    o.name = std::string(name);
    o.header = std::string(p.header);
    CKPTFS_TRY(auto h, unsized(p.header, o.name));
    o.parsed = std::make_shared<const format::Header>(std::move(h));
    o.record = o.name;
    in.overrides.push_back(std::move(o));
    auto ck = layout::build_checkpoint(std::move(in), opts.build);
    if (!ck->valid()) {
      return make_error(EINVAL, "{}/{}: the directory's checkpoint would be invalid with it: {}",
                        display, name, ck->problems.front().to_string());
    }
    if (ck->find_output(name) == nullptr) {  // a file of no tensors has no shard to show it
      return make_error(EINVAL, "{}/{}: it holds no tensor, so no rank shard would show it",
                        display, name);
    }
    return {};
  }

  // The rules for storing file `name` of directory `dirfd` (write::StoreRules).
  write::StoreRules store_rules(int dirfd, const std::string& display, std::string_view name) {
    write::StoreRules r;
    if (!format::parse_model_name(name)) return r;
    if (split_hides_plain(dirfd, name)) {
      r.whole = Error{0, ""};
      return r;
    }
    r.validate = [this, dirfd, display](std::string_view n, const write::Prospect& p) {
      return validate_store(dirfd, display, n, p);
    };
    return r;
  }

  // Renames the nodes under `old_rel` to `new_rel` (and the reverse for an exchange).
  void renamed(Ino op, const std::string& oname, const std::string& old_rel, Ino np,
               const std::string& nname, const std::string& new_rel, bool exchange) {
    std::lock_guard lock(mu_);
    auto move = [](std::string& rel, const std::string& from, const std::string& to) {
      if (rel == from) {
        rel = to;
        return true;
      }
      if (rel.size() > from.size() && rel.starts_with(from) && rel[from.size()] == '/') {
        rel = to + rel.substr(from.size());
        return true;
      }
      return false;
    };
    for (auto& [ino, node] : nodes_) {
      if (node->key.type == 1) continue;  // virtual: follows its directory through the view
      if (move(node->rel, old_rel, new_rel)) continue;
      if (exchange) move(node->rel, new_rel, old_rel);
    }
    std::optional<Ino> a, b;
    if (auto it = kids_.find({op, oname}); it != kids_.end()) {
      a = it->second;
      kids_.erase(it);
    }
    if (auto it = kids_.find({np, nname}); it != kids_.end()) {
      b = it->second;
      kids_.erase(it);
    }
    auto relink = [&](Ino ino, std::pair<Ino, std::string> from, std::pair<Ino, std::string> to) {
      kids_[to] = ino;
      if (auto it = nodes_.find(ino); it != nodes_.end()) {
        auto& links = it->second->links;
        links.erase(std::remove(links.begin(), links.end(), from), links.end());
        links.push_back(to);
      }
    };
    if (a) relink(*a, {op, oname}, {np, nname});
    if (b && exchange) relink(*b, {np, nname}, {op, oname});
  }

  // Whether what the view hides in directory `dir` (whose listing is empty) may go with it:
  // only the remains of a broken checkpoint that has been quiet for the settle time, or the
  // write path's state, never a checkpoint still settling or being written, nor the mount
  // point itself.
  bool hidden_removable(const Node& dir) {
    if (!hidden_child(dir.rel).empty()) return false;
    {
      std::lock_guard lock(writes_mu_);
      for (const auto& [key, w] : writes_) {
        if (w.dir == DevIno{dir.dev, dir.bino} && !w.wf.expired()) return false;
      }
    }
    auto st = dir_state(dir.dev, dir.bino);
    std::lock_guard lock(st->mu);
    if (!st->view) return true;
    return st->settled && !st->building && !st->view->ckpt->valid() && !st->view_sig.files.empty();
  }

  // forget() under mu_: returns the state of a directory that was dropped, if any.
  std::shared_ptr<DirState> forget_locked(Ino ino, uint64_t n);

  void force_revalidate(const View& v) {
    auto st = dir_state(v.dir_dev, v.dir_ino);
    std::lock_guard lock(st->mu);
    st->next_check = Clock::now();
  }

  // A consolidated name was looked up while its checkpoint settles: rather than answer ENOENT
  // at once, wait (at most the settle time) until it is shown or stops settling. Woken early
  // by a writer's close; otherwise rechecks when the settle time would have passed.
  std::shared_ptr<const View> wait_settled(const Node& dir, std::shared_ptr<const View> v) {
    if (!v || !v->settling) return v;
    const auto deadline = Clock::now() + opts.settle + std::chrono::milliseconds(50);
    auto st = dir_state(v->dir_dev, v->dir_ino);
    while (v && v->settling) {
      const auto now = Clock::now();
      if (now >= deadline) break;
      {
        std::unique_lock lock(st->mu);
        auto until = std::clamp(st->next_check, now + std::chrono::milliseconds(10), deadline);
        st->built.wait_until(lock, until, [&] { return st->view != v && !st->building; });
      }
      auto dst = stat_beneath(root.get(), dir.rel);
      if (!dst) break;
      v = view_of(dir.rel, *dst, dir.ino, Need::Current);
    }
    return v;
  }

  // Last: destroyed first, so its thread never calls into a half-destroyed Impl.
  std::unique_ptr<source::CloseWatcher> watcher;
};

Filesystem::Filesystem(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Filesystem::~Filesystem() = default;

Result<std::unique_ptr<Filesystem>> Filesystem::create(const std::string& source, Options opts) {
  auto impl = std::make_unique<Impl>();
  impl->opts = std::move(opts);
  impl->source = source;
  CKPTFS_TRY(impl->root, open_file(source, O_RDONLY | O_DIRECTORY));
  struct stat st {};
  if (::fstat(impl->root.get(), &st) != 0) {
    return make_error(errno, "{}: cannot stat: {}", source, std::strerror(errno));
  }
  struct rlimit rl {};
  ::getrlimit(RLIMIT_NOFILE, &rl);
  const int64_t limit =
      rl.rlim_cur == RLIM_INFINITY ? (int64_t{1} << 20) : static_cast<int64_t>(rl.rlim_cur);
  // A quarter of the limit (16..256) stays free for FUSE channels, logs, plain files and the
  // one shard at a time a header scan opens; the rest may be held by open consolidated files.
  impl->fd_budget = limit - std::clamp<int64_t>(limit / 4, 16, 256);
  impl->flusher = impl->opts.flusher ? impl->opts.flusher
                                     : std::shared_ptr<flush::Flusher>(flush::make_local_flusher());
  impl->budget = std::make_unique<write::MemoryBudget>(impl->opts.write_memory);
  impl->writers = std::make_unique<WriterViews>(impl->opts.writer_view);
  impl->protected_regular =
      impl->opts.protected_regular >= 0 ? impl->opts.protected_regular : read_protected_regular();
  impl->root_dev = static_cast<uint64_t>(st.st_dev);
  impl->root_ino = static_cast<uint64_t>(st.st_ino);
  Node root;
  root.ino = kRootIno;
  root.key = Impl::real_key(st);
  root.kind = Kind::Dir;
  root.dev = impl->root_dev;
  root.bino = impl->root_ino;
  root.nlookup = 1;
  impl->keys_.emplace(root.key, kRootIno);
  impl->nodes_.emplace(kRootIno, std::make_shared<Node>(std::move(root)));
  Impl* raw = impl.get();
  impl->watcher =
      source::CloseWatcher::create([raw](uint64_t dev, uint64_t ino) { raw->on_close(dev, ino); });
  return std::unique_ptr<Filesystem>(new Filesystem(std::move(impl)));
}

void Filesystem::set_notifier(Notifier* n) { impl_->notifier = n; }

Result<EntryOut> Filesystem::lookup(Ino parent, std::string_view name, const Caller& who) {
  if (name.size() > NAME_MAX) return make_error(ENAMETOOLONG, "a name of {} bytes", name.size());
  if (!is_valid_component(name)) return make_error(ENOENT, "invalid name");
  auto dir = impl_->get(parent);
  if (!dir) return make_error(ESTALE, "unknown inode {}", parent);
  if (dir->kind == Kind::Dir) return impl_->lookup_in_dir(*dir, name, who);
  if (dir->kind == Kind::ShardsDir) return impl_->lookup_in_shards(*dir, name);
  if (dir->kind == Kind::StatusDir) {
    if (name != kStatusFileName) return make_error(ENOENT, "no such status file");
    return impl_->lookup_status(parent, Kind::StatusFile, name);
  }
  return make_error(ENOTDIR, "inode {} is not a directory", parent);
}

void Filesystem::forget(Ino ino, uint64_t n) {
  std::shared_ptr<DirState> dropped;  // released after mu_: DirState::mu comes first
  {
    std::lock_guard lock(impl_->mu_);
    dropped = impl_->forget_locked(ino, n);
  }
  if (!dropped) return;
  // Its shards' headers go from the cache too: a forgotten directory is most often one deleted
  // from SRC (see drop_vanished), whose headers would otherwise sit there until evicted.
  std::lock_guard lock(dropped->mu);
  for (const auto& [name, stamp] : dropped->sig.files) impl_->headers.evict(stamp);
}

std::shared_ptr<DirState> Filesystem::Impl::forget_locked(Ino ino, uint64_t n) {
  auto it = nodes_.find(ino);
  if (it == nodes_.end() || ino == kRootIno) return nullptr;
  auto& node = *it->second;
  if (n > node.nlookup) {
    spdlog::critical("forget({}, {}) with only {} lookups", ino, n, node.nlookup);
    std::abort();
  }
  node.nlookup -= n;
  if (node.nlookup > 0) return nullptr;
  // The kernel holds nothing of it any more: retire its number, its names and, for a
  // directory, its cached view (rebuilt from the header cache if it is looked up again).
  keys_.erase(node.key);
  for (const auto& link : node.links) {
    if (auto k = kids_.find(link); k != kids_.end() && k->second == ino) kids_.erase(k);
  }
  std::shared_ptr<DirState> dropped;
  if (node.kind == Kind::Dir) {
    if (auto d = dirs_.find({node.dev, node.bino}); d != dirs_.end()) {
      dropped = std::move(d->second);
      dirs_.erase(d);
    }
  }
  nodes_.erase(it);
  return dropped;
}

Result<struct stat> Filesystem::getattr(Ino ino) {
  auto n = impl_->get(ino);
  if (!n) return make_error(ESTALE, "unknown inode {}", ino);
  switch (n->kind) {
    case Kind::Output:
    case Kind::Index:
    case Kind::Pending:
      return impl_->virtual_attr(*n);
    case Kind::StatusDir:
    case Kind::StatusFile:
      return impl_->status_attr(*n);
    case Kind::ShardsDir: {
      CKPTFS_TRY(struct stat st, stat_beneath(impl_->root.get(), n->rel));
      st.st_ino = Impl::virtual_ino(n->dev, n->bino, 0, kShardsDirName);
      st.st_mode = S_IFDIR | 0555;
      return st;
    }
    default:
      return impl_->real_attr(*n);
  }
}

Result<std::string> Filesystem::readlink(Ino ino) {
  auto n = impl_->get(ino);
  if (!n) return make_error(ESTALE, "unknown inode {}", ino);
  if (n->kind != Kind::Symlink) return make_error(EINVAL, "not a symlink");
  const std::string last = last_of(n->rel);
  CKPTFS_TRY(UniqueFd dir,
             open_beneath(impl_->root.get(), parent_of(n->rel), O_PATH | O_DIRECTORY));
  std::string buf(PATH_MAX, '\0');
  ssize_t len = ::readlinkat(dir.get(), last.c_str(), buf.data(), buf.size());
  if (len < 0) return make_error(errno, "{}: readlink failed: {}", n->rel, std::strerror(errno));
  buf.resize(static_cast<size_t>(len));
  return buf;
}

Result<uint64_t> Filesystem::opendir(Ino ino, const Caller& who) {
  auto n = impl_->get(ino);
  if (!n) return make_error(ESTALE, "unknown inode {}", ino);
  if (n->kind != Kind::Dir && n->kind != Kind::ShardsDir && n->kind != Kind::StatusDir) {
    return make_error(ENOTDIR, "not a directory");
  }
  if (n->kind == Kind::Dir) CKPTFS_CHECK(impl_->real_attr(*n));
  std::vector<DirEntryOut> entries;
  if (n->kind == Kind::StatusDir) {
    Node file;
    file.kind = Kind::StatusFile;
    file.key.name = std::string(kStatusFileName);
    entries.push_back({file.key.name, impl_->status_attr(file).st_ino, S_IFREG});
  } else {
    CKPTFS_TRY(entries, impl_->list(*n, who));
  }
  auto h = std::make_unique<DirHandle>();
  // "." and ".." first, as a real directory lists them (d_ino as stat shows them).
  const uint64_t self = impl_->dir_ino_shown(*n);
  uint64_t parent = self;
  if (!n->links.empty()) {
    if (auto p = impl_->get(n->links.front().first)) parent = impl_->dir_ino_shown(*p);
  }
  h->entries.reserve(entries.size() + 2);
  h->entries.push_back(DirEntryOut{".", self, S_IFDIR});
  h->entries.push_back(DirEntryOut{"..", parent, S_IFDIR});
  for (auto& e : entries) h->entries.push_back(std::move(e));
  return Impl::adopt(impl_->handles_mu_, impl_->dirs_open_, std::move(h));
}

Status Filesystem::readdir(uint64_t dh, uint64_t offset,
                           const std::function<bool(const DirEntryOut&, uint64_t)>& add) {
  auto* h = reinterpret_cast<DirHandle*>(dh);
  for (uint64_t i = offset; i < h->entries.size(); ++i) {
    if (!add(h->entries[i], i + 1)) break;
  }
  return {};
}

void Filesystem::releasedir(uint64_t dh) { Impl::drop(impl_->handles_mu_, impl_->dirs_open_, dh); }

Result<OpenOut> Filesystem::open(Ino ino, int flags, const Caller& who) {
  auto n = impl_->get(ino);
  if (!n) return make_error(ESTALE, "unknown inode {}", ino);
  if ((flags & O_ACCMODE) != O_RDONLY || (flags & O_TRUNC)) {
    if (impl_->opts.read_only) return make_error(EROFS, "read-only view");
    impl_->note_writer_of(ino, who);
    return impl_->open_for_write(*n, flags);
  }
  if (n->kind == Kind::Output || n->kind == Kind::Index || n->kind == Kind::Pending) {
    const auto& in = n->view->inputs;
    if (!std::all_of(in.begin(), in.end(), [&](const Perm& p) { return may_read(p, who); })) {
      return make_error(EACCES, "{}: uid {} may not read every shard", n->rel, who.uid);
    }
  }
  auto h = std::make_unique<FileHandle>();
  h->ino = ino;
  OpenOut out;
  switch (n->kind) {
    case Kind::Output: {
      auto fds = impl_->shard_fds(n->view, n->rel);
      if (!fds) {
        impl_->force_revalidate(*n->view);
        return std::move(fds).error();
      }
      h->reader = std::make_shared<OutputReader>(n->view, *fds, n->output);
      out.keep_cache = true;  // this inode only ever has this version's bytes
      out.is_virtual = true;
      break;
    }
    case Kind::Index:
      h->reader = std::make_shared<MemoryReader>(n->view, n->view->ckpt->index_json);
      out.keep_cache = true;
      out.is_virtual = true;
      break;
    case Kind::Pending:
      h->reader = std::make_shared<MemoryReader>(n->view, n->view->pending);
      break;
    case Kind::StatusFile: {
      if (!who.root() && who.uid != ::geteuid()) {  // as its mode says (the kernel checks too)
        return make_error(EACCES, "status: uid {} is not the mount's owner", who.uid);
      }
      auto text = std::make_shared<const std::string>(impl_->status_json());
      h->reader = std::make_shared<MemoryReader>(text, *text);
      out.direct_io = true;
      break;
    }
    case Kind::File: {
      if (auto wf = impl_->writing(n->dev, n->bino)) {  // being written: what it holds now
        h->reader = std::make_shared<WriteFileReader>(wf);
        h->wf = std::move(wf);
        h->ino = ino;
        break;
      }
      struct stat st {};
      auto opened = open_regular_beneath(impl_->root.get(), n->rel, Resolve::Auto, &st);
      if (!opened && opened.error().code == ENOENT) {
        // The name the kernel holds is stale (the file went, or its name now shows a
        // consolidated file): ESTALE makes it look the name up again.
        return make_error(ESTALE, "{}: gone", n->rel);
      }
      CKPTFS_TRY(UniqueFd fd, std::move(opened));
      if (!(Impl::real_key(st) == n->key)) return make_error(ESTALE, "{}: replaced", n->rel);
      auto stamp = source::stamp_of(st);
      out.keep_cache = impl_->swap_cached_stamp(n->ino, stamp);
      h->reader = std::make_shared<PassthroughReader>(
          std::move(fd), static_cast<uint64_t>(st.st_size), impl_->source_path(n->rel));
      break;
    }
    case Kind::Dir:
    case Kind::ShardsDir:
    case Kind::StatusDir:
      return make_error(EISDIR, "is a directory");
    default:
      return make_error(EACCES, "special files cannot be opened through the view");
  }
  out.fh = Impl::adopt(impl_->handles_mu_, impl_->files_, std::move(h));
  return out;
}

Status Filesystem::read(uint64_t fh, uint64_t off, size_t len, ReadPlan& plan) {
  auto* h = reinterpret_cast<FileHandle*>(fh);
  h->reader->plan(off, len, plan);
  uint64_t n = plan.size;
  if (plan.passthrough()) {  // planned as asked: what the file held at open is what counts
    const uint64_t size = h->reader->size();
    n = off >= size ? 0 : std::min<uint64_t>(len, size - off);
  }
  impl_->reads.fetch_add(1, std::memory_order_relaxed);
  impl_->bytes_read.fetch_add(n, std::memory_order_relaxed);
  return {};
}

std::shared_ptr<const FileReader> Filesystem::reader(uint64_t fh) const {
  return reinterpret_cast<FileHandle*>(fh)->reader;
}

void Filesystem::release(uint64_t fh) {
  auto* h = reinterpret_cast<FileHandle*>(fh);
  std::shared_ptr<write::WriteFile> wf;
  if (h->writable && h->wf) {
    wf = h->wf;
    wf->writers.fetch_sub(1);
  }
  Impl::drop(impl_->handles_mu_, impl_->files_, fh);
  // The last handle gone: drop the file's registry entry (its state goes with `wf`).
  if (wf && wf.use_count() == 1) {
    const auto dev = static_cast<uint64_t>(wf->dev()), ino = static_cast<uint64_t>(wf->ino());
    wf.reset();
    impl_->writing(dev, ino);
  }
}

Result<struct statvfs> Filesystem::statfs() {
  struct statvfs sv {};
  if (::fstatvfs(impl_->root.get(), &sv) != 0) {
    return make_error(errno, "statfs failed: {}", std::strerror(errno));
  }
  return sv;
}

// --- writes --------------------------------------------------------------------------

#define CKPTFS_WRITABLE()                                                  \
  do {                                                                     \
    if (impl_->opts.read_only) return make_error(EROFS, "read-only view"); \
  } while (0)

Result<CreateOut> Filesystem::create(Ino parent, std::string_view name, mode_t mode, int flags,
                                     const Caller& who) {
  CKPTFS_WRITABLE();
  CKPTFS_TRY(auto d, impl_->dir_for_change(parent, name));
  const std::string n(name);
  const std::string where = impl_->source_path(join_rel(d.node.rel, name));
  if (auto shown = impl_->shown_output(d, name); shown.v) {
    // The name shows a consolidated file (or the index) the kernel had not looked up: it is
    // opened as open() opens that file, after the check the kernel makes on the mode shown.
    if (flags & O_EXCL) return make_error(EEXIST, "{}: exists", where);
    const bool index = shown.output == nullptr;
    const auto output =
        static_cast<uint32_t>(index ? 0 : shown.output - shown.v->ckpt->outputs.data());
    CKPTFS_TRY(EntryOut e, impl_->lookup_virtual(shown.v, d.node.rel, d.node.ino,
                                                 index ? Kind::Index : Kind::Output, output, n));
    const int acc = flags & O_ACCMODE;
    const int mask =
        (acc != O_WRONLY ? R_OK : 0) | (acc != O_RDONLY || (flags & O_TRUNC) ? W_OK : 0);
    auto opened = may(Perm::of(e.attr), who, mask)
                      ? open(e.ino, flags & ~(O_CREAT | O_EXCL), who)
                      : Result<OpenOut>(make_error(EACCES, "{}: uid {} may not open it that way",
                                                   where, who.uid));
    if (!opened) {
      forget(e.ino, 1);  // the kernel never gets this entry
      return std::move(opened).error();
    }
    return CreateOut{e, *opened};
  }
  UniqueFd file;
  const int fd = ::openat(d.fd.get(), n.c_str(), O_CREAT | O_EXCL | O_RDWR | O_NOFOLLOW | O_CLOEXEC,
                          mode & 07777);
  const bool made = fd >= 0;
  if (made) {
    file.reset(fd);
    impl_->give_to(file.get(), d, n, who, false);
  } else {
    if (errno != EEXIST || (flags & O_EXCL)) return errno_error(where);
    // An entry the kernel did not see (a name the view hides, or one made meanwhile): opened as
    // the file it is, with the checks the kernel makes for an existing file. Its owner never
    // changes. A symlink answers ELOOP (none is followed), a directory EISDIR.
    const int raw =
        ::openat(d.fd.get(), n.c_str(), O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
    if (raw < 0) return errno_error(where);
    struct stat st {};
    CKPTFS_TRY(file, require_regular(UniqueFd(raw), where, &st));
    CKPTFS_CHECK(may_open_existing(Perm::of(d.st), Perm::of(st), flags, who,
                                   impl_->protected_regular, where));
  }
  impl_->touched(d.dev, d.ino);
  impl_->note_writer(d.node, who);
  CKPTFS_TRY(EntryOut e, impl_->lookup_real(join_rel(d.node.rel, name), parent, name));
  auto wf = impl_->start_writing(std::move(file), d, n, made || (flags & O_TRUNC));
  if (!wf) {
    forget(e.ino, 1);
    return std::move(wf).error();
  }
  if (flags & O_TRUNC) CKPTFS_CHECK((*wf)->truncate(0));  // the inode may have been open already
  CreateOut out;
  out.entry = e;
  out.open.fh = impl_->adopt_writer(std::move(*wf), e.ino);
  return out;
}

Result<EntryOut> Filesystem::mkdir(Ino parent, std::string_view name, mode_t mode,
                                   const Caller& who) {
  CKPTFS_WRITABLE();
  CKPTFS_TRY(auto d, impl_->dir_for_change(parent, name));
  const std::string n(name);
  if (::mkdirat(d.fd.get(), n.c_str(), mode & 07777) != 0) {
    return errno_error(impl_->source_path(join_rel(d.node.rel, name)));
  }
  impl_->give_to(-1, d, n, who, true);
  impl_->touched(d.dev, d.ino);
  return impl_->lookup_real(join_rel(d.node.rel, name), parent, name);
}

Result<EntryOut> Filesystem::mknod(Ino parent, std::string_view name, mode_t mode,
                                   const Caller& who) {
  CKPTFS_WRITABLE();
  if (!S_ISREG(mode) && !S_ISFIFO(mode)) {
    return make_error(EPERM, "only regular files and FIFOs can be made here");
  }
  CKPTFS_TRY(auto d, impl_->dir_for_change(parent, name));
  const std::string n(name);
  if (::mknodat(d.fd.get(), n.c_str(), mode & (S_IFMT | 07777), 0) != 0) {
    return errno_error(impl_->source_path(join_rel(d.node.rel, name)));
  }
  impl_->give_to(-1, d, n, who, true);
  impl_->touched(d.dev, d.ino);
  return impl_->lookup_real(join_rel(d.node.rel, name), parent, name);
}

Result<EntryOut> Filesystem::symlink(std::string_view target, Ino parent, std::string_view name,
                                     const Caller& who) {
  CKPTFS_WRITABLE();
  CKPTFS_TRY(auto d, impl_->dir_for_change(parent, name));
  const std::string n(name);
  if (::symlinkat(std::string(target).c_str(), d.fd.get(), n.c_str()) != 0) {
    return errno_error(impl_->source_path(join_rel(d.node.rel, name)));
  }
  impl_->give_to(-1, d, n, who, true);
  impl_->touched(d.dev, d.ino);
  return impl_->lookup_real(join_rel(d.node.rel, name), parent, name);
}

Result<EntryOut> Filesystem::link(Ino ino, Ino new_parent, std::string_view new_name,
                                  const Caller& who) {
  CKPTFS_WRITABLE();
  auto n = impl_->get(ino);
  if (!n) return make_error(ESTALE, "unknown inode {}", ino);
  if (n->kind != Kind::File || impl_->writing(n->dev, n->bino)) {
    return make_error(EPERM, "only plain files that are not being written can be linked");
  }
  CKPTFS_TRY(auto d, impl_->dir_for_change(new_parent, new_name));
  // A link never replaces anything (a hidden name exists in SRC: EEXIST from linkat), and in a
  // checkpoint directory a model name shows a consolidated file or nothing: a real file linked
  // there would be hidden, its bytes unreachable under the name just made.
  if (impl_->shown_virtual(d, new_name)) {
    return make_error(EEXIST, "{}: exists", join_rel(d.node.rel, new_name));
  }
  if (is_model_output_name(new_name) && impl_->view_of(d.node.rel, d.st, d.node.ino, Need::Any)) {
    return make_error(EPERM,
                      "{}: a model name in a checkpoint directory shows its consolidated "
                      "file; link under another name",
                      join_rel(d.node.rel, new_name));
  }
  CKPTFS_TRY(UniqueFd from,
             open_beneath(impl_->root.get(), parent_of(n->rel), O_PATH | O_DIRECTORY));
  const std::string last = last_of(n->rel);
  if (::linkat(from.get(), last.c_str(), d.fd.get(), std::string(new_name).c_str(), 0) != 0) {
    return errno_error(impl_->source_path(join_rel(d.node.rel, new_name)));
  }
  impl_->touched(d.dev, d.ino);
  impl_->note_writer(d.node, who);
  return impl_->lookup_real(join_rel(d.node.rel, new_name), new_parent, new_name);
}

Status Filesystem::unlink(Ino parent, std::string_view name, const Caller& who) {
  CKPTFS_WRITABLE();
  CKPTFS_TRY(auto d, impl_->dir_for_change(parent, name, ENOENT));
  const std::string n(name);
  if (auto out = impl_->shown_output(d, name); out.v) {
    if (!out.output) return {};  // a synthesized index: nothing is stored, it goes with them
    // The kernel checked the mode shown; what goes is every shard, each checked as the kernel
    // would check its removal (the sticky bit: shards of several owners).
    CKPTFS_CHECK(impl_->may_delete_all(d, Impl::output_perms(*out.v, *out.output), who,
                                       join_rel(d.node.rel, name)));
    auto st = d.state();
    std::unique_lock lock(st->mu);
    st->built.wait(lock, [&] { return !st->building; });
    const auto& ck = *out.v->ckpt;
    CKPTFS_CHECK(impl_->flusher->remove(d.target(impl_->source_path(d.node.rel)), out.output->k,
                                        ck.shards.empty() ? 1 : ck.shards[0].parsed.m));
    ::unlinkat(d.fd.get(), n.c_str(), 0);  // a placeholder of a newer version, if any
    st->next_check = Clock::now();
    impl_->touched(d.dev, d.ino);
    impl_->note_writer(d.node, who);
    return {};
  }
  CKPTFS_CHECK(impl_->may_delete_entry(d, n, who));
  impl_->retire_if_last(d.fd.get(), n);
  if (::unlinkat(d.fd.get(), n.c_str(), 0) != 0) {
    return errno_error(impl_->source_path(join_rel(d.node.rel, name)));
  }
  impl_->touched(d.dev, d.ino);
  impl_->note_writer(d.node, who);
  impl_->recheck(d);
  return {};
}

Status Filesystem::rmdir(Ino parent, std::string_view name, const Caller& who) {
  CKPTFS_WRITABLE();
  CKPTFS_TRY(auto d, impl_->dir_for_change(parent, name, ENOENT));
  const std::string n(name);
  const std::string rel = join_rel(d.node.rel, name);
  CKPTFS_CHECK(impl_->may_delete_entry(d, n, who));
  if (::unlinkat(d.fd.get(), n.c_str(), AT_REMOVEDIR) == 0) {
    impl_->touched(d.dev, d.ino);
    return {};
  }
  if (errno != ENOTEMPTY && errno != EEXIST) return errno_error(impl_->source_path(rel));
  // Not empty in SRC. If the view shows nothing in it, what remains is hidden (the write
  // path's state, a broken checkpoint's shards, an empty .hf_metadata): it goes too, as the
  // caller cannot see or remove it.
  std::optional<Node> child;
  {
    std::lock_guard lock(impl_->mu_);
    if (auto k = impl_->kids_.find({parent, n}); k != impl_->kids_.end()) {
      if (auto it = impl_->nodes_.find(k->second); it != impl_->nodes_.end()) child = *it->second;
    }
  }
  if (!child || child->kind != Kind::Dir || child->rel != rel) {
    return make_error(ENOTEMPTY, "{}: not empty", impl_->source_path(rel));
  }
  CKPTFS_TRY(auto shown, impl_->list(*child));
  if (!shown.empty() || !impl_->hidden_removable(*child)) {
    return make_error(ENOTEMPTY, "{}: not empty", impl_->source_path(rel));
  }
  CKPTFS_TRY(UniqueFd cfd, open_at(d.fd.get(), n, O_RDONLY | O_DIRECTORY | O_NOFOLLOW));
  CKPTFS_TRY(auto left, source::list_dir(cfd.get()));
  // Only what the caller could have removed itself, were it shown (the daemon's own .ckptfs
  // counts as an entry of the directory).
  if (auto may = impl_->may_empty(cfd.get(), who, rel, 0); !may) {
    return make_error(ENOTEMPTY, "{}: not empty ({})", impl_->source_path(rel),
                      may.error().message);
  }
  for (const auto& e : left) flush::remove_tree(cfd.get(), e.name);
  if (::unlinkat(d.fd.get(), n.c_str(), AT_REMOVEDIR) != 0) {
    return errno_error(impl_->source_path(rel));
  }
  impl_->touched(d.dev, d.ino);
  return {};
}

Status Filesystem::rename(Ino parent, std::string_view name, Ino new_parent,
                          std::string_view new_name, unsigned flags, const Caller& who) {
  CKPTFS_WRITABLE();
  CKPTFS_TRY(auto from, impl_->dir_for_change(parent, name, ENOENT));
  CKPTFS_TRY(auto to, impl_->dir_for_change(new_parent, new_name));
  if (impl_->shown_virtual(from, name)) {
    return make_error(EXDEV, "{}: a consolidated file is not renamed in place (copy it)",
                      join_rel(from.node.rel, name));
  }
  const auto shown_over = impl_->shown_output(to, new_name);
  const bool over_virtual = shown_over.v != nullptr;
  if (over_virtual && (flags & RENAME_NOREPLACE)) {
    return make_error(EEXIST, "{}: exists", join_rel(to.node.rel, new_name));
  }
  if (over_virtual && (flags & RENAME_EXCHANGE)) {
    return make_error(EXDEV, "{}: a consolidated file is not exchanged",
                      join_rel(to.node.rel, new_name));
  }
  const std::string o(name), nn(new_name);
  if (format::parse_model_name(new_name) && !(flags & RENAME_EXCHANGE)) {
    // Onto a model name of a directory of other files' rank shards: only a consolidated file
    // that fits its checkpoint (split into shards here) can be seen there. Anything else would
    // be hidden: refused now, before anything moves. A file still being written is decided
    // when its writer closes it.
    CKPTFS_TRY(auto entries, source::list_dir(to.fd.get()));
    if (impl_->name_state(to.fd.get(), entries, nn).others) {
      struct stat sst {};
      Status why = make_error(EINVAL, "{}: not a regular file", o);
      if (::fstatat(from.fd.get(), o.c_str(), &sst, AT_SYMLINK_NOFOLLOW) == 0 &&
          S_ISREG(sst.st_mode)) {
        auto open =
            impl_->writing(static_cast<uint64_t>(sst.st_dev), static_cast<uint64_t>(sst.st_ino));
        if (open && open->writers.load() > 0) {
          why = {};
        } else if (auto fd = open_at(from.fd.get(), o, O_RDONLY | O_NOFOLLOW | O_NONBLOCK); !fd) {
          why = std::move(fd).error();
        } else if (auto sp = write::WriteFile::prospect(
                       fd->get(), impl_->plan_options(to.fd.get(), impl_->source_path(to.node.rel)),
                       impl_->source_path(join_rel(from.node.rel, name)));
                   !sp) {
          why = std::move(sp).error();
        } else {
          why = impl_->validate_store(to.fd.get(), impl_->source_path(to.node.rel), nn,
                                      write::Prospect{sp->header, sp->shard_headers});
        }
      }
      if (!why) {
        return make_error(EINVAL,
                          "{}: in a directory of rank shards a model name shows a consolidated "
                          "file that fits its checkpoint, and {} would be hidden: {}",
                          impl_->source_path(join_rel(to.node.rel, new_name)), o,
                          why.error().message);
      }
    }
  }
  // What the kernel checked on what it sees, the daemon checks on what is really there: the
  // source, and the entry replaced (it may be hidden: a shard file, a real model file), or the
  // shards of the consolidated file replaced.
  CKPTFS_CHECK(impl_->may_delete_entry(from, o, who));
  if (!(flags & RENAME_NOREPLACE)) {
    struct stat victim {};
    if (::fstatat(to.fd.get(), nn.c_str(), &victim, AT_SYMLINK_NOFOLLOW) == 0) {
      CKPTFS_CHECK(may_delete(Perm::of(to.st), Perm::of(victim), who,
                              impl_->source_path(join_rel(to.node.rel, new_name))));
    } else if (flags & RENAME_EXCHANGE) {
      return make_error(ENOENT, "{}: nothing to exchange with", join_rel(to.node.rel, new_name));
    }
  }
  if (over_virtual) {
    CKPTFS_CHECK(impl_->may_delete_all(to,
                                       shown_over.output
                                           ? Impl::output_perms(*shown_over.v, *shown_over.output)
                                           : shown_over.v->inputs,
                                       who, join_rel(to.node.rel, new_name)));
  }
  if (!(flags & (RENAME_EXCHANGE | RENAME_NOREPLACE)) &&
      !(from.dev == to.dev && from.ino == to.ino && o == nn)) {
    impl_->retire_if_last(to.fd.get(), nn);  // the entry replaced, if any
  }
  if (::renameat2(from.fd.get(), o.c_str(), to.fd.get(), nn.c_str(), flags) != 0) {
    return errno_error(fmt::format("rename {} to {}",
                                   impl_->source_path(join_rel(from.node.rel, name)),
                                   impl_->source_path(join_rel(to.node.rel, new_name))));
  }
  impl_->renamed(parent, o, join_rel(from.node.rel, name), new_parent, nn,
                 join_rel(to.node.rel, new_name), (flags & RENAME_EXCHANGE) != 0);
  impl_->touched(from.dev, from.ino);
  impl_->touched(to.dev, to.ino);
  impl_->note_writer(from.node, who);
  impl_->note_writer(to.node, who);
  impl_->recheck(from);
  impl_->recheck(to);
  if (!format::parse_model_name(new_name)) return {};
  // A file renamed onto a model name: one being written is stored when it is closed; a closed
  // one is stored now. Either way it replaces the version shown under that name.
  struct stat st {};
  if (::fstatat(to.fd.get(), nn.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode)) {
    return {};
  }
  if (auto open =
          impl_->writing(static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino));
      open && open->writers.load() > 0) {
    return {};  // stored when its writer closes it, under the name it has then
  }
  CKPTFS_TRY(UniqueFd fd, open_at(to.fd.get(), nn, O_RDWR | O_NOFOLLOW | O_NONBLOCK));
  // The registered state if the file is still open (read-only, or a release not yet here).
  CKPTFS_TRY(auto wf, impl_->start_writing(std::move(fd), to, nn, false));
  auto dst = to.state();
  std::unique_lock lock(dst->mu);
  dst->built.wait(lock, [&] { return !dst->building; });
  const std::string to_display = impl_->source_path(to.node.rel);
  CKPTFS_CHECK(wf->store(write::Place{to.fd.get(), nn, to_display},
                         impl_->store_rules(to.fd.get(), to_display, nn)));
  if (wf->state() == write::WriteFile::State::Committed) {
    // Its backing file is gone (the shards are the file now): the kernel's entry for the name
    // still holds that file's node, which must look the name up again (ESTALE, then the view).
    impl_->retire_key(Impl::real_key(st));
    if (impl_->notifier) impl_->notifier->inval_entry(new_parent, nn);
  }
  if (auto why = wf->stored_whole()) {
    // Stored whole: it replaces what the name stored (the rename says so), whose shards go;
    // if other files' shards remain, it is hidden (the check above let only consolidated
    // files through: splitting this one failed).
    CKPTFS_TRY(auto entries, source::list_dir(to.fd.get()));
    const auto ns = impl_->name_state(to.fd.get(), entries, nn);
    if (ns.others) {
      // It would be hidden (it could not be split after all: memory, staging, a header too
      // large): the rename is undone, and fails.
      if (::renameat2(to.fd.get(), nn.c_str(), from.fd.get(), o.c_str(), RENAME_NOREPLACE) == 0) {
        impl_->renamed(new_parent, nn, join_rel(to.node.rel, new_name), parent, o,
                       join_rel(from.node.rel, name), false);
      } else {
        spdlog::error("{}: cannot undo the rename: {}", why->message, std::strerror(errno));
      }
      return *why;
    }
    if (ns.stored) {
      auto mn = format::parse_model_name(new_name);
      CKPTFS_CHECK(
          impl_->flusher->remove(to.target(impl_->source_path(to.node.rel)), mn->k, mn->m));
    }
  }
  dst->next_check = Clock::now();
  impl_->touched(to.dev, to.ino);
  return {};
}

Result<struct stat> Filesystem::setattr(Ino ino, const SetAttr& a, std::optional<uint64_t> fh) {
  CKPTFS_WRITABLE();
  auto n = impl_->get(ino);
  if (!n) return make_error(ESTALE, "unknown inode {}", ino);
  struct timespec times[2] = {{0, UTIME_OMIT}, {0, UTIME_OMIT}};
  if (a.atime) times[0] = *a.atime;
  if (a.mtime) times[1] = *a.mtime;
  if (n->kind == Kind::Output && fh) {
    // A new version being written through a handle opened with O_TRUNC: its writer sizes it
    // (ftruncate before the data, as safetensors does) and may set its mode and times (cp -a
    // does, before closing it); its backing file carries them to its shards at commit.
    auto* h = reinterpret_cast<FileHandle*>(*fh);
    if (h->wf && h->writable) {
      if (a.size) CKPTFS_CHECK(h->wf->truncate(*a.size));
      CKPTFS_CHECK(h->wf->set_attr(a.mode, a.uid, a.gid, times));
      return getattr_handle(*fh);
    }
  }
  if (n->kind == Kind::Output && !a.size && n->view->ckpt->outputs[n->output].written) {
    return impl_->set_written_attr(*n, a, times);
  }
  if (n->kind == Kind::Output || n->kind == Kind::Index || n->kind == Kind::ShardsDir ||
      n->kind == Kind::Pending || n->kind == Kind::StatusDir || n->kind == Kind::StatusFile) {
    return make_error(EPERM, "{}: a consolidated file's attributes follow its shards", n->rel);
  }
  std::shared_ptr<write::WriteFile> wf;
  if (fh) wf = reinterpret_cast<FileHandle*>(*fh)->wf;
  if (!wf && n->kind == Kind::File) wf = impl_->writing(n->dev, n->bino);
  const std::string where = impl_->source_path(n->rel);
  if (a.size) {
    if (n->kind == Kind::Dir) return make_error(EISDIR, "{}: is a directory", where);
    if (wf) {
      CKPTFS_CHECK(wf->truncate(*a.size));
    } else {
      CKPTFS_TRY(UniqueFd fd, open_beneath(impl_->root.get(), n->rel,
                                           O_WRONLY | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY));
      CKPTFS_TRY(fd, require_regular(std::move(fd), where));
      if (::ftruncate(fd.get(), static_cast<off_t>(*a.size)) != 0) return errno_error(where);
    }
  }
  // The entry by its parent and name (the root by itself).
  const bool is_root = n->rel.empty();
  const std::string last = is_root ? std::string(".") : last_of(n->rel);
  CKPTFS_TRY(UniqueFd pfd, open_beneath(impl_->root.get(), is_root ? "" : parent_of(n->rel),
                                        O_PATH | O_DIRECTORY));
  if (a.mode && n->kind != Kind::Symlink) {
    if (::fchmodat(pfd.get(), last.c_str(), *a.mode & 07777, 0) != 0) return errno_error(where);
  }
  if (a.uid || a.gid) {
    if (::fchownat(pfd.get(), last.c_str(), a.uid ? *a.uid : static_cast<uid_t>(-1),
                   a.gid ? *a.gid : static_cast<gid_t>(-1), AT_SYMLINK_NOFOLLOW) != 0) {
      return errno_error(where);
    }
  }
  if (a.atime || a.mtime) {
    struct timespec ts[2] = {{0, UTIME_OMIT}, {0, UTIME_OMIT}};
    if (a.atime) ts[0] = *a.atime;
    if (a.mtime) ts[1] = *a.mtime;
    if (::utimensat(pfd.get(), last.c_str(), ts, AT_SYMLINK_NOFOLLOW) != 0) {
      return errno_error(where);
    }
  }
  if (n->kind == Kind::Dir) impl_->touched(n->dev, n->bino);
  if (fh) return getattr_handle(*fh);
  return getattr(ino);
}

Result<size_t> Filesystem::write(uint64_t fh, uint64_t off, std::string_view bytes) {
  auto* h = reinterpret_cast<FileHandle*>(fh);
  if (!h->wf || !h->writable) return make_error(EBADF, "not open for writing");
  CKPTFS_CHECK(h->wf->write(off, bytes));
  return bytes.size();
}

Status Filesystem::flush(uint64_t fh, const Caller& who) {
  auto* h = reinterpret_cast<FileHandle*>(fh);
  if (!h->wf || !h->writable) return {};
  impl_->note_writer_of(h->ino, who);
  return impl_->settle_file(*h, [this](write::WriteFile& wf, const write::Place& p) -> Status {
    CKPTFS_CHECK(wf.finalize(
        p, p.dirfd < 0 ? write::StoreRules{} : impl_->store_rules(p.dirfd, p.dir_display, p.name)));
    if (p.dirfd < 0) return {};
    auto why = wf.stored_whole();
    if (!why) return {};
    return impl_->place_whole(p.dirfd, p.dir_display, p.name, *why);
  });
}

Status Filesystem::fsync(uint64_t fh, bool datasync) {
  auto* h = reinterpret_cast<FileHandle*>(fh);
  if (!h->wf) return {};
  return impl_->settle_file(*h, [datasync](write::WriteFile& wf, const write::Place& p) {
    return wf.fsync(p, datasync);
  });
}

Status Filesystem::fsyncdir(Ino ino) {
  auto n = impl_->get(ino);
  if (!n) return make_error(ESTALE, "unknown inode {}", ino);
  if (n->kind != Kind::Dir) return {};
  CKPTFS_TRY(UniqueFd fd, open_beneath(impl_->root.get(), n->rel, O_RDONLY | O_DIRECTORY));
  if (::fsync(fd.get()) != 0) return errno_error(impl_->source_path(n->rel));
  return {};
}

Result<struct stat> Filesystem::getattr_handle(uint64_t fh) {
  auto* h = reinterpret_cast<FileHandle*>(fh);
  if (!h->wf) return getattr(h->ino);
  auto n = impl_->get(h->ino);
  if (n && n->kind == Kind::File) {
    if (auto st = getattr(h->ino); st) return st;  // the name still holds it
  }
  CKPTFS_TRY(struct stat st, h->wf->stat());
  st.st_ino = impl_->shown_ino(static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino));
  return st;
}

Filesystem::Counts Filesystem::counts() const {
  Counts c;
  {
    std::lock_guard lock(impl_->mu_);
    c.nodes = impl_->nodes_.size();
    c.keys = impl_->keys_.size();
    c.dirs = impl_->dirs_.size();
  }
  c.header_bytes = impl_->headers.bytes();
  return c;
}

void Filesystem::invalidate_all() {
  std::vector<std::shared_ptr<DirState>> all;
  {
    std::lock_guard lock(impl_->mu_);
    for (auto& [k, v] : impl_->dirs_) all.push_back(v);
  }
  for (auto& s : all) {
    std::lock_guard lock(s->mu);
    s->next_check = Clock::now();
  }
}

std::string Filesystem::Impl::status_json() {
  using nlohmann::json;
  json out;
  out["version"] = CKPTFS_VERSION;
  out["source"] = source;
  out["pid"] = ::getpid();
  out["uptime_s"] = (now_realtime_ns() - started_ns) / kNsPerSec;
  out["read_only"] = opts.read_only;

  // Checkpoint directories the daemon tracks now (those the kernel holds an inode of).
  std::vector<std::shared_ptr<DirState>> dirs;
  {
    std::lock_guard lock(mu_);
    for (auto& [k, v] : dirs_) dirs.push_back(v);
  }
  json list = json::array();
  std::map<std::string, uint64_t> by_state;
  for (auto& d : dirs) {
    std::shared_ptr<const View> v;
    bool unread = false;
    {
      std::lock_guard lock(d->mu);
      v = d->view;
      unread = d->needs_build || d->building;
    }
    if (!v) continue;  // not a checkpoint directory
    json c;
    c["path"] = source_path(v->rel);
    std::string state = v->complete ? "serving" : v->settling ? "settling" : "refused";
    if (state == "refused" && unread) state = "unread";  // shards' headers not read (yet)
    c["state"] = state;
    if (state == "serving") {
      c["files"] = v->ckpt->outputs.size();
      c["tensors"] = v->ckpt->tensors.size();
      uint64_t bytes = 0;
      for (const auto& o : v->ckpt->outputs) bytes += o.size;
      c["bytes"] = bytes;
    }
    if (state == "refused") {
      json problems = json::array();
      for (const auto& p : v->ckpt->problems) {
        if (problems.size() == 16) break;
        problems.push_back(p.to_string());
      }
      c["problems"] = std::move(problems);
      c["problem_count"] = v->ckpt->problems.size();
    }
    by_state[state]++;
    list.push_back(std::move(c));
  }
  std::sort(list.begin(), list.end(),
            [](const json& a, const json& b) { return a["path"] < b["path"]; });
  json ck;
  ck["tracked"] = list.size();
  for (const char* st : {"serving", "settling", "refused", "unread"}) ck[st] = by_state[st];
  ck["built_total"] = builds.load();
  ck["refused_total"] = refusals.load();
  ck["list"] = std::move(list);
  out["checkpoints"] = std::move(ck);

  out["reads"] = {{"requests", reads.load()}, {"bytes", bytes_read.load()}};
  size_t writing = 0;
  {
    std::lock_guard lock(writes_mu_);
    for (const auto& [k, w] : writes_) writing += w.wf.expired() ? 0 : 1;
  }
  out["writes"] = {{"open_files", writing}};

  json extra = json::object();
  json errs = json::object();
  {
    std::lock_guard lock(status_mu_);
    if (status_extra_) {
      for (auto& [k, v] : status_extra_()) extra[k] = v;
    }
    for (auto& [e, n] : errors_by_errno_) {
      const char* name = ::strerrorname_np(e);
      errs[name ? std::string(name) : std::to_string(e)] = n;
    }
  }
  out["prefetch"] = std::move(extra);
  out["errors"] = {{"total", errors.load()}, {"by_errno", std::move(errs)}};
  out["cache"] = {{"header_bytes", headers.bytes()}, {"shard_fds_open", open_shard_fds.load()}};
  return out.dump(2, ' ', false, json::error_handler_t::replace) + "\n";
}

std::string Filesystem::status_json() const { return impl_->status_json(); }

void Filesystem::set_status_extra(StatusExtra extra) {
  std::lock_guard lock(impl_->status_mu_);
  impl_->status_extra_ = std::move(extra);
}

void Filesystem::note_error(int err) {
  impl_->errors.fetch_add(1, std::memory_order_relaxed);
  std::lock_guard lock(impl_->status_mu_);
  if (impl_->errors_by_errno_.size() < 64 || impl_->errors_by_errno_.count(err)) {
    impl_->errors_by_errno_[err]++;
  }
}

}  // namespace ckptfs::fs
