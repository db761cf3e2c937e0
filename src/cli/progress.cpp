// cli/progress: the progress bar the CLI prints on a terminal.
#include "ckptfs/cli/progress.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include <fmt/core.h>

namespace ckptfs::cli {

ProgressBar::ProgressBar(std::string label)
    : ProgressBar(std::move(label), ::isatty(STDERR_FILENO) == 1) {}

ProgressBar::ProgressBar(std::string label, bool enabled)
    : label_(std::move(label)), enabled_(enabled) {}

void ProgressBar::update(uint64_t done, uint64_t total) {
  if (!enabled_) return;
  const auto now = std::chrono::steady_clock::now();
  if (shown_ && done < total && now - last_ < std::chrono::milliseconds(100)) return;
  last_ = now;
  shown_ = true;
  const double secs = std::chrono::duration<double>(now - t0_).count();
  const double rate = secs > 0 ? static_cast<double>(done) / secs : 0;
  const double eta = rate > 0 && total > done ? static_cast<double>(total - done) / rate : 0;
  constexpr int kWidth = 30;
  const int fill =
      total ? static_cast<int>(kWidth * std::min(1.0, static_cast<double>(done) / total)) : kWidth;
  fmt::print(stderr, "\r{} [{:<{}}] {:.1f}/{:.1f} GB  {:.0f} MB/s  ETA {:.0f}s   ", label_,
             std::string(static_cast<size_t>(fill), '#'), kWidth, done / 1e9, total / 1e9,
             rate / 1e6, eta);
  std::fflush(stderr);
}

void ProgressBar::end() {
  if (shown_) fmt::print(stderr, "\n");
  shown_ = false;
}

}  // namespace ckptfs::cli
