// dtype casts: the element conversions (expected bits computed by hand from IEEE 754 and
// checked against torch 2.15 on CPU), NeMo's dtype mapping parser, the cast extent map and
// its execution by io::gather at every offset; io::transpose, which gather uses for a
// transposed tensor's columns.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <bit>
#include <cstring>
#include <random>

#include "ckptfs/format/cast.hpp"
#include "ckptfs/format/index.hpp"
#include "ckptfs/format/names.hpp"
#include "ckptfs/io/gather.hpp"
#include "ckptfs/io/transpose.hpp"
#include "ckptfs/layout/extent_map.hpp"
#include "ckptfs/util/fd.hpp"
#include "fixture.hpp"

using namespace ckptfs;
using format::DType;

namespace {

struct Bits32 {
  uint32_t in;
  uint16_t out;
};

TEST(Cast, F32ToBf16RoundsToNearestEven) {
  const Bits32 cases[] = {
      {0x3f800000, 0x3f80},  // 1.0
      {0x3f808000, 0x3f80},  // tie, even below: down
      {0x3f818000, 0x3f82},  // tie, odd below: up
      {0x3f808001, 0x3f81},  // just above a tie
      {0x3f807fff, 0x3f80},  // just below a tie
      {0x80000000, 0x8000},  // -0
      {0x00000000, 0x0000},  // +0
      {0x00000001, 0x0000},  // smallest f32 subnormal rounds to +0
      {0x00008000, 0x0000},  // subnormal tie, even below
      {0x00018000, 0x0002},  // subnormal tie, odd below
      {0x007fffff, 0x0080},  // largest f32 subnormal rounds up to the smallest normal
      {0x7f7fffff, 0x7f80},  // max finite f32 overflows to +Inf
      {0x7f7f7fff, 0x7f7f},  // max finite bf16
      {0xff7fffff, 0xff80},  // -max -> -Inf
      {0x7f800000, 0x7f80},  // +Inf
      {0xff800000, 0xff80},  // -Inf
      {0x7fc00000, 0xffff},  // NaNs: torch's vector kernels give 0xFFFF for every NaN
      {0xffc00000, 0xffff}, {0x7f800001, 0xffff}, {0xffa5a5a5, 0xffff},
  };
  for (const auto& c : cases) {
    EXPECT_EQ(format::f32_to_bf16(c.in), c.out) << std::hex << c.in;
  }
}

TEST(Cast, F32ToF16RoundsToNearestEvenWithSubnormalsAndOverflow) {
  const Bits32 cases[] = {
      {0x3f800000, 0x3c00},  // 1.0
      {0xbf800000, 0xbc00},  // -1.0
      {0x3f801000, 0x3c00},  // 1 + 2^-11: tie, even below
      {0x3f803000, 0x3c02},  // 1 + 3*2^-11: tie, odd below
      {0x3f801001, 0x3c01},  // just above a tie
      {0x477fe000, 0x7bff},  // 65504, max finite
      {0x477fefff, 0x7bff},  // just below the overflow threshold
      {0x477ff000, 0x7c00},  // 65520 rounds to +Inf
      {0x501502f9, 0x7c00},  // 1e10
      {0xc77ff000, 0xfc00},  // -65520
      {0x38800000, 0x0400},  // 2^-14, smallest normal
      {0x387fc000, 0x03ff},  // 1023 * 2^-24, largest subnormal
      {0x33800000, 0x0001},  // 2^-24, smallest subnormal
      {0x33000000, 0x0000},  // 2^-25: tie between 0 and 2^-24, even: 0
      {0x33000001, 0x0001},  // just above
      {0x33c00000, 0x0002},  // 1.5 * 2^-24: tie between 1 and 2 ulps, even: 2
      {0xb3800000, 0x8001},  // -2^-24
      {0x00000001, 0x0000},  // f32 subnormal
      {0x80000000, 0x8000},  // -0
      {0x7f800000, 0x7c00},  // +Inf
      {0xff800000, 0xfc00},  // -Inf
      {0x7fc00000, 0x7e00},  // NaN: sign kept, quiet, top 10 payload bits kept
      {0xffc00000, 0xfe00}, {0x7f800001, 0x7e00},  // signalling, payload below the kept bits
      {0x7fa5a5a5, 0x7f2d}, {0xffa5a5a5, 0xff2d}, {0x7fffffff, 0x7fff},
  };
  for (const auto& c : cases) {
    EXPECT_EQ(format::f32_to_f16(c.in), c.out) << std::hex << c.in;
  }
}

TEST(Cast, HalfWidthToF32IsExact) {
  EXPECT_EQ(format::f16_to_f32(0x3c00), 0x3f800000u);
  EXPECT_EQ(format::f16_to_f32(0x0001), 0x33800000u);  // 2^-24
  EXPECT_EQ(format::f16_to_f32(0x03ff), 0x387fc000u);
  EXPECT_EQ(format::f16_to_f32(0x8001), 0xb3800000u);
  EXPECT_EQ(format::f16_to_f32(0x0400), 0x38800000u);
  EXPECT_EQ(format::f16_to_f32(0x7bff), 0x477fe000u);
  EXPECT_EQ(format::f16_to_f32(0x8000), 0x80000000u);
  EXPECT_EQ(format::f16_to_f32(0x0000), 0x00000000u);
  EXPECT_EQ(format::f16_to_f32(0x7c00), 0x7f800000u);
  EXPECT_EQ(format::f16_to_f32(0xfc00), 0xff800000u);
  EXPECT_EQ(format::f16_to_f32(0x7c01), 0x7fc02000u);  // quieted, payload kept
  EXPECT_EQ(format::f16_to_f32(0xfd55), 0xffeaa000u);
  EXPECT_EQ(format::bf16_to_f32(0x3f80), 0x3f800000u);
  EXPECT_EQ(format::bf16_to_f32(0x7f81), 0x7f810000u);  // a signalling NaN stays one
  EXPECT_EQ(format::bf16_to_f32(0x0001), 0x00010000u);
  // Every F16 and BF16 survives the round trip through F32 (NaN: as quieted).
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const auto x = static_cast<uint16_t>(h);
    const bool nan = (h & 0x7fff) > 0x7c00;
    EXPECT_EQ(format::f32_to_f16(format::f16_to_f32(x)), nan ? (x | 0x200) : x) << h;
    if ((h & 0x7fff) <= 0x7f80) {
      EXPECT_EQ(format::f32_to_bf16(format::bf16_to_f32(x)), x) << h;
    }
  }
}

TEST(Cast, BetweenHalfWidthsGoesThroughF32) {
  EXPECT_EQ(format::f16_to_bf16(0x3c00), 0x3f80);
  EXPECT_EQ(format::f16_to_bf16(0x0001), 0x3380);  // 2^-24
  EXPECT_EQ(format::f16_to_bf16(0x3c01), 0x3f80);  // 1 + 2^-10 rounds to 1 in bf16
  EXPECT_EQ(format::f16_to_bf16(0x7c01), 0x7fc0);  // torch's scalar path: canonical NaN
  EXPECT_EQ(format::f16_to_bf16(0xfc01), 0x7fc0);
  EXPECT_EQ(format::f16_to_bf16(0xfc00), 0xff80);
  EXPECT_EQ(format::bf16_to_f16(0x7f81), 0x7e08);
  EXPECT_EQ(format::bf16_to_f16(0x4780), 0x7c00);  // 65536: overflow
  EXPECT_EQ(format::bf16_to_f16(0x3380), 0x0001);
}

TEST(Cast, F64GoesThroughF32LikeTorch) {
  EXPECT_EQ(format::f64_to_f32(0x7ff5a5a5a5a5a5a5), 0x7fed2d2du);
  EXPECT_EQ(format::f64_to_f32(0x7ff0000000000001), 0x7fc00000u);
  EXPECT_EQ(format::f64_to_f32(0x3ff0000010000000), 0x3f800000u);  // 1 + 2^-24: tie, down
  EXPECT_EQ(format::f64_to_f32(0x3ff0000030000000), 0x3f800002u);  // 1 + 3*2^-24: tie, up
  EXPECT_EQ(format::f64_to_f32(0x47efffffffffffff), 0x7f800000u);  // above f32 max: Inf
  EXPECT_EQ(format::f32_to_f64(0x7f800001), 0x7ff8000020000000u);
  EXPECT_EQ(format::f32_to_f64(0x3f800000), 0x3ff0000000000000u);
  EXPECT_EQ(format::f32_to_f64(0x00000001), 0x36a0000000000000u);  // 2^-149
  // torch rounds F64 -> F16/BF16 twice (through F32): 1 + 2^-11 + 2^-40 becomes the tie
  // 1 + 2^-11 in F32, then 1.0 in F16 (one rounding would give 0x3c01).
  const double v = 1.0 + std::ldexp(1.0, -11) + std::ldexp(1.0, -40);
  uint16_t h = 0;
  format::convert(DType::F64, DType::F16, &v, &h, 1);
  EXPECT_EQ(h, 0x3c00);
  const double w = 1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -40);
  format::convert(DType::F64, DType::BF16, &w, &h, 1);
  EXPECT_EQ(h, 0x3f80);
  const uint64_t nan = 0x7ff0000000000001;
  format::convert(DType::F64, DType::BF16, &nan, &h, 1);
  EXPECT_EQ(h, 0xffff);
}

// convert() on unaligned buffers of every length agrees with the element functions.
TEST(Cast, ConvertMatchesElementFunctionsAtAnyAlignment) {
  std::mt19937_64 rng(7);
  std::vector<unsigned char> in(8 * 64 + 1), out(8 * 64 + 1);
  for (auto& b : in) b = static_cast<unsigned char>(rng());
  for (size_t n = 0; n < 64; ++n) {
    format::convert(DType::F32, DType::BF16, in.data() + 1, out.data() + 1, n);
    for (size_t i = 0; i < n; ++i) {
      uint32_t x;
      uint16_t y;
      std::memcpy(&x, in.data() + 1 + 4 * i, 4);
      std::memcpy(&y, out.data() + 1 + 2 * i, 2);
      ASSERT_EQ(y, format::f32_to_bf16(x));
    }
    format::convert(DType::F32, DType::F16, in.data() + 1, out.data() + 1, n);
    for (size_t i = 0; i < n; ++i) {
      uint32_t x;
      uint16_t y;
      std::memcpy(&x, in.data() + 1 + 4 * i, 4);
      std::memcpy(&y, out.data() + 1 + 2 * i, 2);
      ASSERT_EQ(y, format::f32_to_f16(x));
    }
    format::convert(DType::F16, DType::F32, in.data() + 1, out.data() + 1, n);
    for (size_t i = 0; i < n; ++i) {
      uint16_t x;
      uint32_t y;
      std::memcpy(&x, in.data() + 1 + 2 * i, 2);
      std::memcpy(&y, out.data() + 1 + 4 * i, 4);
      ASSERT_EQ(y, format::f16_to_f32(x));
    }
  }
}

TEST(DtypeMapping, ParsesNemoForm) {
  auto m = format::parse_dtype_mapping(
      R"({"lm_head.weight": "BF16", "model.norm.weight": "F32", "ids": "I64"})", "m.json");
  ASSERT_TRUE(m.ok()) << m.error().message;
  ASSERT_EQ(m->size(), 3u);
  EXPECT_EQ((*m)[0], (std::pair<std::string, DType>{"lm_head.weight", DType::BF16}));
  EXPECT_EQ((*m)[2].second, DType::I64);
}

TEST(DtypeMapping, RefusesWhatIsNotADtypeName) {
  auto m = format::parse_dtype_mapping(R"({"a": "BF16", "lm_head.weight": "bfloat16"})",
                                       ".hf_metadata/fqn_to_dtype_mapping.json");
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.error().message.find(".hf_metadata/fqn_to_dtype_mapping.json"), std::string::npos);
  EXPECT_NE(m.error().message.find("lm_head.weight"), std::string::npos);
  EXPECT_NE(m.error().message.find("bfloat16"), std::string::npos);
  EXPECT_FALSE(format::parse_dtype_mapping(R"({"a": 3})", "m").ok());
  EXPECT_FALSE(format::parse_dtype_mapping(R"({"a": null})", "m").ok());
  EXPECT_FALSE(format::parse_dtype_mapping(R"(["BF16"])", "m").ok());
  EXPECT_FALSE(format::parse_dtype_mapping(R"({"a": "BF16", "a": "F32"})", "m").ok());
  EXPECT_FALSE(format::parse_dtype_mapping(R"({"a": "BF16")", "m").ok());
  EXPECT_TRUE(format::parse_dtype_mapping("{}", "m").ok());
}

TEST(DtypePolicy, ParsesOptionValues) {
  using P = layout::BuildOptions::DtypePolicy;
  layout::BuildOptions o;
  ASSERT_TRUE(layout::set_dtype_policy(o, "bf16").ok());
  EXPECT_EQ(o.dtype_policy, P::Cast);
  EXPECT_EQ(o.cast_to, DType::BF16);
  ASSERT_TRUE(layout::set_dtype_policy(o, "fp16").ok());
  EXPECT_EQ(o.cast_to, DType::F16);
  ASSERT_TRUE(layout::set_dtype_policy(o, "fp32").ok());
  EXPECT_EQ(o.cast_to, DType::F32);
  ASSERT_TRUE(layout::set_dtype_policy(o, "stored").ok());
  EXPECT_EQ(o.dtype_policy, P::Stored);
  ASSERT_TRUE(layout::set_dtype_policy(o, "auto").ok());
  EXPECT_EQ(o.dtype_policy, P::Mapping);
  EXPECT_FALSE(layout::set_dtype_policy(o, "int8").ok());
  EXPECT_FALSE(layout::set_dtype_policy(o, "").ok());
}

// --- the cast view: a checkpoint built with a policy, read through map_range + gather ------

std::string shard(int r) { return format::shard_file_name(r, 1, 1); }

test::ChunkSpec chunk(std::string name, DType dt, std::vector<uint64_t> off,
                      std::vector<uint64_t> sz, std::string data) {
  return test::ChunkSpec{std::move(name), dt,           std::move(off),
                         std::move(sz),   std::nullopt, std::move(data)};
}

struct CastView {
  std::shared_ptr<const layout::Checkpoint> ck;
  std::vector<UniqueFd> fds;
  std::vector<int> raw;
};

CastView build_view(const std::vector<test::ShardSpec>& specs, const layout::BuildOptions& opts,
                    std::optional<format::DtypeMapping> dtypes = std::nullopt) {
  CastView v;
  layout::BuildInput in;
  in.dir = "ckpt";
  const auto files = test::add_shards(in, specs);
  in.dtypes = std::move(dtypes);
  v.ck = layout::build_checkpoint(std::move(in), opts);
  for (const auto& sh : v.ck->shards) {
    int fd = ::memfd_create("shard", MFD_CLOEXEC);
    const auto& b = files.at(sh.name);
    EXPECT_EQ(::pwrite(fd, b.data(), b.size(), 0), static_cast<ssize_t>(b.size()));
    v.fds.emplace_back(fd);
    v.raw.push_back(fd);
  }
  return v;
}

std::string read_view(const CastView& v, uint64_t off, uint64_t len) {
  std::vector<layout::Segment> segs;
  layout::map_range(*v.ck, 0, off, len, segs);
  uint64_t n = 0;
  for (const auto& s : segs) n += s.len;
  std::string out(n, '\0');
  io::GatherSource src{v.ck.get(), v.raw, v.ck->outputs[0].header, {}};
  auto st = io::gather(src, segs, out.data());
  EXPECT_TRUE(st.ok()) << st.error().message;
  return out;
}

std::string converted(DType from, DType to, const std::string& in) {
  const size_t n = in.size() / (format::dtype_bits(from) / 8);
  std::string out(n * (format::dtype_bits(to) / 8), '\0');
  format::convert(from, to, in.data(), out.data(), n);
  return out;
}

TEST(CastView, HeaderSizesAndIndexFollowTheCastDtype) {
  std::mt19937_64 rng(1);
  const std::string w = test::random_bytes(rng, 4 * 6 * 4), ids = test::random_bytes(rng, 8 * 3);
  const std::string h = test::random_bytes(rng, 2 * 5);
  layout::BuildOptions opts;
  opts.dtype_policy = layout::BuildOptions::DtypePolicy::Cast;
  opts.cast_to = DType::BF16;
  auto v =
      build_view({{shard(1),
                   {chunk("w", DType::F32, {0, 0}, {6, 4}, w),
                    chunk("ids", DType::I64, {0}, {3}, ids), chunk("h", DType::F16, {0}, {5}, h)}}},
                 opts);
  ASSERT_TRUE(v.ck->valid()) << v.ck->problems[0].to_string();
  const auto& f = v.ck->outputs[0];
  auto hdr = format::parse_header_json(f.header.substr(8), f.size, "out");
  ASSERT_TRUE(hdr.ok()) << hdr.error().message;
  const auto* tw = hdr->find("w");
  ASSERT_NE(tw, nullptr);
  EXPECT_EQ(tw->dtype, DType::BF16);
  EXPECT_EQ(tw->end - tw->begin, 48u);
  EXPECT_EQ(hdr->find("ids")->dtype, DType::I64);  // integers stay as stored
  EXPECT_EQ(hdr->find("h")->dtype, DType::BF16);
  EXPECT_EQ(f.size, f.header.size() + 48 + 24 + 10);
  EXPECT_NE(v.ck->index_json.find("\"total_size\": 82"), std::string::npos) << v.ck->index_json;
  const std::string data = read_view(v, f.header.size(), UINT64_MAX);
  EXPECT_EQ(data.size(), 82u);
  // Tensors in name order: h, ids, w.
  EXPECT_EQ(data.substr(0, 10), converted(DType::F16, DType::BF16, h));
  EXPECT_EQ(data.substr(10, 24), ids);
  EXPECT_EQ(data.substr(34), converted(DType::F32, DType::BF16, w));
}

TEST(CastView, MappingCastsOnlyMappedFloatTensors) {
  std::mt19937_64 rng(2);
  const std::string a = test::random_bytes(rng, 16), b = test::random_bytes(rng, 16),
                    c = test::random_bytes(rng, 16), d = test::random_bytes(rng, 16);
  layout::BuildOptions opts;
  opts.dtype_policy = layout::BuildOptions::DtypePolicy::Mapping;
  format::DtypeMapping m = {{"a", DType::BF16},
                            {"b", DType::F32},
                            {"c", DType::BF16},
                            {"gone", DType::F16},
                            {"d", DType::F8_E4M3}};
  auto v = build_view({{shard(1),
                        {chunk("a", DType::F32, {0}, {4}, a), chunk("b", DType::F32, {0}, {4}, b),
                         chunk("c", DType::I32, {0}, {4}, c), chunk("d", DType::F32, {0}, {4}, d),
                         chunk("e", DType::F32, {0}, {4}, d)}}},
                      opts, m);
  ASSERT_TRUE(v.ck->valid()) << v.ck->problems[0].to_string();
  std::map<std::string, DType> got;
  for (const auto& t : v.ck->tensors) got[t.name] = t.dtype;
  EXPECT_EQ(got["a"], DType::BF16);  // mapped, castable
  EXPECT_EQ(got["b"], DType::F32);   // mapped to what it is
  EXPECT_EQ(got["c"], DType::I32);   // integers are never cast
  EXPECT_EQ(got["d"], DType::F32);   // F8 is not a cast target: stays as stored
  EXPECT_EQ(got["e"], DType::F32);   // not in the mapping
  // Stored: the mapping is ignored.
  opts.dtype_policy = layout::BuildOptions::DtypePolicy::Stored;
  auto s = build_view({{shard(1), {chunk("a", DType::F32, {0}, {4}, a)}}}, opts, m);
  EXPECT_EQ(s.ck->tensors[0].dtype, DType::F32);
}

// Every range of a column- and row-sharded cast view, at every offset and many lengths,
// reads the converted bytes of the full tensor: partial first and last elements included.
TEST(CastView, EveryRangeReadsTheConvertedTensor) {
  std::mt19937_64 rng(3);
  for (auto [from, to] : {std::pair{DType::F32, DType::BF16}, std::pair{DType::BF16, DType::F32},
                          std::pair{DType::F64, DType::F16}, std::pair{DType::F16, DType::F64}}) {
    const uint64_t isz = format::dtype_bits(from) / 8;
    const std::vector<uint64_t> shape{6, 10};
    const std::string full = test::random_bytes(rng, 60 * isz);
    auto part = [&](std::vector<uint64_t> off, std::vector<uint64_t> sz) {
      return chunk("w", from, off, sz, test::slice_chunk(full, shape, from, off, sz));
    };
    // Column split on ranks 1-2 for rows 0-3, a row block on rank 3, plus a whole bias.
    const std::string bias = test::random_bytes(rng, 3 * isz);
    layout::BuildOptions opts;
    opts.dtype_policy = layout::BuildOptions::DtypePolicy::Cast;
    opts.cast_to = to;
    auto v = build_view({{shard(1), {part({0, 0}, {4, 3}), chunk("b", from, {0}, {3}, bias)}},
                         {shard(2), {part({0, 3}, {4, 7})}},
                         {shard(3), {part({4, 0}, {2, 10})}}},
                        opts);
    ASSERT_TRUE(v.ck->valid()) << v.ck->problems[0].to_string();
    const std::string expect = converted(from, to, bias) + converted(from, to, full);
    const uint64_t h = v.ck->outputs[0].header.size();
    ASSERT_EQ(v.ck->outputs[0].size, h + expect.size());
    ASSERT_EQ(read_view(v, h, UINT64_MAX), expect);
    for (uint64_t off = 0; off < expect.size(); ++off) {
      for (uint64_t len : {1ul, 2ul, 3ul, 5ul, 7ul, 9ul, 17ul, 33ul, 100ul}) {
        ASSERT_EQ(read_view(v, h + off, len), expect.substr(off, len))
            << format::dtype_name(from) << "->" << format::dtype_name(to) << " at " << off
            << " len " << len;
      }
    }
    // Across the header boundary too.
    ASSERT_EQ(read_view(v, h - 3, 10), v.ck->outputs[0].header.substr(h - 3) + expect.substr(0, 7));
  }
}

// A cast longer than one gather block streams through the bounded scratch.
TEST(CastView, LargeTensorStreamsInBlocks) {
  std::mt19937_64 rng(4);
  const uint64_t n = io::kCastBlock / 4 * 3 + 5;  // more than three blocks of F32
  const std::string full = test::random_bytes(rng, n * 4);
  layout::BuildOptions opts;
  opts.dtype_policy = layout::BuildOptions::DtypePolicy::Cast;
  opts.cast_to = DType::F16;
  auto v = build_view({{shard(1), {chunk("w", DType::F32, {0}, {n}, full)}}}, opts);
  ASSERT_TRUE(v.ck->valid());
  const uint64_t h = v.ck->outputs[0].header.size();
  const std::string expect = converted(DType::F32, DType::F16, full);
  EXPECT_EQ(read_view(v, h, UINT64_MAX), expect);
  EXPECT_EQ(read_view(v, h + 1, 2 * n - 2), expect.substr(1, 2 * n - 2));
}

}  // namespace

// io::transpose against the element-by-element copy, for every element size, at shapes on and
// off the 8x8 and 4x4 tiles (rows and columns short of a tile, one tile and a bit, many), rows
// wider than the columns taken, and unaligned rows and outputs.
TEST(Transpose, EveryShapeMatchesTheElementByElementCopy) {
  std::mt19937_64 rng(11);
  for (uint64_t es : {1u, 2u, 4u, 8u, 3u}) {
    for (uint64_t n : {1u, 3u, 7u, 8u, 9u, 64u, 65u, 130u}) {
      for (uint64_t k : {1u, 4u, 5u, 8u, 17u, 40u}) {
        const uint64_t pad = 1 + rng() % 3;  // unaligned: rows start at odd offsets
        // Every other case tight: rows of exactly the k columns, the buffer ending with the last
        // row's last element (ASan sees a read past it).
        const bool tight = (n + k) % 2 == 0;
        const uint64_t stride = tight ? k * es : (k + 3) * es + pad;
        const std::string bytes = test::random_bytes(rng, pad + (n - 1) * stride + k * es);
        const std::vector<char> in(bytes.begin(), bytes.end());  // allocated to the byte
        std::string want(n * k * es, '\0'), got(n * k * es + 1, '\0');
        for (uint64_t j = 0; j < k; ++j) {
          for (uint64_t i = 0; i < n; ++i) {
            std::memcpy(want.data() + (j * n + i) * es, in.data() + pad + i * stride + j * es, es);
          }
        }
        io::transpose(in.data() + pad, stride, n, k, es, got.data() + 1);
        ASSERT_EQ(got.substr(1), want) << "es " << es << " n " << n << " k " << k;
      }
    }
  }
}
