// Which processes are writing where: the writer's view of a checkpoint directory. A process
// that wrote through the mount in a directory or in one of its children sees that directory
// as written (its shard files and side files listed and found by name) rather than
// consolidated, for as long as it keeps writing there, in a child or in the parent (torch's
// consolidator writes its output in the parent of the shards it reads) with no pause longer
// than `window`. So a consolidating writer (torch's HF storage, NeMo, torchtitan) lists, opens
// and reads back what it wrote. Processes are told apart by thread group (the pid of the
// request is a thread's). No kernel here: the clock and the thread-to-process map are passed in.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <utility>

namespace ckptfs::fs {

class WriterViews {
 public:
  using Clock = std::chrono::steady_clock;
  // A directory of SRC: its device and number, and its birth time (statx; 0 where the file
  // system keeps none), since a removed directory's number goes to the next one made.
  struct DirId {
    uint64_t dev = 0, ino = 0;
    int64_t birth_ns = 0;
    auto operator<=>(const DirId&) const = default;
  };
  using Now = std::function<Clock::time_point()>;
  using ProcessOf = std::function<pid_t(pid_t tid)>;  // 0: unknown

  // `window` zero turns the writer's view off.
  explicit WriterViews(Clock::duration window, Now now = &Clock::now,
                       ProcessOf process_of = &process_of_tid);

  // Thread `tid` wrote in directory `dir`, whose parent is `parent` (none at the root).
  void note(DirId dir, std::optional<DirId> parent, pid_t tid);
  // Whether thread `tid` sees `dir` as written: its process wrote there or in a child of it,
  // and its last write there, in a child or in the parent itself (not in a sibling) is within
  // the window.
  [[nodiscard]] bool sees_written(DirId dir, std::optional<DirId> parent, pid_t tid);
  // Whether anyone may see `dir` as written (a cheap test before resolving a caller's process).
  [[nodiscard]] bool any(DirId dir, std::optional<DirId> parent);
  // Whether nobody wrote anywhere yet (no directory to stat for a caller's view).
  [[nodiscard]] bool none() const {
    std::lock_guard lock(mu_);
    return dirs_.empty();
  }

  // The thread group of `tid` (/proc/<tid>/status), 0 when it cannot be read.
  static pid_t process_of_tid(pid_t tid);

 private:
  using Procs = std::map<pid_t, Clock::time_point>;  // process -> its last write there
  struct Marks {
    Procs own;       // wrote in the directory itself
    Procs children;  // wrote in one of its children
  };
  void mark(Procs& procs, pid_t proc, Clock::time_point t);
  bool has(const Procs* procs, pid_t proc, Clock::time_point now) const;
  bool any_live(const Procs* procs, Clock::time_point now) const;
  const Marks* find(DirId d) const;
  void prune(Clock::time_point now);

  const Clock::duration window_;
  // How long a write is remembered as "wrote here" (the window bounds the pauses only): a long
  // consolidation writing in the parent keeps its view of the shards it started from.
  const Clock::duration retain_;
  const Now now_;
  const ProcessOf process_of_;
  mutable std::mutex mu_;  // guards dirs_; a leaf
  // Directories written in, and the ones whose children were: each with its writers.
  std::map<DirId, Marks> dirs_;
};

}  // namespace ckptfs::fs
