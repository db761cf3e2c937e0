// fs/write_registry: the files open for writing through the mount, and what this daemon changed
// and finished writing: the evidence that a directory's changes were all its own (quiet_by_us).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "ckptfs/fs/seams.hpp"
#include "ckptfs/layout/checkpoint.hpp"
#include "ckptfs/source/scanner.hpp"
#include "ckptfs/write/file.hpp"

namespace ckptfs::fs {

using DevIno = std::pair<uint64_t, uint64_t>;

class WriteRegistry {
 public:
  explicit WriteRegistry(std::shared_ptr<const Clock> clock) : clock_(std::move(clock)) {}

  // The state of the file (dev, ino) while some handle has it open for writing.
  std::shared_ptr<write::WriteFile> find(uint64_t dev, uint64_t ino);
  // Whether a handle has file (dev, ino) open for writing now.
  [[nodiscard]] bool being_written(uint64_t dev, uint64_t ino) {
    auto w = find(dev, ino);
    return w && w->writers.load() > 0;
  }
  // Registers `wf` as the state of file `key`, opened in directory `dir`; returns the state
  // registered meanwhile by another opener (still linked) if any, else `wf`.
  std::shared_ptr<write::WriteFile> add(DevIno key, std::shared_ptr<write::WriteFile> wf,
                                        DevIno dir, bool shard_named);
  // Whether some file opened in directory `dir` is still open.
  [[nodiscard]] bool open_in(DevIno dir) const;
  // Files open for writing now.
  [[nodiscard]] size_t open_files() const;

  // Records that this daemon just changed directory (dev, ino).
  void touched(uint64_t dev, uint64_t ino);
  // Records that this daemon finished writing these files of directory `dirfd`, as they are.
  void produced(int dirfd, const std::vector<std::string>& names);
  // Whether every change of directory (dev, ino) up to `changed_ns` was this daemon's, and no
  // rank shard is still being written there, and every input of the checkpoint (`sig`) is a
  // file this daemon finished writing, as it is now: shards another writer put there (another
  // node, a job writing SRC directly) still wait for settle.
  bool quiet_by_us(uint64_t dev, uint64_t ino, int64_t changed_ns, const source::Signature& sig);

 private:
  // Files open for writing, by backing identity (the state of a file is keyed by its inode:
  // its final name only arrives with a rename).
  struct Writing {
    std::weak_ptr<write::WriteFile> wf;
    DevIno dir;                // the directory it was opened in
    bool shard_named = false;  // named like a rank shard (a DCP save into the view)
  };
  using StampKey = std::tuple<uint64_t, uint64_t, uint64_t, int64_t, int64_t>;
  static StampKey stamp_key(const layout::FileStamp& s) {
    return {s.dev, s.ino, s.size, s.mtime_ns, s.ctime_ns};
  }

  const std::shared_ptr<const Clock> clock_;
  // Guards every field below. Taken after DirState::mu, and held while a WriteFile's own lock
  // is taken (its dirty()); see node_table.hpp.
  mutable std::mutex mu_;
  std::map<DevIno, Writing> writes_;
  // When this daemon last changed each directory: a checkpoint written through the view shows
  // at once, with no settle wait.
  std::map<DevIno, int64_t> touched_ns_;
  std::set<StampKey> produced_;  // files this daemon finished writing, by stamp
};

}  // namespace ckptfs::fs
