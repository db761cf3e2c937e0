// fs/status: the figures .ckptfs/status.json reports beyond each directory's state (reads,
// builds, errors, the prefetcher's), gathered as the daemon runs.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "ckptfs/fs/filesystem.hpp"

namespace ckptfs::fs {

class StatusFile {
 public:
  explicit StatusFile(int64_t started_ns) : started_ns(started_ns) {}

  const int64_t started_ns;                           // the daemon's start (CLOCK_REALTIME)
  std::atomic<uint64_t> reads{0}, bytes_read{0};      // read requests, and the bytes they return
  std::atomic<uint64_t> writes{0}, bytes_written{0};  // WRITE requests, and the bytes they bring
  std::atomic<uint64_t> builds{0}, refusals{0};       // checkpoint models read; of those invalid
  std::atomic<uint64_t> errors{0};                    // operations failed with an unexpected errno

  // Installs (or, with an empty function, removes) the source of the "prefetch" figures.
  void set_extra(StatusExtra extra);
  // Counts an operation that failed with errno `err`.
  void note_error(int err);

  struct Snapshot {
    std::vector<std::pair<std::string, uint64_t>> extra;
    std::map<int, uint64_t> by_errno;
  };
  // The StatusExtra figures (asked now) and the errors by errno.
  [[nodiscard]] Snapshot snapshot() const;

 private:
  // Guards extra_ and by_errno_; held while extra_ runs (it takes the prefetcher's own lock).
  mutable std::mutex mu_;
  StatusExtra extra_;
  std::map<int, uint64_t> by_errno_;
};

}  // namespace ckptfs::fs
