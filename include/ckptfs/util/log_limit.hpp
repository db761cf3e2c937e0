// Rate limiting of repeated log lines. What a hostile source makes the daemon say (a refused
// checkpoint, an ignored record) comes back at every revalidation: each key may log `burst`
// lines per `period`; the rest are counted, and the next line allowed says how many were held
// back. The table of keys is bounded (the oldest key goes first).
#pragma once

#include <chrono>
#include <cstdint>
#include <list>
#include <map>
#include <mutex>
#include <string>
#include <string_view>

namespace ckptfs {

class LogLimiter {
 public:
  using Clock = std::chrono::steady_clock;

  explicit LogLimiter(uint32_t burst = 3, Clock::duration period = std::chrono::minutes(1),
                      size_t max_keys = 4096)
      : burst_(burst), period_(period), max_keys_(max_keys) {}

  struct Verdict {
    bool log = false;         // log this line
    uint64_t suppressed = 0;  // lines of this key held back since the last one logged
  };

  // Whether a line of `key` may be logged at `now`.
  Verdict allow(std::string_view key, Clock::time_point now = Clock::now()) {
    std::lock_guard lock(mu_);
    auto it = keys_.find(key);
    if (it == keys_.end()) {
      if (keys_.size() >= max_keys_) {
        keys_.erase(order_.front());
        order_.pop_front();
      }
      it = keys_.emplace(std::string(key), Entry{}).first;
      order_.push_back(it->first);
      it->second.window = now;
    }
    Entry& e = it->second;
    if (now - e.window >= period_) {
      e.window = now;
      e.count = 0;
    }
    if (e.count < burst_) {
      ++e.count;
      Verdict v{true, e.held};
      e.held = 0;
      return v;
    }
    ++e.held;
    return Verdict{false, 0};
  }

 private:
  struct Entry {
    Clock::time_point window;  // start of the current period
    uint32_t count = 0;        // lines logged in it
    uint64_t held = 0;         // lines held back since the last one logged
  };
  const uint32_t burst_;
  const Clock::duration period_;
  const size_t max_keys_;
  std::mutex mu_;  // guards keys_ and order_; a leaf
  std::map<std::string, Entry, std::less<>> keys_;
  std::list<std::string> order_;  // keys, oldest first
};

}  // namespace ckptfs
