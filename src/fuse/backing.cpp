// fuse/backing: FUSE passthrough through libfuse 3.14's custom I/O hooks and the raw ioctls.
#include "ckptfs/fuse/backing.hpp"

#include <fcntl.h>
#include <fuse_lowlevel.h>
#include <sys/ioctl.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <spdlog/spdlog.h>

namespace ckptfs::fuse {
namespace {

// The kernel's UAPI from protocol 7.40 (include/uapi/linux/fuse.h, Linux 6.9), which Debian
// 12's headers (libfuse 3.14: 7.38; linux-libc-dev 6.1) predate.
constexpr uint32_t kFlags2Passthrough = 1u << (37 - 32);  // FUSE_PASSTHROUGH, in flags2
constexpr uint32_t kFopenPassthrough = 1u << 7;           // FOPEN_PASSTHROUGH
struct BackingMap {                                       // struct fuse_backing_map
  int32_t fd;
  uint32_t flags;
  uint64_t padding;
};
constexpr unsigned long kBackingOpen = _IOW(229, 1, BackingMap);  // FUSE_DEV_IOC_BACKING_OPEN
constexpr unsigned long kBackingClose = _IOW(229, 2, uint32_t);   // FUSE_DEV_IOC_BACKING_CLOSE

struct OutHeader {  // struct fuse_out_header
  uint32_t len;
  int32_t error;
  uint64_t unique;
};
// struct fuse_init_out from 7.36 on: flags2 at 32; 7.40 puts max_stack_depth at 36, where
// 7.38 has unused[0] (zero).
constexpr size_t kInitFlags2 = 32, kInitStackDepth = 36, kInitMinSize = 40;
struct OpenOut {  // struct fuse_open_out, 7.40 (backing_id was padding before)
  uint64_t fh;
  uint32_t open_flags;
  int32_t backing_id;
};

// What this thread's next reply is to carry. Set by a handler right before its fuse_reply_*,
// consumed by the writev hook on the same thread.
thread_local bool t_init = false;
thread_local int t_open_id = 0;
constexpr size_t kEntryOutSize = 128;  // struct fuse_entry_out, which a CREATE reply leads with

ssize_t hook_writev(int fd, struct iovec* iov, int count, void*) {
  if (count >= 2 && iov[0].iov_len >= sizeof(OutHeader)) {
    const auto* h = static_cast<const OutHeader*>(iov[0].iov_base);
    if (t_init && h->error == 0 && iov[1].iov_len >= kInitMinSize) {
      auto* p = static_cast<char*>(iov[1].iov_base);
      uint32_t flags2 = 0, depth = 1;  // backing files on a plain file system only
      std::memcpy(&flags2, p + kInitFlags2, sizeof flags2);
      flags2 |= kFlags2Passthrough;
      std::memcpy(p + kInitFlags2, &flags2, sizeof flags2);
      std::memcpy(p + kInitStackDepth, &depth, sizeof depth);
    } else if (t_open_id > 0 && h->error == 0 &&
               (iov[1].iov_len == sizeof(OpenOut) ||
                iov[1].iov_len == kEntryOutSize + sizeof(OpenOut))) {
      // An OPEN reply is fuse_open_out; a CREATE reply fuse_entry_out, then fuse_open_out.
      auto* p = static_cast<char*>(iov[1].iov_base) + (iov[1].iov_len - sizeof(OpenOut));
      OpenOut o;
      std::memcpy(&o, p, sizeof o);
      o.open_flags |= kFopenPassthrough;
      o.backing_id = t_open_id;
      std::memcpy(p, &o, sizeof o);
    }
  }
  t_init = false;
  t_open_id = 0;
  return ::writev(fd, iov, count);
}

ssize_t hook_read(int fd, void* buf, size_t len, void*) { return ::read(fd, buf, len); }

ssize_t hook_splice(int fdin, off_t* offin, int fdout, off_t* offout, size_t len,
                    unsigned int flags, void*) {
  return ::splice(fdin, offin, fdout, offout, len, flags);
}

}  // namespace

bool Backing::install(fuse_session* se) {
  static const fuse_custom_io io = {hook_writev, hook_read, hook_splice, hook_splice};
  dev_fd_ = fuse_session_fd(se);
  return fuse_session_custom_io(se, &io, dev_fd_) == 0;
}

void Backing::ask_in_init() { t_init = true; }

int Backing::acquire(uint64_t ino, int fd) {
  std::lock_guard lock(mu_);
  if (broken_ || dev_fd_ < 0) return 0;
  Entry& e = ids_[ino];
  if (e.refs == 0) {
    BackingMap m{fd, 0, 0};
    const int id = ::ioctl(dev_fd_, kBackingOpen, &m);
    if (id <= 0) {
      spdlog::warn(
          "FUSE passthrough is off for this mount: the kernel refused a backing file "
          "({}); plain files are read and written through the daemon",
          std::strerror(errno));
      ids_.erase(ino);
      broken_ = true;
      return 0;
    }
    e.id = id;
  }
  ++e.refs;
  return e.id;
}

void Backing::mark_next_open(int id) { t_open_id = id; }
void Backing::clear_mark() { t_open_id = 0; }

void Backing::release(uint64_t ino) {
  std::lock_guard lock(mu_);
  auto it = ids_.find(ino);
  if (it == ids_.end() || --it->second.refs > 0) return;
  // The kernel holds its own reference for every open file it backed; the id only lets
  // new opens find the file.
  auto id = static_cast<uint32_t>(it->second.id);
  if (::ioctl(dev_fd_, kBackingClose, &id) != 0) {
    spdlog::debug("backing file {} of inode {}: close: {}", id, ino, std::strerror(errno));
  }
  ids_.erase(it);
}

}  // namespace ckptfs::fuse
