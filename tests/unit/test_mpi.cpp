// The pure parts of the OpenMPI flusher (include/ckptfs/flush/mpi.hpp): the wire format, the
// in-flight budget (backpressure), target path expansion, the path of a directory relative to
// the source, the rate limiter. The MPI transport itself is tested with a real mpirun in
// tests/python/test_mpi.py.
#include <gtest/gtest.h>

#include <atomic>
#include <filesystem>
#include <thread>

#include "ckptfs/flush/mpi.hpp"

using namespace ckptfs;
using namespace ckptfs::flush::mpi;
using namespace std::chrono_literals;

TEST(MpiWire, CommandRoundTrip) {
  Command c;
  c.op = Op::Write;
  c.id = 0x0102030405060708ull;
  c.tx = 42;
  c.shard = 7;
  c.offset = (uint64_t{1} << 40) + 3;
  const std::string payload = std::string("abc\0def", 7);
  const std::string buf = encode_command(c, payload);
  ASSERT_EQ(buf.size(), kCommandBytes + payload.size());
  std::string_view got_payload;
  auto d = decode_command(buf, &got_payload);
  ASSERT_TRUE(d) << d.error().message;
  EXPECT_EQ(d->op, Op::Write);
  EXPECT_EQ(d->id, c.id);
  EXPECT_EQ(d->tx, 42u);
  EXPECT_EQ(d->shard, 7u);
  EXPECT_EQ(d->offset, c.offset);
  EXPECT_EQ(d->length, payload.size());
  EXPECT_EQ(got_payload, payload);
  // Little-endian on the wire, whatever the host.
  EXPECT_EQ(static_cast<unsigned char>(buf[16]), 0x08);
  EXPECT_EQ(static_cast<unsigned char>(buf[23]), 0x01);
}

TEST(MpiWire, ReadCarriesLengthWithoutPayload) {
  Command c;
  c.op = Op::Read;
  c.id = 9;
  c.length = 1 << 20;
  const std::string buf = encode_command(c, {});
  ASSERT_EQ(buf.size(), kCommandBytes);
  auto d = decode_command(buf, nullptr);
  ASSERT_TRUE(d);
  EXPECT_EQ(d->length, 1u << 20);
  // A read with a payload is malformed.
  EXPECT_FALSE(decode_command(buf + "x", nullptr));
}

TEST(MpiWire, ReadPathCarriesLengthAndAPath) {
  // ReadPath (node-local targets): `length` is the bytes wanted, the payload is the path, and
  // `tx` carries the shard's expected size.
  Command c;
  c.op = Op::ReadPath;
  c.id = 3;
  c.tx = 12345;
  c.offset = 4096;
  c.length = 1 << 20;
  const std::string path = "ck/.ckptfs/nl-1-2/shard-00002-model-00001-of-00001.safetensors";
  const std::string buf = encode_command(c, path);
  std::string_view got;
  auto d = decode_command(buf, &got);
  ASSERT_TRUE(d) << d.error().message;
  EXPECT_EQ(d->length, 1u << 20);
  EXPECT_EQ(d->tx, 12345u);
  EXPECT_EQ(got, path);
  EXPECT_FALSE(decode_command(encode_command(c, {}), nullptr));  // no path
  EXPECT_FALSE(decode_command(encode_command(c, std::string(kMaxPathBytes + 1, 'a')), nullptr));
  // Every node-local op decodes; one past the last does not.
  for (Op op : {Op::Create, Op::Seal, Op::Abort, Op::Drop, Op::Sweep}) {
    Command k;
    k.op = op;
    auto r = decode_command(encode_command(k, "x"), nullptr);
    ASSERT_TRUE(r) << static_cast<int>(op);
    EXPECT_EQ(r->op, op);
  }
  std::string past = encode_command(Command{}, {});
  past[4] = static_cast<char>(static_cast<uint8_t>(Op::Sweep) + 1);
  EXPECT_FALSE(decode_command(past, nullptr));
}

TEST(MpiTarget, NodeLocalTargetIsMadePerRank) {
  char tmpl[] = "/tmp/ckptfs-target-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string base = tmpl;
  MpiOptions o;
  o.source = base + "/src";
  o.target = base + "/t/%r/ckpt";
  EXPECT_EQ(*target_root(o, 3), base + "/t/3/ckpt");
  auto st = open_target(o, 3);
  ASSERT_TRUE(st) << st.error().message;
  EXPECT_EQ((*st)->root_path(), base + "/t/3/ckpt");
  // The target now belongs to this source: a mount of another one is refused, naming both.
  EXPECT_TRUE(open_target(o, 3));
  MpiOptions other = o;
  other.source = base + "/other-src";
  auto refused = open_target(other, 3);
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().code, EEXIST);
  EXPECT_NE(refused.error().message.find(base + "/src"), std::string::npos);
  EXPECT_NE(refused.error().message.find("other-src"), std::string::npos);
  o.target.clear();
  o.rank_src = base + "/view%r";
  EXPECT_EQ(*target_root(o, 1), base + "/view1");
  EXPECT_FALSE(open_target(o, 1));  // shared mode: never made, must exist
  o.rank_src.clear();
  EXPECT_EQ(*target_root(o, 1), base + "/src");
  std::filesystem::remove_all(base);
}

TEST(MpiWire, CommandRejectsMalformed) {
  Command c;
  c.op = Op::Sync;
  std::string good = encode_command(c, {});
  EXPECT_TRUE(decode_command(good, nullptr));
  EXPECT_FALSE(decode_command(good.substr(0, kCommandBytes - 1), nullptr));  // short
  std::string bad = good;
  bad[0] ^= 1;  // magic
  EXPECT_FALSE(decode_command(bad, nullptr));
  bad = good;
  bad[4] = 0;  // op 0
  EXPECT_FALSE(decode_command(bad, nullptr));
  bad[4] = 99;  // unknown op
  EXPECT_FALSE(decode_command(bad, nullptr));
  bad = good;
  bad[5] = 1;  // padding
  EXPECT_FALSE(decode_command(bad, nullptr));
  bad = good + "xy";  // payload the header does not announce
  EXPECT_FALSE(decode_command(bad, nullptr));
  // Offset + payload past 2^64.
  c.op = Op::Write;
  c.offset = UINT64_MAX;
  EXPECT_FALSE(decode_command(encode_command(c, "z"), nullptr));
  auto e = decode_command(good.substr(0, 3), nullptr);
  ASSERT_FALSE(e);
  EXPECT_EQ(e.error().code, EPROTO);
}

TEST(MpiWire, ReplyRoundTripAndErrors) {
  Reply r;
  r.id = 77;
  r.err = ENOSPC;
  const std::string buf = encode_reply(r, "shard-00002: no space");
  std::string_view p;
  auto d = decode_reply(buf, &p);
  ASSERT_TRUE(d);
  EXPECT_EQ(d->id, 77u);
  EXPECT_EQ(d->err, ENOSPC);
  EXPECT_EQ(p, "shard-00002: no space");
  EXPECT_FALSE(decode_reply(buf.substr(0, buf.size() - 1), nullptr));  // size disagrees
  EXPECT_FALSE(decode_reply(buf.substr(0, 10), nullptr));
  std::string bad = buf;
  bad[1] ^= 1;
  EXPECT_FALSE(decode_reply(bad, nullptr));
  r.err = -5;
  EXPECT_FALSE(decode_reply(encode_reply(r, {}), nullptr));
}

TEST(MpiBudget, BoundsBytesInFlight) {
  InflightBudget b(100);
  EXPECT_TRUE(b.acquire(60, 0ms));
  EXPECT_TRUE(b.acquire(40, 0ms));
  EXPECT_EQ(b.in_flight(), 100u);
  EXPECT_FALSE(b.acquire(1, 10ms));  // full: times out
  b.release(40);
  EXPECT_TRUE(b.acquire(30, 0ms));
  EXPECT_EQ(b.in_flight(), 90u);
  EXPECT_EQ(b.peak(), 100u);
  b.release(90);
  EXPECT_EQ(b.in_flight(), 0u);
  // Larger than the whole budget: goes alone once the pool is empty.
  EXPECT_TRUE(b.acquire(500, 0ms));
  EXPECT_FALSE(b.acquire(1, 0ms));
  b.release(500);
  b.release(10);  // over-release never wraps
  EXPECT_EQ(b.in_flight(), 0u);
}

TEST(MpiBudget, WriterWaitsForCompletionsAndNeverExceedsTheBound) {
  InflightBudget b(1000);
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> max_seen{0};
  std::atomic<int> sent{0};
  // Four writers, a "network" that completes sends slowly: the in-flight bytes stay bounded.
  std::vector<std::thread> writers;
  std::mutex q_mu;  // guards q
  std::vector<uint64_t> q;
  for (int w = 0; w < 4; ++w) {
    writers.emplace_back([&] {
      for (int i = 0; i < 50; ++i) {
        ASSERT_TRUE(b.acquire(300, 5s));
        {
          std::lock_guard l(q_mu);
          q.push_back(300);
        }
        uint64_t cur = b.in_flight();
        uint64_t m = max_seen.load();
        while (cur > m && !max_seen.compare_exchange_weak(m, cur)) {
        }
        ++sent;
      }
    });
  }
  std::thread net([&] {
    while (!stop) {
      std::this_thread::sleep_for(100us);
      std::lock_guard l(q_mu);
      if (!q.empty()) {
        b.release(q.back());
        q.pop_back();
      }
    }
  });
  for (auto& t : writers) t.join();
  stop = true;
  net.join();
  EXPECT_EQ(sent.load(), 200);
  EXPECT_LE(max_seen.load(), 1000u);
  EXPECT_LE(b.peak(), 1000u);
}

TEST(MpiBudget, FailWakesWaiters) {
  InflightBudget b(10);
  ASSERT_TRUE(b.acquire(10, 0ms));
  std::thread t([&] {
    std::this_thread::sleep_for(20ms);
    b.fail();
  });
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_FALSE(b.acquire(5, 60s));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 30s);  // woken, not timed out
  t.join();
  EXPECT_FALSE(b.acquire(0, 0ms));
}

TEST(MpiTarget, ExpandsRank) {
  EXPECT_EQ(*expand_target("/local/ckpt", 3), "/local/ckpt");
  EXPECT_EQ(*expand_target("/local/r%r/ckpt", 12), "/local/r12/ckpt");
  EXPECT_EQ(*expand_target("/a/%r-%r", 0), "/a/0-0");
  EXPECT_EQ(*expand_target("/a/100%%/%r", 5), "/a/100%/5");
  EXPECT_FALSE(expand_target("/a/%d", 1));
  EXPECT_FALSE(expand_target("/a/%", 1));
  EXPECT_FALSE(expand_target("", 1));
}

TEST(MpiTarget, RelativeToSource) {
  EXPECT_EQ(*relative_to("/src", "/src"), "");
  EXPECT_EQ(*relative_to("/src", "/src/a/b"), "a/b");
  EXPECT_FALSE(relative_to("/src", "/srcx/a"));
  EXPECT_FALSE(relative_to("/src", "/other"));
  EXPECT_FALSE(relative_to("/src", "/src/"));
  EXPECT_FALSE(relative_to("/src", "/src/a/../b"));
  EXPECT_FALSE(relative_to("/src", "/src/a//b"));
  EXPECT_FALSE(relative_to("/src", "/src/./b"));
}

TEST(MpiRate, TokenBucket) {
  using Clock = RateLimiter::Clock;
  RateLimiter off(0);
  EXPECT_EQ(off.take(1 << 30, Clock::now()).count(), 0);
  RateLimiter r(1e6, 0);  // 1 MB/s, no burst
  const auto t0 = Clock::now();
  EXPECT_EQ(r.take(500'000, t0), std::chrono::nanoseconds(500'000'000));
  // Another 0.5 MB at the same instant: due a second from t0.
  EXPECT_EQ(r.take(500'000, t0), std::chrono::nanoseconds(1'000'000'000));
  // Long idle: no credit beyond the burst (0 here).
  const auto later = t0 + 10s;
  EXPECT_EQ(r.take(1'000'000, later), std::chrono::nanoseconds(1'000'000'000));
  RateLimiter b(1e6, 1'000'000);  // with a 1 MB burst
  EXPECT_EQ(b.take(1'000'000, t0).count(), 0);
  EXPECT_EQ(b.take(1'000'000, t0), std::chrono::nanoseconds(1'000'000'000));
}

TEST(MpiCombine, ColumnRunsMergeIntoFewMessagesAndReadBackExactly) {
  // A column split's runs: shard s gets `run` bytes per row, consecutive in its file; the
  // writes arrive row by row, alternating shards.
  const uint32_t shards = 3;
  const size_t run = 820, rows = 4000, limit = 64 << 10;
  std::vector<std::string> got(shards);
  std::vector<uint64_t> messages(shards);
  WriteCombiner c(limit, [&](uint32_t s, uint64_t off, std::string_view b) -> Status {
    EXPECT_LE(b.size(), limit);
    if (got[s].size() < off + b.size()) got[s].resize(off + b.size());
    got[s].replace(off, b.size(), b);
    ++messages[s];
    return {};
  });
  std::vector<std::string> want(shards);
  for (size_t r = 0; r < rows; ++r) {
    for (uint32_t s = 0; s < shards; ++s) {
      std::string bytes(run, static_cast<char>('a' + (r * 7 + s) % 26));
      ASSERT_TRUE(c.add(s, 100 + r * run, bytes).ok());
      want[s].resize(100 + r * run);
      want[s] += bytes;
    }
  }
  EXPECT_GT(c.buffered(), 0u);
  ASSERT_TRUE(c.flush_all().ok());
  EXPECT_EQ(c.buffered(), 0u);
  for (uint32_t s = 0; s < shards; ++s) {
    EXPECT_EQ(got[s].substr(100), want[s].substr(100)) << s;
    // rows * run bytes in messages of about `limit`, not one per row.
    EXPECT_LE(messages[s], rows * run / (limit - run) + 2) << s;
  }
  EXPECT_EQ(c.sends(), messages[0] + messages[1] + messages[2]);
}

TEST(MpiCombine, NonContiguousAndLargeWritesFlushFirstErrorsReachTheCaller) {
  std::vector<std::pair<uint64_t, size_t>> sent;
  bool fail = false;
  WriteCombiner c(1024, [&](uint32_t, uint64_t off, std::string_view b) -> Status {
    sent.emplace_back(off, b.size());
    if (fail) return make_error(ENOSPC, "full");
    return {};
  });
  ASSERT_TRUE(c.add(0, 0, std::string(100, 'x')).ok());
  ASSERT_TRUE(c.add(0, 500, std::string(100, 'y')).ok());  // a gap: the first goes out
  ASSERT_EQ(sent.size(), 1u);
  EXPECT_EQ(sent[0], std::make_pair(uint64_t{0}, size_t{100}));
  ASSERT_TRUE(c.add(0, 600, std::string(4096, 'z')).ok());  // continues, but over the limit
  ASSERT_EQ(sent.size(), 3u);
  EXPECT_EQ(sent[1], std::make_pair(uint64_t{500}, size_t{100}));
  EXPECT_EQ(sent[2], std::make_pair(uint64_t{600}, size_t{4096}));
  ASSERT_TRUE(c.add(1, 0, std::string(10, 'w')).ok());
  fail = true;
  auto st = c.flush(1);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.error().code, ENOSPC);
  ASSERT_TRUE(c.add(2, 0, std::string(10, 'v')).ok());
  c.drop();  // an abort: nothing more is sent
  EXPECT_TRUE(c.flush_all().ok());
  EXPECT_EQ(sent.size(), 4u);
  EXPECT_EQ(WriteCombiner::limit_for(3), size_t{1} << 20);
  EXPECT_EQ(WriteCombiner::limit_for(1000), (size_t{64} << 20) / 1000);
  EXPECT_EQ(WriteCombiner::limit_for(5000), size_t{64} << 10);
}
