// flush/mpi_flow: flow control of the head's sends (include/ckptfs/flush/mpi.hpp): the
// in-flight budget (backpressure), the write combiner, the rate limiter. No MPI here: always
// built, tested in tests/unit/test_mpi.cpp.
#include <algorithm>
#include <thread>

#include "ckptfs/flush/mpi.hpp"

namespace ckptfs::flush::mpi {

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

}  // namespace ckptfs::flush::mpi
