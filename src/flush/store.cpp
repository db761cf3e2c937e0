// flush/store: one rank's shard storage under its target directory (ShardStore, see
// ckptfs/flush/store.hpp): staged and node-local shards, sealing, reads, drop and sweep.
#include "ckptfs/flush/store.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "ckptfs/flush/flusher.hpp"
#include "ckptfs/format/record.hpp"
#include "ckptfs/source/scanner.hpp"
#include "ckptfs/util/path.hpp"

namespace ckptfs::flush {
namespace {

constexpr size_t kMaxCachedFds = 64;
constexpr int kMaxSweepDepth = 64;
const std::string kState(format::kStateDirName);

// Opens directory `name` under `parent`, making it first if it is missing; never follows a
// symlink, so a path from the head stays below the target.
Result<UniqueFd> make_dir(int parent, const std::string& name, mode_t mode) {
  if (::mkdirat(parent, name.c_str(), mode) != 0 && errno != EEXIST) {
    return errno_error(fmt::format("{}: cannot create", name));
  }
  return open_at(parent, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW);
}

Status fsync_dir(int fd, std::string_view what) {
  if (::fsync(fd) != 0) return errno_error(fmt::format("{}: fsync failed", what));
  return {};
}

}  // namespace

Result<std::unique_ptr<ShardStore>> ShardStore::open(const std::string& root_path) {
  CKPTFS_TRY(UniqueFd fd, open_file(root_path, O_RDONLY | O_DIRECTORY));
  return std::unique_ptr<ShardStore>(new ShardStore(std::move(fd), root_path));
}

std::string ShardStore::show(std::string_view rel) const {
  return rel.empty() ? root_path_ : fmt::format("{}/{}", root_path_, rel);
}

std::shared_ptr<ShardStore::Held> ShardStore::find(uint64_t tx, uint32_t shard) {
  std::lock_guard lock(mu_);
  auto it = held_.find({tx, shard});
  return it == held_.end() ? nullptr : it->second;
}

Status ShardStore::open_staged(uint64_t tx, uint32_t shard, std::string_view rel) {
  auto fd = open_beneath(root_.get(), rel, O_RDWR | O_NOFOLLOW);
  if (!fd) return std::move(fd).error().context(root_path_);
  struct stat st {};
  if (::fstat(fd->get(), &st) != 0 || !S_ISREG(st.st_mode)) {
    return make_error(EINVAL, "{}: not a regular file", show(rel));
  }
  auto h = std::make_shared<Held>();
  h->fd = std::move(fd).value();
  h->path = std::string(rel);
  std::lock_guard lock(mu_);
  held_[{tx, shard}] = std::move(h);
  return {};
}

Status ShardStore::create(uint64_t tx, std::string_view txname, uint32_t shard,
                          std::string_view rel, uint64_t size) {
  if (!txname.starts_with(kNodeLocalTxPrefix) || !is_valid_component(txname)) {
    return make_error(EINVAL, "'{}' is not a node-local transaction name", txname);
  }
  CKPTFS_TRY(auto parts, components_of(rel));
  CKPTFS_TRY(UniqueFd dir, open_at(root_.get(), ".", O_RDONLY | O_DIRECTORY));
  std::string at;
  for (const auto& c : parts) {
    at = join_rel(at, c);
    auto next = make_dir(dir.get(), c, 0755);
    if (!next) return make_error(next.error().code, "{}: {}", show(at), next.error().message);
    dir = std::move(next).value();
  }
  at = join_rel(at, kState);
  CKPTFS_TRY(UniqueFd state, make_dir(dir.get(), kState, 0700));
  at = join_rel(at, txname);
  CKPTFS_TRY(UniqueFd txdir, make_dir(state.get(), std::string(txname), 0700));
  const std::string name = fmt::format("rank-{:05d}", shard + 1);
  const std::string path = join_rel(at, name);
  auto fd = open_at(txdir.get(), name, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW, 0600);
  if (!fd) return make_error(fd.error().code, "{}: {}", show(path), fd.error().message);
  if (::ftruncate(fd->get(), static_cast<off_t>(size)) != 0) {
    return errno_error(fmt::format("{}: cannot size the shard", show(path)));
  }
  auto h = std::make_shared<Held>();
  h->fd = std::move(fd).value();
  h->path = path;
  h->created = true;
  std::lock_guard lock(mu_);
  held_[{tx, shard}] = std::move(h);
  return {};
}

Status ShardStore::write(uint64_t tx, uint32_t shard, uint64_t off, std::string_view bytes) {
  auto h = find(tx, shard);
  if (!h) return {};  // aborted meanwhile: dropped
  std::optional<Error> fault;
  {
    std::lock_guard lock(mu_);
    written_ += bytes.size();
    if (fault_after_ && written_ > *fault_after_) {
      fault = make_error(ENOSPC, "{}: No space left on device (-o mpi_fault)", show(h->path));
    }
  }
  std::lock_guard lock(h->mu);
  if (!h->err && fault) h->err = std::move(fault);
  if (!h->err) {
    if (auto st = pwrite_all(h->fd.get(), bytes.data(), bytes.size(), off, show(h->path)); !st) {
      h->err = std::move(st).error();
    }
  }
  if (h->err) return *h->err;
  return {};
}

Status ShardStore::read(uint64_t tx, uint32_t shard, uint64_t off, char* dst, size_t n) {
  auto h = find(tx, shard);
  if (!h) return make_error(EIO, "shard {} of transaction {} is not open here", shard + 1, tx);
  {
    std::lock_guard lock(h->mu);
    // A shard whose write failed has holes: never hand them out as its bytes.
    if (h->err) return *h->err;
  }
  return pread_exact(h->fd.get(), dst, n, off, show(h->path));
}

Status ShardStore::sync(uint64_t tx) {
  std::vector<std::shared_ptr<Held>> hs;
  {
    std::lock_guard lock(mu_);
    for (auto it = held_.lower_bound({tx, 0}); it != held_.end() && it->first.first == tx; ++it) {
      hs.push_back(it->second);
    }
  }
  for (const auto& h : hs) {
    std::lock_guard lock(h->mu);
    if (!h->err && ::fsync(h->fd.get()) != 0) {
      h->err = errno_error(show(h->path) + ": fsync failed");
    }
    if (h->err) return *h->err;
  }
  return {};
}

Result<std::string> ShardStore::seal(uint64_t tx, uint32_t shard, std::string_view name) {
  auto h = find(tx, shard);
  if (!h || !h->created) {
    return make_error(EIO, "shard {} of transaction {} is not a node-local shard held here",
                      shard + 1, tx);
  }
  if (!is_valid_component(name)) return make_error(EINVAL, "'{}' is not a plain name", name);
  {
    std::lock_guard lock(h->mu);
    if (!h->err && ::fsync(h->fd.get()) != 0) {
      h->err = errno_error(show(h->path) + ": fsync failed");
    }
    if (h->err) return *h->err;
  }
  const RelParts sp = split_rel(h->path);  // a created shard's path always has a directory
  const std::string dir(sp.dir);
  const std::string from(sp.name);
  CKPTFS_TRY(UniqueFd txdir, open_beneath(root_.get(), dir, O_RDONLY | O_DIRECTORY));
  if (from != name &&
      ::renameat(txdir.get(), from.c_str(), txdir.get(), std::string(name).c_str()) != 0) {
    return errno_error(fmt::format("{}: cannot name it {}", show(h->path), name));
  }
  const std::string sealed = join_rel(dir, name);
  h->path = sealed;
  // The name and every directory above it, up to the root, made durable.
  CKPTFS_CHECK(fsync_dir(txdir.get(), show(dir)));
  for (std::string d = dir; !d.empty();) {
    d = std::string(split_rel(d).dir);
    CKPTFS_TRY(UniqueFd fd, d.empty() ? open_at(root_.get(), ".", O_RDONLY | O_DIRECTORY)
                                      : open_beneath(root_.get(), d, O_RDONLY | O_DIRECTORY));
    CKPTFS_CHECK(fsync_dir(fd.get(), show(d)));
  }
  return sealed;
}

void ShardStore::forget(uint64_t tx, bool remove) {
  std::vector<std::shared_ptr<Held>> hs;
  {
    std::lock_guard lock(mu_);
    auto first = held_.lower_bound({tx, 0});
    auto last = held_.upper_bound({tx, UINT32_MAX});
    for (auto it = first; it != last; ++it) hs.push_back(it->second);
    held_.erase(first, last);
  }
  if (!remove) return;
  std::set<std::string> dirs;
  for (const auto& h : hs) {
    if (h->created) dirs.insert(std::string(split_rel(h->path).dir));
  }
  hs.clear();  // descriptors closed before their directory goes
  for (const auto& d : dirs) {
    if (auto st = drop(d); !st) spdlog::warn("{}", st.error().message);
  }
}

void ShardStore::close(uint64_t tx) { forget(tx, false); }
void ShardStore::abort(uint64_t tx) { forget(tx, true); }

Status ShardStore::read_path(std::string_view path, uint64_t size, uint64_t off, char* dst,
                             size_t n) {
  if (path.empty() || !is_safe_rel(path)) {
    return make_error(EINVAL, "'{}' is not a plain relative path", path);
  }
  auto st = stat_beneath(root_.get(), path);
  if (!st) return make_error(st.error().code, "{}: {}", show(path), st.error().message);
  if (!S_ISREG(st->st_mode)) return make_error(EIO, "{}: not a regular file", show(path));
  if (static_cast<uint64_t>(st->st_size) != size) {
    return make_error(ESTALE, "{}: {} bytes, its commit record says {} (changed outside ckptfs)",
                      show(path), st->st_size, size);
  }
  if (off > size || n > size - off) {
    return make_error(EIO, "{}: read of {} bytes at {} past its end ({})", show(path), n, off,
                      size);
  }
  const auto dev = static_cast<uint64_t>(st->st_dev), ino = static_cast<uint64_t>(st->st_ino);
  std::shared_ptr<const UniqueFd> fd;  // stays open while it is read, even if evicted
  {
    std::lock_guard lock(mu_);
    if (auto it = cache_.find(path); it != cache_.end()) {
      if (it->second.dev == dev && it->second.ino == ino && it->second.size == size) {
        lru_.splice(lru_.begin(), lru_, it->second.lru);
        fd = it->second.fd;
      } else {
        lru_.erase(it->second.lru);
        cache_.erase(it);
      }
    }
  }
  if (!fd) {
    struct stat fst {};
    auto opened = open_regular_beneath(root_.get(), path, Resolve::Auto, &fst);
    if (!opened) {
      return make_error(opened.error().code, "{}: {}", show(path), opened.error().message);
    }
    if (static_cast<uint64_t>(fst.st_dev) != dev || static_cast<uint64_t>(fst.st_ino) != ino) {
      return make_error(ESTALE, "{}: replaced while being opened", show(path));
    }
    fd = std::make_shared<const UniqueFd>(std::move(opened).value());
    std::lock_guard lock(mu_);
    if (!cache_.count(path)) {
      lru_.emplace_front(path);
      cache_.emplace(std::string(path), Cached{fd, dev, ino, size, lru_.begin()});
      while (cache_.size() > kMaxCachedFds) {
        cache_.erase(lru_.back());
        lru_.pop_back();
      }
    }
  }
  return pread_exact(fd->get(), dst, n, off, show(path));
}

Status ShardStore::drop(std::string_view path) {
  CKPTFS_TRY(auto parts, components_of(path));
  if (parts.size() < 2 || parts[parts.size() - 2] != kState ||
      !parts.back().starts_with(kNodeLocalTxPrefix)) {
    return make_error(EINVAL, "{}: not a node-local transaction directory", show(path));
  }
  std::string parent;
  for (size_t i = 0; i + 1 < parts.size(); ++i) parent = join_rel(parent, parts[i]);
  {
    std::lock_guard lock(mu_);
    // Cached descriptors of its shards go first.
    for (auto it = cache_.begin(); it != cache_.end();) {
      if (it->first.starts_with(std::string(path) + "/")) {
        lru_.erase(it->second.lru);
        it = cache_.erase(it);
      } else {
        ++it;
      }
    }
  }
  auto pfd = open_beneath(root_.get(), parent, O_RDONLY | O_DIRECTORY);
  if (!pfd) {
    if (pfd.error().code == ENOENT) return {};  // gone already
    return make_error(pfd.error().code, "{}: {}", show(parent), pfd.error().message);
  }
  remove_tree(pfd->get(), parts.back());
  if (auto gone = stat_beneath(root_.get(), path); gone.ok()) {
    return make_error(EIO, "{}: could not be removed", show(path));
  }
  // The directories it leaves empty, up to the root (rmdir fails on the others: fine).
  for (size_t i = parts.size() - 1; i-- > 0;) {
    std::string d, up;
    for (size_t j = 0; j <= i; ++j) d = join_rel(d, parts[j]);
    for (size_t j = 0; j < i; ++j) up = join_rel(up, parts[j]);
    auto ufd = up.empty() ? open_at(root_.get(), ".", O_RDONLY | O_DIRECTORY)
                          : open_beneath(root_.get(), up, O_RDONLY | O_DIRECTORY);
    if (!ufd || ::unlinkat(ufd->get(), parts[i].c_str(), AT_REMOVEDIR) != 0) break;
  }
  return {};
}

namespace {

void sweep_dir(int fd, const std::string& rel, int depth,
               const std::set<std::string, std::less<>>& keep, const std::set<std::string>& live,
               const std::string& root_path, uint64_t& removed) {
  auto entries = source::list_dir(fd);
  if (!entries) return;
  struct stat self {};
  if (::fstat(fd, &self) != 0) return;
  for (const auto& e : *entries) {
    if (!S_ISDIR(e.st.st_mode) || e.st.st_dev != self.st_dev) continue;
    auto sub = open_at(fd, e.name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW);
    if (!sub) continue;
    if (e.name == kState) {
      auto txs = source::list_dir(sub->get());
      if (!txs) continue;
      for (const auto& t : *txs) {
        if (!S_ISDIR(t.st.st_mode) || !t.name.starts_with(kNodeLocalTxPrefix)) continue;
        if (keep.count(t.name) || live.count(t.name)) continue;
        spdlog::info(
            "{}/{}: no commit record names it (a write that never committed, or a "
            "replaced file whose removal was cut short); removing",
            root_path, join_rel(join_rel(rel, kState), t.name));
        remove_tree(sub->get(), t.name);
        ++removed;
      }
      continue;
    }
    if (depth < kMaxSweepDepth) {
      sweep_dir(sub->get(), join_rel(rel, e.name), depth + 1, keep, live, root_path, removed);
    }
  }
}

}  // namespace

Result<uint64_t> ShardStore::sweep(const std::set<std::string, std::less<>>& keep) {
  std::set<std::string> live;
  {
    std::lock_guard lock(mu_);
    for (const auto& [key, h] : held_) {
      if (!h->created) continue;
      live.insert(std::string(split_rel(split_rel(h->path).dir).name));
    }
  }
  uint64_t removed = 0;
  sweep_dir(root_.get(), "", 0, keep, live, root_path_, removed);
  return removed;
}

void ShardStore::inject_enospc_after(uint64_t after) {
  std::lock_guard lock(mu_);
  fault_after_ = after;
}

uint64_t ShardStore::written() const {
  std::lock_guard lock(mu_);
  return written_;
}

}  // namespace ckptfs::flush
