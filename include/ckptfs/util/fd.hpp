// RAII file descriptors and small exact-I/O helpers.
#pragma once

#include <fcntl.h>
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

// Flags for opening a file that must be a regular file: the final component is not followed,
// a FIFO swapped in opens at once instead of blocking, and a terminal never becomes the
// controlling one. Use with open_at / open_beneath, then pass the descriptor to require_regular.
inline constexpr int kOpenRegularFlags = O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY;

// Checks with fstat that `fd` is a regular file and clears O_NONBLOCK. Anything else is refused
// with an error naming `what`: EISDIR for a directory, ELOOP for a symlink, EINVAL for a FIFO,
// socket or device.
// When `st` is given it receives the fstat taken here, so callers need not take another.
Result<UniqueFd> require_regular(UniqueFd fd, std::string_view what, struct stat* st = nullptr);

// The error for an open with kOpenRegularFlags that failed with errno `e`. ENXIO (a socket, or a
// device without a driver: never a regular file) becomes EINVAL, like the other non-regular files.
Error open_regular_error(int e, std::string_view what);

// openat(dirfd, name, kOpenRegularFlags) followed by require_regular: the file must be a regular
// file, not a symlink (ELOOP), directory (EISDIR), FIFO, socket or device (EINVAL). Returns a
// blocking, close-on-exec descriptor. `name` is meant to be one component: openat follows
// symlinks in any earlier ones (use open_regular_beneath in util/path.hpp for relative paths).
Result<UniqueFd> open_regular_at(int dirfd, const std::string& name, std::string_view what,
                                 struct stat* st = nullptr);

// The file open on `fd` opened again with other `flags` (O_DIRECT, say), through /proc/self/fd:
// the same inode whatever has happened to its path since, so what was checked on `fd` (its stamp,
// its resolution beneath a directory) holds for the new descriptor. Close-on-exec is added.
Result<UniqueFd> reopen(int fd, int flags, std::string_view what);

// Reads exactly `len` bytes at `off`, retrying on EINTR and short reads.
// A premature end of file is an error (EIO) naming `what`.
Status pread_exact(int fd, void* buf, size_t len, uint64_t off, std::string_view what);
// Reads up to `len` bytes at `off`, retrying on EINTR and short reads: fewer only where the file
// ends (a plain file read as the file is). The error names `what`.
Result<size_t> pread_upto(int fd, void* buf, size_t len, uint64_t off, std::string_view what);
// Writes all of `len` bytes at `off`.
Status pwrite_all(int fd, const void* buf, size_t len, uint64_t off, std::string_view what);
// Copies `len` bytes at `in_off` of `in` to `out_off` of `out` inside the kernel
// (copy_file_range: a reflink where the file system shares extents, else one page-cache copy
// with no round trip through user space). False, with nothing copied, where the kernel offers
// no such copy between these two files (EXDEV, ENOSYS, EOPNOTSUPP, EINVAL on the first call):
// the caller copies through user space. A premature end of `in` is an error (EIO) naming `what`.
Result<bool> copy_range(int in, uint64_t in_off, int out, uint64_t out_off, uint64_t len,
                        std::string_view what);

// Whole small file into memory (refuses files larger than `limit`, and anything but a regular
// file as require_regular does; `path` is opened without blocking, symlinks followed).
Result<std::string> read_small_file(const std::string& path, uint64_t limit);
// The same for a regular file already open (`st` its fstat), named `what` in errors.
Result<std::string> read_whole(const UniqueFd& fd, const struct stat& st, std::string_view what,
                               uint64_t limit);

// The error for a system call that just failed: errno, and "what: strerror(errno)".
Error errno_error(std::string_view what);

}  // namespace ckptfs
