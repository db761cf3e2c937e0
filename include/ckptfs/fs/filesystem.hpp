// Filesystem semantics of the consolidated view, with no libfuse include: the FUSE adapter
// is a thin translation of these calls, and tests drive this class directly.
//
// What a directory shows:
//  - a plain directory of SRC is mirrored;
//  - a directory holding rank shards (a checkpoint directory) shows, in place of its shards,
//    the consolidated model-0000k-of-0000m.safetensors files and model.safetensors.index.json
//    (only while the checkpoint validates and has settled), its other files, and the files of
//    .hf_metadata/ except the mapping files (fqn_to_file_index_mapping.json and
//    fqn_to_dtype_mapping.json); optionally a .shards/ folder with the hidden files.
//
// Consistency: each version of a checkpoint directory is an immutable View. A consolidated
// file's inode belongs to one View; when the shards change a new View gets new inodes, the
// kernel is told to drop the old names, and open files keep reading their own version from
// the shard fds they opened.
#pragma once

#include <sys/stat.h>
#include <sys/statvfs.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ckptfs/flush/flusher.hpp"
#include "ckptfs/fs/access.hpp"
#include "ckptfs/fs/seams.hpp"
#include "ckptfs/io/gather.hpp"
#include "ckptfs/layout/checkpoint.hpp"
#include "ckptfs/util/result.hpp"
#include "ckptfs/write/plan.hpp"

namespace ckptfs::fs {

using Ino = uint64_t;
inline constexpr Ino kRootIno = 1;
inline constexpr std::string_view kShardsDirName = ".shards";
// The daemon's status: a read-only virtual directory at the root of the mount, never listed,
// holding kStatusFileName (JSON, generated at each open). Elsewhere the name stays reserved.
inline constexpr std::string_view kStatusDirName = ".ckptfs";
inline constexpr std::string_view kStatusFileName = "status.json";

// Figures of the layers above the Filesystem (the FUSE adapter's prefetcher), for the status
// file: (name, value) pairs under "prefetch".
using StatusExtra = std::function<std::vector<std::pair<std::string, uint64_t>>()>;

struct Options {
  bool show_shards = false;  // expose hidden files under .shards/
  // Plain files opened read-only may be served by the kernel from their file in SRC (FUSE
  // passthrough, OpenOut::backing_fd); set by the adapter once the kernel has accepted it.
  bool backing = false;
  // With `backing`, only files on a file system the kernel may write through the mount too
  // (write::kernel_may_write): a writer joins their backed readers, and never waits for them.
  // The read-write default; `-o passthrough=on` backs every plain file.
  bool backing_where_writable = false;
  // Files opened for writing are served by the kernel from their backing file too (with
  // `backing`): no WRITE request reaches the daemon, which reads the file at close.
  bool backing_writes = false;
  // How long a write open of such a file waits for the releases of readers that closed it
  // (the kernel tells the daemon a moment after close) before it fails with ETXTBSY.
  std::chrono::milliseconds backing_grace{200};
  std::chrono::milliseconds revalidate{1000};  // TTL of a directory's cached view
  std::chrono::milliseconds settle{1000};      // quiet time before a checkpoint shows
  layout::BuildOptions build;
  // Writes: refused (EROFS) when read_only. A consolidated safetensors file written through
  // the view is split into `ranks` rank shards (0: the flusher's default) by `split`.
  bool read_only = false;
  uint32_t ranks = 0;
  write::PlanOptions::Split split = write::PlanOptions::EvenDim0;
  std::shared_ptr<flush::Flusher> flusher;  // null: flush::make_local_flusher()
  // What all files being written may hold in memory together (headers being sniffed, routed
  // files' headers and shard headers); past it a file is staged to disk and split at close.
  uint64_t write_memory = 256ull << 20;
  // fs.protected_regular, applied to names the kernel cannot see (-1: this kernel's).
  int protected_regular = -1;
  // The writer's view (fs/writers.hpp): a process that wrote through the mount in a checkpoint
  // directory, its parent or a child of it within this long sees that directory as written
  // (its shard files listed), so a consolidating writer reads back what it wrote. 0: off.
  std::chrono::milliseconds writer_view{600'000};
  // A path relative to the source that is never looked at: the mount point itself when it
  // lies inside the source (stat'ing it would call the daemon from inside the daemon).
  std::string hide_rel;
  // The time (fs/seams.hpp); null: the system's clocks. Tests pass a ManualClock.
  std::shared_ptr<const Clock> clock;
  // Makes the close watch (fs/seams.hpp); null: inotify_close_watch.
  CloseWatch::Factory close_watch;
  // Called on the thread of the splits after close (write/resplit.hpp) before each one; null:
  // none. Tests hold the splits there, to look at a file between its close and its split.
  std::function<void()> split_gate;
  // Threads running splits after close of different files at once (fs/resplits); 0: one per
  // 4 cores, 1 to 4.
  unsigned split_threads = 0;
  // Threads that build checkpoint views for when_ready's callers (fs/builds.hpp), so that no
  // FUSE worker reads a header or waits for another's build. 0: when_ready always says ready,
  // and every build runs on the thread that needs it (tests drive that path directly).
  unsigned build_threads = 0;
  // Called at the start of every view build with the directory's path relative to SRC: a seam
  // for tests (it may block until released, or throw). Null in production.
  std::function<void(const std::string&)> on_build;
};

// Told when names or inodes the kernel may cache have changed. Implementations must not call
// back into the kernel synchronously from the calling thread (it may hold a request).
class Notifier {
 public:
  virtual ~Notifier() = default;
  virtual void inval_entry(Ino parent, const std::string& name) = 0;
  virtual void inval_inode(Ino ino) = 0;
  // Returns once everything queued before the call reached the kernel, or after `timeout`.
  // Only from a thread that holds no lock of the filesystem and answers a request during
  // which the kernel holds no directory lock (FLUSH, FSYNC).
  virtual void sync(std::chrono::milliseconds /*timeout*/) {}
};

struct EntryOut {
  Ino ino = 0;
  struct stat attr {};
  // Found only in the writer's view (a shard file in a checkpoint directory): the kernel must
  // not keep it for other processes (entry and attribute timeouts 0).
  bool uncached = false;
};

struct DirEntryOut {
  std::string name;
  Ino ino = 0;
  mode_t type = 0;  // S_IFDIR, S_IFREG, ...
};

// A plan for one read: segments plus the sources they refer to. The FUSE adapter turns it
// into a zero-copy reply (fd-backed buffers) or gathers it into one buffer.
class FileReader;

struct ReadPlan {
  std::vector<layout::Segment> segs;
  io::GatherSource src;
  uint64_t size = 0;  // bytes planned (short at end of file)
  // Set instead of segments for a file open for writing: execute() asks it for the bytes.
  const FileReader* direct = nullptr;
  uint64_t direct_off = 0;

  // Some segment converts a dtype or picks elements at a stride
  // (layout::Segment::is_transformed): its bytes exist only once gathered, so such a plan is
  // never spliced.
  [[nodiscard]] bool has_transformed() const {
    return std::any_of(segs.begin(), segs.end(),
                       [](const layout::Segment& s) { return s.is_transformed(); });
  }

  // Some segment reads a shard on a node-local target (no fd here): never spliced either.
  [[nodiscard]] bool has_remote() const {
    return std::any_of(segs.begin(), segs.end(), [&](const layout::Segment& s) {
      return !s.is_memory() && s.shard < src.fds.size() && src.fds[s.shard] < 0;
    });
  }
  // A plain file: one run of one fd, read like the file (short at its current end).
  [[nodiscard]] bool passthrough() const {
    return direct == nullptr && src.ckpt == nullptr && segs.size() == 1 && !segs[0].is_memory();
  }
};

// Copies the bytes of a plan into `dst` (at least plan.size bytes); returns how many.
Result<size_t> execute(const ReadPlan& plan, char* dst);

// Checks that every shard a plan reads is still the file its view was built from: the size and
// mtime stamped then (EIO, naming the shard, when it was rewritten, grew or shrank: a read would
// mix two versions). One fstat per shard a request reads. execute() calls it after gathering a
// view's bytes (a rewrite during the read shows then); a spliced reply cannot report an error
// after the fact, so the adapter calls it before splicing.
Status check_extents(const ReadPlan& plan);
// Whether the plan's bytes may be handed to the kernel as buffers it splices from the shards'
// fds: nothing converted or strided, no node-local shard, a plain file or at most 16
// segments; and its shards unchanged since the view was built (a short splice would reach the
// reader as an early end of file, so a shrunken shard is an error here).
Result<bool> splice_ready(const ReadPlan& plan);

// Everything a read of one open file depends on, kept alive by handles and the prefetcher.
class FileReader {
 public:
  virtual ~FileReader() = default;
  [[nodiscard]] virtual uint64_t size() const = 0;
  virtual void plan(uint64_t off, uint64_t len, ReadPlan& out) const = 0;
  // Reads [off, off+len) (clamped) into dst; returns bytes read.
  Result<size_t> read(uint64_t off, size_t len, char* dst) const;
  // For readers with no segments to plan (a file open for writing): reads directly.
  virtual Result<size_t> read_direct(uint64_t off, size_t len, char* dst) const;
};

struct OpenOut {
  uint64_t fh = 0;
  bool keep_cache = false;  // page cache still matches this file's bytes
  bool is_virtual = false;  // a synthesized consolidated file or index
  bool direct_io = false;   // content made at open (the status file): stat's size means nothing
  // >= 0: the kernel may serve this open from that file (valid while the handle lives) by
  // FUSE passthrough; if it cannot, backing_refused(fh) says so.
  int backing_fd = -1;
};

// Attribute changes of a setattr; unset fields stay. A time with tv_nsec == UTIME_NOW is now.
struct SetAttr {
  std::optional<mode_t> mode;
  std::optional<uid_t> uid;
  std::optional<gid_t> gid;
  std::optional<uint64_t> size;
  std::optional<struct timespec> atime, mtime;
};

struct CreateOut {
  EntryOut entry;
  OpenOut open;
};

class Filesystem {
 public:
  static Result<std::unique_ptr<Filesystem>> create(const std::string& source, Options opts);
  ~Filesystem();
  Filesystem(const Filesystem&) = delete;
  Filesystem& operator=(const Filesystem&) = delete;

  void set_notifier(Notifier* n);

  // Whether a lookup of `name` in directory `dir` (an empty name: its listing) can run now
  // without building the directory's view or waiting for another thread's build. If not, it
  // is parked: `resume` is called once that build has ended (on a builder thread, which may
  // then run the request), and false is returned. Always true without build threads
  // (Options::build_threads). `resume` must not throw.
  bool when_ready(Ino dir, std::string_view name, const std::function<void()>& resume);
  // Ends the builder threads (running builds end; parked requests are dropped): called once
  // the session stops serving, before what `resume`s use goes away.
  void stop_builds();

  // `who`: only its pid matters here, for the writer's view (Options::writer_view).
  Result<EntryOut> lookup(Ino parent, std::string_view name, const Caller& who = {});
  void forget(Ino ino, uint64_t nlookup);
  Result<struct stat> getattr(Ino ino);
  Result<std::string> readlink(Ino ino);

  Result<uint64_t> opendir(Ino ino, const Caller& who = {});
  // Calls `add(entry, next_offset)` from `offset` on; stops when it returns false.
  Status readdir(uint64_t dh, uint64_t offset,
                 const std::function<bool(const DirEntryOut&, uint64_t)>& add);
  void releasedir(uint64_t dh);

  // A consolidated file or index opens only for a caller who may read every shard it is made
  // of, checked as the kernel checks a real file (EACCES otherwise).
  Result<OpenOut> open(Ino ino, int flags, const Caller& who = {});
  Status read(uint64_t fh, uint64_t off, size_t len, ReadPlan& plan);
  [[nodiscard]] std::shared_ptr<const FileReader> reader(uint64_t fh) const;
  // True if the handle was a backed open (its inode's backing file may be let go).
  bool release(uint64_t fh);
  // The kernel could not back the open `fh` (OpenOut::backing_fd): it goes through the page
  // cache, like any other.
  void backing_refused(uint64_t fh);

  Result<struct statvfs> statfs();

  // --- writes (EROFS on a read-only view) ---------------------------------------------
  // Everything but a consolidated safetensors file is written through to SRC. Entries made
  // for a caller other than root belong to the caller. The reserved name .ckptfs is refused.
  //
  // The kernel checks permissions against what it sees; the daemon acts as root in SRC, so for
  // what the kernel cannot see (a name the view hides, the shards behind a consolidated file)
  // it makes the kernel's checks itself against `who` (fs/access.hpp; docs/semantics.md, trust
  // model): create on an existing hidden file opens it as that file (EEXIST with O_EXCL,
  // may_open, protected_regular) and never changes its owner; what rename, unlink and rmdir
  // remove or replace passes may_delete (the sticky bit included).
  Result<CreateOut> create(Ino parent, std::string_view name, mode_t mode, int flags,
                           const Caller& who = {});
  Result<EntryOut> mkdir(Ino parent, std::string_view name, mode_t mode, const Caller& who = {});
  Result<EntryOut> mknod(Ino parent, std::string_view name, mode_t mode, const Caller& who = {});
  Result<EntryOut> symlink(std::string_view target, Ino parent, std::string_view name,
                           const Caller& who = {});
  Result<EntryOut> link(Ino ino, Ino new_parent, std::string_view new_name, const Caller& who = {});
  // Unlinking a consolidated file removes its rank shards and commit record.
  Status unlink(Ino parent, std::string_view name, const Caller& who = {});
  // A directory whose view is empty is removed with what the view hides in it, when `who`
  // could have removed each of those entries.
  Status rmdir(Ino parent, std::string_view name, const Caller& who = {});
  // A consolidated file is not renamed (EXDEV: mv copies it). RENAME_NOREPLACE and
  // RENAME_EXCHANGE are honoured.
  Status rename(Ino parent, std::string_view name, Ino new_parent, std::string_view new_name,
                unsigned flags, const Caller& who = {});
  // `fh`: the handle the kernel gave, if any (ftruncate, fchmod).
  Result<struct stat> setattr(Ino ino, const SetAttr& a, std::optional<uint64_t> fh = {});
  Result<size_t> write(uint64_t fh, uint64_t off, std::string_view bytes);
  // At each close: a consolidated file under a model name is committed as rank shards here,
  // so its errors reach close().
  Status flush(uint64_t fh, const Caller& who = {});
  Status fsync(uint64_t fh, bool datasync);
  Status fsyncdir(Ino ino);
  // Attributes through an open handle (fstat): valid after the name is gone.
  Result<struct stat> getattr_handle(uint64_t fh);

  // What the daemon keeps, for tests of its memory bounds.
  struct Counts {
    size_t nodes = 0;           // inodes the kernel holds
    size_t keys = 0;            // identities with an inode number
    size_t dirs = 0;            // directories with a cached view
    uint64_t header_bytes = 0;  // estimate held by the header cache
  };
  [[nodiscard]] Counts counts() const;

  // The content of .ckptfs/status.json: checkpoints tracked (serving, settling, refused and
  // why), reads, writes in flight, errors and the StatusExtra figures, as one JSON object.
  [[nodiscard]] std::string status_json() const;
  // Files closed and stored as one shard whose split into rank shards (after close, for files
  // the kernel wrote) is queued or running; drain_splits() waits until none is left, as the
  // Filesystem's destruction (unmount) does.
  [[nodiscard]] size_t pending_splits() const;
  void drain_splits();
  // Installs (or, with an empty function, removes) the source of the "prefetch" figures.
  void set_status_extra(StatusExtra extra);
  // Counts an operation that failed with an unexpected errno (the adapter logs it too).
  void note_error(int err);

  // Forces every cached directory view to revalidate on next access.
  void invalidate_all();

  struct Impl;

 private:
  explicit Filesystem(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ckptfs::fs
