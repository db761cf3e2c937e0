// write/resplit: the split of a file stored as its own one shard into N rank shards, after
// close (see the header).
#include "ckptfs/write/resplit.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "ckptfs/format/names.hpp"
#include "ckptfs/format/record.hpp"
#include "ckptfs/write/router.hpp"

namespace ckptfs::write {

std::array<int64_t, 5> shard_stamp(const struct stat& st) {
  return {static_cast<int64_t>(st.st_size), st.st_mtim.tv_sec, st.st_mtim.tv_nsec,
          st.st_ctim.tv_sec, st.st_ctim.tv_nsec};
}

flush::Target resplit_target(const ResplitJob& job, const struct stat& st) {
  flush::Target t;
  t.dirfd = job.dir.get();
  t.display = job.dir_display;
  t.uid = st.st_uid;
  t.gid = st.st_gid;
  t.mode = st.st_mode & 07777;
  // No placeholder: the one shard is the stored form until the commit, and a crash before it
  // only drops this staging.
  return t;
}

Result<StagedResplit> stage_resplit(const ResplitJob& job, flush::Flusher& flusher) {
  struct stat st {};
  if (::fstat(job.shard.get(), &st) != 0) return errno_error(job.what + ": stat failed");
  CKPTFS_TRY(auto tx, flusher.begin(resplit_target(job, st), job.set, job.what));
  CKPTFS_TRY(auto r,
             StreamRouter::create(job.header, job.parsed, job.plan, job.set, *tx, job.what));
  CKPTFS_CHECK(route_file(job.shard.get(), job.size, r, job.what));
  return StagedResplit{std::move(tx), static_cast<uint32_t>(job.set.shards.size())};
}

Result<std::vector<std::string>> commit_resplit(const ResplitJob& job, StagedResplit staged) {
  const std::string first = format::shard_file_name(1, job.k, job.m);
  struct stat now {
  }, sh{};
  if (::fstatat(job.dir.get(), first.c_str(), &now, AT_SYMLINK_NOFOLLOW) != 0 ||
      now.st_dev != job.dev || now.st_ino != job.ino) {
    spdlog::info(
        "{}/{}: stored anew, renamed or removed since its close; its split into rank "
        "shards is dropped",
        job.dir_display, job.name);
    return std::vector<std::string>{};
  }
  if (::fstat(job.shard.get(), &sh) != 0) return errno_error(job.what + ": stat failed");
  if (shard_stamp(sh) != job.stamp) {
    spdlog::warn(
        "{}/{}: changed in its stored shard since its close (written through another "
        "descriptor); left as one shard",
        job.dir_display, job.name);
    return std::vector<std::string>{};
  }
  CKPTFS_CHECK(staged.tx->set_owner(sh.st_uid, sh.st_gid, sh.st_mode));
  const auto info = flush::CommitInfo::of(job.name, job.k, job.m, job.header, job.size, sh);
  // Durable: the one shard may already be (the writer's fsync, or a sync since its close), and
  // the record must never name shards a power loss could leave unwritten.
  CKPTFS_CHECK(staged.tx->commit(info, true));
  spdlog::info("{}/{}: split into {} rank shards after its close", job.dir_display, job.name,
               staged.shards);
  return format::stored_names(job.name, job.k, job.m, staged.shards);
}

}  // namespace ckptfs::write
