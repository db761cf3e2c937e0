// The source layer: reading a backing directory into checkpoints, and revalidating cheaply.
//
// A directory is a checkpoint when it holds at least one rank shard file
// (shard-R-model-K-of-M.safetensors), or commit records of shards on node-local targets, or a
// torch DCP checkpoint (.metadata and *.distcp: source/distcp.hpp), or a verl FSDP checkpoint
// (fsdp_config.json and model_world_size_W_rank_R.pt: source/verl.hpp), or the parent of
// accelerate's pytorch_model_fsdp_0/ DCP folder (source/distcp.hpp). The inputs of the first two
// are those shards plus, when present, .hf_metadata/fqn_to_file_index_mapping.json.
#pragma once

#include <sys/stat.h>

#include <climits>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "ckptfs/layout/checkpoint.hpp"
#include "ckptfs/util/result.hpp"

namespace ckptfs::source {

struct DirEntry {
  std::string name;
  struct stat st {};  // lstat: symlinks are not followed
};

// Every entry of an open directory except "." and ".." and `skip` (never even stat'ed: the
// view's own mount point when it lies inside the source), sorted by name.
Result<std::vector<DirEntry>> list_dir(int dirfd, std::string_view skip = {});

// list_dir, plus, where the directory holds accelerate's FSDP folder (pytorch_model_fsdp_0/,
// source/distcp.hpp), that folder's DCP files under "pytorch_model_fsdp_0/<name>": the
// entries a checkpoint of this directory is detected, signed and built from. (A listing for
// display uses list_dir.) The folder is opened without following a symlink.
Result<std::vector<DirEntry>> list_checkpoint_dir(int dirfd, std::string_view skip = {});

layout::FileStamp stamp_of(const struct stat& st);
// Any entry named like a rank shard (shard-*.safetensors), whatever its type. In a checkpoint
// directory it belongs to the checkpoint (hidden from the view), and one that is not a
// well-formed regular shard makes the checkpoint invalid.
bool is_shard_entry(const DirEntry& e);
// A regular file named exactly shard-R-model-K-of-M.safetensors. Only these make a directory a
// checkpoint: a stray symlink or directory with a shard-like name does not.
bool is_rank_shard(const DirEntry& e);
bool has_shards(const std::vector<DirEntry>& entries);
// A directory with no shard files of its own whose commit records name shards on node-local
// targets (version 2, the OpenMPI flusher's -o target=) is a checkpoint too.
bool has_remote_records(int dirfd, const std::vector<DirEntry>& entries);
// has_shards(), a torch DCP checkpoint (source/distcp.hpp), a verl FSDP checkpoint
// (source/verl.hpp) or has_remote_records(): what makes a directory a checkpoint directory.
bool is_checkpoint_dir(int dirfd, const std::vector<DirEntry>& entries);
// An entry the checkpoint is built from: a rank shard, a DCP checkpoint's .metadata or
// .distcp file (in accelerate's folder too), a verl checkpoint's fsdp_config.json or model
// rank file, or accelerate's folder itself (a directory: searching it is what counts). Its owner
// and mode decide who may read what the view makes of it.
bool is_input_entry(const DirEntry& e);

// What the checkpoint build depends on: each shard's and the mapping file's stamp.
struct Signature {
  std::vector<std::pair<std::string, layout::FileStamp>> files;
  // Newest content change of any input, and newest mtime or ctime (a rename-in changes only
  // ctime). INT64_MIN when there is none: times before 1970 are negative, not zero.
  int64_t newest_mtime_ns = INT64_MIN;
  int64_t newest_change_ns = INT64_MIN;
  bool operator==(const Signature& o) const { return files == o.files; }
};
Signature signature_of(int dirfd, const std::vector<DirEntry>& entries);

// Parsed shard headers, so a revalidation after one shard changes re-reads only that shard.
// One entry per file identity (dev, ino): a newer stamp of the same file replaces the older
// one. The total is bounded by an estimate of the bytes held, least recently used first out,
// so rewritten shards and deleted steps cannot grow the daemon. Thread-safe.
class HeaderCache {
 public:
  explicit HeaderCache(uint64_t max_bytes = 64ull << 20) : max_bytes_(max_bytes) {}

  struct Entry {
    std::shared_ptr<const format::Header> header;
    std::string error;
  };
  std::optional<Entry> find(const layout::FileStamp& s);
  void put(const layout::FileStamp& s, Entry e);
  // Drops the entry of that file, if it holds this stamp (a directory the kernel forgot: its
  // shards are likely gone, and re-reading one header later is cheap).
  void evict(const layout::FileStamp& s);

  [[nodiscard]] uint64_t bytes() const;

 private:
  using Key = std::pair<uint64_t, uint64_t>;  // (dev, ino)
  struct Item {
    layout::FileStamp stamp;
    Entry entry;
    uint64_t bytes = 0;
    std::list<Key>::iterator lru;
  };
  void erase_locked(std::map<Key, Item>::iterator it);

  uint64_t max_bytes_;
  mutable std::mutex mu_;  // guards map_, lru_ and bytes_
  std::map<Key, Item> map_;
  std::list<Key> lru_;  // most recently used first
  uint64_t bytes_ = 0;
};

// Whether a file or directory of the write path's state may be trusted: owned by root or by
// this process's user, and writable by no one else. Only the daemon writes .ckptfs; records
// anyone else could have made or changed are never a source of bytes or of permissions.
bool trusted_state(const struct stat& st);

// The commit records of the write path in a directory (.ckptfs/*.commit), as (relative path,
// lstat) pairs; empty when `entries` has no .ckptfs directory. Only trusted ones (above):
// `untrusted`, when given, counts the records (or the .ckptfs directory) left out for that.
std::vector<std::pair<std::string, struct stat>> record_files(int dirfd,
                                                              const std::vector<DirEntry>& entries,
                                                              size_t* untrusted = nullptr);

// Adds to `in` the output overrides of every valid commit record of the directory, and a
// problem for each one that cannot be used yet (a commit still being completed). Records that
// no longer match the shards are stale, and untrusted ones are not read: both are ignored,
// with a note (in.notes) saying so. Linear in the records' shards and the directory's entries.
void read_records(int dirfd, const std::vector<DirEntry>& entries, const std::string& display,
                  layout::BuildInput& in);

// What load_checkpoint builds from: the shards' headers (through `cache`), the mapping files
// and the commit records of `entries` (a listing of `dirfd`, or part of one).
layout::BuildInput read_input(int dirfd, const std::vector<DirEntry>& entries,
                              const std::string& display, HeaderCache& cache,
                              const layout::BuildOptions& opts = {});

// Reads and builds the checkpoint held by `dirfd`. `display` names the directory in
// messages. Never fails: problems are recorded in the result.
std::shared_ptr<const layout::Checkpoint> load_checkpoint(int dirfd,
                                                          const std::vector<DirEntry>& entries,
                                                          const std::string& display,
                                                          HeaderCache& cache,
                                                          const layout::BuildOptions& opts = {});

// The same from a path.
Result<std::shared_ptr<const layout::Checkpoint>> load_checkpoint_path(
    const std::string& dir, const layout::BuildOptions& opts = {});

// Directories searched below a root: at most this many levels down.
inline constexpr int kMaxSearchDepth = 64;

struct Found {
  std::vector<std::string> dirs;      // holding rank shards, sorted
  std::vector<std::string> too_deep;  // directories not searched: deeper than kMaxSearchDepth
};

// Every directory at or below `root` that holds rank shards (symlinks not followed).
Result<Found> find_checkpoint_dirs(const std::string& root);

}  // namespace ckptfs::source
