// The source layer: reading a backing directory into checkpoints, and revalidating cheaply.
//
// A directory is a checkpoint when it holds at least one rank shard file
// (shard-R-model-K-of-M.safetensors). Its inputs are those shards plus, when present,
// .hf_metadata/fqn_to_file_index_mapping.json.
#pragma once

#include <sys/stat.h>

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

layout::FileStamp stamp_of(const struct stat& st);
// Any entry named like a rank shard (shard-*.safetensors), whatever its type: it belongs to
// the checkpoint, and one that is not a well-formed regular shard makes it invalid.
bool is_shard_entry(const DirEntry& e);
bool has_shards(const std::vector<DirEntry>& entries);

// What the checkpoint build depends on: each shard's and the mapping file's stamp.
struct Signature {
  std::vector<std::pair<std::string, layout::FileStamp>> files;
  int64_t newest_mtime_ns = 0;   // newest content change of any input
  int64_t newest_change_ns = 0;  // newest mtime or ctime (a rename-in changes only ctime)
  bool operator==(const Signature& o) const { return files == o.files; }
};
Signature signature_of(int dirfd, const std::vector<DirEntry>& entries);

// Parsed shard headers keyed by file identity, so a revalidation after one shard changes
// re-reads only that shard. Thread-safe.
class HeaderCache {
 public:
  explicit HeaderCache(size_t max_entries = 1u << 16) : max_entries_(max_entries) {}

  struct Entry {
    std::shared_ptr<const format::Header> header;
    std::string error;
  };
  std::optional<Entry> find(const layout::FileStamp& s);
  void put(const layout::FileStamp& s, Entry e);

 private:
  using Key = std::tuple<uint64_t, uint64_t, uint64_t, int64_t, int64_t>;
  static Key key(const layout::FileStamp& s) {
    return {s.dev, s.ino, s.size, s.mtime_ns, s.ctime_ns};
  }
  size_t max_entries_;
  std::mutex mu_;  // guards map_
  std::map<Key, Entry> map_;
};

// Reads and builds the checkpoint held by `dirfd`. `display` names the directory in
// messages. Never fails: problems are recorded in the result.
std::shared_ptr<const layout::Checkpoint> load_checkpoint(int dirfd,
                                                          const std::vector<DirEntry>& entries,
                                                          const std::string& display,
                                                          HeaderCache& cache,
                                                          const layout::BuildOptions& opts = {});

// The same from a path.
Result<std::shared_ptr<const layout::Checkpoint>> load_checkpoint_path(const std::string& dir);

// Every directory at or below `root` that holds rank shards (symlinks not followed), sorted.
Result<std::vector<std::string>> find_checkpoint_dirs(const std::string& root);

}  // namespace ckptfs::source
