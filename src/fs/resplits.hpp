// fs/resplits: the splits into rank shards that closes left to run after them
// (write/resplit.hpp), run one at a time on a thread of their own; unmount waits for them.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "ckptfs/write/resplit.hpp"

namespace ckptfs::fs {

class Resplits {
 public:
  // `run` does one split (WritePath::run_resplit); it must not throw.
  explicit Resplits(std::function<void(write::ResplitJob&)> run) : run_(std::move(run)) {}
  // Runs what is queued, then stops: the daemon's unmount waits here.
  ~Resplits();
  Resplits(const Resplits&) = delete;
  Resplits& operator=(const Resplits&) = delete;

  // Queues a split. At most kMaxQueued wait at once (each holds its file's parsed header and
  // plan): a close that would queue more waits for room.
  void post(write::ResplitJob job);
  // Splits queued or running.
  [[nodiscard]] size_t pending() const;
  // Waits until none is queued or running.
  void drain();

  static constexpr size_t kMaxQueued = 16;

 private:
  void loop();

  std::function<void(write::ResplitJob&)> run_;
  mutable std::mutex mu_;         // guards queue_, running_, stop_ and the start of worker_
  std::condition_variable work_;  // a job was queued, or stop_
  std::condition_variable room_;  // a job was taken or finished
  std::deque<write::ResplitJob> queue_;
  bool running_ = false;  // the worker is running a job it took from queue_
  bool stop_ = false;
  std::thread worker_;  // started by the first post()
};

}  // namespace ckptfs::fs
