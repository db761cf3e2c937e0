// write/dedup: a consolidator's output stored as links of the rank shards it was made from
// (see the header).
#include "ckptfs/write/dedup.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>

#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "ckptfs/format/record.hpp"
#include "ckptfs/io/gather.hpp"
#include "ckptfs/layout/extent_map.hpp"
#include "ckptfs/source/scanner.hpp"
#include "ckptfs/source/shards.hpp"
#include "ckptfs/util/copy.hpp"
#include "ckptfs/util/fd.hpp"
#include "ckptfs/util/path.hpp"

namespace ckptfs::write {

namespace {

// Bytes compared at a time: the view's and the file's, one buffer each.
constexpr uint64_t kCompareBlock = 1 << 20;

// Does output `file` of `ck` (its shards open as `fds`) read as the first `size` bytes of `fd`?
Result<bool> reads_as(const layout::Checkpoint& ck, uint32_t file, std::span<const int> fds, int fd,
                      uint64_t size, const std::string& what) {
  const auto& o = ck.outputs[file];
  io::GatherSource gs{&ck, fds, o.header, {}};
  std::vector<layout::Segment> segs;
  const uint64_t block = std::min(kCompareBlock, std::max<uint64_t>(size, 1));
  std::unique_ptr<char[]> view(new char[block]), mine(new char[block]);
  for (uint64_t off = 0; off < size; off += block) {
    const uint64_t n = std::min(block, size - off);
    layout::map_range(ck, file, off, n, segs);
    CKPTFS_CHECK(io::gather(gs, segs, view.get()));
    CKPTFS_CHECK(pread_exact(fd, mine.get(), n, off, what));
    if (std::memcmp(view.get(), mine.get(), n) != 0) return false;
  }
  return true;
}

}  // namespace

Origin origin_of(int dirfd, std::string_view rel) {
  struct stat st {};
  if (::fstatat(dirfd, std::string(kOriginDir).c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 &&
      S_ISDIR(st.st_mode)) {
    return Origin::Below;
  }
  return !rel.empty() && split_rel(rel).name == kConsolidatedDir ? Origin::Above : Origin::None;
}

Result<std::optional<StagedResplit>> stage_links(const ResplitJob& job, int origin,
                                                 const std::string& origin_display,
                                                 flush::Flusher& flusher) {
  auto no = [&](std::string_view why) -> Result<std::optional<StagedResplit>> {
    spdlog::debug("{}/{}: not stored as links of {}: {}", job.dir_display, job.name, origin_display,
                  why);
    return std::optional<StagedResplit>{};
  };
  if (!flusher.adopts_files()) return no("the flusher links no file");
  auto entries = source::list_checkpoint_dir(origin);
  if (!entries) return no(entries.error().message);
  // The view the directory would show with the file stored as these shards: their tensors,
  // under the file's own header (its commit record's, as for every file written through the
  // mount: the consolidator's header bytes, which need not be the ones ckptfs would make).
  source::HeaderCache headers;
  auto in = source::read_input(origin, *entries, origin_display, headers);
  in.overrides.push_back(layout::OutputOverride{job.k, job.name, job.header, job.parsed,
                                                format::record_file_name(job.name)});
  const auto ck = layout::build_checkpoint(std::move(in));
  if (!ck->problems.empty() || ck->outputs.empty()) return no("not a complete checkpoint");
  uint32_t file = 0;
  while (file < ck->outputs.size() &&
         !(ck->outputs[file].name == job.name && ck->outputs[file].folder.empty())) {
    ++file;
  }
  if (file == ck->outputs.size()) return no("no file of that name");
  const auto& o = ck->outputs[file];
  if (o.size != job.size || o.header != job.header) return no("another header or size");

  // The shards of that name (k of m), every rank's; each the written file's owner's, with its
  // mode and no other link (the commit gives them the file's owner, mode and times, and a
  // file of someone else's, or linked elsewhere, is never taken over).
  struct stat mine {};
  if (::fstat(job.shard.get(), &mine) != 0) return errno_error(job.what + ": stat failed");
  std::vector<uint32_t> ranks;
  for (uint32_t s = 0; s < ck->shards.size(); ++s) {
    const auto& sh = ck->shards[s];
    if (sh.parsed.k != job.k || sh.parsed.m != job.m) continue;
    if (sh.remote() || sh.access.uid != mine.st_uid || sh.access.gid != mine.st_gid ||
        (sh.access.mode & 07777) != (mine.st_mode & 07777)) {
      return no(fmt::format("{}: another owner or mode", sh.name));
    }
    ranks.push_back(s);
  }
  for (uint32_t s : o.shards) {
    if (std::find(ranks.begin(), ranks.end(), s) == ranks.end()) {
      return no(fmt::format("{} is read from {}, of another name", job.name, ck->shards[s].name));
    }
  }
  std::sort(ranks.begin(), ranks.end(), [&](uint32_t a, uint32_t b) {
    return ck->shards[a].parsed.shard < ck->shards[b].parsed.shard;
  });
  if (ranks.empty()) return no("no shard of that name");

  auto fds = source::open_shards(*ck, origin, origin_display, "store once");
  if (!fds) return no(fds.error().message);
  std::vector<int> raw;
  for (const auto& f : *fds) raw.push_back(f.get());
  for (uint32_t s : ranks) {
    struct stat st {};
    if (::fstat(raw[s], &st) != 0 || st.st_nlink != 1) {
      return no(fmt::format("{}: linked elsewhere", ck->shards[s].name));
    }
  }
  CKPTFS_TRY(const bool same, reads_as(*ck, file, raw, job.shard.get(), job.size, job.what));
  if (!same) return no("its bytes differ");

  layout::ShardSet set;  // each staged shard the size of the file it is replaced by
  for (uint32_t r = 0; r < ranks.size(); ++r) {
    set.shards.push_back(layout::ShardLayout{r, {}, nullptr, ck->shards[ranks[r]].stamp.size});
  }
  CKPTFS_TRY(auto tx, flusher.in_place().begin(resplit_target(job, mine), set, job.what));
  for (uint32_t r = 0; r < ranks.size(); ++r) {
    const auto& sh = ck->shards[ranks[r]];
    CKPTFS_CHECK(tx->adopt(r, origin, sh.name, static_cast<ino_t>(sh.stamp.ino)));
    // Still the bytes compared: the same size and mtime (the link itself moved its ctime).
    struct stat st {};
    if (::fstat(raw[ranks[r]], &st) != 0) return no(fmt::format("{}: stat failed", sh.name));
    if (const auto now = source::stamp_of(st);
        now.size != sh.stamp.size || now.mtime_ns != sh.stamp.mtime_ns) {
      return no(fmt::format("{}: changed while it was compared", sh.name));
    }
  }
  spdlog::info("{}/{}: reads as {}'s view: stored as links of its {} rank shards", job.dir_display,
               job.name, origin_display, ranks.size());
  return std::optional<StagedResplit>{
      StagedResplit{std::move(tx), static_cast<uint32_t>(ranks.size())}};
}

std::string scratch_name() {
  static std::atomic<uint64_t> counter{0};
  return fmt::format("{}{}-{}", format::kScratchPrefix, ::getpid(), counter.fetch_add(1));
}

namespace {

// The state directory of `stored`, where `stored`'s `name` is the file `st` and `stored` holds
// this daemon's state (only a link this daemon made is another directory's stored form).
std::optional<UniqueFd> storing_state(int stored, const std::string& name, const struct stat& st) {
  struct stat at {};
  if (::fstatat(stored, name.c_str(), &at, AT_SYMLINK_NOFOLLOW) != 0 || at.st_dev != st.st_dev ||
      at.st_ino != st.st_ino) {
    return std::nullopt;
  }
  auto state =
      open_at(stored, std::string(format::kStateDirName), O_RDONLY | O_DIRECTORY | O_NOFOLLOW);
  struct stat sst {};
  if (!state || ::fstat(state->get(), &sst) != 0 || !source::trusted_state(sst)) {
    return std::nullopt;
  }
  return std::move(state).value();
}

// The scratch file `tmp`, created in `state` and locked: recovery leaves it alone while it
// is being made (a daemon killed meanwhile leaves it unlocked, and recovery removes it).
Result<UniqueFd> open_scratch(int state, const std::string& tmp) {
  CKPTFS_TRY(UniqueFd out, open_at(state, tmp, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW, 0600));
  if (::flock(out.get(), LOCK_EX) != 0) {
    const int err = errno;
    ::unlinkat(state, tmp.c_str(), 0);
    return make_error(err, "{}/{}: cannot lock: {}", format::kStateDirName, tmp,
                      std::strerror(err));
  }
  return out;
}

}  // namespace

Status unshare_stored(int stored, const std::string& name, const struct stat& st,
                      const std::string& what) {
  auto state = storing_state(stored, name, st);
  if (!state) return {};
  const std::string tmp = scratch_name();
  const std::string copy_what = fmt::format("{}: its copy for the directory that stored it", what);
  CKPTFS_TRY(UniqueFd in, open_at(stored, name, O_RDONLY | O_NOFOLLOW));
  struct stat ist {};
  if (::fstat(in.get(), &ist) != 0 || ist.st_ino != st.st_ino) return {};
  CKPTFS_TRY(UniqueFd out, open_scratch(state->get(), tmp));
  auto made = [&]() -> Status {
    const auto size = static_cast<uint64_t>(ist.st_size);
    std::vector<char> buf;
    CKPTFS_CHECK(copy_all(in.get(), 0, out.get(), 0, size, copy_what, buf));
    const struct timespec ts[2] = {ist.st_atim, ist.st_mtim};
    if ((::geteuid() == 0 && ::fchown(out.get(), ist.st_uid, ist.st_gid) != 0) ||
        ::fchmod(out.get(), ist.st_mode & 07777) != 0 || ::futimens(out.get(), ts) != 0 ||
        ::fsync(out.get()) != 0) {
      return errno_error(copy_what);
    }
    if (::renameat(state->get(), tmp.c_str(), stored, name.c_str()) != 0) {
      return errno_error(copy_what + ": cannot rename it into place");
    }
    if (::fsync(stored) != 0) return errno_error(copy_what + ": fsync of its directory");
    return {};
  }();
  if (!made)
    ::unlinkat(state->get(), tmp.c_str(), 0);
  else
    spdlog::info("{}: another directory stored a file as links of it: it has its copy now", what);
  return made;
}

Result<bool> detach_truncated(int stored, int dir, const std::string& name, const struct stat& st,
                              const std::string& what) {
  auto state = storing_state(stored, name, st);
  if (!state) return false;
  const std::string tmp = scratch_name();
  const std::string new_what = fmt::format("{}: a new file under its name", what);
  CKPTFS_TRY(UniqueFd out, open_scratch(state->get(), tmp));
  // The new file takes the old one's owner and mode, as the truncate would have left them.
  if ((::geteuid() == 0 && ::fchown(out.get(), st.st_uid, st.st_gid) != 0) ||
      ::fchmod(out.get(), st.st_mode & 07777) != 0 ||
      ::renameat(state->get(), tmp.c_str(), dir, name.c_str()) != 0) {
    const int err = errno;
    ::unlinkat(state->get(), tmp.c_str(), 0);
    return make_error(err, "{}: {}", new_what, std::strerror(err));
  }
  spdlog::info(
      "{}: truncated while another directory stores a file as links of it: a new file "
      "under its name, the stored one untouched",
      what);
  return true;
}

}  // namespace ckptfs::write
