// One regular file open for writing through the mount, keyed by its inode: decides from its
// bytes what it is, and either passes it through to its backing file or routes it into rank
// shards. No kernel and no FUSE here: the fs layer calls it, tests drive it directly.
//
// The backing file (created in SRC under the name the writer used) is the file's identity and
// carries its name through renames; for a routed file it stays empty (a placeholder) and is
// removed at commit.
//
//   Sniffing  the file was empty when opened: bytes written in order from 0 are held in memory
//             until the header decides (at most the header plus one write)
//   Plain     the bytes are the backing file's (any other content, out-of-order writes, a
//             write into an existing file)
//   Routed    a consolidated safetensors file: each write goes straight to the rank shards of
//             a flush::Transaction
//   Committed the shards are the file's stored form (finalize() at close, under a model name)
//   Failed    a write to the shards failed (ENOSPC, EIO): every later call reports it
#pragma once

#include <sys/stat.h>

#include <array>
#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ckptfs/flush/flusher.hpp"
#include "ckptfs/format/safetensors.hpp"
#include "ckptfs/util/fd.hpp"
#include "ckptfs/util/result.hpp"
#include "ckptfs/write/budget.hpp"
#include "ckptfs/write/plan.hpp"
#include "ckptfs/write/resplit.hpp"
#include "ckptfs/write/router.hpp"

namespace ckptfs::write {

// What a consolidated file would be stored as, parsed once by the writer: its own header
// (bytes, 8 + N, and parse) and the parsed header of each rank shard it is split into (rank
// order). The store checks (write/store_checks.hpp) read it as it is.
struct Prospect {
  std::string_view header;
  const std::shared_ptr<const format::Header>& parsed;
  const std::vector<std::shared_ptr<const format::Header>>& shards;
};

// How a file closed under a model name may be stored (the fs layer's rules for its directory).
struct StoreRules {
  // Set: stored whole whatever it holds (code 0: quietly, it will be shown as a plain file; an
  // errno: the reason, reported by stored_whole()).
  std::optional<Error> whole;
  // Asked before the file is stored as rank shards under `name`; an error stores it whole and
  // is reported by stored_whole(). Empty: always yes.
  std::function<Status(std::string_view name, const Prospect&)> validate;
};

// Whether the kernel may write a file on `fd`'s file system through the mount (write
// passthrough): one whose SEEK_HOLE reports the holes a writer left, which WriteFile reads at
// close (tmpfs, ext4, xfs, btrfs).
bool kernel_may_write(int fd);

// Where the file is now: its directory (open) and name, for finalize().
struct Place {
  int dirfd = -1;
  std::string name;
  std::string dir_display;
  std::string dir_rel;  // the directory beneath SRC ("" for its root)
};

class WriteFile {
 public:
  enum class State { Sniffing, Plain, Routed, Committed, Failed };

  // `backing` is the file open read-write; `dirfd` its directory, where shards are staged
  // (dup'd). `fresh`: the file was empty (created, or opened with O_TRUNC), so its content is
  // sniffed. `what` names it in messages. `budget` (may be null: unbounded) bounds what all
  // files hold in memory together; a file that cannot get its share is staged to disk.
  static Result<std::shared_ptr<WriteFile>> open(UniqueFd backing, int dirfd,
                                                 std::string dir_display, bool fresh,
                                                 flush::Flusher& flusher, PlanOptions plan,
                                                 std::string what, MemoryBudget* budget = nullptr);
  ~WriteFile();
  WriteFile(const WriteFile&) = delete;
  WriteFile& operator=(const WriteFile&) = delete;

  Status write(uint64_t off, std::string_view bytes);
  Status truncate(uint64_t size);
  // chmod, chown and utimens of the file: its backing file carries them (and its shards take
  // them at commit). A time with tv_nsec UTIME_OMIT is left as it is.
  Status set_attr(std::optional<mode_t> mode, std::optional<uid_t> uid, std::optional<gid_t> gid,
                  const struct timespec times[2]);
  // Reads as a plain file would: what was written so far, zeros in holes.
  Result<size_t> read(uint64_t off, size_t len, char* dst);
  // The backing file's attributes, with the file's logical size.
  Result<struct stat> stat();
  Status fsync(const Place& where, bool datasync);

  // At close: a complete routed file, or a plain file holding a consolidated safetensors file,
  // under a model name (model.safetensors, model-0000k-of-0000m.safetensors) is committed as
  // rank shards and its backing file removed. Anything else is stored whole in the backing
  // file. A consolidated file cut short under a model name keeps only the bytes received (it
  // must not read as complete). A committed file takes no more writes (EIO): a new version is
  // a new file.
  // `rules`: the fs layer's say on how it may be stored (see StoreRules).
  Status finalize(const Place& where, const StoreRules& rules = {});
  // A closed plain file renamed onto a model name: stored as rank shards now if it holds a
  // consolidated safetensors file (state() is then Committed).
  Status store(const Place& where, const StoreRules& rules = {});
  // What the closed file `fd` would be stored as: its header and its shard headers under
  // `plan` (an error when it is no consolidated safetensors file or cannot be split).
  struct Split {
    std::string header;
    std::shared_ptr<const format::Header> parsed;
    std::vector<std::shared_ptr<const format::Header>> shards;
    [[nodiscard]] Prospect prospect() const { return Prospect{header, parsed, shards}; }
  };
  static Result<Split> prospect(int fd, const PlanOptions& plan, std::string_view what);
  // Why the last finalize() or store() left a file under a model name whole in its backing
  // file rather than stored as rank shards (not a consolidated safetensors file, cut short,
  // too large a header, no memory or staging for it); empty when it was stored as shards or
  // the name is no model name. The fs layer decides from it whether the name can show the
  // file (docs/semantics.md, "A model name holds what was written").
  [[nodiscard]] std::optional<Error> stored_whole() const;

  [[nodiscard]] State state() const;
  // Once committed: the files its stored form is made of, relative to its directory (the
  // rank shards and the commit record).
  [[nodiscard]] std::vector<std::string> stored_names() const;
  // Written since the last finalize. Lock-free: the fs layer polls it under its own locks,
  // which must not wait behind a long copy holding this file's mutex.
  [[nodiscard]] bool dirty() const { return dirty_.load(std::memory_order_relaxed); }
  // Renamed while open: the next finalize decides again under the name it has then (a file
  // finalized under another name, then renamed onto a model name, is split at its close even
  // with no write since).
  void renamed() { dirty_.store(true, std::memory_order_relaxed); }
  // Handles open for writing on this file (kept by the fs layer): with none, nothing will
  // finalize it, so a rename onto a model name stores it at once.
  std::atomic<int> writers{0};
  [[nodiscard]] dev_t dev() const { return dev_; }
  // The kernel writes the backing file itself from now on (FUSE passthrough): no write()
  // reaches this object, and each finalize() learns what changed from the backing file's size
  // and times. Only a file whose bytes are its backing file's can (Sniffing with nothing held
  // yet, or Plain): false otherwise, and nothing changes.
  // The backing file must be on a file system that reports the holes a writer left
  // (SEEK_HOLE) and never turns written zeros into holes (tmpfs, ext4, xfs, btrfs): at close a
  // file cut short under a model name is found by its first hole.
  bool kernel_writes();
  [[nodiscard]] bool kernel_written() const;
  // The kernel writes it under a model name (created or renamed there): until it is closed, a
  // staging with no shards names it (Flusher::begin_kernel_write), so that after a daemon
  // crash recovery removes it rather than show bytes that were never stored.
  void guard_model_name();
  // The backing file, open read-write, for the kernel to serve opens from (valid while this
  // object lives).
  [[nodiscard]] int backing_fd() const { return backing_.get(); }
  // Its backing file still has a name (not unlinked, not a placeholder removed at commit).
  [[nodiscard]] bool linked() const;
  [[nodiscard]] ino_t ino() const { return ino_; }
  // The split into rank shards that the last close left to run after it (PlanOptions::
  // split_after_close: the file was committed as its own one shard), taken once.
  std::optional<ResplitJob> take_resplit();

 private:
  WriteFile() = default;
  Status write_locked(uint64_t off, std::string_view bytes);
  Status decide_locked();
  Status to_plain_locked(bool keep_all);
  Status enter_routed_locked(std::shared_ptr<const format::Header> h);
  Status split_plain_locked(const Place& where, bool durable, const StoreRules& rules);
  // One rank: the file, complete and in its own directory, becomes its shard as it is.
  // False (and nothing changed) where it cannot; the caller then copies.
  bool adopt_locked(const Place& where, const std::string& prefix,
                    const std::shared_ptr<const format::Header>& parsed, uint64_t size);
  Status commit_locked(const Place& where, bool durable);
  // Adopted and committed as one shard: what splits it into `set` after close.
  std::optional<ResplitJob> resplit_job_locked(const Place& where, std::string header,
                                               std::shared_ptr<const format::Header> parsed, Plan p,
                                               layout::ShardSet set);
  // Why a complete routed file must be stored whole under `where` (StoreRules), if it must.
  std::optional<Error> refused_locked(const Place& where, const StoreRules& rules);
  Status fill_other_links_locked();
  Status fail_locked(Error e);
  Status finalize_locked(const Place& where, const StoreRules& rules);
  // Whether the kernel changed the backing file since stamp_ (and stamps it anew).
  bool kernel_changed_locked();
  // A file the kernel wrote, closed under a model name with a hole before its end (sized by
  // ftruncate, and the writer died or stopped before filling it): cut at the hole, as a
  // routed file cut short keeps only the bytes received; the reason, if it was.
  std::optional<Error> cut_at_hole_locked();
  void touch_locked();
  // Stages the file to disk (Plain) because the memory budget is spent; logs once.
  Status spill_locked(std::string_view why);
  // Whether the retained state of a routed file (header, shard headers, chunks) fits the budget
  // and the record's size limit; the reason it does not otherwise.
  std::optional<Error> admit_locked(const format::Header& h, const layout::ShardSet& s,
                                    uint64_t extra);
  Result<bool> is_backing(const Place& where) const;
  flush::Target target() const;

  mutable std::mutex mu_;  // guards every field below (one file's writes, reads and state)
  State state_ = State::Plain;
  UniqueFd backing_, dir_;
  std::string dir_display_, what_;
  dev_t dev_ = 0;
  ino_t ino_ = 0;
  flush::Flusher* flusher_ = nullptr;
  PlanOptions plan_opts_;
  std::string prefix_;  // Sniffing: the bytes [0, prefix_.size()) received so far
  uint64_t size_ = 0;   // the file's logical size (Sniffing, Routed, Committed)
  uint32_t ranks_ = 0;  // shard files of tx_
  std::unique_ptr<flush::Transaction> tx_;
  std::optional<StreamRouter> router_;
  std::optional<Error> error_;       // Failed
  std::vector<std::string> stored_;  // Committed: see stored_names()
  // The kernel writes the backing file (kernel_writes()); `stamp_` is its size, mtime and
  // when this object last looked, so a change since is a write.
  bool kernel_writes_ = false;
  std::array<int64_t, 3> stamp_{};
  std::unique_ptr<flush::Transaction> guard_;  // see guard_model_name(); dropped at close
  // Committed by adopting the file itself as its one rank shard (Transaction::adopt): its
  // header bytes (the record's), and no router; the backing file is the shard.
  std::optional<std::string> adopted_;
  std::optional<ResplitJob> resplit_;  // see take_resplit()
  std::atomic<bool> dirty_{false};
  bool durable_ = false;            // fsync was asked: the commit is made durable too
  MemoryBudget* budget_ = nullptr;  // shared by the mount's files; null: unbounded
  Charge charge_;                   // this file's share of it
  bool spilled_ = false;            // staged to disk for lack of memory (logged once)
  bool fresh_ = false;              // made empty by its open and not closed since
  std::optional<Error> whole_;      // see stored_whole()
};

}  // namespace ckptfs::write
