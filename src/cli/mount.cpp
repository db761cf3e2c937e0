#include <fmt/core.h>

#include "ckptfs/cli/args.hpp"

namespace ckptfs::cli {
int cmd_mount(std::span<char*>, bool) {
  fmt::print(stderr, "ckptfs mount: not built yet\n");
  return 1;
}
}  // namespace ckptfs::cli
