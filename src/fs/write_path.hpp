// fs/write_path: files written through the mount as a component (WritePath: the registry of
// files open for writing, their opening, their settling at close and fsync, and the store side
// of a rename onto a model name). Implemented in write_path.cpp and write_rename.cpp.
#pragma once

#include <sys/stat.h>
#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "ckptfs/flush/flusher.hpp"
#include "ckptfs/fs/filesystem.hpp"
#include "ckptfs/fs/seams.hpp"
#include "ckptfs/source/scanner.hpp"
#include "ckptfs/util/fd.hpp"
#include "ckptfs/write/budget.hpp"
#include "ckptfs/write/file.hpp"
#include "ckptfs/write/store_checks.hpp"
#include "node_table.hpp"
#include "resplits.hpp"
#include "write_registry.hpp"

namespace ckptfs::fs {

// A directory a file is written in: open (owned by the caller), its identity, its path
// relative to SRC, and its owner (whose the shards made there are).
struct WriteDir {
  int fd = -1;
  uint64_t dev = 0, ino = 0;
  std::string rel;
  uid_t uid = 0;
  gid_t gid = 0;
};

// The write path. The rest of fs/ hands it descriptors and nodes; it hands back the shared
// state of a file being written (write::WriteFile), which handles hold.
class WritePath {
 public:
  // What it works with: owned by the Filesystem, and outliving this.
  struct Deps {
    const Options& opts;
    std::string source;  // SRC's path, for messages
    int root = -1;       // SRC, open
    std::shared_ptr<const Clock> clock;
    flush::Flusher& flusher;       // stores and removes rank shards
    NodeTable& nodes;              // directories' locks (DirState), and nodes retired at commit
    source::HeaderCache& headers;  // the views' header cache, which the store checks build from
  };
  explicit WritePath(Deps d);
  WritePath(const WritePath&) = delete;
  WritePath& operator=(const WritePath&) = delete;
  // Set before the mount serves requests (null: no kernel to tell).
  void set_notifier(Notifier* n) { notifier_ = n; }

  // --- what the rest of fs/ asks of the files being written -------------------------------------
  // The evidence a directory's changes were this daemon's (DirViews' settle).
  WriteRegistry& registry() { return writes_; }
  // The state of file (dev, ino) while some handle has it open for writing.
  std::shared_ptr<write::WriteFile> find(uint64_t dev, uint64_t ino) {
    return writes_.find(dev, ino);
  }
  [[nodiscard]] bool open_in(DevIno dir) const { return writes_.open_in(dir); }
  [[nodiscard]] size_t open_files() const { return writes_.open_files(); }
  // This daemon just changed directory (dev, ino): its view shows the change at once.
  void touched(uint64_t dev, uint64_t ino) { writes_.touched(dev, ino); }

  // --- write_path.cpp: opening and settling ------------------------------------------------------
  // The state of a regular file `fd`, named `name` in `d`, opened for writing (`fresh`: it
  // starts empty); shared by every handle on the file.
  Result<std::shared_ptr<write::WriteFile>> start(UniqueFd fd, const WriteDir& d,
                                                  const std::string& name, bool fresh);
  // File `rel` of SRC (its fstat `st`) is about to change in place through the mount (opened
  // for writing; a shard is hidden, so never truncated by path): where the directory above,
  // or one below, stores a file as links of it (write/dedup), that file gets its own copy
  // first.
  Status before_change(const std::string& rel, const struct stat& st);
  // The same file `rel` (node key `key`) opened with O_TRUNC: where another directory stores it
  // as links, its name gets a new empty file instead of that directory a copy (a save again of
  // torch's sharded/ rewrites every shard; each copy cost its size again, and an fsync), and
  // ESTALE asks the kernel to open the name again.
  Status before_truncate(const std::string& rel, const Key& key);
  // The same for file `rel` (its fstat `st`), which the caller opened itself and checked it may
  // truncate: true when the name is a new empty file now (open it again).
  Result<bool> detach_stored(const std::string& rel, const struct stat& st);
  // Calls fn(stored, dir) for each directory that may store file `rel` (in `dir`) as links:
  // the one above, then those below; true once fn says it is done.
  using StoringFn = std::function<Result<bool>(int stored, int dir)>;
  Result<bool> each_storing(const std::string& rel, const StoringFn& fn) const;
  // Directories beside a linked shard that before_change checks, at most.
  static constexpr size_t kMaxStoringDirs = 256;
  // Node `n` (a real file, or a consolidated file written anew with O_TRUNC) opened for writing.
  Result<std::shared_ptr<write::WriteFile>> open(const Node& n, int flags);
  // close() of a handle on `wf`, the file of inode `ino`: stored as rank shards, or whole.
  Status close(Ino ino, write::WriteFile& wf);
  Status fsync(Ino ino, write::WriteFile& wf, bool datasync);
  // Splits into rank shards that closes left to run after them, queued or running.
  [[nodiscard]] size_t pending_splits() const { return resplits_.pending(); }
  [[nodiscard]] size_t running_splits() const { return resplits_.running(); }
  [[nodiscard]] unsigned split_threads() const { return resplits_.workers(); }
  // Waits until none is left.
  void drain_splits() { resplits_.drain(); }
  // This daemon changed the attributes of shard `before` (chmod, chown, utimens) to `after`:
  // a split after close that is still pending for it goes ahead (SplitStamps). Under the
  // shard's directory's lock.
  void attr_changed(const struct stat& before, const struct stat& after) {
    stamps_.changed(static_cast<uint64_t>(before.st_dev), static_cast<uint64_t>(before.st_ino),
                    write::shard_stamp(before), write::shard_stamp(after));
  }

  // --- write_rename.cpp: a rename onto a model name ----------------------------------------------
  // Before file `from_name` of `from` (stat `src_st`) moves onto model name `to_name` of `to`:
  // refused (EINVAL) where the view would hide it (a native checkpoint, or other files' shards
  // that it does not fit).
  Status may_rename_onto(const WriteDir& from, const std::string& from_name,
                         const struct stat& src_st, const WriteDir& to, const std::string& to_name);
  // The regular file that a rename onto model name `name` of `to` (inode
  // `to_parent`) is about to replace, kept until the store of the file moved over it is known:
  // a hard link of it in the directory's state directory (.ckptfs/unshare-<pid>-<n>, so that
  // recovery removes one a dead daemon left), locked. Put back when that store fails (the
  // rename fails, and must have changed no name); let go otherwise, its node retired if that
  // was its last link. nullopt when the name holds no such file.
  class Replaced {
   public:
    Replaced(Replaced&& o) noexcept;
    Replaced& operator=(Replaced&& o) noexcept;
    Replaced(const Replaced&) = delete;
    Replaced& operator=(const Replaced&) = delete;
    ~Replaced() { let_go(); }
    // Puts it back under its name, over what is there now (one rename: never a moment
    // without a file under the name).
    Status put_back(int dir, const std::string& name);

   private:
    friend class WritePath;
    void let_go();  // the link goes, unless put back
    Replaced(NodeTable& nodes, UniqueFd state, UniqueFd held, std::string link,
             const struct stat& st, std::optional<Ino> ino)
        : nodes_(&nodes),
          state_(std::move(state)),
          held_(std::move(held)),
          link_(std::move(link)),
          st_(st),
          ino_(ino) {}
    NodeTable* nodes_;
    UniqueFd state_, held_;  // the state directory; the file itself, flock'ed
    std::string link_;       // its link's name in state_ ("" once put back or moved from)
    struct stat st_ {};
    std::optional<Ino> ino_;  // its node, where the kernel holds it under the name
  };
  Result<std::optional<Replaced>> keep_replaced(const WriteDir& to, Ino to_parent,
                                                const std::string& name);
  // After it moved (`from_parent`/`to_parent`: the directories' inodes): a closed file is
  // stored now, one being written when its writer closes it. Where the store fails (memory,
  // staging, a file that could not be split and would be hidden) the file is moved back, what
  // it replaced (`replaced`) put back, and the error returned.
  Status store_renamed(const WriteDir& from, Ino from_parent, const std::string& from_name,
                       const WriteDir& to, Ino to_parent, const std::string& to_name,
                       std::optional<Replaced>& replaced);

 private:
  using SettleFn = std::function<Status(write::WriteFile&, const write::Place&)>;
  // Runs `fn` on the file where it is now, under its directory's lock (the view never lists a
  // commit half done), and makes the view show the result at once.
  Status settle(Ino ino, write::WriteFile& wf, const SettleFn& fn);
  // Removes the version name `p` stores, which its writer's new header replaced (see .cpp).
  void drop_replaced(const write::Place& p);
  // `display`: the directory's path, which its messages name.
  write::PlanOptions plan_options(int dirfd, const std::string& display) const;
  // One split after close (on Resplits' thread): staged with no lock held, committed under
  // its directory's lock, and shown by the view at once.
  void run_resplit(write::ResplitJob& job);
  // The directory `job`'s file may be stored as links of (write::origin_of), open, and its
  // display name; nullopt when there is none.
  std::optional<UniqueFd> origin_of(const write::ResplitJob& job, std::string& display) const;
  std::string source_path(const std::string& rel) const {
    return rel.empty() ? d_.source : d_.source + "/" + rel;
  }

  Deps d_;
  Notifier* notifier_ = nullptr;
  WriteRegistry writes_;        // files open for writing; this daemon's changes
  write::MemoryBudget budget_;  // the write path's memory (Options::write_memory)
  // May a file under a model name be stored as rank shards (write/store_checks.hpp).
  write::StoreChecks checks_;
  SplitStamps stamps_;  // what each pending split expects of its one shard
  // Last: destroyed first, so that unmount waits for its splits while the rest still works.
  Resplits resplits_{[this](write::ResplitJob& job) { run_resplit(job); }, d_.opts.split_threads};
};

}  // namespace ckptfs::fs
