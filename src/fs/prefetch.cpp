// fs/prefetch: the read path's prefetch policy behind a PagePusher, and its defaults from the
// machine.
#include "ckptfs/fs/prefetch.hpp"

#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>

#include <spdlog/spdlog.h>

namespace ckptfs::fs {

uint64_t read_mem_available() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  uint64_t kb = 0;
  std::string unit;
  while (f >> key >> kb >> unit) {
    if (key == "MemAvailable:") return kb * 1024;
  }
  return 0;
}

// One inode's push. Threads holding one of its tickets take chunks in offset order.
struct Prefetcher::Push {
  Ino ino = 0;
  std::shared_ptr<const FileReader> reader;
  uint64_t start = 0;               // chunk-aligned offset the push was requested from
  std::once_flag bounded;           // `end` is set by the first thread that works on it
  std::atomic<uint64_t> end{0};     // push nothing at or past this
  std::atomic<uint64_t> next{0};    // the next chunk to claim: the push front
  std::atomic<uint64_t> floor{0};   // never push below this (readers are there)
  std::atomic<uint64_t> pushed{0};  // bytes claimed so far, for the memory probe
  std::atomic<bool> stop{false};
  unsigned tickets = 0;    // guarded by Prefetcher::mu_: tickets not yet finished
  unsigned overtakes = 0;  // guarded by Prefetcher::mu_
};

Prefetcher::Prefetcher(PagePusher& pusher, PrefetchConfig cfg) : pusher_(pusher), cfg_(cfg) {
  const unsigned n = std::max(1u, cfg_.threads);
  for (unsigned i = 0; i < n; ++i) threads_.emplace_back([this] { run(); });
}

Prefetcher::~Prefetcher() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
    halt_ = true;
  }
  cv_.notify_all();
  idle_cv_.notify_all();  // a write_opened waiting for a push
  for (auto& t : threads_) t.join();
}

void Prefetcher::on_open(Ino ino, std::shared_ptr<const FileReader> reader) {
  {
    std::lock_guard lock(mu_);
    if (opened_.count(ino)) return;
    if (opened_.size() >= cfg_.max_remembered) opened_.clear();
    opened_.insert(ino);
  }
  request(ino, std::move(reader), 0);
}

void Prefetcher::on_miss(Ino ino, const std::shared_ptr<const FileReader>& reader, uint64_t off,
                         uint64_t len) {
  const uint64_t want = off + len + cfg_.lead;
  {
    std::lock_guard lock(mu_);
    if (outrun_.count(ino)) return;
    auto it = running_.find(ino);
    if (it != running_.end()) {
      Push& p = *it->second;
      const uint64_t front = p.next.load();
      const uint64_t floor = p.floor.load();
      // Past the front (and not in the window the push skipped on purpose): the reader is
      // faster than the push, which then only competes with it for the same bytes.
      if (front > p.start && off >= std::max(front, floor - floor % cfg_.chunk) &&
          ++p.overtakes >= cfg_.max_overtakes) {
        p.stop = true;
        if (outrun_.size() >= cfg_.max_remembered) outrun_.clear();
        outrun_.insert(ino);
        ++stats_.overtaken;
        spdlog::debug("prefetch of inode {} given up at {}: the reader is ahead", ino, front);
        return;
      }
      uint64_t cur = p.floor.load();
      while (cur < want && !p.floor.compare_exchange_weak(cur, want)) {
      }
      return;
    }
  }
  request(ino, reader, want);
}

void Prefetcher::write_opened(Ino ino) {
  std::unique_lock lock(mu_);
  ++writing_[ino];
  auto it = running_.find(ino);
  if (it == running_.end()) return;
  std::shared_ptr<Push> p = it->second;
  p->stop = true;  // its threads claim no more chunks; the one storing now finishes
  idle_cv_.wait(lock, [&] {
    auto now = running_.find(ino);
    return stop_ || now == running_.end() || now->second != p;
  });
}

void Prefetcher::write_closed(Ino ino) {
  std::lock_guard lock(mu_);
  if (auto it = writing_.find(ino); it != writing_.end() && --it->second == 0) writing_.erase(it);
}

void Prefetcher::request(Ino ino, std::shared_ptr<const FileReader> reader, uint64_t off) {
  if (off >= reader->size()) return;
  {
    std::lock_guard lock(mu_);
    if (stop_ || running_.count(ino) || writing_.count(ino)) return;
    if (running_.size() >= cfg_.max_pushes) {
      ++stats_.dropped;
      return;
    }
    auto p = std::make_shared<Push>();
    p->ino = ino;
    p->reader = std::move(reader);
    p->start = off - off % cfg_.chunk;
    p->next = p->start;
    p->floor = off;
    p->tickets = std::clamp(cfg_.per_inode, 1u, static_cast<unsigned>(threads_.size()));
    for (unsigned i = 0; i < p->tickets; ++i) queue_.push_back(p);
    running_.emplace(ino, std::move(p));
    ++stats_.pushes;
  }
  cv_.notify_all();
}

std::optional<uint64_t> Prefetcher::claim(Push& p) const {
  uint64_t cur = p.next.load();
  while (true) {
    uint64_t floor = p.floor.load();
    uint64_t off = std::max(cur, floor - floor % cfg_.chunk);
    if (p.stop || halt_ || off >= p.end.load()) return std::nullopt;
    if (p.next.compare_exchange_weak(cur, off + cfg_.chunk)) return off;
  }
}

void Prefetcher::run() {
  std::vector<char> buf;
  std::unique_lock lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (stop_) return;
    std::shared_ptr<Push> p = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    if (buf.size() < cfg_.chunk) buf.resize(cfg_.chunk);
    work(*p, buf);
    lock.lock();
    if (--p->tickets == 0) {
      auto it = running_.find(p->ino);
      if (it != running_.end() && it->second == p) running_.erase(it);
      idle_cv_.notify_all();
    }
  }
}

void Prefetcher::work(Push& p, std::vector<char>& buf) {
  const uint64_t size = p.reader->size();
  std::call_once(p.bounded, [&] {
    const uint64_t avail = pusher_.mem_available();
    if (avail < cfg_.reserve + cfg_.chunk) return;  // end stays 0: nothing is pushed
    p.end = std::min(size, p.start + (avail - cfg_.reserve) / 2);
  });
  while (auto got = claim(p)) {
    const uint64_t off = *got;
    const size_t n = static_cast<size_t>(std::min(cfg_.chunk, size - off));
    const uint64_t before = p.pushed.fetch_add(n);
    if (before / cfg_.check_every != (before + n) / cfg_.check_every &&
        pusher_.mem_available() < cfg_.reserve) {
      spdlog::debug("prefetch of inode {} paused at {}: memory is short", p.ino, off);
      p.stop = true;
      return;
    }
    auto r = p.reader->read(off, n, buf.data());
    if (!r) {
      spdlog::warn("prefetch of inode {}: {}", p.ino, r.error().message);
      p.stop = true;
      return;
    }
    if (int rc = pusher_.store(p.ino, off, std::span<const char>(buf.data(), *r)); rc != 0) {
      spdlog::debug("prefetch of inode {} stopped at {}: {}", p.ino, off, std::strerror(-rc));
      p.stop = true;  // e.g. -ENOENT: the kernel dropped the inode
      return;
    }
    std::lock_guard lock(mu_);
    ++stats_.stores;
    stats_.bytes += *r;
  }
}

Prefetcher::Stats Prefetcher::stats() const {
  std::lock_guard lock(mu_);
  return stats_;
}

void Prefetcher::drain() {
  std::unique_lock lock(mu_);
  idle_cv_.wait(lock, [&] { return running_.empty() || stop_; });
}

ReadTuning tune_read_path(const Machine& m) {
  const unsigned cores = std::max(1u, m.cores);
  ReadTuning t;
  // Parallel readers keep one worker per outstanding 1 MiB request busy: at least 8 (what
  // 2 cores were measured with), one per core beyond that (16 workers doubled 4 readers'
  // throughput on 16 cores), and never an unbounded pool.
  t.fuse_threads = std::clamp(cores, 8u, 64u);
  // Prefetch was measured a win on 2 cores (mmap copy-out 1.41x buffered) and a loss or a
  // tie in every row on 16 (4 parallel readers: 4.21 against 7.31 GB/s without). Below
  // 8 cores it stays on; pushes smaller than a GiB are not worth the competition for memory.
  t.prefetch = cores < 8 && m.mem_available >= (2ull << 30);
  t.prefetch_threads = std::clamp(cores / 2, 2u, 8u);
  t.per_inode = t.prefetch_threads;
  return t;
}

Background fuse_background(unsigned read_ahead_kb, unsigned max_request_kb) {
  // Requests one read-ahead window takes (the kernel's own 128 KiB when read_ahead_kb is 0).
  const uint64_t ra = read_ahead_kb == 0 ? 128 : read_ahead_kb;
  const uint64_t per_window = max_request_kb == 0 ? 1 : (ra + max_request_kb - 1) / max_request_kb;
  Background b;
  b.congestion_threshold = static_cast<unsigned>(std::clamp<uint64_t>(2 * per_window + 1, 9, 3072));
  b.max_background = std::max(12u, b.congestion_threshold * 4 / 3);  // libfuse's 3/4 ratio
  return b;
}

Machine probe_machine() {
  Machine m;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof(set), &set) == 0)
    m.cores = static_cast<unsigned>(CPU_COUNT(&set));
  if (m.cores == 0) m.cores = std::thread::hardware_concurrency();
  m.mem_available = read_mem_available();
  return m;
}

std::vector<std::pair<std::string, uint64_t>> Prefetcher::figures() const {
  const Stats s = stats();
  return {{"pushes", s.pushes},
          {"dropped", s.dropped},
          {"stores", s.stores},
          {"bytes", s.bytes},
          {"overtaken", s.overtaken}};
}

}  // namespace ckptfs::fs
