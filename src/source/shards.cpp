// source/shards: the one shard opener (see include/ckptfs/source/shards.hpp).
#include "ckptfs/source/shards.hpp"

#include <sys/stat.h>

#include <string>

#include "ckptfs/source/scanner.hpp"
#include "ckptfs/util/path.hpp"

namespace ckptfs::source {

Result<UniqueFd> open_shard(const layout::Checkpoint& ck, uint32_t shard, int dirfd,
                            std::string_view display, std::string_view verb) {
  const layout::ShardFile& s = ck.shards.at(shard);
  if (s.remote()) {
    return make_error(EIO,
                      "{}/{}: stored on the node-local target of MPI rank {} ({}); {} it through "
                      "the mount of its `mpirun ckptfs mount -o target=...` job",
                      display, s.name, s.owner, s.remote_path, verb);
  }
  struct stat st {};
  const std::string what = fmt::format("{}/{}", display, s.name);
  Result<UniqueFd> fd = s.name.find('/') == std::string::npos
                            ? open_regular_at(dirfd, s.name, what, &st)
                            : open_regular_beneath(dirfd, s.name, Resolve::Auto, &st);
  if (!fd) {
    if (s.name.find('/') == std::string::npos) return fd;
    return make_error(fd.error().code, "{}/{}", display, fd.error().message);
  }
  if (stamp_of(st) != s.stamp) {
    return make_error(ESTALE, "{}: changed since the checkpoint was read", what);
  }
  return fd;
}

Result<std::vector<UniqueFd>> open_shards(const layout::Checkpoint& ck, int dirfd,
                                          std::string_view display, std::string_view verb,
                                          RemoteShards remote) {
  std::vector<UniqueFd> fds(ck.shards.size());
  for (uint32_t s = 0; s < ck.shards.size(); ++s) {
    if (ck.shards[s].remote() && remote == RemoteShards::Skip) continue;
    CKPTFS_TRY(fds[s], open_shard(ck, s, dirfd, display, verb));
  }
  return fds;
}

}  // namespace ckptfs::source
