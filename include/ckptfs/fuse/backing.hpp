// fuse/backing: FUSE passthrough on libfuse 3.14, whose API lacks it: the INIT and OPEN
// replies are amended in the session's writev hook, and backing files registered by ioctl.
#pragma once

#include <cstdint>
#include <mutex>
#include <unordered_map>

struct fuse_session;

namespace ckptfs::fuse {

// Linux 6.9+ (CONFIG_FUSE_PASSTHROUGH) serves an open file from a backing file the daemon
// registered (FUSE_DEV_IOC_BACKING_OPEN, CAP_SYS_ADMIN): reads, writes and mmap go to that
// file's page cache, large folios and all, and no request reaches the daemon. libfuse 3.14
// negotiates no FUSE_PASSTHROUGH and zeroes fuse_open_out.backing_id, so this class amends
// the two replies as they are written (the reply to a request is written by the thread that
// handles it, right after the handler calls fuse_reply_*).
class Backing {
 public:
  Backing() = default;
  Backing(const Backing&) = delete;
  Backing& operator=(const Backing&) = delete;

  // Installs the session's I/O hooks (read, writev, and splice, which libfuse offers with
  // custom I/O only if hooked). After fuse_session_mount, before the loop.
  bool install(fuse_session* se);
  // In init(): the INIT reply this thread writes next asks for passthrough.
  void ask_in_init();
  // Registers `fd` as `ino`'s backing file, once while backed opens of `ino` are live: the id
  // for the OPEN reply, or 0 where the kernel refuses (no CAP_SYS_ADMIN, passthrough not
  // negotiated, SRC itself on a stacked file system); then passthrough is off for the mount.
  int acquire(uint64_t ino, int fd);
  // The OPEN or CREATE reply this thread writes next is served from backing file `id`.
  static void mark_next_open(int id);
  // Forgets a mark that no reply used (the reply failed).
  static void clear_mark();
  // A backed open of `ino` was released: the last one lets its backing file go.
  void release(uint64_t ino);

 private:
  struct Entry {
    int id = 0;
    uint32_t refs = 0;
  };
  int dev_fd_ = -1;
  mutable std::mutex mu_;  // guards ids_ and broken_
  std::unordered_map<uint64_t, Entry> ids_;
  bool broken_ = false;  // the kernel refused once: no more attempts
};

}  // namespace ckptfs::fuse
