// write/file_store: how a closed file is stored: its commit, the split of a file written whole,
// its adoption as its own one shard, and the job for its split after close (WriteFile's second
// file; the state machine itself is write/file.cpp).
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "ckptfs/format/names.hpp"
#include "ckptfs/format/record.hpp"
#include "ckptfs/write/dedup.hpp"
#include "ckptfs/write/file.hpp"
#include "ckptfs/write/sniff.hpp"

namespace ckptfs::write {

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
  const auto info =
      flush::CommitInfo::of(where.name, mn->k, mn->m, adopted_ ? *adopted_ : router_->header(),
                            adopted_ ? size_ : router_->file_size(), bst);
  if (auto st = tx_->commit(info, durable); !st) return fail_locked(std::move(st).error());
  state_ = State::Committed;
  stored_ = format::stored_names(info.name, info.k, info.m, ranks_);
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
  // The N-shard form is checked here even where the file is stored as its one shard below:
  // the split after close commits the N shards without asking again. The one-shard form is
  // then checked too (a directory's other files decide whether it may be stored so), so this
  // path builds the directory's checkpoint twice, at close only.
  if (rules.validate) {
    std::vector<std::shared_ptr<const format::Header>> shards;
    for (const auto& sh : set->shards) shards.push_back(sh.parsed);
    if (auto st = rules.validate(where.name, Prospect{prefix, parsed, shards}); !st) {
      charge_.reset();
      whole_ = std::move(st).error();
      return {};
    }
  }
  // Split later also with one rank where the shards live on node-local targets: the one
  // shard in SRC is then not their final place.
  const bool later = set->shards.size() > 1 || !flusher_->shards_in_place();
  if (!later && adopt_locked(where, prefix, parsed, size)) {
    CKPTFS_CHECK(commit_locked(where, durable));
    // Closed beside the rank shards a consolidator made it from (write/dedup): after the close,
    // it is stored as links of them if it reads as their view.
    if (state_ == State::Committed && adopted_ && kernel_writes_ && plan_opts_.split_after_close &&
        origin_of(where.dirfd, where.dir_rel) != Origin::None) {
      resplit_ = resplit_job_locked(where, prefix, parsed, std::move(*p), std::move(*set));
    }
    return {};
  }
  // Written by the kernel, and split later: stored now as its own one shard (if that form
  // passes the same checks), so that close() returns without copying a byte.
  if (later && kernel_writes_ && plan_opts_.split_after_close &&
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
  CKPTFS_CHECK(route_file(backing_.get(), size, r, what_));
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
  auto tx = flusher_->in_place().begin(target(), one, what_);
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
  job.dir_rel = where.dir_rel;
  job.name = where.name;
  // The split runs after close, under the file's model name: its messages name that, not the
  // name it was opened by (a writer's temporary, renamed since).
  job.what = where.dir_display + "/" + where.name;
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
