// fs/rename: rename within SRC (RENAME_NOREPLACE and RENAME_EXCHANGE honoured); a file renamed
// onto a model name is stored as rank shards, and one that would be hidden there is refused.
#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>

#include <spdlog/spdlog.h>

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
    // Onto a model name of a directory of other files' rank shards: only a consolidated file
    // that fits its checkpoint (split into shards here) can be seen there. Anything else would
    // be hidden: refused now, before anything moves. A file still being written is decided
    // when its writer closes it.
    CKPTFS_TRY(auto entries, source::list_dir(to.fd.get()));
    const auto ns = write::StoreChecks::name_state(to.fd.get(), entries, nn);
    if (!ns.native.empty()) {
      return make_error(EINVAL,
                        "{}: in a {} checkpoint directory every model name shows the "
                        "consolidated view of its native files, and {} would be hidden",
                        source_path(join_rel(to.node.rel, new_name)), ns.native, o);
    }
    if (ns.others) {
      Status why = make_error(EINVAL, "{}: not a regular file", o);
      if (S_ISREG(src_st.st_mode)) {
        if (writes.being_written(static_cast<uint64_t>(src_st.st_dev),
                                 static_cast<uint64_t>(src_st.st_ino))) {
          why = {};
        } else if (auto fd = open_at(from.fd.get(), o, O_RDONLY | O_NOFOLLOW | O_NONBLOCK); !fd) {
          why = std::move(fd).error();
        } else if (auto sp = write::WriteFile::prospect(
                       fd->get(), plan_options(to.fd.get(), source_path(to.node.rel)),
                       source_path(join_rel(from.node.rel, name)));
                   !sp) {
          why = std::move(sp).error();
        } else {
          why = checks.validate(to.fd.get(), source_path(to.node.rel), nn, sp->prospect());
        }
      }
      if (!why) {
        return make_error(EINVAL,
                          "{}: in a directory of rank shards a model name shows a consolidated "
                          "file that fits its checkpoint, and {} would be hidden: {}",
                          source_path(join_rel(to.node.rel, new_name)), o, why.error().message);
      }
    }
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
  if (!(flags & (RENAME_EXCHANGE | RENAME_NOREPLACE)) &&
      !(from.dev == to.dev && from.ino == to.ino && o == nn)) {
    retire_if_last(to.fd.get(), nn);  // the entry replaced, if any
  }
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
  writes.touched(from.dev, from.ino);
  writes.touched(to.dev, to.ino);
  note_writer(from.node, who);
  note_writer(to.node, who);
  views.recheck(from.dev, from.ino);
  views.recheck(to.dev, to.ino);
  if (!format::parse_model_name(new_name)) return {};
  // A file renamed onto a model name: one being written is stored when it is closed; a closed
  // one is stored now. Either way it replaces the version shown under that name.
  struct stat st {};
  if (::fstatat(to.fd.get(), nn.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode)) {
    return {};
  }
  if (auto open = writes.find(static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino));
      open && open->writers.load() > 0) {
    open->renamed();
    return {};  // stored when its writer closes it, under the name it has then
  }
  CKPTFS_TRY(UniqueFd fd, open_at(to.fd.get(), nn, O_RDWR | O_NOFOLLOW | O_NONBLOCK));
  // The registered state if the file is still open (read-only, or a release not yet here).
  CKPTFS_TRY(auto wf, start_writing(std::move(fd), to, nn, false));
  auto dst = to.state();
  std::unique_lock lock(dst->mu);
  dst->built.wait(lock, [&] { return !dst->building; });
  const std::string to_display = source_path(to.node.rel);
  CKPTFS_CHECK(wf->store(write::Place{to.fd.get(), nn, to_display},
                         checks.rules(to.fd.get(), to_display, nn)));
  if (wf->state() == write::WriteFile::State::Committed) {
    // Its backing file is gone (the shards are the file now): the kernel's entry for the name
    // still holds that file's node, which must look the name up again (ESTALE, then the view).
    nodes.retire_key(real_key(st));
    if (notifier) notifier->inval_entry(new_parent, nn);
  }
  if (auto why = wf->stored_whole()) {
    // Stored whole: it replaces what the name stored (the rename says so), whose shards go;
    // if other files' shards remain, it is hidden (the check above let only consolidated
    // files through: splitting this one failed).
    CKPTFS_TRY(auto entries, source::list_dir(to.fd.get()));
    const auto ns = write::StoreChecks::name_state(to.fd.get(), entries, nn);
    if (ns.others) {
      // It would be hidden (it could not be split after all: memory, staging, a header too
      // large): the rename is undone, and fails.
      if (::renameat2(to.fd.get(), nn.c_str(), from.fd.get(), o.c_str(), RENAME_NOREPLACE) == 0) {
        nodes.renamed(new_parent, nn, join_rel(to.node.rel, new_name), parent, o,
                      join_rel(from.node.rel, name), false);
      } else {
        spdlog::error("{}: cannot undo the rename: {}", why->message, std::strerror(errno));
      }
      return *why;
    }
    if (ns.stored) {
      auto mn = format::parse_model_name(new_name);
      CKPTFS_CHECK(flusher->remove(to.target(source_path(to.node.rel)), mn->k, mn->m));
    }
  }
  dst->next_check = clock->now();
  writes.touched(to.dev, to.ino);
  return {};
}

}  // namespace ckptfs::fs
