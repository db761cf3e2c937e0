// fs/liveness: whether a checkpoint directory has settled (quiet long enough, every shard at rest
// or closed by its writer, or all of it written by this daemon), and waiting until it has.
#include <sys/stat.h>

#include <algorithm>
#include <chrono>

#include <spdlog/spdlog.h>

#include "ckptfs/util/path.hpp"
#include "impl.hpp"

namespace ckptfs::fs {
namespace {

int64_t saturating_sub(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_sub_overflow(a, b, &r)) return b < 0 ? INT64_MAX : INT64_MIN;
  return r;
}

}  // namespace

// Times settle for directory `rel` (stat `dst`) whose inputs are now `sig`, as checked at `now`
// under the directory's lock: sets st.settled, and st.next_check to when it may have settled.
// `fresh`: the directory had no view yet.
void DirViews::time_settle(DirState& st, const std::string& rel, const struct stat& dst,
                           const source::Signature& sig, bool fresh, Clock::TimePoint now) {
  // Settle: quiet since the newest change of any shard (written: mtime; moved in: ctime)
  // and of the directory (created or renamed into place). Stamps can lie (clock skew, a
  // future mtime): the daemon's own observation counts too, so a checkpoint whose stamps
  // say "in the future" shows once nothing changed for `settle` while the daemon watched.
  const int64_t changed_ns = std::max({sig.newest_change_ns, mtime_ns(dst), ctime_ns(dst)});
  if (!(sig == st.sig) || changed_ns != st.changed_ns || fresh) st.seen_since = now;
  st.changed_ns = changed_ns;
  const int64_t stamp_age = saturating_sub(d_.clock->realtime_ns(), changed_ns);
  if (stamp_age < -kNsPerSec && !st.skew_logged) {
    st.skew_logged = true;
    spdlog::warn(
        "{}: shard or directory times lie {} s in the future (clock skew?); settle is timed "
        "from when the daemon saw them",
        source_path(rel), -stamp_age / kNsPerSec);
  }
  const int64_t seen_age =
      std::chrono::duration_cast<std::chrono::nanoseconds>(now - st.seen_since).count();
  const int64_t quiet_ns = std::max(stamp_age, seen_age);
  const int64_t settle_ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(d_.opts.settle).count();
  st.settled =
      quiet_ns >= settle_ns ||
      d_.writes.quiet_by_us(static_cast<uint64_t>(dst.st_dev), static_cast<uint64_t>(dst.st_ino),
                            changed_ns, sig) ||
      at_rest(st, static_cast<uint64_t>(dst.st_dev), static_cast<uint64_t>(dst.st_ino), sig);
  if (!st.settled) {
    st.next_check = std::min(st.next_check, now + std::chrono::nanoseconds(settle_ns - quiet_ns));
  }
}

// Whether every shard of directory (dev, ino) is at rest: unchanged since the daemon first
// looked at the directory, or closed by its writer since its last change (inotify). Commit
// records and the mapping file (names with a '/') need no such evidence: the first is renamed
// into place whole, the second is proven whole by parsing.
bool DirViews::at_rest(const DirState& st, uint64_t dev, uint64_t ino,
                       const source::Signature& sig) const {
  bool any = false;
  for (const auto& [name, stamp] : sig.files) {
    if (name.find('/') != std::string::npos) continue;
    any = true;
    auto f = st.first_seen.find(name);
    if (f != st.first_seen.end() && f->second == stamp) continue;
    if (watcher_ && watcher_->closed(dev, ino, name, stamp.mtime_ns)) continue;
    return false;
  }
  return any;
}

// The content of names::kPending: why a checkpoint directory shows no consolidated file yet.
std::string DirViews::pending_text(const layout::Checkpoint& ck, const std::string& dir) const {
  const double settle_s = std::chrono::duration<double>(d_.opts.settle).count();
  std::string t = fmt::format("{}: not shown yet.\n", dir);
  if (ck.valid()) {
    t += fmt::format(
        "Its shards are complete, but they changed less than {} s ago and the close of every "
        "shard's writer was not seen. It is shown once each shard is closed, or after {} s "
        "without changes.\n",
        settle_s, settle_s);
    return t;
  }
  t += fmt::format(
      "Incomplete so far (it is shown once every shard is complete and closed, or quiet for "
      "{} s):\n",
      settle_s);
  size_t n = 0;
  for (const auto& p : ck.problems) {
    if (++n > 32) {
      t += fmt::format("  ... and {} more\n", ck.problems.size() - 32);
      break;
    }
    t += "  " + p.to_string() + "\n";
  }
  return t;
}

// A writer closed a file of directory (dev, ino): check it again now, and wake lookups
// waiting for it to settle. Runs on the watcher_'s thread.
void DirViews::on_close(uint64_t dev, uint64_t ino) {
  std::shared_ptr<DirState> st = d_.nodes.find_dir(dev, ino);
  if (!st) return;
  {
    std::lock_guard lock(st->mu);
    st->next_check = d_.clock->now();
  }
  st->built.notify_all();
}

// A consolidated name was looked up while its checkpoint settles: rather than answer ENOENT
// at once, wait (at most the settle time) until it is shown or stops settling. Woken early
// by a writer's close; otherwise rechecks when the settle time would have passed.
std::shared_ptr<const View> DirViews::wait_settled(const Node& dir, std::shared_ptr<const View> v) {
  if (!v || !v->settling) return v;
  const auto deadline = d_.clock->now() + d_.opts.settle + std::chrono::milliseconds(50);
  auto st = d_.nodes.dir_state(v->dir_dev, v->dir_ino);
  while (v && v->settling) {
    const auto now = d_.clock->now();
    if (now >= deadline) break;
    {
      std::unique_lock lock(st->mu);
      auto until = std::clamp(st->next_check, now + std::chrono::milliseconds(10), deadline);
      d_.clock->wait_until(st->built, lock, until, [&] { return st->view != v && !st->building; });
    }
    auto dst = stat_beneath(d_.root, dir.rel);
    if (!dst) break;
    v = view_of(dir.rel, *dst, dir.ino, Need::Current);
  }
  return v;
}

}  // namespace ckptfs::fs
