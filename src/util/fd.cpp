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

Status pread_exact(int fd, void* buf, size_t len, uint64_t off, std::string_view what) {
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
    if (n == 0) {
      return make_error(EIO, "{}: unexpected end of file reading {} bytes at offset {}", what, len,
                        off);
    }
    done += static_cast<size_t>(n);
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

Result<std::string> read_small_file(const std::string& path, uint64_t limit) {
  CKPTFS_TRY(UniqueFd fd, open_file(path, O_RDONLY));
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) {
    int e = errno;
    return make_error(e, "{}: stat failed: {}", path, std::strerror(e));
  }
  if (static_cast<uint64_t>(st.st_size) > limit) {
    return make_error(EFBIG, "{}: file is {} bytes, larger than the {} byte limit", path,
                      st.st_size, limit);
  }
  std::string out(static_cast<size_t>(st.st_size), '\0');
  CKPTFS_CHECK(pread_exact(fd.get(), out.data(), out.size(), 0, path));
  return out;
}

}  // namespace ckptfs
