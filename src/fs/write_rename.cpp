// fs/write_rename: the write path's side of a rename onto a model name: refused where the view
// would hide the file, and the file stored as rank shards once it has moved.
#include "write_path.hpp"

#include <fcntl.h>
#include <stdio.h>
#include <sys/file.h>
#include <sys/stat.h>

#include <cstring>
#include <utility>

#include <spdlog/spdlog.h>

#include "ckptfs/format/names.hpp"
#include "ckptfs/util/path.hpp"
#include "ckptfs/write/dedup.hpp"
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

WritePath::Replaced::Replaced(Replaced&& o) noexcept
    : nodes_(o.nodes_),
      state_(std::move(o.state_)),
      held_(std::move(o.held_)),
      link_(std::exchange(o.link_, std::string())),
      st_(o.st_),
      ino_(o.ino_) {}

WritePath::Replaced& WritePath::Replaced::operator=(Replaced&& o) noexcept {
  if (this != &o) {
    let_go();
    nodes_ = o.nodes_;
    state_ = std::move(o.state_);
    held_ = std::move(o.held_);
    link_ = std::exchange(o.link_, std::string());
    st_ = o.st_;
    ino_ = o.ino_;
  }
  return *this;
}

void WritePath::Replaced::let_go() {
  if (link_.empty()) return;
  ::unlinkat(state_.get(), link_.c_str(), 0);
  // Its last link gone: its number may name the next file made, which must get a node of its
  // own (NodeTable::retire). Retired before held_ closes, while the number is still its.
  struct stat now {};
  if (::fstat(held_.get(), &now) == 0 && now.st_nlink == 0) nodes_->retire_key(real_key(st_));
  link_.clear();
  held_.reset();
}

Status WritePath::Replaced::put_back(int dir, const std::string& name) {
  if (::renameat(state_.get(), link_.c_str(), dir, name.c_str()) != 0) {
    return errno_error(fmt::format("{}: cannot put back the file the rename replaced", name));
  }
  link_.clear();
  return {};
}

Result<std::optional<WritePath::Replaced>> WritePath::keep_replaced(const WriteDir& to,
                                                                    Ino to_parent,
                                                                    const std::string& name) {
  // Nothing there, or nothing this daemon can hold open (a symlink, a file it may not read):
  // replaced unkept.
  auto held = open_at(to.fd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK);
  if (!held) return std::optional<Replaced>();
  struct stat st {};
  if (::fstat(held->get(), &st) != 0 || !S_ISREG(st.st_mode)) return std::optional<Replaced>();
  const std::string display = source_path(join_rel(to.rel, name));
  const std::string state_name(format::kStateDirName);
  if (::mkdirat(to.fd, state_name.c_str(), 0700) != 0 && errno != EEXIST) {
    return errno_error(fmt::format("{}/{}: cannot create", source_path(to.rel), state_name));
  }
  CKPTFS_TRY(UniqueFd state, open_at(to.fd, state_name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW));
  struct stat sst {};
  if (::fstat(state.get(), &sst) != 0 || !source::trusted_state(sst)) {
    return make_error(EPERM, "{}/{}: not this daemon's state directory; {} is not replaced",
                      source_path(to.rel), state_name, display);
  }
  // Locked, so that another daemon's recovery of this directory leaves the link while this one
  // holds it; a lock someone else holds on the file only means it is not taken here.
  ::flock(held->get(), LOCK_EX | LOCK_NB);
  std::string link = write::scratch_name();
  if (::linkat(to.fd, name.c_str(), state.get(), link.c_str(), 0) != 0) {
    return errno_error(
        fmt::format("{}: cannot keep it while the file renamed over it is stored", display));
  }
  struct stat linked {};
  if (::fstatat(state.get(), link.c_str(), &linked, AT_SYMLINK_NOFOLLOW) != 0 ||
      linked.st_ino != st.st_ino || linked.st_dev != st.st_dev) {
    ::unlinkat(state.get(), link.c_str(), 0);
    return make_error(EAGAIN, "{}: changed while the rename began", display);
  }
  std::optional<Ino> ino;
  if (auto n = d_.nodes.child(to_parent, name); n && n->key == real_key(st)) ino = n->ino;
  return std::optional<Replaced>(
      Replaced(d_.nodes, std::move(state), std::move(held).value(), std::move(link), st, ino));
}

Status WritePath::store_renamed(const WriteDir& from, Ino from_parent, const std::string& from_name,
                                const WriteDir& to, Ino to_parent, const std::string& to_name,
                                std::optional<Replaced>& replaced) {
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
  const std::string to_display = source_path(to.rel);
  auto stored = [&]() -> Status {
    CKPTFS_TRY(UniqueFd fd, open_at(to.fd, to_name, O_RDWR | O_NOFOLLOW | O_NONBLOCK));
    // The registered state if the file is still open (read-only, or a release not yet here).
    CKPTFS_TRY(auto wf, start(std::move(fd), to, to_name, false));
    auto dst = d_.nodes.dir_state(to.dev, to.ino);
    std::unique_lock lock(dst->mu);
    dst->built.wait(lock, [&] { return !dst->building; });
    CKPTFS_CHECK(wf->store(write::Place{to.fd, to_name, to_display, to.rel},
                           checks_.rules(to.fd, to_display, to_name)));
    if (wf->state() == write::WriteFile::State::Committed) {
      // Its backing file is gone (the shards are the file now): the kernel's entry for the
      // name still holds that file's node, which must look the name up again (ESTALE, then
      // the view).
      d_.nodes.retire_key(real_key(st));
      if (notifier_) notifier_->inval_entry(to_parent, to_name);
    }
    if (auto why = wf->stored_whole()) {
      // Stored whole: it replaces what the name stored (the rename says so), whose shards go;
      // if other files' shards remain, it would be hidden (may_rename_onto let only
      // consolidated files through: splitting this one failed: memory, staging, a header too
      // large), and the rename fails.
      CKPTFS_TRY(auto entries, source::list_dir(to.fd));
      const auto ns = write::StoreChecks::name_state(to.fd, entries, to_name);
      if (ns.others) return *why;
      if (ns.stored) {
        auto mn = format::parse_model_name(to_name);
        CKPTFS_CHECK(d_.flusher.remove(flush::Target{to.fd, to_display, to.uid, to.gid, 0644},
                                       mn->k, mn->m));
      }
    }
    return {};
  }();
  if (!stored) {
    // Not stored: the rename is undone, so that it changed no name. The file goes back under
    // its old name (a link first, then what it replaced renamed back over the new one: the
    // name never shows nothing, nor the version stored before), unless the store moved it.
    struct stat now {};
    if (::fstatat(to.fd, to_name.c_str(), &now, AT_SYMLINK_NOFOLLOW) != 0 ||
        now.st_ino != st.st_ino || now.st_dev != st.st_dev) {
      spdlog::error("{}: cannot undo the rename: the file is no longer there",
                    stored.error().message);
      return stored;
    }
    const bool back = replaced
                          ? ::linkat(to.fd, to_name.c_str(), from.fd, from_name.c_str(), 0) == 0
                          : ::renameat2(to.fd, to_name.c_str(), from.fd, from_name.c_str(),
                                        RENAME_NOREPLACE) == 0;
    if (!back) {
      spdlog::error("{}: cannot undo the rename: {}", stored.error().message, std::strerror(errno));
      return stored;
    }
    d_.nodes.renamed(to_parent, to_name, join_rel(to.rel, to_name), from_parent, from_name,
                     join_rel(from.rel, from_name), false);
    if (replaced) {
      if (auto put = replaced->put_back(to.fd, to_name); !put) {
        spdlog::error("{}: {}", stored.error().message, put.error().message);
      } else if (replaced->ino_) {
        d_.nodes.put_back(*replaced->ino_, to_parent, to_name, join_rel(to.rel, to_name));
      }
    }
    writes_.touched(to.dev, to.ino);
    writes_.touched(from.dev, from.ino);
    return stored;
  }
  auto dst = d_.nodes.dir_state(to.dev, to.ino);
  {
    std::lock_guard lock(dst->mu);
    dst->next_check = d_.clock->now();
  }
  writes_.touched(to.dev, to.ino);
  return {};
}

}  // namespace ckptfs::fs
