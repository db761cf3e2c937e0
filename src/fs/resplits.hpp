// fs/resplits: the splits into rank shards that closes left to run after them (write/resplit.hpp),
// on their own threads (one file at a time each), unmount waiting for them; and what each
// expects (SplitStamps).
#pragma once

#include <array>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "ckptfs/write/resplit.hpp"

namespace ckptfs::fs {

class Resplits {
 public:
  // `run` does one split (WritePath::run_resplit); it must not throw. `workers` threads run
  // splits of different files at once (0: default_workers()); two splits of one file (its
  // shard's device and inode) never run together, and run in the order queued.
  explicit Resplits(std::function<void(write::ResplitJob&)> run, unsigned workers = 1);
  // Runs what is queued, then stops: the daemon's unmount waits here.
  ~Resplits();
  Resplits(const Resplits&) = delete;
  Resplits& operator=(const Resplits&) = delete;

  // Queues a split. At most kMaxQueued wait at once (each holds its file's parsed header and
  // plan): a close that would queue more waits for room.
  void post(write::ResplitJob job);
  // Splits queued or running; running alone.
  [[nodiscard]] size_t pending() const;
  [[nodiscard]] size_t running() const;
  // Waits until none is queued or running.
  void drain();
  [[nodiscard]] unsigned workers() const { return workers_; }

  static constexpr size_t kMaxQueued = 16;
  // One thread per 4 cores, 1 to 4: a split is a copy inside the kernel (or sends to the
  // ranks), and the writer's next file needs the cores too.
  static unsigned default_workers();

 private:
  using Key = std::pair<uint64_t, uint64_t>;
  void loop();
  // The first queued job whose file no worker is splitting; queue_.end() if none. Under mu_.
  std::deque<write::ResplitJob>::iterator runnable();

  std::function<void(write::ResplitJob&)> run_;
  const unsigned workers_;
  mutable std::mutex mu_;         // guards queue_, busy_, stop_ and the start of threads_
  std::condition_variable work_;  // a job was queued or finished, or stop_
  std::condition_variable room_;  // a job was taken or finished
  std::deque<write::ResplitJob> queue_;
  std::set<Key> busy_;  // the files being split now (one worker each)
  bool stop_ = false;
  std::vector<std::thread> threads_;  // started by the first post()
};

// The stamp (write::shard_stamp) each split after close, queued or running, expects of its one
// shard, keyed by the shard's device and inode. Taken at the file's close; moved on by this
// daemon's own chmod, chown and utimens of the file (cp -p, shutil.copy2 and mv set them after
// close: a change of its attributes, not of its bytes, which must not cost it its split); taken
// back by the split when it commits. Each call is made under the directory's lock
// (DirState::mu) of the shard, as the split's commit is.
class SplitStamps {
 public:
  using Stamp = std::array<int64_t, 5>;
  void expect(uint64_t dev, uint64_t ino, const Stamp& s);
  // This daemon changed the attributes of shard (dev, ino), and nothing else, from `before` to
  // `after`: a split that expected `before` now expects `after`.
  void changed(uint64_t dev, uint64_t ino, const Stamp& before, const Stamp& after);
  // What the split of shard (dev, ino) expects, forgotten here (nullopt: nothing registered).
  std::optional<Stamp> take(uint64_t dev, uint64_t ino);

 private:
  std::mutex mu_;  // guards expected_ (a leaf lock: taken under DirState::mu, nothing under it)
  std::map<std::pair<uint64_t, uint64_t>, Stamp> expected_;
};

}  // namespace ckptfs::fs
