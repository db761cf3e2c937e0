// flush/mpi_target: where each rank keeps its shards (include/ckptfs/flush/mpi.hpp): target
// patterns (%r), paths relative to the source, a node-local target's claim, opening a rank's
// ShardStore. No MPI here: always built, tested in tests/unit/test_mpi.cpp.
#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>

#include "ckptfs/flush/mpi.hpp"
#include "ckptfs/util/fd.hpp"
#include "ckptfs/util/path.hpp"

namespace ckptfs::flush::mpi {

Result<std::string> expand_target(std::string_view pattern, int rank) {
  if (pattern.empty()) return make_error(EINVAL, "target: empty path");
  std::string out;
  for (size_t i = 0; i < pattern.size(); ++i) {
    if (pattern[i] != '%') {
      out += pattern[i];
      continue;
    }
    if (i + 1 < pattern.size() && pattern[i + 1] == 'r') {
      out += std::to_string(rank);
    } else if (i + 1 < pattern.size() && pattern[i + 1] == '%') {
      out += '%';
    } else {
      return make_error(EINVAL, "target: '{}': only %r (the rank) and %% may follow '%'", pattern);
    }
    ++i;
  }
  return out;
}

Result<std::string> relative_to(std::string_view source, std::string_view display) {
  if (display == source) return std::string();
  if (display.size() <= source.size() + 1 || !display.starts_with(source) ||
      display[source.size()] != '/') {
    return make_error(EINVAL, "{}: not under the mount's source {}", display, source);
  }
  const std::string_view rel = display.substr(source.size() + 1);  // never empty here
  if (!is_safe_rel(rel)) {
    return make_error(EINVAL, "{}: not a plain path under {}", display, source);
  }
  return std::string(rel);
}

Status claim_target(const std::string& root, const std::string& source) {
  const std::string marker = root + "/" + std::string(kTargetOwnerFile);
  const std::string want = source + "\n";
  auto have = read_small_file(marker, 64 << 10);
  if (have.ok()) {
    if (*have == want) return {};
    return make_error(EEXIST,
                      "node-local target {} holds the shards of another source ({}), not {}: a "
                      "mount removes what its own records do not name, so targets are never "
                      "shared; use another target",
                      root, have->substr(0, have->find('\n')), source);
  }
  if (have.error().code != ENOENT) return std::move(have).error().context(marker);
  const std::string tmp = marker + ".tmp";
  CKPTFS_TRY(UniqueFd fd, open_file(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644));
  CKPTFS_CHECK(pwrite_all(fd.get(), want.data(), want.size(), 0, tmp));
  if (::fsync(fd.get()) != 0) return errno_error(tmp + ": fsync failed");
  // RENAME_NOREPLACE: two mounts claiming one target at once cannot both win.
  if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, marker.c_str(), RENAME_NOREPLACE) != 0) {
    const int e = errno;
    ::unlink(tmp.c_str());
    if (e == EEXIST) return claim_target(root, source);
    return make_error(e, "{}: cannot claim the target: {}", marker, std::strerror(e));
  }
  return {};
}

Result<std::string> target_root(const MpiOptions& o, int rank) {
  if (o.node_local()) return expand_target(o.target, rank);
  if (!o.rank_src.empty()) return expand_target(o.rank_src, rank);
  if (o.source.empty()) return make_error(EINVAL, "no source directory");
  return o.source;
}

Result<std::unique_ptr<ShardStore>> open_target(const MpiOptions& o, int rank) {
  CKPTFS_TRY(std::string root, target_root(o, rank));
  if (o.node_local()) {
    // mkdir -p: a per-rank directory (%r) is made on its own node.
    std::error_code ec;
    std::filesystem::create_directories(root, ec);
    if (ec) {
      return make_error(ec.value(), "node-local target {}: cannot create it: {}", root,
                        ec.message());
    }
  }
  auto st = ShardStore::open(root);
  if (!st) return std::move(st).error().context(o.node_local() ? "node-local target" : "target");
  if (o.node_local()) CKPTFS_CHECK(claim_target(root, o.source));
  return st;
}

}  // namespace ckptfs::flush::mpi
