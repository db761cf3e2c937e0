// The FUSE adapter: the only code that includes libfuse. It translates low-level requests
// into fs::Filesystem calls, replies, pushes prefetched pages and kernel invalidations.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "ckptfs/fs/filesystem.hpp"

namespace ckptfs::fuse {

struct MountOptions {
  std::string source;
  std::string mountpoint;
  bool foreground = false;
  // Unset: chosen from the machine by fs::tune_read_path when the mount starts.
  std::optional<unsigned> threads;           // max FUSE worker threads
  std::optional<bool> prefetch;              // push consolidated files into the page cache
  std::optional<unsigned> prefetch_threads;  // push threads (each inode: all of them)
  bool splice = false;                       // reply with fd-backed buffers spliced by the kernel
  unsigned read_ahead_kb = 8192;             // the mount's bdi read_ahead_kb (0: leave the default)
  // Plain files opened for reading are served by the kernel from their file in SRC (FUSE
  // passthrough, Linux 6.9+, as root). Unset: on for a read-only mount, where no write can
  // meet a backed reader (a write open of a file being read that way is refused, ETXTBSY).
  std::optional<bool> passthrough;
  // With passthrough, files opened for writing are written by the kernel into their file in
  // SRC too (no WRITE request; the daemon splits a consolidated file at close). Unset: on.
  std::optional<bool> write_passthrough;
  unsigned max_read = 0;     // -o max_read: the largest FUSE_READ (0: libfuse's, 1 MiB here)
  bool auto_unmount = true;  // unmount if the daemon dies (fusermount3 watchdog)
  double attr_timeout = 1.0;
  double entry_timeout = 1.0;
  std::vector<std::string> fuse_opts;  // passed to libfuse as -o
  std::string log_file;                // daemonized: log here (else syslog)
  std::string log_level = "info";
  fs::Options fs;
};

// Mounts, serves until unmounted or signalled, and cleans up. Returns the exit status.
// Without `foreground` it returns in the parent as soon as the mount is ready.
int run_mount(const MountOptions& opts);

}  // namespace ckptfs::fuse
