// util/fd: RAII file descriptors, regular-file opens, and exact pread/pwrite helpers.
#include "ckptfs/util/fd.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>

namespace ckptfs {

void UniqueFd::reset(int fd) noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

Result<UniqueFd> open_file(const std::string& path, int flags, mode_t mode) {
  int fd = ::open(path.c_str(), flags | O_CLOEXEC, mode);
  if (fd < 0) {
    int e = errno;
    return make_error(e, "{}: cannot open: {}", path, std::strerror(e));
  }
  return UniqueFd(fd);
}

Result<UniqueFd> open_at(int dirfd, const std::string& name, int flags, mode_t mode) {
  int fd = ::openat(dirfd, name.c_str(), flags | O_CLOEXEC, mode);
  if (fd < 0) {
    int e = errno;
    return make_error(e, "{}: cannot open: {}", name, std::strerror(e));
  }
  return UniqueFd(fd);
}

namespace {

const char* kind_of(mode_t mode) {
  switch (mode & S_IFMT) {
    case S_IFDIR:
      return "a directory";
    case S_IFLNK:
      return "a symbolic link";
    case S_IFIFO:
      return "a FIFO";
    case S_IFSOCK:
      return "a socket";
    case S_IFCHR:
      return "a character device";
    case S_IFBLK:
      return "a block device";
    default:
      return "not a regular file";
  }
}

}  // namespace

Result<UniqueFd> require_regular(UniqueFd fd, std::string_view what, struct stat* st_out) {
  struct stat local {};
  struct stat& st = st_out ? *st_out : local;
  if (::fstat(fd.get(), &st) != 0) {
    int e = errno;
    return make_error(e, "{}: stat failed: {}", what, std::strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    int e = S_ISDIR(st.st_mode) ? EISDIR : S_ISLNK(st.st_mode) ? ELOOP : EINVAL;
    return make_error(e, "{}: is {}, not a regular file; refusing it", what, kind_of(st.st_mode));
  }
  int fl = ::fcntl(fd.get(), F_GETFL);
  if (fl < 0 || ((fl & O_NONBLOCK) && ::fcntl(fd.get(), F_SETFL, fl & ~O_NONBLOCK) != 0)) {
    int e = errno;
    return make_error(e, "{}: cannot clear O_NONBLOCK: {}", what, std::strerror(e));
  }
  return fd;
}

Error open_regular_error(int e, std::string_view what) {
  if (e == ENXIO) {
    return make_error(EINVAL, "{}: is a socket or a device, not a regular file; refusing it", what);
  }
  return make_error(e, "{}: cannot open: {}", what, std::strerror(e));
}

Result<UniqueFd> open_regular_at(int dirfd, const std::string& name, std::string_view what,
                                 struct stat* st) {
  // O_NOATIME where allowed (the file's owner, or root): the daemon's own reads of headers
  // and shards leave SRC's access times as their writers and readers set them.
  int fd = ::openat(dirfd, name.c_str(), kOpenRegularFlags | O_CLOEXEC | O_NOATIME);
  if (fd < 0 && errno == EPERM) fd = ::openat(dirfd, name.c_str(), kOpenRegularFlags | O_CLOEXEC);
  if (fd < 0) {
    int e = errno;
    if (e == ELOOP) {  // O_NOFOLLOW: the final component is a symlink
      return make_error(ELOOP, "{}: is a symbolic link, not a regular file; refusing it", what);
    }
    return open_regular_error(e, what);
  }
  return require_regular(UniqueFd(fd), what, st);
}

Result<UniqueFd> reopen(int fd, int flags, std::string_view what) {
  const std::string link = "/proc/self/fd/" + std::to_string(fd);
  UniqueFd again(::open(link.c_str(), (flags & ~O_NOFOLLOW) | O_CLOEXEC));
  if (!again.valid()) {
    int e = errno;
    return make_error(e, "{}: cannot open it again: {}", what, std::strerror(e));
  }
  struct stat a {};
  struct stat b {};
  if (::fstat(fd, &a) != 0 || ::fstat(again.get(), &b) != 0) return errno_error(what);
  if (a.st_dev != b.st_dev || a.st_ino != b.st_ino) {  // /proc not the kernel's own (a chroot)
    return make_error(ESTALE, "{}: opened again, another file answered; refusing it", what);
  }
  return again;
}

Result<size_t> pread_upto(int fd, void* buf, size_t len, uint64_t off, std::string_view what) {
  auto* p = static_cast<char*>(buf);
  size_t done = 0;
  while (done < len) {
    ssize_t n = ::pread(fd, p + done, len - done, static_cast<off_t>(off + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      int e = errno;
      return make_error(e, "{}: read of {} bytes at offset {} failed: {}", what, len, off,
                        std::strerror(e));
    }
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  return done;
}

Status pread_exact(int fd, void* buf, size_t len, uint64_t off, std::string_view what) {
  CKPTFS_TRY(const size_t got, pread_upto(fd, buf, len, off, what));
  if (got < len) {
    return make_error(EIO, "{}: unexpected end of file reading {} bytes at offset {}", what, len,
                      off);
  }
  return {};
}

Status pwrite_all(int fd, const void* buf, size_t len, uint64_t off, std::string_view what) {
  const auto* p = static_cast<const char*>(buf);
  size_t done = 0;
  while (done < len) {
    ssize_t n = ::pwrite(fd, p + done, len - done, static_cast<off_t>(off + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      int e = errno;
      return make_error(e, "{}: write of {} bytes at offset {} failed: {}", what, len, off,
                        std::strerror(e));
    }
    done += static_cast<size_t>(n);
  }
  return {};
}

Result<bool> copy_range(int in, uint64_t in_off, int out, uint64_t out_off, uint64_t len,
                        std::string_view what) {
  uint64_t done = 0;
  while (done < len) {
    auto ioff = static_cast<loff_t>(in_off + done);
    auto ooff = static_cast<loff_t>(out_off + done);
    const ssize_t n = ::copy_file_range(in, &ioff, out, &ooff, len - done, 0);
    if (n < 0) {
      const int e = errno;
      if (e == EINTR) continue;
      if (done == 0 && (e == EXDEV || e == ENOSYS || e == EOPNOTSUPP || e == EINVAL)) {
        return false;
      }
      return make_error(e, "{}: copy of {} bytes at offset {} failed: {}", what, len, in_off,
                        std::strerror(e));
    }
    if (n == 0) {
      return make_error(EIO,
                        "{}: the file copied from ends at byte {}, inside a copy of {} bytes at "
                        "offset {}",
                        what, in_off + done, len, in_off);
    }
    done += static_cast<uint64_t>(n);
  }
  return true;
}

Result<std::string> read_small_file(const std::string& path, uint64_t limit) {
  int raw = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
  if (raw < 0) return open_regular_error(errno, path);
  struct stat st {};
  CKPTFS_TRY(UniqueFd fd, require_regular(UniqueFd(raw), path, &st));
  return read_whole(fd, st, path, limit);
}

Result<std::string> read_whole(const UniqueFd& fd, const struct stat& st, std::string_view what,
                               uint64_t limit) {
  if (static_cast<uint64_t>(st.st_size) > limit) {
    return make_error(EFBIG, "{}: file is {} bytes, larger than the {} byte limit", what,
                      st.st_size, limit);
  }
  std::string out(static_cast<size_t>(st.st_size), '\0');
  CKPTFS_CHECK(pread_exact(fd.get(), out.data(), out.size(), 0, what));
  return out;
}

Error errno_error(std::string_view what) {
  const int e = errno;
  return make_error(e, "{}: {}", what, std::strerror(e));
}

}  // namespace ckptfs
