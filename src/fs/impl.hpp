// fs/impl: Filesystem::Impl, the filesystem's state and its operations; each operation is
// defined in the room (src/fs/*.cpp) named above its declaration. The views (DirViews) and
// the files being written (WritePath) are components with interfaces of their own.
//
// Lock order: node_table.hpp. Tests: tests/unit/test_fs.cpp, test_writefile.cpp, test_trust.cpp
// (through Filesystem, with fs/seams.hpp's ManualClock and a close watch of their own where
// timing matters) and tests/python/test_{mount,write,trust,posix}.py (mounted).
#pragma once

#include <sys/stat.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "builds.hpp"
#include "ckptfs/flush/flusher.hpp"
#include "ckptfs/fs/filesystem.hpp"
#include "ckptfs/fs/seams.hpp"
#include "ckptfs/fs/writers.hpp"
#include "ckptfs/source/scanner.hpp"
#include "ckptfs/util/fd.hpp"
#include "ckptfs/util/log_limit.hpp"
#include "ckptfs/util/path.hpp"
#include "ckptfs/write/file.hpp"
#include "dir_views.hpp"
#include "handles.hpp"
#include "io_modes.hpp"
#include "names.hpp"
#include "node_table.hpp"
#include "status.hpp"
#include "write_path.hpp"

namespace ckptfs::fs {

inline constexpr int64_t kNsPerSec = 1'000'000'000;

// Nanoseconds since the epoch as a timespec. Times before 1970 are negative and keep tv_nsec
// in [0, 1e9), as POSIX requires (plain division would give a negative tv_nsec).
inline struct timespec to_timespec(int64_t ns) {
  int64_t sec = ns / kNsPerSec;
  int64_t rem = ns % kNsPerSec;
  if (rem < 0) {
    rem += kNsPerSec;
    --sec;
  }
  return timespec{static_cast<time_t>(sec), static_cast<long>(rem)};
}

inline void set_times(struct stat& st, int64_t ns) {
  st.st_mtim = st.st_ctim = st.st_atim = to_timespec(ns);
}

// The last component of a path relative to the source root, and the path of its directory.
inline std::string last_of(std::string_view rel) { return std::string(split_rel(rel).name); }
inline std::string parent_of(std::string_view rel) { return std::string(split_rel(rel).dir); }

struct Filesystem::Impl {
  // `root`: the source directory, open.
  Impl(Options o, std::string source_dir, UniqueFd root_fd, const struct stat& root_st);

  // --- set at creation, constant after -------------------------------------------------------
  Options opts;
  std::string source;
  UniqueFd root;
  std::shared_ptr<const Clock> clock;       // Options::clock, or the system's
  std::shared_ptr<flush::Flusher> flusher;  // Options::flusher, or the local one
  int protected_regular = 0;                // Options::protected_regular, resolved
  // Shard fds held by open consolidated files, bounded by RLIMIT_NOFILE less a reserve for
  // FUSE, plain files and header scans that scales with the limit.
  int64_t fd_budget = 0;
  Notifier* notifier = nullptr;  // set before the mount serves requests

  // --- state; each part has its own lock (the lock order: node_table.hpp) --------------------
  NodeTable nodes;                       // inodes, cached names, directory states
  IoModes io_modes{opts.backing_grace};  // plain files' opens: backed (FUSE passthrough) or cached
  StatusFile status;                     // figures for .ckptfs/status.json
  source::HeaderCache headers;
  // Files written through the mount (write_path.hpp): the registry of files open for writing,
  // their settling at close and fsync, the store side of rename.
  WritePath writing;
  std::atomic<int64_t> open_shard_fds{0};
  std::unique_ptr<WriterViews> writers;  // who sees which directory as written
  // Open file and directory handles. After `writing` and `open_shard_fds`: a handle the kernel
  // never released, freed with the Filesystem, gives back its write memory (`writing`'s
  // budget) and its shard fds (`open_shard_fds`) before they go.
  Handles handles;
  // The checkpoint directories' views (dir_views.hpp). Last: destroyed first, so the threads
  // it owns (the close watch, the builders) never call into a half-destroyed Impl.
  DirViews views;

  std::string source_path(const std::string& rel) const {
    return rel.empty() ? source : source + "/" + rel;
  }

  // --- namespace.cpp: lookup, listing --------------------------------------------------------
  Result<EntryOut> lookup(Ino parent, std::string_view name, const Caller& who);
  void forget(Ino ino, uint64_t n);
  Result<uint64_t> opendir(Ino ino, const Caller& who);
  Status readdir(uint64_t dh, uint64_t offset,
                 const std::function<bool(const DirEntryOut&, uint64_t)>& add);
  void releasedir(uint64_t dh) { handles.drop_dir(dh); }

  Result<EntryOut> lookup_in_dir(const Node& dir, std::string_view name_sv, const Caller& who);
  Result<EntryOut> lookup_in_shards(const Node& dir, std::string_view name);
  Result<EntryOut> lookup_in_adapter(const Node& dir, std::string_view name);
  std::vector<DirEntryOut> list_adapter(const Node& dir) const;
  Result<EntryOut> lookup_real(const std::string& rel, Ino parent, std::string_view name);
  // A file lifted into its checkpoint directory from .hf_metadata/ or huggingface/ is reached,
  // in SRC, through that folder: `who` needs its search permission (EACCES otherwise), which
  // the kernel cannot check on a name it sees in the checkpoint directory (namespace.cpp).
  Status may_reach_lifted(const std::string& rel, const Caller& who);
  // A synthesized entry of View `v`: `name` in directory `dir_ino`, which is the checkpoint
  // directory or, with `folder`, the view's folder of that name (the LoRA adapter's).
  Result<EntryOut> lookup_virtual(const std::shared_ptr<const View>& v, const std::string& dir_rel,
                                  Ino dir_ino, Kind kind, uint32_t output, const std::string& name,
                                  std::string_view folder = {});
  Result<std::vector<DirEntryOut>> list(const Node& dir, const Caller& who = {});
  void drop_vanished(const Node& dir, const std::vector<source::DirEntry>& entries);
  // The name in directory `rel` that must never be stat'ed (see Options::hide_rel).
  std::string_view hidden_child(const std::string& rel) const {
    return names::hidden_child(opts.hide_rel, rel);
  }

  uint64_t dir_ino_shown(const Node& n) const;

  // --- attributes.cpp: what stat says of a node -----------------------------------------------
  Result<struct stat> getattr(Ino ino);
  Result<struct stat> getattr_handle(uint64_t fh);
  Result<std::string> readlink(Ino ino);
  Result<struct stat> real_attr(const Node& n);
  std::optional<struct stat> by_other_link(const Node& n);
  std::optional<struct stat> by_open_handle(const Node& n);
  void decorate_real(Ino ino, const std::string& rel, struct stat& st);
  struct stat virtual_attr(const Node& n) const;
  static void written_attr(const Node& n, struct stat& st);

  // The writer's view (fs/writers.hpp).
  WriterViews::DirId dir_id(const Node& dir);
  std::optional<WriterViews::DirId> parent_id(const Node& dir);
  void note_writer(const Node& dir, const Caller& who);
  void note_writer_of(Ino ino, const Caller& who);
  bool sees_written(const Node& dir, const Caller& who);

  // A directory's View, checked, built and settled: `views` (dir_views.hpp).

  // --- open.cpp: opening files for reading, and reads --------------------------------------
  Result<OpenOut> open(Ino ino, int flags, const Caller& who);
  Status read(uint64_t fh, uint64_t off, size_t len, ReadPlan& plan);
  std::shared_ptr<const FileReader> reader(uint64_t fh) const;
  bool release(uint64_t fh);
  void backing_refused(uint64_t fh);
  Result<std::shared_ptr<const ShardFds>> open_view_shards(const std::shared_ptr<const View>& v,
                                                           const std::string& rel);

  // --- mutate.cpp: changes to SRC's names and attributes (rename.cpp: rename) ----------------
  // A directory being changed: its node, an open descriptor and its identity.
  struct DirRef {
    Impl* impl = nullptr;
    Node node;
    UniqueFd fd;
    uint64_t dev = 0, ino = 0;
    struct stat st {};
    std::shared_ptr<DirState> state() const { return impl->nodes.dir_state(dev, ino); }
    flush::Target target(std::string display) const {
      return flush::Target{fd.get(), std::move(display), st.st_uid, st.st_gid, 0644};
    }
    // The directory as the write path takes it (valid while this DirRef lives).
    WriteDir at() const { return WriteDir{fd.get(), dev, ino, node.rel, st.st_uid, st.st_gid}; }
  };
  struct Shown {
    std::shared_ptr<const View> v;  // set when the view shows `name` as a consolidated file
    const layout::OutputFile* output = nullptr;  // null: the synthesized index
  };
  Status writable() const;
  Result<DirRef> dir_for_change(Ino parent, std::string_view name, int reserved = EPERM);
  Shown shown_output(const DirRef& d, std::string_view name);
  bool shown_virtual(const DirRef& d, std::string_view name) {
    return shown_output(d, name).v != nullptr;
  }
  void give_to(int fd, const DirRef& d, const std::string& name, const Caller& who, bool by_name);
  static std::vector<Perm> output_perms(const View& v, const layout::OutputFile& o);
  Status may_delete_entry(const DirRef& d, const std::string& name, const Caller& who);
  void retire_if_last(int dirfd, const std::string& name);
  bool hidden_removable(const Node& dir);
  // Directory `n` of `d` (child `n` of inode `parent`), which the view shows empty: what it
  // holds in SRC is hidden, and goes (rmdir, and a directory renamed over it); ENOTEMPTY if the
  // view shows anything, or `who` could not have removed what is hidden.
  Status empty_hidden(const DirRef& d, Ino parent, const std::string& n, const Caller& who);

  Result<CreateOut> create(Ino parent, std::string_view name, mode_t mode, int flags,
                           const Caller& who);
  Result<EntryOut> mkdir(Ino parent, std::string_view name, mode_t mode, const Caller& who);
  Result<EntryOut> mknod(Ino parent, std::string_view name, mode_t mode, const Caller& who);
  Result<EntryOut> symlink(std::string_view target, Ino parent, std::string_view name,
                           const Caller& who);
  Result<EntryOut> link(Ino ino, Ino new_parent, std::string_view new_name, const Caller& who);
  Status unlink(Ino parent, std::string_view name, const Caller& who);
  Status rmdir(Ino parent, std::string_view name, const Caller& who);
  Status rename(Ino parent, std::string_view name, Ino new_parent, std::string_view new_name,
                unsigned flags, const Caller& who);
  Result<struct stat> setattr(Ino ino, const SetAttr& a, std::optional<uint64_t> fh);
  Result<struct stat> set_written_attr(const Node& n, const SetAttr& a,
                                       const struct timespec times[2]);
  Status fsyncdir(Ino ino);

  // --- write_glue.cpp: handles open for writing, handed to `writing` -------------------------
  Result<OpenOut> open_for_write(const Node& n, int flags);
  uint64_t adopt_writer(std::shared_ptr<write::WriteFile> wf, Ino ino);
  // Whether the mount lets the kernel write files itself (Options::backing_writes).
  [[nodiscard]] bool backs_writes() const {
    return opts.backing_writes && writes_backed.load(std::memory_order_relaxed);
  }
  std::atomic<bool> writes_backed{true};  // false once the kernel refused a writer's backing
  // A write open of real file `n` (or of consolidated file `n` with O_TRUNC: the new file
  // under its name), or one made by create (`wf`, inode `ino`, `rel` in messages), served by
  // the kernel from the file itself where IoModes allows it (write passthrough), else through
  // WRITE requests. Only where backs_writes(). `counted`: the open is counted in io_modes
  // already, backed or not.
  Result<OpenOut> open_backed_writer(const Node& n, int flags);
  // The file a writer the kernel writes itself (a backed open) is giving inode `ino`, if one
  // is open: a consolidated file being replaced, whose opens must all be backed meanwhile.
  [[nodiscard]] std::shared_ptr<write::WriteFile> backed_writer_of(Ino ino) const;
  Result<OpenOut> backed_writer(std::shared_ptr<write::WriteFile> wf, Ino ino, std::string_view rel,
                                std::optional<bool> counted = {});
  Result<size_t> write(uint64_t fh, uint64_t off, std::string_view bytes);
  Status flush(uint64_t fh, const Caller& who);
  Status fsync(uint64_t fh, bool datasync);

  // --- status.cpp: the status directory and .ckptfs/status.json -------------------------------
  struct stat status_attr(const Node& n) const;
  Result<EntryOut> lookup_status(Ino parent, Kind kind, std::string_view name);
  std::string status_json() const;
};

}  // namespace ckptfs::fs
