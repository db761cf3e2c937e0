// fs/builds: view builds off the FUSE workers' path: the builder threads, which read shard
// headers and native files, and run the requests parked on a directory until its build ends.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>

#include "ckptfs/util/threads.hpp"

namespace ckptfs::fs {

// A fixed set of threads running jobs in the order they were queued. A job must not throw (an
// exception it lets out is logged and dropped).
class BuildPool {
 public:
  explicit BuildPool(unsigned threads);
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

  std::mutex mu_;  // guards queue_ and stopping_
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stopping_ = false;
  JoinedThreads threads_;  // started by the constructor; joined by stop()
};

}  // namespace ckptfs::fs
