// source/watcher: inotify close-write evidence for the settle rules.
#include "ckptfs/source/watcher.hpp"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/inotify.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <vector>

#include <spdlog/spdlog.h>

namespace ckptfs::source {
namespace {

constexpr size_t kMaxNamesPerDir = 1 << 16;

int64_t realtime_ns() {
  struct timespec ts {};
  ::clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

}  // namespace

std::unique_ptr<CloseWatcher> CloseWatcher::create(OnClose on_close, size_t max_dirs) {
  UniqueFd in(::inotify_init1(IN_NONBLOCK | IN_CLOEXEC));
  if (!in.valid()) {
    spdlog::warn("inotify unavailable ({}): checkpoints show after the settle time only",
                 std::strerror(errno));
    return nullptr;
  }
  UniqueFd wake(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (!wake.valid()) return nullptr;
  return std::unique_ptr<CloseWatcher>(
      new CloseWatcher(std::move(in), std::move(wake), std::move(on_close), max_dirs));
}

CloseWatcher::CloseWatcher(UniqueFd inotify, UniqueFd wake, OnClose on_close, size_t max_dirs)
    : inotify_(std::move(inotify)),
      wake_(std::move(wake)),
      on_close_(std::move(on_close)),
      max_dirs_(max_dirs),
      thread_([this] { run(); }) {}

CloseWatcher::~CloseWatcher() {
  uint64_t one = 1;
  if (::write(wake_.get(), &one, sizeof one) != sizeof one) {
    spdlog::error("cannot stop the inotify thread: {}", std::strerror(errno));
  }
  thread_.join();
}

bool CloseWatcher::watch(int dirfd, uint64_t dev, uint64_t ino) {
  std::lock_guard lock(mu_);
  if (by_id_.count({dev, ino})) return true;
  if (dirs_.size() >= max_dirs_) return false;
  // inotify takes a path: the directory's own fd, through /proc, so no name is resolved twice.
  const std::string path = "/proc/self/fd/" + std::to_string(dirfd);
  const int wd =
      ::inotify_add_watch(inotify_.get(), path.c_str(), IN_CLOSE_WRITE | IN_MODIFY | IN_ONLYDIR);
  if (wd < 0) {
    spdlog::debug("inotify watch of directory {}:{} failed: {}", dev, ino, std::strerror(errno));
    return false;
  }
  // The kernel gives the same descriptor for the same inode: a directory renamed away and
  // back, or one whose old identity was dropped.
  auto& d = dirs_[wd];
  if (d.dev != dev || d.ino != ino) {
    by_id_.erase({d.dev, d.ino});
    d = Dir{dev, ino, {}};
  }
  by_id_[{dev, ino}] = wd;
  return true;
}

bool CloseWatcher::closed(uint64_t dev, uint64_t ino, const std::string& name,
                          int64_t mtime_ns) const {
  std::lock_guard lock(mu_);
  auto w = by_id_.find({dev, ino});
  if (w == by_id_.end()) return false;
  auto d = dirs_.find(w->second);
  if (d == dirs_.end()) return false;
  auto f = d->second.files.find(name);
  if (f == d->second.files.end()) return false;
  return !f->second.dirty && f->second.closed_ns >= mtime_ns;
}

size_t CloseWatcher::watched() const {
  std::lock_guard lock(mu_);
  return dirs_.size();
}

void CloseWatcher::run() {
  pollfd fds[2] = {{inotify_.get(), POLLIN, 0}, {wake_.get(), POLLIN, 0}};
  while (true) {
    int n = ::poll(fds, 2, -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      spdlog::error("inotify poll failed: {}", std::strerror(errno));
      return;
    }
    if (fds[1].revents) return;
    if (fds[0].revents) drain();
  }
}

void CloseWatcher::drain() {
  alignas(inotify_event) char buf[64 * 1024];
  std::vector<std::pair<uint64_t, uint64_t>> closed_in;
  while (true) {
    ssize_t n = ::read(inotify_.get(), buf, sizeof buf);
    if (n <= 0) break;  // EAGAIN: drained
    const int64_t now = realtime_ns();
    std::lock_guard lock(mu_);
    for (ssize_t off = 0; off < n;) {
      const auto* ev = reinterpret_cast<const inotify_event*>(buf + off);
      off += static_cast<ssize_t>(sizeof(inotify_event) + ev->len);
      if (ev->mask & IN_Q_OVERFLOW) {
        // Events were lost: nothing recorded can be trusted any more.
        spdlog::warn("inotify queue overflow: close evidence dropped, settle time applies");
        for (auto& [wd, d] : dirs_) d.files.clear();
        continue;
      }
      auto it = dirs_.find(ev->wd);
      if (it == dirs_.end()) continue;
      if (ev->mask & IN_IGNORED) {  // the directory is gone, or the watch was removed
        by_id_.erase({it->second.dev, it->second.ino});
        dirs_.erase(it);
        continue;
      }
      if (ev->len == 0) continue;
      std::string name(ev->name, ::strnlen(ev->name, ev->len));
      auto& files = it->second.files;
      if (files.size() >= kMaxNamesPerDir && !files.count(name)) files.clear();
      auto& f = files[name];
      if (ev->mask & IN_MODIFY) f.dirty = true;
      if (ev->mask & IN_CLOSE_WRITE) {
        f.dirty = false;
        f.closed_ns = now;
        closed_in.emplace_back(it->second.dev, it->second.ino);
      }
    }
  }
  for (const auto& [dev, ino] : closed_in) on_close_(dev, ino);
}

}  // namespace ckptfs::source
