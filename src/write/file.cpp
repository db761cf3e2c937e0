// write/file: one file being written through the mount: detection, routing or staging, close
// (one cohesive thing: the state machine of an open file; how it is stored is file_store.cpp).
#include "ckptfs/write/file.hpp"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "ckptfs/format/index.hpp"
#include "ckptfs/format/names.hpp"
#include "ckptfs/format/record.hpp"
#include "ckptfs/write/sniff.hpp"

namespace ckptfs::write {
namespace {

// The header length a prefix announces (its first 8 bytes), or 0 before they arrived.
uint64_t announced_len(std::string_view prefix) {
  if (prefix.size() < format::kHeaderLenBytes) return 0;
  return format::read_length_prefix(prefix.data());
}

// What a routed file keeps in memory until it is closed: its header, every shard header and a
// descriptor per chunk (an estimate, on the generous side).
uint64_t retained_bytes(const format::Header& h, const layout::ShardSet& s) {
  uint64_t n = format::kHeaderLenBytes + h.json_len + 256 * h.tensors.size();
  // Each shard header as parsed (about its text, plus a descriptor per chunk).
  for (const auto& sh : s.shards) n += sh.header.size() + 128 * sh.parsed->tensors.size();
  return n;
}

}  // namespace

Result<std::shared_ptr<WriteFile>> WriteFile::open(UniqueFd backing, int dirfd,
                                                   std::string dir_display, bool fresh,
                                                   flush::Flusher& flusher, PlanOptions plan,
                                                   std::string what, MemoryBudget* budget) {
  auto f = std::shared_ptr<WriteFile>(new WriteFile());
  f->budget_ = budget;
  f->charge_.bind(budget);
  struct stat st {};
  if (::fstat(backing.get(), &st) != 0) return errno_error(what + ": stat failed");
  int d = ::fcntl(dirfd, F_DUPFD_CLOEXEC, 0);
  if (d < 0) return errno_error(dir_display + ": dup failed");
  f->dir_.reset(d);
  f->backing_ = std::move(backing);
  f->dir_display_ = std::move(dir_display);
  f->what_ = std::move(what);
  f->dev_ = st.st_dev;
  f->ino_ = st.st_ino;
  f->flusher_ = &flusher;
  f->plan_opts_ = std::move(plan);
  f->size_ = static_cast<uint64_t>(st.st_size);
  f->state_ = fresh && st.st_size == 0 ? State::Sniffing : State::Plain;
  f->fresh_ = f->state_ == State::Sniffing;
  return f;
}

WriteFile::~WriteFile() {
  std::lock_guard lock(mu_);
  if (state_ == State::Routed || state_ == State::Sniffing) {
    // finalize() runs at every close; this is only reached when a handle went without one.
    if (auto st = to_plain_locked(true); !st) spdlog::error("{}", st.error().message);
  }
}

WriteFile::State WriteFile::state() const {
  std::lock_guard lock(mu_);
  return state_;
}

bool WriteFile::linked() const {
  struct stat st {};
  return ::fstat(backing_.get(), &st) == 0 && st.st_nlink > 0;
}

std::optional<Error> WriteFile::stored_whole() const {
  std::lock_guard lock(mu_);
  return whole_;
}

std::vector<std::string> WriteFile::stored_names() const {
  std::lock_guard lock(mu_);
  return stored_;
}

flush::Target WriteFile::target() const {
  flush::Target t;
  t.dirfd = dir_.get();
  t.display = dir_display_;
  struct stat st {};
  if (::fstat(backing_.get(), &st) == 0) {
    t.uid = st.st_uid;
    t.gid = st.st_gid;
    t.mode = st.st_mode & 07777;
    t.placeholder = st.st_ino;
  }
  return t;
}

Status WriteFile::fail_locked(Error e) {
  if (tx_) tx_->abort();
  tx_.reset();
  router_.reset();
  prefix_.clear();
  prefix_.shrink_to_fit();
  state_ = State::Failed;
  error_ = e;
  charge_.reset();
  return e;
}

// The backing file carries the file's times while its bytes are held or routed elsewhere: a
// write or a size change marks it modified, as it would a plain file.
void WriteFile::touch_locked() {
  const struct timespec now[2] = {{0, UTIME_OMIT}, {0, UTIME_NOW}};
  ::futimens(backing_.get(), now);
}

Status WriteFile::spill_locked(std::string_view why) {
  if (!spilled_) {
    spilled_ = true;
    spdlog::info("{}: {}; held on disk instead (split at close)", what_, why);
  }
  return to_plain_locked(true);
}

std::optional<Error> WriteFile::admit_locked(const format::Header& h, const layout::ShardSet& s,
                                             uint64_t extra) {
  // The commit record holds the header and, for node-local shards, every shard header, each as
  // a JSON string: valid JSON text escapes to at most twice its size (a quote, a backslash or
  // whitespace becomes two bytes; it has no raw control character). A record over the
  // side-file limit could never be read back.
  uint64_t record = 1024 + 2 * (format::kHeaderLenBytes + h.json_len);
  for (const auto& sh : s.shards) record += 256 + 2 * sh.header.size();
  if (record > format::kMaxSideFileSize) {
    return Error{EFBIG, fmt::format("{}: its commit record would pass the {} byte limit", what_,
                                    format::kMaxSideFileSize)};
  }
  if (!charge_.hold(extra + retained_bytes(h, s))) {
    return Error{ENOMEM, fmt::format("{}: the daemon's write memory ({} MiB) is in use", what_,
                                     budget_ ? budget_->limit() >> 20 : 0)};
  }
  return std::nullopt;
}

Status WriteFile::write(uint64_t off, std::string_view bytes) {
  std::lock_guard lock(mu_);
  return write_locked(off, bytes);
}

Status WriteFile::write_locked(uint64_t off, std::string_view bytes) {
  const uint64_t end = off + bytes.size();
  switch (state_) {
    case State::Failed:
      return *error_;
    case State::Committed:
      return make_error(EIO,
                        "{}: already stored as rank shards when it was closed; write a new "
                        "file (or reopen it) to change it",
                        what_);
    case State::Sniffing:
      dirty_ = true;
      if (off == prefix_.size()) {
        if (!charge_.hold(prefix_.size() + bytes.size())) {
          CKPTFS_CHECK(spill_locked("the daemon's write memory is in use"));
          break;  // now Plain
        }
        prefix_.append(bytes);
        size_ = std::max(size_, end);
        touch_locked();
        return decide_locked();
      }
      CKPTFS_CHECK(to_plain_locked(true));
      break;  // now Plain
    case State::Routed: {
      dirty_ = true;
      auto st = router_->write(off, bytes);
      if (st) {
        size_ = std::max(size_, end);
        touch_locked();
        return {};
      }
      if (!needs_staging(st.error())) return fail_locked(std::move(st).error());
      spdlog::info("{}: {}; staging the whole file and splitting it at close", what_,
                   st.error().message);
      CKPTFS_CHECK(to_plain_locked(true));
      break;  // now Plain
    }
    case State::Plain:
      break;
  }
  dirty_ = true;
  return pwrite_all(backing_.get(), bytes.data(), bytes.size(), off, what_);
}

Status WriteFile::decide_locked() {
  const uint64_t known = size_ > prefix_.size() ? size_ : 0;  // sized by ftruncate
  // Parsing and planning a large header costs a multiple of its size: one file at a time.
  const uint64_t n = announced_len(prefix_);
  std::unique_lock<std::mutex> big;
  if (budget_ && n > MemoryBudget::kBigHeader && prefix_.size() >= format::kHeaderLenBytes + n) {
    big = std::unique_lock(budget_->big());
  }
  Sniffed s = sniff(prefix_, known, what_);
  switch (s.kind) {
    case Kind::NeedMore:
      return {};
    case Kind::Consolidated:
      return enter_routed_locked(std::make_shared<const format::Header>(std::move(*s.header)));
    case Kind::RankShard:
    case Kind::Other:
      return to_plain_locked(true);
  }
  return {};
}

Status WriteFile::enter_routed_locked(std::shared_ptr<const format::Header> hp) {
  const format::Header& h = *hp;
  auto p = plan(h, plan_opts_, what_);
  auto s = p ? shard_headers(h, *p, what_) : Result<layout::ShardSet>(p.error());
  if (!s) {
    spdlog::warn("{}: stored whole, not split: {}", what_, s.error().message);
    return to_plain_locked(true);
  }
  if (auto no = admit_locked(h, *s, prefix_.size())) {
    if (no->code == ENOMEM) return spill_locked(no->message);
    spdlog::warn("{}; stored whole, not split", no->message);
    return to_plain_locked(true);
  }
  auto tx = flusher_->begin(target(), *s, what_);
  if (!tx) {
    // Staging could not be made (no space for it, no flock on this file system, ...): the
    // file is kept whole, as a plain file would be, rather than refused.
    spdlog::warn("{}: stored whole, not split: {}", what_, tx.error().message);
    return to_plain_locked(true);
  }
  tx_ = std::move(tx).value();
  ranks_ = static_cast<uint32_t>(s->shards.size());
  auto r = StreamRouter::create(prefix_.substr(0, h.data_start()), hp, *p, *s, *tx_, what_);
  if (!r) return fail_locked(std::move(r).error());
  router_.emplace(std::move(r).value());
  auto fed = router_->write(0, prefix_);
  if (!fed) {
    tx_->abort();
    tx_.reset();
    router_.reset();
    if (!needs_staging(fed.error())) return fail_locked(std::move(fed).error());
    return to_plain_locked(true);  // from the prefix, still held
  }
  prefix_.clear();
  prefix_.shrink_to_fit();
  (void)charge_.hold(retained_bytes(h, *s));  // less than it held: never refused
  state_ = State::Routed;
  return {};
}

// Moves what the file holds into the backing file and continues as a plain file. `keep_all`:
// the logical size is kept (zeros after the bytes received), else the file ends at the last
// byte received (a consolidated file cut short must not read as complete).
Status WriteFile::to_plain_locked(bool keep_all) {
  uint64_t received = 0;
  // The backing file carries the file's times (touch_locked, set_attr): moving bytes it
  // already stood for into it is no change of the file, and keeps them (cp -a sets a small
  // file's times before it closes it, while its bytes are still held).
  struct stat before {};
  const bool timed = ::fstat(backing_.get(), &before) == 0;
  // A failure here fails the file for good (fail_locked): the bytes routed so far are not
  // all in the file, and a retry at the next write or at release would only fail again (or,
  // with the MPI flusher, wait out another timeout).
  if (state_ == State::Sniffing) {
    if (auto st = pwrite_all(backing_.get(), prefix_.data(), prefix_.size(), 0, what_); !st) {
      return fail_locked(std::move(st).error());
    }
    received = prefix_.size();
    prefix_.clear();
    prefix_.shrink_to_fit();
  } else if (state_ == State::Routed) {
    received = router_->received();
    std::string buf(std::min<uint64_t>(kCopyChunk, std::max<uint64_t>(received, 1)), '\0');
    auto pread = [this](uint32_t rank, uint64_t off, char* dst, size_t n) {
      return tx_->pread(rank, off, dst, n);
    };
    for (uint64_t x = 0; x < received; x += buf.size()) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size(), received - x));
      auto got = router_->read(x, n, buf.data(), pread);
      if (!got) return fail_locked(std::move(got).error());
      if (auto st = pwrite_all(backing_.get(), buf.data(), *got, x, what_); !st) {
        return fail_locked(std::move(st).error());
      }
    }
    tx_->abort();
    tx_.reset();
    router_.reset();
  } else {
    return {};
  }
  const uint64_t size = keep_all ? size_ : received;
  // Sized only where it is not already: on ext4 a truncate to the size a file has, 0 included,
  // marks it to be flushed to disk at its last close (auto_da_alloc), which a file the kernel
  // then writes at page-cache speed would pay in full at close().
  struct stat now {};
  if ((::fstat(backing_.get(), &now) != 0 || static_cast<uint64_t>(now.st_size) != size) &&
      ::ftruncate(backing_.get(), static_cast<off_t>(size)) != 0) {
    return fail_locked(errno_error(what_ + ": cannot size the file"));
  }
  if (timed) {
    const struct timespec kept[2] = {before.st_atim, before.st_mtim};
    ::futimens(backing_.get(), kept);
  }
  state_ = State::Plain;
  charge_.reset();  // a plain file's bytes are its backing file's
  return {};
}

// File systems whose SEEK_HOLE reports exactly what no writer wrote (dirty page cache
// included) and which never store written zeros as holes (ZFS with compression does).
bool kernel_may_write(int fd) {
  struct statfs sf {};
  if (::fstatfs(fd, &sf) != 0) return false;
  switch (static_cast<unsigned long>(sf.f_type)) {
    case TMPFS_MAGIC:
    case EXT4_SUPER_MAGIC:
    case XFS_SUPER_MAGIC:
    case BTRFS_SUPER_MAGIC:
      return true;
    default:
      return false;
  }
}

bool WriteFile::kernel_writes() {
  std::lock_guard lock(mu_);
  if (!kernel_writes_ && !kernel_may_write(backing_.get())) return false;
  if (state_ == State::Sniffing && prefix_.empty()) {
    if (!to_plain_locked(true)) return false;
  }
  if (state_ != State::Plain) return false;
  kernel_writes_ = true;
  kernel_changed_locked();
  return true;
}

bool WriteFile::kernel_written() const {
  std::lock_guard lock(mu_);
  return kernel_writes_;
}

void WriteFile::guard_model_name() {
  std::lock_guard lock(mu_);
  if (!kernel_writes_ || guard_ || state_ != State::Plain) return;
  flush::Target t = target();
  t.kernel_written = true;
  auto g = flusher_->begin_kernel_write(t, what_);
  if (!g) {
    spdlog::warn("{}: not guarded against a daemon crash before its close: {}", what_,
                 g.error().message);
    return;
  }
  guard_ = std::move(g).value();
}

std::optional<Error> WriteFile::cut_at_hole_locked() {
  struct stat st {};
  if (::fstat(backing_.get(), &st) != 0 || st.st_size == 0) return std::nullopt;
  const off_t hole = ::lseek(backing_.get(), 0, SEEK_HOLE);
  if (hole < 0 || hole >= st.st_size) return std::nullopt;
  Error e{EIO, fmt::format("{}: closed with nothing written from byte {} of its {} (a "
                           "consolidated file cut short is never shown as complete)",
                           what_, hole, st.st_size)};
  spdlog::warn("{}", e.message);
  if (::ftruncate(backing_.get(), hole) != 0) {
    return Error{
        errno, fmt::format("{}: cannot cut it at byte {}: {}", what_, hole, std::strerror(errno))};
  }
  return e;
}

bool WriteFile::kernel_changed_locked() {
  struct stat st {};
  if (::fstat(backing_.get(), &st) != 0) return true;  // cannot tell: look again at close
  // Size and mtime: every write moves one of them (ctime moves too, but also with a link or
  // a rename of the file, as its split after close makes).
  const std::array<int64_t, 3> now{static_cast<int64_t>(st.st_size), st.st_mtim.tv_sec,
                                   st.st_mtim.tv_nsec};
  return std::exchange(stamp_, now) != now;
}

Status WriteFile::truncate(uint64_t size) {
  std::lock_guard lock(mu_);
  switch (state_) {
    case State::Failed:
      return *error_;
    case State::Committed:
      return make_error(EIO, "{}: already stored as rank shards when it was closed", what_);
    case State::Sniffing:
      if (size >= prefix_.size()) {
        // The backing file system's own limit, at the call (EFBIG past its largest file):
        // the empty placeholder is sized, then emptied again; its times change as the
        // file's would.
        if (size > 0 && ::ftruncate(backing_.get(), static_cast<off_t>(size)) != 0) {
          return errno_error(what_ + ": truncate failed");
        }
        if (size > 0 && ::ftruncate(backing_.get(), 0) != 0) {
          return errno_error(what_ + ": truncate failed");
        }
        size_ = size;
        return {};
      }
      break;
    case State::Routed:
      if (size == size_) {
        touch_locked();
        return {};
      }
      break;
    case State::Plain:
      break;
  }
  CKPTFS_CHECK(to_plain_locked(true));
  dirty_ = true;
  if (::ftruncate(backing_.get(), static_cast<off_t>(size)) != 0) {
    return errno_error(what_ + ": truncate failed");
  }
  return {};
}

Status WriteFile::set_attr(std::optional<mode_t> mode, std::optional<uid_t> uid,
                           std::optional<gid_t> gid, const struct timespec times[2]) {
  std::lock_guard lock(mu_);
  if (mode && ::fchmod(backing_.get(), *mode & 07777) != 0) return errno_error(what_ + ": chmod");
  if ((uid || gid) && ::fchown(backing_.get(), uid ? *uid : static_cast<uid_t>(-1),
                               gid ? *gid : static_cast<gid_t>(-1)) != 0) {
    return errno_error(what_ + ": chown");
  }
  if ((times[0].tv_nsec != UTIME_OMIT || times[1].tv_nsec != UTIME_OMIT) &&
      ::futimens(backing_.get(), times) != 0) {
    return errno_error(what_ + ": utimens");
  }
  return {};
}

Result<size_t> WriteFile::read(uint64_t off, size_t len, char* dst) {
  std::lock_guard lock(mu_);
  switch (state_) {
    case State::Failed:
      return *error_;
    case State::Sniffing: {
      if (off >= size_) return size_t{0};
      const size_t n = static_cast<size_t>(std::min<uint64_t>(len, size_ - off));
      const size_t from_prefix =
          off < prefix_.size() ? std::min<size_t>(n, prefix_.size() - off) : 0;
      if (from_prefix > 0) std::copy_n(prefix_.data() + off, from_prefix, dst);
      std::fill(dst + from_prefix, dst + n, '\0');
      return n;
    }
    case State::Routed:
    case State::Committed: {
      if (adopted_) break;  // the file is its own shard
      if (off >= size_) return size_t{0};
      len = static_cast<size_t>(std::min<uint64_t>(len, size_ - off));
      return router_->read(off, len, dst, [this](uint32_t r, uint64_t o, char* d, size_t n) {
        return tx_->pread(r, o, d, n);
      });
    }
    case State::Plain:
      break;
  }
  return pread_upto(backing_.get(), dst, len, off, what_);
}

Result<struct stat> WriteFile::stat() {
  std::lock_guard lock(mu_);
  struct stat st {};
  if (::fstat(backing_.get(), &st) != 0) return errno_error(what_ + ": stat failed");
  if (state_ != State::Plain) {
    st.st_size = static_cast<off_t>(size_);
    st.st_blocks = static_cast<blkcnt_t>((size_ + 511) / 512);
  }
  return st;
}

Status WriteFile::fsync(const Place& where, bool datasync) {
  std::lock_guard lock(mu_);
  switch (state_) {
    case State::Failed:
      return *error_;
    case State::Sniffing:
    case State::Plain:
      // The bytes held while sniffing go to the backing file first: fsync covers them.
      if (state_ == State::Sniffing) CKPTFS_CHECK(to_plain_locked(true));
      durable_ = true;  // a split at close is made durable too
      if ((datasync ? ::fdatasync(backing_.get()) : ::fsync(backing_.get())) != 0) {
        return errno_error(what_ + ": fsync failed");
      }
      return {};
    case State::Routed:
      durable_ = true;
      if (router_->complete() && format::is_model_name(where.name))
        return commit_locked(where, true);
      return tx_->sync();
    case State::Committed:
      return tx_->sync();
  }
  return {};
}

Result<bool> WriteFile::is_backing(const Place& where) const {
  struct stat st {};
  if (::fstatat(where.dirfd, where.name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
    if (errno == ENOENT) return false;
    return errno_error(fmt::format("{}/{}: stat failed", where.dir_display, where.name));
  }
  return st.st_dev == dev_ && st.st_ino == ino_;
}

Status WriteFile::finalize(const Place& where, const StoreRules& rules) {
  std::lock_guard lock(mu_);
  if (!kernel_writes_) return finalize_locked(where, rules);
  if (state_ == State::Committed && kernel_changed_locked()) {
    // The kernel let a descriptor of this open file write after another one's close()
    // stored it (a dup, a fork): those bytes went to the removed backing file. Never
    // silently: the close() of that descriptor fails.
    // Adopted as its shard, the file may still be the stored form (one rank), or no longer
    // (its split after close replaced it).
    struct stat now {};
    const bool in_place = adopted_ && ::fstat(backing_.get(), &now) == 0 && now.st_nlink > 0;
    Error e{EIO, in_place ? fmt::format("{}: written after close() stored it (through another "
                                        "descriptor), into its stored shard in place: save it "
                                        "again",
                                        what_)
                          : fmt::format("{}: written after close() stored it (through another "
                                        "descriptor); those bytes are not stored",
                                        what_)};
    spdlog::warn("{}", e.message);
    return e;
  }
  auto st = finalize_locked(where, rules);
  kernel_changed_locked();  // what this close saw (and did: a commit removes the backing file)
  guard_.reset();           // closed: the file is stored, or whole as it is
  return st;
}

Status WriteFile::finalize_locked(const Place& where, const StoreRules& rules) {
  // Written since the last close (by the daemon, or by the kernel), or made by this open (an
  // empty file is a file too).
  const bool was_dirty = dirty_.exchange(false) || std::exchange(fresh_, false) ||
                         (kernel_writes_ && kernel_changed_locked());
  whole_.reset();
  const bool model = format::is_model_name(where.name);
  switch (state_) {
    case State::Failed:
      return *error_;
    case State::Committed:
      return {};
    case State::Sniffing:
      CKPTFS_CHECK(to_plain_locked(true));
      if (model) {
        whole_ = Error{EINVAL,
                       fmt::format("{}: {} bytes, not a complete safetensors file", what_, size_)};
      }
      return {};
    case State::Plain:
      if (!was_dirty || !model) return {};
      if (kernel_writes_) {
        if (auto cut = cut_at_hole_locked()) {
          whole_ = std::move(cut);
          return {};
        }
      }
      if (rules.whole) {
        if (rules.whole->code) whole_ = rules.whole;
        return {};
      }
      return split_plain_locked(where, durable_, rules);
    case State::Routed:
      break;
  }
  if (!model) return to_plain_locked(true);
  if (!router_->complete()) {
    // torch's consolidator closes after the header, then reopens to append: nothing is lost
    // then (info); a file sized for bytes that never came is (warning).
    spdlog::log(size_ > router_->received() ? spdlog::level::warn : spdlog::level::info,
                "{}: closed after {} of its {} bytes; stored as written up to there (a "
                "consolidated file cut short is never shown as complete)",
                what_, router_->received(), router_->file_size());
    // Sized (ftruncate) beyond what arrived, it is kept shorter than the writer made it: EIO.
    // Otherwise it is exactly what was written, just not a complete safetensors file.
    whole_ = Error{size_ > router_->received() ? EIO : EINVAL,
                   fmt::format("{}: closed after {} of its {} bytes", what_, router_->received(),
                               router_->file_size())};
    return to_plain_locked(false);
  }
  if (auto no = refused_locked(where, rules)) {
    if (no->code) {
      whole_ = std::move(no);
    } else {
      spdlog::info("{}: stored whole: the other model files of {} are plain files", what_,
                   dir_display_);
    }
    return to_plain_locked(true);
  }
  return commit_locked(where, durable_);
}

std::optional<Error> WriteFile::refused_locked(const Place& where, const StoreRules& rules) {
  if (rules.whole) return rules.whole;
  if (!rules.validate) return std::nullopt;
  // Building the directory's checkpoint with this file in it costs a multiple of its header's
  // size: one large one at a time.
  std::unique_lock<std::mutex> big;
  if (budget_ && router_->header().size() > MemoryBudget::kBigHeader) {
    big = std::unique_lock(budget_->big());
  }
  if (auto st = rules.validate(
          where.name, Prospect{router_->header(), router_->parsed(), router_->shard_parsed()});
      !st) {
    return std::move(st).error();
  }
  return std::nullopt;
}

Status WriteFile::store(const Place& where, const StoreRules& rules) {
  std::lock_guard lock(mu_);
  whole_.reset();
  if (state_ != State::Plain || !format::is_model_name(where.name)) return {};
  if (rules.whole) {
    if (rules.whole->code) whole_ = rules.whole;
    return {};
  }
  auto st = split_plain_locked(where, durable_, rules);
  if (kernel_writes_) kernel_changed_locked();  // a commit removed the backing file
  return st;
}

}  // namespace ckptfs::write
