// Who may do what: the kernel's permission rules (generic_permission, may_delete and the sticky
// bit, may_create_in_sticky), for the names the kernel cannot check itself. The daemon acts as
// root in SRC, and the kernel checks only what it sees: a shard file the view hides, the inputs
// of a synthesized file, a name the kernel believed free. Pure functions, no I/O, but for the last
// three (may_delete_at, may_delete_each, may_empty), which apply the rules to what SRC holds.
#pragma once

#include <sys/stat.h>
#include <sys/types.h>

#include <string>
#include <string_view>
#include <vector>

#include "ckptfs/util/result.hpp"

namespace ckptfs::fs {

// Who is asking: the credentials of the request (uid 0 is root and passes every check but the
// sticky rule of protected_regular, as in the kernel).
struct Caller {
  uid_t uid = 0;
  gid_t gid = 0;
  std::vector<gid_t> groups;  // supplementary groups
  pid_t pid = 0;              // the requesting thread (0: unknown), for the writer's view

  [[nodiscard]] bool root() const { return uid == 0; }
  [[nodiscard]] bool in_group(gid_t g) const;
};

// Owner and mode of one file (st_mode, type bits included).
struct Perm {
  uid_t uid = 0;
  gid_t gid = 0;
  mode_t mode = 0;

  static Perm of(const struct stat& st) { return Perm{st.st_uid, st.st_gid, st.st_mode}; }
  // A directory that must be searched to reach an input: its x bits as read bits, so that a
  // read check on it is the kernel's search check.
  static Perm searching(const struct stat& st) {
    return Perm{st.st_uid, st.st_gid, static_cast<mode_t>(S_IFREG | ((st.st_mode & 0111) << 2))};
  }
  bool operator==(const Perm&) const = default;
};

// The kernel's generic_permission: the owner class if the caller owns the file, else the group
// class if the caller is in its group, else other. `mask` is R_OK, W_OK and X_OK or'ed. Root
// reads and writes anything and searches directories; it executes a file with some x bit.
[[nodiscard]] bool may(const Perm& p, const Caller& c, int mask);
[[nodiscard]] inline bool may_read(const Perm& p, const Caller& c) { return may(p, c, 4); }

// The kernel's may_delete, for removing or replacing `victim` in directory `dir`: write and
// search permission on the directory (EACCES), and in a sticky directory only the victim's
// owner, the directory's owner or root (EPERM). `what` names the victim in the error.
Status may_delete(const Perm& dir, const Perm& victim, const Caller& c, std::string_view what);

// An open with O_CREAT that found `file` already in `dir`: the checks the kernel makes for an
// existing file (may_open: read and write permission as `flags` ask, O_TRUNC needs write) and,
// with `protected_regular` (fs.protected_regular) set, may_create_in_sticky: in a sticky
// directory that others can write, a regular file owned by neither the caller nor the
// directory's owner is refused (EACCES), root included.
Status may_open_existing(const Perm& dir, const Perm& file, int flags, const Caller& c,
                         int protected_regular, std::string_view what);

// The owner and read bits shown for a file made of `inputs` (a consolidated file and its
// index): the inputs' common owner and group (else the directory's), and a read bit for a
// class only where every input grants it to that class. No inputs: no bit at all (only root
// reads it). The kernel checks these modes; open() checks may_read on every input too, which
// covers what a mode alone cannot say.
Perm shown_perm(const std::vector<Perm>& inputs, uid_t dir_uid, gid_t dir_gid);

// fs.protected_regular as this kernel has it (0 when it cannot be read).
int read_protected_regular();

// --- the same rules applied to what SRC holds (these read SRC) -------------------------------

// May `c` remove entry `name` of directory `dirfd` (whose owner and mode are `dir`) as it is now
// (nothing to check when it does not exist). `what` names it in the error.
Status may_delete_at(int dirfd, const Perm& dir, const std::string& name, const Caller& c,
                     std::string_view what);

// May `c` remove every one of `victims` from directory `dir` (the shards of a consolidated file).
Status may_delete_each(const Perm& dir, const std::vector<Perm>& victims, const Caller& c,
                       std::string_view what);

// Whether `c` could empty directory `dirfd` (at `rel`) entry by entry, subdirectories first:
// what rmdir removes with a directory whose view is empty. The write path's own state directory
// counts as one entry (nobody but the daemon writes inside it).
Status may_empty(int dirfd, const Caller& c, const std::string& rel, int depth = 0);

}  // namespace ckptfs::fs
