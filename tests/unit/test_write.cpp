#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <tuple>

#include <fmt/format.h>

#include "ckptfs/format/dcp.hpp"
#include "ckptfs/format/names.hpp"
#include "ckptfs/format/safetensors.hpp"
#include "ckptfs/layout/extent_map.hpp"
#include "ckptfs/util/checked.hpp"
#include "ckptfs/util/fd.hpp"
#include "ckptfs/write/plan.hpp"
#include "ckptfs/write/router.hpp"
#include "ckptfs/write/sniff.hpp"
#include "fixture.hpp"

using namespace ckptfs;
using namespace ckptfs::write;
using format::DType;

namespace {

struct Spec {
  std::string name;
  DType dtype = DType::F32;
  std::vector<uint64_t> shape;
};

// A consolidated file as save_pretrained writes it: header, then tensors in the given order.
struct Consolidated {
  std::string bytes;
  std::string header_bytes;
  format::Header header;
  std::map<std::string, std::string> data;  // tensor name -> its bytes
};

Consolidated make_consolidated(const std::vector<Spec>& specs, std::mt19937_64& rng) {
  Consolidated c;
  std::vector<format::TensorEntry> entries;
  std::string data;
  for (const auto& s : specs) {
    format::TensorEntry e;
    e.name = s.name;
    e.dtype = s.dtype;
    e.shape = s.shape;
    e.begin = data.size();
    const uint64_t n = *format::byte_size(s.dtype, *checked_numel(s.shape));
    e.end = e.begin + n;
    c.data[s.name] = test::random_bytes(rng, n);
    data += c.data[s.name];
    entries.push_back(e);
  }
  c.header_bytes = format::serialize_header(entries, {{"format", "pt"}});
  c.bytes = c.header_bytes + data;
  auto h = format::parse_file_bytes(c.bytes, "model.safetensors");
  EXPECT_TRUE(h.ok()) << h.error().message;
  c.header = std::move(h).value();
  return c;
}

// Records every byte the router sends, and refuses a byte written twice.
class MemSink : public ShardSink {
 public:
  Status pwrite(uint32_t rank, uint64_t offset, std::string_view bytes) override {
    auto& f = files[rank];
    auto& w = written[rank];
    if (f.size() < offset + bytes.size()) {
      f.resize(offset + bytes.size(), '\0');
      w.resize(offset + bytes.size(), false);
    }
    for (size_t i = 0; i < bytes.size(); ++i) {
      if (w[offset + i]) return make_error(EIO, "rank {}: byte {} written twice", rank, offset + i);
      w[offset + i] = true;
      f[offset + i] = bytes[i];
    }
    ++calls;
    return {};
  }
  std::map<uint32_t, std::string> files;
  std::map<uint32_t, std::vector<bool>> written;
  size_t calls = 0;
};

class FailingSink : public ShardSink {
 public:
  Status pwrite(uint32_t, uint64_t, std::string_view) override {
    return make_error(EAGAIN, "disk says try again");
  }
};

std::string shard_name(uint32_t rank) { return format::shard_file_name(rank + 1, 1, 1); }

struct Routed {
  Plan plan;
  layout::ShardSet shards;
  MemSink sink;
};

// Plans, routes `c` in the given piece sizes, and checks the router reports completion.
std::unique_ptr<Routed> route(const Consolidated& c, const PlanOptions& opts,
                              const std::vector<size_t>& pieces = {}) {
  auto r = std::make_unique<Routed>();
  auto p = plan(c.header, opts, "model.safetensors");
  EXPECT_TRUE(p.ok()) << p.error().message;
  r->plan = std::move(p).value();
  auto s = shard_headers(c.header, r->plan, "model.safetensors");
  EXPECT_TRUE(s.ok()) << s.error().message;
  r->shards = std::move(s).value();
  auto router =
      StreamRouter::create(c.header_bytes, std::make_shared<const format::Header>(c.header),
                           r->plan, r->shards, r->sink, "model.safetensors");
  EXPECT_TRUE(router.ok()) << router.error().message;
  uint64_t off = 0;
  size_t i = 0;
  while (off < c.bytes.size()) {
    size_t n = pieces.empty() ? c.bytes.size() : pieces[i++ % pieces.size()];
    n = std::min<size_t>(n, c.bytes.size() - off);
    auto st = router->write(off, std::string_view(c.bytes).substr(off, n));
    EXPECT_TRUE(st.ok()) << st.error().message;
    if (!st) break;
    off += n;
  }
  EXPECT_TRUE(router->complete());
  return r;
}

// Checks the routed shards: every byte written once, they parse and build into a valid
// checkpoint, every chunk equals the element-by-element slice of the original, and the read
// path gives back every original tensor byte-exact.
void check_shards(const Consolidated& c, const Routed& r) {
  layout::BuildInput in;
  in.dir = "ckpt";
  for (uint32_t rank = 0; rank < r.plan.ranks; ++rank) {
    ASSERT_TRUE(r.sink.files.count(rank)) << "rank " << rank << " got nothing";
    const auto& bytes = r.sink.files.at(rank);
    ASSERT_EQ(bytes.size(), r.shards.shards[rank].file_size()) << "rank " << rank;
    const auto& w = r.sink.written.at(rank);
    ASSERT_TRUE(std::all_of(w.begin(), w.end(), [](bool b) { return b; })) << "rank " << rank;
    in.shards.push_back(test::shard_input(shard_name(rank), bytes));
    ASSERT_TRUE(in.shards.back().error.empty()) << in.shards.back().error;
  }
  for (size_t i = 0; i < c.header.tensors.size(); ++i) {
    const auto& t = c.header.tensors[i];
    for (size_t k = 0; k < r.plan.tensors[i].chunks.size(); ++k) {
      const auto& ch = r.plan.tensors[i].chunks[k];
      auto want = test::slice_chunk(c.data.at(t.name), t.shape, t.dtype, ch.offsets, ch.sizes);
      ASSERT_EQ(r.sink.files.at(ch.rank).substr(r.shards.chunk_offset[i][k], want.size()), want)
          << t.name << " chunk " << k;
    }
  }
  auto ck = layout::build_checkpoint(std::move(in));
  std::string problems;
  for (const auto& p : ck->problems) problems += p.to_string() + "\n";
  ASSERT_TRUE(ck->valid()) << problems;
  ASSERT_EQ(ck->tensors.size(), c.header.tensors.size());
  std::vector<layout::Segment> segs;
  for (const auto& t : ck->tensors) {
    layout::map_range(*ck, t.output, t.out_offset, t.nbytes, segs);
    std::string got;
    for (const auto& s : segs) {
      got += s.is_memory() ? ck->outputs[t.output].header.substr(s.src, s.len)
                           : r.sink.files
                                 .at(static_cast<uint32_t>(
                                     format::parse_shard_name(ck->shards[s.shard].name)->shard - 1))
                                 .substr(s.src, s.len);
    }
    ASSERT_EQ(got, c.data.at(t.name)) << t.name;
    const auto* orig = c.header.find(t.name);
    ASSERT_EQ(t.shape, orig->shape) << t.name;
    ASSERT_EQ(t.dtype, orig->dtype) << t.name;
  }
}

PlanOptions opts(uint32_t ranks, uint64_t min_split = 0) {
  PlanOptions o;
  o.ranks = ranks;
  o.min_split_bytes = min_split;
  return o;
}

std::vector<std::pair<std::vector<uint64_t>, std::vector<uint64_t>>> chunks_of(
    const TensorPlan& tp) {
  std::vector<std::pair<std::vector<uint64_t>, std::vector<uint64_t>>> out;
  for (const auto& c : tp.chunks) out.emplace_back(c.offsets, c.sizes);
  return out;
}

std::vector<uint32_t> ranks_of(const TensorPlan& tp) {
  std::vector<uint32_t> out;
  for (const auto& c : tp.chunks) out.push_back(c.rank);
  return out;
}

// ---- sniff ----

TEST(Sniff, ConsolidatedKnownAndUnknownSize) {
  std::mt19937_64 rng(1);
  auto c = make_consolidated({{"a", DType::F32, {4, 4}}, {"b", DType::BF16, {3}}}, rng);
  for (uint64_t size : {uint64_t{0}, uint64_t{c.bytes.size()}}) {
    auto s = sniff(c.bytes, size, "f");
    EXPECT_EQ(s.kind, Kind::Consolidated) << s.why;
    ASSERT_TRUE(s.header);
    EXPECT_EQ(s.header->tensors.size(), 2u);
    EXPECT_EQ(s.header_len + 8, c.header_bytes.size());
    // The first WRITE is exactly the header: enough to decide.
    auto h = sniff(c.header_bytes, size, "f");
    EXPECT_EQ(h.kind, Kind::Consolidated) << h.why;
    EXPECT_EQ(h.header->data_size, c.header.data_size);
  }
}

TEST(Sniff, TruncatedPrefixesNeedMore) {
  std::mt19937_64 rng(2);
  auto c = make_consolidated({{"a", DType::F32, {4, 4}}}, rng);
  for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{8}, size_t{9}, size_t{20},
                   c.header_bytes.size() - 1}) {
    auto s = sniff(std::string_view(c.bytes).substr(0, n), 0, "f");
    EXPECT_EQ(s.kind, Kind::NeedMore) << n << ": " << s.why;
    EXPECT_FALSE(s.header);
  }
  EXPECT_EQ(sniff(std::string_view(c.bytes).substr(0, 8), 0, "f").header_len + 8,
            c.header_bytes.size());
}

TEST(Sniff, GarbageIsOther) {
  auto le = [](uint64_t n) {
    std::string s(8, '\0');
    for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((n >> (8 * i)) & 0xff);
    return s;
  };
  EXPECT_EQ(sniff("hello world, this is not a checkpoint", 0, "f").kind, Kind::Other);
  EXPECT_EQ(sniff(le(1) + "{", 0, "f").kind, Kind::Other);      // N too small
  EXPECT_EQ(sniff(le(100'000'001), 0, "f").kind, Kind::Other);  // N too big
  EXPECT_EQ(sniff(le(10) + "[", 0, "f").kind, Kind::Other);     // not an object
  EXPECT_EQ(sniff(le(10), 12, "f").kind, Kind::Other);          // past the size
  EXPECT_EQ(sniff("abc", 5, "f").kind, Kind::Other);            // too short
  EXPECT_EQ(sniff(le(4) + "{} x", 0, "f").kind, Kind::Other);   // bad JSON
  std::string bad_dtype = R"({"a":{"dtype":"Q7","shape":[1],"data_offsets":[0,1]}})";
  auto s = sniff(le(bad_dtype.size()) + bad_dtype + "x", 0, "f.tmp");
  EXPECT_EQ(s.kind, Kind::Other);
  EXPECT_NE(s.why.find("f.tmp"), std::string::npos) << s.why;
  EXPECT_NE(s.why.find("'a'"), std::string::npos) << s.why;
  // Offsets with a hole: looks like safetensors, is not.
  std::string hole = R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                     R"("b":{"dtype":"U8","shape":[1],"data_offsets":[2,3]}})";
  EXPECT_EQ(sniff(le(hole.size()) + hole, 0, "f").kind, Kind::Other);
  // A known size that disagrees with the header.
  std::string one = R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})";
  EXPECT_EQ(sniff(le(one.size()) + one, 8 + one.size() + 1, "f").kind, Kind::Consolidated);
  EXPECT_EQ(sniff(le(one.size()) + one, 8 + one.size() + 2, "f").kind, Kind::Other);
  // Deep nesting is refused without recursing through it (size unknown: the lenient pass).
  std::string deep = R"({"a":)" + std::string(200000, '[') + std::string(200000, ']') + "}";
  auto d = sniff(le(deep.size()) + deep, 0, "f");
  EXPECT_EQ(d.kind, Kind::Other);
  EXPECT_NE(d.why.find("nested"), std::string::npos) << d.why;
  // The smallest header: no tensors at all.
  auto empty = sniff(le(2) + "{}", 10, "f");
  EXPECT_EQ(empty.kind, Kind::Consolidated) << empty.why;
  EXPECT_TRUE(empty.header->tensors.empty());
}

TEST(Sniff, RankShard) {
  test::ShardSpec spec{shard_name(0),
                       {{"w", DType::F32, {2, 0}, {2, 4}, std::vector<uint64_t>{4, 4}, {}}}};
  auto bytes = test::make_shard_bytes(spec);
  EXPECT_EQ(sniff(bytes, bytes.size(), "f").kind, Kind::RankShard);
  EXPECT_EQ(sniff(bytes, 0, "f").kind, Kind::RankShard);
}

// ---- plan ----

TEST(Plan, UnevenDim0) {
  std::mt19937_64 rng(3);
  auto c = make_consolidated({{"w", DType::F32, {10, 4}}}, rng);
  auto p = plan(c.header, opts(4), "f");
  ASSERT_TRUE(p.ok()) << p.error().message;
  const auto& tp = p->tensors[0];
  EXPECT_EQ(tp.split_dim, 0u);
  EXPECT_EQ(ranks_of(tp), (std::vector<uint32_t>{0, 1, 2, 3}));
  using V = std::vector<uint64_t>;
  EXPECT_EQ(chunks_of(tp),
            (std::vector<std::pair<V, V>>{
                {{0, 0}, {3, 4}}, {{3, 0}, {3, 4}}, {{6, 0}, {2, 4}}, {{8, 0}, {2, 4}}}));
  EXPECT_EQ(p->rank_bytes, (std::vector<uint64_t>{48, 48, 32, 32}));
}

TEST(Plan, Dim0BelowRanksUsesOnlyThatMany) {
  std::mt19937_64 rng(4);
  auto c = make_consolidated({{"w", DType::BF16, {3, 5}}}, rng);
  auto p = plan(c.header, opts(8), "f");
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(ranks_of(p->tensors[0]), (std::vector<uint32_t>{0, 1, 2}));
  for (const auto& ch : p->tensors[0].chunks) EXPECT_EQ(ch.sizes, (std::vector<uint64_t>{1, 5}));
  auto r = route(c, opts(8));
  check_shards(c, *r);  // ranks 3..7 get empty (but valid) shards
}

TEST(Plan, WholeTensorsBalanceBytes) {
  std::mt19937_64 rng(5);
  auto c = make_consolidated({{"split", DType::U8, {3, 1000}},
                              {"vec", DType::U8, {500}},
                              {"scalar", DType::F32, {}},
                              {"empty", DType::F32, {0, 4}},
                              {"small", DType::U8, {10, 10}}},
                             rng);
  auto p = plan(c.header, opts(3, 1024), "f");
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->tensors[0].split_dim, 0u);
  for (size_t i = 1; i < 5; ++i) {
    EXPECT_EQ(p->tensors[i].split_dim, TensorPlan::kWhole) << i;
    ASSERT_EQ(p->tensors[i].chunks.size(), 1u);
  }
  // After the split (1000 each): vec -> 0 (tie, lowest), scalar -> 1, empty -> 2,
  // small -> 2 (still the lightest).
  EXPECT_EQ(ranks_of(p->tensors[1]), std::vector<uint32_t>{0});
  EXPECT_EQ(ranks_of(p->tensors[2]), std::vector<uint32_t>{1});
  EXPECT_EQ(ranks_of(p->tensors[3]), std::vector<uint32_t>{2});
  EXPECT_EQ(ranks_of(p->tensors[4]), std::vector<uint32_t>{2});
  EXPECT_EQ(p->rank_bytes, (std::vector<uint64_t>{1500, 1004, 1100}));
  auto r = route(c, opts(3, 1024), {7, 1, 300, 4096});
  check_shards(c, *r);
}

TEST(Plan, DefaultMinSplitKeepsSmallTensorsWhole) {
  std::mt19937_64 rng(6);
  auto c = make_consolidated({{"a", DType::F32, {64, 64}}, {"b", DType::F32, {128, 128}}}, rng);
  PlanOptions o;
  o.ranks = 2;
  auto p = plan(c.header, o, "f");
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->tensors[0].split_dim, TensorPlan::kWhole);  // 16 KiB < 64 KiB
  EXPECT_EQ(p->tensors[1].split_dim, 0u);                  // 64 KiB
  EXPECT_FALSE(plan(c.header, opts(0), "f").ok());
}

TEST(Plan, TpColwiseRowwise) {
  std::mt19937_64 rng(7);
  auto c = make_consolidated({{"model.layers.0.self_attn.q_proj.weight", DType::F32, {8, 6}},
                              {"model.layers.0.self_attn.o_proj.weight", DType::F32, {8, 6}},
                              {"model.layers.0.self_attn.o_proj.bias", DType::F32, {8}},
                              {"model.layers.x.self_attn.o_proj.weight", DType::F32, {8, 6}},
                              {"model.layers.12.mlp.down_proj.weight", DType::F32, {4, 6}},
                              {"model.embed_tokens.weight", DType::F32, {6, 8}}},
                             rng);
  PlanOptions o = opts(4);
  o.split = PlanOptions::TpPlan;
  o.tp_plan = {{"model.layers.*.self_attn.q_proj", "colwise"},
               {"model.layers.*.self_attn.o_proj", "rowwise"},
               {"layers.*.mlp.down_proj", "rowwise"}};
  auto p = plan(c.header, o, "f");
  ASSERT_TRUE(p.ok());
  auto by = [&](std::string_view n) -> const TensorPlan& {
    return *std::find_if(p->tensors.begin(), p->tensors.end(),
                         [&](const TensorPlan& t) { return t.name == n; });
  };
  using V = std::vector<uint64_t>;
  EXPECT_EQ(by("model.layers.0.self_attn.q_proj.weight").split_dim, 0u);
  const auto& o_proj = by("model.layers.0.self_attn.o_proj.weight");
  EXPECT_EQ(o_proj.split_dim, 1u);
  EXPECT_EQ(chunks_of(o_proj),
            (std::vector<std::pair<V, V>>{
                {{0, 0}, {8, 2}}, {{0, 2}, {8, 2}}, {{0, 4}, {8, 1}}, {{0, 5}, {8, 1}}}));
  EXPECT_EQ(by("model.layers.0.self_attn.o_proj.bias").split_dim, TensorPlan::kWhole);
  EXPECT_EQ(by("model.layers.x.self_attn.o_proj.weight").split_dim, 0u);  // '*' is a number
  EXPECT_EQ(by("model.layers.12.mlp.down_proj.weight").split_dim, 1u);    // matches mid-name
  EXPECT_EQ(by("model.embed_tokens.weight").split_dim, 0u);               // unmatched
  auto r = route(c, o, {5, 13, 64});
  check_shards(c, *r);
}

TEST(Plan, SubByteSplitsOnlyOnByteBoundaries) {
  std::mt19937_64 rng(8);
  auto c = make_consolidated({{"rows_ok", DType::F4, {4, 3}},    // 2 rows x 12 bits = 3 bytes
                              {"rows_bad", DType::F4, {2, 3}},   // 1 row = 12 bits
                              {"cols_ok", DType::F4, {2, 4}},    // 2 cols = 1 byte
                              {"cols_bad", DType::F4, {2, 3}}},  // 1 col = 4 bits
                             rng);
  PlanOptions o = opts(2);
  o.split = PlanOptions::TpPlan;
  o.tp_plan = {{"cols_ok", "rowwise"}, {"cols_bad", "rowwise"}};
  auto p = plan(c.header, o, "f");
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->tensors[0].split_dim, 0u);
  EXPECT_EQ(p->tensors[1].split_dim, TensorPlan::kWhole);
  EXPECT_EQ(p->tensors[2].split_dim, 1u);
  EXPECT_EQ(p->tensors[3].split_dim, TensorPlan::kWhole);
  auto r = route(c, o, {1});
  check_shards(c, *r);
}

// ---- shard headers ----

TEST(ShardHeaders, MetadataAndEmptyRank) {
  std::mt19937_64 rng(9);
  auto c = make_consolidated({{"w", DType::F32, {2, 3}}, {"b", DType::F32, {3}}}, rng);
  auto p = plan(c.header, opts(4), "f");
  ASSERT_TRUE(p.ok());
  auto s = shard_headers(c.header, *p, "f");
  ASSERT_TRUE(s.ok()) << s.error().message;
  ASSERT_EQ(s->shards.size(), 4u);
  for (const auto& sh : s->shards) {
    EXPECT_EQ(sh.header.size() % 8, 0u);
    auto h = format::parse_header_json(std::string_view(sh.header).substr(8), sh.file_size(), "s");
    ASSERT_TRUE(h.ok()) << h.error().message;
    EXPECT_EQ(*h->find_metadata("format"), "pt");
    EXPECT_EQ(*h->find_metadata("DCP_VERSION"), "1.0");
    auto info = format::parse_sharding_info(*h->find_metadata("DCP_SHARDING_INFO"), "s");
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info->size(), h->tensors.size());
    for (const auto& [fqn, e] : *info) {
      ASSERT_TRUE(e.full_shape);
      EXPECT_EQ(*e.full_shape, c.header.find(fqn)->shape);
    }
  }
  // w splits over ranks 0 and 1; b goes to rank 2; rank 3 holds nothing.
  EXPECT_EQ(s->shards[3].data_size, 0u);
  auto r = route(c, opts(4));
  check_shards(c, *r);
}

// The parse each shard comes with is the parse of its bytes: the store checks build the
// directory's checkpoint from it without parsing (write/store_checks.cpp).
TEST(ShardHeaders, ParsedIsTheParseOfTheBytes) {
  std::mt19937_64 rng(19);
  auto c = make_consolidated({{"model.layers.0.w\u00e9", DType::BF16, {6, 5}},
                              {"empty_a", DType::F32, {0, 4}},
                              {"empty_b", DType::F32, {0}},
                              {"scalar", DType::F64, {}},
                              {"big", DType::F32, {130, 3}},
                              {"bits", DType::U8, {7}}},
                             rng);
  const auto canon = [](std::vector<format::TensorEntry> t) {
    std::sort(t.begin(), t.end(), [](const auto& a, const auto& b) {
      return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
    });
    return t;
  };
  for (uint32_t ranks : {1u, 3u, 5u}) {
    PlanOptions o = opts(ranks);
    o.min_split_bytes = 1;
    auto p = plan(c.header, o, "f");
    ASSERT_TRUE(p.ok()) << p.error().message;
    auto s = shard_headers(c.header, *p, "f");
    ASSERT_TRUE(s.ok()) << s.error().message;
    for (const auto& sh : s->shards) {
      SCOPED_TRACE(fmt::format("{} ranks, rank {}", ranks, sh.rank));
      ASSERT_NE(sh.parsed, nullptr);
      auto h =
          format::parse_header_json(std::string_view(sh.header).substr(8), sh.file_size(), "s");
      ASSERT_TRUE(h.ok()) << h.error().message;
      EXPECT_EQ(sh.parsed->json_len, h->json_len);
      EXPECT_EQ(sh.parsed->data_size, h->data_size);
      EXPECT_EQ(sh.parsed->metadata, h->metadata);
      const auto a = canon(sh.parsed->tensors), b = canon(h->tensors);
      ASSERT_EQ(a.size(), b.size());
      for (size_t i = 0; i < a.size(); ++i) {
        EXPECT_EQ(a[i].name, b[i].name);
        EXPECT_EQ(a[i].dtype, b[i].dtype);
        EXPECT_EQ(a[i].shape, b[i].shape);
        EXPECT_EQ(a[i].begin, b[i].begin);
        EXPECT_EQ(a[i].end, b[i].end);
      }
    }
  }
}

// ---- router ----

TEST(Router, RejectsOutOfOrderWrites) {
  std::mt19937_64 rng(10);
  auto c = make_consolidated({{"w", DType::F32, {8, 8}}}, rng);
  auto p = plan(c.header, opts(2), "model.tmp");
  auto s = shard_headers(c.header, *p, "model.tmp");
  const std::string_view b = c.bytes;
  const uint64_t hs = c.header_bytes.size();
  auto make = [&](MemSink& sink) {
    return std::move(StreamRouter::create(c.header_bytes,
                                          std::make_shared<const format::Header>(c.header), *p, *s,
                                          sink, "model.tmp")
                         .value());
  };
  {
    MemSink sink;
    auto r = make(sink);
    ASSERT_TRUE(r.write(0, b.substr(0, hs + 10)).ok());
    ASSERT_TRUE(r.write(hs + 10, {}).ok());  // an empty write is a no-op
    auto st = r.write(hs, b.substr(hs, 4));  // backwards / rewrite
    ASSERT_FALSE(st.ok());
    EXPECT_TRUE(needs_staging(st.error()));
    EXPECT_NE(st.error().message.find("model.tmp"), std::string::npos);
    EXPECT_TRUE(needs_staging(r.write(hs + 10, b.substr(hs + 10, 4)).error()));  // stays failed
  }
  {
    MemSink sink;
    auto r = make(sink);
    ASSERT_TRUE(r.write(0, b.substr(0, hs)).ok());
    auto st = r.write(hs + 4, b.substr(hs + 4, 4));  // hole
    ASSERT_FALSE(st.ok());
    EXPECT_TRUE(needs_staging(st.error()));
    EXPECT_NE(st.error().message.find("hole"), std::string::npos);
  }
  {
    MemSink sink;
    auto r = make(sink);
    std::string changed(b.substr(0, hs));
    changed[hs - 3] = 'X';
    auto st = r.write(0, changed);
    ASSERT_FALSE(st.ok());
    EXPECT_TRUE(needs_staging(st.error()));
    EXPECT_TRUE(sink.files.empty());  // nothing routed from a header that does not match
  }
  {
    MemSink sink;
    auto r = make(sink);
    ASSERT_TRUE(r.write(0, b).ok());
    EXPECT_TRUE(r.complete());
    auto st = r.write(b.size(), "x");  // past the end the header describes
    ASSERT_FALSE(st.ok());
    EXPECT_TRUE(needs_staging(st.error()));
  }
  {
    FailingSink sink;
    auto r = StreamRouter::create(c.header_bytes, std::make_shared<const format::Header>(c.header),
                                  *p, *s, sink, "model.tmp");
    ASSERT_TRUE(r.ok());
    auto st = r->write(0, b);
    ASSERT_FALSE(st.ok());
    EXPECT_EQ(st.error().code, EIO);  // the sink's EAGAIN must not read as "stage it"
  }
  // A header that does not belong to the plan is refused at construction.
  MemSink sink;
  EXPECT_FALSE(StreamRouter::create(c.header_bytes.substr(1),
                                    std::make_shared<const format::Header>(c.header), *p, *s, sink,
                                    "m")
                   .ok());
}

// A sink whose shards are files: it copies data in the kernel (copy_range), into one scratch file
// per rank, and records what landed there as MemSink does (a byte copied twice fails too).
class CopyingSink : public MemSink {
 public:
  explicit CopyingSink(const std::string& dir) : dir_(dir) {}
  Result<bool> copy_in(uint32_t rank, uint64_t offset, int src_fd, uint64_t src_off,
                       uint64_t n) override {
    auto& fd = fds_[rank];
    if (fd.get() < 0) {
      fd = std::move(open_at(AT_FDCWD, fmt::format("{}/rank{}", dir_, rank),
                             O_RDWR | O_CREAT | O_TRUNC, 0600))
               .value();
    }
    CKPTFS_TRY(bool copied, copy_range(src_fd, src_off, fd.get(), offset, n, "scratch"));
    if (!copied) return false;
    std::string got(n, '\0');
    CKPTFS_CHECK(pread_exact(fd.get(), got.data(), n, offset, "scratch"));
    CKPTFS_CHECK(pwrite(rank, offset, got));
    ++copies;
    return true;
  }
  size_t copies = 0;

 private:
  std::string dir_;
  std::map<uint32_t, UniqueFd> fds_;
};

TEST(Router, RouteFileCopiesTheDataInTheKernelWhereTheSinkCan) {
  std::mt19937_64 rng(12);
  auto c = make_consolidated(
      {{"a", DType::F32, {64, 48}}, {"b", DType::BF16, {7, 300}}, {"c", DType::F32, {5}}}, rng);
  test::TempDir dir;
  const std::string path = dir.path() + "/model.safetensors";
  test::write_file(path, c.bytes);
  auto fd = std::move(open_at(AT_FDCWD, path, O_RDONLY)).value();
  for (const bool kernel : {false, true}) {
    SCOPED_TRACE(kernel ? "in the kernel" : "through user space");
    Routed r;
    r.plan = *plan(c.header, opts(3, 1), "model.safetensors");
    r.shards = *shard_headers(c.header, r.plan, "model.safetensors");
    CopyingSink copying(dir.path());
    MemSink& sink = kernel ? copying : r.sink;
    auto router =
        StreamRouter::create(c.header_bytes, std::make_shared<const format::Header>(c.header),
                             r.plan, r.shards, sink, "model.safetensors");
    ASSERT_TRUE(router.ok()) << router.error().message;
    auto st = route_file(fd.get(), c.bytes.size(), *router, "model.safetensors");
    ASSERT_TRUE(st.ok()) << st.error().message;
    EXPECT_TRUE(router->complete());
    if (kernel) {
      EXPECT_GT(copying.copies, 0u);
      EXPECT_EQ(copying.calls, copying.copies + 3);  // only the three shard headers by pwrite
      r.sink.files = copying.files;
      r.sink.written = copying.written;
    }
    check_shards(c, r);
  }
  // A file shorter than its header says: an error naming it, never shards with zeros.
  const std::string cut = dir.path() + "/cut.safetensors";
  test::write_file(cut, c.bytes.substr(0, c.bytes.size() - 100));
  auto cfd = std::move(open_at(AT_FDCWD, cut, O_RDONLY)).value();
  auto p = plan(c.header, opts(3, 1), "cut");
  auto s = shard_headers(c.header, *p, "cut");
  CopyingSink copying(dir.path());
  auto router = StreamRouter::create(
      c.header_bytes, std::make_shared<const format::Header>(c.header), *p, *s, copying, "cut");
  ASSERT_TRUE(router.ok());
  ASSERT_TRUE(router->write(0, c.header_bytes).ok());
  auto st = router->copy_rest(cfd.get());
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.error().code, EIO);
  EXPECT_NE(st.error().message.find("cut"), std::string::npos) << st.error().message;
  EXPECT_FALSE(router->complete());
}

TEST(Router, ZeroLengthWriteAndNoTensors) {
  std::mt19937_64 rng(11);
  auto c = make_consolidated({}, rng);
  auto r = route(c, opts(3));
  EXPECT_EQ(r->sink.files.size(), 3u);
}

// ---- property: random headers, plans and write sizes ----

TEST(RouterProperty, RandomHeadersRoundTrip) {
  std::mt19937_64 rng(20260);
  const DType dtypes[] = {DType::BF16, DType::F32, DType::I8, DType::BOOL, DType::F4, DType::F64};
  // What the random cases covered, so a generator change cannot quietly stop testing a path.
  size_t whole = 0, dim0 = 0, dim1 = 0, sub_byte_split = 0, empty_ranks = 0;
  for (int iter = 0; iter < 300; ++iter) {
    SCOPED_TRACE(fmt::format("iteration {}", iter));
    const size_t n = 1 + rng() % 7;
    std::vector<Spec> specs;
    for (size_t i = 0; i < n; ++i) {
      Spec s;
      s.name = fmt::format("model.layers.{}.{}.weight", i, rng() % 2 ? "col" : "row");
      s.dtype = dtypes[rng() % std::size(dtypes)];
      const size_t rank = rng() % 5;
      for (size_t d = 0; d < rank; ++d) s.shape.push_back(rng() % 10 == 0 ? 0 : 1 + rng() % 12);
      if (s.dtype == DType::F4 && *checked_numel(s.shape) % 2 != 0) s.dtype = DType::U8;
      specs.push_back(std::move(s));
    }
    std::shuffle(specs.begin(), specs.end(), rng);  // file order need not be name order
    auto c = make_consolidated(specs, rng);
    PlanOptions o;
    o.ranks = 1 + rng() % 8;
    o.min_split_bytes = std::array<uint64_t, 3>{0, 32, 4096}[rng() % 3];
    if (rng() % 2) {
      o.split = PlanOptions::TpPlan;
      o.tp_plan = {{"layers.*.col", "colwise"}, {"model.layers.*.row", "rowwise"}};
    }
    std::vector<size_t> pieces;
    for (int k = 0; k < 16; ++k) {
      const unsigned lg = rng() % 21;  // 1 byte .. 1 MiB, log-uniform
      pieces.push_back(
          std::max<size_t>(1, (size_t{1} << lg) - rng() % ((size_t{1} << lg) / 2 + 1)));
    }
    auto r = route(c, o, pieces);
    ASSERT_NO_FATAL_FAILURE(check_shards(c, *r));
    for (size_t i = 0; i < r->plan.tensors.size(); ++i) {
      const auto& tp = r->plan.tensors[i];
      whole += tp.split_dim == TensorPlan::kWhole;
      dim0 += tp.split_dim == 0;
      dim1 += tp.split_dim == 1;
      sub_byte_split +=
          tp.split_dim != TensorPlan::kWhole && c.header.tensors[i].dtype == DType::F4;
    }
    for (const auto& sh : r->shards.shards) empty_ranks += sh.data_size == 0;
  }
  EXPECT_GT(whole, 100u);
  EXPECT_GT(dim0, 100u);
  EXPECT_GT(dim1, 30u);
  EXPECT_GT(sub_byte_split, 10u);
  EXPECT_GT(empty_ranks, 10u);
  fmt::print("whole {} dim0 {} dim1 {} sub-byte splits {} empty ranks {}\n", whole, dim0, dim1,
             sub_byte_split, empty_ranks);
}

}  // namespace
