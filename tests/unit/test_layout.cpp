#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <set>

#include <fmt/format.h>

#include "ckptfs/format/model_map.hpp"
#include "ckptfs/format/names.hpp"
#include "ckptfs/format/safetensors.hpp"
#include "ckptfs/layout/extent_map.hpp"
#include "ckptfs/layout/map_report.hpp"
#include "ckptfs/util/checked.hpp"
#include "fixture.hpp"

using namespace ckptfs;
using namespace ckptfs::layout;
using format::DType;
using test::ChunkSpec;
using test::ShardSpec;

namespace {

struct Built {
  std::shared_ptr<const Checkpoint> ck;
  std::map<std::string, std::string> files;  // shard name -> bytes
};

Built build(const std::vector<ShardSpec>& shards,
            std::optional<format::FqnMapping> mapping = std::nullopt) {
  Built b;
  BuildInput in;
  in.dir = "ckpt";
  for (const auto& s : shards) {
    auto bytes = test::make_shard_bytes(s);
    in.shards.push_back(test::shard_input(s.file_name, bytes));
    b.files[s.file_name] = bytes;
  }
  in.mapping = std::move(mapping);
  b.ck = build_checkpoint(std::move(in));
  return b;
}

std::string problems(const Checkpoint& c) {
  std::string s;
  for (const auto& p : c.problems) s += p.to_string() + "\n";
  return s;
}

bool has_problem(const Checkpoint& c, std::string_view needle, std::string_view tensor = {}) {
  return std::any_of(c.problems.begin(), c.problems.end(), [&](const Problem& p) {
    return p.to_string().find(needle) != std::string::npos &&
           (tensor.empty() || p.tensor == tensor);
  });
}

// Reads a whole consolidated file through the extent map.
std::string read_via_map(const Built& b, uint32_t file, uint64_t off, uint64_t len) {
  std::vector<Segment> segs;
  map_range(*b.ck, file, off, len, segs);
  std::string out;
  for (const auto& s : segs) {
    if (s.is_memory()) {
      out += b.ck->outputs[file].header.substr(s.src, s.len);
    } else {
      out += b.files.at(b.ck->shards[s.shard].name).substr(s.src, s.len);
    }
  }
  return out;
}

ChunkSpec chunk(std::string name, DType dt, std::vector<uint64_t> off, std::vector<uint64_t> sz,
                std::string data = {}) {
  return ChunkSpec{std::move(name), dt,           std::move(off),
                   std::move(sz),   std::nullopt, std::move(data)};
}

std::string shard(int r, int k = 1, int m = 1) { return format::shard_file_name(r, k, m); }

}  // namespace

TEST(Build, RowShardedTensorIsOneRunPerChunk) {
  std::string a(32, 'a'), c(32, 'c');
  auto b = build({{shard(1), {chunk("w", DType::F32, {0, 0}, {2, 4}, a)}},
                  {shard(2), {chunk("w", DType::F32, {2, 0}, {2, 4}, c)}}});
  ASSERT_TRUE(b.ck->valid()) << problems(*b.ck);
  ASSERT_EQ(b.ck->outputs.size(), 1u);
  EXPECT_EQ(b.ck->outputs[0].name, "model-00001-of-00001.safetensors");
  const auto& t = b.ck->tensors[0];
  EXPECT_EQ(t.shape, (std::vector<uint64_t>{4, 4}));
  std::vector<Segment> segs;
  map_range(*b.ck, 0, 0, UINT64_MAX, segs);
  ASSERT_EQ(segs.size(), 3u);  // header, chunk 1, chunk 2
  EXPECT_TRUE(segs[0].is_memory());
  EXPECT_EQ(segs[1].len, 32u);
  EXPECT_EQ(segs[2].len, 32u);
  EXPECT_EQ(read_via_map(b, 0, b.ck->outputs[0].header.size(), 64), a + c);
}

TEST(Build, ColumnShardedTensorInterleavesRows) {
  // 2 rows x 4 cols of U8, split into two 2-column chunks.
  auto b = build({{shard(1), {chunk("w", DType::U8, {0, 0}, {2, 2}, "abcd")}},
                  {shard(2), {chunk("w", DType::U8, {0, 2}, {2, 2}, "ABCD")}}});
  ASSERT_TRUE(b.ck->valid()) << problems(*b.ck);
  EXPECT_EQ(read_via_map(b, 0, b.ck->outputs[0].header.size(), 8), "abABcdCD");
  EXPECT_EQ(read_via_map(b, 0, b.ck->outputs[0].header.size() + 3, 3), "Bcd");
}

TEST(Build, WholeTensorsWithoutShardingInfo) {
  ShardSpec s{shard(1), {chunk("a", DType::I32, {0}, {3}), chunk("b", DType::F16, {}, {})}, false};
  auto b = build({s});
  ASSERT_TRUE(b.ck->valid()) << problems(*b.ck);
  EXPECT_EQ(b.ck->tensors.size(), 2u);
}

TEST(Build, ReplicasAreDeduplicated) {
  auto b = build({{shard(1), {chunk("norm", DType::F32, {0}, {4}, std::string(16, 'x'))}},
                  {shard(2), {chunk("norm", DType::F32, {0}, {4}, std::string(16, 'x'))}}});
  ASSERT_TRUE(b.ck->valid()) << problems(*b.ck);
  ASSERT_EQ(b.ck->tensors[0].chunks.size(), 1u);
  EXPECT_EQ(b.ck->tensors[0].chunks[0].replicas.size(), 1u);
}

TEST(Build, GapIsAnErrorNamingTensorAndFiles) {
  auto b = build({{shard(1), {chunk("w", DType::F32, {0, 0}, {2, 4})}},
                  {shard(3), {chunk("w", DType::F32, {4, 0}, {2, 4})}}});
  EXPECT_FALSE(b.ck->valid());
  EXPECT_TRUE(b.ck->outputs.empty());
  EXPECT_TRUE(has_problem(*b.ck, "gap", "w")) << problems(*b.ck);
  EXPECT_TRUE(has_problem(*b.ck, "shard-00001")) << problems(*b.ck);
  EXPECT_TRUE(has_problem(*b.ck, "[2, 0]")) << problems(*b.ck);
}

TEST(Build, MissingTailIsCaughtWhenFullShapeIsKnown) {
  ShardSpec s{shard(1), {chunk("w", DType::F32, {0}, {4})}};
  s.chunks[0].full_shape = std::vector<uint64_t>{8};
  auto b = build({s});
  EXPECT_TRUE(has_problem(*b.ck, "gap", "w")) << problems(*b.ck);
}

TEST(Build, OverlapIsAnError) {
  auto b = build({{shard(1), {chunk("w", DType::F32, {0, 0}, {3, 4})}},
                  {shard(2), {chunk("w", DType::F32, {2, 0}, {2, 4})}}});
  EXPECT_TRUE(has_problem(*b.ck, "overlap", "w")) << problems(*b.ck);
  EXPECT_TRUE(has_problem(*b.ck, "shard-00002")) << problems(*b.ck);
}

TEST(Build, DtypeAndRankMismatchesAreErrors) {
  auto b = build({{shard(1), {chunk("w", DType::F32, {0}, {4})}},
                  {shard(2), {chunk("w", DType::BF16, {4}, {4})}}});
  EXPECT_TRUE(has_problem(*b.ck, "dtype BF16 differs from F32", "w")) << problems(*b.ck);
  auto c = build({{shard(1), {chunk("w", DType::F32, {0}, {4})}},
                  {shard(2), {chunk("w", DType::F32, {4, 0}, {4, 1})}}});
  EXPECT_TRUE(has_problem(*c.ck, "number of dimensions 2 differs from 1", "w")) << problems(*c.ck);
  auto d = build({{shard(1), {chunk("w", DType::F32, {0, 0}, {4})}}});
  EXPECT_TRUE(has_problem(*d.ck, "saved_offsets [0, 0] has rank 2", "w")) << problems(*d.ck);
}

TEST(Build, ChunkOutsideDeclaredShapeIsAnError) {
  ShardSpec s{shard(1), {chunk("w", DType::F32, {6}, {4})}};
  s.chunks[0].full_shape = std::vector<uint64_t>{8};
  auto b = build({s});
  EXPECT_TRUE(has_problem(*b.ck, "outside the tensor shape", "w")) << problems(*b.ck);
}

TEST(Build, UnreadableShardIsAProblem) {
  BuildInput in;
  in.dir = "d";
  layout::ShardInput si;
  si.name = shard(1);
  si.error = "header length 999 runs past the end";
  in.shards.push_back(si);
  auto ck = build_checkpoint(std::move(in));
  EXPECT_TRUE(has_problem(*ck, "runs past the end")) << problems(*ck);
  EXPECT_TRUE(ck->outputs.empty());
}

TEST(Build, OutputFilesFollowShardNames) {
  auto b = build({{shard(1, 1, 2), {chunk("a", DType::U8, {0}, {2}, "aa")}},
                  {shard(1, 2, 2), {chunk("b", DType::U8, {0}, {2}, "bb")}},
                  {shard(2, 2, 2), {chunk("b", DType::U8, {2}, {2}, "BB")}}});
  ASSERT_TRUE(b.ck->valid()) << problems(*b.ck);
  ASSERT_EQ(b.ck->outputs.size(), 2u);
  EXPECT_EQ(b.ck->outputs[0].name, "model-00001-of-00002.safetensors");
  EXPECT_EQ(b.ck->outputs[1].name, "model-00002-of-00002.safetensors");
  EXPECT_NE(b.ck->index_json.find("\"b\": \"model-00002-of-00002.safetensors\""), std::string::npos)
      << b.ck->index_json;
  EXPECT_NE(b.ck->index_json.find("\"total_size\": 6"), std::string::npos) << b.ck->index_json;
}

TEST(Build, MappingFileDecidesGroupingAndOrder) {
  format::FqnMapping m = {{"z", 1}, {"a", 2}, {"y", 1}};
  auto b = build({{shard(1),
                   {chunk("a", DType::U8, {0}, {1}, "A"), chunk("y", DType::U8, {0}, {1}, "Y"),
                    chunk("z", DType::U8, {0}, {1}, "Z")}}},
                 m);
  ASSERT_TRUE(b.ck->valid()) << problems(*b.ck);
  ASSERT_EQ(b.ck->outputs.size(), 2u);
  EXPECT_EQ(b.ck->outputs[0].name, "model-00001-of-00002.safetensors");
  // z before y: the mapping's order.
  EXPECT_EQ(read_via_map(b, 0, b.ck->outputs[0].header.size(), 2), "ZY");
  // A tensor the mapping lists but no shard has means a missing shard.
  format::FqnMapping m2 = {{"a", 1}, {"gone", 1}};
  auto c = build({{shard(1), {chunk("a", DType::U8, {0}, {1}, "A")}}}, m2);
  EXPECT_TRUE(has_problem(*c.ck, "found in no shard", "gone")) << problems(*c.ck);
  // And a tensor it does not list is refused.
  format::FqnMapping m3 = {{"a", 1}};
  auto d = build(
      {{shard(1), {chunk("a", DType::U8, {0}, {1}), chunk("extra", DType::U8, {0}, {1})}}}, m3);
  EXPECT_TRUE(has_problem(*d.ck, "not in fqn_to_file_index_mapping.json", "extra"))
      << problems(*d.ck);
}

TEST(Build, ConflictingOutputAssignmentsAreErrors) {
  auto b = build({{shard(1, 1, 2), {chunk("w", DType::U8, {0}, {2})}},
                  {shard(2, 2, 2), {chunk("w", DType::U8, {2}, {2})}}});
  EXPECT_TRUE(has_problem(*b.ck, "output file", "w")) << problems(*b.ck);
  auto c = build({{shard(1, 1, 2), {chunk("w", DType::U8, {0}, {2})}},
                  {shard(2, 1, 3), {chunk("v", DType::U8, {0}, {2})}}});
  EXPECT_TRUE(has_problem(*c.ck, "output files")) << problems(*c.ck);
}

TEST(Build, SubByteChunksMustBeByteAligned) {
  // F4 [2, 4]: column split at 2 -> runs of 2 elements = 8 bits: fine.
  auto b = build({{shard(1), {chunk("q", DType::F4, {0, 0}, {2, 2})}},
                  {shard(2), {chunk("q", DType::F4, {0, 2}, {2, 2})}}});
  EXPECT_TRUE(b.ck->valid()) << problems(*b.ck);
  // F4 [2, 6] split 4 + 2 columns: rows are 24 bits, runs 16 and 8 bits: fine.
  auto c = build({{shard(1), {chunk("q", DType::F4, {0, 0}, {2, 4})}},
                  {shard(2), {chunk("q", DType::F4, {0, 4}, {2, 2})}}});
  EXPECT_TRUE(c.ck->valid()) << problems(*c.ck);
  auto d = build({{shard(1), {chunk("q", DType::F4, {0, 0}, {4, 2})}},
                  {shard(2), {chunk("q", DType::F4, {0, 2}, {4, 4})}}});
  EXPECT_TRUE(d.ck->valid()) << problems(*d.ck);
  // F6 [4, 4] split 1 + 3 columns: a 6-bit run cannot be a whole number of bytes.
  auto e = build({{shard(1), {chunk("q", DType::F6_E2M3, {0, 0}, {4, 1})}},
                  {shard(2), {chunk("q", DType::F6_E2M3, {0, 1}, {4, 3})}}});
  EXPECT_TRUE(has_problem(*e.ck, "inside a byte", "q")) << problems(*e.ck);
}

TEST(Build, ZeroDimAndEmptyTensors) {
  auto b = build({{shard(1),
                   {chunk("scalar", DType::F64, {}, {}, "12345678"),
                    chunk("empty", DType::F32, {0, 0}, {0, 8})}},
                  {shard(2), {chunk("scalar", DType::F64, {}, {}, "12345678")}}});
  ASSERT_TRUE(b.ck->valid()) << problems(*b.ck);
  EXPECT_EQ(read_via_map(b, 0, b.ck->outputs[0].header.size(), 100), "12345678");
}

TEST(Build, NoTensorsIsAProblem) {
  auto b = build({{shard(1), {}}});
  EXPECT_TRUE(has_problem(*b.ck, "no tensors")) << problems(*b.ck);
}

namespace {

// A shard whose header lists `entries` (U8 [1] each, in order) and whose
// __metadata__["DCP_SHARDING_INFO"] is `info` verbatim.
ShardInput shard_with_info(const std::string& name, const std::vector<std::string>& entries,
                           const std::string& info) {
  std::vector<format::TensorEntry> te;
  for (const auto& e : entries) {
    te.push_back({e, DType::U8, {1}, te.size(), te.size() + 1});
  }
  auto bytes = format::serialize_header(te, {{"DCP_SHARDING_INFO", info}, {"format", "pt"}}) +
               std::string(te.size(), '\0');
  return test::shard_input(name, bytes);
}

}  // namespace

TEST(Build, DeeplyNestedShardingInfoIsAProblemNamingTheFile) {
  // 100,000 levels where saved_offsets should be: once a stack overflow in the error message.
  const std::string deep = std::string(100'000, '[') + std::string(100'000, ']');
  BuildInput in;
  in.dir = "d";
  in.shards.push_back(shard_with_info(shard(1), {"w"}, R"({"w":{"saved_offsets":)" + deep + "}}"));
  in.shards.push_back(shard_with_info(shard(2), {"w"}, R"({"w":{"saved_offsets":[1]}})"));
  auto ck = build_checkpoint(std::move(in));
  ASSERT_FALSE(ck->valid());
  EXPECT_TRUE(std::any_of(ck->problems.begin(), ck->problems.end(), [&](const Problem& p) {
    return p.file == shard(1) &&
           p.message.find("DCP_SHARDING_INFO is nested deeper than 64 levels") != std::string::npos;
  })) << problems(*ck);
  EXPECT_TRUE(ck->outputs.empty());
}

TEST(Build, DeeplyNestedHeaderIsAProblemNamingTheFile) {
  const std::string deep = std::string(100'000, '{') + std::string(100'000, '}');
  std::string json = R"({"w":)" + deep + "}";
  std::string bytes(8, '\0');
  for (size_t i = 0; i < 8; ++i) bytes[i] = static_cast<char>((json.size() >> (8 * i)) & 0xff);
  BuildInput in;
  in.dir = "d";
  in.shards.push_back(test::shard_input(shard(1), bytes + json));
  auto ck = build_checkpoint(std::move(in));
  ASSERT_EQ(ck->problems.size(), 1u) << problems(*ck);
  EXPECT_EQ(ck->problems[0].file, shard(1));
  EXPECT_NE(ck->problems[0].message.find("header is nested deeper than 64 levels"),
            std::string::npos)
      << problems(*ck);
}

TEST(Build, ShardingInfoEntriesWithoutHeaderEntriesAreNamed) {
  BuildInput in;
  in.dir = "d";
  in.shards.push_back(shard_with_info(
      shard(1), {"a", "b"},
      R"({"a":{"saved_offsets":[0]},"ghost":{"saved_offsets":[0]},"b":{"saved_offsets":[0]}})"));
  auto ck = build_checkpoint(std::move(in));
  ASSERT_EQ(ck->problems.size(), 1u) << problems(*ck);
  EXPECT_EQ(ck->problems[0].tensor, "ghost");
  EXPECT_TRUE(has_problem(*ck, "listed in DCP_SHARDING_INFO but has no header entry", "ghost"));
}

TEST(Build, ManyTensorsInTwoRanks) {
  // The shape of an MoE checkpoint: few files, huge headers. (Speed is measured by
  // tools/bench_engine, not asserted here; this checks the result.)
  constexpr size_t kTensors = 5000;
  std::vector<std::string> names;
  std::string info[2] = {"{", "{"};
  for (size_t t = 0; t < kTensors; ++t) {
    names.push_back(fmt::format("model.layers.{}.mlp.experts.{}.weight", t / 64, t % 64));
    for (int r = 0; r < 2; ++r) {
      info[r] += fmt::format(R"({}"{}":{{"saved_offsets":[{}]}})", t ? "," : "", names.back(), r);
    }
  }
  BuildInput in;
  in.dir = "d";
  for (int r = 0; r < 2; ++r)
    in.shards.push_back(shard_with_info(shard(r + 1), names, info[r] + "}"));
  auto ck = build_checkpoint(std::move(in));
  ASSERT_TRUE(ck->valid()) << problems(*ck);
  ASSERT_EQ(ck->tensors.size(), kTensors);
  for (const auto& t : ck->tensors) {
    ASSERT_EQ(t.shape, (std::vector<uint64_t>{2})) << t.name;
    ASSERT_EQ(t.chunks.size(), 2u) << t.name;
  }
  ASSERT_EQ(ck->outputs.size(), 1u);
  EXPECT_EQ(ck->outputs[0].tensors.size(), kTensors);
}

// ---------------------------------------------------------------------------------------
// Property test: random shapes, chunk grids, dtypes and byte ranges, checked against the
// naive element-by-element reference (full tensors sliced into chunks by test::slice_chunk).

namespace {

struct Case {
  std::vector<ShardSpec> shards;
  std::vector<std::pair<std::string, std::string>> truth;  // tensor -> full bytes
  std::map<std::string, DType> dtypes;
};

// Splits [0, n) into random pieces (or one piece).
std::vector<uint64_t> cuts(std::mt19937_64& rng, uint64_t n, int max_pieces) {
  std::set<uint64_t> c{0, n};
  int pieces = 1 + static_cast<int>(rng() % max_pieces);
  for (int i = 1; i < pieces && n > 1; ++i) c.insert(1 + rng() % (n - 1));
  return {c.begin(), c.end()};
}

Case random_case(std::mt19937_64& rng, int min_world) {
  Case cs;
  auto dts = format::all_dtypes();
  int ntensors = 1 + static_cast<int>(rng() % 4);
  std::map<int, std::vector<ChunkSpec>> per_rank;
  for (int ti = 0; ti < ntensors; ++ti) {
    std::string name = "t" + std::to_string(ti);
    DType dt = dts[rng() % dts.size()].dtype;
    size_t rank = rng() % 5;
    std::vector<uint64_t> shape(rank);
    for (auto& d : shape) d = (rng() % 10 == 0) ? 0 : 1 + rng() % 9;
    // Sub-byte types: keep the innermost dimension such that whole tensors are byte-sized.
    uint64_t bits = format::dtype_bits(dt);
    if (bits % 8 != 0) {
      if (shape.empty()) {
        dt = DType::U8;
      } else if (bits == 4) {
        shape.back() = 2 * ((shape.back() + 1) / 2);
      } else {
        shape.back() = 4 * ((shape.back() + 3) / 4);
      }
    }
    bits = format::dtype_bits(dt);
    auto numel = *checked_numel(shape);
    std::string full = test::random_bytes(rng, *format::byte_size(dt, numel));
    cs.truth.emplace_back(name, full);
    cs.dtypes[name] = dt;
    std::vector<std::vector<uint64_t>> grid;
    for (auto d : shape) grid.push_back(cuts(rng, d, 4));
    // Enumerate grid cells; each chunk goes to its own rank (as in DCP), in shuffled order.
    auto enumerate = [&] {
      std::vector<std::pair<std::vector<uint64_t>, std::vector<uint64_t>>> cells;
      std::vector<size_t> idx(rank, 0);
      bool done = numel == 0;
      if (numel == 0) cells.emplace_back(std::vector<uint64_t>(rank, 0), shape);
      while (!done) {
        std::vector<uint64_t> off(rank), sz(rank);
        for (size_t d = 0; d < rank; ++d) {
          off[d] = grid[d][idx[d]];
          sz[d] = grid[d][idx[d] + 1] - off[d];
        }
        cells.emplace_back(off, sz);
        size_t d = rank;
        done = true;
        while (d > 0) {
          --d;
          if (++idx[d] + 1 < grid[d].size()) {
            done = false;
            break;
          }
          idx[d] = 0;
        }
      }
      return cells;
    };
    auto cells = enumerate();
    // A sub-byte chunk must itself be a whole number of bytes (safetensors cannot hold it
    // otherwise): when random cuts break that, cut the last dim on whole-byte steps instead.
    // Cuts that keep chunks byte-sized but split runs inside a byte remain: those are the
    // cases the builder must refuse.
    if (bits % 8 != 0 && numel > 0) {
      bool bytesized = true;
      for (const auto& [off, sz] : cells) bytesized &= (*checked_numel(sz) * bits) % 8 == 0;
      if (!bytesized) {
        uint64_t step = bits == 4 ? 2 : 4;
        auto c = cuts(rng, shape.back() / step, 4);
        for (auto& v : c) v *= step;
        grid.back() = c;
        cells = enumerate();
      }
    }
    int world = std::max<int>(min_world, static_cast<int>(cells.size()) + 1);
    std::vector<int> ranks(world);
    std::iota(ranks.begin(), ranks.end(), 0);
    std::shuffle(ranks.begin(), ranks.end(), rng);
    size_t replica = rng() % (4 * cells.size());  // one replica for about 1 tensor in 4
    for (size_t j = 0; j < cells.size(); ++j) {
      const auto& [off, sz] = cells[j];
      auto data = test::slice_chunk(full, shape, dt, off, sz);
      per_rank[ranks[j]].push_back(chunk(name, dt, off, sz, data));
      if (j == replica) per_rank[ranks[cells.size()]].push_back(chunk(name, dt, off, sz, data));
    }
  }
  for (auto& [r, chunks] : per_rank) {
    std::shuffle(chunks.begin(), chunks.end(), rng);
    cs.shards.push_back(ShardSpec{shard(r + 1), std::move(chunks), true});
  }
  return cs;
}

}  // namespace

TEST(ExtentMapProperty, MatchesElementwiseReference) {
  std::mt19937_64 rng(20261122);
  int checked_cases = 0, subbyte_cases = 0, rejected = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    Case cs = random_case(rng, 1 + static_cast<int>(rng() % 5));
    // The only cases allowed to fail are sub-byte grids cut inside a byte.
    auto b = build(cs.shards);
    if (!b.ck->valid()) {
      ASSERT_TRUE(has_problem(*b.ck, "inside a byte")) << "iteration " << iter << ":\n"
                                                       << problems(*b.ck);
      ++rejected;
      continue;
    }
    ++checked_cases;
    const auto& out = b.ck->outputs[0];
    // Reference file bytes: header + full tensors in file order.
    std::string ref = out.header;
    for (uint32_t ti : out.tensors) {
      const auto& t = b.ck->tensors[ti];
      auto it = std::find_if(cs.truth.begin(), cs.truth.end(),
                             [&](auto& p) { return p.first == t.name; });
      ASSERT_NE(it, cs.truth.end());
      ASSERT_EQ(t.out_offset, ref.size());
      ref += it->second;
      if (format::dtype_bits(t.dtype) % 8) ++subbyte_cases;
    }
    ASSERT_EQ(ref.size(), out.size);
    ASSERT_EQ(read_via_map(b, 0, 0, out.size), ref) << "iteration " << iter;
    for (int q = 0; q < 12; ++q) {
      uint64_t off = rng() % (out.size + 4);
      uint64_t len = rng() % (out.size + 4);
      std::string want = off < ref.size() ? ref.substr(off, len) : std::string();
      ASSERT_EQ(read_via_map(b, 0, off, len), want)
          << "iteration " << iter << " range " << off << "+" << len;
    }
  }
  EXPECT_GT(checked_cases, 1500);
  EXPECT_GT(subbyte_cases, 50);
  RecordProperty("cases", checked_cases);
  EXPECT_GT(rejected, 10);
  RecordProperty("rejected", rejected);
}

TEST(ExtentMap, ColumnShardedRangeAllocatesNothingPerRun) {
  // 8 ranks, BF16, 512 columns each (1 KiB runs), 256 rows: a 1 MiB range yields 1024 runs,
  // all within capacity reserved once.
  std::vector<ShardSpec> shards;
  for (int r = 0; r < 8; ++r) {
    shards.push_back({shard(r + 1), {chunk("w", DType::BF16, {0, uint64_t(r) * 512}, {256, 512})}});
  }
  auto b = build(shards);
  ASSERT_TRUE(b.ck->valid()) << problems(*b.ck);
  std::vector<Segment> segs;
  segs.reserve(4096);
  auto* before = segs.data();
  map_range(*b.ck, 0, b.ck->outputs[0].header.size(), 1 << 20, segs);
  EXPECT_EQ(segs.data(), before);
  EXPECT_EQ(segs.size(), 1024u);
  for (const auto& s : segs) EXPECT_EQ(s.len, 1024u);
}

// --- never a silently wrong model (issue 33): why no built-in map serves a trainer's names ---

namespace {
std::vector<Tensor> named(std::initializer_list<const char*> names) {
  std::vector<Tensor> out;
  for (const char* n : names) {
    Tensor t;
    t.name = n;
    out.push_back(std::move(t));
  }
  return out;
}
}  // namespace

TEST(MapReport, ATrainersOwnNamesAreToldApartAndEachMapSaysWhy) {
  // Megatron-Core GPT with learned absolute position embeddings (GPT-2's): megatron-gpt's
  // detect clause refuses it by name, the others find nothing of theirs.
  auto stored =
      named({"embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
             "decoder.layers.self_attention.linear_qkv.weight",
             "decoder.layers.self_attention.linear_proj.weight",
             "decoder.layers.mlp.linear_fc1.weight", "decoder.layers.mlp.linear_fc2.weight",
             "decoder.final_layernorm.weight", "output_layer.weight"});
  auto r =
      explain_unmapped(stored, "Megatron-Core torch_dist (.metadata, *.distcp, metadata.json)");
  EXPECT_FALSE(r.native.empty());
  EXPECT_TRUE(r.native.starts_with("embedding.") || r.native.starts_with("decoder.") ||
              r.native.starts_with("output_layer."))
      << r.native;
  ASSERT_EQ(r.trials.size(), format::builtin_maps().size());
  auto trial = [&](std::string_view map) {
    for (const auto& t : r.trials) {
      if (t.starts_with(std::string(map) + ": ")) return t;
    }
    return std::string();
  };
  EXPECT_NE(trial("megatron-gpt").find("embedding.position_embeddings.weight"), std::string::npos)
      << trial("megatron-gpt");
  EXPECT_NE(trial("torchtitan-llama3").find("no stored name like 'tok_embeddings.weight'"),
            std::string::npos)
      << trial("torchtitan-llama3");
}

TEST(MapReport, HfNamesAreNotATrainersOwn) {
  // An HF checkpoint, lm_head included (which torchtitan's maps read as it is).
  auto stored =
      named({"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
             "model.layers.0.mlp.gate_proj.weight", "model.norm.weight", "lm_head.weight"});
  auto r = explain_unmapped(stored, "torch DCP (.metadata, *.distcp)");
  EXPECT_TRUE(r.native.empty()) << r.native << " " << r.trials.size();
  // torchtitan: its own names, which an HF checkpoint lacks.
  stored = named(
      {"tok_embeddings.weight", "layers.0.attention.wq.weight", "norm.weight", "output.weight"});
  r = explain_unmapped(stored, "torch DCP (.metadata, *.distcp)");
  EXPECT_FALSE(r.native.empty());
}
