// fuse/notify: kernel invalidations from their own thread, and prefetched pages pushed to the
// page cache (fuse_lowlevel_notify_*).
#include "notify.hpp"

#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>

#include <spdlog/spdlog.h>

namespace ckptfs::fuse {
namespace {

// Kernel invalidations, sent from their own thread: fuse_lowlevel_notify_inval_* must not run
// on a thread that is answering a request for the same directory (it would deadlock).
class NotifyQueue final : public fs::Notifier {
 public:
  explicit NotifyQueue(fuse_session* se) : se_(se), thread_([this] { run(); }) {}
  ~NotifyQueue() override {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void inval_entry(fs::Ino parent, const std::string& name) override { push({parent, name}); }
  void inval_inode(fs::Ino ino) override { push({ino, std::nullopt}); }
  // The kernel has processed a notification once its write to /dev/fuse returned, so waiting
  // for the thread to get past what is queued now is waiting for the kernel to have dropped it.
  void sync(std::chrono::milliseconds timeout) override {
    std::unique_lock lock(mu_);
    const uint64_t want = pushed_;
    if (!done_cv_.wait_for(lock, timeout, [&] { return stop_ || done_ >= want; })) {
      spdlog::debug("kernel invalidations still queued after {} ms", timeout.count());
    }
  }

 private:
  struct Item {
    fs::Ino ino;
    std::optional<std::string> name;
  };
  void push(Item it) {
    {
      std::lock_guard lock(mu_);
      q_.push_back(std::move(it));
      ++pushed_;
    }
    cv_.notify_one();
  }
  void run() {
    std::unique_lock lock(mu_);
    while (true) {
      cv_.wait(lock, [&] { return stop_ || !q_.empty(); });
      if (stop_) break;
      Item it = std::move(q_.front());
      q_.pop_front();
      lock.unlock();
      int rc =
          it.name ? fuse_lowlevel_notify_inval_entry(se_, it.ino, it.name->c_str(), it.name->size())
                  : fuse_lowlevel_notify_inval_inode(se_, it.ino, 0, 0);
      if (rc != 0 && rc != -ENOENT) {
        spdlog::debug("invalidation of inode {} failed: {}", it.ino, std::strerror(-rc));
      }
      lock.lock();
      ++done_;
      done_cv_.notify_all();
    }
    done_cv_.notify_all();  // stop_: nobody waits for what will never be sent
  }

  fuse_session* se_;
  std::mutex mu_;                    // guards q_, stop_, pushed_ and done_
  std::condition_variable cv_;       // an item queued, or stopping
  std::condition_variable done_cv_;  // an item sent (done_ advanced), or stopping
  std::deque<Item> q_;
  uint64_t pushed_ = 0;  // items queued since start
  uint64_t done_ = 0;    // items whose notification returned
  bool stop_ = false;
  std::thread thread_;
};

// The kernel side of a prefetch push: fuse_lowlevel_notify_store.
class FusePusher final : public fs::PagePusher {
 public:
  explicit FusePusher(fuse_session* se) : se_(se) {}
  int store(fs::Ino ino, uint64_t off, std::span<const char> bytes) override {
    fuse_bufvec bv = FUSE_BUFVEC_INIT(bytes.size());
    bv.buf[0].mem = const_cast<char*>(bytes.data());
    return fuse_lowlevel_notify_store(se_, ino, static_cast<off_t>(off), &bv,
                                      static_cast<fuse_buf_copy_flags>(0));
  }
  uint64_t mem_available() override { return fs::read_mem_available(); }

 private:
  fuse_session* se_;
};

}  // namespace

std::unique_ptr<fs::Notifier> make_notify_queue(fuse_session* se) {
  return std::make_unique<NotifyQueue>(se);
}

std::unique_ptr<fs::PagePusher> make_page_pusher(fuse_session* se) {
  return std::make_unique<FusePusher>(se);
}

}  // namespace ckptfs::fuse
