// Prefetch: pushes consolidated files into the kernel page cache ahead of their readers, and
// the rule that picks the read path's defaults from the machine. No libfuse here: the push
// itself goes through a PagePusher (the adapter's calls fuse_lowlevel_notify_store), so the
// policy is testable without a kernel.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ckptfs/fs/filesystem.hpp"

namespace ckptfs::fs {

// The kernel side of a push.
class PagePusher {
 public:
  virtual ~PagePusher() = default;
  // Stores `bytes` at `off` of inode `ino` in the kernel page cache: 0, or a negative errno
  // (-ENOENT: the kernel no longer has the inode). Called from several threads at once.
  virtual int store(Ino ino, uint64_t off, std::span<const char> bytes) = 0;
  // Memory available now (MemAvailable), in bytes; 0 when unknown (then nothing is pushed).
  virtual uint64_t mem_available() = 0;
};

// MemAvailable from /proc/meminfo, in bytes; 0 when it cannot be read.
uint64_t read_mem_available();

struct PrefetchConfig {
  unsigned threads = 2;             // push threads
  unsigned per_inode = 2;           // of which at most this many push one inode at once
  uint64_t chunk = 1 << 20;         // bytes per store
  uint64_t lead = 8 << 20;          // the kernel's read-ahead: a push skips this far past a miss
  uint64_t reserve = 512ull << 20;  // stop when less memory than this is available
  uint64_t check_every = 256ull << 20;  // bytes pushed between two memory probes
  size_t max_pushes = 64;               // pushes queued or running at once; more are dropped
  unsigned max_overtakes = 4;           // misses past the push front before the push gives up
  // Inodes remembered as opened (pushed once) or outrun; past this many the memory is
  // forgotten (a forgotten inode may be pushed once more), so it never grows with the mount.
  size_t max_remembered = 1 << 16;
};

// Pushes files in offset order. Triggers: the first open of an inode (from offset 0), and a
// read that reached the daemon (a miss) while no push of that inode runs: the kernel asked for
// bytes it did not have (caches dropped, pages evicted). Rules:
// - one push per inode at a time, served by up to `per_inode` threads taking chunks in order;
// - a miss during a push raises its floor to the miss's end + `lead`: the kernel's own
//   read-ahead will ask for those bytes anyway, so the push skips ahead of them;
// - a push that a reader overtakes `max_overtakes` times (misses at or past the push front)
//   only competes with the reader: it stops, and that inode is not pushed again on misses;
// - each push covers at most half the memory available when it is requested, and stops when
//   less than `reserve` is available (probed every `check_every` bytes) or on any error.
class Prefetcher {
 public:
  Prefetcher(PagePusher& pusher, PrefetchConfig cfg);
  ~Prefetcher();
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;

  void on_open(Ino ino, std::shared_ptr<const FileReader> reader);
  // A read of [off, off+len) reached the daemon.
  void on_miss(Ino ino, const std::shared_ptr<const FileReader>& reader, uint64_t off,
               uint64_t len);
  // Inode `ino` is opened for writing (before the open's reply): its push stops, and this
  // returns once no chunk of it is being stored. The kernel sends a writer's WRITE requests
  // from the inode's page cache after unlocking the pages it filled, so a store of the old
  // bytes meanwhile would overwrite the data the daemon then stores. No push of it starts
  // until as many write_closed calls (its writers' RELEASEs) have come.
  void write_opened(Ino ino);
  void write_closed(Ino ino);

  struct Stats {
    uint64_t pushes = 0;     // pushes started (accepted into the queue)
    uint64_t dropped = 0;    // requests refused because `max_pushes` were pending
    uint64_t stores = 0;     // successful stores
    uint64_t bytes = 0;      // bytes stored
    uint64_t overtaken = 0;  // pushes given up because a reader overtook them
  };
  [[nodiscard]] Stats stats() const;
  // stats() as (name, value) pairs, for .ckptfs/status.json.
  [[nodiscard]] std::vector<std::pair<std::string, uint64_t>> figures() const;
  // Blocks until no push is queued or running (tests, and an orderly shutdown).
  void drain();

 private:
  struct Push;
  void request(Ino ino, std::shared_ptr<const FileReader> reader, uint64_t off);
  void run();
  void work(Push& p, std::vector<char>& buf);
  std::optional<uint64_t> claim(Push& p) const;

  PagePusher& pusher_;
  const PrefetchConfig cfg_;
  mutable std::mutex mu_;  // guards queue_, running_, opened_, outrun_, writing_, stats_, stop_
  std::condition_variable cv_;                    // work queued, or stopping
  std::condition_variable idle_cv_;               // a push finished (drain)
  std::deque<std::shared_ptr<Push>> queue_;       // tickets: one per thread that may join a push
  std::map<Ino, std::shared_ptr<Push>> running_;  // pushes queued or running, by inode
  std::set<Ino> opened_;  // inodes whose first open already triggered a push (bounded)
  std::set<Ino> outrun_;  // inodes whose reader overtook their push: not pushed on misses
                          // (bounded)
  std::map<Ino, unsigned> writing_;  // inodes open for writing, and by how many: never pushed
  Stats stats_;
  bool stop_ = false;
  std::atomic<bool> halt_{false};  // stop_, readable without the lock by pushing threads
  std::vector<std::thread> threads_;
};

// The read path's defaults, chosen from the machine (see docs/benchmarks.md, "Read path").
struct Machine {
  unsigned cores = 0;          // CPUs this process may run on
  uint64_t mem_available = 0;  // bytes
};
struct ReadTuning {
  unsigned fuse_threads = 8;  // FUSE worker threads
  bool prefetch = true;
  unsigned prefetch_threads = 2;
  unsigned per_inode = 2;
};
ReadTuning tune_read_path(const Machine& m);
// FUSE's background queue for a mount whose read-ahead window is read_ahead_kb, read in
// requests of max_request_kb. The kernel skips the rest of a read-ahead batch once
// congestion_threshold requests are in flight, and mm then drops the pages it inserted for
// it: with libfuse's 12/9 a 64 MiB window inserted 4.3x the file's pages and halved a cold
// read (docs/benchmarks.md, "Warm re-reads"). So the queue holds two windows (a reader's
// current and next) before congestion: never below libfuse's 12/9, at most 4096/3072.
struct Background {
  unsigned max_background = 12;
  unsigned congestion_threshold = 9;
};
Background fuse_background(unsigned read_ahead_kb, unsigned max_request_kb);
// The machine this process runs on: sched_getaffinity's CPU count (hardware_concurrency
// where that fails), and MemAvailable.
Machine probe_machine();

}  // namespace ckptfs::fs
