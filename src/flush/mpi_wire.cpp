// The pure parts of the OpenMPI flusher (include/ckptfs/flush/mpi.hpp): wire format,
// backpressure accounting, target paths, rate limiting. No MPI here: always built and tested.
#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>

#include <cstring>

#include <algorithm>
#include <filesystem>
#include <thread>

#include "ckptfs/flush/mpi.hpp"
#include "ckptfs/util/fd.hpp"
#include "ckptfs/util/path.hpp"

namespace ckptfs::flush::mpi {
namespace {

void put_u32(std::string& b, size_t at, uint32_t v) {
  for (int i = 0; i < 4; ++i) b[at + i] = static_cast<char>((v >> (8 * i)) & 0xff);
}
void put_u64(std::string& b, size_t at, uint64_t v) {
  for (int i = 0; i < 8; ++i) b[at + i] = static_cast<char>((v >> (8 * i)) & 0xff);
}
uint32_t get_u32(std::string_view b, size_t at) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(b[at + i]);
  return v;
}
uint64_t get_u64(std::string_view b, size_t at) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(b[at + i]);
  return v;
}

// Command layout: magic u32 | op u8, 3 zero bytes | shard u32 | pad u32 | id u64 | tx u64 |
// offset u64 | length u64  (48 bytes).
// Reply layout:   magic u32 | err i32 | id u64 | payload size u64  (24 bytes).

}  // namespace

bool reads_bytes(Op op) { return op == Op::Read || op == Op::ReadPath; }

std::string encode_command(const Command& c, std::string_view payload) {
  std::string b(kCommandBytes + payload.size(), '\0');
  put_u32(b, 0, kMagic);
  b[4] = static_cast<char>(c.op);
  put_u32(b, 8, c.shard);
  put_u64(b, 16, c.id);
  put_u64(b, 24, c.tx);
  put_u64(b, 32, c.offset);
  put_u64(b, 40, reads_bytes(c.op) ? c.length : payload.size());
  std::copy(payload.begin(), payload.end(), b.begin() + kCommandBytes);
  return b;
}

Result<Command> decode_command(std::string_view b, std::string_view* payload) {
  if (b.size() < kCommandBytes) return make_error(EPROTO, "mpi command: {} bytes, short", b.size());
  if (get_u32(b, 0) != kMagic) return make_error(EPROTO, "mpi command: bad magic");
  if (b[5] != 0 || b[6] != 0 || b[7] != 0 || get_u32(b, 12) != 0) {
    return make_error(EPROTO, "mpi command: nonzero padding");
  }
  Command c;
  const auto op = static_cast<uint8_t>(b[4]);
  if (op < static_cast<uint8_t>(Op::Open) || op > static_cast<uint8_t>(Op::Sweep)) {
    return make_error(EPROTO, "mpi command: unknown op {}", op);
  }
  c.op = static_cast<Op>(op);
  c.shard = get_u32(b, 8);
  c.id = get_u64(b, 16);
  c.tx = get_u64(b, 24);
  c.offset = get_u64(b, 32);
  c.length = get_u64(b, 40);
  const uint64_t body = b.size() - kCommandBytes;
  if (c.op == Op::Read       ? body != 0
      : c.op == Op::ReadPath ? (body == 0 || body > kMaxPathBytes)
                             : body != c.length) {
    return make_error(EPROTO, "mpi command: payload of {} bytes, header says {}", body, c.length);
  }
  if (c.offset + body < c.offset || (reads_bytes(c.op) && c.offset + c.length < c.offset)) {
    return make_error(EPROTO, "mpi command: offset overflows");
  }
  if (payload) *payload = b.substr(kCommandBytes);
  return c;
}

std::string encode_reply(const Reply& r, std::string_view payload) {
  std::string b(kReplyBytes + payload.size(), '\0');
  put_u32(b, 0, kMagic);
  put_u32(b, 4, static_cast<uint32_t>(r.err));
  put_u64(b, 8, r.id);
  put_u64(b, 16, payload.size());
  std::copy(payload.begin(), payload.end(), b.begin() + kReplyBytes);
  return b;
}

Result<Reply> decode_reply(std::string_view b, std::string_view* payload) {
  if (b.size() < kReplyBytes) return make_error(EPROTO, "mpi reply: {} bytes, short", b.size());
  if (get_u32(b, 0) != kMagic) return make_error(EPROTO, "mpi reply: bad magic");
  Reply r;
  r.err = static_cast<int32_t>(get_u32(b, 4));
  r.id = get_u64(b, 8);
  if (r.err < 0) return make_error(EPROTO, "mpi reply: negative errno {}", r.err);
  if (get_u64(b, 16) != b.size() - kReplyBytes) {
    return make_error(EPROTO, "mpi reply: payload size disagrees with its header");
  }
  if (payload) *payload = b.substr(kReplyBytes);
  return r;
}

bool InflightBudget::acquire(uint64_t n, std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  const bool ok =
      cv_.wait_for(lock, timeout, [&] { return failed_ || used_ + n <= capacity_ || used_ == 0; });
  if (!ok || failed_) return false;
  used_ += n;
  peak_ = std::max(peak_, used_);
  return true;
}

void InflightBudget::release(uint64_t n) {
  {
    std::lock_guard lock(mu_);
    used_ -= std::min(used_, n);
  }
  cv_.notify_all();
}

void InflightBudget::fail() {
  {
    std::lock_guard lock(mu_);
    failed_ = true;
  }
  cv_.notify_all();
}

uint64_t InflightBudget::in_flight() const {
  std::lock_guard lock(mu_);
  return used_;
}

uint64_t InflightBudget::peak() const {
  std::lock_guard lock(mu_);
  return peak_;
}

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
  std::string_view rel = display.substr(source.size() + 1);
  for (size_t at = 0; at <= rel.size();) {
    size_t slash = rel.find('/', at);
    if (slash == std::string_view::npos) slash = rel.size();
    if (!is_valid_component(rel.substr(at, slash - at))) {
      return make_error(EINVAL, "{}: not a plain path under {}", display, source);
    }
    at = slash + 1;
  }
  return std::string(rel);
}

std::chrono::nanoseconds RateLimiter::take(uint64_t n, Clock::time_point now) {
  if (rate_ <= 0) return std::chrono::nanoseconds(0);
  std::lock_guard lock(mu_);
  // Credit for idle time is capped at one burst.
  const auto burst = std::chrono::nanoseconds(static_cast<int64_t>(1e9 * burst_ / rate_));
  Clock::time_point start = next_.value_or(now - burst);
  if (start < now - burst) start = now - burst;
  const auto cost = std::chrono::nanoseconds(static_cast<int64_t>(1e9 * n / rate_));
  next_ = start + cost;
  return *next_ > now ? std::chrono::duration_cast<std::chrono::nanoseconds>(*next_ - now)
                      : std::chrono::nanoseconds(0);
}

void RateLimiter::throttle(uint64_t n) {
  if (rate_ <= 0) return;
  auto d = take(n, Clock::now());
  if (d.count() > 0) std::this_thread::sleep_for(d);
}

size_t WriteCombiner::limit_for(size_t shards) {
  constexpr size_t kMax = 1 << 20, kTotal = 64 << 20, kMin = 64 << 10;
  if (shards == 0) return kMax;
  return std::clamp(kTotal / shards, kMin, kMax);
}

Status WriteCombiner::send(uint32_t shard, uint64_t offset, std::string_view bytes) {
  ++sends_;
  return send_(shard, offset, bytes);
}

Status WriteCombiner::add(uint32_t shard, uint64_t offset, std::string_view bytes) {
  if (bytes.empty()) return {};
  auto it = bufs_.find(shard);
  if (it != bufs_.end() && it->second.offset + it->second.bytes.size() == offset &&
      it->second.bytes.size() + bytes.size() <= limit_) {
    it->second.bytes.append(bytes);
    if (it->second.bytes.size() == limit_) return flush(shard);
    return {};
  }
  CKPTFS_CHECK(flush(shard));
  if (bytes.size() >= limit_) return send(shard, offset, bytes);
  auto& b = bufs_[shard];
  b.offset = offset;
  b.bytes.reserve(limit_);
  b.bytes.assign(bytes);
  return {};
}

Status WriteCombiner::flush(uint32_t shard) {
  auto it = bufs_.find(shard);
  if (it == bufs_.end()) return {};
  Buf b = std::move(it->second);
  bufs_.erase(it);
  return send(shard, b.offset, b.bytes);
}

Status WriteCombiner::flush_all() {
  Status first;
  while (!bufs_.empty()) {
    auto st = flush(bufs_.begin()->first);
    if (!st && first) first = std::move(st);
  }
  return first;
}

uint64_t WriteCombiner::buffered() const {
  uint64_t n = 0;
  for (const auto& [shard, b] : bufs_) n += b.bytes.size();
  return n;
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
