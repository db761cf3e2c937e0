// The loader (src/load), CPU destination mode: exact bytes against the truth and against the
// extent map on several layouts and against a consolidated copy, small rings, 1 and many
// threads, refusals that name the file and tensor, read-once sharing among thread ranks, and
// the host memory's huge-page rule.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <thread>

#include "ckptfs/engine/consolidate.hpp"
#include "ckptfs/format/names.hpp"
#include "ckptfs/io/gather.hpp"
#include "ckptfs/layout/extent_map.hpp"
#include "ckptfs/load/checksum.hpp"
#include "ckptfs/load/collective.hpp"
#include "ckptfs/load/loader.hpp"
#include "ckptfs/source/scanner.hpp"
#include "ckptfs/util/fd.hpp"
#include "fixture.hpp"

using namespace ckptfs;
using format::DType;

namespace {

namespace stdfs = std::filesystem;

struct Spec {
  std::string name;
  DType dtype;
  std::vector<uint64_t> shape;
  std::vector<uint64_t> grid;  // pieces per dim (empty: whole)
  uint32_t file = 1;
  bool replicate = false;
};

// Cut points of n into `pieces` as torch.chunk does (the last pieces may be short or empty).
std::vector<uint64_t> cuts(uint64_t n, uint64_t pieces) {
  const uint64_t step = (n + pieces - 1) / pieces;
  std::vector<uint64_t> out;
  for (uint64_t i = 0; i < pieces; ++i) out.push_back(std::min(i * step, n));
  out.push_back(n);
  return out;
}

// Writes a rank-shard checkpoint of `specs` over `world` ranks (grid cells dealt round-robin)
// and returns each tensor's full bytes.
std::map<std::string, std::string> write_ckpt(const std::string& dir,
                                              const std::vector<Spec>& specs, uint32_t world,
                                              uint32_t files, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::map<std::string, std::string> truth;
  std::map<std::pair<uint32_t, uint32_t>, test::ShardSpec> shards;
  for (const auto& s : specs) {
    uint64_t numel = 1;
    for (auto d : s.shape) numel *= d;
    const std::string full = test::random_bytes(rng, numel * format::dtype_bits(s.dtype) / 8);
    truth[s.name] = full;
    std::vector<std::vector<uint64_t>> pts;
    for (size_t d = 0; d < s.shape.size(); ++d) {
      pts.push_back(cuts(s.shape[d], s.grid.empty() ? 1 : s.grid[d]));
    }
    // Every cell, row-major.
    std::vector<std::pair<std::vector<uint64_t>, std::vector<uint64_t>>> cells{{{}, {}}};
    for (const auto& p : pts) {
      std::vector<std::pair<std::vector<uint64_t>, std::vector<uint64_t>>> next;
      for (const auto& c : cells) {
        for (size_t i = 0; i + 1 < p.size(); ++i) {
          auto n = c;
          n.first.push_back(p[i]);
          n.second.push_back(p[i + 1] - p[i]);
          next.push_back(std::move(n));
        }
      }
      cells = std::move(next);
    }
    uint32_t rank = 0;
    for (const auto& [off, sz] : cells) {
      uint64_t cn = 1;
      for (auto d : sz) cn *= d;
      if (cn == 0 && numel > 0) continue;
      for (uint32_t r = 0; r < world; ++r) {
        if (!s.replicate && r != rank % world) continue;
        auto& sh = shards[{r, s.file}];
        sh.file_name = format::shard_file_name(r + 1, s.file, files);
        sh.chunks.push_back(test::ChunkSpec{s.name, s.dtype, off, sz, std::nullopt,
                                            test::slice_chunk(full, s.shape, s.dtype, off, sz)});
      }
      ++rank;
    }
  }
  for (const auto& [key, sh] : shards) {
    test::write_file(dir + "/" + sh.file_name, test::make_shard_bytes(sh));
  }
  return truth;
}

// At most 4 cells per tensor: DCP writes one chunk of a tensor per rank, so worlds of 4 and
// up. Layouts: row-sharded, column-sharded (strided), replicated, uneven and 2-D grids, tensors
// bigger than a 1 MiB chunk, and 0-d / empty ones.
std::vector<Spec> mixed_specs() {
  return {
      {"row.weight", DType::F32, {1024, 1030}, {4, 1}, 1, false},  // 4.02 MiB, rows
      {"col.weight", DType::BF16, {300, 2050}, {1, 4}, 1, false},  // 1.17 MiB, strided
      {"grid.weight", DType::F16, {129, 67}, {2, 2}, 2, false},    // uneven 2-D grid
      {"uneven.rows", DType::I32, {10, 7}, {3, 1}, 2, false},      // world 3 cuts 4/4/2
      {"norm.weight", DType::F32, {777}, {}, 2, true},             // replicated everywhere
      {"scalar", DType::F64, {}, {}, 1, false},                    // 0-d
      {"empty", DType::F32, {0, 4}, {}, 2, false},                 // no bytes
      {"tiny.u8", DType::U8, {5}, {}, 1, false},
  };
}

// The reference through the extent map: every tensor's bytes gathered in one call.
std::map<std::string, std::string> extent_map_reference(const std::string& dir,
                                                        const std::string& dtype) {
  layout::BuildOptions bo;
  EXPECT_TRUE(layout::set_dtype_policy(bo, dtype).ok());
  auto ck = source::load_checkpoint_path(dir, bo);
  EXPECT_TRUE(ck.ok());
  std::map<std::string, std::string> out;
  if (!ck) return out;
  std::vector<UniqueFd> fds;
  std::vector<int> raw;
  for (const auto& s : (*ck)->shards) {
    auto fd = open_file(dir + "/" + s.name, O_RDONLY);
    EXPECT_TRUE(fd.ok());
    raw.push_back(fd->get());
    fds.push_back(std::move(*fd));
  }
  std::vector<layout::Segment> segs;
  for (const auto& t : (*ck)->tensors) {
    const auto& f = (*ck)->outputs[t.output];
    layout::map_range(**ck, t.output, t.out_offset, t.nbytes, segs);
    std::string bytes(t.nbytes, '\0');
    EXPECT_TRUE(
        io::gather(io::GatherSource{ck->get(), raw, f.header, {}}, segs, bytes.data()).ok());
    out[t.name] = bytes;
  }
  return out;
}

std::map<std::string, std::string> load_all(const load::Source& src, const load::LoadOptions& lo,
                                            load::LoadStats* stats = nullptr) {
  auto backend = load::make_cpu_backend();
  auto reqs = load::all_tensors(src);
  auto r = load::load(src, reqs, *backend, lo);
  EXPECT_TRUE(r.ok()) << r.error().message;
  std::map<std::string, std::string> out;
  if (!r) return out;
  for (const auto& q : reqs) out[q.name] = std::string(static_cast<const char*>(q.dst), q.bytes);
  if (stats) *stats = r->stats;
  return out;
}

struct Ckpt {
  test::TempDir tmp;
  std::string dir = tmp.path() + "/ckpt";
  std::map<std::string, std::string> truth;
  explicit Ckpt(uint32_t world = 4, uint64_t seed = 1) {
    truth = write_ckpt(dir, mixed_specs(), world, 2, seed);
  }
};

}  // namespace

TEST(LoadChecksum, Xxh64AndBlockSum) {
  EXPECT_EQ(load::xxh64("", 0, 0), 0xEF46DB3751D8E999ull);  // the published test vector
  std::mt19937_64 rng(5);
  const std::string data = test::random_bytes(rng, 3 * load::kChecksumBlock + 12345);
  const uint64_t whole = load::checksum(data.data(), data.size());
  // Any cut at multiples of the block gives the same sum.
  uint64_t parts =
      load::checksum_part(data.data(), 0, 2 * load::kChecksumBlock) +
      load::checksum_part(data.data() + 2 * load::kChecksumBlock, 2 * load::kChecksumBlock,
                          data.size() - 2 * load::kChecksumBlock);
  EXPECT_EQ(whole, parts);
  std::string other = data;
  other[load::kChecksumBlock + 7] ^= 1;
  EXPECT_NE(load::checksum(other.data(), other.size()), whole);
  // Swapping two blocks changes it (each block is seeded with its index).
  std::string swapped = data.substr(load::kChecksumBlock, load::kChecksumBlock) +
                        data.substr(0, load::kChecksumBlock) +
                        data.substr(2 * load::kChecksumBlock);
  EXPECT_NE(load::checksum(swapped.data(), swapped.size()), whole);
}

TEST(Load, RankShardsExactOnEveryLayout) {
  for (uint32_t world : {4u, 5u}) {
    Ckpt c(world, world);
    auto src = load::Source::open(c.dir);
    ASSERT_TRUE(src.ok()) << src.error().message;
    EXPECT_EQ((*src)->kind(), load::Source::Kind::RankShards);
    const auto ref = extent_map_reference(c.dir, "stored");
    // 1 thread, many threads; a ring of 2 MiB (smaller than row.weight) and the default.
    for (auto [threads, chunk, ring] :
         {std::tuple{1u, 1ull << 20, 2u}, std::tuple{7u, 1ull << 20, 2u},
          std::tuple{3u, 16ull << 20, 0u}}) {
      SCOPED_TRACE(testing::Message() << "world " << world << ", " << threads << " threads");
      load::LoadOptions lo;
      lo.threads = threads;
      lo.chunk = chunk;
      lo.ring_slots = ring;
      lo.checksum = true;
      load::LoadStats st;
      auto got = load_all(**src, lo, &st);
      ASSERT_EQ(got.size(), c.truth.size());
      for (const auto& [name, bytes] : c.truth) {
        EXPECT_TRUE(got[name] == bytes) << name;
        EXPECT_TRUE(ref.at(name) == bytes) << name;
      }
      uint64_t total = 0;
      for (const auto& [n, b] : c.truth) total += b.size();
      EXPECT_EQ(st.bytes, total);
      EXPECT_GE(st.bytes_read, total);  // replicas are read once; gaps are not counted
      EXPECT_LE(st.bytes_read, total);
      auto reqs = load::all_tensors(**src);
      ASSERT_EQ(st.checksums.size(), reqs.size());
      for (size_t i = 0; i < reqs.size(); ++i) {
        const auto& b = c.truth[reqs[i].name];
        EXPECT_EQ(st.checksums[i], load::checksum(b.data(), b.size())) << reqs[i].name;
      }
    }
  }
}

TEST(Load, CastViewMatchesTheExtentMap) {
  Ckpt c;
  load::SourceOptions so;
  so.dtype = "fp32";
  auto src = load::Source::open(c.dir, so);
  ASSERT_TRUE(src.ok()) << src.error().message;
  const auto ref = extent_map_reference(c.dir, "fp32");
  load::LoadOptions lo;
  lo.threads = 3;
  lo.chunk = 1ull << 20;
  lo.staging = load::LoadOptions::Staging::Always;
  auto got = load_all(**src, lo);
  for (const auto& [name, bytes] : ref) EXPECT_TRUE(got[name] == bytes) << name;
  // col.weight was BF16: served as F32, twice the bytes.
  EXPECT_EQ(got["col.weight"].size(), c.truth["col.weight"].size() * 2);
}

TEST(Load, ConsolidatedInputAndDirect) {
  Ckpt c;
  const std::string cons = c.tmp.path() + "/cons";
  engine::ConsolidateOptions co;
  co.src = c.dir;
  co.dst = cons;
  co.threads = 2;
  auto r = engine::consolidate(co);
  ASSERT_TRUE(r.ok()) << r.error().message;
  for (bool direct : {false, true}) {
    load::SourceOptions so;
    so.direct = direct;
    auto src = load::Source::open(cons, so);
    ASSERT_TRUE(src.ok()) << src.error().message;
    EXPECT_EQ((*src)->kind(), load::Source::Kind::Consolidated);
    load::LoadOptions lo;
    lo.threads = 4;
    lo.chunk = 1ull << 20;
    lo.ring_slots = 3;
    lo.staging = direct ? load::LoadOptions::Staging::Always : load::LoadOptions::Staging::Auto;
    auto got = load_all(**src, lo);
    ASSERT_EQ(got.size(), c.truth.size());
    for (const auto& [name, bytes] : c.truth) EXPECT_TRUE(got[name] == bytes) << name;
    // Rank shards in direct mode too.
    auto shards = load::Source::open(c.dir, so);
    ASSERT_TRUE(shards.ok());
    got = load_all(**shards, lo);
    for (const auto& [name, bytes] : c.truth) EXPECT_TRUE(got[name] == bytes) << name;
  }
}

TEST(Load, SlicesAndCallerMemory) {
  Ckpt c;
  auto src = load::Source::open(c.dir);
  ASSERT_TRUE(src.ok()) << src.error().message;
  const std::string& row = c.truth["row.weight"];
  const uint64_t row_bytes = 1030 * 4;
  std::string a(697 * row_bytes, '\0');
  std::string b(c.truth["col.weight"].size(), '\0');
  std::vector<load::Request> reqs{
      {"row.weight", a.data(), a.size(), std::pair<uint64_t, uint64_t>{3, 700}},
      {"col.weight", b.data(), b.size(), std::nullopt},
      {"col.weight", nullptr, 10 * 2050 * 2, std::pair<uint64_t, uint64_t>{290, 300}},
  };
  auto backend = load::make_cpu_backend();
  load::LoadOptions lo;
  lo.chunk = 1ull << 20;
  lo.ring_slots = 1;
  lo.staging = load::LoadOptions::Staging::Always;
  auto r = load::load(**src, reqs, *backend, lo);
  ASSERT_TRUE(r.ok()) << r.error().message;
  EXPECT_TRUE(a == row.substr(3 * row_bytes, a.size()));
  EXPECT_TRUE(b == c.truth["col.weight"]);
  ASSERT_EQ(r->owned.size(), 1u);
  EXPECT_EQ(reqs[2].dst, r->owned[0].data());
  EXPECT_TRUE(std::string(r->owned[0].data(), reqs[2].bytes) ==
              c.truth["col.weight"].substr(290 * 2050 * 2));
}

TEST(Load, WrongRequestsAreRefusedNamingTheTensor) {
  Ckpt c;
  auto src = load::Source::open(c.dir);
  ASSERT_TRUE(src.ok()) << src.error().message;
  auto backend = load::make_cpu_backend();
  auto refused = [&](load::Request q, int code, std::string_view what) {
    std::vector<load::Request> reqs{std::move(q)};
    auto r = load::load(**src, reqs, *backend);
    ASSERT_FALSE(r.ok()) << what;
    EXPECT_EQ(r.error().code, code) << r.error().message;
    EXPECT_NE(r.error().message.find(what), std::string::npos) << r.error().message;
  };
  refused({"no.such.tensor", nullptr, 4, {}}, ENOENT, "'no.such.tensor'");
  refused({"row.weight", nullptr, 4, {}}, EINVAL, "'row.weight'");
  refused({"row.weight", nullptr, 0, std::pair<uint64_t, uint64_t>{5, 2000}}, EINVAL,
          "'row.weight': rows [5, 2000)");
  refused({"row.weight", nullptr, 4120, std::pair<uint64_t, uint64_t>{0, 2}}, EINVAL,
          "the slice has 8240");
  refused({"scalar", nullptr, 8, std::pair<uint64_t, uint64_t>{0, 1}}, EINVAL, "'scalar' is 0-d");
  load::LoadOptions lo;
  lo.chunk = 12345;
  auto reqs = load::all_tensors(**src);
  auto r = load::load(**src, reqs, *backend, lo);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, EINVAL);
}

TEST(Load, BadCheckpointsAreRefusedNamingFileAndTensor) {
  // A rank's chunk missing in the middle of a tensor: a gap, never zeros.
  {
    test::TempDir tmp;
    const std::string dir = tmp.path() + "/ck";
    write_ckpt(dir, {{"w", DType::F32, {12, 4}, {3, 1}, 1, false}}, 3, 1, 1);
    std::string bytes;
    {
      // Rewrite rank 2's shard without its chunk (an empty shard).
      test::ShardSpec empty{format::shard_file_name(2, 1, 1), {}};
      test::write_file(dir + "/" + empty.file_name, test::make_shard_bytes(empty));
    }
    auto src = load::Source::open(dir);
    ASSERT_FALSE(src.ok());
    EXPECT_EQ(src.error().code, EINVAL);
    EXPECT_NE(src.error().message.find("not a complete, valid checkpoint"), std::string::npos);
    EXPECT_NE(src.error().message.find("tensor 'w'"), std::string::npos) << src.error().message;
  }
  // A truncated shard: the problem names the file.
  {
    test::TempDir tmp;
    const std::string dir = tmp.path() + "/ck";
    write_ckpt(dir, {{"w", DType::F32, {12, 4}, {2, 1}, 1, false}}, 2, 1, 1);
    const std::string victim = dir + "/" + format::shard_file_name(2, 1, 1);
    ASSERT_EQ(::truncate(victim.c_str(), static_cast<off_t>(stdfs::file_size(victim) - 5)), 0);
    auto src = load::Source::open(dir);
    ASSERT_FALSE(src.ok());
    EXPECT_NE(src.error().message.find(format::shard_file_name(2, 1, 1)), std::string::npos)
        << src.error().message;
  }
  // Consolidated: a file missing from a set, and a corrupt header.
  {
    test::TempDir tmp;
    const std::string dir = tmp.path() + "/ck";
    stdfs::create_directories(dir);
    test::write_file(dir + "/" + format::model_file_name(2, 2), "xx");
    auto src = load::Source::open(dir);
    ASSERT_FALSE(src.ok());
    EXPECT_NE(src.error().message.find(format::model_file_name(1, 2)), std::string::npos)
        << src.error().message;
    test::write_file(dir + "/" + format::model_file_name(1, 2), std::string(16, '\xff'));
    src = load::Source::open(dir);
    ASSERT_FALSE(src.ok());
    EXPECT_NE(src.error().message.find(format::model_file_name(1, 2)), std::string::npos)
        << src.error().message;
  }
  // Nothing to load.
  {
    test::TempDir tmp;
    auto src = load::Source::open(tmp.path());
    ASSERT_FALSE(src.ok());
    EXPECT_EQ(src.error().code, ENOENT);
  }
}

TEST(LoadCollective, AssignmentIsBalancedAndDeterministic) {
  std::vector<uint64_t> bytes{100, 1, 50, 50, 0, 99};
  auto a = load::assign_balanced(bytes, 2);
  EXPECT_EQ(a, load::assign_balanced(bytes, 2));
  uint64_t r0 = 0, r1 = 0;
  for (size_t i = 0; i < bytes.size(); ++i) (a[i] == 0 ? r0 : r1) += bytes[i];
  EXPECT_EQ(r0 + r1, 300u);
  EXPECT_LE(std::max(r0, r1) - std::min(r0, r1), 100u);
  EXPECT_EQ(load::assign_balanced(bytes, 1), std::vector<unsigned>(bytes.size(), 0));
}

TEST(LoadCollective, ThreadRanksReadOnceAndAllGetEveryByte) {
  // Many mid-sized tensors so a share can be near 1/N.
  std::vector<Spec> specs;
  for (int i = 0; i < 24; ++i) {
    specs.push_back({"layer" + std::to_string(i) + ".w",
                     i % 2 ? DType::BF16 : DType::F32,
                     {64, static_cast<uint64_t>(100 + 13 * i)},
                     {i % 3 ? 4u : 1u, i % 3 ? 1u : 4u},
                     1u + i % 2,
                     false});
  }
  specs.push_back({"norm", DType::F32, {33}, {}, 1, true});
  // Layouts: many row- and column-sharded tensors (stored, and a cast view), then the mixed
  // set (2-D grid, uneven, replicated, 0-d, empty) over 5 ranks.
  for (auto [dtype, mixed] :
       {std::pair{"stored", false}, std::pair{"fp32", false}, std::pair{"stored", true}}) {
    test::TempDir tmp;
    const std::string dir = tmp.path() + "/ck";
    auto truth = mixed ? write_ckpt(dir, mixed_specs(), 5, 2, 11) : write_ckpt(dir, specs, 4, 2, 9);
    const auto ref = extent_map_reference(dir, dtype);
    uint64_t total = 0;
    for (const auto& [n, b] : ref) total += b.size();
    uint64_t read_alone = 0;  // what one rank reads (source bytes: half the served for BF16->F32)
    for (unsigned ranks : {1u, 2u, 3u, 4u}) {
      SCOPED_TRACE(testing::Message()
                   << ranks << " ranks, dtype " << dtype << (mixed ? ", mixed layouts" : ""));
      auto group = load::ThreadGroup::create(ranks, 60000);
      std::vector<std::map<std::string, std::string>> got(ranks);
      std::vector<load::LoadStats> stats(ranks);
      std::vector<std::string> errors(ranks);
      std::vector<std::thread> threads;
      for (unsigned r = 0; r < ranks; ++r) {
        threads.emplace_back([&, r] {
          load::SourceOptions so;
          so.dtype = dtype;
          auto src = load::Source::open(dir, so);  // each rank opens its own files
          auto coll = group->member(r);
          if (!src) {
            errors[r] = src.error().message;
            (void)coll->all_ok(false);
            return;
          }
          auto backend = load::make_cpu_backend();
          auto reqs = load::all_tensors(**src);
          load::LoadOptions lo;
          lo.threads = 2;
          lo.chunk = 1ull << 20;
          lo.checksum = true;
          if (std::string(dtype) == "stored") lo.staging = load::LoadOptions::Staging::Always;
          auto res = load::load(**src, reqs, *backend, lo, coll.get());
          if (!res) {
            errors[r] = res.error().message;
            return;
          }
          for (size_t i = 0; i < reqs.size(); ++i) {
            got[r][reqs[i].name] =
                std::string(static_cast<const char*>(reqs[i].dst), reqs[i].bytes);
            if (res->stats.checksums[i] !=
                load::checksum(static_cast<const char*>(reqs[i].dst), reqs[i].bytes)) {
              errors[r] = "checksum of " + reqs[i].name;
            }
          }
          stats[r] = res->stats;
        });
      }
      for (auto& t : threads) t.join();
      uint64_t read = 0;
      uint64_t largest = 0;
      for (const auto& [n, b] : ref) largest = std::max<uint64_t>(largest, b.size());
      for (unsigned r = 0; r < ranks; ++r) {
        EXPECT_EQ(errors[r], "") << "rank " << r;
        ASSERT_EQ(got[r].size(), ref.size());
        for (const auto& [name, bytes] : ref)
          EXPECT_TRUE(got[r][name] == bytes) << r << " " << name;
        EXPECT_EQ(stats[r].bytes, total);
        if (std::string(dtype) == "stored") {
          EXPECT_EQ(stats[r].bytes_shared + stats[r].bytes_read, total) << r;
        }
        // Balanced: no rank reads more than its 1/N plus one tensor.
        EXPECT_LE(stats[r].bytes_read, total / ranks + largest) << r;
        read += stats[r].bytes_read;
      }
      if (ranks == 1) read_alone = read;
      EXPECT_EQ(read, read_alone);  // storage read once in all
    }
  }
}

TEST(LoadCollective, AFailingRankFailsEveryRankWithoutHanging) {
  test::TempDir tmp;
  const std::string dir = tmp.path() + "/ck";
  write_ckpt(dir, mixed_specs(), 4, 2, 3);
  auto group = load::ThreadGroup::create(2, 20000);
  std::vector<Status> results(2);
  std::vector<std::thread> threads;
  for (unsigned r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      auto src = load::Source::open(dir);
      ASSERT_TRUE(src.ok()) << src.error().message;
      auto coll = group->member(r);
      auto backend = load::make_cpu_backend();
      auto reqs = load::all_tensors(**src);
      if (r == 1) reqs[0].bytes += 1;  // rank 1 asks for a wrong size
      auto res = load::load(**src, reqs, *backend, {}, coll.get());
      if (!res) results[r] = res.error();
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_FALSE(results[1].ok());
  EXPECT_NE(results[1].error().message.find("the ranks passed different requests"),
            std::string::npos)
      << results[1].error().message;
  ASSERT_FALSE(results[0].ok());
  EXPECT_NE(results[0].error().message.find("the ranks passed different requests"),
            std::string::npos)
      << results[0].error().message;

  // Same requests, but rank 1 fails locally: rank 0 learns it and fails too.
  for (unsigned r = 0; r < 2; ++r) results[r] = Status{};
  threads.clear();
  for (unsigned r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      auto src = load::Source::open(dir);
      ASSERT_TRUE(src.ok());
      auto coll = group->member(r);
      auto backend = load::make_cpu_backend();
      std::vector<load::Request> reqs{{"row.weight", nullptr, 1024 * 1030 * 4, {}}};
      // Rank 1 fails locally after the requests agreed: a chunk size the loader refuses.
      load::LoadOptions lo;
      if (r == 1) lo.chunk = 12345;
      auto res = load::load(**src, reqs, *backend, lo, coll.get());
      if (!res) results[r] = res.error();
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_FALSE(results[1].ok());
  EXPECT_NE(results[1].error().message.find("chunk size"), std::string::npos);
  ASSERT_FALSE(results[0].ok());
  EXPECT_NE(results[0].error().message.find("another rank failed"), std::string::npos)
      << results[0].error().message;
}

TEST(Load, ConsolidatedSetWithAnUnusedFileNumber) {
  // Tensors in files 1 and 3 of 3: ckptfs consolidate writes no file 2; the index names the
  // files, and a file the index names but that is missing is refused, named.
  test::TempDir tmp;
  const std::string dir = tmp.path() + "/ck";
  auto truth = write_ckpt(
      dir, {{"a", DType::F32, {8, 4}, {2, 1}, 1, false}, {"b", DType::BF16, {6}, {}, 3, false}}, 2,
      3, 4);
  engine::ConsolidateOptions co;
  co.src = dir;
  co.dst = tmp.path() + "/cons";
  ASSERT_TRUE(engine::consolidate(co).ok());
  ASSERT_FALSE(stdfs::exists(co.dst + "/" + format::model_file_name(2, 3)));
  auto src = load::Source::open(co.dst);
  ASSERT_TRUE(src.ok()) << src.error().message;
  auto got = load_all(**src, {});
  EXPECT_TRUE(got == truth);
  stdfs::remove(co.dst + "/" + format::model_file_name(3, 3));
  src = load::Source::open(co.dst);
  ASSERT_FALSE(src.ok());
  EXPECT_NE(src.error().message.find(format::model_file_name(3, 3)), std::string::npos)
      << src.error().message;
}

TEST(LoadCuda, OnTheDeviceOrACleanRefusal) {
  auto bad = load::make_backend("tpu", true);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.error().code, EINVAL);
  auto b = load::make_backend("cuda:0", true);
  if (!b) {
    // No GPU (or no CUDA in this build): a clear error, never a crash.
    EXPECT_TRUE(b.error().code == ENODEV || b.error().code == ENOTSUP) << b.error().message;
    EXPECT_NE(b.error().message.find("cuda:0"), std::string::npos);
    GTEST_SKIP() << "no CUDA device: " << b.error().message;
  }
  // With a GPU: the staged pipeline into device memory the loader allocates, copied back.
  Ckpt c;
  auto src = load::Source::open(c.dir);
  ASSERT_TRUE(src.ok()) << src.error().message;
  auto reqs = load::all_tensors(**src);
  load::LoadOptions lo;
  lo.threads = 4;
  lo.chunk = 1ull << 20;
  lo.ring_slots = 3;
  lo.checksum = true;
  auto r = load::load(**src, reqs, **b, lo);
  ASSERT_TRUE(r.ok()) << r.error().message;
  for (size_t i = 0; i < reqs.size(); ++i) {
    std::string host(reqs[i].bytes, '\0');
    ASSERT_TRUE((*b)->to_host(host.data(), reqs[i].dst, host.size()).ok());
    EXPECT_TRUE(host == c.truth[reqs[i].name]) << reqs[i].name;
    auto sum = load::checksum_dest(**b, reqs[i].dst, reqs[i].bytes);
    ASSERT_TRUE(sum.ok());
    EXPECT_EQ(*sum, r->stats.checksums[i]) << reqs[i].name;
  }
}

// The huge-page rule (docs/loader.md): advised unless a virtio balloon reports free pages;
// the override wins either way. Driven with a fake sysfs driver directory.
TEST(LoadHugePages, AdvisedUnlessABalloonReportsFreePages) {
  test::TempDir tmp;
  const std::string drv = tmp.path() + "/virtio_balloon";
  EXPECT_TRUE(load::huge_pages_pay(nullptr, drv));  // no balloon driver
  stdfs::create_directories(drv + "/virtio3");
  stdfs::create_directories(drv + "/module");       // not a device: never read
  EXPECT_TRUE(load::huge_pages_pay(nullptr, drv));  // a device without a features file
  std::ofstream(drv + "/virtio3/features") << "0110000000000000000000000000000010000000\n";
  EXPECT_TRUE(load::huge_pages_pay(nullptr, drv));  // stats, deflate on OOM; no reporting
  std::ofstream(drv + "/module/features") << "0000010\n";
  EXPECT_TRUE(load::huge_pages_pay(nullptr, drv));
  stdfs::create_directories(drv + "/virtio7");
  std::ofstream(drv + "/virtio7/features") << "0110010000000000000000000000000010000000\n";
  EXPECT_FALSE(load::huge_pages_pay(nullptr, drv));  // bit 5: free page reporting
  EXPECT_FALSE(load::huge_pages_pay("", drv));
  EXPECT_FALSE(load::huge_pages_pay("yes", drv));  // not an override
  EXPECT_TRUE(load::huge_pages_pay("1", drv));
  EXPECT_FALSE(load::huge_pages_pay("0", tmp.path() + "/none"));
}

// Whether the VMA holding `p` carries VM_HUGEPAGE ("hg" in /proc/self/smaps VmFlags).
static bool advised_huge(const void* p) {
  std::ifstream smaps("/proc/self/smaps");
  const auto at = reinterpret_cast<uintptr_t>(p);
  std::string line;
  bool inside = false;
  while (std::getline(smaps, line)) {
    uintptr_t lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2 && line.find(':') > line.find(' ')) {
      inside = lo <= at && at < hi;
    } else if (inside && line.starts_with("VmFlags:")) {
      return line.find(" hg") != std::string::npos;
    }
  }
  ADD_FAILURE() << "no mapping holds " << p;
  return false;
}

// The CPU backend's destinations follow the rule: advised with huge_pages, not without.
// 64 MiB is above glibc's largest mmap threshold, so each buffer is a mapping of its own.
TEST(LoadHugePages, CpuBackendAdvisesOnlyWhenAsked) {
  for (const bool huge : {true, false}) {
    auto b = load::make_backend("cpu", huge);
    ASSERT_TRUE(b.ok()) << b.error().message;
    auto dest = (*b)->alloc_dest(64ull << 20);
    ASSERT_TRUE(dest.ok()) << dest.error().message;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(dest->data()) % (2ull << 20), 0u);
    EXPECT_EQ(advised_huge(dest->data() + (8ull << 20)), huge) << "huge_pages=" << huge;
    auto staging = (*b)->alloc_staging(64ull << 20);
    ASSERT_TRUE(staging.ok()) << staging.error().message;
    EXPECT_EQ(advised_huge(staging->data() + (8ull << 20)), huge) << "huge_pages=" << huge;
  }
}
