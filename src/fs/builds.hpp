// fs/builds: view builds off the FUSE workers' path: the builder threads, which read shard
// headers and native files, and run the requests parked on a directory until its build ends.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>

#include "ckptfs/util/threads.hpp"

namespace ckptfs::fs {

// Up to `threads` threads running jobs in the order they were queued, started on demand: a
// job queued while every thread is busy starts another. One build after another then runs on
// one thread (its malloc arena keeps what one large header parse leaves, not one per thread),
// and only builds that overlap use more. A job must not throw (an exception it lets out is
// logged and dropped).
class BuildPool {
 public:
  explicit BuildPool(unsigned threads) : max_(threads) {}
  ~BuildPool() { stop(); }
  BuildPool(const BuildPool&) = delete;
  BuildPool& operator=(const BuildPool&) = delete;

  // Queues `job`; false once stopped, or when no thread could be started (the caller runs it).
  bool submit(std::function<void()> job);
  // Lets the running jobs end, drops the queued ones (their requests go unanswered: the
  // session is ending), and joins the threads. Idempotent.
  void stop();

 private:
  void run();

  const unsigned max_;
  std::mutex mu_;  // guards queue_, stopping_, idle_ and threads_ (their start)
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stopping_ = false;
  unsigned idle_ = 0;      // threads waiting for a job
  JoinedThreads threads_;  // started by submit(), at most max_; joined by stop()
};

}  // namespace ckptfs::fs
