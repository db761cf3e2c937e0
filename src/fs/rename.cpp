// fs/rename: rename within SRC (RENAME_NOREPLACE and RENAME_EXCHANGE honoured); a file renamed
// onto a model name is handed to the write path (write_rename.cpp), which stores it as rank
// shards or refuses one the view would hide.
#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>

#include "ckptfs/format/names.hpp"
#include "ckptfs/util/path.hpp"
#include "impl.hpp"

namespace ckptfs::fs {

Status Filesystem::Impl::rename(Ino parent, std::string_view name, Ino new_parent,
                                std::string_view new_name, unsigned flags, const Caller& who) {
  CKPTFS_CHECK(writable());
  CKPTFS_TRY(auto from, dir_for_change(parent, name, ENOENT));
  CKPTFS_TRY(auto to, dir_for_change(new_parent, new_name));
  if (shown_virtual(from, name)) {
    return make_error(EXDEV, "{}: a consolidated file is not renamed in place (copy it)",
                      join_rel(from.node.rel, name));
  }
  // The source first, as the kernel looks it up first: a missing one is ENOENT, whatever the
  // target is.
  const std::string o(name), nn(new_name);
  struct stat src_st {};
  if (::fstatat(from.fd.get(), o.c_str(), &src_st, AT_SYMLINK_NOFOLLOW) != 0) {
    return errno_error(source_path(join_rel(from.node.rel, name)));
  }
  const auto shown_over = shown_output(to, new_name);
  const bool over_virtual = shown_over.v != nullptr;
  if (over_virtual && (flags & RENAME_NOREPLACE)) {
    return make_error(EEXIST, "{}: exists", join_rel(to.node.rel, new_name));
  }
  if (over_virtual && (flags & RENAME_EXCHANGE)) {
    return make_error(EXDEV, "{}: a consolidated file is not exchanged",
                      join_rel(to.node.rel, new_name));
  }
  if (format::parse_model_name(new_name) && !(flags & RENAME_EXCHANGE)) {
    CKPTFS_CHECK(writing.may_rename_onto(from.at(), o, src_st, to.at(), nn));
  }
  // What the kernel checked on what it sees, the daemon checks on what is really there: the
  // source, and the entry replaced (it may be hidden: a shard file, a real model file), or the
  // shards of the consolidated file replaced.
  CKPTFS_CHECK(may_delete_entry(from, o, who));
  if (!(flags & RENAME_NOREPLACE)) {
    struct stat victim {};
    if (::fstatat(to.fd.get(), nn.c_str(), &victim, AT_SYMLINK_NOFOLLOW) == 0) {
      CKPTFS_CHECK(may_delete(Perm::of(to.st), Perm::of(victim), who,
                              source_path(join_rel(to.node.rel, new_name))));
    } else if (flags & RENAME_EXCHANGE) {
      return make_error(ENOENT, "{}: nothing to exchange with", join_rel(to.node.rel, new_name));
    }
  }
  if (over_virtual) {
    CKPTFS_CHECK(may_delete_each(
        Perm::of(to.st),
        shown_over.output ? output_perms(*shown_over.v, *shown_over.output) : shown_over.v->inputs,
        who, source_path(join_rel(to.node.rel, new_name))));
  }
  const bool replaces = !(flags & (RENAME_EXCHANGE | RENAME_NOREPLACE)) &&
                        !(from.dev == to.dev && from.ino == to.ino && o == nn);
  // Onto a model name the file is stored after it moved, which can fail (memory, staging), and
  // then the rename is undone: what it replaces is kept until then.
  std::optional<WritePath::Replaced> replaced;
  if (replaces && format::parse_model_name(new_name)) {
    CKPTFS_TRY(replaced, writing.keep_replaced(to.at(), new_parent, nn));
  }
  if (replaces) retire_if_last(to.fd.get(), nn);  // the entry replaced, if any (and not kept)
  int moved = ::renameat2(from.fd.get(), o.c_str(), to.fd.get(), nn.c_str(), flags);
  if (moved != 0 && (errno == ENOTEMPTY || errno == EEXIST) && S_ISDIR(src_st.st_mode) &&
      !(flags & (RENAME_EXCHANGE | RENAME_NOREPLACE))) {
    // A directory over one the view shows empty, holding only what is hidden (the write path's
    // .ckptfs): that goes, as rmdir would remove it, and the rename is tried again.
    CKPTFS_CHECK(empty_hidden(to, new_parent, nn, who));
    moved = ::renameat2(from.fd.get(), o.c_str(), to.fd.get(), nn.c_str(), flags);
  }
  if (moved != 0) {
    return errno_error(fmt::format("rename {} to {}", source_path(join_rel(from.node.rel, name)),
                                   source_path(join_rel(to.node.rel, new_name))));
  }
  nodes.renamed(parent, o, join_rel(from.node.rel, name), new_parent, nn,
                join_rel(to.node.rel, new_name), (flags & RENAME_EXCHANGE) != 0);
  writing.touched(from.dev, from.ino);
  writing.touched(to.dev, to.ino);
  note_writer(from.node, who);
  note_writer(to.node, who);
  views.recheck(from.dev, from.ino);
  views.recheck(to.dev, to.ino);
  if (!format::parse_model_name(new_name)) return {};
  // A file renamed onto a model name: one being written is stored when it is closed; a closed
  // one is stored now. Either way it replaces the version shown under that name.
  return writing.store_renamed(from.at(), parent, o, to.at(), new_parent, nn, replaced);
}

}  // namespace ckptfs::fs
