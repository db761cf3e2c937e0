// source/shards: the one shard opener, used by the mount, consolidate, the loader and verify.
#pragma once

#include <string_view>
#include <vector>

#include "ckptfs/layout/checkpoint.hpp"
#include "ckptfs/util/fd.hpp"
#include "ckptfs/util/result.hpp"

namespace ckptfs::source {

// What to do with a shard the record places on an MPI rank's node-local target: only the mount
// of that `mpirun` job can read it (through its flusher).
enum class RemoteShards {
  Refuse,  // EIO naming the shard, the rank and its path, and saying where to read it
  Skip,    // its slot is left invalid (the mount reads it through the flusher)
};

// Opens every shard of `ck` beneath the checkpoint directory `dirfd` (`display` names the
// directory in messages), in shard order. Each is opened as open_regular_at does (a FIFO
// cannot block the open; anything but a regular file is refused), a name in a folder
// (accelerate's pytorch_model_fsdp_0/) is resolved without following a symlink, and each must
// still be the file the checkpoint's build stamped: otherwise ESTALE naming it. `verb` says
// what the caller does ("consolidate", "load"), for the node-local refusal.
Result<std::vector<UniqueFd>> open_shards(const layout::Checkpoint& ck, int dirfd,
                                          std::string_view display, std::string_view verb,
                                          RemoteShards remote = RemoteShards::Refuse);

// One shard, as open_shards opens it (for a caller that opens them one at a time).
Result<UniqueFd> open_shard(const layout::Checkpoint& ck, uint32_t shard, int dirfd,
                            std::string_view display, std::string_view verb);

}  // namespace ckptfs::source
