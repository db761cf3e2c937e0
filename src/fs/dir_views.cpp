// fs/dir_views: a checkpoint directory's View: checked (listed, stamped, settle timed) when its
// TTL passes, built from the shards' headers when its inputs change, and announced to the kernel.
#include <fcntl.h>
#include <sys/stat.h>

#include <algorithm>

#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include "ckptfs/format/names.hpp"
#include "ckptfs/util/path.hpp"
#include "impl.hpp"
#include "names.hpp"

namespace ckptfs::fs {

// At the first directory check (view_of, when_ready), so after a daemon's fork: a thread
// started before the fork does not exist in the daemon.
void DirViews::start() {
  std::call_once(started_, [this] {
    const CloseWatch::Factory make =
        d_.opts.close_watch ? d_.opts.close_watch : CloseWatch::Factory(inotify_close_watch);
    watcher_ = make([this](uint64_t dev, uint64_t ino) { on_close(dev, ino); });
    if (d_.opts.build_threads > 0) builders_ = std::make_unique<BuildPool>(d_.opts.build_threads);
  });
}

std::shared_ptr<const View> DirViews::make_view(std::shared_ptr<const layout::Checkpoint> ck,
                                                const std::string& rel, const struct stat& dst,
                                                const source::Signature& sig,
                                                const std::vector<source::DirEntry>& entries,
                                                bool settled) {
  auto v = std::make_shared<View>();
  v->ckpt = std::move(ck);
  v->generation = ++generations_;
  v->mtime_ns = std::max(sig.newest_mtime_ns, mtime_ns(dst));
  v->complete = (settled || v->ckpt->all_written()) && v->ckpt->valid();
  v->settling = !v->complete && !settled;
  if (v->settling) v->pending = pending_text(*v->ckpt, source_path(rel));
  v->rel = rel;
  v->records = std::any_of(sig.files.begin(), sig.files.end(), [](const auto& f) {
    return f.first.starts_with(std::string(format::kStateDirName) + "/");
  });
  v->dir_dev = static_cast<uint64_t>(dst.st_dev);
  v->dir_ino = static_cast<uint64_t>(dst.st_ino);
  for (const auto& e : entries) {
    if (source::is_input_entry(e) && !S_ISDIR(e.st.st_mode)) v->inputs.push_back(Perm::of(e.st));
  }
  // A folder the inputs are in (accelerate's): reaching them takes searching it. Last, so
  // that the first input is a file (a new version of a model file takes its owner and mode).
  for (const auto& e : entries) {
    if (source::is_input_entry(e) && S_ISDIR(e.st.st_mode)) {
      v->inputs.push_back(Perm::searching(e.st));
    }
  }
  // Every file whose bytes the view serves is an input, whatever named it (a .metadata names
  // its data files): its owner and mode as the build stat'ed it (a view serves bytes only
  // when valid). Node-local shards have no file here: theirs are their record's.
  for (const auto& sh : v->ckpt->shards) {
    if (!v->ckpt->valid() && !sh.remote()) continue;
    v->inputs.push_back(Perm{sh.access.uid, sh.access.gid,
                             static_cast<mode_t>(S_IFREG | (sh.access.mode & 07777))});
  }
  v->shown = shown_perm(v->inputs, dst.st_uid, dst.st_gid);
  return v;
}

// Returns the view of directory `rel` (null when it is no checkpoint), revalidating it when
// its TTL has passed. `dir_ino` is its FUSE inode, for invalidation. `mtime_out`, when
// given, receives the directory's shown mtime.
//
// Two phases. The check (list the directory, stat the inputs, time settle) is cheap and
// runs under the directory's lock. Reading the shards' headers can be slow (a hostile header
// is up to 100 MB), so only a Need::Current caller does it, with the lock released and
// `building` set (fs/builds.cpp: claim_locked, run_build): callers of other names and of
// attributes (Need::Any) never read a header and never wait; they get the previous view, or a
// placeholder that shows nothing consolidated yet. (The kernel serializes lookups of one name,
// so a header read during the lookup of the checkpoint directory itself would stall every
// path through it.) The FUSE adapter asks when_ready first, so that its workers neither build
// nor wait: a builder thread does, and the request is parked on the directory meanwhile.
std::shared_ptr<const View> DirViews::view_of(const std::string& rel, const struct stat& dst,
                                              Ino dir_ino, Need need, int64_t* mtime_out) {
  start();
  auto st =
      d_.nodes.dir_state(static_cast<uint64_t>(dst.st_dev), static_cast<uint64_t>(dst.st_ino));
  std::unique_lock lock(st->mu);
  if (need == Need::Current) st->built.wait(lock, [&] { return !st->building; });
  if (!st->building) check_locked(*st, rel, dst, dir_ino);
  if (mtime_out) *mtime_out = st->view ? st->mtime_ns : mtime_ns(dst);
  if (need == Need::Any || !st->needs_build) return st->view;

  BuildJob job = claim_locked(*st, rel, dir_ino);
  lock.unlock();
  Resumes resumes;
  std::shared_ptr<const View> v;
  try {
    v = run_build(st, job, resumes);
  } catch (...) {
    resume(resumes);  // the requests parked meanwhile are answered however the build ended
    throw;
  }
  resume(resumes);
  return v;
}

// The cheap phase of view_of, under the directory's lock: lists the directory when its TTL
// has passed, records its inputs and settle state, and updates the view where no header
// needs reading (no checkpoint any more, only the settle state changed, first sight).
void DirViews::check_locked(DirState& st, const std::string& rel, const struct stat& dst,
                            Ino dir_ino) {
  auto now = d_.clock->now();
  if (st.checked && now < st.next_check) return;
  const bool first = !st.checked;
  st.checked = true;
  st.next_check = now + d_.opts.revalidate;

  auto dirfd = open_beneath(d_.root, rel, O_RDONLY | O_DIRECTORY);
  if (!dirfd) return;  // vanished: open files keep their own views
  // Watched before it is listed: a shard closed after the listing is never missed.
  if (first && watcher_) {
    watcher_->watch(dirfd->get(), static_cast<uint64_t>(dst.st_dev),
                    static_cast<uint64_t>(dst.st_ino));
  }
  auto entries =
      source::list_checkpoint_dir(dirfd->get(), names::hidden_child(d_.opts.hide_rel, rel));
  if (!entries) return;
  if (!d_.opts.read_only &&
      std::any_of(entries->begin(), entries->end(), [](const source::DirEntry& e) {
        return names::is_state(e.name) && S_ISDIR(e.st.st_mode);
      })) {
    // What a crashed writer or daemon left: finish its commit, or drop its staging.
    if (d_.flusher.recover(flush::Target{dirfd->get(), source_path(rel)})) {
      auto again =
          source::list_checkpoint_dir(dirfd->get(), names::hidden_child(d_.opts.hide_rel, rel));
      if (!again) return;
      entries = std::move(again);
    }
  }
  std::shared_ptr<const View> old = st.view;
  if (!source::is_checkpoint_dir(dirfd->get(), *entries)) {
    st.entries.clear();
    st.sig = {};
    st.view_sig = {};
    st.needs_build = false;
    st.view = nullptr;
    if (old) changed(old, nullptr, dir_ino);
    return;
  }
  auto sig = source::signature_of(dirfd->get(), *entries);
  if (first) {
    for (const auto& [name, stamp] : sig.files) st.first_seen.emplace(name, stamp);
  }
  time_settle(st, rel, dst, sig, !old, now);
  st.mtime_ns = std::max(sig.newest_mtime_ns, mtime_ns(dst));
  st.entries = std::move(*entries);
  st.sig = std::move(sig);
  st.dst = dst;
  const bool built_from_these = old && st.view_sig == st.sig;
  st.needs_build = !built_from_these;
  const bool complete_now =
      built_from_these && (st.settled || old->ckpt->all_written()) && old->ckpt->valid();
  if (built_from_these &&
      (old->complete != complete_now || old->settling != (!complete_now && !st.settled))) {
    // Only the settle state changed: the same model, shown or hidden.
    auto v = make_view(old->ckpt, rel, dst, st.sig, st.entries, st.settled);
    st.view = v;
    announce(old, v, rel, dir_ino);
  } else if (!old) {
    // Until a reader needs the model: a checkpoint with nothing consolidated to show, so its
    // shard names stay hidden meanwhile.
    auto pending = std::make_shared<layout::Checkpoint>();
    pending->dir = source_path(rel);
    pending->problems.push_back({"", "", "shard headers not read yet"});
    st.view = make_view(std::move(pending), rel, dst, st.sig, st.entries, st.settled);
    drop_hidden_kids(dir_ino);
  }
}

// What a build found, in one line per checkpoint: a refusal names its first problems and
// how many more there are (ckptfs inspect lists them all), then the source layer's notes.
// A directory that keeps changing logs at most a few such lines a minute (logs).
void DirViews::log_build(const std::string& rel, const layout::Checkpoint& ck) {
  constexpr size_t kShown = 4;
  if (!ck.valid()) {
    if (auto v = logs_.allow("refused:" + rel); v.log) {
      std::string first;
      for (size_t i = 0; i < ck.problems.size() && i < kShown; ++i) {
        first += (i ? "; " : "") + ck.problems[i].to_string();
      }
      spdlog::error("{}: checkpoint not shown: {}{}{}", source_path(rel), first,
                    ck.problems.size() > kShown
                        ? fmt::format("; and {} more problem(s) (ckptfs inspect lists them)",
                                      ck.problems.size() - kShown)
                        : std::string(),
                    v.suppressed ? fmt::format(" ({} earlier refusal(s) not logged)", v.suppressed)
                                 : std::string());
    }
  }
  for (const auto& note : ck.notes) {
    if (auto v = logs_.allow("note:" + rel); v.log) spdlog::warn("{}", note);
  }
  if (ck.unmapped_native()) {
    if (auto v = logs_.allow("unmapped:" + rel); v.log) {
      spdlog::warn(
          "{}: served under its stored names, a trainer's own ('{}'), with no config.json: no "
          "model map fits ({}); give -o map=PATH (docs/maps.md) and, if it needs one, "
          "-o hf_config=PATH",
          source_path(rel), ck.native_name, fmt::join(ck.map_trials, "; "));
    }
  }
}

void DirViews::announce(const std::shared_ptr<const View>& old,
                        const std::shared_ptr<const View>& now, const std::string& rel,
                        Ino dir_ino) {
  if (now->complete) {
    spdlog::info("{}: serving {} consolidated file(s), {} tensors", source_path(rel),
                 now->ckpt->outputs.size(), now->ckpt->tensors.size());
  }
  changed(old, now, dir_ino);
}

// Tells the kernel to drop what it may cache of the previous version of directory `dir_ino`:
// the consolidated names `old` showed (their inodes belong to that version) and the
// directory's attributes. Names only `now` shows need nothing: before, they answered ENOENT,
// which is not cached. Dropping them would even hurt: the build often runs in the lookup of
// one of them, and an entry dropped right after that lookup takes the new inode and its page
// cache with it once the file is closed.
void DirViews::changed(const std::shared_ptr<const View>& old,
                       const std::shared_ptr<const View>& now, Ino dir_ino) {
  if (!notifier_ || old == now) return;
  if (old && old->complete) {
    for (const auto& o : old->ckpt->outputs) {
      if (o.folder.empty()) notifier_->inval_entry(dir_ino, o.name);
    }
    notifier_->inval_entry(dir_ino, std::string(format::kIndexFileName));
    if (old->ckpt->adapter) notifier_->inval_entry(dir_ino, old->ckpt->adapter->dir);
    if (!old->ckpt->config_json.empty()) notifier_->inval_entry(dir_ino, std::string(kConfigName));
  }
  if (old && old->settling) notifier_->inval_entry(dir_ino, std::string(names::kPending));
  notifier_->inval_inode(dir_ino);
}

// A directory just became a checkpoint: real names the kernel may cache under it that the
// view now hides (a real model.safetensors, a shard) must go, or they would stay reachable.
void DirViews::drop_hidden_kids(Ino dir_ino) {
  if (!notifier_) return;
  std::vector<std::string> gone;
  d_.nodes.for_each_kid(dir_ino, [&](const std::string& name, const Node*) {
    if (names::hidden_in_checkpoint(name)) gone.push_back(name);
  });
  for (const auto& name : gone) notifier_->inval_entry(dir_ino, name);
}

void DirViews::invalidate_all() {
  for (auto& s : d_.nodes.dirs()) {
    std::lock_guard lock(s->mu);
    s->next_check = d_.clock->now();
  }
}

void DirViews::recheck(uint64_t dev, uint64_t ino) {
  auto st = d_.nodes.dir_state(dev, ino);
  std::lock_guard lock(st->mu);
  st->next_check = d_.clock->now();
}

}  // namespace ckptfs::fs
