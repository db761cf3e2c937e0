// util/path: the one path checker, path splitter and the beneath-the-root resolvers.
#include "ckptfs/util/path.hpp"

#include <fcntl.h>
#include <linux/limits.h>
#include <linux/openat2.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
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

RelParts split_rel(std::string_view rel) {
  const size_t slash = rel.rfind('/');
  if (slash == std::string_view::npos) return {std::string_view(), rel};
  return {rel.substr(0, slash), rel.substr(slash + 1)};
}

Result<std::vector<std::string>> components_of(std::string_view rel) {
  if (!is_safe_rel(rel)) return make_error(EINVAL, "'{}' is not a plain relative path", rel);
  std::vector<std::string> out;
  while (!rel.empty()) {
    const size_t slash = rel.find('/');
    out.emplace_back(rel.substr(0, slash));
    if (slash == std::string_view::npos) break;
    rel.remove_prefix(slash + 1);
  }
  return out;
}

Result<std::string> read_small_file_beneath(int rootfd, std::string_view rel, uint64_t limit) {
  struct stat st {};
  CKPTFS_TRY(UniqueFd fd, open_regular_beneath(rootfd, rel, Resolve::Auto, &st));
  return read_whole(fd, st, rel, limit);
}

bool is_safe_rel(std::string_view rel) {
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

bool openat2_supported() {
  // A per-process probe, run once (thread-safe static initialisation) and constant afterwards:
  // the code base has no mutable globals, and a function-local `static const` probe is the
  // accepted idiom for a fact about the process that cannot change. A zero-sized open_how fails
  // with EINVAL before any lookup where openat2 exists, and with ENOSYS where the kernel or a
  // seccomp filter lacks it. Callers still handle a later ENOSYS (a filter installed after the
  // probe) by walking.
  static const bool supported = [] {
    int saved = errno;
    long r = ::syscall(SYS_openat2, -1, nullptr, nullptr, 0);
    bool ok = !(r < 0 && errno == ENOSYS);
    errno = saved;
    return ok;
  }();
  return supported;
}

namespace {

Error refuse_unsafe(std::string_view rel) {
  return make_error(EINVAL, "{}: refusing a path that could leave the source directory", rel);
}

Error open_error(std::string_view rel, int e) {
  std::string_view shown = rel.empty() ? std::string_view(".") : rel;
  if (e == ELOOP) {
    return make_error(ELOOP, "{}: refusing to follow a symbolic link beneath the source directory",
                      shown);
  }
  return make_error(e, "{}: cannot open: {}", shown, std::strerror(e));
}

// The walk reports ENOTDIR for a symlink opened with O_DIRECTORY | O_NOFOLLOW; openat2 with
// RESOLVE_NO_SYMLINKS reports ELOOP. Turn the former into the latter.
int walk_errno(int dirfd, const std::string& name, int e) {
  struct stat st {};
  if (e == ENOTDIR && ::fstatat(dirfd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 &&
      S_ISLNK(st.st_mode)) {
    return ELOOP;
  }
  return e;
}

// O_PATH | O_NOFOLLOW opens a final symlink itself; refuse that descriptor (ELOOP).
Result<UniqueFd> refuse_symlink_fd(UniqueFd fd, std::string_view rel, int flags) {
  if ((flags & O_PATH) && (flags & O_NOFOLLOW)) {
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0) return open_error(rel, errno);
    if (S_ISLNK(st.st_mode)) return open_error(rel, ELOOP);
  }
  return fd;
}

// Fallback resolver: one openat per component from rootfd, O_NOFOLLOW throughout. `rel` has
// passed is_safe_rel, so no component is empty, "." or "..", and the walk cannot leave the root.
Result<UniqueFd> walk_beneath(int rootfd, std::string_view rel, int flags, mode_t mode) {
  int dirfd = rootfd;
  UniqueFd held;  // the current intermediate directory (O_PATH)
  std::string name = ".";
  size_t start = 0;
  while (!rel.empty()) {
    size_t slash = rel.find('/', start);
    name.assign(rel.substr(start, slash == std::string_view::npos ? rel.npos : slash - start));
    if (slash == std::string_view::npos) break;
    int fd = ::openat(dirfd, name.c_str(), O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return open_error(rel, walk_errno(dirfd, name, errno));
    held.reset(fd);
    dirfd = fd;
    start = slash + 1;
  }
  int fd = ::openat(dirfd, name.c_str(), flags | O_NOFOLLOW | O_CLOEXEC, mode);
  if (fd < 0) return open_error(rel, walk_errno(dirfd, name, errno));
  return refuse_symlink_fd(UniqueFd(fd), rel, flags | O_NOFOLLOW);
}

}  // namespace

Result<UniqueFd> open_beneath(int rootfd, std::string_view rel, int flags, mode_t mode,
                              Resolve how) {
  if (!is_safe_rel(rel)) return refuse_unsafe(rel);
  if (how == Resolve::Walk || !openat2_supported()) return walk_beneath(rootfd, rel, flags, mode);
  std::string path = rel.empty() ? std::string(".") : std::string(rel);
  struct open_how oh {};
  // Without O_NOFOLLOW a final symlink is ELOOP under RESOLVE_NO_SYMLINKS for every flag
  // combination; with it, O_PATH would open the link itself and O_DIRECTORY would say ENOTDIR.
  oh.flags = static_cast<uint64_t>((flags & ~O_NOFOLLOW) | O_CLOEXEC);
  oh.mode = (flags & O_CREAT) ? mode : 0;
  oh.resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS;
  long fd = ::syscall(SYS_openat2, rootfd, path.c_str(), &oh, sizeof oh);
  // A path longer than PATH_MAX (a deep tree the kernel resolves from a working directory in
  // it) is walked one component at a time, as it was given.
  if (fd < 0 && (errno == ENOSYS || (errno == ENAMETOOLONG && path.size() >= PATH_MAX))) {
    return walk_beneath(rootfd, rel, flags, mode);
  }
  if (fd < 0) return open_error(rel, errno);
  return UniqueFd(static_cast<int>(fd));
}

Result<struct stat> stat_beneath(int rootfd, std::string_view rel, Resolve how) {
  if (!is_safe_rel(rel)) return refuse_unsafe(rel);
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
    CKPTFS_TRY(parent, open_beneath(rootfd, rel.substr(0, slash), O_PATH | O_DIRECTORY, 0, how));
    dirfd = parent.get();
  }
  if (::fstatat(dirfd, last.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
    int e = errno;
    return make_error(e, "{}: cannot stat: {}", rel, std::strerror(e));
  }
  return st;
}

Result<UniqueFd> open_regular_beneath(int rootfd, std::string_view rel, Resolve how,
                                      struct stat* st) {
  auto fd = open_beneath(rootfd, rel, kOpenRegularFlags, 0, how);
  if (!fd.ok()) {
    int e = fd.error().code;
    if (e == ENXIO) return open_regular_error(e, rel);
    return std::move(fd).error();
  }
  return require_regular(std::move(fd).value(), rel, st);
}

namespace {

// Nanoseconds since the epoch, saturated: a hostile file can carry any time ext4 stores
// (years past 2262 overflow 64 bits of nanoseconds), and overflow must not be undefined.
int64_t to_ns(const struct timespec& ts) {
  int64_t ns;
  if (__builtin_mul_overflow(static_cast<int64_t>(ts.tv_sec), int64_t{1000000000}, &ns) ||
      __builtin_add_overflow(ns, static_cast<int64_t>(ts.tv_nsec), &ns)) {
    return ts.tv_sec < 0 ? INT64_MIN : INT64_MAX;
  }
  return ns;
}

}  // namespace

int64_t mtime_ns(const struct stat& st) { return to_ns(st.st_mtim); }
int64_t ctime_ns(const struct stat& st) { return to_ns(st.st_ctim); }

}  // namespace ckptfs
