#include "ckptfs/util/path.hpp"

#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>

namespace ckptfs {

bool is_valid_component(std::string_view name) {
  if (name.empty() || name == "." || name == ".." || name.size() > 255) return false;
  return name.find('/') == std::string_view::npos && name.find('\0') == std::string_view::npos;
}

std::string join_rel(std::string_view dir, std::string_view name) {
  if (dir.empty()) return std::string(name);
  std::string out;
  out.reserve(dir.size() + 1 + name.size());
  out.append(dir).append("/").append(name);
  return out;
}

namespace {

bool rel_is_safe(std::string_view rel) {
  if (rel.empty()) return true;
  if (rel.front() == '/') return false;
  size_t start = 0;
  while (start <= rel.size()) {
    size_t slash = rel.find('/', start);
    if (slash == std::string_view::npos) slash = rel.size();
    if (!is_valid_component(rel.substr(start, slash - start))) return false;
    start = slash + 1;
  }
  return true;
}

}  // namespace

Result<UniqueFd> open_beneath(int rootfd, std::string_view rel, int flags, mode_t mode) {
  if (!rel_is_safe(rel)) {
    return make_error(EINVAL, "{}: refusing a path that could leave the source directory", rel);
  }
  std::string path = rel.empty() ? std::string(".") : std::string(rel);
  struct open_how how {};
  how.flags = static_cast<uint64_t>(flags | O_CLOEXEC);
  how.mode = (flags & O_CREAT) ? mode : 0;
  how.resolve = RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS;
  long fd = ::syscall(SYS_openat2, rootfd, path.c_str(), &how, sizeof how);
  if (fd < 0 && errno == ENOSYS) {
    fd = ::openat(rootfd, path.c_str(), flags | O_CLOEXEC, mode);
  }
  if (fd < 0) {
    int e = errno;
    return make_error(e, "{}: cannot open: {}", path, std::strerror(e));
  }
  return UniqueFd(static_cast<int>(fd));
}

Result<struct stat> stat_beneath(int rootfd, std::string_view rel) {
  if (!rel_is_safe(rel)) {
    return make_error(EINVAL, "{}: refusing a path that could leave the source directory", rel);
  }
  struct stat st {};
  if (rel.empty()) {
    if (::fstat(rootfd, &st) != 0) {
      int e = errno;
      return make_error(e, "source root: cannot stat: {}", std::strerror(e));
    }
    return st;
  }
  // Resolve the parent beneath the root, then stat the last component without following it.
  size_t slash = rel.rfind('/');
  std::string last(slash == std::string_view::npos ? rel : rel.substr(slash + 1));
  int dirfd = rootfd;
  UniqueFd parent;
  if (slash != std::string_view::npos) {
    CKPTFS_TRY(parent, open_beneath(rootfd, rel.substr(0, slash), O_PATH | O_DIRECTORY));
    dirfd = parent.get();
  }
  if (::fstatat(dirfd, last.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
    int e = errno;
    return make_error(e, "{}: cannot stat: {}", rel, std::strerror(e));
  }
  return st;
}

int64_t mtime_ns(const struct stat& st) {
  return static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
}
int64_t ctime_ns(const struct stat& st) {
  return static_cast<int64_t>(st.st_ctim.tv_sec) * 1000000000 + st.st_ctim.tv_nsec;
}

}  // namespace ckptfs
