// fuse/config: the mount options left open decided for this machine, host tuning (file limit,
// read-ahead, logging), each logged once.
#include "config.hpp"

#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <climits>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/syslog_sink.h>
#include <spdlog/spdlog.h>

#include "ckptfs/util/text.hpp"

namespace ckptfs::fuse {
namespace {

void raise_fd_limit() {
  struct rlimit rl {};
  if (::getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &rl);
  }
}

}  // namespace

Decided decide(const MountOptions& given) {
  raise_fd_limit();
  // The kernel already applied the caller's umask to the modes it sends: the daemon's own
  // must not mask them again.
  ::umask(0);
  Decided d;
  d.opts = given;
  MountOptions& o = d.opts;
  d.machine = fs::probe_machine();
  const fs::ReadTuning tune = fs::tune_read_path(d.machine);
  if (!o.threads) o.threads = tune.fuse_threads;
  if (!o.prefetch) o.prefetch = tune.prefetch;
  if (!o.prefetch_threads) o.prefetch_threads = tune.prefetch_threads;
  if (o.passthrough.value_or(o.fs.read_only) && ::geteuid() != 0) {
    if (o.passthrough) spdlog::warn("passthrough=on needs root (CAP_SYS_ADMIN): off");
    o.passthrough = false;
  }
  if (o.write_passthrough.value_or(false) && ::geteuid() != 0) {
    spdlog::warn("write_passthrough=on needs root (CAP_SYS_ADMIN): off");
  }
  o.fs.backing_writes = !o.fs.read_only && ::geteuid() == 0 && o.write_passthrough.value_or(true);
  // Read passthrough by default wherever a writer of the same file is backed too (it joins the
  // readers, fs/io_modes.hpp): a read-only mount, or a read-write one with write passthrough.
  o.fs.backing = o.passthrough.value_or(o.fs.read_only || o.fs.backing_writes);
  o.fs.backing_where_writable = !o.passthrough && !o.fs.read_only;
  return d;
}

std::string mount_devnum(const std::string& mnt) {
  char real[PATH_MAX];
  std::string want = ::realpath(mnt.c_str(), real) ? std::string(real) : mnt;
  std::ifstream f("/proc/self/mountinfo");
  std::string line, found;
  while (std::getline(f, line)) {
    std::istringstream ss(line);
    std::string id, parent, dev, root, point;
    ss >> id >> parent >> dev >> root >> point;
    std::string unescaped;
    for (size_t i = 0; i < point.size(); ++i) {
      if (point[i] == '\\' && i + 3 < point.size()) {
        unescaped += static_cast<char>(std::stoi(point.substr(i + 1, 3), nullptr, 8));
        i += 3;
      } else {
        unescaped += point[i];
      }
    }
    if (unescaped == want) found = dev;  // the last match is the topmost mount
  }
  return found;
}

void set_read_ahead(const std::string& dev, unsigned kb) {
  if (kb == 0 || dev.empty()) return;
  std::ofstream f("/sys/class/bdi/" + dev + "/read_ahead_kb");
  f << kb;
  f.close();
  if (!f) {
    spdlog::warn("could not set read_ahead_kb={} (bdi {})", kb, dev);
  } else {
    spdlog::debug("read_ahead_kb={} for bdi {}", kb, dev);
  }
}

void setup_background_logging(const MountOptions& o) {
  const auto level = spdlog::get_level();
  spdlog::drop("ckptfs");  // the foreground logger of the same name (also the default one)
  std::shared_ptr<spdlog::logger> logger;
  if (!o.log_file.empty()) {
    logger = spdlog::basic_logger_mt("ckptfs", o.log_file);
  } else {
    logger = spdlog::syslog_logger_mt("ckptfs", "ckptfs", LOG_PID, LOG_DAEMON);
  }
  logger->set_formatter(safe_log_formatter());
  logger->set_level(level);
  logger->flush_on(spdlog::level::info);
  spdlog::set_default_logger(logger);
}

void log_read_path(const Decided& d, bool backing) {
  const MountOptions& o = d.opts;
  const bool passthrough = backing && o.fs.backing;
  spdlog::info(
      "read path: {} cores, {} MiB available: threads={} prefetch={} (threads {}) splice={} "
      "passthrough={}",
      d.machine.cores, d.machine.mem_available >> 20, *o.threads, *o.prefetch ? "on" : "off",
      *o.prefetch_threads, o.splice ? "on" : "off", passthrough ? "on" : "off");
  if (o.fs.read_only) return;
  if (backing && o.fs.backing_writes) {
    spdlog::info(
        "write path: passthrough (the kernel writes files into SRC itself; a consolidated file "
        "is stored at close as its own one shard, and split into rank shards after it)");
  } else {
    spdlog::info("write path: FUSE requests ({})",
                 o.fs.backing_writes ? "libfuse refused the I/O hooks passthrough needs"
                 : ::geteuid() != 0  ? "passthrough needs root"
                                     : "write_passthrough=off");
  }
}

}  // namespace ckptfs::fuse
