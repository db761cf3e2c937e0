// fs/write_registry: the files open for writing, and the evidence of this daemon's own changes.
#include "write_registry.hpp"

#include <fcntl.h>
#include <sys/stat.h>

namespace ckptfs::fs {

std::shared_ptr<write::WriteFile> WriteRegistry::find(uint64_t dev, uint64_t ino) {
  std::lock_guard lock(mu_);
  auto it = writes_.find({dev, ino});
  if (it == writes_.end()) return nullptr;
  auto wf = it->second.wf.lock();
  if (!wf) writes_.erase(it);
  return wf;
}

std::shared_ptr<write::WriteFile> WriteRegistry::add(DevIno key,
                                                     std::shared_ptr<write::WriteFile> wf,
                                                     DevIno dir, bool shard_named) {
  std::lock_guard lock(mu_);
  auto& w = writes_[key];
  if (auto other = w.wf.lock(); other && other->linked()) return other;  // opened meanwhile
  w = Writing{wf, dir, shard_named};
  return wf;
}

bool WriteRegistry::open_in(DevIno dir) const {
  std::lock_guard lock(mu_);
  for (const auto& [key, w] : writes_) {
    if (w.dir == dir && !w.wf.expired()) return true;
  }
  return false;
}

size_t WriteRegistry::open_files() const {
  size_t n = 0;
  std::lock_guard lock(mu_);
  for (const auto& [k, w] : writes_) n += w.wf.expired() ? 0 : 1;
  return n;
}

void WriteRegistry::touched(uint64_t dev, uint64_t ino) {
  std::lock_guard lock(mu_);
  if (touched_ns_.size() > 4096) touched_ns_.clear();  // only recent changes matter
  touched_ns_[{dev, ino}] = clock_->realtime_ns();
}

void WriteRegistry::produced(int dirfd, const std::vector<std::string>& names) {
  std::vector<StampKey> keys;
  for (const auto& n : names) {
    struct stat st {};
    if (::fstatat(dirfd, n.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) {
      keys.push_back(stamp_key(source::stamp_of(st)));
    }
  }
  std::lock_guard lock(mu_);
  if (produced_.size() > 65536) produced_.clear();  // only recent writes matter
  produced_.insert(keys.begin(), keys.end());
}

bool WriteRegistry::quiet_by_us(uint64_t dev, uint64_t ino, int64_t changed_ns,
                                const source::Signature& sig) {
  std::vector<std::shared_ptr<write::WriteFile>> seen;  // released after the lock
  std::lock_guard lock(mu_);
  auto t = touched_ns_.find({dev, ino});
  if (t == touched_ns_.end() || changed_ns > t->second) return false;
  for (const auto& [name, stamp] : sig.files) {
    if (!produced_.count(stamp_key(stamp))) return false;
  }
  for (auto it = writes_.begin(); it != writes_.end();) {
    auto wf = it->second.wf.lock();
    if (!wf) {
      it = writes_.erase(it);
      continue;
    }
    // A consolidated file being written changes nothing shown until its commit, which is
    // atomic; a rank shard written in place (a DCP save) does.
    const bool busy = it->second.dir == DevIno{dev, ino} && it->second.shard_named && wf->dirty();
    seen.push_back(std::move(wf));
    if (busy) return false;
    ++it;
  }
  return true;
}

}  // namespace ckptfs::fs
