// Path helpers that keep every access beneath a root directory.
//
// The daemon runs as root over a source tree that other users can write to, so every path
// beneath the root is resolved without following a symbolic link in ANY component
// (intermediate or final) and without leaving the root. Two resolvers implement that rule:
// openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS) where the kernel has
// it, and otherwise (openat2 answers ENOSYS: kernels before 5.6, some seccomp profiles) a walk
// that opens one component at a time with O_NOFOLLOW. Both give the same errno for the same
// tree:
//   - a symlink as an intermediate or the final component: ELOOP (whatever the flags,
//     O_PATH | O_NOFOLLOW and O_DIRECTORY included: no descriptor to a symlink is returned);
//   - an intermediate component that is not a directory: ENOTDIR;
//   - a missing component: ENOENT;
//   - a path that is absolute or has an empty, "." or ".." component: EINVAL, before any
//     system call.
#pragma once

#include <sys/stat.h>

#include <string>
#include <string_view>
#include <vector>

#include "ckptfs/util/fd.hpp"

namespace ckptfs {

// True for a single, safe path component: not empty, not "." or "..", no '/' or NUL.
bool is_valid_component(std::string_view name);

// True for a relative path of safe components ("" is the root itself): no leading '/', no
// empty, "." or ".." component. What every *_beneath function below accepts.
bool is_safe_rel(std::string_view rel);

// Joins a relative directory path ("" = root) and a component.
std::string join_rel(std::string_view dir, std::string_view name);

// The one path splitter. The directory part of a relative path ("" for a bare name) and its
// last component: split_rel("a/b/c") is {"a/b", "c"}, split_rel("c") is {"", "c"}.
struct RelParts {
  std::string_view dir;
  std::string_view name;
};
RelParts split_rel(std::string_view rel);

// The components of a safe relative path, in order ("" gives none); EINVAL naming `rel` when
// it is not one (see is_safe_rel).
Result<std::vector<std::string>> components_of(std::string_view rel);

// Which resolver open_beneath / stat_beneath use. Auto is openat2 when the kernel has it, the
// component walk otherwise; Walk forces the component walk (for tests of the fallback).
enum class Resolve { Auto, Walk };

// Whether this process can call openat2 (probed once per process).
bool openat2_supported();

// Opens `rel` (relative, "" = the root itself) beneath `rootfd`, following no symlink and
// never resolving outside the root; see the errno list above. O_CLOEXEC is always added.
Result<UniqueFd> open_beneath(int rootfd, std::string_view rel, int flags, mode_t mode = 0,
                              Resolve how = Resolve::Auto);

// lstat of `rel` beneath `rootfd`: the final component is not followed (a symlink gives the
// link's own stat), the parent is resolved with open_beneath (a symlink on the way: ELOOP).
Result<struct stat> stat_beneath(int rootfd, std::string_view rel, Resolve how = Resolve::Auto);

// Opens `rel` beneath `rootfd` read-only as with open_regular_at (util/fd.hpp): a FIFO cannot
// block the open, and anything but a regular file is refused.
Result<UniqueFd> open_regular_beneath(int rootfd, std::string_view rel, Resolve how = Resolve::Auto,
                                      struct stat* st = nullptr);

// Whole small regular file `rel` beneath `rootfd` (as open_regular_beneath opens it; larger
// than `limit`: EFBIG), named `rel` in errors.
Result<std::string> read_small_file_beneath(int rootfd, std::string_view rel, uint64_t limit);

int64_t mtime_ns(const struct stat& st);
int64_t ctime_ns(const struct stat& st);

}  // namespace ckptfs
