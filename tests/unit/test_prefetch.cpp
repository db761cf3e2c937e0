// The prefetch policy, without a kernel: a fake PagePusher records what would be stored.
#include <gtest/gtest.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <future>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "ckptfs/fs/prefetch.hpp"

namespace ckptfs::fs {
namespace {

constexpr uint64_t kMiB = 1 << 20;

char pattern(uint64_t x) { return static_cast<char>((x * 131 + (x >> 20)) & 0xff); }

// A file of `size` bytes of pattern(); reads at or past `fail_at` fail with EIO.
class FakeReader final : public FileReader {
 public:
  explicit FakeReader(uint64_t size, uint64_t fail_at = UINT64_MAX)
      : size_(size), fail_at_(fail_at) {}
  [[nodiscard]] uint64_t size() const override { return size_; }
  void plan(uint64_t off, uint64_t len, ReadPlan& out) const override {
    out.segs.clear();
    out.src = io::GatherSource{};
    out.direct = this;
    out.direct_off = off;
    out.size = off >= size_ ? 0 : std::min(len, size_ - off);
  }
  Result<size_t> read_direct(uint64_t off, size_t len, char* dst) const override {
    if (off + len > fail_at_) return make_error(EIO, "shard went away");
    for (size_t i = 0; i < len; ++i) dst[i] = pattern(off + i);
    return len;
  }

 private:
  uint64_t size_, fail_at_;
};

struct Store {
  Ino ino;
  uint64_t off;
  size_t len;
};

// Records stores; can hold them at a gate, fail them from an offset on, and report any memory.
class FakePusher final : public PagePusher {
 public:
  int store(Ino ino, uint64_t off, std::span<const char> bytes) override {
    std::unique_lock lock(mu_);
    ++in_store_;
    ++in_ino_[ino];
    max_in_store_ = std::max(max_in_store_, in_store_);
    max_in_ino_[ino] = std::max(max_in_ino_[ino], in_ino_[ino]);
    cv_.notify_all();
    cv_.wait(lock, [&] { return open_; });
    --in_store_;
    --in_ino_[ino];
    if (off >= fail_from_) return -ENOENT;
    for (size_t i = 0; i < bytes.size(); ++i) {
      if (bytes[i] != pattern(off + i)) {
        ADD_FAILURE() << "byte " << off + i << " of inode " << ino << " is wrong";
        break;
      }
    }
    stores_.push_back({ino, off, bytes.size()});
    if (++count_ == drop_mem_after_) mem_ = 0;
    return 0;
  }
  uint64_t mem_available() override {
    std::lock_guard lock(mu_);
    ++probes_;
    return mem_;
  }

  void close_gate() {
    std::lock_guard lock(mu_);
    open_ = false;
  }
  void open_gate() {
    {
      std::lock_guard lock(mu_);
      open_ = true;
    }
    cv_.notify_all();
  }
  // Waits until `n` stores are held at the gate; false after 10 s.
  bool wait_held(int n) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, std::chrono::seconds(10), [&] { return in_store_ >= n; });
  }
  std::vector<Store> stores() {
    std::lock_guard lock(mu_);
    return stores_;
  }
  std::vector<uint64_t> offsets(Ino ino) {
    std::vector<uint64_t> out;
    for (const auto& s : stores()) {
      if (s.ino == ino) out.push_back(s.off);
    }
    std::sort(out.begin(), out.end());
    return out;
  }
  int max_in_store() {
    std::lock_guard lock(mu_);
    return max_in_store_;
  }
  int in_ino(Ino ino) {
    std::lock_guard lock(mu_);
    return in_ino_[ino];
  }
  int max_in_ino(Ino ino) {
    std::lock_guard lock(mu_);
    return max_in_ino_[ino];
  }
  void set_mem(uint64_t m) {
    std::lock_guard lock(mu_);
    mem_ = m;
  }
  void fail_from(uint64_t off) {
    std::lock_guard lock(mu_);
    fail_from_ = off;
  }
  void drop_mem_after(int stores) {
    std::lock_guard lock(mu_);
    drop_mem_after_ = stores;
  }

 private:
  std::mutex mu_;  // guards everything below
  std::condition_variable cv_;
  bool open_ = true;
  int in_store_ = 0, max_in_store_ = 0;
  std::map<Ino, int> in_ino_, max_in_ino_;
  std::vector<Store> stores_;
  uint64_t mem_ = 64ull << 30;
  uint64_t fail_from_ = UINT64_MAX;
  int count_ = 0, drop_mem_after_ = -1;
  int probes_ = 0;
};

PrefetchConfig config(unsigned threads, unsigned per_inode = 1) {
  PrefetchConfig c;
  c.threads = threads;
  c.per_inode = per_inode;
  c.chunk = kMiB;
  c.lead = 4 * kMiB;
  c.reserve = 64 * kMiB;
  c.check_every = 2 * kMiB;
  return c;
}

std::vector<uint64_t> mibs(std::initializer_list<uint64_t> l) {
  std::vector<uint64_t> out;
  for (auto x : l) out.push_back(x * kMiB);
  return out;
}

TEST(Prefetch, FirstOpenPushesTheWholeFileOnce) {
  FakePusher pusher;
  Prefetcher pf(pusher, config(1));
  auto r = std::make_shared<FakeReader>(3 * kMiB + 123);
  pf.on_open(7, r);
  pf.drain();
  pf.on_open(7, r);  // a re-open of a pushed file pushes nothing
  pf.drain();
  auto st = pusher.stores();
  ASSERT_EQ(st.size(), 4u);
  for (size_t i = 0; i < st.size(); ++i) {
    EXPECT_EQ(st[i].ino, 7u);
    EXPECT_EQ(st[i].off, i * kMiB);  // one thread: in offset order
  }
  EXPECT_EQ(st.back().len, 123u);
  EXPECT_EQ(pf.stats().pushes, 1u);
  EXPECT_EQ(pf.stats().bytes, 3 * kMiB + 123);
}

TEST(Prefetch, WhatItRemembersOfOpenedInodesIsBounded) {
  FakePusher pusher;
  auto cfg = config(1);
  cfg.max_remembered = 4;
  Prefetcher pf(pusher, cfg);
  auto r = std::make_shared<FakeReader>(kMiB);
  for (Ino ino = 1; ino <= 4; ++ino) pf.on_open(ino, r);
  pf.drain();
  pf.on_open(2, r);  // remembered: nothing pushed
  pf.drain();
  EXPECT_EQ(pf.stats().pushes, 4u);
  pf.on_open(5, r);  // the fifth forgets the first four
  pf.drain();
  pf.on_open(2, r);  // forgotten: pushed once more, which costs a copy and nothing else
  pf.drain();
  EXPECT_EQ(pf.stats().pushes, 6u);
  EXPECT_EQ(pusher.offsets(2), (std::vector<uint64_t>{0, 0}));
}

TEST(Prefetch, MissStartsAPushPastTheReadAhead) {
  FakePusher pusher;
  Prefetcher pf(pusher, config(1));
  auto r = std::make_shared<FakeReader>(12 * kMiB);
  pf.on_miss(3, r, 2 * kMiB, kMiB);  // the kernel reads [2, 3) and reads ahead to 7 MiB
  pf.drain();
  EXPECT_EQ(pusher.offsets(3), mibs({7, 8, 9, 10, 11}));
  pf.on_miss(4, r, 11 * kMiB, kMiB);  // nothing left past the read-ahead
  pf.drain();
  EXPECT_TRUE(pusher.offsets(4).empty());
  EXPECT_EQ(pf.stats().pushes, 1u);
}

TEST(Prefetch, OnePushPerInodeAndAMissRaisesItsFloor) {
  FakePusher pusher;
  Prefetcher pf(pusher, config(2));
  auto r = std::make_shared<FakeReader>(16 * kMiB);
  pusher.close_gate();
  pf.on_open(1, r);
  ASSERT_TRUE(pusher.wait_held(1));  // the push holds chunk 0
  pf.on_miss(1, r, 0, kMiB);         // the reader is at 0: skip to 0 + 1 + 4 MiB
  pf.on_miss(1, r, 0, kMiB);
  EXPECT_EQ(pf.stats().pushes, 1u);
  pusher.open_gate();
  pf.drain();
  EXPECT_EQ(pusher.offsets(1), mibs({0, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}));
  EXPECT_EQ(pusher.max_in_ino(1), 1);  // per_inode = 1 although 2 threads run
}

TEST(Prefetch, AReaderThatOvertakesThePushStopsIt) {
  FakePusher pusher;
  auto cfg = config(1);
  cfg.lead = 0;
  cfg.max_overtakes = 2;
  Prefetcher pf(pusher, cfg);
  auto r = std::make_shared<FakeReader>(64 * kMiB);
  pusher.close_gate();
  pf.on_open(1, r);
  ASSERT_TRUE(pusher.wait_held(1));  // front: 1 MiB
  pf.on_miss(1, r, kMiB, kMiB);      // past the front: 1
  pf.on_miss(1, r, 2 * kMiB, kMiB);  // past the front (and the floor it raised): 2, stop
  pusher.open_gate();
  pf.drain();
  EXPECT_EQ(pusher.offsets(1), mibs({0}));
  EXPECT_EQ(pf.stats().overtaken, 1u);
  pf.on_miss(1, r, 10 * kMiB, kMiB);  // that inode is not pushed again on misses
  pf.drain();
  EXPECT_EQ(pf.stats().pushes, 1u);
  EXPECT_EQ(pusher.offsets(1).size(), 1u);
}

TEST(Prefetch, MissesInsideTheSkippedWindowAreNotOvertakes) {
  FakePusher pusher;
  auto cfg = config(1);
  cfg.max_overtakes = 1;
  Prefetcher pf(pusher, cfg);
  auto r = std::make_shared<FakeReader>(16 * kMiB);
  pusher.close_gate();
  pf.on_open(1, r);
  ASSERT_TRUE(pusher.wait_held(1));
  pf.on_miss(1, r, 0, kMiB);  // behind the front: floor 5 MiB
  for (uint64_t m = 1; m < 5; ++m) pf.on_miss(1, r, m * kMiB, kMiB);  // the read-ahead window
  pusher.open_gate();
  pf.drain();
  EXPECT_EQ(pf.stats().overtaken, 0u);
  EXPECT_EQ(pusher.offsets(1).back(), 15 * kMiB);
}

TEST(Prefetch, MemoryBoundsEachPush) {
  FakePusher pusher;
  auto cfg = config(1);
  Prefetcher pf(pusher, cfg);
  auto r = std::make_shared<FakeReader>(64 * kMiB);
  pusher.set_mem(cfg.reserve + 8 * kMiB);  // half of what is above the reserve: 4 MiB
  pf.on_open(1, r);
  pf.drain();
  EXPECT_EQ(pusher.offsets(1), mibs({0, 1, 2, 3}));
  pf.on_miss(1, r, 2 * kMiB, kMiB);  // a later miss continues past the read-ahead
  pf.drain();
  EXPECT_EQ(pusher.offsets(1), mibs({0, 1, 2, 3, 7, 8, 9, 10}));
  pusher.set_mem(cfg.reserve);  // under the reserve: nothing at all
  pf.on_open(2, r);
  pf.drain();
  EXPECT_TRUE(pusher.offsets(2).empty());
}

TEST(Prefetch, StopsWhenMemoryRunsShort) {
  FakePusher pusher;
  Prefetcher pf(pusher, config(1));
  auto r = std::make_shared<FakeReader>(32 * kMiB);
  pusher.drop_mem_after(3);  // probed every 2 MiB: the probe after the third store sees 0
  pf.on_open(1, r);
  pf.drain();
  EXPECT_EQ(pusher.offsets(1), mibs({0, 1, 2}));
}

// A writer's open: the push of that inode stops, and write_opened returns only once the store
// in progress has ended (the kernel sends the writer's WRITE requests from pages a store could
// still overwrite); no push of it starts while a writer has it open, and misses push it again
// after the last writer's release.
TEST(Prefetch, AWriterStopsThePushOfItsInodeAndWaitsForTheStoreInProgress) {
  FakePusher pusher;
  Prefetcher pf(pusher, config(1));
  pusher.close_gate();
  auto r = std::make_shared<FakeReader>(16 * kMiB);
  pf.on_open(3, r);
  ASSERT_TRUE(pusher.wait_held(1));  // the store of its first MiB is in progress
  auto opened = std::async(std::launch::async, [&] {
    pf.write_opened(3);
    return pusher.in_ino(3);  // stores of inode 3 in progress when it returned
  });
  // Held at the gate, the store has not ended: write_opened has not returned (a wrong one
  // returns at once, with the store still in progress).
  EXPECT_EQ(opened.wait_for(std::chrono::milliseconds(50)), std::future_status::timeout);
  pusher.open_gate();
  EXPECT_EQ(opened.get(), 0);
  pf.drain();
  EXPECT_EQ(pusher.offsets(3), mibs({0}));  // stopped after the store it waited for
  // While the writer has it open: no push, on an open or on a miss.
  pf.on_open(3, r);
  pf.on_miss(3, r, 0, kMiB);
  pf.write_opened(3);  // a second writer
  pf.write_closed(3);
  pf.on_miss(3, r, 0, kMiB);
  pf.drain();
  EXPECT_EQ(pusher.offsets(3), mibs({0}));
  // Its last writer gone: a miss pushes it again, past the kernel's read-ahead.
  pf.write_closed(3);
  pf.on_miss(3, r, 0, kMiB);
  pf.drain();
  EXPECT_EQ(pusher.offsets(3), mibs({0, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}));
  // Other inodes were never held back.
  pf.on_open(4, std::make_shared<FakeReader>(2 * kMiB));
  pf.drain();
  EXPECT_EQ(pusher.offsets(4), mibs({0, 1}));
}

TEST(Prefetch, StopsOnAStoreError) {
  FakePusher pusher;
  Prefetcher pf(pusher, config(1));
  pusher.fail_from(2 * kMiB);  // the kernel forgot the inode
  pf.on_open(1, std::make_shared<FakeReader>(16 * kMiB));
  pf.drain();
  EXPECT_EQ(pusher.offsets(1), mibs({0, 1}));
  EXPECT_EQ(pf.stats().stores, 2u);
}

TEST(Prefetch, StopsOnAReadError) {
  FakePusher pusher;
  Prefetcher pf(pusher, config(1));
  pf.on_open(1, std::make_shared<FakeReader>(16 * kMiB, 3 * kMiB));
  pf.drain();
  EXPECT_EQ(pusher.offsets(1), mibs({0, 1, 2}));
}

TEST(Prefetch, QueueIsBounded) {
  FakePusher pusher;
  auto cfg = config(1);
  cfg.max_pushes = 3;
  Prefetcher pf(pusher, cfg);
  auto r = std::make_shared<FakeReader>(2 * kMiB);
  pusher.close_gate();
  for (Ino i = 1; i <= 6; ++i) pf.on_open(i, r);
  ASSERT_TRUE(pusher.wait_held(1));
  EXPECT_EQ(pf.stats().pushes, 3u);
  EXPECT_EQ(pf.stats().dropped, 3u);
  pusher.open_gate();
  pf.drain();
  EXPECT_EQ(pusher.stores().size(), 6u);  // 3 files of 2 chunks
  EXPECT_TRUE(pusher.offsets(6).empty());
}

TEST(Prefetch, AllThreadsServeOneInode) {
  FakePusher pusher;
  Prefetcher pf(pusher, config(3, 3));
  pusher.close_gate();
  pf.on_open(1, std::make_shared<FakeReader>(16 * kMiB));
  ASSERT_TRUE(pusher.wait_held(3));
  pusher.open_gate();
  pf.drain();
  EXPECT_EQ(pusher.max_in_ino(1), 3);
  EXPECT_LE(pusher.max_in_store(), 3);
  std::vector<uint64_t> all;
  for (uint64_t m = 0; m < 16; ++m) all.push_back(m * kMiB);
  EXPECT_EQ(pusher.offsets(1), all);  // each chunk exactly once
}

TEST(Prefetch, ThreadsServeSeveralInodes) {
  FakePusher pusher;
  Prefetcher pf(pusher, config(3, 1));
  pusher.close_gate();
  auto r = std::make_shared<FakeReader>(4 * kMiB);
  for (Ino i = 1; i <= 4; ++i) pf.on_open(i, r);
  ASSERT_TRUE(pusher.wait_held(3));
  pusher.open_gate();
  pf.drain();
  EXPECT_EQ(pusher.max_in_store(), 3);
  for (Ino i = 1; i <= 4; ++i) {
    EXPECT_EQ(pusher.offsets(i), mibs({0, 1, 2, 3}));
    EXPECT_EQ(pusher.max_in_ino(i), 1);
  }
}

TEST(Prefetch, DestructionWithPushesPendingDoesNotWait) {
  FakePusher pusher;
  auto r = std::make_shared<FakeReader>(1024 * kMiB);
  {
    Prefetcher pf(pusher, config(2, 2));
    pusher.close_gate();
    pf.on_open(1, r);
    pf.on_open(2, r);
    ASSERT_TRUE(pusher.wait_held(2));
    pusher.open_gate();
  }
  EXPECT_LT(pusher.stores().size(), 2048u);
}

TEST(ReadTuning, FromTheMachine) {
  constexpr uint64_t kGiB = 1ull << 30;
  auto two = tune_read_path({2, 23 * kGiB});  // the development VM
  EXPECT_EQ(two.fuse_threads, 8u);
  EXPECT_TRUE(two.prefetch);
  EXPECT_EQ(two.prefetch_threads, 2u);
  EXPECT_EQ(two.per_inode, 2u);
  auto h100 = tune_read_path({16, 120 * kGiB});  // the 16-core H100 node of issue 9
  EXPECT_EQ(h100.fuse_threads, 16u);
  EXPECT_FALSE(h100.prefetch);
  auto four = tune_read_path({4, 8 * kGiB});
  EXPECT_TRUE(four.prefetch);
  EXPECT_EQ(four.fuse_threads, 8u);
  EXPECT_FALSE(tune_read_path({2, kGiB}).prefetch);  // little memory: no pushes
  auto unknown = tune_read_path({0, 0});
  EXPECT_EQ(unknown.fuse_threads, 8u);
  EXPECT_FALSE(unknown.prefetch);
  auto big = tune_read_path({256, 1024 * kGiB});
  EXPECT_EQ(big.fuse_threads, 64u);
  EXPECT_EQ(big.prefetch_threads, 8u);
}

TEST(ReadTuning, BackgroundQueueHoldsTwoReadAheadWindows) {
  // The default 8 MiB window in 1 MiB requests: 8 each, 17 before congestion.
  auto d = fuse_background(8192, 1024);
  EXPECT_EQ(d.congestion_threshold, 17u);
  EXPECT_EQ(d.max_background, 22u);
  // 64 MiB windows: libfuse's 12/9 made the kernel drop 4.3x the file's pages.
  auto big = fuse_background(65536, 1024);
  EXPECT_GT(big.congestion_threshold, 2u * 64);
  EXPECT_GT(big.max_background, big.congestion_threshold);
  // Small windows keep libfuse's defaults; 0 is the kernel's 128 KiB.
  for (unsigned kb : {0u, 128u, 1024u, 4096u}) {
    auto b = fuse_background(kb, 1024);
    EXPECT_EQ(b.congestion_threshold, 9u) << kb;
    EXPECT_EQ(b.max_background, 12u) << kb;
  }
  // Smaller requests need more of them; absurd windows are capped.
  EXPECT_EQ(fuse_background(8192, 128).congestion_threshold, 129u);
  auto cap = fuse_background(~0u, 4);
  EXPECT_EQ(cap.congestion_threshold, 3072u);
  EXPECT_EQ(cap.max_background, 4096u);
  EXPECT_EQ(fuse_background(8192, 0).congestion_threshold, 9u);  // no request size: one
}

TEST(ReadTuning, ProbesThisMachine) {
  auto m = probe_machine();
  EXPECT_GE(m.cores, 1u);
  EXPECT_GT(m.mem_available, 0u);
  EXPECT_GT(read_mem_available(), 0u);
}

}  // namespace
}  // namespace ckptfs::fs
