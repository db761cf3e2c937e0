// fs/write_path: files being written through the mount: opening them for writing, and settling
// them at close or fsync (stored as rank shards, or whole, by write/store_checks' rules).
#include "write_path.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <optional>

#include <spdlog/spdlog.h>

#include "ckptfs/format/names.hpp"
#include "ckptfs/source/scanner.hpp"
#include "ckptfs/util/path.hpp"
#include "ckptfs/write/dedup.hpp"
#include "dir_views.hpp"

namespace ckptfs::fs {

WritePath::WritePath(Deps d)
    : d_(std::move(d)),
      writes_(d_.clock),
      budget_(d_.opts.write_memory),
      checks_(d_.headers, d_.opts.build,
              [this](uint64_t dev, uint64_t ino) { return writes_.being_written(dev, ino); }) {}

write::PlanOptions WritePath::plan_options(int dirfd, const std::string& display) const {
  write::PlanOptions p;
  p.ranks = d_.opts.ranks ? d_.opts.ranks : d_.flusher.default_ranks();
  p.split = d_.opts.split;
  // Files the kernel writes are split after their close (write/resplit.hpp).
  p.split_after_close = d_.opts.backing_writes && d_.flusher.adopts_files();
  if (p.split == write::PlanOptions::TpPlan) {
    if (auto text = read_small_file_beneath(dirfd, "config.json", 16u << 20); text) {
      if (auto plan = format::parse_tp_plan(*text, display + "/config.json"); plan) {
        p.tp_plan = std::move(plan).value();
      } else {
        spdlog::warn("{}; splitting on dim 0", plan.error().message);
      }
    }
  }
  return p;
}

Result<bool> WritePath::each_storing(const std::string& rel, const StoringFn& fn) const {
  const auto file = split_rel(rel);
  // The directory above (torch's OUT/ of OUT/sharded/) and those below (NeMo's
  // MODEL/consolidated/), under any name: `mv OUT/sharded OUT/old` and `mv MODEL/consolidated
  // MODEL/hf` keep the links.
  const std::string what = source_path(rel);
  CKPTFS_TRY(UniqueFd dir, open_beneath(d_.root, std::string(file.dir), O_RDONLY | O_DIRECTORY));
  if (!file.dir.empty()) {
    CKPTFS_TRY(UniqueFd parent,
               open_beneath(d_.root, std::string(split_rel(file.dir).dir), O_RDONLY | O_DIRECTORY));
    CKPTFS_TRY(const bool done, fn(parent.get(), dir.get()));
    if (done) return true;
  }
  CKPTFS_TRY(auto entries, source::list_dir(dir.get()));
  size_t dirs = 0;
  for (const auto& e : entries) {
    if (!S_ISDIR(e.st.st_mode)) continue;
    if (++dirs > kMaxStoringDirs) {
      spdlog::warn(
          "{}: more than {} directories beside it; those after are not checked for "
          "links of it",
          what, kMaxStoringDirs);
      break;
    }
    auto below = open_at(dir.get(), e.name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW);
    if (!below) continue;
    CKPTFS_TRY(const bool done, fn(below->get(), dir.get()));
    if (done) return true;
  }
  return false;
}

Status WritePath::before_change(const std::string& rel, const struct stat& st) {
  const auto file = split_rel(rel);
  if (st.st_nlink < 2 || !format::looks_like_shard_name(file.name)) return {};
  // A consolidator's shards, which another directory may store its output as (write/dedup):
  // that stays as it is, whatever is written here now.
  const std::string name(file.name), what = source_path(rel);
  auto done = each_storing(rel, [&](int stored, int) -> Result<bool> {
    CKPTFS_CHECK(write::unshare_stored(stored, name, st, what));
    // Its other link was the one just copied: none left to look for.
    CKPTFS_TRY(const struct stat now, stat_beneath(d_.root, rel));
    return now.st_nlink < 2;
  });
  if (!done) return std::move(done).error();
  return {};
}

Result<bool> WritePath::detach_stored(const std::string& rel, const struct stat& st) {
  const auto file = split_rel(rel);
  if (st.st_nlink < 2 || !format::looks_like_shard_name(file.name)) return false;
  const std::string name(file.name), what = source_path(rel);
  return each_storing(rel, [&](int stored, int dir) {
    return write::detach_truncated(stored, dir, name, st, what);
  });
}

Status WritePath::before_truncate(const std::string& rel, const Key& key) {
  if (!format::looks_like_shard_name(split_rel(rel).name)) return {};  // no stat for the rest
  auto st = stat_beneath(d_.root, rel);
  if (!st || st->st_nlink < 2 || !(real_key(*st) == key)) return {};
  CKPTFS_TRY(const bool detached, detach_stored(rel, *st));
  if (!detached) return {};
  // The kernel opens the name again on ESTALE (with a fresh lookup): the new file.
  return make_error(ESTALE, "{}: a new file under its name now", source_path(rel));
}

std::optional<UniqueFd> WritePath::origin_of(const write::ResplitJob& job,
                                             std::string& display) const {
  switch (write::origin_of(job.dir.get(), job.dir_rel)) {
    case write::Origin::None:
      return std::nullopt;
    case write::Origin::Below: {
      auto fd = open_at(job.dir.get(), std::string(write::kOriginDir),
                        O_RDONLY | O_DIRECTORY | O_NOFOLLOW);
      if (!fd) return std::nullopt;
      display = fmt::format("{}/{}", job.dir_display, write::kOriginDir);
      return std::move(fd).value();
    }
    case write::Origin::Above: {
      // The directory above, beneath the root (the one path checker), and still the one whose
      // kConsolidatedDir the file's directory is (not moved since the close).
      const std::string above(split_rel(job.dir_rel).dir);
      auto fd = open_beneath(d_.root, above, O_RDONLY | O_DIRECTORY);
      struct stat a {
      }, b{};
      if (!fd ||
          ::fstatat(fd->get(), std::string(write::kConsolidatedDir).c_str(), &a,
                    AT_SYMLINK_NOFOLLOW) != 0 ||
          ::fstat(job.dir.get(), &b) != 0 || a.st_dev != b.st_dev || a.st_ino != b.st_ino) {
        return std::nullopt;
      }
      display = source_path(above);
      return std::move(fd).value();
    }
  }
  return std::nullopt;
}

Result<std::shared_ptr<write::WriteFile>> WritePath::start(UniqueFd fd, const WriteDir& d,
                                                           const std::string& name, bool fresh) {
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return make_error(errno, "stat failed");
  const DevIno key{static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino)};
  CKPTFS_CHECK(before_change(join_rel(d.rel, name), st));
  // The state registered under this number, unless it belongs to a file since unlinked
  // (committed, or removed while open) whose number this one reuses.
  if (auto wf = writes_.find(key.first, key.second); wf && wf->linked()) return wf;
  CKPTFS_TRY(auto wf, write::WriteFile::open(std::move(fd), d.fd, source_path(d.rel), fresh,
                                             d_.flusher, plan_options(d.fd, source_path(d.rel)),
                                             source_path(join_rel(d.rel, name)), &budget_));
  // The state another opener registered meanwhile, if any.
  return writes_.add(key, std::move(wf), DevIno{d.dev, d.ino}, format::looks_like_shard_name(name));
}

Result<std::shared_ptr<write::WriteFile>> WritePath::open(const Node& n, int flags) {
  std::string dir_rel, name;
  UniqueFd fd;
  bool fresh = (flags & O_TRUNC) != 0;
  if (n.kind == Kind::File) {
    const auto parts = split_rel(n.rel);
    dir_rel = std::string(parts.dir);
    name = std::string(parts.name);
  } else if (n.kind == Kind::Output && !n.view->ckpt->outputs[n.output].folder.empty()) {
    return make_error(EPERM, "{}: a LoRA adapter's file is made of the rank files; not written",
                      source_path(join_rel(n.rel, n.key.name)));
  } else if (n.kind == Kind::Output && (flags & O_TRUNC)) {
    // Replacing a consolidated file: a new file under its name, committed at close.
    dir_rel = n.rel;
    name = n.key.name;
  } else if (n.kind == Kind::Dir || n.kind == Kind::ShardsDir || n.kind == Kind::StatusDir ||
             n.kind == Kind::AdapterDir) {
    return make_error(EISDIR, "is a directory");
  } else if (n.kind == Kind::Pending || n.kind == Kind::StatusFile) {
    return make_error(EACCES, "{}: written by ckptfs only", n.key.name);
  } else if (n.kind == Kind::Output || n.kind == Kind::Index) {
    return make_error(EPERM,
                      "{}: a consolidated file is not changed in place; write it anew (O_TRUNC) "
                      "or write a new file and rename it over",
                      source_path(join_rel(n.rel, n.key.name)));
  } else {
    return make_error(EACCES, "special files cannot be opened through the view");
  }
  CKPTFS_TRY(UniqueFd dfd, open_beneath(d_.root, dir_rel, O_RDONLY | O_DIRECTORY));
  struct stat dst {};
  if (::fstat(dfd.get(), &dst) != 0) return make_error(errno, "stat failed");
  const WriteDir d{dfd.get(),
                   static_cast<uint64_t>(dst.st_dev),
                   static_cast<uint64_t>(dst.st_ino),
                   dir_rel,
                   dst.st_uid,
                   dst.st_gid};
  const int oflags = O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC;
  if (n.kind == Kind::File) {
    if (flags & O_TRUNC) CKPTFS_CHECK(before_truncate(n.rel, n.key));
    int raw = ::openat(d.fd, name.c_str(), oflags);
    if (raw < 0) return make_error(errno, "{}: {}", source_path(n.rel), std::strerror(errno));
    struct stat st {};
    CKPTFS_TRY(fd, require_regular(UniqueFd(raw), source_path(n.rel), &st));
    if (!(real_key(st) == n.key)) return make_error(ESTALE, "{}: replaced", n.rel);
    fresh = fresh || st.st_size == 0;
  } else {
    int raw = ::openat(d.fd, name.c_str(), oflags | O_CREAT | O_TRUNC, 0600);
    if (raw < 0) return make_error(errno, "{}: {}", source_path(n.rel), std::strerror(errno));
    fd.reset(raw);
    // The new version keeps the owner and mode of the one it replaces (its shards'), which
    // its own shards then take at commit.
    if (!n.view->inputs.empty()) {
      const Perm& p = n.view->inputs.front();
      if ((::geteuid() == 0 && ::fchown(raw, p.uid, p.gid) != 0) ||
          ::fchmod(raw, p.mode & 07777) != 0) {
        return make_error(errno, "{}: cannot keep the owner and mode: {}", source_path(n.rel),
                          std::strerror(errno));
      }
    }
    fresh = true;
  }
  CKPTFS_TRY(auto wf, start(std::move(fd), d, name, fresh));
  if (flags & O_TRUNC) CKPTFS_CHECK(wf->truncate(0));
  writes_.touched(d.dev, d.ino);
  return wf;
}

Status WritePath::settle(Ino ino, write::WriteFile& wf, const SettleFn& fn) {
  auto n = d_.nodes.get(ino);
  if (!n) return make_error(ESTALE, "unknown inode {}", ino);
  const bool real = n->kind == Kind::File;
  const auto parts = split_rel(n->rel);
  const std::string dir_rel = real ? std::string(parts.dir) : n->rel;
  const std::string name = real ? std::string(parts.name) : n->key.name;
  if (!wf.linked() && wf.state() != write::WriteFile::State::Committed) {
    // An orphan: its last name was unlinked or renamed over while it was open. As in a plain
    // directory, its close succeeds and its bytes go with it; what its old name holds now
    // (another file, another file's shards) is no business of it.
    return fn(wf, write::Place{-1, "", source_path(dir_rel), dir_rel});
  }
  auto dfd = open_beneath(d_.root, dir_rel, O_RDONLY | O_DIRECTORY);
  struct stat dst {};
  if (!dfd || ::fstat(dfd->get(), &dst) != 0) {
    // The directory is gone from where the file was: keep the bytes in the file itself.
    return fn(wf, write::Place{-1, "", source_path(dir_rel), dir_rel});
  }
  auto st =
      d_.nodes.dir_state(static_cast<uint64_t>(dst.st_dev), static_cast<uint64_t>(dst.st_ino));
  Status result;
  {
    std::unique_lock lock(st->mu);
    st->built.wait(lock, [&] { return !st->building; });
    result = fn(wf, write::Place{dfd->get(), name, source_path(dir_rel), dir_rel});
    st->next_check = d_.clock->now();
    if (result.ok()) {
      auto names = wf.stored_names();
      if (names.empty() && format::looks_like_shard_name(name)) names.push_back(name);
      writes_.produced(dfd->get(), names);
    }
  }
  writes_.touched(static_cast<uint64_t>(dst.st_dev), static_cast<uint64_t>(dst.st_ino));
  // A real file's node: its placeholder is gone; a consolidated file's: its version replaced.
  if (wf.state() == write::WriteFile::State::Committed) d_.nodes.retire(n->ino);
  if (notifier_ &&
      (wf.state() == write::WriteFile::State::Committed || format::parse_model_name(name))) {
    // The name now shows the consolidated file (committed, or still the older one when this
    // one was cut short and stays hidden behind it): the kernel's entry still holds the file
    // as it was being written.
    for (const auto& [parent, link] : n->links) notifier_->inval_entry(parent, link);
    // Before close() returns: an open of the name right after it must not find the entry
    // of the file as it was being written (its placeholder is gone: ENOENT).
    notifier_->sync(std::chrono::seconds(2));
  }
  return result;
}

Status WritePath::close(Ino ino, write::WriteFile& wf) {
  std::optional<write::ResplitJob> job;
  auto st = settle(ino, wf, [&](write::WriteFile& f, const write::Place& p) -> Status {
    auto done = f.finalize(
        p, p.dirfd < 0 ? write::StoreRules{} : checks_.rules(p.dirfd, p.dir_display, p.name));
    // Its split's stamp is expected from here, under the directory's lock: a chmod, chown or
    // utimens right after the close moves it on (attr_changed) rather than cancel the split.
    if ((job = f.take_resplit())) stamps_.expect(job->dev, job->ino, job->stamp);
    CKPTFS_CHECK(std::move(done));
    if (p.dirfd < 0) return {};
    auto why = f.stored_whole();
    if (!why) return {};
    CKPTFS_TRY(auto placed, checks_.place_whole(p.dirfd, p.dir_display, p.name, *why));
    if (placed == write::StoreChecks::Placed::AwaitsDataOverStored) drop_replaced(p);
    return {};
  });
  if (job) resplits_.post(std::move(*job));
  return st;
}

// A consolidator saving again wrote its header over a name that stores the first save's file
// (O_TRUNC) and closed it, to reopen it for the data: that version goes now, as a plain
// directory's O_TRUNC frees it. The name shows nothing to anyone else meanwhile (fs/namespace)
// and a reader that has it open loses it, as in a plain directory. Kept, it held the
// old rank shards alive through the new save (the rank shards its writer rewrote in
// `sharded/` get new files, since this name linked them), so the new data needed as many
// fresh pages again. Under the directory's lock (settle).
void WritePath::drop_replaced(const write::Place& p) {
  auto mn = format::parse_model_name(p.name);
  if (!mn) return;
  if (auto gone = d_.flusher.remove(flush::Target{p.dirfd, p.dir_display}, mn->k, mn->m); !gone) {
    // Left hidden in SRC as before this change: nothing the writer made is lost.
    spdlog::warn("{}/{}: the version its writer is replacing stays stored: {}", p.dir_display,
                 p.name, gone.error().message);
  }
}

void WritePath::run_resplit(write::ResplitJob& job) {
  if (d_.opts.split_gate) d_.opts.split_gate();
  // The stamp this split registered is forgotten however it ends (the commit takes it itself).
  struct Forget {
    SplitStamps& stamps;
    const write::ResplitJob& job;
    bool armed = true;
    ~Forget() {
      if (armed) stamps.take(job.dev, job.ino);
    }
  } forget{stamps_, job};
  // A consolidator's output is stored as links of the shards it was made from (write/dedup),
  // else split as the mount asks; with one rank there is nothing else to do, unless the
  // shards live on node-local targets.
  Result<std::optional<write::StagedResplit>> linked = std::optional<write::StagedResplit>{};
  std::string origin_display;
  if (auto origin = origin_of(job, origin_display)) {
    linked = write::stage_links(job, origin->get(), origin_display, d_.flusher);
  }
  if (!linked) spdlog::warn("{}: not stored as links: {}", job.what, linked.error().message);
  if ((!linked || !*linked) && job.set.shards.size() < 2 && d_.flusher.shards_in_place()) return;
  auto staged = linked && *linked ? Result<write::StagedResplit>(std::move(**linked))
                                  : write::stage_resplit(job, d_.flusher);
  if (!staged) {
    spdlog::warn("{}: stays stored as one shard: {}", job.what, staged.error().message);
    return;
  }
  struct stat dst {};
  if (::fstat(job.dir.get(), &dst) != 0) return;  // the staging goes with `staged`
  const auto dev = static_cast<uint64_t>(dst.st_dev), ino = static_cast<uint64_t>(dst.st_ino);
  auto st = d_.nodes.dir_state(dev, ino);
  {
    std::unique_lock lock(st->mu);
    st->built.wait(lock, [&] { return !st->building; });
    struct stat before {};
    const bool dated = ::fstat(job.dir.get(), &before) == 0;
    // The one shard as this daemon last left it: its close, or a chmod, chown or utimens since.
    forget.armed = false;
    job.stamp = stamps_.take(job.dev, job.ino).value_or(job.stamp);
    auto names = write::commit_resplit(job, std::move(staged).value());
    if (!names) {
      spdlog::warn("{}: stays stored as one shard: {}", job.what, names.error().message);
    } else if (!names->empty()) {
      // The split is the daemon's, not a change anyone made to the directory: it keeps the
      // mtime it had (the file's close, or a cp -a, tar x or rsync -a that set it since).
      const struct timespec ts[2] = {{0, UTIME_OMIT}, before.st_mtim};
      if (dated && ::futimens(job.dir.get(), ts) != 0) {
        spdlog::warn("{}: the directory's mtime could not be kept: {}", job.dir_display,
                     std::strerror(errno));
      }
      writes_.produced(job.dir.get(), *names);
      st->next_check = d_.clock->now();
    }
  }
  writes_.touched(dev, ino);
}

Status WritePath::fsync(Ino ino, write::WriteFile& wf, bool datasync) {
  return settle(ino, wf, [datasync](write::WriteFile& f, const write::Place& p) {
    return f.fsync(p, datasync);
  });
}

}  // namespace ckptfs::fs
