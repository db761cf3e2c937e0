// The write path's memory bound: the bytes that all files being written hold in the daemon (a
// header being sniffed, the header, shard headers and chunk map of a routed file), shared by
// every file of a mount. A file that cannot get its share is staged to disk instead (its bytes
// go to its backing file and it is split at close), so memory never grows with what writers
// send. Transient work proportional to a large header (parsing it, planning its shards) is
// done one file at a time.
#pragma once

#include <cstdint>
#include <mutex>

namespace ckptfs::write {

class MemoryBudget {
 public:
  // Headers above this size are parsed and planned one file at a time (big()).
  static constexpr uint64_t kBigHeader = 8ull << 20;

  explicit MemoryBudget(uint64_t limit) : limit_(limit) {}
  MemoryBudget(const MemoryBudget&) = delete;
  MemoryBudget& operator=(const MemoryBudget&) = delete;

  // Takes n bytes if they fit under the limit.
  [[nodiscard]] bool try_take(uint64_t n) {
    std::lock_guard lock(mu_);
    if (n > limit_ || used_ > limit_ - n) return false;
    used_ += n;
    return true;
  }
  void give(uint64_t n) {
    std::lock_guard lock(mu_);
    used_ = n > used_ ? 0 : used_ - n;
  }
  [[nodiscard]] uint64_t used() const {
    std::lock_guard lock(mu_);
    return used_;
  }
  [[nodiscard]] uint64_t limit() const { return limit_; }
  // Held around the transient work on a header above kBigHeader.
  std::mutex& big() { return big_; }

 private:
  const uint64_t limit_;
  mutable std::mutex mu_;  // guards used_; a leaf
  uint64_t used_ = 0;
  // One large header parsed or planned at a time. Taken while holding that file's own mutex;
  // nothing else is taken under it.
  std::mutex big_;
};

// One file's share of a MemoryBudget: grown as the file holds more, returned when it is reset
// or destroyed. Not thread-safe (its WriteFile's mutex guards it).
class Charge {
 public:
  explicit Charge(MemoryBudget* b = nullptr) : budget_(b) {}
  ~Charge() { reset(); }
  Charge(const Charge&) = delete;
  Charge& operator=(const Charge&) = delete;

  // Draws from `b` from now on (what was held goes back first).
  void bind(MemoryBudget* b) {
    reset();
    budget_ = b;
  }
  // Holds `n` bytes in total (more or less than now); false, holding what it held, when the
  // budget cannot give the difference. Without a budget, always true.
  [[nodiscard]] bool hold(uint64_t n) {
    if (!budget_) return true;
    if (n > held_) {
      if (!budget_->try_take(n - held_)) return false;
    } else {
      budget_->give(held_ - n);
    }
    held_ = n;
    return true;
  }
  void reset() {
    if (budget_ && held_) budget_->give(held_);
    held_ = 0;
  }
  [[nodiscard]] uint64_t held() const { return held_; }

 private:
  MemoryBudget* budget_;
  uint64_t held_ = 0;
};

}  // namespace ckptfs::write
