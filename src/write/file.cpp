// write/file: one file being written through the mount: detection, routing or staging, commit (one
// cohesive thing: the state machine of an open file).
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

constexpr size_t kCopyChunk = 1 << 20;

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

namespace {

// File systems whose SEEK_HOLE reports exactly what no writer wrote (dirty page cache
// included) and which never store written zeros as holes (ZFS with compression does).
bool reports_holes(int fd) {
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

}  // namespace

bool WriteFile::kernel_writes() {
  std::lock_guard lock(mu_);
  if (!kernel_writes_ && !reports_holes(backing_.get())) return false;
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

Status WriteFile::commit_locked(const Place& where, bool durable) {
  struct stat bst {};
  if (::fstat(backing_.get(), &bst) != 0) return fail_locked(errno_error(what_ + ": stat failed"));
  if (bst.st_nlink == 0) {  // unlinked while open: nothing to keep
    tx_->abort();
    tx_.reset();
    router_.reset();
    state_ = State::Plain;
    charge_.reset();
    return {};
  }
  struct stat a {
  }, b{};
  CKPTFS_TRY(bool here, is_backing(where));
  const bool same_dir = ::fstat(where.dirfd, &a) == 0 && ::fstat(dir_.get(), &b) == 0 &&
                        a.st_dev == b.st_dev && a.st_ino == b.st_ino;
  if (!here || !same_dir) {
    spdlog::info("{}: moved away from {} before it was closed; stored whole", what_, dir_display_);
    if (adopted_) {  // its bytes never left the file
      tx_->abort();
      tx_.reset();
      adopted_.reset();
      state_ = State::Plain;
      return {};
    }
    return to_plain_locked(true);
  }
  CKPTFS_CHECK(tx_->set_owner(bst.st_uid, bst.st_gid, bst.st_mode));
  auto mn = format::parse_model_name(where.name);
  flush::CommitInfo info;
  info.name = where.name;
  info.k = mn->k;
  info.m = mn->m;
  info.header = adopted_ ? *adopted_ : router_->header();
  info.size = adopted_ ? size_ : router_->file_size();
  info.uid = bst.st_uid;
  info.gid = bst.st_gid;
  info.mode = bst.st_mode & 07777;
  info.times = true;
  info.atime = bst.st_atim;
  info.mtime = bst.st_mtim;
  if (auto st = tx_->commit(info, durable); !st) return fail_locked(std::move(st).error());
  state_ = State::Committed;
  stored_.clear();
  for (uint32_t r = 0; r < ranks_; ++r) {
    stored_.push_back(format::shard_file_name(r + 1, info.k, info.m));
  }
  stored_.push_back(std::string(format::kStateDirName) + "/" + format::record_file_name(info.name));
  // The backing file was a placeholder: the shards are the file now.
  CKPTFS_TRY(bool still, is_backing(where));
  if (still && ::unlinkat(where.dirfd, where.name.c_str(), 0) != 0 && errno != ENOENT) {
    return errno_error(
        fmt::format("{}/{}: cannot remove the placeholder", where.dir_display, where.name));
  }
  spdlog::info("{}/{}: stored as {} rank shard(s){}", where.dir_display, where.name, ranks_,
               adopted_ ? " (the file itself, linked under the shard's name)" : "");
  return fill_other_links_locked();
}

// A hard link made in SRC to the backing file while it was written (the placeholder's other
// names) must not end up empty: once the name is gone, any link left gets the file's bytes.
Status WriteFile::fill_other_links_locked() {
  if (adopted_) return {};  // the shard is the file: every link of it holds the bytes
  struct stat st {};
  if (::fstat(backing_.get(), &st) != 0 || st.st_nlink == 0) return {};
  spdlog::info("{}: also linked elsewhere in SRC ({} link(s)); its bytes are written there too",
               what_, st.st_nlink);
  std::string buf(std::min<uint64_t>(kCopyChunk, std::max<uint64_t>(size_, 1)), '\0');
  auto pread = [this](uint32_t rank, uint64_t off, char* dst, size_t n) {
    return tx_->pread(rank, off, dst, n);
  };
  for (uint64_t x = 0; x < size_; x += buf.size()) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size(), size_ - x));
    CKPTFS_TRY(size_t got, router_->read(x, n, buf.data(), pread));
    CKPTFS_CHECK(pwrite_all(backing_.get(), buf.data(), got, x, what_ + " (another link)"));
  }
  if (::ftruncate(backing_.get(), static_cast<off_t>(size_)) != 0) {
    return errno_error(what_ + ": cannot size another link");
  }
  if (durable_ && ::fsync(backing_.get()) != 0) return errno_error(what_ + ": fsync failed");
  return {};
}

Status WriteFile::split_plain_locked(const Place& where, bool durable, const StoreRules& rules) {
  auto whole = [&](int code, std::string why) -> Status {
    whole_ = Error{code, fmt::format("{}: {}", what_, why)};
    return {};
  };
  struct stat st {};
  if (::fstat(backing_.get(), &st) != 0) return errno_error(what_ + ": stat failed");
  const auto size = static_cast<uint64_t>(st.st_size);
  if (size < format::kHeaderLenBytes + kMinHeaderLen) {
    return whole(EINVAL, fmt::format("{} bytes, not a safetensors file", size));
  }
  Result<uint64_t> len = format::read_header_length(backing_.get(), size, what_);
  if (!len && len.error().code == EINVAL) {  // not a header that fits: the file stays whole
    whole_ = std::move(len).error();
    return {};
  }
  CKPTFS_TRY(const uint64_t n, std::move(len));
  // Parsing and planning a large header costs a multiple of its size: one file at a time.
  std::unique_lock<std::mutex> big;
  if (budget_ && n > MemoryBudget::kBigHeader) big = std::unique_lock(budget_->big());
  CKPTFS_TRY(const std::string prefix, format::read_header_prefix(backing_.get(), n, what_));
  Sniffed s = sniff(prefix, size, what_);
  if (s.kind == Kind::RankShard) return whole(EINVAL, "a rank shard (it has DCP_SHARDING_INFO)");
  if (s.kind != Kind::Consolidated) return whole(EINVAL, s.why);
  // One parse, shared by the check and the router.
  const auto parsed = std::make_shared<const format::Header>(std::move(*s.header));
  auto p = plan(*parsed, plan_opts_, what_);
  auto set = p ? shard_headers(*parsed, *p, what_) : Result<layout::ShardSet>(p.error());
  if (!set) {
    spdlog::warn("{}: stored whole, not split: {}", what_, set.error().message);
    whole_ = set.error();
    return {};
  }
  if (auto no = admit_locked(*parsed, *set, 0)) {
    whole_ = std::move(no);
    return {};
  }
  if (rules.validate) {
    std::vector<std::shared_ptr<const format::Header>> shards;
    for (const auto& sh : set->shards) shards.push_back(sh.parsed);
    if (auto st = rules.validate(where.name, Prospect{prefix, parsed, shards}); !st) {
      charge_.reset();
      whole_ = std::move(st).error();
      return {};
    }
  }
  if (set->shards.size() == 1 && adopt_locked(where, prefix, parsed, size)) {
    return commit_locked(where, durable);
  }
  // Written by the kernel, and split later: stored now as its own one shard (if that form
  // passes the same checks), so that close() returns without copying a byte.
  if (set->shards.size() > 1 && kernel_writes_ && plan_opts_.split_after_close &&
      (!rules.validate || rules.validate(where.name, Prospect{prefix, parsed, {parsed}})) &&
      adopt_locked(where, prefix, parsed, size)) {
    CKPTFS_CHECK(commit_locked(where, durable));
    if (state_ == State::Committed && adopted_) {
      resplit_ = resplit_job_locked(where, prefix, parsed, std::move(*p), std::move(*set));
    }
    return {};
  }
  auto tx = flusher_->begin(target(), *set, what_);
  if (!tx) {  // no staging here: the file stays whole, as written
    spdlog::warn("{}: stored whole, not split: {}", what_, tx.error().message);
    charge_.reset();
    whole_ = std::move(tx).error();
    return {};
  }
  CKPTFS_TRY(auto r, StreamRouter::create(prefix, parsed, *p, *set, **tx, what_));
  std::string buf(kCopyChunk, '\0');
  for (uint64_t x = 0; x < size; x += kCopyChunk) {
    const size_t len = static_cast<size_t>(std::min<uint64_t>(kCopyChunk, size - x));
    CKPTFS_CHECK(pread_exact(backing_.get(), buf.data(), len, x, what_));
    CKPTFS_CHECK(r.write(x, std::string_view(buf.data(), len)));
  }
  // The file is routed now; the commit removes the backing file once the shards hold it.
  tx_ = std::move(tx).value();
  ranks_ = static_cast<uint32_t>(set->shards.size());
  router_.emplace(std::move(r));
  size_ = size;
  state_ = State::Routed;
  return commit_locked(where, durable);
}

bool WriteFile::adopt_locked(const Place& where, const std::string& prefix,
                             const std::shared_ptr<const format::Header>& parsed, uint64_t size) {
  if (!flusher_->adopts_files()) return false;
  struct stat a {
  }, b{}, f{};
  if (::fstat(where.dirfd, &a) != 0 || ::fstat(dir_.get(), &b) != 0 || a.st_dev != b.st_dev ||
      a.st_ino != b.st_ino || ::fstat(backing_.get(), &f) != 0 || f.st_nlink == 0) {
    return false;  // moved to another directory, or unlinked: commit_locked decides as ever
  }
  // The one rank shard is the file as written: its header (no DCP_SHARDING_INFO: every tensor
  // whole, which torch's HF reader and ckptfs take at offset 0) and its data.
  layout::ShardSet one;
  one.shards.push_back(layout::ShardLayout{0, prefix, parsed, size - prefix.size()});
  auto tx = flusher_->begin(target(), one, what_);
  if (!tx) return false;
  if (auto st = (*tx)->adopt(0, where.dirfd, where.name, f.st_ino); !st) {
    spdlog::debug("{}: copied into its shard: {}", what_, st.error().message);
    return false;  // the transaction's destructor removes its staging
  }
  tx_ = std::move(tx).value();
  ranks_ = 1;
  size_ = size;
  adopted_ = prefix;
  state_ = State::Routed;
  return true;
}

std::optional<ResplitJob> WriteFile::resplit_job_locked(
    const Place& where, std::string header, std::shared_ptr<const format::Header> parsed, Plan p,
    layout::ShardSet set) {
  auto mn = format::parse_model_name(where.name);
  struct stat st {};
  if (!mn || ::fstat(backing_.get(), &st) != 0) return std::nullopt;
  const int shard = ::fcntl(backing_.get(), F_DUPFD_CLOEXEC, 0);
  const int dir = shard < 0 ? -1 : ::fcntl(dir_.get(), F_DUPFD_CLOEXEC, 0);
  if (dir < 0) {
    if (shard >= 0) ::close(shard);
    spdlog::warn("{}: stays one shard: {}", what_, std::strerror(errno));
    return std::nullopt;
  }
  ResplitJob job;
  job.shard.reset(shard);
  job.dir.reset(dir);
  job.dir_display = where.dir_display;
  job.name = where.name;
  job.what = what_;
  job.k = mn->k;
  job.m = mn->m;
  job.header = std::move(header);
  job.parsed = std::move(parsed);
  job.plan = std::move(p);
  job.set = std::move(set);
  job.size = size_;
  job.dev = st.st_dev;
  job.ino = st.st_ino;
  job.stamp = shard_stamp(st);
  return job;
}

std::optional<ResplitJob> WriteFile::take_resplit() {
  std::lock_guard lock(mu_);
  return std::exchange(resplit_, std::nullopt);
}

Result<WriteFile::Split> WriteFile::prospect(int fd, const PlanOptions& plan_opts,
                                             std::string_view what) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return errno_error(fmt::format("{}: stat failed", what));
  const auto size = static_cast<uint64_t>(st.st_size);
  if (size < format::kHeaderLenBytes + kMinHeaderLen) {
    return make_error(EINVAL, "{}: {} bytes, not a safetensors file", what, size);
  }
  CKPTFS_TRY(const uint64_t n, format::read_header_length(fd, size, what));
  Split out;
  CKPTFS_TRY(out.header, format::read_header_prefix(fd, n, what));
  Sniffed s = sniff(out.header, size, what);
  if (s.kind != Kind::Consolidated) {
    return make_error(EINVAL, "{}",
                      s.kind == Kind::RankShard
                          ? fmt::format("{}: a rank shard, not a consolidated file", what)
                          : s.why);
  }
  CKPTFS_TRY(auto p, plan(*s.header, plan_opts, what));
  CKPTFS_TRY(auto set, shard_headers(*s.header, p, what));
  for (auto& sh : set.shards) out.shards.push_back(std::move(sh.parsed));
  out.parsed = std::make_shared<const format::Header>(std::move(*s.header));
  return out;
}

}  // namespace ckptfs::write
