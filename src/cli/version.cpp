// `ckptfs version` and `ckptfs --version`: this build's version, the libraries it was built
// with (and the libfuse it runs with), and the optional features compiled in.
#include <fuse_lowlevel.h>

#include <fmt/core.h>
#include <spdlog/version.h>
#include <nlohmann/json.hpp>

#include "ckptfs/cli/args.hpp"

// CKPTFS_HAVE_* come from meson.build (the one set of feature macros).
#ifndef CKPTFS_HAVE_MPI
#error "CKPTFS_HAVE_MPI is set by meson.build"
#endif

namespace ckptfs::cli {
namespace {

constexpr std::string_view kUsage = R"(usage: ckptfs version
       ckptfs --version

Prints the version of ckptfs, of the libraries it was built with (libfuse: also the one it
runs with), and the optional features compiled in.

options:
  -h, --help  this text
)";

const char* yes_no(bool b) { return b ? "yes" : "no"; }

}  // namespace

std::string version_text() {
  std::string out = fmt::format("ckptfs {}\n", CKPTFS_VERSION);
  out += fmt::format("libfuse {}.{} (built), {} (running)\n", FUSE_MAJOR_VERSION,
                     FUSE_MINOR_VERSION, fuse_pkgversion());
  out += fmt::format("spdlog {}.{}.{}\n", SPDLOG_VER_MAJOR, SPDLOG_VER_MINOR, SPDLOG_VER_PATCH);
  out += fmt::format("fmt {}.{}.{}\n", FMT_VERSION / 10000, FMT_VERSION / 100 % 100,
                     FMT_VERSION % 100);
  out += fmt::format("nlohmann_json {}.{}.{}\n", NLOHMANN_JSON_VERSION_MAJOR,
                     NLOHMANN_JSON_VERSION_MINOR, NLOHMANN_JSON_VERSION_PATCH);
  // systemd: the sd_notify protocol is spoken directly (no libsystemd), so always present.
  out += fmt::format("features: openmpi={} cuda={} nccl={} sd_notify=yes\n",
                     yes_no(CKPTFS_HAVE_MPI), yes_no(CKPTFS_HAVE_CUDA), yes_no(CKPTFS_HAVE_NCCL));
  return out;
}

int cmd_version(std::span<char*> argv) {
  auto parsed = parse_command(argv, {}, {"version", kUsage, "no argument", 0});
  if (auto* rc = std::get_if<int>(&parsed)) return *rc;
  fmt::print("{}", version_text());
  return 0;
}

}  // namespace ckptfs::cli
