// The single `ckptfs` binary: subcommand dispatch.
#include <cstdio>
#include <span>
#include <string_view>
#include <vector>

#include <fmt/core.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "ckptfs/cli/args.hpp"
#include "ckptfs/util/text.hpp"

namespace {

constexpr std::string_view kUsage =
    R"(ckptfs )" CKPTFS_VERSION
    R"( - rank-sharded checkpoints as consolidated HuggingFace checkpoints

usage: ckptfs <command> [options]
       ckptfs SRC MNT [-o opts]        (the form mount.fuse3 uses; same as 'ckptfs mount')

commands:
  mount SRC MNT        present the shards under SRC as consolidated checkpoints at MNT
  inspect DIR          list checkpoints, tensors, chunk grids, output files and problems
  verify DIR           exit non-zero with one line per problem (--data checks replicas)
  consolidate SRC DST  write the consolidated checkpoint to DST (a real copy)
  load CKPT            load a checkpoint into memory (cpu or cuda:N), checksum, GB/s
  status MNT           what the daemon serving MNT is doing (--json for monitoring)
  version              version, libraries and optional features (also --version)

Run 'ckptfs <command> --help' for a command's options.
)";

}  // namespace

namespace {
int run(int argc, char** argv);
}  // namespace

// No exception leaves main: an error the commands did not expect is reported, never an abort.
int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::bad_alloc&) {
    std::fputs("ckptfs: out of memory\n", stderr);
  } catch (const std::exception& e) {
    fmt::print(stderr, "ckptfs: internal error: {}\n", ckptfs::printable(e.what()));
  } catch (...) {
    std::fputs("ckptfs: internal error\n", stderr);
  }
  return 70;  // EX_SOFTWARE
}

namespace {

int run(int argc, char** argv) {
  // Logs go to stderr (stdout carries command output such as inspect --json).
  auto logger = spdlog::stderr_color_mt("ckptfs");
  logger->set_formatter(ckptfs::safe_log_formatter());  // names from headers never go out raw
  spdlog::set_default_logger(std::move(logger));
  std::span<char*> args(argv, static_cast<size_t>(argc));
  // As /sbin/mount.ckptfs, mount(8) runs us as `mount.ckptfs SRC MNT [-sfnv] [-o opts]
  // [-t type]`: keep SRC, MNT and -o; drop what only concerns mount(8) itself.
  std::string_view self = argv[0];
  self = self.substr(self.rfind('/') == std::string_view::npos ? 0 : self.rfind('/') + 1);
  if (self == "mount.ckptfs" || self == "mount.fuse.ckptfs") {
    std::vector<char*> kept;
    bool fake = false;
    for (int i = 1; i < argc; ++i) {
      std::string_view a = argv[i];
      if ((a == "-o" || a == "-t" || a == "-N") && i + 1 < argc) {
        if (a == "-o") kept.insert(kept.end(), {argv[i], argv[i + 1]});
        ++i;
      } else if (a.size() < 2 || a[0] != '-' || a.starts_with("-o")) {
        kept.push_back(argv[i]);
      } else if (a.find('f') != std::string_view::npos) {
        fake = true;  // mount -f: everything but the mount itself
      }
    }
    return fake ? 0 : ckptfs::cli::cmd_mount(kept, true);
  }
  if (argc < 2) {
    fmt::print(stderr, "{}", kUsage);
    return 2;
  }
  std::string_view cmd = argv[1];
  auto rest = args.subspan(2);
  if (cmd == "--help" || cmd == "-h" || cmd == "help") {
    fmt::print("{}", kUsage);
    return 0;
  }
  if (cmd == "--version" || cmd == "-V") {
    fmt::print("{}", ckptfs::cli::version_text());
    return 0;
  }
  if (cmd == "version") return ckptfs::cli::cmd_version(rest);
  if (cmd == "status") return ckptfs::cli::cmd_status(rest);
  if (cmd == "inspect") return ckptfs::cli::cmd_inspect(rest);
  if (cmd == "verify") return ckptfs::cli::cmd_verify(rest);
  if (cmd == "consolidate") return ckptfs::cli::cmd_consolidate(rest);
  if (cmd == "load") return ckptfs::cli::cmd_load(rest);
  if (cmd == "mount") return ckptfs::cli::cmd_mount(rest, false);
  if (!cmd.empty() && cmd[0] != '-' && argc >= 3) {
    // mount.fuse3 form: ckptfs SRC MNT -o opts
    return ckptfs::cli::cmd_mount(args.subspan(1), true);
  }
  fmt::print(stderr, "ckptfs: unknown command '{}'\n\n{}", cmd, kUsage);
  return 2;
}

}  // namespace
