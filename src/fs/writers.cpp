// Which processes are writing where (the writer's view of a checkpoint directory).
#include "ckptfs/fs/writers.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace ckptfs::fs {
namespace {

// Bounds: directories remembered, and writers per directory (expired ones go first).
constexpr size_t kMaxDirs = 4096;
constexpr size_t kMaxProcs = 256;

}  // namespace

WriterViews::WriterViews(Clock::duration window, Now now, ProcessOf process_of)
    : window_(window),
      retain_(std::max<Clock::duration>(window, std::chrono::hours(1))),
      now_(std::move(now)),
      process_of_(std::move(process_of)) {}

pid_t WriterViews::process_of_tid(pid_t tid) {
  if (tid <= 0) return 0;
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/status", static_cast<int>(tid));
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  char buf[2048];
  const ssize_t n = ::read(fd, buf, sizeof buf - 1);
  ::close(fd);
  if (n <= 0) return 0;
  buf[n] = '\0';
  const char* t = std::strstr(buf, "\nTgid:");
  return t ? static_cast<pid_t>(std::strtol(t + 6, nullptr, 10)) : 0;
}

void WriterViews::note(DirId dir, std::optional<DirId> parent, pid_t tid) {
  if (window_ == Clock::duration::zero()) return;
  const pid_t proc = process_of_(tid);
  if (proc <= 0) return;
  const auto t = now_();
  std::lock_guard lock(mu_);
  if (dirs_.size() >= kMaxDirs) prune(t);
  if (dirs_.size() < kMaxDirs || dirs_.count(dir)) mark(dirs_[dir].own, proc, t);
  if (parent && (dirs_.size() < kMaxDirs || dirs_.count(*parent))) {
    mark(dirs_[*parent].children, proc, t);
  }
}

void WriterViews::mark(Procs& procs, pid_t proc, Clock::time_point t) {
  if (procs.size() >= kMaxProcs && !procs.count(proc)) {
    std::erase_if(procs, [&](const auto& p) { return t - p.second > retain_; });
    if (procs.size() >= kMaxProcs) return;  // full of live writers: this one is forgotten
  }
  procs[proc] = t;
}

const WriterViews::Marks* WriterViews::find(DirId d) const {
  auto it = dirs_.find(d);
  return it == dirs_.end() ? nullptr : &it->second;
}

bool WriterViews::has(const Procs* procs, pid_t proc, Clock::time_point now) const {
  if (!procs) return false;
  auto p = procs->find(proc);
  return p != procs->end() && now - p->second <= window_;
}

bool WriterViews::any_live(const Procs* procs, Clock::time_point now) const {
  if (!procs) return false;
  for (const auto& [proc, t] : *procs) {
    if (now - t <= window_) return true;
  }
  return false;
}

bool WriterViews::any(DirId dir, std::optional<DirId> parent) {
  if (window_ == Clock::duration::zero()) return false;
  const auto t = now_();
  std::lock_guard lock(mu_);
  const Marks* d = find(dir);
  const Marks* p = parent ? find(*parent) : nullptr;
  return (d && (any_live(&d->own, t) || any_live(&d->children, t))) || (p && any_live(&p->own, t));
}

bool WriterViews::sees_written(DirId dir, std::optional<DirId> parent, pid_t tid) {
  if (!any(dir, parent)) return false;
  const pid_t proc = process_of_(tid);
  if (proc <= 0) return false;
  const auto t = now_();
  std::lock_guard lock(mu_);
  const Marks* d = find(dir);
  if (!d || (!d->own.count(proc) && !d->children.count(proc))) return false;  // never wrote here
  const Marks* p = parent ? find(*parent) : nullptr;
  return has(&d->own, proc, t) || has(&d->children, proc, t) || (p && has(&p->own, proc, t));
}

void WriterViews::prune(Clock::time_point now) {
  auto stale = [&](const auto& p) { return now - p.second > retain_; };
  for (auto it = dirs_.begin(); it != dirs_.end();) {
    std::erase_if(it->second.own, stale);
    std::erase_if(it->second.children, stale);
    it = it->second.own.empty() && it->second.children.empty() ? dirs_.erase(it) : std::next(it);
  }
}

}  // namespace ckptfs::fs
