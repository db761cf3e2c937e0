#include <gtest/gtest.h>

#include <limits>

#include "ckptfs/format/dcp.hpp"
#include "ckptfs/format/dtype.hpp"
#include "ckptfs/format/index.hpp"
#include "ckptfs/format/names.hpp"
#include "ckptfs/format/safetensors.hpp"
#include "fixture.hpp"
// The internal strict parser, for its value descriptions.
#include "../../src/format/json_strict.hpp"

using namespace ckptfs;
using namespace ckptfs::format;

namespace {

std::string le64(uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return s;
}

// A file whose header is `json` followed by `data_len` zero bytes.
std::string file_with(const std::string& json, size_t data_len) {
  return le64(json.size()) + json + std::string(data_len, '\0');
}

Result<Header> parse(const std::string& json, size_t data_len) {
  return parse_file_bytes(file_with(json, data_len), "f.safetensors");
}

void expect_error(const Result<Header>& r, std::string_view needle) {
  ASSERT_FALSE(r.ok()) << "expected an error containing: " << needle;
  EXPECT_NE(r.error().message.find(needle), std::string::npos) << r.error().message;
  EXPECT_NE(r.error().message.find("f.safetensors"), std::string::npos) << r.error().message;
}

// `depth` nested arrays: "[[...]]".
std::string nested(size_t depth) { return std::string(depth, '[') + std::string(depth, ']'); }

// `depth` nested objects: {"x":{"x":...{}}}.
std::string nested_objects(size_t depth) {
  std::string s;
  for (size_t i = 1; i < depth; ++i) s += "{\"x\":";
  return s + "{" + std::string(depth, '}');
}

constexpr size_t kDeep = 100'000;
constexpr std::string_view kTooDeep = "nested deeper than 64 levels";

}  // namespace

TEST(DType, TableIsIndexedByEnumAndRoundTrips) {
  for (size_t i = 0; i < all_dtypes().size(); ++i) {
    const auto& d = all_dtypes()[i];
    EXPECT_EQ(static_cast<size_t>(d.dtype), i) << d.name;
    EXPECT_EQ(parse_dtype(d.name), d.dtype);
    EXPECT_EQ(dtype_name(d.dtype), d.name);
  }
  EXPECT_FALSE(parse_dtype("F128"));
  EXPECT_FALSE(parse_dtype("bf16"));  // names are case-sensitive
}

TEST(DType, SubByteSizesAreCountedInBits) {
  EXPECT_EQ(dtype_bits(DType::F4), 4u);
  EXPECT_EQ(dtype_bits(DType::F6_E2M3), 6u);
  EXPECT_EQ(byte_size(DType::F4, 6), 3u);
  EXPECT_FALSE(byte_size(DType::F4, 3));  // 12 bits
  EXPECT_EQ(byte_size(DType::F6_E3M2, 4), 3u);
  EXPECT_FALSE(byte_size(DType::F6_E3M2, 2));
  EXPECT_EQ(byte_size(DType::BF16, 10), 20u);
  EXPECT_FALSE(byte_size(DType::F64, std::numeric_limits<uint64_t>::max() / 4));
}

TEST(Safetensors, ParsesAValidHeader) {
  std::string json =
      R"({"__metadata__":{"format":"pt"},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]},)"
      R"("a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"e":{"dtype":"F16","shape":[0,3],"data_offsets":[12,12]},)"
      R"("s":{"dtype":"I64","shape":[],"data_offsets":[12,20]}})";
  auto r = parse(json, 20);
  ASSERT_TRUE(r.ok()) << r.error().message;
  ASSERT_EQ(r->tensors.size(), 4u);
  EXPECT_EQ(r->tensors[0].name, "a");
  EXPECT_EQ(r->tensors[1].name, "b");
  EXPECT_EQ(r->data_size, 20u);
  EXPECT_EQ(r->data_start(), 8 + json.size());
  ASSERT_NE(r->find_metadata("format"), nullptr);
  EXPECT_EQ(*r->find_metadata("format"), "pt");
  EXPECT_EQ(r->find("s")->shape.size(), 0u);
}

TEST(Safetensors, AcceptsSpacePaddingAndNullMetadata) {
  std::string json =
      R"({"__metadata__":null,"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}    )";
  auto r = parse(json, 1);
  ASSERT_TRUE(r.ok()) << r.error().message;
  EXPECT_TRUE(r->metadata.empty());
}

TEST(Safetensors, RejectsMalformedHeaders) {
  const std::string ok_entry = R"("a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]})";
  expect_error(parse("not json", 0), "does not start");
  expect_error(parse("{\"a\":", 0), "is not valid JSON");
  expect_error(
      parse("{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},\"\xff\":1}", 1),
      "is not valid JSON");
  expect_error(parse("{" + ok_entry + "," + ok_entry + "}", 4), "duplicate key \"a\"");
  expect_error(parse(R"({"a":{"dtype":"X9","shape":[4],"data_offsets":[0,4]}})", 4),
               "unknown dtype 'X9'");
  expect_error(parse(R"({"a":{"dtype":"U8","shape":[-4],"data_offsets":[0,4]}})", 4),
               "non-negative integer");
  expect_error(parse(R"({"a":{"dtype":"U8","shape":[4.5],"data_offsets":[0,4]}})", 4),
               "non-negative integer");
  expect_error(parse(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,5]}})", 5), "needs 4");
  expect_error(parse(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[4,0]}})", 4),
               "end before they begin");
  expect_error(parse(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0]}})", 4),
               "must have 2 entries");
  expect_error(parse(R"({"a":{"dtype":"U8","shape":[4]}})", 4), "missing 'data_offsets'");
  expect_error(parse(R"({"a":{"dtype":"U8","data_offsets":[0,4]}})", 4), "missing 'shape'");
  expect_error(parse(R"({"a":[1,2]})", 0), "not an object");
  expect_error(parse(R"({"__metadata__":{"k":1},)" + ok_entry + "}", 4),
               "__metadata__ value for 'k' is not a string");
  expect_error(
      parse(
          R"({"a":{"dtype":"U8","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,4]}})",
          4),
      "overflows");
  expect_error(parse(R"({"a":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}})", 2),
               "whole number of bytes");
  // holes and overlaps in the data buffer
  expect_error(
      parse(
          R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[6,10]}})",
          10),
      "hole");
  expect_error(
      parse(
          R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})",
          6),
      "overlap");
  expect_error(parse(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})", 6), "hole");
  // exact file size
  expect_error(parse("{" + ok_entry + "}", 3), "truncated");
  expect_error(parse("{" + ok_entry + "}", 5), "describes");
}

TEST(Safetensors, RejectsBadLengthPrefix) {
  expect_error(parse_file_bytes("short", "f.safetensors"), "too short");
  expect_error(parse_file_bytes(le64(1000) + "{}", "f.safetensors"), "runs past the end");
  expect_error(parse_file_bytes(le64(kMaxHeaderSize + 1) + "{}", "f.safetensors"), "exceeds the");
  expect_error(parse_file_bytes(le64(~0ull) + "{}", "f.safetensors"), "exceeds the");
}

TEST(Safetensors, EntriesArePackedBackToBackAndOverflowIsRefused) {
  std::vector<format::TensorEntry> list;
  format::TensorEntry a;
  a.name = "a";
  ASSERT_TRUE(format::append_packed(list, a, 12).ok());
  format::TensorEntry b;
  b.name = "b";
  ASSERT_TRUE(format::append_packed(list, b, 0).ok());  // an empty tensor takes no bytes
  format::TensorEntry c;
  c.name = "c";
  ASSERT_TRUE(format::append_packed(list, c, 4).ok());
  ASSERT_EQ(list.size(), 3u);
  EXPECT_EQ(list[0].begin, 0u);
  EXPECT_EQ(list[0].end, 12u);
  EXPECT_EQ(list[1].begin, 12u);
  EXPECT_EQ(list[1].end, 12u);
  EXPECT_EQ(list[2].begin, 12u);
  EXPECT_EQ(list[2].end, 16u);
  format::TensorEntry d;
  d.name = "huge";
  auto st = format::append_packed(list, d, UINT64_MAX - 8);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.error().code, EOVERFLOW);
  EXPECT_NE(st.error().message.find("huge"), std::string::npos);
  EXPECT_EQ(list.size(), 3u);
}

TEST(Safetensors, SerializeRoundTripsAndPadsToEight) {
  std::vector<TensorEntry> entries(2);
  entries[0] = {"w\"eird\\name", DType::BF16, {3, 5}, 0, 30};
  entries[1] = {"zero_d", DType::F32, {}, 30, 34};
  for (size_t extra = 0; extra < 9; ++extra) {
    std::map<std::string, std::string> md{{"format", "pt"}, {"pad", std::string(extra, 'x')}};
    std::string head = serialize_header(entries, md);
    EXPECT_EQ(head.size() % 8, 0u);
    auto r = parse_file_bytes(head + std::string(34, '\0'), "rt");
    ASSERT_TRUE(r.ok()) << r.error().message;
    EXPECT_EQ(r->tensors.size(), 2u);
    EXPECT_EQ(r->tensors[0].name, entries[0].name);
    EXPECT_EQ(r->tensors[0].shape, entries[0].shape);
    EXPECT_EQ(r->metadata, md);
    // __metadata__ comes first, then tensors in the given order.
    std::string json = head.substr(8);
    EXPECT_LT(json.find("__metadata__"), json.find("eird"));
    EXPECT_LT(json.find("eird"), json.find("zero_d"));
  }
}

TEST(Dcp, ParsesOffsetsAndOptionalShape) {
  auto r = parse_sharding_info(
      R"({"a":{"saved_offsets":[0,16]},"b":{"saved_offsets":[4],"shape":[8],"future":"x"}})", "s");
  ASSERT_TRUE(r.ok()) << r.error().message;
  EXPECT_EQ(r->at("a").saved_offsets, (std::vector<uint64_t>{0, 16}));
  EXPECT_FALSE(r->at("a").full_shape);
  EXPECT_EQ(*r->at("b").full_shape, (std::vector<uint64_t>{8}));
  auto back = parse_sharding_info(serialize_sharding_info(*r), "s");
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->at("b").saved_offsets, r->at("b").saved_offsets);
}

TEST(Dcp, RejectsBadInfo) {
  EXPECT_FALSE(parse_sharding_info("{", "s").ok());
  EXPECT_FALSE(parse_sharding_info("[]", "s").ok());
  EXPECT_FALSE(parse_sharding_info(R"({"a":{}})", "s").ok());
  EXPECT_FALSE(parse_sharding_info(R"({"a":{"saved_offsets":[-1]}})", "s").ok());
  auto r = parse_sharding_info(R"({"t.w":{"saved_offsets":"x"}})", "shard-1");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("t.w"), std::string::npos);
  EXPECT_NE(r.error().message.find("shard-1"), std::string::npos);
}

TEST(Names, ParsesShardAndModelNames) {
  auto s = parse_shard_name("shard-00003-model-00001-of-00004.safetensors");
  ASSERT_TRUE(s);
  EXPECT_EQ(s->shard, 3u);
  EXPECT_EQ(s->k, 1u);
  EXPECT_EQ(s->m, 4u);
  EXPECT_TRUE(parse_shard_name("shard-1-model-1-of-1.safetensors"));
  EXPECT_FALSE(parse_shard_name("shard-00003-model-00005-of-00004.safetensors"));
  EXPECT_FALSE(parse_shard_name("shard-00003-model-00000-of-00004.safetensors"));
  EXPECT_FALSE(parse_shard_name("shard-x-model-00001-of-00004.safetensors"));
  EXPECT_FALSE(parse_shard_name("shard-00003-model-00001-of-00004.safetensors.tmp"));
  EXPECT_FALSE(parse_shard_name("shard-00003-model-00001-of-00004"));
  EXPECT_FALSE(parse_shard_name("shard-1234567890-model-1-of-1.safetensors"));
  auto m = parse_model_name("model-00002-of-00004.safetensors");
  ASSERT_TRUE(m);
  EXPECT_EQ(m->k, 2u);
  EXPECT_EQ(m->m, 4u);
  EXPECT_TRUE(parse_model_name("model.safetensors")->single);
  EXPECT_FALSE(parse_model_name("model-00002-of-00004.bin"));
  EXPECT_EQ(model_file_name(2, 4), "model-00002-of-00004.safetensors");
  EXPECT_EQ(shard_file_name(3, 1, 4), "shard-00003-model-00001-of-00004.safetensors");
  EXPECT_EQ(model_file_name(2, 123456), "model-00002-of-123456.safetensors");
}

TEST(Index, SerializesSortedWithMetadata) {
  Index idx;
  idx.total_size = 100;
  idx.total_parameters = 50;
  idx.weight_map = {{"z", "model-00002-of-00002.safetensors"},
                    {"a", "model-00001-of-00002.safetensors"}};
  std::string s = serialize_index(idx);
  EXPECT_EQ(s.back(), '\n');
  EXPECT_LT(s.find("\"metadata\""), s.find("\"weight_map\""));
  EXPECT_LT(s.find("\"a\""), s.find("\"z\""));
  auto back = parse_index(s, "idx");
  ASSERT_TRUE(back.ok()) << back.error().message;
  EXPECT_EQ(back->total_size, 100u);
  EXPECT_EQ(back->weight_map.size(), 2u);
  EXPECT_FALSE(parse_index(R"({"metadata":{}})", "idx").ok());
}

TEST(Index, MappingKeepsOrderAndValidates) {
  auto m = parse_fqn_mapping(R"({"z":2,"a":1,"m":2})", "map");
  ASSERT_TRUE(m.ok());
  ASSERT_EQ(m->size(), 3u);
  EXPECT_EQ((*m)[0].first, "z");
  EXPECT_EQ((*m)[2].second, 2u);
  EXPECT_FALSE(parse_fqn_mapping(R"({"a":0})", "map").ok());
  EXPECT_FALSE(parse_fqn_mapping(R"({"a":"1"})", "map").ok());
  EXPECT_FALSE(parse_fqn_mapping(R"([1])", "map").ok());
  auto rt = parse_fqn_mapping(serialize_fqn_mapping(*m), "map");
  ASSERT_TRUE(rt.ok());
  EXPECT_EQ(*rt, *m);
}

// Hostile nesting: 100,000 levels once overflowed the stack when an error message serialized
// the value. The strict parser now refuses anything deeper than 64 levels before parsing.
TEST(Nesting, DeepHeaderValuesAreRefusedNamingTheFile) {
  // As a shape element, where an integer is expected.
  expect_error(
      parse(R"({"a":{"dtype":"U8","shape":[)" + nested(kDeep) + R"(],"data_offsets":[0,1]}})", 1),
      "header is nested deeper than 64 levels");
  // As a whole tensor entry, as arrays and as objects.
  expect_error(parse(R"({"a":)" + nested(kDeep) + "}", 0), kTooDeep);
  expect_error(parse(R"({"a":)" + nested_objects(kDeep) + "}", 0), kTooDeep);
  // In __metadata__, and unterminated (the scan runs before the parser sees the text).
  expect_error(parse(R"({"__metadata__":{"k":)" + nested(kDeep) + "}}", 0), kTooDeep);
  expect_error(parse(R"({"a":)" + std::string(kDeep, '['), 0), kTooDeep);
}

TEST(Nesting, ExactlyTheLimitIsAccepted) {
  // Root object (1) + tensor entry (2) + 62 arrays in an unknown key = 64 levels.
  auto at = [](size_t arrays) {
    return R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"future":)" + nested(arrays) +
           "}}";
  };
  auto r = parse(at(62), 1);
  ASSERT_TRUE(r.ok()) << r.error().message;
  EXPECT_EQ(r->tensors.size(), 1u);
  expect_error(parse(at(63), 1), "header is nested deeper than 64 levels");
}

TEST(Nesting, BracketsInsideStringsDoNotCount) {
  // A name full of brackets, an escaped quote and an escaped backslash before the closing
  // quote: none of it is structure.
  std::string name = std::string(100, '[') + R"(\"{{{\\)";
  auto r = parse(R"({")" + name + R"(":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", 1);
  ASSERT_TRUE(r.ok()) << r.error().message;
  EXPECT_EQ(r->tensors[0].name, std::string(100, '[') + "\"{{{\\");
  // DCP_SHARDING_INFO is a string in the header: its nesting is the DCP parser's business.
  std::string md = R"({"__metadata__":{"DCP_SHARDING_INFO":")" + nested(kDeep) + R"("}})";
  EXPECT_TRUE(parse(md, 0).ok());
}

TEST(Nesting, DeepShardingInfoIsRefusedNamingTheFile) {
  auto r = parse_sharding_info(R"({"a":{"saved_offsets":)" + nested(kDeep) + "}}", "shard-1");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("shard-1: DCP_SHARDING_INFO is nested deeper than 64 levels"),
            std::string::npos)
      << r.error().message;
  // Exactly the limit: root (1) + entry (2) + 62 arrays under a key newer writers might add.
  auto ok =
      parse_sharding_info(R"({"a":{"saved_offsets":[0],"future":)" + nested(62) + "}}", "shard-1");
  ASSERT_TRUE(ok.ok()) << ok.error().message;
  EXPECT_FALSE(
      parse_sharding_info(R"({"a":{"saved_offsets":[0],"future":)" + nested(63) + "}}", "shard-1")
          .ok());
}

TEST(Nesting, DeepMappingAndIndexAreRefusedNamingTheFile) {
  auto m = parse_fqn_mapping(R"({"a":)" + nested(kDeep) + "}", "fqn_to_file_index_mapping.json");
  ASSERT_FALSE(m.ok());
  EXPECT_NE(
      m.error().message.find("fqn_to_file_index_mapping.json: mapping is nested deeper than 64"),
      std::string::npos)
      << m.error().message;
  auto i = parse_index(R"({"metadata":{},"weight_map":)" + nested_objects(kDeep) + "}",
                       "model.safetensors.index.json");
  ASSERT_FALSE(i.ok());
  EXPECT_NE(i.error().message.find("model.safetensors.index.json: index is nested deeper than 64"),
            std::string::npos)
      << i.error().message;
  // An index nested exactly 64 deep (in a key transformers does not read) is accepted.
  auto ok = parse_index(R"({"metadata":{"x":)" + nested(62) + R"(},"weight_map":{"w":"f"}})", "i");
  ASSERT_TRUE(ok.ok()) << ok.error().message;
}

TEST(Nesting, ErrorMessagesDescribeValuesWithoutSerializingThem) {
  // Values within the limit, where an integer is expected: described, not dumped.
  expect_error(parse(R"({"a":{"dtype":"U8","shape":[[[[1,2]]]],"data_offsets":[0,4]}})", 4),
               "'shape' holds an array of 1 element where a non-negative integer is required");
  expect_error(parse(R"({"a":{"dtype":"U8","shape":[{"k":1,"j":2}],"data_offsets":[0,4]}})", 4),
               "holds an object with 2 keys");
  expect_error(parse(R"({"a":{"dtype":"U8","shape":[-3],"data_offsets":[0,4]}})", 4),
               "'shape' holds -3 where");
  auto m = parse_fqn_mapping(R"({"w":[[]]})", "map");
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.error().message.find("file index is an array of 1 element"), std::string::npos)
      << m.error().message;
  auto d = parse_sharding_info(R"({"w":{"saved_offsets":[null]}})", "s");
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.error().message.find("holds null where"), std::string::npos) << d.error().message;

  // A value far deeper than any parse would let through is still described in O(1) stack.
  using nlohmann::json;
  json deep = json::array();
  for (size_t i = 0; i < kDeep; ++i) {
    json outer = json::array();
    outer.push_back(std::move(deep));
    deep = std::move(outer);
  }
  EXPECT_EQ(detail::describe(deep), "an array of 1 element");
  EXPECT_EQ(detail::describe(json::object()), "an empty object");
  EXPECT_EQ(detail::describe(json(1.5)), "1.5");
  EXPECT_EQ(detail::describe(json(false)), "false");

  // Strings: quoted, cut to 40 characters, control characters and bad UTF-8 escaped.
  EXPECT_EQ(detail::describe(json("a\"b")), R"(the string "a\"b")");
  EXPECT_EQ(detail::describe(json(std::string("x\n\x1b[2J\x7f\xc2\x85y", 10))),
            R"(the string "x\n\u001b[2J\u007f\u0085y")");
  std::string long_s = "\xc3\xa9" + std::string(1000, 'z');
  EXPECT_EQ(detail::describe(json(long_s)),
            "the string \"\xc3\xa9" + std::string(39, 'z') + "\"... (1002 bytes)");
  std::string bad_utf8 = "\xff\xe2\x82";
  EXPECT_EQ(detail::describe(json(bad_utf8)), R"(the string "\xff\xe2\x82")");
  expect_error(parse(R"({"a":{"dtype":"U8","shape":[")" + std::string(5000, 'q') +
                         R"("],"data_offsets":[0,4]}})",
                     4),
               "holds the string \"qqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqqq\"... (5000 bytes)");
}

TEST(StrictJson, DuplicateKeysAreRefusedAtAnyDepth) {
  auto r = parse_sharding_info(R"({"w":{"saved_offsets":[0]},"w":{"saved_offsets":[2]}})", "s");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("duplicate key \"w\""), std::string::npos) << r.error().message;
  expect_error(parse(R"({"a":{"dtype":"U8","shape":[1],"shape":[1],"data_offsets":[0,1]}})", 1),
               "duplicate key \"shape\"");
  auto e = parse_fqn_mapping(R"({"":1,"":1})", "map");
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.error().message.find("map: mapping has duplicate key \"\""), std::string::npos)
      << e.error().message;
  // Keys are unique per object, not per document.
  auto ok = parse_sharding_info(
      R"({"v":{"saved_offsets":[0],"shape":[2]},"w":{"saved_offsets":[0],"shape":[2]}})", "s");
  ASSERT_TRUE(ok.ok()) << ok.error().message;
  // Top-level keys are collected in document order, not the parsed object's (sorted) order,
  // and a nested object's keys are not among them.
  auto m = parse_fqn_mapping(R"({"c":3,"b":1,"a":2})", "map");
  ASSERT_TRUE(m.ok()) << m.error().message;
  EXPECT_EQ(*m, (FqnMapping{{"c", 3}, {"b", 1}, {"a", 2}}));
  auto m2 = parse_fqn_mapping(R"({"c":1,"b":{"z":1},"a":1})", "map");
  ASSERT_FALSE(m2.ok());
  EXPECT_NE(m2.error().message.find("tensor 'b'"), std::string::npos) << m2.error().message;
}
