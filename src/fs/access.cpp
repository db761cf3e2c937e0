// fs/access: the kernel's permission rules, applied by the daemon to names the kernel cannot check.
#include "ckptfs/fs/access.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>

#include "ckptfs/source/scanner.hpp"
#include "ckptfs/util/fd.hpp"
#include "ckptfs/util/path.hpp"
#include "names.hpp"

namespace ckptfs::fs {

bool Caller::in_group(gid_t g) const {
  return gid == g || std::find(groups.begin(), groups.end(), g) != groups.end();
}

bool may(const Perm& p, const Caller& c, int mask) {
  if (c.root()) {
    // CAP_DAC_OVERRIDE: everything but executing a file no one may execute.
    if ((mask & X_OK) && !S_ISDIR(p.mode) && (p.mode & 0111) == 0) return false;
    return true;
  }
  mode_t bits = p.mode & 07;  // other
  if (c.uid == p.uid) {
    bits = (p.mode >> 6) & 07;
  } else if (c.in_group(p.gid)) {
    bits = (p.mode >> 3) & 07;
  }
  return (static_cast<int>(bits) & mask) == mask;
}

Status may_delete(const Perm& dir, const Perm& victim, const Caller& c, std::string_view what) {
  if (!may(dir, c, W_OK | X_OK)) {
    return make_error(EACCES, "{}: uid {} may not write the directory", what, c.uid);
  }
  if ((dir.mode & S_ISVTX) && !c.root() && c.uid != victim.uid && c.uid != dir.uid) {
    return make_error(EPERM, "{}: sticky directory: owned by uid {}, not by uid {}", what,
                      victim.uid, c.uid);
  }
  return {};
}

Status may_open_existing(const Perm& dir, const Perm& file, int flags, const Caller& c,
                         int protected_regular, std::string_view what) {
  int mask = 0;
  const int acc = flags & O_ACCMODE;
  if (acc == O_RDONLY || acc == O_RDWR) mask |= R_OK;
  if (acc == O_WRONLY || acc == O_RDWR || (flags & O_TRUNC)) mask |= W_OK;
  if (!may(file, c, mask)) {
    return make_error(EACCES, "{}: exists, and uid {} may not open it that way", what, c.uid);
  }
  // may_create_in_sticky (fs.protected_regular), which binds root too.
  if (protected_regular > 0 && (dir.mode & S_ISVTX) && S_ISREG(file.mode) && file.uid != dir.uid &&
      file.uid != c.uid &&
      ((dir.mode & S_IWOTH) || (protected_regular >= 2 && (dir.mode & S_IWGRP)))) {
    return make_error(EACCES,
                      "{}: exists in a sticky directory, owned by uid {} (protected_regular)", what,
                      file.uid);
  }
  return {};
}

Perm shown_perm(const std::vector<Perm>& inputs, uid_t dir_uid, gid_t dir_gid) {
  Perm out{dir_uid, dir_gid, 0};
  if (inputs.empty()) return out;
  auto same = [&](auto field) {
    return std::all_of(inputs.begin(), inputs.end(),
                       [&](const Perm& p) { return field(p) == field(inputs[0]); });
  };
  if (same([](const Perm& p) { return p.uid; })) out.uid = inputs[0].uid;
  if (same([](const Perm& p) { return p.gid; })) out.gid = inputs[0].gid;
  auto all = [&](auto pred) { return std::all_of(inputs.begin(), inputs.end(), pred); };
  // The shown owner may not be in a shard's group: only its own bits or other's count.
  if (all([&](const Perm& p) {
        return p.uid == out.uid ? (p.mode & S_IRUSR) : (p.mode & S_IROTH);
      })) {
    out.mode |= S_IRUSR;
  }
  if (all([&](const Perm& p) {
        return p.gid == out.gid ? (p.mode & S_IRGRP) : (p.mode & S_IROTH);
      })) {
    out.mode |= S_IRGRP;
  }
  if (all([](const Perm& p) { return (p.mode & S_IROTH) != 0; })) out.mode |= S_IROTH;
  return out;
}

int read_protected_regular() {
  std::ifstream f("/proc/sys/fs/protected_regular");
  int v = 0;
  if (!(f >> v)) return 0;
  return v;
}

Status may_delete_at(int dirfd, const Perm& dir, const std::string& name, const Caller& c,
                     std::string_view what) {
  if (c.root()) return {};
  struct stat st {};
  if (::fstatat(dirfd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) return {};
  return may_delete(dir, Perm::of(st), c, what);
}

Status may_delete_each(const Perm& dir, const std::vector<Perm>& victims, const Caller& c,
                       std::string_view what) {
  for (const auto& p : victims) CKPTFS_CHECK(may_delete(dir, p, c, what));
  return {};
}

Status may_empty(int dirfd, const Caller& c, const std::string& rel, int depth) {
  if (c.root()) return {};
  if (depth > 8) return make_error(ENOTEMPTY, "{}: too deep", rel);
  struct stat dst {};
  if (::fstat(dirfd, &dst) != 0) return errno_error(rel);
  CKPTFS_TRY(auto entries, source::list_dir(dirfd));
  for (const auto& e : entries) {
    const std::string what = join_rel(rel, e.name);
    CKPTFS_CHECK(may_delete(Perm::of(dst), Perm::of(e.st), c, what));
    if (S_ISDIR(e.st.st_mode) && !names::is_state(e.name)) {
      CKPTFS_TRY(UniqueFd sub, open_at(dirfd, e.name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW));
      CKPTFS_CHECK(may_empty(sub.get(), c, what, depth + 1));
    }
  }
  return {};
}

}  // namespace ckptfs::fs
