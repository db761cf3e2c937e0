// fuse/config: where every mount option the user left open and every host tuning is decided
// (threads, prefetch, passthrough, the bdi's read-ahead, the file limit, where the log goes),
// and logged once.
#pragma once

#include <string>

#include "ckptfs/fs/prefetch.hpp"
#include "ckptfs/fuse/adapter.hpp"

namespace ckptfs::fuse {

struct Decided {
  MountOptions opts;  // every std::optional the user left empty, filled
  fs::Machine machine;
};

// The process set up for serving (the file limit raised, no umask of its own: the kernel
// already applied the caller's to the modes it sends) and the options decided for this
// machine: threads and prefetch by its cores and memory, passthrough only as root.
Decided decide(const MountOptions& given);

// The mount's bdi "major:minor" from /proc/self/mountinfo (no stat: that would call ourselves).
std::string mount_devnum(const std::string& mnt);
// The bdi's read_ahead_kb (0: left as it is). The kernel caps it at INIT: set after that.
void set_read_ahead(const std::string& devnum, unsigned kb);
// A daemon in the background logs to the log file, or to syslog.
void setup_background_logging(const MountOptions& o);
// The one line saying how the read path was set up.
void log_read_path(const Decided& d, bool backing);

}  // namespace ckptfs::fuse
