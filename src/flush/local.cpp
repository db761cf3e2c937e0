// flush/local: the local flusher: staged shards in D/.ckptfs, commit records, roll forward and
// recovery.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <set>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "ckptfs/flush/flusher.hpp"
#include "ckptfs/format/names.hpp"
#include "ckptfs/format/record.hpp"
#include "ckptfs/source/scanner.hpp"
#include "ckptfs/util/fd.hpp"
#include "ckptfs/util/path.hpp"

namespace ckptfs::flush {
namespace {

const std::string kState(format::kStateDirName);
constexpr int kMaxRemoveDepth = 8;  // staging directories are flat; anything deeper is not ours

std::string staged_name(uint32_t shard) { return fmt::format("rank-{:05d}", shard); }

Status fsync_fd(int fd, std::string_view what) {
  if (::fsync(fd) != 0) return errno_error(fmt::format("{}: fsync failed", what));
  return {};
}

void remove_tree_depth(int parent, const std::string& name, int depth) {
  if (::unlinkat(parent, name.c_str(), 0) == 0 || errno == ENOENT) return;
  if (depth > kMaxRemoveDepth) return;
  auto fd = open_at(parent, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW);
  struct stat pst {
  }, cst{};
  if (fd &&
      (::fstat(parent, &pst) != 0 || ::fstat(fd->get(), &cst) != 0 || pst.st_dev != cst.st_dev)) {
    return;  // another file system mounted there (the view itself, say): never descend
  }
  if (fd) {
    if (auto list = source::list_dir(fd->get()); list) {
      for (const auto& e : *list) {
        if (S_ISDIR(e.st.st_mode)) {
          remove_tree_depth(fd->get(), e.name, depth + 1);
        } else {
          ::unlinkat(fd->get(), e.name.c_str(), 0);
        }
      }
    }
  }
  ::unlinkat(parent, name.c_str(), AT_REMOVEDIR);
}

}  // namespace

void remove_tree(int parent, const std::string& name) { remove_tree_depth(parent, name, 0); }

namespace {

// Whether no live process holds the staging directory's lock (so it is a crash's leftover).
// A daemon's scratch file (write/dedup's copies, and the file a rename onto a model name
// replaces, kept until the store of the file moved over it is known), not this process's own.
bool scratch(const source::DirEntry& e) {
  return S_ISREG(e.st.st_mode) && e.name.starts_with(format::kScratchPrefix) &&
         !e.name.substr(format::kScratchPrefix.size()).starts_with(fmt::format("{}-", ::getpid()));
}

// Removes the scratch file `name` when nobody holds its lock: its daemon died with it.
void remove_dead_scratch(int statefd, const std::string& name, const std::string& display) {
  int fd = ::openat(statefd, name.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0) return;
  UniqueFd held(fd);
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || ::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    return;
  }
  if (::unlinkat(statefd, name.c_str(), 0) == 0) {
    spdlog::info("{}: removed {}/{}, left by a daemon that died with it", display, kState, name);
  }
}

bool stale(int txfd) {
  int fd = ::openat(txfd, "lock", O_RDWR | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return errno == ENOENT;
  UniqueFd lock(fd);
  return ::flock(fd, LOCK_EX | LOCK_NB) == 0;
}

// The roll forward of a commit: staged shards over their final names, then the directory's
// other shards and records of the same file number removed. Idempotent.
// `recovering`: a staged shard that is gone was moved already by the interrupted roll forward;
// in a live commit every staged shard must still be there.
Status roll_forward(int dirfd, int statefd, const format::Record& rec, int txfd,
                    const std::string& display, bool recovering) {
  for (const auto& s : rec.shards) {
    if (s.remote()) continue;  // on a node-local target: nothing staged here
    auto p = format::parse_shard_name(s.name);
    if (::renameat(txfd, staged_name(p->shard).c_str(), dirfd, s.name.c_str()) != 0 &&
        (errno != ENOENT || !recovering)) {
      return errno_error(
          fmt::format("{}/{}: cannot move the committed shard into place", display, s.name));
    }
  }
  auto entries = source::list_dir(dirfd);
  if (!entries) return std::move(entries).error().context(display);
  for (const auto& e : *entries) {
    auto p = format::parse_shard_name(e.name);
    if (!p || p->k != rec.k || p->m != rec.m) continue;
    bool ours =
        std::any_of(rec.shards.begin(), rec.shards.end(),
                    [&](const format::RecordShard& s) { return !s.remote() && s.name == e.name; });
    if (!ours && ::unlinkat(dirfd, e.name.c_str(), 0) != 0 && errno != ENOENT) {
      return errno_error(fmt::format("{}/{}: cannot remove an older shard", display, e.name));
    }
  }
  if (auto recs = source::list_dir(statefd); recs) {
    for (const auto& e : *recs) {
      const auto file = format::parse_record_name(e.name);
      if (!file) continue;
      auto mn = format::parse_model_name(*file);
      if (mn && mn->k == rec.k && mn->m == rec.m && *file != rec.name) {
        ::unlinkat(statefd, e.name.c_str(), 0);
      }
    }
  }
  return {};
}

// Staging directories this process is using: recover() never touches them, whatever their
// lock says (between a staging's mkdir and its flock, the lock proves nothing).
struct Live {
  std::mutex mu;  // guards names
  std::set<std::string> names;
  bool has(const std::string& n) {
    std::lock_guard lock(mu);
    return names.count(n) != 0;
  }
};

// The state directory is trusted only when the daemon made it: owned by its user and
// writable by nobody else. Anyone else's could swap staged shards or plant records that make
// recovery rename or unlink files as root.
Status check_state_dir(int statefd, const std::string& display) {
  struct stat st {};
  if (::fstat(statefd, &st) != 0) return errno_error(display + ": stat failed");
  if (st.st_uid != ::geteuid() || (st.st_mode & 022) != 0) {
    return make_error(
        EPERM,
        "{}: owned by uid {} with mode {:o}, not by this daemon (uid {}) and private; "
        "not used",
        display, st.st_uid, st.st_mode & 07777, ::geteuid());
  }
  return {};
}

class LocalTransaction final : public Transaction {
 public:
  ~LocalTransaction() override {
    abort();
    std::lock_guard lock(live_->mu);
    live_->names.erase(name_);
  }

  static Result<std::unique_ptr<LocalTransaction>> begin(const Target& t,
                                                         const layout::ShardSet& set,
                                                         std::string what,
                                                         std::shared_ptr<Live> live) {
    static std::atomic<uint64_t> counter{0};
    auto tx = std::unique_ptr<LocalTransaction>(new LocalTransaction());
    tx->live_ = std::move(live);
    tx->what_ = std::move(what);
    tx->display_ = t.display;
    int d = ::fcntl(t.dirfd, F_DUPFD_CLOEXEC, 0);
    if (d < 0) return errno_error(fmt::format("{}: dup failed", t.display));
    tx->dir_.reset(d);
    if (::mkdirat(t.dirfd, kState.c_str(), 0700) != 0 && errno != EEXIST) {
      return errno_error(fmt::format("{}/{}: cannot create", t.display, kState));
    }
    CKPTFS_TRY(tx->state_, open_at(t.dirfd, kState, O_RDONLY | O_DIRECTORY | O_NOFOLLOW));
    CKPTFS_CHECK(check_state_dir(tx->state_.get(), t.display + "/" + kState));
    std::random_device rd;
    tx->name_ = fmt::format("tx-{}-{}-{:08x}", ::getpid(), counter.fetch_add(1), rd());
    {
      std::lock_guard lock(tx->live_->mu);
      tx->live_->names.insert(tx->name_);
    }
    const std::string tx_display = fmt::format("{}/{}/{}", t.display, kState, tx->name_);
    if (::mkdirat(tx->state_.get(), tx->name_.c_str(), 0700) != 0) {
      return errno_error(fmt::format("{}: cannot create", tx_display));
    }
    tx->created_ = true;
    CKPTFS_TRY(tx->tx_, open_at(tx->state_.get(), tx->name_, O_RDONLY | O_DIRECTORY | O_NOFOLLOW));
    CKPTFS_TRY(tx->lock_, open_at(tx->tx_.get(), "lock", O_RDWR | O_CREAT | O_EXCL, 0600));
    if (::flock(tx->lock_.get(), LOCK_EX) != 0) return errno_error(tx_display + "/lock");
    const std::string owner = fmt::format("{}{}\n", static_cast<uint64_t>(t.placeholder),
                                          t.kernel_written ? " kernel" : "");
    CKPTFS_CHECK(pwrite_all(tx->lock_.get(), owner.data(), owner.size(), 0, tx_display + "/lock"));
    for (const auto& sh : set.shards) {
      const std::string n = staged_name(sh.rank + 1);
      CKPTFS_TRY(UniqueFd fd, open_at(tx->tx_.get(), n, O_RDWR | O_CREAT | O_EXCL, 0600));
      if (::ftruncate(fd.get(), static_cast<off_t>(sh.file_size())) != 0) {
        return errno_error(fmt::format("{}/{}: cannot size the shard", tx_display, n));
      }
      tx->sizes_.push_back(sh.file_size());
      tx->fds_.push_back(std::move(fd));
    }
    CKPTFS_CHECK(tx->set_owner(t.uid, t.gid, t.mode));
    return tx;
  }

  Status pwrite(uint32_t rank, uint64_t offset, std::string_view bytes) override {
    return pwrite_all(fds_[rank].get(), bytes.data(), bytes.size(), offset, shard_what(rank));
  }

  Result<bool> copy_in(uint32_t rank, uint64_t offset, int src_fd, uint64_t src_off,
                       uint64_t n) override {
    return copy_range(src_fd, src_off, fds_[rank].get(), offset, n, shard_what(rank));
  }
  Status pread(uint32_t rank, uint64_t off, char* dst, size_t n) override {
    return pread_exact(fds_[rank].get(), dst, n, off, shard_what(rank));
  }

  Status sync() override {
    for (uint32_t r = 0; r < fds_.size(); ++r) CKPTFS_CHECK(fsync_fd(fds_[r].get(), shard_what(r)));
    if (committed_) {  // the record and the names too
      if (!record_.empty()) {
        auto fd = open_at(state_.get(), record_, O_RDONLY | O_NOFOLLOW);
        if (fd) CKPTFS_CHECK(fsync_fd(fd->get(), record_));
      }
      CKPTFS_CHECK(fsync_fd(state_.get(), display_ + "/" + kState));
      CKPTFS_CHECK(fsync_fd(dir_.get(), display_));
    }
    return {};
  }

  Status set_owner(uid_t uid, gid_t gid, mode_t mode) override {
    for (uint32_t r = 0; r < fds_.size(); ++r) {
      if (::geteuid() == 0 && ::fchown(fds_[r].get(), uid, gid) != 0) {
        return errno_error(shard_what(r) + ": chown failed");
      }
      if (::fchmod(fds_[r].get(), mode & 07777) != 0) {
        return errno_error(shard_what(r) + ": chmod failed");
      }
    }
    return {};
  }

  Status commit(const CommitInfo& info, bool durable) override {
    if (info.times) {  // the file's times, which its shards carry (and show through the view)
      const struct timespec ts[2] = {info.atime, info.mtime};
      for (uint32_t r = 0; r < fds_.size(); ++r) {
        if (::futimens(fds_[r].get(), ts) != 0) return errno_error(shard_what(r) + ": utimens");
      }
    }
    if (durable) CKPTFS_CHECK(sync());
    format::Record rec;
    rec.name = info.name;
    rec.k = info.k;
    rec.m = info.m;
    rec.size = info.size;
    rec.header = info.header;
    rec.tx = name_;
    rec.has_owner = true;
    rec.uid = info.uid;
    rec.gid = info.gid;
    rec.mode = info.mode & 07777;
    if (!info.remote_shards.empty()) {
      // Node-local shards (the OpenMPI flusher): the record names them on their owners'
      // targets; nothing of theirs is staged here.
      rec.shards = info.remote_shards;
    } else {
      for (uint32_t r = 0; r < fds_.size(); ++r) {
        format::RecordShard sh;
        sh.name = format::shard_file_name(r + 1, info.k, info.m);
        sh.size = sizes_[r];
        rec.shards.push_back(std::move(sh));
      }
    }
    const std::string text = format::serialize_record(rec);
    const std::string rec_display = fmt::format("{}/{}/{}/record", display_, kState, name_);
    if (text.size() > format::kMaxSideFileSize) {  // it could never be read back
      return make_error(EFBIG, "{}: the commit record would be {} bytes, over the {} byte limit",
                        rec_display, text.size(), format::kMaxSideFileSize);
    }
    {
      CKPTFS_TRY(UniqueFd fd, open_at(tx_.get(), "record", O_WRONLY | O_CREAT | O_TRUNC, 0644));
      CKPTFS_CHECK(pwrite_all(fd.get(), text.data(), text.size(), 0, rec_display));
      // The record is an input of the view as its shards are: it carries the file's times too,
      // so a copy's times (cp -a, tar x, rsync -a) are the directory's newest input's.
      if (info.times) {
        const struct timespec ts[2] = {info.atime, info.mtime};
        if (::futimens(fd.get(), ts) != 0) return errno_error(rec_display + ": utimens");
      }
      if (durable) CKPTFS_CHECK(fsync_fd(fd.get(), rec_display));
    }
    // The commit point.
    const std::string final_rec = format::record_file_name(info.name);
    if (::renameat(tx_.get(), "record", state_.get(), final_rec.c_str()) != 0) {
      return errno_error(fmt::format("{}/{}/{}: cannot commit", display_, kState, final_rec));
    }
    committed_ = true;
    record_ = final_rec;
    if (durable) CKPTFS_CHECK(fsync_fd(state_.get(), display_ + "/" + kState));
    CKPTFS_CHECK(roll_forward(dir_.get(), state_.get(), rec, tx_.get(), display_, false));
    remove_staging();
    if (durable) CKPTFS_CHECK(fsync_fd(dir_.get(), display_));
    return {};
  }

  std::string staging_name() const override { return name_; }

  Status adopt(uint32_t rank, int dirfd, const std::string& name, ino_t ino) override {
    if (rank >= fds_.size()) return make_error(EINVAL, "{}: no rank {} shard", what_, rank);
    const std::string n = staged_name(rank + 1);
    const std::string staged = shard_what(rank);
    if (::unlinkat(tx_.get(), n.c_str(), 0) != 0) return errno_error(staged + ": cannot replace");
    if (::linkat(dirfd, name.c_str(), tx_.get(), n.c_str(), 0) != 0) {
      return errno_error(fmt::format("{}: cannot link {} as its shard", staged, name));
    }
    CKPTFS_TRY(UniqueFd fd, open_at(tx_.get(), n, O_RDWR | O_NOFOLLOW));
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0) return errno_error(staged + ": stat failed");
    if (st.st_ino != ino) {
      ::unlinkat(tx_.get(), n.c_str(), 0);
      return make_error(EIO, "{}: {} was replaced meanwhile", staged, name);
    }
    if (static_cast<uint64_t>(st.st_size) != sizes_[rank]) {
      return make_error(EIO, "{}: {} holds {} bytes, its shard {}", staged, name, st.st_size,
                        sizes_[rank]);
    }
    fds_[rank] = std::move(fd);
    return {};
  }

  void abort() override {
    if (committed_ || !created_) return;
    fds_.clear();
    remove_staging();
  }

 private:
  LocalTransaction() = default;

  std::string shard_what(uint32_t r) const {
    return fmt::format("{}: rank {} shard ({}/{}/{}/{})", what_, r, display_, kState, name_,
                       staged_name(r + 1));
  }

  void remove_staging() {
    if (!created_) return;
    created_ = false;
    remove_tree(state_.get(), name_);
    lock_.reset();
  }

  std::string what_, display_, name_;
  std::string record_;  // the record's name in .ckptfs, once committed
  std::shared_ptr<Live> live_;
  UniqueFd dir_, state_, tx_, lock_;
  std::vector<UniqueFd> fds_;
  std::vector<uint64_t> sizes_;
  bool created_ = false;    // the staging directory exists and is ours to remove
  bool committed_ = false;  // the record is in place: the staging is no longer ours to drop
};

class LocalFlusher final : public Flusher {
 public:
  uint32_t default_ranks() const override { return 1; }

  Result<std::unique_ptr<Transaction>> begin(const Target& t, const layout::ShardSet& set,
                                             std::string what) override {
    CKPTFS_TRY(auto tx, LocalTransaction::begin(t, set, std::move(what), live_));
    return std::unique_ptr<Transaction>(std::move(tx));
  }

  bool adopts_files() const override { return true; }

  Result<std::unique_ptr<Transaction>> begin_kernel_write(const Target& t,
                                                          std::string what) override {
    CKPTFS_TRY(auto tx, LocalTransaction::begin(t, layout::ShardSet{}, std::move(what), live_));
    return std::unique_ptr<Transaction>(std::move(tx));
  }

  bool recover(const Target& t) override {
    auto state = open_at(t.dirfd, kState, O_RDONLY | O_DIRECTORY | O_NOFOLLOW);
    if (!state) return false;
    auto list = source::list_dir(state->get());
    if (!list) return false;
    // Nothing to do unless some staging or scratch file is there: records alone are the
    // stored form.
    if (std::none_of(list->begin(), list->end(), [](const source::DirEntry& e) {
          return (S_ISDIR(e.st.st_mode) && e.name.starts_with("tx-")) || scratch(e);
        })) {
      return false;
    }
    if (auto ok = check_state_dir(state->get(), t.display + "/" + kState); !ok) {
      spdlog::warn("{}", ok.error().message);
      return false;
    }
    for (const auto& e : *list) {
      if (scratch(e)) remove_dead_scratch(state->get(), e.name, t.display);
    }
    std::vector<std::string> referenced;
    bool changed = false;
    for (const auto& e : *list) {
      if (!S_ISREG(e.st.st_mode) || !format::parse_record_name(e.name)) continue;
      auto text = read_small_file_beneath(state->get(), e.name, format::kMaxSideFileSize);
      if (!text) continue;
      auto rec = format::parse_record(*text, e.name);
      if (!rec || rec->tx.empty()) continue;
      referenced.push_back(rec->tx);
      if (live_->has(rec->tx)) continue;
      auto tx = open_at(state->get(), rec->tx, O_RDONLY | O_DIRECTORY | O_NOFOLLOW);
      if (!tx || !stale(tx->get())) continue;
      spdlog::info("{}: completing the interrupted commit of {}", t.display, rec->name);
      if (auto st = roll_forward(t.dirfd, state->get(), *rec, tx->get(), t.display, true); !st) {
        spdlog::error("{}: {}", t.display, st.error().message);
        continue;
      }
      remove_tree(state->get(), rec->tx);
      changed = true;
    }
    for (const auto& e : *list) {
      if (!S_ISDIR(e.st.st_mode) || !e.name.starts_with("tx-")) continue;
      if (std::find(referenced.begin(), referenced.end(), e.name) != referenced.end()) continue;
      if (live_->has(e.name)) continue;
      auto tx = open_at(state->get(), e.name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW);
      if (!tx || !stale(tx->get())) continue;
      spdlog::info("{}: removing {}/{}, left by a write that never committed", t.display, kState,
                   e.name);
      remove_placeholder(t.dirfd, tx->get());
      remove_tree(state->get(), e.name);
      changed = true;
    }
    return changed;
  }

  // Records first: a crash midway leaves shards without a record (a DCP checkpoint the view
  // may show), never a record naming shards that are gone.
  Status remove(const Target& t, uint32_t k, uint32_t m) override {
    if (auto state = open_at(t.dirfd, kState, O_RDONLY | O_DIRECTORY | O_NOFOLLOW); state) {
      CKPTFS_TRY(auto recs, source::list_dir(state->get()));
      for (const auto& e : recs) {
        const auto file = format::parse_record_name(e.name);
        if (!file) continue;
        auto mn = format::parse_model_name(*file);
        if (mn && mn->k == k && mn->m == m && ::unlinkat(state->get(), e.name.c_str(), 0) != 0 &&
            errno != ENOENT) {
          return errno_error(fmt::format("{}/{}/{}: cannot remove", t.display, kState, e.name));
        }
      }
    }
    CKPTFS_TRY(auto entries, source::list_dir(t.dirfd));
    for (const auto& e : entries) {
      auto p = format::parse_shard_name(e.name);
      if (!p || p->k != k || p->m != m) continue;
      if (::unlinkat(t.dirfd, e.name.c_str(), 0) != 0 && errno != ENOENT) {
        return errno_error(fmt::format("{}/{}: cannot remove", t.display, e.name));
      }
    }
    return {};
  }

 private:
  std::shared_ptr<Live> live_ = std::make_shared<Live>();

  // The empty backing file of the dead writer, found by the inode its staging recorded.
  static void remove_placeholder(int dirfd, int txfd) {
    auto text = read_small_file_beneath(txfd, "lock", 64);
    if (!text) return;
    char* rest = nullptr;
    const uint64_t ino = std::strtoull(text->c_str(), &rest, 10);
    if (ino == 0) return;
    // "<ino> kernel": a file the kernel wrote (begin_kernel_write), removed from under a model
    // name; else an empty placeholder.
    const bool kernel = std::string_view(rest).starts_with(" kernel");
    auto entries = source::list_dir(dirfd);
    if (!entries) return;
    for (const auto& e : *entries) {
      if (!S_ISREG(e.st.st_mode) || static_cast<uint64_t>(e.st.st_ino) != ino) continue;
      if (kernel ? format::is_model_name(e.name) : e.st.st_size == 0) {
        if (kernel) {
          spdlog::info("removing {}, written through the mount and never closed", e.name);
        }
        ::unlinkat(dirfd, e.name.c_str(), 0);
      }
    }
  }
};

}  // namespace

std::unique_ptr<Flusher> make_local_flusher() { return std::make_unique<LocalFlusher>(); }

}  // namespace ckptfs::flush
