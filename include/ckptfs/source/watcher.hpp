// Close evidence for checkpoint directories: an inotify watch that records when the writer of a
// file closed it (IN_CLOSE_WRITE) and whether it was modified since (IN_MODIFY).
//
// A DCP save has no commit marker: each rank writes its shard under the final name. The close
// of a shard's last writer is the best evidence that the rank is done with it; the filesystem
// layer combines it with the structural checks (exact sizes, headers, tiling, mapping) to show
// a checkpoint the moment it is complete instead of after a quiet time.
//
// inotify sees changes made through this machine's kernel only: a shard written by another
// node of a shared filesystem has no event, so it is never "closed" here and falls back to the
// settle time. Events lost to a queue overflow drop every record (the safe direction).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "ckptfs/util/fd.hpp"
#include "ckptfs/util/result.hpp"

namespace ckptfs::source {

class CloseWatcher {
 public:
  // Called from the watcher's thread after a file of directory (dev, ino) was closed by a
  // writer. Must not block for long.
  using OnClose = std::function<void(uint64_t dev, uint64_t ino)>;

  // Null when inotify is unavailable (the caller then relies on settle alone).
  static std::unique_ptr<CloseWatcher> create(OnClose on_close, size_t max_dirs = 8192);
  ~CloseWatcher();
  CloseWatcher(const CloseWatcher&) = delete;
  CloseWatcher& operator=(const CloseWatcher&) = delete;

  // Starts watching the directory open as `dirfd`, whose identity is (dev, ino). Idempotent.
  // False when it cannot (the watch limit, or the kernel's).
  bool watch(int dirfd, uint64_t dev, uint64_t ino);

  // Whether the writer of `name` in directory (dev, ino) closed it after its last modification
  // seen here, at or after `mtime_ns` (the file's current mtime: a change whose event is still
  // queued is not mistaken for a closed file).
  [[nodiscard]] bool closed(uint64_t dev, uint64_t ino, const std::string& name,
                            int64_t mtime_ns) const;

  [[nodiscard]] size_t watched() const;

 private:
  CloseWatcher(UniqueFd inotify, UniqueFd wake, OnClose on_close, size_t max_dirs);
  void run();
  void drain();

  struct FileState {
    bool dirty = false;             // modified since the last close seen
    int64_t closed_ns = INT64_MIN;  // when the last close was seen (CLOCK_REALTIME)
  };
  struct Dir {
    uint64_t dev = 0, ino = 0;
    std::map<std::string, FileState> files;
  };

  UniqueFd inotify_;
  UniqueFd wake_;  // eventfd: stops the thread
  OnClose on_close_;
  size_t max_dirs_;
  mutable std::mutex mu_;                               // guards dirs_ and by_id_
  std::map<int, Dir> dirs_;                             // by watch descriptor
  std::map<std::pair<uint64_t, uint64_t>, int> by_id_;  // (dev, ino) -> watch descriptor
  std::thread thread_;
};

}  // namespace ckptfs::source
