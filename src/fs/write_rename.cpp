// fs/write_rename: the write path's side of a rename onto a model name: refused where the view
// would hide the file, and the file stored as rank shards once it has moved.
#include "write_path.hpp"

#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>

#include <cstring>

#include <spdlog/spdlog.h>

#include "ckptfs/format/names.hpp"
#include "ckptfs/util/path.hpp"
#include "dir_views.hpp"

namespace ckptfs::fs {

Status WritePath::may_rename_onto(const WriteDir& from, const std::string& from_name,
                                  const struct stat& src_st, const WriteDir& to,
                                  const std::string& to_name) {
  // Onto a model name of a directory of other files' rank shards: only a consolidated file
  // that fits its checkpoint (split into shards here) can be seen there. Anything else would
  // be hidden: refused now, before anything moves. A file still being written is decided
  // when its writer closes it.
  CKPTFS_TRY(auto entries, source::list_dir(to.fd));
  const auto ns = write::StoreChecks::name_state(to.fd, entries, to_name);
  const std::string to_path = source_path(join_rel(to.rel, to_name));
  if (!ns.native.empty()) {
    return make_error(EINVAL,
                      "{}: in a {} checkpoint directory every model name shows the "
                      "consolidated view of its native files, and {} would be hidden",
                      to_path, ns.native, from_name);
  }
  if (!ns.others) return {};
  Status why = make_error(EINVAL, "{}: not a regular file", from_name);
  if (S_ISREG(src_st.st_mode)) {
    if (writes_.being_written(static_cast<uint64_t>(src_st.st_dev),
                              static_cast<uint64_t>(src_st.st_ino))) {
      why = {};
    } else if (auto fd = open_at(from.fd, from_name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK); !fd) {
      why = std::move(fd).error();
    } else if (auto sp =
                   write::WriteFile::prospect(fd->get(), plan_options(to.fd, source_path(to.rel)),
                                              source_path(join_rel(from.rel, from_name)));
               !sp) {
      why = std::move(sp).error();
    } else {
      why = checks_.validate(to.fd, source_path(to.rel), to_name, sp->prospect());
    }
  }
  if (why) return {};
  return make_error(EINVAL,
                    "{}: in a directory of rank shards a model name shows a consolidated file "
                    "that fits its checkpoint, and {} would be hidden: {}",
                    to_path, from_name, why.error().message);
}

Status WritePath::store_renamed(const WriteDir& from, Ino from_parent, const std::string& from_name,
                                const WriteDir& to, Ino to_parent, const std::string& to_name) {
  struct stat st {};
  if (::fstatat(to.fd, to_name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(st.st_mode)) {
    return {};
  }
  if (auto open = writes_.find(static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino));
      open && open->writers.load() > 0) {
    open->renamed();
    open->guard_model_name();  // written by the kernel: never shown if the daemon dies first
    return {};                 // stored when its writer closes it, under the name it has then
  }
  CKPTFS_TRY(UniqueFd fd, open_at(to.fd, to_name, O_RDWR | O_NOFOLLOW | O_NONBLOCK));
  // The registered state if the file is still open (read-only, or a release not yet here).
  CKPTFS_TRY(auto wf, start(std::move(fd), to, to_name, false));
  auto dst = d_.nodes.dir_state(to.dev, to.ino);
  std::unique_lock lock(dst->mu);
  dst->built.wait(lock, [&] { return !dst->building; });
  const std::string to_display = source_path(to.rel);
  CKPTFS_CHECK(wf->store(write::Place{to.fd, to_name, to_display, to.rel},
                         checks_.rules(to.fd, to_display, to_name)));
  if (wf->state() == write::WriteFile::State::Committed) {
    // Its backing file is gone (the shards are the file now): the kernel's entry for the name
    // still holds that file's node, which must look the name up again (ESTALE, then the view).
    d_.nodes.retire_key(real_key(st));
    if (notifier_) notifier_->inval_entry(to_parent, to_name);
  }
  if (auto why = wf->stored_whole()) {
    // Stored whole: it replaces what the name stored (the rename says so), whose shards go;
    // if other files' shards remain, it is hidden (may_rename_onto let only consolidated
    // files through: splitting this one failed).
    CKPTFS_TRY(auto entries, source::list_dir(to.fd));
    const auto ns = write::StoreChecks::name_state(to.fd, entries, to_name);
    if (ns.others) {
      // It would be hidden (it could not be split after all: memory, staging, a header too
      // large): the rename is undone, and fails.
      if (::renameat2(to.fd, to_name.c_str(), from.fd, from_name.c_str(), RENAME_NOREPLACE) == 0) {
        d_.nodes.renamed(to_parent, to_name, join_rel(to.rel, to_name), from_parent, from_name,
                         join_rel(from.rel, from_name), false);
      } else {
        spdlog::error("{}: cannot undo the rename: {}", why->message, std::strerror(errno));
      }
      return *why;
    }
    if (ns.stored) {
      auto mn = format::parse_model_name(to_name);
      CKPTFS_CHECK(
          d_.flusher.remove(flush::Target{to.fd, to_display, to.uid, to.gid, 0644}, mn->k, mn->m));
    }
  }
  dst->next_check = d_.clock->now();
  writes_.touched(to.dev, to.ino);
  return {};
}

}  // namespace ckptfs::fs
