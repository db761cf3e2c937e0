// A progress bar for long offline work (consolidate, verify --data): drawn on stderr with
// carriage-return updates only when stderr is a terminal, silent otherwise.
//   consolidate [#########                     ] 1.2/3.4 GB  850 MB/s  ETA 3s
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace ckptfs::cli {

class ProgressBar {
 public:
  // `label` starts the line; `enabled`: draw at all (default: stderr is a terminal).
  explicit ProgressBar(std::string label);
  ProgressBar(std::string label, bool enabled);
  ~ProgressBar() { end(); }
  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;

  [[nodiscard]] bool enabled() const { return enabled_; }
  // Redraws at most every 100 ms, and always when done == total.
  void update(uint64_t done, uint64_t total);
  // Ends the line if anything was drawn (idempotent).
  void end();

 private:
  std::string label_;
  bool enabled_;
  bool shown_ = false;
  std::chrono::steady_clock::time_point t0_ = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point last_{};
};

}  // namespace ckptfs::cli
