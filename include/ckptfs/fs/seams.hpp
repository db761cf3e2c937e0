// fs/seams: what the filesystem reads of the world besides SRC (the time, and writers' closes)
// as interfaces passed in through fs::Options, so that tests drive settle timing without sleeping.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

namespace ckptfs::fs {

// The time: revalidation, settle (observed quiet, and the age of file stamps) and the waits for
// it, the writer's view, the status file's uptime.
class Clock {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;
  virtual ~Clock() = default;
  // Monotonic time, for intervals.
  [[nodiscard]] virtual TimePoint now() const = 0;
  // Wall-clock time in nanoseconds since the epoch, as file times are (CLOCK_REALTIME).
  [[nodiscard]] virtual int64_t realtime_ns() const = 0;
  // Waits on `cv` (with `lock` held; released while waiting) until `done()` or until this
  // clock reaches `until`.
  virtual void wait_until(std::condition_variable& cv, std::unique_lock<std::mutex>& lock,
                          TimePoint until, const std::function<bool()>& done) const = 0;
};

// The system's clocks (steady_clock and CLOCK_REALTIME).
std::shared_ptr<const Clock> system_clock();

// A clock that moves only when told (tests). A wait whose condition does not hold jumps the
// clock to its deadline at once, as a simulation would, instead of sleeping.
class ManualClock final : public Clock {
 public:
  // Starts at the system's current time, so that file times of files made now compare as they
  // would with the system's clock.
  ManualClock();
  [[nodiscard]] TimePoint now() const override;
  [[nodiscard]] int64_t realtime_ns() const override;
  void wait_until(std::condition_variable& cv, std::unique_lock<std::mutex>& lock, TimePoint until,
                  const std::function<bool()>& done) const override;
  void advance(std::chrono::nanoseconds d) const;

 private:
  const TimePoint steady0_;
  const int64_t real0_;
  mutable std::mutex mu_;  // guards offset_; a leaf
  mutable std::chrono::nanoseconds offset_{0};
};

// Close evidence for checkpoint directories: whether the writer of a shard closed it since its
// last change (source::CloseWatcher's inotify watch, in the daemon).
class CloseWatch {
 public:
  // Called (from the watch's own thread) after a writer closed a file of directory (dev, ino).
  using OnClose = std::function<void(uint64_t dev, uint64_t ino)>;
  // Makes the watch, given what it calls; a null watch means none (settle time alone).
  using Factory = std::function<std::unique_ptr<CloseWatch>(OnClose)>;
  virtual ~CloseWatch() = default;
  // Starts watching directory `dirfd`, whose identity is (dev, ino). False when it cannot.
  virtual bool watch(int dirfd, uint64_t dev, uint64_t ino) = 0;
  // Whether the writer of `name` in directory (dev, ino) closed it after its last change seen,
  // at or after `mtime_ns` (the file's current mtime).
  [[nodiscard]] virtual bool closed(uint64_t dev, uint64_t ino, const std::string& name,
                                    int64_t mtime_ns) const = 0;
};

// inotify's watch (source::CloseWatcher); null where inotify is unavailable.
std::unique_ptr<CloseWatch> inotify_close_watch(CloseWatch::OnClose on_close);

}  // namespace ckptfs::fs
