// load/loader: the loader: reads planned tensors through a bounded ring of staging buffers.
#include "ckptfs/load/loader.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "ckptfs/load/checksum.hpp"
#include "ckptfs/util/threads.hpp"

namespace ckptfs::load {
namespace {

struct Piece {
  uint32_t req = 0;
  uint64_t off = 0;  // within the request
  uint64_t len = 0;
};

// The bounded ring of staging buffers: a free list of slot numbers. A slot handed out may
// still be the source of a copy in flight; the taker waits on its event (Backend::wait_slot).
class Ring {
 public:
  explicit Ring(unsigned slots) {
    for (unsigned i = 0; i < slots; ++i) free_.push_back(i);
  }
  // A free slot, or -1 once the load failed.
  int acquire(const std::atomic<bool>& failed) {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return !free_.empty() || failed.load(); });
    if (failed.load()) return -1;
    const unsigned s = free_.front();
    free_.pop_front();
    return static_cast<int>(s);
  }
  void release(unsigned slot) {
    {
      std::lock_guard lock(mu_);
      free_.push_back(slot);
    }
    cv_.notify_one();
  }
  void wake_all() { cv_.notify_all(); }

 private:
  std::mutex mu_;  // guards free_
  std::condition_variable cv_;
  std::deque<unsigned> free_;
};

// Reads `pieces` through the ring into the requests' destinations.
class Pipeline {
 public:
  Pipeline(const Source& src, std::span<Request> reqs, const std::vector<Resolved>& res,
           Backend& backend, const LoadOptions& opts, std::vector<Piece> pieces)
      : src_(src),
        reqs_(reqs),
        res_(res),
        backend_(backend),
        opts_(opts),
        pieces_(std::move(pieces)),
        sums_(reqs.size()) {}

  Status run(unsigned threads, unsigned slots) {
    if (pieces_.empty()) return {};
    if (!backend_.on_device() && opts_.staging == LoadOptions::Staging::Auto) {
      // Host destination: no staging ring, each piece read straight into place.
      JoinedThreads workers;
      CKPTFS_CHECK(start(workers, threads, [&](unsigned) { work_direct(); }));
      workers.join();
      return first_error_;
    }
    uint64_t biggest = 0;
    for (const auto& p : pieces_) biggest = std::max(biggest, p.len);
    for (unsigned i = 0; i < slots; ++i) {
      CKPTFS_TRY(Buffer b, backend_.alloc_staging(static_cast<size_t>(biggest)));
      staging_.push_back(std::move(b));
    }
    CKPTFS_CHECK(backend_.prepare(slots, opts_.streams));
    Ring ring(slots);
    JoinedThreads workers;
    auto started = start(workers, threads, [&](unsigned t) { work(t, ring); });
    workers.join();
    auto fin = backend_.finish();  // even after a failure: no copy may outlive the staging
    CKPTFS_CHECK(std::move(started));
    if (!first_error_.ok()) return first_error_;
    return fin;
  }

  [[nodiscard]] uint64_t checksum(size_t req) const { return sums_[req].load(); }

 private:
  // Starts up to `n` workers running body(t). Fewer is fine (they share one queue of pieces):
  // a thread limit costs speed, not the load; none at all is an error (EAGAIN).
  template <typename Body>
  Status start(JoinedThreads& g, unsigned n, Body body) {
    for (unsigned t = 0; t < n; ++t) {
      auto st = g.spawn([body, t] { body(t); });
      if (st) continue;
      if (g.size() == 0) return std::move(st).error().context("load");
      spdlog::warn("load: {} of {} reader threads started: {}", g.size(), n, st.error().message);
      break;
    }
    return {};
  }

  void fail(Status st, Ring& ring) {
    {
      std::lock_guard lock(mu_);
      if (first_error_.ok()) first_error_ = std::move(st);
    }
    failed_.store(true);
    ring.wake_all();
  }

  void work_direct() {
    ReadScratch scratch;
    while (!failed_.load()) {
      const size_t k = next_.fetch_add(1);
      if (k >= pieces_.size()) break;
      const Piece& p = pieces_[k];
      const auto& r = res_[p.req];
      char* dst = static_cast<char*>(reqs_[p.req].dst) + p.off;
      auto st = src_.read(r.tensor, r.offset + p.off, p.len, dst, scratch);
      if (!st) {
        std::lock_guard lock(mu_);
        if (first_error_.ok()) {
          first_error_ =
              std::move(st).error().context(fmt::format("tensor '{}'", reqs_[p.req].name));
        }
        failed_.store(true);
        return;
      }
      if (opts_.checksum) sums_[p.req].fetch_add(checksum_part(dst, p.off, p.len));
    }
  }

  void work(unsigned t, Ring& ring) {
    if (auto st = backend_.bind_thread(); !st) return fail(std::move(st), ring);
    ReadScratch scratch;
    while (!failed_.load()) {
      const size_t k = next_.fetch_add(1);
      if (k >= pieces_.size()) break;
      const Piece& p = pieces_[k];
      const int slot = ring.acquire(failed_);
      if (slot < 0) break;
      auto st = step(t, static_cast<unsigned>(slot), p, scratch);
      ring.release(static_cast<unsigned>(slot));
      if (!st)
        return fail(std::move(st).error().context(fmt::format("tensor '{}'", reqs_[p.req].name)),
                    ring);
    }
  }

  Status step(unsigned t, unsigned slot, const Piece& p, ReadScratch& scratch) {
    CKPTFS_CHECK(backend_.wait_slot(slot));
    char* buf = staging_[slot].data();
    const auto& r = res_[p.req];
    CKPTFS_CHECK(src_.read(r.tensor, r.offset + p.off, p.len, buf, scratch));
    if (opts_.checksum) sums_[p.req].fetch_add(checksum_part(buf, p.off, p.len));
    return backend_.copy(t, slot, static_cast<char*>(reqs_[p.req].dst) + p.off, buf,
                         static_cast<size_t>(p.len));
  }

  const Source& src_;
  std::span<Request> reqs_;
  const std::vector<Resolved>& res_;
  Backend& backend_;
  const LoadOptions& opts_;
  std::vector<Piece> pieces_;
  std::vector<Buffer> staging_;  // one per ring slot
  std::vector<std::atomic<uint64_t>> sums_;
  std::atomic<size_t> next_{0};
  std::atomic<bool> failed_{false};
  std::mutex mu_;  // guards first_error_
  Status first_error_;
};

}  // namespace

Result<uint64_t> checksum_dest(Backend& backend, const void* dst, uint64_t bytes, uint64_t chunk) {
  if (!backend.on_device()) return checksum(static_cast<const char*>(dst), bytes);
  std::vector<char> tmp(static_cast<size_t>(std::min(bytes, chunk)));
  uint64_t sum = 0;
  for (uint64_t off = 0; off < bytes; off += chunk) {
    const uint64_t n = std::min(chunk, bytes - off);
    CKPTFS_CHECK(backend.to_host(tmp.data(), static_cast<const char*>(dst) + off, n));
    sum += checksum_part(tmp.data(), off, n);
  }
  return sum;
}

uint64_t combine_checksums(std::vector<std::pair<std::string, uint64_t>> named) {
  std::sort(named.begin(), named.end());
  std::string buf;
  for (const auto& [name, sum] : named) {
    buf += name;
    buf.push_back('\0');
    for (int i = 0; i < 8; ++i) buf.push_back(static_cast<char>((sum >> (8 * i)) & 0xff));
  }
  return xxh64(buf.data(), buf.size(), 0);
}

unsigned default_threads() { return std::clamp(std::thread::hardware_concurrency(), 2u, 16u); }

Result<std::vector<Resolved>> resolve(const Source& src, std::span<const Request> reqs) {
  std::vector<Resolved> out;
  out.reserve(reqs.size());
  for (const auto& r : reqs) {
    const int64_t idx = src.find(r.name);
    if (idx < 0) return make_error(ENOENT, "tensor '{}' is not in {}", r.name, src.dir());
    const auto& t = src.tensors()[static_cast<size_t>(idx)];
    Resolved z{static_cast<uint32_t>(idx), 0, t.nbytes};
    if (r.rows) {
      const auto [first, last] = *r.rows;
      if (t.shape.empty()) {
        return make_error(EINVAL, "tensor '{}' is 0-d: a row slice needs a dim 0", r.name);
      }
      const uint64_t rows = t.shape[0];
      if (first > last || last > rows) {
        return make_error(EINVAL, "tensor '{}': rows [{}, {}) are not within its {} rows", r.name,
                          first, last, rows);
      }
      const uint64_t row_bytes = rows ? t.nbytes / rows : 0;
      if (row_bytes * rows != t.nbytes) {
        return make_error(EINVAL, "tensor '{}': a row of {} is not a whole number of bytes", r.name,
                          format::dtype_name(t.dtype));
      }
      z.offset = first * row_bytes;
      z.bytes = (last - first) * row_bytes;
    }
    if (r.bytes != z.bytes) {
      return make_error(EINVAL, "tensor '{}': the request has {} bytes, the {} has {}", r.name,
                        r.bytes, r.rows ? "slice" : "tensor", z.bytes);
    }
    out.push_back(z);
  }
  return out;
}

std::vector<Request> all_tensors(const Source& src) {
  std::vector<Request> out;
  out.reserve(src.tensors().size());
  for (const auto& t : src.tensors()) out.push_back(Request{t.name, nullptr, t.nbytes, {}});
  return out;
}

Result<LoadResult> load(const Source& src, std::span<Request> reqs, Backend& backend,
                        const LoadOptions& opts, Collective* coll) {
  const bool shared = coll && coll->size() > 1;
  const unsigned me = shared ? coll->rank() : 0;
  LoadResult out;
  std::vector<unsigned> owner(reqs.size(), 0);
  std::vector<Resolved> res;
  const auto t0 = std::chrono::steady_clock::now();
  const uint64_t read0 = src.bytes_read();
  std::unique_ptr<Pipeline> pipe;
  if (shared) {
    // Every rank must pass the same requests (names, sizes, slices): checked first, by all.
    std::string key;
    for (const auto& q : reqs) {
      key += fmt::format("{}\n{}\n{}\n{}\n", q.name, q.bytes, q.rows ? q.rows->first : ~0ull,
                         q.rows ? q.rows->second : ~0ull);
    }
    CKPTFS_TRY(bool same, coll->all_same(xxh64(key.data(), key.size(), 0)));
    if (!same) {
      return make_error(EINVAL,
                        "rank {}: the ranks passed different requests (every rank must "
                        "ask for the same tensors, sizes and slices)",
                        me);
    }
  }
  // This rank's part: check, allocate, read its share. Every failure still goes through the
  // collective's all_ok below, so the other ranks learn it instead of waiting in a broadcast.
  auto local = [&]() -> Status {
    if (opts.chunk == 0 || opts.chunk % kChecksumBlock != 0) {
      return make_error(EINVAL, "chunk size {} is not a positive multiple of {} bytes", opts.chunk,
                        kChecksumBlock);
    }
    if (opts.threads > kMaxThreads || opts.ring_slots > kMaxRingSlots ||
        opts.streams > kMaxStreams) {
      return make_error(EINVAL, "{} threads, {} ring slots, {} streams: at most {}, {} and {}",
                        opts.threads, opts.ring_slots, opts.streams, kMaxThreads, kMaxRingSlots,
                        kMaxStreams);
    }
    CKPTFS_TRY(res, resolve(src, reqs));
    for (size_t i = 0; i < reqs.size(); ++i) {
      if (reqs[i].dst) continue;
      CKPTFS_TRY(Buffer b, backend.alloc_dest(static_cast<size_t>(res[i].bytes)));
      reqs[i].dst = b.data();
      out.owned.push_back(std::move(b));
    }
    if (shared) {
      std::vector<uint64_t> bytes(reqs.size());
      for (size_t i = 0; i < reqs.size(); ++i) bytes[i] = res[i].bytes;
      owner = assign_balanced(bytes, coll->size());
    }
    std::vector<Piece> pieces;
    for (uint32_t i = 0; i < reqs.size(); ++i) {
      if (owner[i] != me) continue;
      for (uint64_t off = 0; off < res[i].bytes; off += opts.chunk) {
        pieces.push_back(Piece{i, off, std::min(opts.chunk, res[i].bytes - off)});
      }
    }
    const unsigned want = opts.threads ? opts.threads : default_threads();
    const auto threads =
        static_cast<unsigned>(std::max<size_t>(1, std::min<size_t>(want, pieces.size())));
    const unsigned slots = opts.ring_slots ? opts.ring_slots : 2 * threads;
    pipe = std::make_unique<Pipeline>(src, reqs, res, backend, opts, std::move(pieces));
    return pipe->run(threads, slots);
  }();

  LoadStats& st = out.stats;
  if (shared) {
    auto all = coll->all_ok(local.ok());
    if (!local) return std::move(local).error();
    if (!all) return std::move(all).error();
    if (!*all) return make_error(EIO, "rank {}: another rank failed to read its share", me);
    // Broadcasts in groups of kGroup (ncclGroupStart/End), so a model of thousands of
    // tensors never queues them all at once.
    constexpr size_t kGroup = 64;
    size_t in_group = 0;
    CKPTFS_CHECK(coll->begin_group());
    for (size_t i = 0; i < reqs.size(); ++i) {
      if (res[i].bytes == 0) continue;
      CKPTFS_CHECK(coll->broadcast(reqs[i].dst, res[i].bytes, owner[i]));
      if (owner[i] != me) st.bytes_shared += res[i].bytes;
      if (++in_group == kGroup) {
        CKPTFS_CHECK(coll->end_group());
        CKPTFS_CHECK(coll->begin_group());
        in_group = 0;
      }
    }
    CKPTFS_CHECK(coll->end_group());
  } else if (!local) {
    return std::move(local).error();
  }
  for (size_t i = 0; i < reqs.size(); ++i) st.bytes += res[i].bytes;
  st.bytes_read = src.bytes_read() - read0;
  st.direct_fallback = src.direct_fallback();
  if (opts.checksum) {
    st.checksums.resize(reqs.size());
    for (size_t i = 0; i < reqs.size(); ++i) {
      if (owner[i] == me) {
        st.checksums[i] = pipe->checksum(i);
      } else {
        CKPTFS_TRY(st.checksums[i], checksum_dest(backend, reqs[i].dst, res[i].bytes, opts.chunk));
      }
    }
  }
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

}  // namespace ckptfs::load
