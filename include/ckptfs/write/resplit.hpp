// write/resplit: after close, turns a file stored as its own one shard (adopted at close, no
// byte copied) into the rank shards the mount asked for (-o ranks=N), off the writer's path.
//
// A file the kernel wrote (write passthrough) and closed under a model name is committed at
// close as one shard: the file itself, linked under the shard's name (WriteFile). That is a
// complete stored form, so close() returns at once and nothing closed depends on what follows.
// The split into N shards then runs in the background: stage() copies the shard into a new
// staging (flush::Transaction) with no lock held, and commit() makes it the stored form under
// the directory's lock, but only if the one shard is still that file, unchanged (a new save
// under the name, a rename, an unlink or a write through a dup'd descriptor since leave the
// one shard as it is). A crash at any point leaves the one shard or the N: recover() removes
// an uncommitted staging and completes a committed one, as for any commit.
#pragma once

#include <sys/types.h>

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ckptfs/flush/flusher.hpp"
#include "ckptfs/format/safetensors.hpp"
#include "ckptfs/layout/shard_set.hpp"
#include "ckptfs/util/fd.hpp"
#include "ckptfs/util/result.hpp"
#include "ckptfs/write/plan.hpp"

namespace ckptfs::write {

// What the split needs, taken from the file at its one-shard commit.
struct ResplitJob {
  UniqueFd shard;                       // the one shard (the file as written), open
  UniqueFd dir;                         // its directory
  std::string dir_display, name, what;  // name: the model name it is stored under
  std::string dir_rel;                  // the directory beneath SRC, as at the close
  uint32_t k = 1, m = 1;                // the name's k of m
  std::string header;                   // the file's 8 + N header bytes
  std::shared_ptr<const format::Header> parsed;
  Plan plan;
  layout::ShardSet set;  // the N shard headers
  uint64_t size = 0;     // the file's size
  // The shard's inode, size, mtime and ctime after the one-shard commit: commit() goes ahead
  // only if the name still holds it, unchanged.
  dev_t dev = 0;
  ino_t ino = 0;
  std::array<int64_t, 5> stamp{};
};

// A split staged and not committed yet (aborted when dropped).
struct StagedResplit {
  std::unique_ptr<flush::Transaction> tx;
  uint32_t shards = 0;  // how many rank shards it stages
};

// Where a new stored form of `job`'s file is staged: its directory, with the owner and mode of
// the one shard (`st`, its fstat).
flush::Target resplit_target(const ResplitJob& job, const struct stat& st);

// Copies the one shard into the N staged shards of a new transaction of `flusher`.
Result<StagedResplit> stage_resplit(const ResplitJob& job, flush::Flusher& flusher);

// Makes the staged shards the stored form, if the name still holds the one shard unchanged;
// call it under the directory's lock. Returns the names the stored form is made of (relative
// to the directory), or an empty list when it was left as it is (the reason is logged).
Result<std::vector<std::string>> commit_resplit(const ResplitJob& job, StagedResplit staged);

// The stamp commit_resplit compares (an fstat of the shard).
std::array<int64_t, 5> shard_stamp(const struct stat& st);

}  // namespace ckptfs::write
