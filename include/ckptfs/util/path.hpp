// Path helpers that keep every access beneath a root directory.
#pragma once

#include <sys/stat.h>

#include <string>
#include <string_view>

#include "ckptfs/util/fd.hpp"

namespace ckptfs {

// True for a single, safe path component: not empty, not "." or "..", no '/' or NUL.
bool is_valid_component(std::string_view name);

// Joins a relative directory path ("" = root) and a component.
std::string join_rel(std::string_view dir, std::string_view name);

// Opens `rel` (relative, "" = the root itself) beneath `rootfd`, never resolving outside it
// (openat2 RESOLVE_BENEATH where the kernel has it; a component check otherwise).
Result<UniqueFd> open_beneath(int rootfd, std::string_view rel, int flags, mode_t mode = 0);

// lstat of `rel` beneath `rootfd`.
Result<struct stat> stat_beneath(int rootfd, std::string_view rel);

int64_t mtime_ns(const struct stat& st);
int64_t ctime_ns(const struct stat& st);

}  // namespace ckptfs
