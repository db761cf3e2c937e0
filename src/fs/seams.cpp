// fs/seams: the system's clock, a manual clock for tests, and inotify's close watch.
#include "ckptfs/fs/seams.hpp"

#include <time.h>

#include "ckptfs/source/watcher.hpp"

namespace ckptfs::fs {
namespace {

constexpr int64_t kNsPerSec = 1'000'000'000;

int64_t now_realtime_ns() {
  struct timespec ts {};
  ::clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<int64_t>(ts.tv_sec) * kNsPerSec + ts.tv_nsec;
}

class SystemClock final : public Clock {
 public:
  TimePoint now() const override { return std::chrono::steady_clock::now(); }
  int64_t realtime_ns() const override { return now_realtime_ns(); }
  void wait_until(std::condition_variable& cv, std::unique_lock<std::mutex>& lock, TimePoint until,
                  const std::function<bool()>& done) const override {
    cv.wait_until(lock, until, done);
  }
};

class InotifyWatch final : public CloseWatch {
 public:
  explicit InotifyWatch(std::unique_ptr<source::CloseWatcher> w) : w_(std::move(w)) {}
  bool watch(int dirfd, uint64_t dev, uint64_t ino) override { return w_->watch(dirfd, dev, ino); }
  bool closed(uint64_t dev, uint64_t ino, const std::string& name,
              int64_t mtime_ns) const override {
    return w_->closed(dev, ino, name, mtime_ns);
  }

 private:
  std::unique_ptr<source::CloseWatcher> w_;
};

}  // namespace

std::shared_ptr<const Clock> system_clock() {
  static const auto clock = std::make_shared<const SystemClock>();
  return clock;
}

ManualClock::ManualClock()
    : steady0_(std::chrono::steady_clock::now()), real0_(now_realtime_ns()) {}

Clock::TimePoint ManualClock::now() const {
  std::lock_guard lock(mu_);
  return steady0_ + offset_;
}

int64_t ManualClock::realtime_ns() const {
  std::lock_guard lock(mu_);
  return real0_ + offset_.count();
}

void ManualClock::wait_until(std::condition_variable&, std::unique_lock<std::mutex>&,
                             TimePoint until, const std::function<bool()>& done) const {
  if (done()) return;
  std::lock_guard lock(mu_);
  if (steady0_ + offset_ < until) offset_ = until - steady0_;
}

void ManualClock::advance(std::chrono::nanoseconds d) const {
  std::lock_guard lock(mu_);
  offset_ += d;
}

std::unique_ptr<CloseWatch> inotify_close_watch(CloseWatch::OnClose on_close) {
  auto w = source::CloseWatcher::create(std::move(on_close));
  if (!w) return nullptr;
  return std::make_unique<InotifyWatch>(std::move(w));
}

}  // namespace ckptfs::fs
