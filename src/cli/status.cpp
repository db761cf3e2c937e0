// `ckptfs status MNT`: what the daemon serving MNT is doing, from its .ckptfs/status.json.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "ckptfs/cli/args.hpp"
#include "ckptfs/fs/filesystem.hpp"
#include "ckptfs/util/fd.hpp"
#include "ckptfs/util/text.hpp"

namespace ckptfs::cli {
namespace {

constexpr std::string_view kUsage = R"(usage: ckptfs status MNT [--json]

Prints what the daemon serving the ckptfs mount MNT is doing: the checkpoints it tracks
(serving, settling, refused and why), reads and bytes served, files open for writing,
prefetch and cache figures, and errors. The daemon answers through MNT/.ckptfs/status.json,
a read-only file made at each open that no listing shows. Exits 1 when MNT is not a ckptfs
mount.

options:
  --json      print the daemon's JSON as it is (for a monitoring agent)
  -h, --help  this text
)";

Result<std::string> read_status(const std::string& mnt) {
  const std::string path = fmt::format("{}/{}/{}", mnt, fs::kStatusDirName, fs::kStatusFileName);
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) {
    if (errno == ENOENT || errno == ENOTDIR) {
      return make_error(ENOENT, "{}: not a ckptfs mount (no {}/{})", mnt, fs::kStatusDirName,
                        fs::kStatusFileName);
    }
    return make_error(errno, "{}: {}", path, std::strerror(errno));
  }
  std::string out;
  char buf[65536];
  while (true) {
    ssize_t n = ::read(fd.get(), buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return make_error(errno, "{}: {}", path, std::strerror(errno));
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

std::string bytes_str(uint64_t b) {
  if (b >= (uint64_t{1} << 30)) return fmt::format("{:.2f} GiB", b / double(uint64_t{1} << 30));
  if (b >= (uint64_t{1} << 20)) return fmt::format("{:.1f} MiB", b / double(uint64_t{1} << 20));
  if (b >= 1024) return fmt::format("{:.1f} KiB", b / 1024.0);
  return fmt::format("{} B", b);
}

// Values of the daemon's JSON, read defensively: an older daemon may lack a key.
uint64_t num(const nlohmann::json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_number_unsigned() ? it->get<uint64_t>()
         : it != j.end() && it->is_number()        ? static_cast<uint64_t>(it->get<double>())
                                                   : 0;
}

std::string str(const nlohmann::json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_string() ? printable(it->get<std::string>()) : std::string();
}

void print_human(const nlohmann::json& j) {
  using nlohmann::json;
  fmt::print("ckptfs {} serving {} (pid {}, up {} s, {})\n", str(j, "version"), str(j, "source"),
             num(j, "pid"), num(j, "uptime_s"),
             j.value("read_only", false) ? "read-only" : "read-write");
  const json ck = j.value("checkpoints", json::object());
  fmt::print(
      "checkpoints: {} tracked: {} serving, {} settling, {} refused, {} not read yet "
      "({} read, {} refused since mount)\n",
      num(ck, "tracked"), num(ck, "serving"), num(ck, "settling"), num(ck, "refused"),
      num(ck, "unread"), num(ck, "built_total"), num(ck, "refused_total"));
  for (const auto& c : ck.value("list", json::array())) {
    std::string line = fmt::format("  {:<9} {}", str(c, "state"), str(c, "path"));
    if (c.contains("files")) {
      line += fmt::format("  ({} files, {} tensors, {})", num(c, "files"), num(c, "tensors"),
                          bytes_str(num(c, "bytes")));
    }
    if (c.contains("map") && c["map"].is_string()) line += "  map " + str(c, "map");
    fmt::print("{}\n", line);
    if (const json u = c.value("unmapped_native", json::object()); !u.empty()) {
      fmt::print("      under a trainer's own names ('{}'), no config.json: no model map fits\n",
                 printable(str(u, "name")));
      for (const auto& t : u.value("maps_tried", json::array())) {
        if (t.is_string()) fmt::print("        {}\n", printable(t.get<std::string>()));
      }
    }
    for (const auto& p : c.value("problems", json::array())) {
      if (p.is_string()) fmt::print("      {}\n", printable(p.get<std::string>()));
    }
    const uint64_t shown = c.value("problems", json::array()).size();
    if (num(c, "problem_count") > shown) {
      fmt::print("      ... and {} more\n", num(c, "problem_count") - shown);
    }
  }
  const json rd = j.value("reads", json::object());
  const json pf = j.value("prefetch", json::object());
  fmt::print(
      "reads: {} requests, {} served{}\n", num(rd, "requests"), bytes_str(num(rd, "bytes")),
      pf.empty() ? "" : fmt::format(" (and {} pushed by prefetch)", bytes_str(num(pf, "bytes"))));
  fmt::print("writes: {} files open for writing\n",
             num(j.value("writes", json::object()), "open_files"));
  if (pf.empty()) {
    fmt::print("prefetch: off\n");
  } else {
    fmt::print("prefetch: {} pushes, {} stored, {} dropped, {} overtaken\n", num(pf, "pushes"),
               bytes_str(num(pf, "bytes")), num(pf, "dropped"), num(pf, "overtaken"));
  }
  const json ca = j.value("cache", json::object());
  fmt::print("cache: {} of shard headers, {} shard fds open\n", bytes_str(num(ca, "header_bytes")),
             num(ca, "shard_fds_open"));
  const json er = j.value("errors", json::object());
  std::string by;
  // A named object: items() of a temporary would iterate it after its end of life.
  const json by_errno = er.value("by_errno", json::object());
  for (const auto& [k, v] : by_errno.items()) {
    by += fmt::format("{}{} {}", by.empty() ? " (" : ", ", v.is_number() ? v.get<uint64_t>() : 0,
                      printable(k));
  }
  fmt::print("errors: {}{}\n", num(er, "total"), by.empty() ? "" : by + ")");
}

}  // namespace

int cmd_status(std::span<char*> argv) {
  static constexpr OptSpec spec[] = {{"json", 0, false}};
  auto parsed = parse_command(argv, spec, {"status", kUsage, "MNT", 1});
  if (auto* rc = std::get_if<int>(&parsed)) return *rc;
  auto* args = &std::get<Args>(parsed);
  std::string mnt = args->positional[0];
  while (mnt.size() > 1 && mnt.back() == '/') mnt.pop_back();
  auto text = read_status(mnt);
  if (!text) {
    fmt::print(stderr, "ckptfs status: {}\n", printable(text.error().message));
    return 1;
  }
  auto j = nlohmann::json::parse(*text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    fmt::print(stderr, "ckptfs status: {}: the daemon's status is not a JSON object\n",
               printable(mnt));
    return 1;
  }
  if (args->has("json")) {
    fmt::print("{}", *text);
  } else {
    print_human(j);
  }
  return 0;
}

}  // namespace ckptfs::cli
