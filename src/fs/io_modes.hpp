// fs/io_modes: which opens of a file the kernel serves from its backing file in SRC (FUSE
// passthrough) and which through the mount's page cache; the kernel refuses to mix the two.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string_view>
#include <unordered_map>

#include "ckptfs/fs/filesystem.hpp"
#include "ckptfs/util/result.hpp"

namespace ckptfs::fs {

// Linux (fs/fuse/iomode.c, 6.9+) fails open(2) with EIO when one inode has a passthrough open
// and a cached one at once. The daemon therefore decides per inode: an open is backed only
// while no cached open of the inode is live, and a cached open (a write the kernel cannot
// write itself) is refused with ETXTBSY, naming the file, while backed opens are live. A
// backed write open joins backed readers: the kernel opens each backed open's own file, with
// that open's flags, from the path of the inode's backing id (fs/fuse/passthrough.c), so the
// file a reader's open registered takes the writer's writes. The kernel lets a backed open go
// at close(2) but tells the daemon (RELEASE) a moment later, so a cached open waits up to
// `grace` for the releases of backed opens that already closed.
class IoModes {
 public:
  explicit IoModes(std::chrono::milliseconds grace = std::chrono::milliseconds(200))
      : grace_(grace) {}
  // A read-only open that could be backed: true if it is (counted as backed), false if it must
  // go through the page cache (counted as cached).
  bool open_read(Ino ino, bool could_back);
  // An open through the page cache (writing): ETXTBSY while backed opens of `ino` are live.
  Status open_cached(Ino ino, std::string_view rel);
  // A write open that could be backed (write passthrough): true if it is (counted as backed,
  // beside backed readers too), false if it goes through the page cache (counted as cached,
  // beside other cached opens). Never waits.
  bool open_write(Ino ino);
  // A backed open the kernel could not back after all (the ioctl failed): counted as cached.
  void demote(Ino ino);
  void release(Ino ino, bool backed);
  // Whether backed opens of `ino` are live (one hash lookup).
  [[nodiscard]] bool has_backed(Ino ino) const;
  [[nodiscard]] uint64_t backed_opens() const;
  [[nodiscard]] uint64_t backed_writes() const;

 private:
  struct Counts {
    uint32_t backed = 0, cached = 0;
  };
  const std::chrono::milliseconds grace_;
  mutable std::mutex mu_;       // guards open_, total_backed_ and backed_writes_; a leaf
  std::condition_variable cv_;  // a backed open was released
  std::unordered_map<Ino, Counts> open_;
  uint64_t total_backed_ = 0;   // backed opens ever made (status)
  uint64_t backed_writes_ = 0;  // of them, write opens (status)
};

}  // namespace ckptfs::fs
