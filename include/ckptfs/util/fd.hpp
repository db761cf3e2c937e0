// RAII file descriptors and small exact-I/O helpers.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "ckptfs/util/result.hpp"

namespace ckptfs {

// Owns one file descriptor; closes it on destruction. Move-only.
class UniqueFd {
 public:
  UniqueFd() noexcept = default;
  explicit UniqueFd(int fd) noexcept : fd_(fd) {}
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  UniqueFd(UniqueFd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  ~UniqueFd() { reset(); }

  [[nodiscard]] int get() const noexcept { return fd_; }
  [[nodiscard]] bool valid() const noexcept { return fd_ >= 0; }
  int release() noexcept { return std::exchange(fd_, -1); }
  void reset(int fd = -1) noexcept;

 private:
  int fd_ = -1;
};

// open(2) wrapper; the error names the path.
Result<UniqueFd> open_file(const std::string& path, int flags, mode_t mode = 0644);
Result<UniqueFd> open_at(int dirfd, const std::string& name, int flags, mode_t mode = 0644);

// Reads exactly `len` bytes at `off`, retrying on EINTR and short reads.
// A premature end of file is an error (EIO) naming `what`.
Status pread_exact(int fd, void* buf, size_t len, uint64_t off, std::string_view what);
// Writes all of `len` bytes at `off`.
Status pwrite_all(int fd, const void* buf, size_t len, uint64_t off, std::string_view what);

// Whole small file into memory (refuses files larger than `limit`).
Result<std::string> read_small_file(const std::string& path, uint64_t limit);

}  // namespace ckptfs
