// One rank's shard storage under its target directory: what an OpenMPI rank does with the
// head's commands (flush/mpi_dispatch.cpp), and what the head does itself for the shards it
// owns. Pure POSIX, no MPI: unit-tested on its own.
//
// Two ways a shard file comes to be held:
//  - shared target (open_staged): the head made the staged file in SRC, which every rank sees;
//    the store opens it by its path and writes into it.
//  - node-local target (create): the store makes the shard itself, under its own root, at
//      <rel>/.ckptfs/nl-<epoch>-<n>/rank-0000i       while the file is written,
//      <rel>/.ckptfs/nl-<epoch>-<n>/shard-...safetensors   once sealed (seal()),
//    where <rel> mirrors the file's directory under SRC. The head's commit record (a version 2
//    record in SRC) names the sealed path: a directory renamed in SRC keeps reading the same
//    shards, and one written again gets a new nl- directory, never the old one's files. Such a
//    directory is removed when its file is replaced or removed (drop()), or, left by a crash,
//    by sweep() at the next mount: every nl- directory no record names.
//
// Every path from the head is relative to the root and resolved beneath it with no symlink
// followed (util/path.hpp): a command can never reach outside the target. Thread-safe.
#pragma once

#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>

#include "ckptfs/util/fd.hpp"
#include "ckptfs/util/result.hpp"

namespace ckptfs::flush {

// Name prefix of a node-local transaction's directory (sweep() removes only these).
inline constexpr std::string_view kNodeLocalTxPrefix = "nl-";

class ShardStore {
 public:
  // `root_path` must be an existing directory.
  static Result<std::unique_ptr<ShardStore>> open(const std::string& root_path);
  ShardStore(const ShardStore&) = delete;
  ShardStore& operator=(const ShardStore&) = delete;

  [[nodiscard]] const std::string& root_path() const { return root_path_; }

  // Shared target: opens the staged shard at `rel` (a regular file the head made).
  Status open_staged(uint64_t tx, uint32_t shard, std::string_view rel);
  // Node-local target: makes <rel>/.ckptfs/<txname>/rank-{shard+1:05d}, `size` bytes (sparse),
  // making the directories as needed. `txname` must start with kNodeLocalTxPrefix.
  Status create(uint64_t tx, std::string_view txname, uint32_t shard, std::string_view rel,
                uint64_t size);
  // pwrite into a held shard. A failure is returned and latched: sync(), seal() and read()
  // report it again (a rank's writes get no reply). A shard not held (aborted meanwhile) is
  // ignored.
  Status write(uint64_t tx, uint32_t shard, uint64_t off, std::string_view bytes);
  // The shard's bytes as written so far; never a shard whose writes failed.
  Status read(uint64_t tx, uint32_t shard, uint64_t off, char* dst, size_t n);
  // fsyncs every shard of `tx` held here; the first latched or fsync error.
  Status sync(uint64_t tx);
  // Node-local: fsyncs the shard, names it `name` in its directory and fsyncs the directories
  // from it up to the root. Returns its path relative to the root (what the record names).
  Result<std::string> seal(uint64_t tx, uint32_t shard, std::string_view name);
  // Forgets `tx` (committed, or aborted by the head).
  void close(uint64_t tx);
  // Forgets `tx` and removes the node-local directories it created (nothing was committed).
  void abort(uint64_t tx);

  // Reads n bytes at `off` of the committed shard at `path`, which must be a regular file of
  // `size` bytes. Descriptors of recently read shards are cached (checked against the path's
  // current identity at each read).
  Status read_path(std::string_view path, uint64_t size, uint64_t off, char* dst, size_t n);
  // Removes a committed node-local directory: `path` is <rel>/.ckptfs/nl-..., named by a
  // record that was replaced or removed. Then removes the empty directories above it.
  Status drop(std::string_view path);
  // Removes every <...>/.ckptfs/nl-* directory below the root that is not in `keep` (names of
  // directories some record names) and not held by a live transaction. Returns how many.
  Result<uint64_t> sweep(const std::set<std::string, std::less<>>& keep);

  // Tests: writes fail with ENOSPC once `after` bytes were written (-o mpi_fault).
  void inject_enospc_after(uint64_t after);

  // Shard bytes written so far.
  [[nodiscard]] uint64_t written() const;

 private:
  struct Held {
    UniqueFd fd;
    std::string path;          // relative to the root
    bool created = false;      // made by create(): its directory goes with an abort
    std::mutex mu;             // guards err
    std::optional<Error> err;  // the first failed write
  };
  struct Cached {
    std::shared_ptr<const UniqueFd> fd;
    uint64_t dev = 0, ino = 0, size = 0;
    std::list<std::string>::iterator lru;
  };

  explicit ShardStore(UniqueFd root, std::string root_path)
      : root_(std::move(root)), root_path_(std::move(root_path)) {}
  std::shared_ptr<Held> find(uint64_t tx, uint32_t shard);
  std::string show(std::string_view rel) const;
  void forget(uint64_t tx, bool remove);

  UniqueFd root_;
  std::string root_path_;
  mutable std::mutex mu_;  // guards held_, cache_, lru_, written_, fault_after_
  std::map<std::pair<uint64_t, uint32_t>, std::shared_ptr<Held>> held_;  // (tx, shard)
  std::map<std::string, Cached, std::less<>> cache_;                     // read_path descriptors
  std::list<std::string> lru_;  // cache_ keys, most recent first
  uint64_t written_ = 0;
  std::optional<uint64_t> fault_after_;
};

}  // namespace ckptfs::flush
