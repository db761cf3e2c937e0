// Model maps (docs/maps.md): format/model_map's parser, layout/model_map's compiler through
// build_checkpoint, and the bytes map_range serves for mapped tensors, checked against naive
// element-by-element references (fixed maps, a random-map property test, hostile maps).
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <iostream>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "ckptfs/format/cast.hpp"
#include "ckptfs/format/megatron_args.hpp"
#include "ckptfs/format/model_map.hpp"
#include "ckptfs/io/gather.hpp"
#include "ckptfs/layout/checkpoint.hpp"
#include "ckptfs/layout/extent_map.hpp"
#include "ckptfs/layout/model_map.hpp"
#include "ckptfs/util/fd.hpp"
#include "fixture.hpp"

using namespace ckptfs;
using format::DType;
using nlohmann::json;

namespace {

// ---- helpers: parsing ------------------------------------------------------------------

json map_with(json rules, json extra = json::object()) {
  json m = {{"ckptfs_map", 1}, {"name", "t"}, {"tensors", std::move(rules)}};
  for (auto it = extra.begin(); it != extra.end(); ++it) m[it.key()] = it.value();
  return m;
}

json one_rule(json rule, json extra = json::object()) {
  return map_with(json::array({std::move(rule)}), std::move(extra));
}

// The refusal's message, or "" when the map parsed.
std::string refusal(const std::string& text) {
  auto m = format::parse_model_map(text, "test.json");
  return m ? std::string() : m.error().message;
}
std::string refusal(const json& j) { return refusal(j.dump()); }

void expect_refused(const std::string& text, std::initializer_list<std::string_view> needles) {
  const std::string msg = refusal(text);
  EXPECT_FALSE(msg.empty()) << "parsed, but should be refused: " << text.substr(0, 300);
  for (auto n : needles) {
    EXPECT_NE(msg.find(n), std::string::npos)
        << "message lacks '" << n << "': " << msg << "\n  map: " << text.substr(0, 300);
  }
}
void expect_refused(const json& j, std::initializer_list<std::string_view> needles) {
  expect_refused(j.dump(), needles);
}
void expect_refused(const char* text, std::initializer_list<std::string_view> needles) {
  expect_refused(std::string(text), needles);
}

std::shared_ptr<const format::ModelMap> map_of(const json& j) {
  auto m = format::parse_model_map(j.dump(), "test.json");
  if (!m) throw std::runtime_error("map refused: " + m.error().message + "\n" + j.dump());
  return std::make_shared<const format::ModelMap>(std::move(m).value());
}

// ---- helpers: checkpoints --------------------------------------------------------------

size_t esize(DType d) { return format::dtype_bits(d) / 8; }

uint64_t numel(const std::vector<uint64_t>& s) {
  return std::accumulate(s.begin(), s.end(), uint64_t{1}, std::multiplies<>());
}

struct Stored {
  std::string name;
  DType dtype = DType::F32;
  std::vector<uint64_t> shape;
  std::string data;  // row-major; random when empty
};

struct View {
  std::shared_ptr<const layout::Checkpoint> ck;
  std::vector<std::string> shards;  // the shard files' bytes, in memory
};

// A torch-DCP-like checkpoint: every stored tensor cut into a random grid of chunks, spread over
// `nshards` files at random offsets (BuildInput::declared, as the DCP source hands them over).
View build_view(std::vector<Stored>& stored, const layout::BuildOptions& opts, std::mt19937_64& rng,
                int nshards = 2, std::string format = "torch DCP (.metadata, *.distcp)",
                std::string own_config = {}, std::string native = {}) {
  View v;
  v.shards.assign(static_cast<size_t>(nshards), std::string());
  layout::BuildInput in;
  in.dir = "ckpt";
  in.config = std::move(own_config);
  if (!native.empty()) {
    in.native_config = std::move(native);
    in.native_what = "common.pt (Megatron-LM's args)";
  }
  layout::Declared d;
  d.format = std::move(format);
  for (auto& s : stored) {
    if (s.data.empty()) s.data = test::random_bytes(rng, numel(s.shape) * esize(s.dtype));
    // Cut points per dim (at most 2, and at most 24 chunks).
    std::vector<std::vector<uint64_t>> cuts(s.shape.size());
    uint64_t cells = 1;
    for (size_t k = 0; k < s.shape.size(); ++k) {
      std::set<uint64_t> c = {0, s.shape[k]};
      const uint64_t n = rng() % 3;
      for (uint64_t i = 0; i < n && s.shape[k] > 1 && cells * (c.size()) < 24; ++i) {
        c.insert(1 + rng() % (s.shape[k] - 1));
      }
      cuts[k].assign(c.begin(), c.end());
      cells *= cuts[k].size() - 1;
    }
    std::vector<uint64_t> cell(s.shape.size(), 0);
    for (;;) {
      layout::DeclaredChunk c;
      c.tensor = s.name;
      c.dtype = s.dtype;
      c.full_shape = s.shape;
      for (size_t k = 0; k < s.shape.size(); ++k) {
        c.offsets.push_back(cuts[k][cell[k]]);
        c.sizes.push_back(cuts[k][cell[k] + 1] - cuts[k][cell[k]]);
      }
      const auto bytes = test::slice_chunk(s.data, s.shape, s.dtype, c.offsets, c.sizes);
      c.shard = static_cast<uint32_t>(rng() % static_cast<uint64_t>(nshards));
      auto& f = v.shards[c.shard];
      f.append(rng() % 8, '\x5a');  // padding between chunks
      c.file_offset = f.size();
      f += bytes;
      d.chunks.push_back(std::move(c));
      size_t k = s.shape.size();
      while (k-- > 0) {
        if (++cell[k] + 1 < cuts[k].size()) break;
        cell[k] = 0;
      }
      if (k == static_cast<size_t>(-1)) break;
    }
  }
  for (int i = 0; i < nshards; ++i) {
    layout::ShardInput si;
    si.name = fmt::format("__{}_0.distcp", i);
    si.stamp.size = v.shards[static_cast<size_t>(i)].size();
    // Files of other bytes are other files (io::gather's window is keyed by the stamp).
    si.stamp.ino = std::hash<std::string>{}(v.shards[static_cast<size_t>(i)]);
    in.shards.push_back(std::move(si));
  }
  in.declared = std::move(d);
  v.ck = layout::build_checkpoint(std::move(in), opts);
  return v;
}

// Builds `stored` (their data filled in where empty) with `map` and `config` (null: none).
View compile(const json& map, const json& config, std::vector<Stored>& stored, uint64_t seed = 7,
             layout::BuildOptions opts = {}) {
  std::mt19937_64 rng(seed);
  opts.map = map_of(map);
  if (!config.is_null()) opts.hf_config = config.dump();
  return build_view(stored, opts, rng, 2);
}
View compile(const json& map, const json& config, std::vector<Stored>&& stored, uint64_t seed = 7,
             layout::BuildOptions opts = {}) {
  return compile(map, config, stored, seed, std::move(opts));
}

std::string problems(const layout::Checkpoint& c) {
  std::string s;
  for (const auto& p : c.problems) s += p.to_string() + "\n";
  return s;
}

// Whether some problem names `tensor` (when given) and says every needle.
bool has_problem(const layout::Checkpoint& c, std::string_view tensor,
                 std::initializer_list<std::string_view> needles) {
  return std::any_of(c.problems.begin(), c.problems.end(), [&](const layout::Problem& p) {
    const auto s = p.to_string();
    if (!tensor.empty() && p.tensor != tensor) return false;
    return std::all_of(needles.begin(), needles.end(),
                       [&](std::string_view n) { return s.find(n) != std::string::npos; });
  });
}

#define EXPECT_PROBLEM(view, tensor, ...)                                                   \
  do {                                                                                      \
    const auto& ck_ = *(view).ck;                                                           \
    EXPECT_FALSE(ck_.valid()) << "built without problems";                                  \
    EXPECT_TRUE(ck_.outputs.empty());                                                       \
    EXPECT_TRUE(has_problem(ck_, tensor, {__VA_ARGS__})) << "problems:\n" << problems(ck_); \
  } while (0)

// Bytes [off, off + len) of output `file`, gathered from the segments map_range gives: header
// bytes from memory, shard bytes from the in-memory shards, cast segments converted.
std::string read_range(const View& v, uint32_t file, uint64_t off, uint64_t len) {
  std::vector<layout::Segment> segs;
  layout::map_range(*v.ck, file, off, len, segs);
  std::string out;
  const auto& header = v.ck->outputs[file].header;
  for (const auto& s : segs) {
    if (s.is_memory()) {
      EXPECT_LE(s.src + s.len, header.size());
      out += header.substr(s.src, s.len);
      continue;
    }
    EXPECT_LT(s.shard, v.shards.size());
    if (s.shard >= v.shards.size()) return out;
    const auto& f = v.shards[s.shard];
    const uint64_t n = s.src_len();
    EXPECT_LE(s.src + n, f.size()) << "a segment reads past its shard";
    if (s.src + n > f.size()) return out;
    if (s.is_strided()) {  // element e at src + e * stride; the first `skip` bytes dropped
      std::string picked;
      for (uint64_t e = 0; e < s.elems(); ++e) picked += f.substr(s.src + e * s.stride, s.esize);
      out += picked.substr(s.skip, s.len);
      continue;
    }
    if (!s.is_cast()) {
      out += f.substr(s.src, s.len);
      continue;
    }
    const uint64_t elems = s.elems();
    std::string conv(elems * esize(s.to), '\0');
    format::convert(s.from, s.to, f.data() + s.src, conv.data(), elems);
    out += conv.substr(s.skip, s.len);
  }
  return out;
}

// Every sub-range of tensor `t` starting each `step` bytes, of each length in `lens` (also
// unaligned to elements), read through map_range, equals the same bytes of `want`.
void expect_every_subrange(const View& v, const layout::Tensor& t, const std::string& want,
                           uint64_t step, std::initializer_list<uint64_t> lens) {
  for (uint64_t a = 0; a < t.nbytes; a += step) {
    for (uint64_t n : lens) {
      const uint64_t len = std::min<uint64_t>(n, t.nbytes - a);
      ASSERT_EQ(read_range(v, t.output, t.out_offset + a, len), want.substr(a, len))
          << a << "+" << len;
    }
  }
}

const layout::Tensor* find_tensor(const layout::Checkpoint& ck, std::string_view name) {
  for (const auto& t : ck.tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

// A served tensor's bytes, read through map_range.
std::string tensor_bytes(const View& v, std::string_view name) {
  const auto* t = find_tensor(*v.ck, name);
  EXPECT_NE(t, nullptr) << "no tensor " << name << "; problems:\n" << problems(*v.ck);
  if (!t) return {};
  return read_range(v, t->output, t->out_offset, t->nbytes);
}

// Rows `r` (each of `row_bytes`) of `data`, in that order.
std::string rows_of(const std::string& data, uint64_t row_bytes, const std::vector<uint64_t>& r) {
  std::string out;
  for (auto i : r) out += data.substr(i * row_bytes, row_bytes);
  return out;
}

// The last two axes of row-major `data` ([blocks, r, c] elements of `es` bytes) swapped.
std::string transposed(const std::string& data, uint64_t blocks, uint64_t r, uint64_t c,
                       size_t es) {
  std::string out(data.size(), '\0');
  for (uint64_t b = 0; b < blocks; ++b) {
    for (uint64_t i = 0; i < r; ++i) {
      for (uint64_t j = 0; j < c; ++j) {
        out.replace(((b * c + j) * r + i) * es, es, data, ((b * r + i) * c + j) * es, es);
      }
    }
  }
  return out;
}

Stored st(std::string name, std::vector<uint64_t> shape, DType dt = DType::F32) {
  return Stored{std::move(name), dt, std::move(shape), {}};
}

// =========================================================================================
// Parser
// =========================================================================================

TEST(MapParse, TheDocumentedExampleParses) {
  const std::string text = R"MAP({
    "ckptfs_map": 1,
    "name": "torchtitan-llama3",
    "about": "torchtitan Llama 3 to HF LlamaForCausalLM (torchtitan's Llama3StateDictAdapter.to_hf)",
    "detect": {"all": ["tok_embeddings.weight", "layers.{L}.attention.wq.weight"],
               "none": ["layers.{L}.attention.q_norm.weight"]},
    "prefixes": ["model."],
    "axes": {
      "heads": "num_attention_heads",
      "kv_heads": "num_key_value_heads | num_attention_heads",
      "head_dim": "head_dim | hidden_size / num_attention_heads",
      "half": "head_dim / 2"
    },
    "tensors": [
      {"hf": "model.embed_tokens.weight", "from": "tok_embeddings.weight",
       "shape": ["vocab_size", "hidden_size"]},
      {"hf": "model.layers.{L}.self_attn.q_proj.weight", "from": "layers.{L}.attention.wq.weight",
       "rows": "(heads half two) -> (heads two half)", "let": {"two": "2"}},
      {"hf": "lm_head.weight", "from": "output.weight", "when": "!tie_word_embeddings"}
    ],
    "drop": ["freqs_cis"]
  })MAP";
  auto m = format::parse_model_map(text, "doc");
  ASSERT_TRUE(m) << m.error().message;
  EXPECT_EQ(m->name, "torchtitan-llama3");
  EXPECT_EQ(m->prefixes, std::vector<std::string>{"model."});
  EXPECT_EQ(m->axes.size(), 4u);
  EXPECT_EQ(m->detect.all.size(), 2u);
  EXPECT_EQ(m->detect.none.size(), 1u);
  ASSERT_EQ(m->rules.size(), 3u);
  EXPECT_EQ(m->rules[1].number, 2u);
  ASSERT_EQ(m->rules[1].parts.size(), 1u);
  const auto& rows = *m->rules[1].parts[0].rows;
  EXPECT_EQ(rows.names, (std::vector<std::string>{"heads", "half", "two"}));
  ASSERT_EQ(rows.lhs.size(), 1u);
  ASSERT_EQ(rows.rhs.size(), 1u);
  ASSERT_EQ(rows.rhs[0].size(), 3u);
  EXPECT_EQ(rows.rhs[0][0].axis, 0u);
  EXPECT_EQ(rows.rhs[0][1].axis, 2u);
  EXPECT_EQ(rows.rhs[0][2].axis, 1u);
  EXPECT_EQ(m->rules[2].when, "tie_word_embeddings");
  EXPECT_TRUE(m->rules[2].when_not);
  EXPECT_EQ(m->drop.size(), 1u);
}

TEST(MapParse, UnknownKeysAreRefusedByName) {
  expect_refused(map_with(json::array({{{"hf", "a"}, {"from", "b"}}}), {{"bogus", 1}}),
                 {"unknown key", "bogus"});
  expect_refused(one_rule({{"hf", "a"}, {"from", "b"}, {"hf_name", "c"}}),
                 {"rule 1", "unknown key", "hf_name"});
  expect_refused(
      one_rule({{"hf", "a"}, {"concat", json::array({{{"from", "b"}, {"slice", "x"}}})}}),
      {"part 1", "unknown key", "slice"});
  expect_refused(map_with(json::array({{{"hf", "a"}, {"from", "b"}}}),
                          {{"detect", {{"every", json::array({"x"})}}}}),
                 {"detect", "unknown key", "every"});
  // Keys are case-sensitive: "Tensors" is not "tensors".
  expect_refused(R"({"ckptfs_map": 1, "name": "t", "Tensors": []})", {"unknown key", "Tensors"});
}

TEST(MapParse, SplitLastAndRefuse) {
  const json ok = one_rule({{"hf", "a"}, {"from", "b"}, {"split_last", {"c", 2}}},
                           {{"refuse", {{{"from", "x.*"}, {"why", "a reason"}}}}});
  auto m = format::parse_model_map(ok.dump(), "t.json");
  ASSERT_TRUE(m) << m.error().message;
  ASSERT_TRUE(m->rules[0].split_last);
  EXPECT_EQ(m->rules[0].split_last->size(), 2u);
  ASSERT_EQ(m->refuse.size(), 1u);
  EXPECT_EQ(m->refuse[0].why, "a reason");
  expect_refused(one_rule({{"hf", "a"}, {"from", "b"}, {"split_last", json::array()}}),
                 {"'split_last'", "1 to 16"});
  expect_refused(one_rule({{"hf", "a"}, {"from", "b"}, {"split_last", "c"}}), {"'split_last'"});
  expect_refused(one_rule({{"hf", "a"}, {"from", "b"}, {"split_last", {"c +"}}}),
                 {"rule 1 ('a')", "'split_last'"});
  expect_refused(
      one_rule({{"hf", "a"}, {"from", "b"}, {"split_last", json(std::vector<int>(17, 1))}}),
      {"1 to 16"});
  expect_refused(one_rule({{"hf", "a"}, {"from", "b"}}, {{"refuse", "x"}}), {"'refuse'"});
  expect_refused(one_rule({{"hf", "a"}, {"from", "b"}}, {{"refuse", {"x"}}}),
                 {"refuse 1", "not an object"});
  expect_refused(one_rule({{"hf", "a"}, {"from", "b"}}, {{"refuse", {{{"from", "x"}}}}}),
                 {"refuse 1", "'from' and 'why'"});
  expect_refused(one_rule({{"hf", "a"}, {"from", "b"}},
                          {{"refuse", {{{"from", "x"}, {"why", "y"}, {"z", 1}}}}}),
                 {"refuse 1", "unknown key 'z'"});
  expect_refused(
      one_rule({{"hf", "a"}, {"from", "b"}}, {{"refuse", {{{"from", "x.{0}"}, {"why", "y"}}}}}),
      {"refuse 1"});
  expect_refused(one_rule({{"hf", "a"}, {"from", "b"}},
                          {{"refuse", {{{"from", "x"}, {"why", "two\nlines"}}}}}),
                 {"refuse 1", "one line"});
  expect_refused(one_rule({{"hf", "a"}, {"from", "b"}},
                          {{"refuse", {{{"from", "x"}, {"why", std::string(513, 'w')}}}}}),
                 {"refuse 1", "one line of 1 to 512"});
}

TEST(MapParse, ArithmeticOnTheBytesIsRefusedByName) {
  for (const char* word : {"transpose", "permute", "sum", "add", "mean", "scale", "mul", "cast",
                           "dtype", "reshape", "view"}) {
    SCOPED_TRACE(word);
    // In the 4th rule: the message numbers it and quotes its HF name. A rule's `transpose`
    // swaps the last two axes ([-2, -1]); every other permutation is refused for what it needs.
    json rules = json::array();
    for (int i = 0; i < 3; ++i) rules.push_back({{"hf", fmt::format("x{}", i)}, {"from", "y"}});
    rules.push_back({{"hf", "lm_head.weight"}, {"from", "output.weight"}, {word, true}});
    if (std::string_view(word) == "transpose") {
      expect_refused(map_with(rules), {"rule 4", "'transpose' is true", "only [-2, -1]",
                                       "needs arithmetic on the bytes"});
    } else {
      expect_refused(
          map_with(rules),
          {"rule 4", fmt::format("'{}' needs arithmetic on the bytes", word), "zero-copy"});
    }
    // In a concat part, and at the top level.
    expect_refused(
        one_rule({{"hf", "a"}, {"concat", json::array({{{"from", "b"}, {word, "0 1"}}})}}),
        {"part 1", fmt::format("'{}' needs arithmetic", word)});
    expect_refused(map_with(json::array({{{"hf", "a"}, {"from", "b"}}}), {{word, 1}}),
                   {fmt::format("'{}' needs arithmetic", word)});
  }
}

// docs/maps.md's messages: the rule by number and HF name, the key as written.
TEST(MapParse, MessagesQuoteTheRuleAndTheKeyAsWritten) {
  json rules = json::array();
  for (int i = 0; i < 3; ++i) rules.push_back({{"hf", fmt::format("x{}", i)}, {"from", "y"}});
  rules.push_back({{"hf", "lm_head.weight"}, {"from", "output.weight"}, {"permute", true}});
  EXPECT_EQ(refusal(map_with(rules)),
            "test.json: rule 4 ('lm_head.weight'): 'permute' needs arithmetic on the bytes; a "
            "zero-copy map cannot do it");
  expect_refused(one_rule({{"hf", "a"}, {"from", "b"}, {"hf_name", "c"}}),
                 {"rule 1 ('a'): unknown key 'hf_name'"});
  expect_refused(
      one_rule({{"hf", "a"}, {"concat", json::array({{{"from", "b"}, {"slice", "x"}}})}}),
      {"rule 1 ('a') part 1: unknown key 'slice'"});
  expect_refused(one_rule({{"hf", "q"}, {"from", "w"}, {"rows", "a -> b"}}),
                 {"rule 1 ('q'): rows"});
}

TEST(MapParse, StrictJson) {
  expect_refused(
      R"({"ckptfs_map": 1, "ckptfs_map": 1, "name": "t", "tensors": [{"hf": "a", "from": "b"}]})",
      {"ckptfs_map"});
  expect_refused(
      R"({"ckptfs_map": 1, "name": "t", "tensors": [{"hf": "a", "hf": "c", "from": "b"}]})",
      {"hf"});
  expect_refused(R"({"ckptfs_map": 1, "name": "t", "tensors": [{"hf": "a", "from": "b"}]} x)", {});
  expect_refused(R"({"ckptfs_map": 1, "name": "t", "tensors": [{"hf": "a", "from": "b"}])", {});
  expect_refused(R"([{"ckptfs_map": 1}])", {"JSON object"});
  expect_refused("", {});
  expect_refused("null", {});
  // Capped: more than 1 MiB, and nested deeper than 32.
  std::string big =
      map_with(json::array({{{"hf", "a"}, {"from", "b"}}}), {{"about", std::string(10, 'x')}})
          .dump();
  big.insert(1, std::string(format::kMaxMapBytes, ' '));
  expect_refused(big, {"at most"});
  std::string deep = std::string(40, '[') + std::string(40, ']');
  expect_refused(
      fmt::format(
          R"({{"ckptfs_map": 1, "name": "t", "tensors": [{{"hf": "a", "from": "b"}}], "about": {}}})",
          deep),
      {});
}

TEST(MapParse, TheVersionMustBeOne) {
  const json rules = json::array({{{"hf", "a"}, {"from", "b"}}});
  for (const json& v :
       {json(2), json(0), json("1"), json(true), json(1.0), json(-1), json(nullptr)}) {
    json m = map_with(rules);
    m["ckptfs_map"] = v;
    expect_refused(m, {"'ckptfs_map' must be 1"});
  }
  json m = map_with(rules);
  m.erase("ckptfs_map");
  expect_refused(m, {"'ckptfs_map' must be 1"});
}

TEST(MapParse, Names) {
  const json rules = json::array({{{"hf", "a"}, {"from", "b"}}});
  for (const json& n :
       {json(""), json("Upper"), json("a b"), json(std::string(65, 'a')), json("x/y"), json(3)}) {
    json m = map_with(rules);
    m["name"] = n;
    expect_refused(m, {"name"});
  }
  json m = map_with(rules);
  m["name"] = std::string(64, 'a');
  EXPECT_EQ(refusal(m), "");
  m["name"] = "my-map_1.2";
  EXPECT_EQ(refusal(m), "");
  m.erase("name");
  expect_refused(m, {"no 'name'"});
}

TEST(MapParse, TensorsAreOneTo4096Rules) {
  expect_refused(map_with(json::array()), {"'tensors' must be a list of 1 to 4096 rules"});
  expect_refused(map_with(json::object()), {"'tensors' must be a list"});
  json m = map_with(json::array());
  m.erase("tensors");
  expect_refused(m, {"'tensors' must be a list"});
  json rules = json::array();
  for (int i = 0; i < 4096; ++i) rules.push_back({{"hf", fmt::format("a{}", i)}, {"from", "b"}});
  EXPECT_EQ(refusal(map_with(rules)), "");
  rules.push_back({{"hf", "z"}, {"from", "b"}});
  expect_refused(map_with(rules), {"1 to 4096 rules"});
  expect_refused(map_with(json::array({"a"})), {"rule 1", "not an object"});
}

TEST(MapParse, BadPatterns) {
  struct Case {
    std::string pattern;
    std::string_view needle;
  };
  const Case cases[] = {
      {"", "empty name pattern"},
      {"a.{L", "without"},
      {"a.}L", "without"},
      {"a.{1L}", "is not a name"},
      {"a.{}", "is not a name"},
      {"a.{L-1}", "is not a name"},
      {"a.{L}{M}", "follows another capture"},
      {"a.{L}.b.{L}", "twice"},
      {"a.{L}0", "digit right after a capture"},
      {"a.*", "'*' is allowed only in drop"},
      {std::string(513, 'a'), "name pattern of 513 characters"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.pattern);
    expect_refused(one_rule({{"hf", c.pattern}, {"from", "x"}}), {"rule 1", "'hf'", c.needle});
    expect_refused(one_rule({{"hf", "y"}, {"from", c.pattern}}), {"rule 1", "'from'", c.needle});
  }
  // Stars only in drop and detect, one at a time.
  const json ok = json::array({{{"hf", "a"}, {"from", "b"}}});
  EXPECT_EQ(refusal(map_with(ok, {{"drop", json::array({"junk.*", "*._extra_state*"})}})), "");
  expect_refused(map_with(ok, {{"drop", json::array({"junk.**"})}}), {"drop", "'*' follows"});
  expect_refused(map_with(ok, {{"drop", json::array({"a.{L}*"})}}), {"drop", "follows a capture"});
  expect_refused(map_with(ok, {{"drop", json::array({"{L"})}}), {"drop"});
  expect_refused(map_with(ok, {{"drop", "junk.*"}}), {"drop", "not a list"});
  expect_refused(map_with(ok, {{"drop", json::array({1})}}), {"drop", "not a string"});
  expect_refused(map_with(ok, {{"detect", {{"all", json::array({"a.{L"})}}}}), {"detect"});
  expect_refused(map_with(ok, {{"detect", {{"format", 1}}}}), {"detect", "format"});
  expect_refused(map_with(ok, {{"detect", "x"}}), {"'detect' is not an object"});
}

TEST(MapParse, Captures) {
  expect_refused(one_rule({{"hf", "a"}, {"from", "layers.{L}.w"}}),
                 {"rule 1", "capture '{L}' of 'from' is not in 'hf'"});
  expect_refused(one_rule({{"hf", "a.{L}"}, {"from", "w"}}),
                 {"rule 1", "capture '{L}' of 'hf' is bound by neither"});
  expect_refused(one_rule({{"hf", "a"}, {"from", "w"}, {"for", {{"E", 4}}}}),
                 {"'for' capture 'E' is not in 'hf'"});
  expect_refused(one_rule({{"hf", "a.{L}"}, {"from", "layers.{L}.w"}, {"for", {{"L", 4}}}}),
                 {"capture 'L' is both matched and in 'for'"});
  expect_refused(one_rule({{"hf", "a.{L}.{E}"},
                           {"concat", json::array({{{"from", "x.{L}"}}, {{"from", "y.{E}"}}})}}),
                 {"capture '{E}'"});
  expect_refused(
      one_rule({{"hf", "a.{L}"}, {"concat", json::array({{{"from", "x"}}, {{"from", "y.{L}"}}})}}),
      {"capture '{L}'"});
  // Captures bound by matching and by `for` together.
  EXPECT_EQ(refusal(one_rule({{"hf", "a.{L}.{E}"},
                              {"from", "layers.{L}.w"},
                              {"for", {{"E", "experts"}}},
                              {"index", json::array({"E"})}})),
            "");
}

TEST(MapParse, BadRows) {
  struct Case {
    std::string rows;
    std::string_view needle;
  };
  const Case cases[] = {
      {"a b", "exactly one '->'"},
      {"a -> b -> c", "exactly one '->'"},
      {"(a b) -> a", "axis 'b' appears 0 times after '->'"},
      {"(a b) -> (a b a)", "axis 'a' appears 2 times after '->'"},
      {"(a b) -> a[0:1] a[1:2] b", "axis 'a' appears 2 times"},
      {"(a a) -> a", "axis 'a' twice before '->'"},
      {"a -> b", "axis 'b' after '->' is not before it"},
      {"() -> a", "empty group"},
      {"a -> ()", "empty group"},
      {"(a -> a", "expected an axis name"},
      {"a -> a[1]", "slice '[1]' is not 'lo:hi'"},
      {"a -> a[1:2:3]", "is not 'lo:hi'"},
      {"a -> a[1:2", "'[' without ']'"},
      {"a -> a[:2]", "expected a number"},
      {"a -> a[0:$]", "unexpected '$'"},
      {"2a -> 2a", "expected an axis name"},
      {"a# -> a", "expected an axis name"},
      {"-> a", "axis 'a' after '->' is not before it"},
      {"a ->", "axis 'a' appears 0 times"},
      {"(a0 a1 a2 a3 a4 a5 a6 a7 a8 a9 a10 a11 a12 a13 a14 a15 a16) -> "
       "(a0 a1 a2 a3 a4 a5 a6 a7 a8 a9 a10 a11 a12 a13 a14 a15 a16)",
       "more than 16 axes"},
      {"a -> a[" + std::string(600, '1') + ":2]", "characters"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.rows);
    expect_refused(one_rule({{"hf", "q"}, {"from", "w"}, {"rows", c.rows}}), {"rule 1", c.needle});
    // The same inside a concat part.
    expect_refused(
        one_rule({{"hf", "q"}, {"concat", json::array({{{"from", "w"}, {"rows", c.rows}}})}}),
        {"part 1", c.needle});
  }
  expect_refused(one_rule({{"hf", "q"}, {"from", "w"}, {"rows", 3}}), {"'rows'", "not a string"});
  // 16 names are fine, and so are the documented forms.
  EXPECT_EQ(refusal(one_rule({{"hf", "q"},
                              {"from", "w"},
                              {"rows",
                               "(a0 a1 a2 a3 a4 a5 a6 a7) (a8 a9 a10 a11 a12 a13 a14 a15) -> "
                               "(a15 a14 a13 a12 a11 a10 a9 a8 a7 a6 a5 a4 a3 a2 a1 a0)"}})),
            "");
  for (const char* ok :
       {"(heads half two) -> (heads two half)", "(groups part) -> (groups part[0:q])",
        "(groups part) -> (groups part[q:q+head_dim])", "(two f) -> (two[0:1] f)",
        "v -> v[0:vocab_size]", "a->a", "  (a)   b  ->  b (a)  "}) {
    EXPECT_EQ(refusal(one_rule({{"hf", "q"}, {"from", "w"}, {"rows", ok}})), "") << ok;
  }
}

TEST(MapParse, BadExpressions) {
  struct Case {
    std::string expr;
    std::string_view needle;
  };
  const Case cases[] = {
      {"", "expected a number"},
      {"2 +", "expected a number"},
      {"(2", "expected ')'"},
      {"2)", "unexpected ')'"},
      {"2 $ 3", "unexpected '$'"},
      {"1 2", "unexpected '2'"},
      {"a.", "ends with '.'"},
      {"-1", "unexpected '-'"},
      {"2 ||3", "unexpected '|'"},
      {std::string(33, '(') + "1" + std::string(33, ')'), "nested deeper than 32"},
      {std::string(257, '1'), "expression of 257 characters"},
      {"99999999999999999999", "number too large"},
      {"4611686018427387905", "number too large"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.expr);
    expect_refused(one_rule({{"hf", "q"}, {"from", "w"}, {"let", {{"x", c.expr}}}}),
                   {"rule 1", "'x'", c.needle});
    expect_refused(
        map_with(json::array({{{"hf", "q"}, {"from", "w"}}}), {{"axes", {{"n", c.expr}}}}),
        {"'n'", c.needle});
    expect_refused(one_rule({{"hf", "q"}, {"from", "w"}, {"shape", json::array({c.expr})}}),
                   {"'shape'", c.needle});
    expect_refused(one_rule({{"hf", "q"}, {"from", "w"}, {"index", json::array({c.expr})}}),
                   {"'index'", c.needle});
  }
  // 64 names are fine, 65 are not.
  std::string names64, names65;
  for (int i = 0; i < 64; ++i) names64 += fmt::format("{}n{}", i ? "+" : "", i);
  names65 = names64 + "+n64";
  EXPECT_EQ(refusal(one_rule({{"hf", "q"}, {"from", "w"}, {"let", {{"x", names64}}}})), "");
  expect_refused(one_rule({{"hf", "q"}, {"from", "w"}, {"let", {{"x", names65}}}}),
                 {"more than 64 names"});
  // 32 levels of parentheses are fine; 2^62 is the largest literal.
  EXPECT_EQ(
      refusal(one_rule({{"hf", "q"},
                        {"from", "w"},
                        {"let", {{"x", std::string(32, '(') + "1" + std::string(32, ')')}}}})),
      "");
  EXPECT_EQ(
      refusal(one_rule({{"hf", "q"}, {"from", "w"}, {"let", {{"x", "4611686018427387904"}}}})), "");
  // Values of the wrong JSON type, and names that are not names.
  for (const json& v : {json(true), json(-1), json(1.5), json(nullptr), json::array({1})}) {
    expect_refused(one_rule({{"hf", "q"}, {"from", "w"}, {"let", {{"x", v}}}}),
                   {"'x'", "not an expression"});
  }
  expect_refused(one_rule({{"hf", "q"}, {"from", "w"}, {"let", {{"2x", "1"}}}}),
                 {"'2x' is not a name"});
  expect_refused(one_rule({{"hf", "q"}, {"from", "w"}, {"let", {{"a.b", "1"}}}}),
                 {"'a.b' is not a name"});
  expect_refused(one_rule({{"hf", "q"}, {"from", "w"}, {"let", "x"}}), {"'let'", "not an object"});
  json many = json::object();
  for (int i = 0; i < 65; ++i) many[fmt::format("n{}", i)] = 1;
  expect_refused(one_rule({{"hf", "q"}, {"from", "w"}, {"let", many}}), {"65 names"});
}

// The expressions' arithmetic, through eval_expr on a parsed map's axes.
TEST(MapParse, ExpressionValues) {
  auto eval = [](const std::string& text,
                 std::map<std::string, uint64_t> env = {}) -> Result<uint64_t> {
    auto m = format::parse_model_map(
        map_with(json::array({{{"hf", "q"}, {"from", "w"}}}), {{"axes", {{"x", text}}}}).dump(),
        "t");
    if (!m) return std::move(m).error();
    return format::eval_expr(m->axes[0].second, [&](std::string_view n) -> std::optional<uint64_t> {
      auto it = env.find(std::string(n));
      if (it == env.end()) return std::nullopt;
      return it->second;
    });
  };
  EXPECT_EQ(*eval("2 + 3 * 4"), 14u);
  EXPECT_EQ(*eval("(2 + 3) * 4"), 20u);
  EXPECT_EQ(*eval("12 / 2 / 3"), 2u);
  EXPECT_EQ(*eval("10 - 2 - 3"), 5u);
  EXPECT_EQ(*eval("2*3+4*5"), 26u);
  EXPECT_EQ(*eval("hidden / heads", {{"hidden", 64}, {"heads", 4}}), 16u);
  EXPECT_EQ(*eval("head_dim | hidden / heads", {{"hidden", 64}, {"heads", 4}}), 16u);
  EXPECT_EQ(*eval("head_dim | hidden / heads", {{"head_dim", 8}, {"hidden", 64}, {"heads", 4}}),
            8u);
  EXPECT_EQ(*eval("text_config.hidden_size", {{"text_config.hidden_size", 7}}), 7u);
  EXPECT_EQ(*eval("4611686018427387904"), uint64_t{1} << 62);
  auto fails = [&](const std::string& text, std::string_view needle, int code,
                   std::map<std::string, uint64_t> env = {}) {
    auto r = eval(text, std::move(env));
    ASSERT_FALSE(r) << text << " = " << *r;
    EXPECT_EQ(r.error().code, code) << text;
    EXPECT_NE(r.error().message.find(needle), std::string::npos) << r.error().message;
    EXPECT_NE(r.error().message.find(text), std::string::npos) << r.error().message;
  };
  fails("4611686018427387904 * 2", "overflows", EOVERFLOW);
  fails("4611686018427387904 + 1", "overflows", EOVERFLOW);
  fails("2147483648 * 2147483648 * 2", "overflows", EOVERFLOW);
  fails("big * big", "overflows", EOVERFLOW, {{"big", uint64_t{1} << 40}});
  fails("3 - 5", "negative", EINVAL);
  fails("7 / 2", "does not divide exactly", EINVAL);
  fails("hidden / heads", "100 / 3 does not divide exactly", EINVAL,
        {{"hidden", 100}, {"heads", 3}});
  fails("1 / 0", "does not divide exactly", EINVAL);
  fails("a | b", "no value for a, b", ENOENT);
  fails("a + 1 | b", "no value for a, b", ENOENT);
}

TEST(MapParse, BadRuleShapes) {
  expect_refused(one_rule({{"from", "w"}}), {"rule 1", "no 'hf'"});
  expect_refused(one_rule({{"hf", 1}, {"from", "w"}}), {"rule 1", "'hf'", "not a string"});
  expect_refused(one_rule({{"hf", "q"}}), {"rule 1", "exactly one of 'from' and 'concat'"});
  expect_refused(one_rule({{"hf", "q"}, {"from", "w"}, {"concat", json::array({{{"from", "w"}}})}}),
                 {"exactly one of 'from' and 'concat'"});
  expect_refused(one_rule({{"hf", "q"}, {"from", 1}}), {"'from'", "not a string"});
  expect_refused(
      one_rule({{"hf", "q"}, {"concat", json::array({{{"from", "w"}}})}, {"rows", "a -> a"}}),
      {"'index' and 'rows' belong in each 'concat' part"});
  expect_refused(
      one_rule({{"hf", "q"}, {"concat", json::array({{{"from", "w"}}})}, {"index", {0}}}),
      {"belong in each 'concat' part"});
  expect_refused(one_rule({{"hf", "q"}, {"concat", json::array()}}),
                 {"not a list of 1 to 64 parts"});
  expect_refused(one_rule({{"hf", "q"}, {"concat", "w"}}), {"not a list of 1 to 64 parts"});
  json parts = json::array();
  for (int i = 0; i < 65; ++i) parts.push_back({{"from", fmt::format("w{}", i)}});
  expect_refused(one_rule({{"hf", "q"}, {"concat", parts}}), {"not a list of 1 to 64 parts"});
  parts.erase(parts.size() - 1);
  EXPECT_EQ(refusal(one_rule({{"hf", "q"}, {"concat", parts}})), "");
  expect_refused(one_rule({{"hf", "q"}, {"concat", json::array({"w"})}}),
                 {"part 1", "not an object"});
  expect_refused(
      one_rule({{"hf", "q"}, {"concat", json::array({{{"from", "w"}}, {{"index", {0}}}})}}),
      {"part 2", "no 'from'"});
  for (const json& w : {json(""), json("!"), json("1x"), json("a b"), json("!!x"), json(true),
                        json(std::string(129, 'a'))}) {
    expect_refused(one_rule({{"hf", "q"}, {"from", "w"}, {"when", w}}), {"'when'"});
  }
  EXPECT_EQ(refusal(one_rule({{"hf", "q"}, {"from", "w"}, {"when", "text_config.tie"}})), "");
  expect_refused(one_rule({{"hf", "q"}, {"from", "w"}, {"optional", 1}}),
                 {"'optional' is not true, false or \"absent\""});
  expect_refused(one_rule({{"hf", "q"}, {"from", "w"}, {"optional", "maybe"}}),
                 {"'optional' is not true, false"});
  EXPECT_EQ(refusal(one_rule({{"hf", "q"}, {"from", "w"}, {"optional", "absent"}})), "");
  expect_refused(one_rule({{"hf", "q"}, {"from", "w"}, {"shape", "n"}}), {"'shape'", "not a list"});
  expect_refused(one_rule({{"hf", "q"}, {"from", "w"}, {"shape", json(std::vector<int>(17, 1))}}),
                 {"'shape'", "at most 16"});
  expect_refused(one_rule({{"hf", "q"}, {"from", "w"}, {"index", "L"}}), {"'index'", "not a list"});
  expect_refused(one_rule({{"hf", "q"}, {"from", "w"}, {"index", json(std::vector<int>(17, 0))}}),
                 {"'index'", "at most 16"});
  expect_refused(one_rule({{"hf", "q"}, {"from", "w"}, {"for", {{"L", "x +"}}}}), {"'L'"});
  // The map-level keys.
  const json ok = json::array({{{"hf", "a"}, {"from", "b"}}});
  expect_refused(map_with(ok, {{"prefixes", "model."}}), {"'prefixes'"});
  expect_refused(map_with(ok, {{"prefixes", json::array({""})}}), {"'prefixes'"});
  expect_refused(map_with(ok, {{"prefixes", json::array({1})}}), {"'prefixes'"});
  expect_refused(map_with(ok, {{"prefixes", json(std::vector<std::string>(17, "m."))}}),
                 {"'prefixes'"});
  expect_refused(map_with(ok, {{"prefixes", json::array({std::string(129, 'm')})}}),
                 {"'prefixes'"});
  expect_refused(map_with(ok, {{"about", std::string(513, 'a')}}), {"'about'"});
  expect_refused(map_with(ok, {{"about", 1}}), {"'about'"});
  expect_refused(map_with(ok, {{"axes", json::array()}}), {"'axes'", "not an object"});
}

TEST(MapParse, RulesAreNumberedFromOne) {
  json rules = json::array();
  rules.push_back({{"hf", "a"}, {"from", "b"}});
  rules.push_back({{"hf", "c"}, {"from", "d"}});
  rules.push_back({{"hf", "e.weight"}, {"from", "f"}, {"rows", "a -> b"}});
  expect_refused(map_with(rules), {"rule 3", "e.weight"});
}

TEST(MapParse, Patterns) {
  auto pat = [](const std::string& p) {
    auto m =
        map_of(map_with(json::array({{{"hf", "h"}, {"from", "w"}}}), {{"drop", json::array({p})}}));
    return m->drop[0];
  };
  auto match = [&](const std::string& p, std::string_view name) {
    return format::match_pattern(pat(p), name);
  };
  EXPECT_EQ(*match("layers.{L}.w", "layers.0.w"), std::vector<uint64_t>{0});
  EXPECT_EQ(*match("layers.{L}.w", "layers.17.w"), std::vector<uint64_t>{17});
  EXPECT_EQ(*match("l.{L}.e.{E}", "l.3.e.12"), (std::vector<uint64_t>{3, 12}));
  EXPECT_FALSE(match("layers.{L}.w", "layers.01.w"));  // no leading zero
  EXPECT_FALSE(match("layers.{L}.w", "layers.-1.w"));  // no sign
  EXPECT_FALSE(match("layers.{L}.w", "layers..w"));    // not empty
  EXPECT_FALSE(match("layers.{L}.w", "layers.1x.w"));
  EXPECT_FALSE(match("layers.{L}.w", "layers.1.w.x"));  // whole names only
  EXPECT_FALSE(match("layers.{L}.w", "xlayers.1.w"));
  EXPECT_FALSE(match("layers.{L}", "layers.99999999999"));  // at most 10 digits
  EXPECT_TRUE(match("layers.{L}", "layers.9999999999"));
  EXPECT_TRUE(match("junk.*", "junk."));
  EXPECT_TRUE(match("junk.*", "junk.a.b.c"));
  EXPECT_TRUE(match("*._extra_state*", "decoder.layers.mlp._extra_state/shard_0_2"));
  EXPECT_FALSE(match("*._extra_state*", "decoder.layers.mlp.weight"));
  EXPECT_TRUE(match("a*b*c", "aXXbYYbZZc"));
  EXPECT_FALSE(match("a*b*c", "aXXbYYbZZ"));
  EXPECT_TRUE(match("l.{L}.*", "l.3.anything"));
  EXPECT_FALSE(match("l.{L}.*", "l.03.anything"));
  // A star pattern over a long name stays quick (no exponential backtracking).
  const std::string longname(4000, 'a');
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_FALSE(match("*a*a*a*a*a*a*a*a*a*a*b", longname));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2));
  // expand_pattern substitutes captures.
  auto m = map_of(one_rule({{"hf", "model.layers.{L}.experts.{E}.w"},
                            {"from", "l.{L}.w"},
                            {"for", {{"E", 2}}},
                            {"index", json::array({"E"})}}));
  EXPECT_EQ(format::expand_pattern(m->rules[0].hf, {{"L", 3}, {"E", 10}}),
            "model.layers.3.experts.10.w");
}

// =========================================================================================
// Built-in maps
// =========================================================================================

std::filesystem::path maps_dir() {
  if (const char* d = std::getenv("CKPTFS_MAPS_DIR")) return d;
  for (std::filesystem::path p = std::filesystem::current_path(); !p.empty(); p = p.parent_path()) {
    if (std::filesystem::exists(p / "maps" / "meson.build")) return p / "maps";
    if (p == p.parent_path()) break;
  }
  return {};
}

TEST(MapBuiltins, EveryMapFileIsBuiltInAndParses) {
  const auto dir = maps_dir();
  ASSERT_FALSE(dir.empty()) << "set CKPTFS_MAPS_DIR or run from the repository";
  std::set<std::string> stems;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.path().extension() != ".json") continue;
    stems.insert(e.path().stem().string());
    std::ifstream f(e.path());
    std::stringstream s;
    s << f.rdbuf();
    auto m = format::parse_model_map(s.str(), e.path().string());
    EXPECT_TRUE(m) << m.error().message;
    if (m) {
      EXPECT_EQ(m->name, e.path().stem().string()) << "a map's name is its file's";
      EXPECT_FALSE(m->detect.empty()) << m->name << ": a built-in needs a detect clause";
    }
  }
  EXPECT_FALSE(stems.empty());
  const auto& b = format::builtin_maps();
  EXPECT_EQ(b.size(), stems.size()) << "maps/*.json not all in maps/meson.build, or one failed";
  std::set<std::string> names;
  for (const auto& m : b) {
    names.insert(m->name);
    EXPECT_EQ(m->origin, "built-in");
    EXPECT_EQ(format::find_builtin_map(m->name), m);
  }
  EXPECT_EQ(names, stems);
  EXPECT_EQ(format::find_builtin_map("no-such-map"), nullptr);
  // maps/meson.build lists every file once (the list is the detection order).
  std::ifstream f(dir / "meson.build");
  std::stringstream s;
  s << f.rdbuf();
  for (const auto& n : stems) {
    const auto q = "'" + n + ".json'";
    const auto at = s.str().find(q);
    EXPECT_NE(at, std::string::npos) << n;
    EXPECT_EQ(s.str().find(q, at + 1), std::string::npos) << n << " listed twice";
  }
}

// A tiny torchtitan Llama 3: 2 layers, 4 heads of 4 (2 kv heads), hidden 16, ffn 24, vocab 11.
std::vector<Stored> titan_llama(bool with_head, DType dt = DType::BF16) {
  std::vector<Stored> s = {st("tok_embeddings.weight", {11, 16}, dt), st("norm.weight", {16}, dt)};
  for (int l = 0; l < 2; ++l) {
    const auto p = fmt::format("layers.{}.", l);
    s.push_back(st(p + "attention.qkv_linear.wq.weight", {16, 16}, dt));
    s.push_back(st(p + "attention.qkv_linear.wk.weight", {8, 16}, dt));
    s.push_back(st(p + "attention.qkv_linear.wv.weight", {8, 16}, dt));
    s.push_back(st(p + "attention.wo.weight", {16, 16}, dt));
    s.push_back(st(p + "feed_forward.w1.weight", {24, 16}, dt));
    s.push_back(st(p + "feed_forward.w3.weight", {24, 16}, dt));
    s.push_back(st(p + "feed_forward.w2.weight", {16, 24}, dt));
    s.push_back(st(p + "attention_norm.weight", {16}, dt));
    s.push_back(st(p + "ffn_norm.weight", {16}, dt));
  }
  if (with_head) s.push_back(st("lm_head.weight", {11, 16}, dt));
  return s;
}

json titan_llama_config(bool tied) {
  return {{"hidden_size", 16},          {"num_attention_heads", 4}, {"num_key_value_heads", 2},
          {"intermediate_size", 24},    {"vocab_size", 11},         {"num_hidden_layers", 2},
          {"tie_word_embeddings", tied}};
}

// HF's q_proj row order from torchtitan's: (heads half two) -> (heads two half).
std::vector<uint64_t> rope_rows(uint64_t heads, uint64_t hd) {
  std::vector<uint64_t> r;
  const uint64_t half = hd / 2;
  for (uint64_t h = 0; h < heads; ++h) {
    for (uint64_t t = 0; t < 2; ++t) {
      for (uint64_t j = 0; j < half; ++j) r.push_back(h * hd + j * 2 + t);
    }
  }
  return r;
}

TEST(MapBuiltins, TorchtitanLlamaIsDetectedAndPermutedBackToHfRopeOrder) {
  for (bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    auto stored = titan_llama(true);
    for (const auto& m : format::builtin_maps()) {
      std::vector<layout::Tensor> ts;
      for (const auto& s : stored) {
        layout::Tensor t;
        t.name = s.name;
        ts.push_back(std::move(t));
      }
      EXPECT_EQ(layout::map_detects(*m, ts, "torch DCP (.metadata, *.distcp)"),
                m->name == "torchtitan-llama3")
          << m->name;
    }
    std::mt19937_64 rng(3);
    layout::BuildOptions opts;
    opts.hf_config = titan_llama_config(tied).dump();  // detected, not named
    auto v = build_view(stored, opts, rng, 3);
    ASSERT_TRUE(v.ck->valid()) << problems(*v.ck);
    EXPECT_EQ(v.ck->map, "torchtitan-llama3");
    EXPECT_EQ(v.ck->stored.size(), stored.size());
    EXPECT_EQ(v.ck->tensors.size(), stored.size() - (tied ? 1 : 0));
    EXPECT_EQ(v.ck->tensors[0].name, "model.embed_tokens.weight");
    EXPECT_EQ(find_tensor(*v.ck, "lm_head.weight") != nullptr, !tied);
    EXPECT_FALSE(v.ck->config_json.empty());  // shown as the view's config.json
    auto by = [&](std::string_view n) -> const Stored& {
      return *std::find_if(stored.begin(), stored.end(), [&](auto& s) { return s.name == n; });
    };
    for (int l = 0; l < 2; ++l) {
      const auto p = fmt::format("layers.{}.", l);
      const auto h = fmt::format("model.layers.{}.", l);
      EXPECT_EQ(tensor_bytes(v, h + "self_attn.q_proj.weight"),
                rows_of(by(p + "attention.qkv_linear.wq.weight").data, 32, rope_rows(4, 4)));
      EXPECT_EQ(tensor_bytes(v, h + "self_attn.k_proj.weight"),
                rows_of(by(p + "attention.qkv_linear.wk.weight").data, 32, rope_rows(2, 4)));
      EXPECT_EQ(tensor_bytes(v, h + "self_attn.v_proj.weight"),
                by(p + "attention.qkv_linear.wv.weight").data);
      EXPECT_EQ(tensor_bytes(v, h + "mlp.down_proj.weight"), by(p + "feed_forward.w2.weight").data);
      EXPECT_EQ(tensor_bytes(v, h + "post_attention_layernorm.weight"),
                by(p + "ffn_norm.weight").data);
      const auto* q = find_tensor(*v.ck, h + "self_attn.q_proj.weight");
      ASSERT_NE(q, nullptr);
      EXPECT_EQ(q->shape, (std::vector<uint64_t>{16, 16}));
      // 16 rows in 2 x 4 strided pairs; RunBuilder's greedy joins of contiguous rows (3 and 4)
      // cost a few more: fewer runs than rows is what matters.
      EXPECT_LE(q->runs.size(), 12u) << "the permutation compresses into strided runs";
      EXPECT_NE(q->origin.find(p + "attention.qkv_linear.wq.weight"), std::string::npos)
          << q->origin;
      EXPECT_NE(q->origin.find("rule 2"), std::string::npos) << q->origin;
    }
    // No config.json: detected, served under the stored names, with a note.
    std::mt19937_64 rng2(3);
    auto bare = build_view(stored, {}, rng2, 1);
    ASSERT_TRUE(bare.ck->valid()) << problems(*bare.ck);
    EXPECT_EQ(bare.ck->map, "");
    EXPECT_NE(bare.ck->map_note.find("torchtitan-llama3"), std::string::npos);
    EXPECT_NE(find_tensor(*bare.ck, "layers.0.attention.qkv_linear.wq.weight"), nullptr);
    // map=none: nothing applied even with a config.
    std::mt19937_64 rng3(3);
    layout::BuildOptions none;
    none.no_map = true;
    none.hf_config = titan_llama_config(tied).dump();
    auto plain = build_view(stored, none, rng3, 1);
    ASSERT_TRUE(plain.ck->valid()) << problems(*plain.ck);
    EXPECT_EQ(plain.ck->map, "");
  }
}

// The stored names of one layer of each torchtitan 0.3 family (the writer's tiny configs), as
// layout::Tensor: enough for the detect clauses.
std::vector<layout::Tensor> names_of(std::initializer_list<std::string_view> names) {
  std::vector<layout::Tensor> ts;
  for (auto n : names) {
    layout::Tensor t;
    t.name = std::string(n);
    ts.push_back(std::move(t));
  }
  return ts;
}

TEST(MapBuiltins, EachTorchtitanFamilyIsDetectedByExactlyOneBuiltIn) {
  const std::vector<std::pair<std::string, std::vector<layout::Tensor>>> families = {
      {"torchtitan-deepseek-v3",
       names_of({"tok_embeddings.weight", "layers.0.attention.wq_a.weight",
                 "layers.0.attention.q_norm.weight", "layers.0.attention.wq_b.weight",
                 "layers.0.attention.wkv_a.weight", "layers.0.attention.kv_norm.weight",
                 "layers.0.attention.wkv_b.weight", "layers.0.feed_forward.w1.weight",
                 "layers.1.moe.router.gate.weight",
                 "layers.1.moe.routed_experts.inner_experts.w1_EFD", "norm.weight"})},
      {"torchtitan-kimi-k2.7",
       names_of({"tok_embeddings.weight", "layers.0.attention.wq.weight",
                 "layers.0.attention.wkv_a.weight", "layers.0.attention.kv_norm.weight",
                 "layers.0.attention.wkv_b.weight", "layers.0.feed_forward.w1.weight",
                 "vision_encoder.patch_embed.weight", "vision_encoder.layers.0.attn.wq.weight",
                 "vision_encoder.projector.pre_norm.weight"})},
      {"torchtitan-qwen3.5",
       names_of({"tok_embeddings.weight", "layers.0.attn.in_proj_q.weight",
                 "layers.0.attn.conv_q.weight", "layers.1.attn.wq.weight",
                 "layers.1.attn.q_norm.weight", "layers.0.feed_forward.w1.weight",
                 "vision_encoder.patch_embed.weight", "vision_encoder.merger.norm.weight"})},
      {"torchtitan-gpt-oss",
       names_of({"tok_embeddings.weight", "layers.0.attention.sinks",
                 "layers.0.attention.qkv_linear.wq.weight", "layers.0.attention.qkv_linear.wq.bias",
                 "layers.0.moe.router.gate.weight",
                 "layers.0.moe.routed_experts.inner_experts.mlp1_weight_EGD"})},
  };
  for (const auto& [want, ts] : families) {
    std::vector<std::string> hits;
    for (const auto& m : format::builtin_maps()) {
      if (layout::map_detects(*m, ts, "torch DCP (.metadata, *.distcp)")) hits.push_back(m->name);
    }
    EXPECT_EQ(hits, std::vector<std::string>{want});
  }
}

TEST(MapBuiltins, GptOssIsServedWithItsExpertsTransposed) {
  std::vector<Stored> stored = {
      st("tok_embeddings.weight", {11, 8}),
      st("layers.0.attention.sinks", {4}),
      st("layers.0.moe.routed_experts.inner_experts.mlp1_weight_EGD", {2, 6, 8}),
      st("layers.0.moe.routed_experts.inner_experts.mlp1_bias_EG", {2, 6}),
      st("layers.0.moe.routed_experts.inner_experts.mlp2_weight_EDF", {2, 8, 3}),
      st("layers.0.moe.routed_experts.inner_experts.mlp2_bias_ED", {2, 8}),
      st("layers.0.attention.qkv_linear.wq.weight", {8, 8}),
      st("layers.0.attention.qkv_linear.wq.bias", {8}),
      st("layers.0.attention.qkv_linear.wk.weight", {4, 8}),
      st("layers.0.attention.qkv_linear.wk.bias", {4}),
      st("layers.0.attention.qkv_linear.wv.weight", {4, 8}),
      st("layers.0.attention.qkv_linear.wv.bias", {4}),
      st("layers.0.attention.wo.weight", {8, 8}),
      st("layers.0.attention.wo.bias", {8}),
      st("layers.0.attention_norm.weight", {8}),
      st("layers.0.ffn_norm.weight", {8}),
      st("layers.0.moe.router.gate.weight", {2, 8}),
      st("layers.0.moe.router.gate.bias", {2}),
      st("norm.weight", {8})};
  std::mt19937_64 rng(5);
  layout::BuildOptions opts;
  opts.hf_config = json({{"hidden_size", 8},
                         {"vocab_size", 11},
                         {"intermediate_size", 3},
                         {"num_local_experts", 2},
                         {"num_attention_heads", 4},
                         {"tie_word_embeddings", true}})
                       .dump();
  auto v = build_view(stored, opts, rng, 1);
  ASSERT_TRUE(v.ck->valid()) << problems(*v.ck);
  EXPECT_EQ(v.ck->map, "torchtitan-gpt-oss");
  const auto* up = find_tensor(*v.ck, "model.layers.0.mlp.experts.gate_up_proj");
  ASSERT_NE(up, nullptr);
  EXPECT_EQ(up->shape, (std::vector<uint64_t>{2, 8, 6}));
  EXPECT_EQ(tensor_bytes(v, up->name), transposed(stored[2].data, 2, 6, 8, 4));
  EXPECT_EQ(tensor_bytes(v, "model.layers.0.mlp.experts.down_proj"),
            transposed(stored[4].data, 2, 8, 3, 4));
  EXPECT_EQ(tensor_bytes(v, "model.layers.0.mlp.experts.gate_up_proj_bias"), stored[3].data);
  EXPECT_EQ(tensor_bytes(v, "model.layers.0.mlp.experts.down_proj_bias"), stored[5].data);
}

TEST(MapBuiltins, AConfigThatDisagreesNamesTheTensorAndTheAxis) {
  auto stored = titan_llama(false);
  auto config = titan_llama_config(true);
  config["num_attention_heads"] = 8;  // head size 2: wq's 16 rows are 8 x 1 x 2, wk's 8 rows...
  config["num_key_value_heads"] = 8;  // ... are fine, but v_proj's shape is 8 x 2 = 16 != 8
  std::mt19937_64 rng(1);
  layout::BuildOptions opts;
  opts.map = format::find_builtin_map("torchtitan-llama3");
  opts.hf_config = config.dump();
  opts.hf_config_what = "/cfg/config.json";
  auto bad = build_view(stored, opts, rng, 2);
  EXPECT_PROBLEM(bad, "layers.0.attention.qkv_linear.wk.weight", "axis 0", "kv_heads",
                 "/cfg/config.json");
  // vocab_size disagrees with the embedding: names the tensor, axis 0 and vocab_size.
  config = titan_llama_config(true);
  config["vocab_size"] = 12;
  opts.hf_config = config.dump();
  auto bad2 = build_view(stored, opts, rng, 2);
  EXPECT_PROBLEM(bad2, "tok_embeddings.weight", "axis 0", "vocab_size", "12");
  // A named map with no config.json anywhere refuses, saying so.
  layout::BuildOptions noconf;
  noconf.map = opts.map;
  auto bad3 = build_view(stored, noconf, rng, 2);
  EXPECT_PROBLEM(bad3, "", "needs the model's config.json", "hf_config");
  // A config that is not JSON.
  opts.hf_config = "{\"vocab_size\": ";
  auto bad4 = build_view(stored, opts, rng, 2);
  EXPECT_PROBLEM(bad4, "", "/cfg/config.json");
  // The checkpoint's own config.json is preferred to hf_config.
  opts.hf_config = config.dump();  // vocab 12: wrong
  auto own = build_view(stored, opts, rng, 2, "torch DCP (.metadata, *.distcp)",
                        titan_llama_config(true).dump());
  EXPECT_TRUE(own.ck->valid()) << problems(*own.ck);
  EXPECT_TRUE(own.ck->config_json.empty());
}

// A tiny Megatron-Core GPT: 2 stacked layers, 4 heads in 2 query groups of head size 2, hidden 8,
// ffn 6, vocabulary 10 padded to 12, untied.
TEST(MapBuiltins, MegatronQkvSplitGateUpHalvesAndVocabularyPadding) {
  const uint64_t L = 2, heads = 4, groups = 2, hd = 2, D = 8, F = 6, V = 10, Vp = 12;
  const uint64_t q = heads / groups * hd, part = q + 2 * hd;
  const DType dt = DType::F32;
  std::vector<Stored> stored = {
      st("embedding.word_embeddings.weight", {Vp, D}, dt),
      st("decoder.layers.self_attention.linear_qkv.layer_norm_weight", {L, D}, dt),
      st("decoder.layers.self_attention.linear_qkv.weight", {L, groups * part, D}, dt),
      st("decoder.layers.self_attention.linear_proj.weight", {L, D, heads * hd}, dt),
      st("decoder.layers.mlp.linear_fc1.layer_norm_weight", {L, D}, dt),
      st("decoder.layers.mlp.linear_fc1.weight", {L, 2 * F, D}, dt),
      st("decoder.layers.mlp.linear_fc2.weight", {L, D, F}, dt),
      st("decoder.final_layernorm.weight", {D}, dt),
      st("output_layer.weight", {Vp, D}, dt),
      st("decoder.layers.self_attention.core_attention._extra_state/shard_0_2", {3}, DType::U8),
  };
  json config = {{"hidden_size", D},
                 {"num_attention_heads", heads},
                 {"num_key_value_heads", groups},
                 {"intermediate_size", F},
                 {"vocab_size", V},
                 {"num_hidden_layers", L},
                 {"tie_word_embeddings", false}};
  std::mt19937_64 rng(5);
  layout::BuildOptions opts;
  opts.hf_config = config.dump();
  auto v = build_view(stored, opts, rng, 2,
                      "Megatron-Core torch_dist (.metadata, *.distcp, metadata.json)");
  ASSERT_TRUE(v.ck->valid()) << problems(*v.ck);
  EXPECT_EQ(v.ck->map, "megatron-gpt");
  const uint64_t row = D * 4;
  auto seq = [](uint64_t a, uint64_t b) {
    std::vector<uint64_t> r;
    for (uint64_t i = a; i < b; ++i) r.push_back(i);
    return r;
  };
  EXPECT_EQ(tensor_bytes(v, "model.embed_tokens.weight"), rows_of(stored[0].data, row, seq(0, V)));
  EXPECT_EQ(tensor_bytes(v, "lm_head.weight"), rows_of(stored[8].data, row, seq(0, V)));
  for (uint64_t l = 0; l < L; ++l) {
    const auto h = fmt::format("model.layers.{}.", l);
    std::vector<uint64_t> qr, kr, vr;
    for (uint64_t g = 0; g < groups; ++g) {
      for (uint64_t i = 0; i < q; ++i) qr.push_back(l * groups * part + g * part + i);
      for (uint64_t i = 0; i < hd; ++i) kr.push_back(l * groups * part + g * part + q + i);
      for (uint64_t i = 0; i < hd; ++i) vr.push_back(l * groups * part + g * part + q + hd + i);
    }
    EXPECT_EQ(tensor_bytes(v, h + "self_attn.q_proj.weight"), rows_of(stored[2].data, row, qr));
    EXPECT_EQ(tensor_bytes(v, h + "self_attn.k_proj.weight"), rows_of(stored[2].data, row, kr));
    EXPECT_EQ(tensor_bytes(v, h + "self_attn.v_proj.weight"), rows_of(stored[2].data, row, vr));
    EXPECT_EQ(tensor_bytes(v, h + "mlp.gate_proj.weight"),
              rows_of(stored[5].data, row, seq(l * 2 * F, l * 2 * F + F)));
    EXPECT_EQ(tensor_bytes(v, h + "mlp.up_proj.weight"),
              rows_of(stored[5].data, row, seq(l * 2 * F + F, (l + 1) * 2 * F)));
    EXPECT_EQ(tensor_bytes(v, h + "input_layernorm.weight"), rows_of(stored[1].data, row, {l}));
    EXPECT_EQ(tensor_bytes(v, h + "mlp.down_proj.weight"),
              stored[6].data.substr(l * D * F * 4, D * F * 4));
  }
  // The padding rows are not in the view, and the extra state was dropped.
  EXPECT_EQ(v.ck->tensors.size(), 3 + 9 * L);
  EXPECT_FALSE(v.ck->left_out.empty());
}

// =========================================================================================
// Compiling fixed maps
// =========================================================================================

TEST(MapCompile, RenamesPrefixesDropAndWhen) {
  const json map =
      map_with(json::array({{{"hf", "model.a"}, {"from", "a"}, {"shape", {"n", 3}}},
                            {{"hf", "model.b.{L}"}, {"from", "b.{L}"}},
                            {{"hf", "head"}, {"from", "out"}, {"when", "!tie"}},
                            {{"hf", "opt"}, {"from", "missing"}, {"optional", true}},
                            {{"hf", "opt.{L}"}, {"from", "c.{L}"}, {"optional", true}}}),
               {{"prefixes", {"module.", "model."}}, {"drop", {"junk.*", "rope.{L}.freqs"}}});
  std::vector<Stored> stored = {st("module.a", {4, 3}),  st("b.0", {2}),
                                st("b.5", {2}),          st("model.b.10", {2}),
                                st("out", {4, 3}),       st("junk.x.y", {1}),
                                st("rope.3.freqs", {2}), st("module.rope.4.freqs", {2})};
  for (bool tie : {true, false}) {
    auto v = compile(map, {{"n", 4}, {"tie", tie}}, stored);
    ASSERT_TRUE(v.ck->valid()) << problems(*v.ck);
    std::vector<std::string> names;
    for (const auto& t : v.ck->tensors) names.push_back(t.name);
    std::vector<std::string> want = {"model.a", "model.b.0", "model.b.5", "model.b.10"};
    if (!tie) want.push_back("head");
    EXPECT_EQ(names, want);
    EXPECT_EQ(tensor_bytes(v, "model.a"), stored[0].data);
    EXPECT_EQ(tensor_bytes(v, "model.b.10"), stored[3].data);
    EXPECT_EQ(v.ck->tensors[0].origin.find("module.a"), 0u) << v.ck->tensors[0].origin;
    ASSERT_EQ(v.ck->left_out.size(), 1u);
    EXPECT_NE(v.ck->left_out[0].find(tie ? "4 stored" : "3 stored"), std::string::npos)
        << v.ck->left_out[0];
  }
  // Optional rules making one HF tensor are alternatives: one must find a stored tensor (a
  // layer stored one by one, or stacked), unless one of them says the tensor may be absent
  // (megatron-core's expert bias). A `when` that does not hold counts as found.
  {
    const json per_layer = {{"hf", "w.{L}"}, {"from", "w.{L}"}, {"optional", true}};
    const json stacked = {{"hf", "w.{L}"},
                          {"from", "ws"},
                          {"for", {{"L", "n"}}},
                          {"index", {"L"}},
                          {"optional", true}};
    const json alternatives = map_with(json::array({per_layer, stacked}));
    auto one = compile(alternatives, {{"n", 2}}, {st("w.0", {3}), st("w.1", {3})});
    ASSERT_TRUE(one.ck->valid()) << problems(*one.ck);
    auto other = compile(alternatives, {{"n", 2}}, {st("ws", {2, 3})});
    ASSERT_TRUE(other.ck->valid()) << problems(*other.ck);
    EXPECT_EQ(other.ck->tensors.size(), 2u);
    auto none = compile(alternatives, {{"n", 2}}, {st("x", {1})});
    EXPECT_PROBLEM(none, "w.{L}", "none of the 2 rules making 'w.{L}' found a stored tensor");
    json absent = stacked;
    absent["optional"] = "absent";
    auto allowed = compile(map_with(json::array({per_layer, absent, {{"hf", "x"}, {"from", "x"}}})),
                           {{"n", 2}}, {st("x", {1})});
    ASSERT_TRUE(allowed.ck->valid()) << problems(*allowed.ck);
    EXPECT_EQ(allowed.ck->tensors.size(), 1u);
    json unless = stacked;
    unless["when"] = "stacked";
    auto skipped = compile(map_with(json::array({per_layer, unless, {{"hf", "x"}, {"from", "x"}}})),
                           {{"n", 2}}, {st("x", {1})});
    ASSERT_TRUE(skipped.ck->valid()) << problems(*skipped.ck);
  }
  // Without `optional`, a rule that reads nothing is an error naming it.
  auto v = compile(one_rule({{"hf", "opt"}, {"from", "missing"}}), json::object(), {st("x", {1})});
  EXPECT_PROBLEM(v, "missing", "rule 1 ('opt')", "no such stored tensor");
  auto vc =
      compile(one_rule({{"hf", "opt.{L}"}, {"from", "c.{L}"}}), json::object(), {st("x", {1})});
  EXPECT_PROBLEM(vc, "opt.{L}", "rule 1 ('opt.{L}')", "no stored tensor matches 'c.{L}'");
  // A `when` on an absent key does not hold.
  auto w = compile(map_with(json::array({{{"hf", "a"}, {"from", "a"}},
                                         {{"hf", "b"}, {"from", "b"}, {"when", "flag"}}})),
                   json::object(), {st("a", {1}), st("b", {1})});
  ASSERT_TRUE(w.ck->valid()) << problems(*w.ck);
  EXPECT_EQ(w.ck->tensors.size(), 1u);
}

TEST(MapCompile, ForIndexUnstacksAndMatchedCapturesSelectExperts) {
  // Megatron-like stacks [L, E, F, D] unstacked by `for` L and E; torchtitan-like grouped
  // experts [E, F, D] per matched layer, by `for` E.
  const json map = map_with(
      json::array({{{"hf", "s.{L}.e.{E}"},
                    {"from", "stack"},
                    {"for", {{"L", "layers"}, {"E", "experts"}}},
                    {"index", {"L", "E"}}},
                   {{"hf", "g.{L}.e.{E}"},
                    {"from", "layers.{L}.w1"},
                    {"for", {{"E", "experts"}}},
                    {"index", {"E"}},
                    {"shape", {"f", "d"}}},
                   {{"hf", "third"}, {"from", "stack"}, {"index", {"layers - 1", "1 + 1"}}}}));
  std::vector<Stored> stored = {st("stack", {2, 3, 4, 5}, DType::BF16),
                                st("layers.0.w1", {3, 4, 5}, DType::BF16),
                                st("layers.2.w1", {3, 4, 5}, DType::BF16)};
  const json config = {{"layers", 2}, {"experts", 3}, {"f", 4}, {"d", 5}};
  auto v = compile(map, config, stored);
  ASSERT_TRUE(v.ck->valid()) << problems(*v.ck);
  ASSERT_EQ(v.ck->tensors.size(), 6u + 6u + 1u);
  const uint64_t blk = 4 * 5 * 2;
  for (uint64_t l = 0; l < 2; ++l) {
    for (uint64_t e = 0; e < 3; ++e) {
      EXPECT_EQ(tensor_bytes(v, fmt::format("s.{}.e.{}", l, e)),
                stored[0].data.substr((l * 3 + e) * blk, blk));
    }
  }
  EXPECT_EQ(v.ck->tensors[0].name, "s.0.e.0");  // the order of two `for`s is not specified
  for (uint64_t e = 0; e < 3; ++e) {
    EXPECT_EQ(tensor_bytes(v, fmt::format("g.2.e.{}", e)), stored[2].data.substr(e * blk, blk));
  }
  EXPECT_EQ(tensor_bytes(v, "third"), stored[0].data.substr((1 * 3 + 2) * blk, blk));
  EXPECT_EQ(find_tensor(*v.ck, "third")->shape, (std::vector<uint64_t>{4, 5}));
}

TEST(MapCompile, ConcatJoinsAlongAxisZero) {
  // HF gate and up from Megatron's fused fc1, and the other way: fc1 from gate and up.
  const uint64_t F = 3, D = 4;
  const json map = map_with(json::array(
      {{{"hf", "fc1"}, {"concat", {{{"from", "w1"}}, {{"from", "w3"}}}}, {"shape", {"2 * f", "d"}}},
       {{"hf", "up_gate"},
        {"concat",
         {{{"from", "fc1"}, {"rows", "(two f) -> (two[1:2] f)"}, {"let", {{"two", 2}}}},
          {{"from", "fc1"}, {"rows", "(two f) -> (two[0:1] f)"}, {"let", {{"two", 2}}}}}}},
       {{"hf", "qkv_rows"},
        {"concat",
         {{{"from", "x"}, {"index", {1}}, {"rows", "(a b) c -> (b a) c"}, {"let", {{"a", 2}}}},
          {{"from", "y"}}}}}}));
  std::vector<Stored> stored = {st("w1", {F, D}), st("w3", {F, D}), st("fc1", {2 * F, D}),
                                st("x", {2, 6, 2, 3}), st("y", {5, 2, 3})};
  auto v = compile(map, {{"f", F}, {"d", D}}, stored);
  ASSERT_TRUE(v.ck->valid()) << problems(*v.ck);
  EXPECT_EQ(tensor_bytes(v, "fc1"), stored[0].data + stored[1].data);
  EXPECT_EQ(find_tensor(*v.ck, "fc1")->shape, (std::vector<uint64_t>{2 * F, D}));
  EXPECT_EQ(tensor_bytes(v, "up_gate"),
            stored[2].data.substr(F * D * 4) + stored[2].data.substr(0, F * D * 4));
  // x[1] is [6, 2, 3] = (a=2 b=3) rows of [2, 3]; (b a) reorders the 6 rows: 0 3 1 4 2 5.
  const std::string x1 = stored[3].data.substr(6 * 2 * 3 * 4, 6 * 2 * 3 * 4);
  EXPECT_EQ(tensor_bytes(v, "qkv_rows"),
            rows_of(x1, 2 * 3 * 4, {0, 3, 1, 4, 2, 5}) + stored[4].data);
  EXPECT_EQ(find_tensor(*v.ck, "qkv_rows")->shape, (std::vector<uint64_t>{11, 2, 3}));
  // Parts of other trailing shapes or dtypes do not join.
  auto bad = compile(one_rule({{"hf", "j"}, {"concat", {{{"from", "a"}}, {{"from", "b"}}}}}),
                     json::object(), {st("a", {2, 3}), st("b", {2, 4})});
  EXPECT_PROBLEM(bad, "b", "part 2 has shape [2, 4]", "does not join part 1's [2, 3]");
  auto bad2 = compile(one_rule({{"hf", "j"}, {"concat", {{{"from", "a"}}, {{"from", "b"}}}}}),
                      json::object(), {st("a", {2, 3}), st("b", {2, 3}, DType::BF16)});
  EXPECT_PROBLEM(bad2, "b", "concatenates BF16 with F32");
  auto bad3 = compile(one_rule({{"hf", "j"}, {"concat", {{{"from", "a"}}, {{"from", "b"}}}}}),
                      json::object(), {st("a", {}), st("b", {})});
  EXPECT_PROBLEM(bad3, "b", "does not join");
}

TEST(MapCompile, SplitLastWritesTheLastAxisAsSeveralWithTheSameBytes) {
  // A Linear's [out, C*T*P*P] patch embedding served as a Conv3d's [out, C, T, P, P], and a
  // fused bias of three 1-D parts (concat along axis 0 of 1-D tensors).
  const json map = map_with(
      json::array({{{"hf", "conv"},
                    {"from", "lin"},
                    {"split_last", {"c", "2", "p", "p"}},
                    {"shape", {"out", "c", 2, "p", "p"}}},
                   {{"hf", "qkv.bias"}, {"concat", {{{"from", "q.bias"}}, {{"from", "k.bias"}}}}},
                   {{"hf", "stack.{E}"},
                    {"from", "st"},
                    {"for", {{"E", 2}}},
                    {"index", {"E"}},
                    {"rows", "(a b) -> (b a)"},
                    {"let", {{"a", 2}}},
                    {"split_last", {2, 3}}}}));
  std::vector<Stored> stored = {st("lin", {5, 24}, DType::BF16), st("q.bias", {4}),
                                st("k.bias", {3}), st("st", {2, 6, 6})};
  auto v = compile(map, {{"out", 5}, {"c", 3}, {"p", 2}}, stored);
  ASSERT_TRUE(v.ck->valid()) << problems(*v.ck);
  EXPECT_EQ(find_tensor(*v.ck, "conv")->shape, (std::vector<uint64_t>{5, 3, 2, 2, 2}));
  EXPECT_EQ(tensor_bytes(v, "conv"), stored[0].data);
  EXPECT_NE(find_tensor(*v.ck, "conv")->origin.find("last axis as [c, 2, p, p]"), std::string::npos)
      << find_tensor(*v.ck, "conv")->origin;
  EXPECT_EQ(find_tensor(*v.ck, "qkv.bias")->shape, (std::vector<uint64_t>{7}));
  EXPECT_EQ(tensor_bytes(v, "qkv.bias"), stored[1].data + stored[2].data);
  // Rows move as before; only the shape of each row changes.
  EXPECT_EQ(find_tensor(*v.ck, "stack.1")->shape, (std::vector<uint64_t>{6, 2, 3}));
  EXPECT_EQ(tensor_bytes(v, "stack.1"),
            rows_of(stored[3].data.substr(6 * 6 * 4), 6 * 4, {0, 3, 1, 4, 2, 5}));
  // A product that is not the last axis is refused, naming the stored tensor and the sizes.
  auto bad = compile(one_rule({{"hf", "conv"}, {"from", "lin"}, {"split_last", {"c", "p", "p"}}}),
                     {{"c", 3}, {"p", 3}}, {st("lin", {5, 24})});
  EXPECT_PROBLEM(bad, "lin", "rule 1 ('conv')", "last axis of 'conv' is 24",
                 "'split_last' c=3 x p=3 x p=3 gives 27");
  auto scalar = compile(one_rule({{"hf", "s"}, {"from", "v"}, {"index", {0}}, {"split_last", {1}}}),
                        json::object(), {st("v", {3})});
  EXPECT_PROBLEM(scalar, "s", "'split_last' on a tensor with no axes");
  auto unknown = compile(one_rule({{"hf", "conv"}, {"from", "lin"}, {"split_last", {"zz", 1}}}),
                         json::object(), {st("lin", {5, 24})});
  EXPECT_PROBLEM(unknown, "conv", "'split_last' zz");
}

TEST(MapCompile, OffsetWritesACaptureShiftedInTheHfName) {
  // torchtitan's mtp_layers.{M} after the model's layers.{L}: HF's model.layers.{layers + M}.
  const json map = map_with(json::array({{{"hf", "model.layers.{L}.w"}, {"from", "layers.{L}.w"}},
                                         {{"hf", "model.layers.{M}.w"},
                                          {"from", "mtp_layers.{M}.w"},
                                          {"offset", {{"M", "num_hidden_layers"}}}},
                                         {{"hf", "e.{M}.x{E}"},
                                          {"from", "mtp_layers.{M}.e"},
                                          {"for", {{"E", 2}}},
                                          {"index", {"E"}},
                                          {"offset", {{"E", "10"}, {"M", "1"}}}}}));
  std::vector<Stored> stored = {st("layers.0.w", {2}), st("layers.1.w", {2}),
                                st("mtp_layers.0.w", {2}), st("mtp_layers.1.w", {2}),
                                st("mtp_layers.0.e", {2, 3})};
  auto v = compile(map, {{"num_hidden_layers", 2}}, stored);
  ASSERT_TRUE(v.ck->valid()) << problems(*v.ck);
  std::vector<std::string> names;
  for (const auto& t : v.ck->tensors) names.push_back(t.name);
  EXPECT_EQ(names,
            (std::vector<std::string>{"model.layers.0.w", "model.layers.1.w", "model.layers.2.w",
                                      "model.layers.3.w", "e.1.x10", "e.1.x11"}));
  EXPECT_EQ(tensor_bytes(v, "model.layers.3.w"), stored[3].data);
  EXPECT_EQ(tensor_bytes(v, "e.1.x11"), stored[4].data.substr(3 * 4));
  EXPECT_NE(find_tensor(*v.ck, "model.layers.2.w")->origin.find("{M} + num_hidden_layers in hf"),
            std::string::npos)
      << find_tensor(*v.ck, "model.layers.2.w")->origin;
  // A config whose offset lands on a name another rule made is refused, naming it.
  auto clash = compile(map, {{"num_hidden_layers", 1}}, stored);
  EXPECT_PROBLEM(clash, "model.layers.1.w", "rule 2", "the HF name is made twice");
  auto unknown = compile(map, json::object(), stored);
  EXPECT_PROBLEM(unknown, "model.layers.{M}.w", "'offset' M");
  expect_refused(one_rule({{"hf", "a.{L}"}, {"from", "b.{L}"}, {"offset", {{"K", 1}}}}),
                 {"'offset' capture 'K' is not in 'hf'"});
  expect_refused(one_rule({{"hf", "a.{L}"}, {"from", "b.{L}"}, {"offset", {{"L", "x +"}}}}),
                 {"rule 1"});
}

TEST(MapCompile, RefuseNamesTheStoredTensorAndWhy) {
  const json map = one_rule({{"hf", "a"}, {"from", "a"}},
                            {{"refuse",
                              {{{"from", "experts.{L}.w*"}, {"why", "needs a transpose"}},
                               {{"from", "other"}, {"why", "never"}}}},
                             {"prefixes", {"model."}}});
  auto ok = compile(map, json::object(), {st("a", {2})});
  ASSERT_TRUE(ok.ck->valid()) << problems(*ok.ck);
  auto v = compile(map, json::object(), {st("a", {2}), st("model.experts.3.w1_EFD", {2, 2})});
  EXPECT_PROBLEM(v, "model.experts.3.w1_EFD", "map 't'", "cannot serve", "needs a transpose");
  // compile_map (inspect's and the tests' entry) says the same.
  std::vector<layout::Tensor> ts = names_of({"a", "model.experts.3.w1_EFD"});
  auto c = layout::compile_map(*map_of(map), json::object(), "config.json", ts);
  ASSERT_EQ(c.problems.size(), 1u);
  EXPECT_EQ(c.problems[0].tensor, "model.experts.3.w1_EFD");
  EXPECT_NE(c.problems[0].message.find("needs a transpose"), std::string::npos);
  EXPECT_TRUE(c.tensors.empty());
}

TEST(MapCompile, RowsSizesComeFromLetAxesAndConfig) {
  // (a b c) with a from the rule's let, b from the map's axes (through the config), c inferred.
  const json map = map_with(
      json::array(
          {{{"hf", "o"},
            {"from", "w"},
            {"rows", "(a b c) -> c[1:c_hi] (b a)"},
            {"let", {{"a", "2"}}}},
           {{"hf", "p"}, {"from", "w"}, {"rows", "(x y) -> (y x)"}, {"let", {{"y", "nb * 2"}}}}}),
      {{"axes", {{"b", "nb"}}}});
  std::vector<Stored> stored = {st("w", {2 * 3 * 4, 5}, DType::U8)};
  auto v = compile(map, {{"nb", 3}, {"c_hi", 3}}, stored);
  ASSERT_TRUE(v.ck->valid()) << problems(*v.ck);
  std::vector<uint64_t> r;
  for (uint64_t c = 1; c < 3; ++c) {
    for (uint64_t b = 0; b < 3; ++b) {
      for (uint64_t a = 0; a < 2; ++a) r.push_back(a * 12 + b * 4 + c);
    }
  }
  EXPECT_EQ(tensor_bytes(v, "o"), rows_of(stored[0].data, 5, r));
  EXPECT_EQ(find_tensor(*v.ck, "o")->shape, (std::vector<uint64_t>{2, 6, 5}));
  std::vector<uint64_t> p;
  for (uint64_t y = 0; y < 6; ++y) {
    for (uint64_t x = 0; x < 4; ++x) p.push_back(x * 6 + y);
  }
  EXPECT_EQ(tensor_bytes(v, "p"), rows_of(stored[0].data, 5, p));
}

// `transpose: [-2, -1]` (gpt-oss's experts): the HF tensor is the stored one with its last two
// axes swapped, whatever grid of chunks (every axis cut at random) holds it; one run per
// matrix, read column by column as strided segments; every sub-range, unaligned too.
TEST(MapCompile, TransposeSwapsTheLastTwoAxesWhateverTheChunks) {
  for (DType dt : {DType::BF16, DType::F32, DType::U8}) {
    for (uint64_t seed = 1; seed <= 12; ++seed) {
      SCOPED_TRACE(fmt::format("{} seed {}", format::dtype_name(dt), seed));
      const json map = map_with(json::array(
          {{{"hf", "up"}, {"from", "w1"}, {"transpose", {-2, -1}}, {"shape", {3, 5, 4}}},
           {{"hf", "down.{E}"},
            {"from", "w2"},
            {"for", {{"E", 2}}},
            {"index", {"E"}},
            {"transpose", {-2, -1}}}}));
      std::vector<Stored> stored = {st("w1", {3, 4, 5}, dt), st("w2", {2, 6, 7}, dt)};
      auto v = compile(map, json::object(), stored, seed);
      ASSERT_TRUE(v.ck->valid()) << problems(*v.ck);
      const size_t es = esize(dt);
      const std::string want = transposed(stored[0].data, 3, 4, 5, es);
      const auto* t = find_tensor(*v.ck, "up");
      ASSERT_NE(t, nullptr);
      EXPECT_EQ(t->shape, (std::vector<uint64_t>{3, 5, 4}));
      EXPECT_EQ(t->runs.size(), 3u);  // one per matrix, not one per element
      EXPECT_EQ(tensor_bytes(v, "up"), want);
      expect_every_subrange(v, *t, want, 3, {1, 2, 5, 17});
      const std::string w2 = transposed(stored[1].data, 2, 6, 7, es);
      for (int e = 0; e < 2; ++e) {
        const auto* d = find_tensor(*v.ck, fmt::format("down.{}", e));
        ASSERT_NE(d, nullptr);
        EXPECT_EQ(d->shape, (std::vector<uint64_t>{7, 6}));
        EXPECT_EQ(tensor_bytes(v, d->name), w2.substr(e * 42 * es, 42 * es));
      }
    }
  }
}

TEST(MapCompile, TransposeIsRefusedWhereItCannotApply) {
  // One axis: nothing to swap. Named in the problem, with the rule.
  auto v = compile(one_rule({{"hf", "b"}, {"from", "bias"}, {"transpose", {-2, -1}}}),
                   json::object(), {st("bias", {6})});
  EXPECT_PROBLEM(v, "bias", "rule 1 ('b')", "'transpose' of a tensor of shape [6]");
  // A shape check sees the swapped shape.
  auto w =
      compile(one_rule({{"hf", "t"}, {"from", "w"}, {"transpose", {-2, -1}}, {"shape", {4, 5}}}),
              json::object(), {st("w", {4, 5})});
  EXPECT_PROBLEM(w, "", "axis 0 of 't' is 5");
  // Only the last two axes, and only with one `from`, no `rows`, no `split_last`.
  expect_refused(one_rule({{"hf", "t"}, {"from", "w"}, {"transpose", {0, 1}}}),
                 {"'transpose' is an array of 2 elements", "only [-2, -1]"});
  expect_refused(
      one_rule({{"hf", "t"}, {"from", "w"}, {"transpose", {-2, -1}}, {"rows", "a -> a"}}),
      {"'transpose' goes with one 'from'"});
  expect_refused(one_rule({{"hf", "t"},
                           {"concat", json::array({{{"from", "a"}}, {{"from", "b"}}})},
                           {"transpose", {-2, -1}}}),
                 {"'transpose' goes with one 'from'"});
  expect_refused(
      one_rule({{"hf", "t"}, {"from", "w"}, {"transpose", {-2, -1}}, {"split_last", {2, 2}}}),
      {"'transpose' goes with one 'from'"});
}

// The same through io::gather, from real descriptors (memfds): the strided segments read through
// the per-thread window give the transposed bytes, and a shard rewritten under a new stamp is
// read again, not served from the window of the old one.
TEST(MapCompile, TransposedReadsGatherFromDescriptorsAndTheWindowFollowsTheStamp) {
  const json map = one_rule({{"hf", "up"}, {"from", "w1"}, {"transpose", {-2, -1}}});
  io::StridedWindows windows;  // shared by every checkpoint: keyed by each shard's stamp
  size_t grouped = 0;          // reads with whole columns one after another (column groups)
  for (uint64_t layout_seed : {5u, 6u, 7u, 8u, 9u, 10u})
    for (uint64_t seed : {3u, 4u}) {
      std::vector<Stored> stored = {st("w1", {2, 9, 13}, DType::BF16)};
      std::mt19937_64 bytes(seed);
      stored[0].data = test::random_bytes(bytes, 2 * 9 * 13 * 2);
      // The same chunks and offsets for both seeds; the second reads its ranges in reverse, so
      // its first read is the one whose window the first left (another file's: another stamp).
      auto v = compile(map, json::object(), stored, layout_seed);
      ASSERT_TRUE(v.ck->valid()) << problems(*v.ck);
      std::vector<UniqueFd> fds;
      std::vector<int> raw;
      for (const auto& f : v.shards) {
        int fd = ::memfd_create("shard", MFD_CLOEXEC);
        ASSERT_EQ(::pwrite(fd, f.data(), f.size(), 0), static_cast<ssize_t>(f.size()));
        fds.emplace_back(fd);
        raw.push_back(fd);
      }
      const auto* t = find_tensor(*v.ck, "up");
      ASSERT_NE(t, nullptr);
      const std::string want = transposed(stored[0].data, 2, 9, 13, 2);
      std::vector<uint64_t> starts;
      for (uint64_t a = 0; a < t->nbytes; a += 37) starts.push_back(a);
      if (seed == 4) std::reverse(starts.begin(), starts.end());
      for (uint64_t a : starts) {
        const uint64_t len = std::min<uint64_t>(a % 5 == 0 ? t->nbytes : 53, t->nbytes - a);
        std::vector<layout::Segment> segs;
        layout::map_range(*v.ck, t->output, t->out_offset + a, len, segs);
        for (size_t i = 1; i < segs.size(); ++i) {
          grouped += segs[i].is_strided() && segs[i - 1].is_strided() && segs[i].skip == 0 &&
                     segs[i].src == segs[i - 1].src + 2 && segs[i].len == segs[i - 1].len;
        }
        for (bool windowed : {false, true}) {  // in pieces, and through the shared windows
          std::string got(len, '\0');
          io::GatherSource src{v.ck.get(), raw, v.ck->outputs[t->output].header, {}};
          if (windowed) src.windows = &windows;
          auto g = io::gather(src, segs, got.data());
          ASSERT_TRUE(g.ok()) << g.error().message;
          ASSERT_EQ(got, want.substr(a, len))
              << "seed " << seed << " at " << a << "+" << len << (windowed ? " windowed" : "");
        }
      }
    }
  EXPECT_GT(grouped, 0u);  // the column-group path was taken
}

TEST(MapCompile, AMappedCastViewReadsAndConvertsElementsAtAnyOffset) {
  const json map = one_rule({{"hf", "q"},
                             {"from", "wq"},
                             {"rows", "(heads half two) -> (heads two half)"},
                             {"let", {{"two", 2}, {"heads", 3}}}});
  std::vector<Stored> stored = {st("wq", {3 * 4, 5}, DType::BF16)};
  layout::BuildOptions opts;
  opts.dtype_policy = layout::BuildOptions::DtypePolicy::Cast;
  opts.cast_to = DType::F32;
  auto v = compile(map, json::object(), stored, 9, opts);
  ASSERT_TRUE(v.ck->valid()) << problems(*v.ck);
  const auto* t = find_tensor(*v.ck, "q");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->dtype, DType::F32);
  const std::string bf = rows_of(stored[0].data, 5 * 2, rope_rows(3, 4));
  std::string want(bf.size() * 2, '\0');
  format::convert(DType::BF16, DType::F32, bf.data(), want.data(), bf.size() / 2);
  EXPECT_EQ(tensor_bytes(v, "q"), want);
  // Every sub-range, also unaligned to elements.
  expect_every_subrange(v, *t, want, 7, {1, 3, 5, 41});
}

// =========================================================================================
// Hostile maps: each a clear problem naming the tensor (and the axis), never a crash or hang
// =========================================================================================

TEST(MapHostile, OverlappingSelectionsAreRefused) {
  auto twice = compile(one_rule({{"hf", "w2"}, {"concat", {{{"from", "w"}}, {{"from", "w"}}}}}),
                       json::object(), {st("w", {4, 3})});
  EXPECT_PROBLEM(twice, "w", "rule 1 ('w2')", "'w2' reads elements 0..11 twice");
  auto overlap = compile(one_rule({{"hf", "o"},
                                   {"concat",
                                    {{{"from", "w"}, {"rows", "v -> v[0:3]"}},
                                     {{"from", "w"}, {"rows", "v -> v[2:4]"}}}}}),
                         json::object(), {st("w", {4, 3})});
  EXPECT_PROBLEM(overlap, "w", "reads elements 6..8 twice");
  auto idx = compile(
      one_rule(
          {{"hf", "o"},
           {"concat", {{{"from", "w"}, {"index", {1}}}, {{"from", "w"}, {"index", {"2 - 1"}}}}}}),
      json::object(), {st("w", {4, 3})});
  EXPECT_PROBLEM(idx, "w", "reads elements 3..5 twice");
  // Disjoint selections of one tensor in one output are fine; and two outputs may read one tensor.
  auto ok = compile(
      map_with(json::array(
          {{{"hf", "o"},
            {"concat",
             {{{"from", "w"}, {"rows", "v -> v[2:4]"}}, {{"from", "w"}, {"rows", "v -> v[0:2]"}}}}},
           {{"hf", "p"}, {"from", "w"}}})),
      json::object(), {st("w", {4, 3})});
  EXPECT_TRUE(ok.ck->valid()) << problems(*ok.ck);
}

TEST(MapHostile, OutOfRangeIndexSlicesAndAxes) {
  const json none = json::object();
  auto i1 =
      compile(one_rule({{"hf", "o"}, {"from", "w"}, {"index", {5}}}), none, {st("w", {3, 4})});
  EXPECT_PROBLEM(i1, "w", "rule 1 ('o')", "axis 0", "index 5", "[3, 4]");
  auto i2 = compile(one_rule({{"hf", "o"}, {"from", "w"}, {"index", {0, "n"}}}), {{"n", 4}},
                    {st("w", {3, 4, 2})});
  EXPECT_PROBLEM(i2, "w", "axis 1", "index 4");
  auto i3 = compile(one_rule({{"hf", "o"}, {"from", "w"}, {"index", {0, 0, 0}}}), none,
                    {st("w", {3, 4})});
  EXPECT_PROBLEM(i3, "w", "'index' selects 3 axes of a tensor of shape [3, 4]");
  auto i4 =
      compile(one_rule({{"hf", "o"}, {"from", "w"}, {"index", {"E"}}}), none, {st("w", {3, 4})});
  EXPECT_PROBLEM(i4, "w", "axis 0", "no value for E");
  auto f1 =
      compile(one_rule({{"hf", "o.{L}"}, {"from", "w"}, {"for", {{"L", 3}}}, {"index", {"L"}}}),
              none, {st("w", {2, 4})});
  EXPECT_PROBLEM(f1, "w", "axis 0", "'for' L counts 3 but the axis holds 2");
  auto f2 =
      compile(one_rule({{"hf", "o.{L}"}, {"from", "w"}, {"for", {{"L", 1}}}, {"index", {"L"}}}),
              none, {st("w", {2, 4})});
  EXPECT_PROBLEM(f2, "w", "'for' L counts 1 but the axis holds 2");
  auto s1 = compile(one_rule({{"hf", "o"}, {"from", "w"}, {"rows", "v -> v[0:vocab]"}}),
                    {{"vocab", 11}}, {st("w", {10, 4})});
  EXPECT_PROBLEM(s1, "w", "rule 1 ('o')", "v: slice [0:11] is outside the axis's 10");
  auto s2 = compile(one_rule({{"hf", "o"}, {"from", "w"}, {"rows", "v -> v[5:2]"}}), none,
                    {st("w", {10, 4})});
  EXPECT_PROBLEM(s2, "w", "slice [5:2]");
  auto s3 = compile(one_rule({{"hf", "o"}, {"from", "w"}, {"rows", "v -> v[0:2-3]"}}), none,
                    {st("w", {10, 4})});
  EXPECT_PROBLEM(s3, "w", "v: ", "negative");
  auto r1 = compile(one_rule({{"hf", "o"}, {"from", "w"}, {"rows", "a b -> b a"}}), none,
                    {st("w", {10, 4})});
  EXPECT_PROBLEM(r1, "w", "describes 2 axes", "has 1 leading");  // no transpose
  auto r2 = compile(one_rule({{"hf", "o"}, {"from", "w"}, {"rows", "a b -> b a"}}), none,
                    {st("w", {10})});
  EXPECT_PROBLEM(r2, "w", "describes 2 axes", "has 0 leading");
  auto r3 = compile(one_rule({{"hf", "o"}, {"from", "w"}, {"index", {1}}, {"rows", "a -> a"}}),
                    none, {st("w", {10})});
  EXPECT_PROBLEM(r3, "w", "'rows' on a tensor with no axes left");
}

TEST(MapHostile, SizesThatDoNotDivideOrDisagree) {
  auto d1 = compile(
      one_rule({{"hf", "o"}, {"from", "w"}, {"rows", "(h x) -> (x h)"}, {"let", {{"h", 3}}}}),
      json::object(), {st("w", {7, 2})});
  EXPECT_PROBLEM(d1, "w", "axis 0", "7 rows do not divide by 3", "h=3");
  auto d2 = compile(one_rule({{"hf", "o"}, {"from", "w"}, {"rows", "(h x) -> (x h)"}}),
                    {{"h", 2}, {"x", 5}}, {st("w", {8, 2})});
  EXPECT_PROBLEM(d2, "w", "axis 0", "8 rows, but h=2 x x=5 gives 10");
  auto d3 = compile(one_rule({{"hf", "o"}, {"from", "w"}, {"rows", "(h x) -> (x h)"}}),
                    json::object(), {st("w", {8, 2})});
  EXPECT_PROBLEM(d3, "w", "axis 0", "'h' and 'x' are both unknown sizes");
  auto d4 = compile(
      one_rule({{"hf", "o"}, {"from", "w"}, {"rows", "(h x) -> (x h)"}, {"let", {{"h", 0}}}}),
      json::object(), {st("w", {8, 2})});
  EXPECT_PROBLEM(d4, "w", "axis 0", "do not divide by 0");
  // A size expression that does not divide exactly names both numbers.
  auto d5 = compile(one_rule({{"hf", "o"}, {"from", "w"}, {"shape", {"hidden / heads", 2}}}),
                    {{"hidden", 100}, {"heads", 3}}, {st("w", {8, 2})});
  EXPECT_PROBLEM(d5, "o", "shape axis 0", "100 / 3 does not divide exactly");
  auto d6 = compile(one_rule({{"hf", "o"}, {"from", "w"}, {"shape", {"n", 2}}}), {{"n", 9}},
                    {st("w", {8, 2})});
  EXPECT_PROBLEM(d6, "w", "axis 0 of 'o' is 8, but 'n' is 9");
  auto d7 = compile(one_rule({{"hf", "o"}, {"from", "w"}, {"shape", {8}}}), json::object(),
                    {st("w", {8, 2})});
  EXPECT_PROBLEM(d7, "o", "shape [8, 2] has 2 axes; 'shape' says 1");
  // Config values that are not non-negative integers are missing, not misread.
  for (const json& bad : {json(-4), json(4.5), json("4"), json(nullptr), json::array({4})}) {
    auto c = compile(one_rule({{"hf", "o"}, {"from", "w"}, {"shape", {"n", 2}}}), {{"n", bad}},
                     {st("w", {4, 2})});
    EXPECT_PROBLEM(c, "o", "no value for n");
  }
}

// A size that the map defines but whose definition fails (overflow, inexact division) must
// refuse the map, not be taken for an unknown size and inferred from the stored tensor.
TEST(MapHostile, ARowsSizeWhoseDefinitionFailsIsRefusedNotInferred) {
  for (const char* bad : {"4611686018427387904 * 4", "7 / 2", "1 - 2", "n / 0"}) {
    SCOPED_TRACE(bad);
    auto v = compile(one_rule({{"hf", "o"},
                               {"from", "w"},
                               {"rows", "(a b) -> (b a)"},
                               {"let", {{"a", bad}, {"b", 2}}}}),
                     {{"n", 3}}, {st("w", {8, 2})});
    EXPECT_PROBLEM(v, "w", "axis 0", bad);
    auto a =
        compile(map_with(json::array({{{"hf", "o"}, {"from", "w"}, {"rows", "(a b) -> (b a)"}}}),
                         {{"axes", {{"a", bad}, {"b", "2"}}}}),
                {{"n", 3}}, {st("w", {8, 2})});
    EXPECT_PROBLEM(a, "w", "axis 0", bad);
  }
}

TEST(MapHostile, CyclesAreRefused) {
  // Axes defined in terms of each other.
  const json cyc = {{"a", "b"}, {"b", "a"}};
  auto s = compile(
      map_with(json::array({{{"hf", "o"}, {"from", "w"}, {"shape", {"a", 2}}}}), {{"axes", cyc}}),
      json::object(), {st("w", {4, 2})});
  EXPECT_PROBLEM(s, "o", "'a'");
  auto r = compile(
      map_with(json::array(
                   {{{"hf", "o"}, {"from", "w"}, {"rows", "(a c) -> (c a)"}, {"let", {{"c", 2}}}}}),
               {{"axes", cyc}}),
      json::object(), {st("w", {4, 2})});
  EXPECT_PROBLEM(r, "w", "'a'", "itself");
  auto l = compile(one_rule({{"hf", "o"},
                             {"from", "w"},
                             {"rows", "(a c) -> (c a)"},
                             {"let", {{"c", 2}, {"a", "b + 0"}, {"b", "a * 1"}}}}),
                   json::object(), {st("w", {4, 2})});
  EXPECT_PROBLEM(l, "w", "'a'", "itself");
  // A concat part naming an HF output, not a stored tensor (maps cannot read their outputs).
  auto c = compile(
      map_with(json::array({{{"hf", "x"}, {"from", "w"}},
                            {{"hf", "y"}, {"concat", {{{"from", "w2"}}, {{"from", "x"}}}}}})),
      json::object(), {st("w", {4, 2}), st("w2", {4, 2})});
  EXPECT_PROBLEM(c, "x", "rule 2 ('y')", "no such stored tensor");
  auto self = compile(one_rule({{"hf", "y"}, {"concat", {{{"from", "w"}}, {{"from", "y"}}}}}),
                      json::object(), {st("w", {4, 2})});
  EXPECT_PROBLEM(self, "y", "no such stored tensor");
  // One HF name made twice.
  auto two =
      compile(map_with(json::array({{{"hf", "x"}, {"from", "w"}}, {{"hf", "x"}, {"from", "w2"}}})),
              json::object(), {st("w", {4, 2}), st("w2", {4, 2})});
  EXPECT_PROBLEM(two, "x", "rule 2 ('x')", "the HF name is made twice");
}

// Axes are evaluated against config.json (docs/maps.md), not against whichever rule asked first:
// an axis that reads a rule's capture cannot be cached across bindings.
TEST(MapHostile, AnAxisThatReadsACaptureIsNotCachedAcrossBindings) {
  auto v = compile(map_with(json::array({{{"hf", "o.{L}"},
                                          {"from", "w"},
                                          {"for", {{"L", 2}}},
                                          {"index", {"L"}},
                                          {"rows", "v -> v[0:n]"}}}),
                            {{"axes", {{"n", "L + 2"}}}}),
                   json::object(), {st("w", {2, 4, 3})});
  if (v.ck->valid()) {
    // Served: then each binding must have its own n (2, then 3), not the first one's.
    const auto* t0 = find_tensor(*v.ck, "o.0");
    const auto* t1 = find_tensor(*v.ck, "o.1");
    ASSERT_TRUE(t0 && t1);
    EXPECT_EQ(t0->shape[0], 2u);
    EXPECT_EQ(t1->shape[0], 3u) << "axis 'n' = L + 2 was cached from L = 0";
  } else {
    EXPECT_PROBLEM(v, "", "L");
  }
}

TEST(MapHostile, StoredTensorsNeitherMappedNorDropped) {
  auto v = compile(map_with(json::array({{{"hf", "x"}, {"from", "w"}}}), {{"drop", {"junk.*"}}}),
                   json::object(),
                   {st("w", {4}), st("layers.0.attention.rope.x", {2}), st("junk.1", {1})});
  EXPECT_PROBLEM(v, "layers.0.attention.rope.x", "stored tensor is neither mapped nor dropped",
                 "map 't'");
  EXPECT_FALSE(has_problem(*v.ck, "junk.1", {}));
}

TEST(MapHostile, HugeNumbersCountsAndExpressions) {
  const json none = json::object();
  auto f1 = compile(
      one_rule({{"hf", "o.{L}"}, {"from", "w"}, {"for", {{"L", "2000000"}}}, {"index", {"L"}}}),
      none, {st("w", {2, 2})});
  EXPECT_PROBLEM(f1, "o.{L}", "'for' L counts 2000000 (at most 1048576)");
  auto f2 = compile(
      one_rule({{"hf", "o.{L}"}, {"from", "w"}, {"for", {{"L", "65536"}}}, {"index", {"L"}}}), none,
      {st("w", {2, 2})});
  EXPECT_PROBLEM(f2, "w", "'for' L counts 65536 but the axis holds 2");
  auto f5 = compile(
      one_rule({{"hf", "o.{L}"}, {"from", "w"}, {"for", {{"L", "1048576"}}}, {"index", {"L"}}}),
      none, {st("w", {2, 2})});
  EXPECT_PROBLEM(f5, "o.{L}", "more than 65536 bindings");
  auto f3 = compile(one_rule({{"hf", "o.{L}.{E}"},
                              {"from", "w"},
                              {"for", {{"L", 1024}, {"E", 1024}}},
                              {"index", {"L", "E"}}}),
                    none, {st("w", {2, 2, 2})});
  EXPECT_PROBLEM(f3, "o.{L}.{E}", "more than 65536 bindings");
  auto f4 = compile(
      one_rule({{"hf", "o.{L}"}, {"from", "w"}, {"for", {{"L", "4611686018427387904 * 4"}}}}), none,
      {st("w", {2, 2})});
  EXPECT_PROBLEM(f4, "o.{L}", "'for' L", "overflows");
  auto n1 = compile(one_rule({{"hf", "o"}, {"from", "w"}, {"index", {"4611686018427387904"}}}),
                    none, {st("w", {2, 2})});
  EXPECT_PROBLEM(n1, "w", "axis 0", "index 4611686018427387904");
  auto n2 = compile(one_rule({{"hf", "o"},
                              {"from", "w"},
                              {"rows", "v -> v[4611686018427387904:4611686018427387904]"}}),
                    none, {st("w", {2, 2})});
  EXPECT_PROBLEM(n2, "w", "outside");
  auto n3 =
      compile(one_rule({{"hf", "o"},
                        {"from", "w"},
                        {"rows", "(a b) -> (b a)"},
                        {"let", {{"a", "4611686018427387904"}, {"b", "4611686018427387904"}}}}),
              none, {st("w", {2, 2})});
  EXPECT_PROBLEM(n3, "w", "axis 0");
  // The longest expression allowed, evaluated.
  std::string longest = "1";
  while (longest.size() + 4 <= format::kMaxExprChars) longest += " + 1";
  auto e1 = compile(one_rule({{"hf", "o"}, {"from", "w"}, {"shape", {longest, 2}}}), none,
                    {st("w", {2, 2})});
  EXPECT_PROBLEM(e1, "w", "axis 0 of 'o' is 2");
}

// Unresolvable axes that refer to each other many times over: each is evaluated a bounded number
// of times (an exponential re-evaluation would hang the mount on a hostile map).
TEST(MapHostile, AChainOfUnresolvableAxesIsNotExponential) {
  json axes = json::object();
  const int depth = 30;
  for (int i = 0; i < depth; ++i) {
    axes[fmt::format("a{}", i)] = fmt::format("a{} + b{} | b{} + a{}", i + 1, i + 1, i + 1, i + 1);
    axes[fmt::format("b{}", i)] = fmt::format("b{} * a{} | a{} * b{}", i + 1, i + 1, i + 1, i + 1);
  }
  axes[fmt::format("a{}", depth)] = "nowhere";
  axes[fmt::format("b{}", depth)] = "nowhere";
  const json map =
      map_with(json::array({{{"hf", "o"}, {"from", "w"}, {"shape", {"a0", 2}}}}), {{"axes", axes}});
  EXPECT_EXIT(
      {
        ::alarm(5);
        auto v = compile(map, json::object(), {st("w", {4, 2})});
        std::_Exit(v.ck->valid() ? 1 : 0);
      },
      ::testing::ExitedWithCode(0), "");
}

// A stored tensor described, with no bytes: compile_map needs names, dtypes and shapes only.
layout::Tensor described(std::string name, std::vector<uint64_t> shape, DType dt = DType::U8) {
  layout::Tensor t;
  t.name = std::move(name);
  t.dtype = t.src_dtype = dt;
  t.shape = std::move(shape);
  t.strides.assign(t.shape.size(), 1);
  for (size_t d = t.shape.size(); d-- > 1;) t.strides[d - 1] = t.strides[d] * t.shape[d];
  t.numel = numel(t.shape);
  t.nbytes = t.numel * esize(dt);
  return t;
}

// The process's resident set now and its peak since the last reset_peak(), in KiB (Linux).
uint64_t status_kib(std::string_view field) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.starts_with(field)) return std::stoull(line.substr(field.size() + 1));
  }
  return 0;
}
bool reset_peak() { return static_cast<bool>(std::ofstream("/proc/self/clear_refs") << "5"); }

// The red team's Megatron config: 2 layers of 2^24 query groups of one row each, a 128 MiB
// store. The fused QKV's q, k and v are each one strided run per layer; the compiler checks
// that no element is read twice without a structure that grows with the 2^24 rows (it made a
// 24-byte tuple per row, and sorted them: 400 MB, 12 s). Built in a child, whose peak memory
// is measured.
TEST(MapHostile, AMegatronConfigOfMillionsOfQueryGroupsCompilesInMemoryThatDoesNotGrowWithRows) {
  const uint64_t L = 2, G = uint64_t{1} << 24;
  const std::vector<layout::Tensor> stored = {
      described("embedding.word_embeddings.weight", {1, 1}),
      described("decoder.layers.self_attention.linear_qkv.layer_norm_weight", {L, 1}),
      described("decoder.layers.self_attention.linear_qkv.weight", {L, 3 * G, 1}),
      described("decoder.layers.self_attention.linear_proj.weight", {L, 1, G}),
      described("decoder.layers.mlp.linear_fc1.layer_norm_weight", {L, 1}),
      described("decoder.layers.mlp.linear_fc1.weight", {L, 2, 1}),
      described("decoder.layers.mlp.linear_fc2.weight", {L, 1, 1}),
      described("decoder.final_layernorm.weight", {1}),
      described("output_layer.weight", {1, 1}),
  };
  const json config = {{"hidden_size", 1},         {"num_attention_heads", G},
                       {"num_key_value_heads", G}, {"head_dim", 1},
                       {"intermediate_size", 1},   {"vocab_size", 1},
                       {"num_hidden_layers", L},   {"tie_word_embeddings", false}};
  const auto map = format::find_builtin_map("megatron-gpt");
  ASSERT_NE(map, nullptr);
  // In the child: 0, or what went wrong on stderr.
  auto child = [&]() -> int {
    ::alarm(120);  // a hang guard, not a timing
    const bool measured = reset_peak();
    const uint64_t before = status_kib("VmRSS:");
    auto c = layout::compile_map(*map, config, "config.json", stored);
    const uint64_t grown = status_kib("VmHWM:") - before;
    if (!c.problems.empty()) {
      std::cerr << c.problems[0].to_string() << "\n";
      return 1;
    }
    if (c.tensors.size() != 3 + 9 * L) {
      std::cerr << c.tensors.size() << " tensors\n";
      return 2;
    }
    for (const auto& t : c.tensors) {
      const bool qkv = t.name.ends_with("q_proj.weight") || t.name.ends_with("k_proj.weight") ||
                       t.name.ends_with("v_proj.weight");
      if (qkv && t.runs.size() != 1) {
        std::cerr << t.name << ": " << t.runs.size() << " runs\n";
        return 3;
      }
    }
    if (measured && grown > 64 * 1024) {
      std::cerr << "peak memory grew by " << grown / 1024 << " MiB\n";
      return 4;
    }
    return 0;
  };
  EXPECT_EXIT(std::_Exit(child()), ::testing::ExitedWithCode(0), "");
}

// Parts of one HF tensor that read one stored tensor: hulls that do not meet need no more;
// interleaved rows are checked exactly (disjoint: served; meeting: refused), within a cap.
TEST(MapHostile, InterleavedPartsOfOneStoredTensorAreCheckedExactly) {
  // A fused [q; k; v] per group, 4 groups of (2 + 1 + 1) rows: "qv" is q and v of every group.
  const json qv = one_rule({{"hf", "qv"},
                            {"concat",
                             {{{"from", "w"}, {"rows", "(g p) -> (g p[0:2])"}},
                              {{"from", "w"}, {"rows", "(g p) -> (g p[3:4])"}}}},
                            {"let", {{"g", 4}}}});
  std::vector<Stored> stored = {st("w", {16, 3})};
  auto ok = compile(qv, json::object(), stored);
  ASSERT_TRUE(ok.ck->valid()) << problems(*ok.ck);
  EXPECT_EQ(tensor_bytes(ok, "qv"), rows_of(stored[0].data, 3 * 4, {0, 1, 4, 5, 8, 9, 12, 13}) +
                                        rows_of(stored[0].data, 3 * 4, {3, 7, 11, 15}));
  // q and "k and v" overlap in one row of every group: refused, naming the elements.
  auto twice = compile(one_rule({{"hf", "qkv"},
                                 {"concat",
                                  {{{"from", "w"}, {"rows", "(g p) -> (g p[0:3])"}},
                                   {{"from", "w"}, {"rows", "(g p) -> (g p[2:4])"}}}},
                                 {"let", {{"g", 4}}}}),
                       json::object(), {st("w", {16, 3})});
  EXPECT_PROBLEM(twice, "w", "rule 1 ('qkv')", "'qkv' reads elements 6..8 twice");
  // Interleaved beyond the cap: refused by name, never expanded.
  const uint64_t g = layout::kMaxOverlapBlocks / 2 + 1;
  auto cap = compile(one_rule({{"hf", "ab"},
                               {"concat",
                                {{{"from", "w"}, {"rows", "(g p) -> (g p[0:1])"}},
                                 {{"from", "w"}, {"rows", "(g p) -> (g p[1:2])"}}}},
                               {"let", {{"p", 2}}}}),
                     json::object(), {st("w", {2 * g, 1}, DType::U8)});
  EXPECT_PROBLEM(cap, "w", "rule 1 ('ab')", "interleave",
                 fmt::format("more than {} blocks", layout::kMaxOverlapBlocks));
}

// A tensor that needs more runs than the map may have is refused once it passes what is left
// of kMaxRunsTotal; its runs never grew to the per-tensor cap first (they did: 3 x 2^23 runs,
// 1.2 GB, before "25165824 runs (at most 16777216)").
TEST(MapHostile, ATensorNeedingMoreRunsThanTheMapMayHaveStopsAtTheBudget) {
  const uint64_t rows = layout::kMaxRunsTotal * 4;  // (a b) -> (b a), a = 2: a run per 2 rows
  json parts = json::array();
  std::vector<layout::Tensor> stored;
  for (int i = 0; i < 3; ++i) {
    parts.push_back({{"from", fmt::format("w{}", i)}, {"rows", "(a b) -> (b a)"}});
    stored.push_back(described(fmt::format("w{}", i), {rows, 1}));
  }
  const auto map = map_of(one_rule({{"hf", "many"}, {"concat", parts}, {"let", {{"a", 2}}}}));
  auto child = [&]() -> int {
    ::alarm(120);  // a hang guard
    auto c = layout::compile_map(*map, json::object(), "config.json", stored);
    const std::string want = fmt::format("needs more than {} runs", layout::kMaxRunsTotal);
    const bool ok = c.tensors.empty() && c.problems.size() == 1 && c.problems[0].tensor == "many" &&
                    c.problems[0].message.find(want) != std::string::npos;
    if (!ok) std::cerr << (c.problems.empty() ? "no problem" : c.problems[0].to_string());
    return ok ? 0 : 1;
  };
  EXPECT_EXIT(std::_Exit(child()), ::testing::ExitedWithCode(0), "");
}

// An HF name a map makes is a tensor name like any other: not `__metadata__` (the safetensors
// header's own field), valid UTF-8 (it is written into the JSON header), not empty.
TEST(MapHostile, HfNamesThatCannotNameATensorAreRefusedNamingTheRule) {
  auto meta = compile(map_with(json::array({{{"hf", "model.norm.weight"}, {"from", "a"}},
                                            {{"hf", "__metadata__"}, {"from", "b"}}})),
                      json::object(), {st("a", {2}), st("b", {2})});
  EXPECT_PROBLEM(meta, "__metadata__", "map 't'", "rule 2 ('__metadata__')",
                 "a tensor named '__metadata__'");
  // The map's JSON cannot hold invalid UTF-8 (the parser refuses it): a map made another way
  // is checked all the same.
  auto m = format::parse_model_map(one_rule({{"hf", "x.{L}.y"}, {"from", "w.{L}"}}).dump(), "m");
  ASSERT_TRUE(m) << m.error().message;
  for (auto& piece : m->rules[0].hf.pieces) {
    if (piece.kind == format::MapPattern::Piece::Lit && piece.text == "x.")
      piece.text = "\xff\xfe.";
  }
  layout::BuildOptions opts;
  opts.map = std::make_shared<const format::ModelMap>(std::move(m).value());
  opts.hf_config = "{}";
  std::mt19937_64 rng(3);
  std::vector<Stored> stored = {st("w.0", {2}), st("w.1", {2})};
  auto bad = build_view(stored, opts, rng);
  EXPECT_PROBLEM(bad, "", "rule 1 ('x.{L}.y')", "not valid UTF-8", "\\xff\\xfe.0.y");
}

// =========================================================================================
// The random-map property test
// =========================================================================================

struct RefPart {
  std::vector<uint32_t> stored;  // per binding (one entry unless the rule matches captures)
  std::vector<uint64_t> index;   // selected values; index[0] is the binding's when by_for
  bool by_for = false;
  bool rows = false;
  std::vector<std::vector<std::string>> lhs, rhs;
  std::map<std::string, uint64_t> size;
  std::map<std::string, std::pair<uint64_t, uint64_t>> slice;
};

struct RefRule {
  std::string hf;                 // with "{L}" when bound
  std::vector<uint64_t> binding;  // values of L (empty: one unbound tensor)
  std::vector<RefPart> parts;
};

struct Case {
  json map;
  json config = json::object();
  std::vector<Stored> stored;
  std::vector<RefRule> rules;
};

struct Expected {
  std::string name;
  DType dtype;
  std::vector<uint64_t> shape;
  std::string bytes;
};

bool odometer(std::vector<uint64_t>& c, const std::vector<uint64_t>& lim) {
  for (size_t i = c.size(); i-- > 0;) {
    if (++c[i] < lim[i]) return true;
    c[i] = 0;
  }
  return false;
}

// The reference: one part of one binding, element by element. It selects `index`, splits each
// leading axis row-major into its named sizes, slices, and walks the output axes in RHS order.
std::string reference(const Stored& s, const RefPart& p, std::optional<uint64_t> bound,
                      std::vector<uint64_t>& oshape) {
  const size_t es = esize(s.dtype);
  std::vector<uint64_t> idx = p.index;
  if (p.by_for) idx[0] = *bound;
  const std::vector<uint64_t> rest(s.shape.begin() + static_cast<ptrdiff_t>(idx.size()),
                                   s.shape.end());
  std::string out;
  auto put = [&](const std::vector<uint64_t>& rc) {
    uint64_t flat = 0;
    for (size_t d = 0; d < s.shape.size(); ++d) {
      const uint64_t x = d < idx.size() ? idx[d] : rc[d - idx.size()];
      EXPECT_LT(x, s.shape[d]);
      flat = flat * s.shape[d] + x;
    }
    out.append(s.data, flat * es, es);
  };
  if (!p.rows) {
    oshape = rest;
    if (numel(rest) == 0) return out;
    std::vector<uint64_t> c(rest.size(), 0);
    do put(c);
    while (odometer(c, rest));
    return out;
  }
  struct OutAxis {
    std::string name;
    uint64_t lo, n;
  };
  std::vector<OutAxis> ax;
  oshape.clear();
  for (const auto& g : p.rhs) {
    uint64_t n = 1;
    for (const auto& name : g) {
      auto [lo, hi] =
          p.slice.count(name) ? p.slice.at(name) : std::pair{uint64_t{0}, p.size.at(name)};
      ax.push_back({name, lo, hi - lo});
      n *= hi - lo;
    }
    oshape.push_back(n);
  }
  oshape.push_back(rest.back());
  std::vector<uint64_t> lim;
  for (const auto& a : ax) lim.push_back(a.n);
  if (numel(lim) == 0 || rest.back() == 0) return out;
  std::vector<uint64_t> c(ax.size(), 0);
  do {
    std::map<std::string, uint64_t> val;
    for (size_t i = 0; i < ax.size(); ++i) val[ax[i].name] = ax[i].lo + c[i];
    std::vector<uint64_t> rc;
    for (const auto& g : p.lhs) {
      uint64_t x = 0;
      for (const auto& name : g) x = x * p.size.at(name) + val.at(name);
      rc.push_back(x);
    }
    rc.push_back(0);
    for (uint64_t e = 0; e < rest.back(); ++e) {
      rc.back() = e;
      put(rc);
    }
  } while (odometer(c, lim));
  return out;
}

std::vector<Expected> expected_of(const Case& c) {
  std::vector<Expected> out;
  for (const auto& r : c.rules) {
    const size_t nb = r.binding.empty() ? 1 : r.binding.size();
    for (size_t b = 0; b < nb; ++b) {
      Expected e;
      e.name = r.hf;
      std::optional<uint64_t> bound;
      if (!r.binding.empty()) {
        bound = r.binding[b];
        e.name.replace(e.name.find("{L}"), 3, std::to_string(*bound));
      }
      for (size_t i = 0; i < r.parts.size(); ++i) {
        const auto& p = r.parts[i];
        const Stored& s = c.stored[p.stored.size() == 1 ? p.stored[0] : p.stored[b]];
        std::vector<uint64_t> shape;
        e.bytes += reference(s, p, bound, shape);
        e.dtype = s.dtype;
        if (i == 0) {
          e.shape = shape;
        } else {
          e.shape[0] += shape[0];
        }
      }
      out.push_back(std::move(e));
    }
  }
  return out;
}

class Gen {
 public:
  explicit Gen(uint64_t seed) : rng(seed) {}
  std::mt19937_64 rng;
  uint64_t R(uint64_t lo, uint64_t hi) { return lo + rng() % (hi - lo + 1); }
  bool P(int pct) { return static_cast<int>(rng() % 100) < pct; }
  template <typename T>
  void shuffle(std::vector<T>& v) {
    std::shuffle(v.begin(), v.end(), rng);
  }

  // Makes `name` (of `size`) known to the map: in `let`, the map's axes, or config.json, directly
  // or through an expression; or leaves it unknown when `may_be_unknown` (then inferred).
  // Returns whether it is known.
  bool define(Case& c, json& let, const std::string& name, uint64_t size, bool may_be_unknown) {
    if (may_be_unknown && P(35)) return false;
    const std::string key = "c_" + name;
    switch (R(0, 4)) {
      case 0:
        let[name] = P(50) ? json(size) : json(std::to_string(size));
        break;
      case 1:
        c.config[key] = size + 3;
        let[name] = fmt::format("{} - 3", key);
        break;
      case 2:
        c.config[key] = size * 2;
        c.map["axes"][name] = fmt::format("({}) / 2", key);
        break;
      case 3:
        c.config[name] = size;
        break;
      default:
        c.map["axes"][name] = fmt::format("{} * 1 + 0", size);
        break;
    }
    return true;
  }

  std::string index_text(Case& c, json& let, const std::string& name, uint64_t v, json& out) {
    switch (R(0, 3)) {
      case 0:
        out = v;
        break;
      case 1:
        out = fmt::format("{} + 0", v);
        break;
      case 2:
        c.config["c_" + name] = v;
        out = "c_" + name;
        break;
      default:
        let[name] = v;
        out = name;
        break;
    }
    return {};
  }

  // A rows rearrangement for a tensor whose leading axes are split into `factors` (named
  // pre.0, pre.1, ...); `fixed_tail` extra single-name groups kept as they are after the first
  // RHS group (for concat parts, whose trailing axes must agree).
  void make_rows(Case& c, json& let, RefPart& p, const std::string& pre,
                 const std::vector<std::vector<uint64_t>>& factors, size_t fixed_tail,
                 bool one_group, std::string& text) {
    std::vector<std::string> all;
    std::string lhs_text;
    for (size_t g = 0; g < factors.size(); ++g) {
      std::vector<std::string> grp;
      bool unknown_used = false;
      for (size_t i = 0; i < factors[g].size(); ++i) {
        const std::string n = fmt::format("{}x{}_{}", pre, g, i);
        grp.push_back(n);
        p.size[n] = factors[g][i];
        if (!define(c, let, n, factors[g][i], !unknown_used)) unknown_used = true;
      }
      p.lhs.push_back(grp);
      if (grp.size() == 1 && P(70)) {
        lhs_text += grp[0] + " ";
      } else {
        lhs_text += "(" + fmt::format("{}", fmt::join(grp, " ")) + ") ";
      }
      if (g < factors.size() - fixed_tail) all.insert(all.end(), grp.begin(), grp.end());
    }
    // The RHS: the free names permuted and grouped (all in one group when tails are fixed), then
    // the fixed tail names.
    shuffle(all);
    std::vector<std::vector<std::string>> rhs;
    if (one_group) {
      rhs.push_back(all);
    } else {
      size_t i = 0;
      while (i < all.size()) {
        const size_t n = R(1, all.size() - i);
        rhs.emplace_back(all.begin() + static_cast<ptrdiff_t>(i),
                         all.begin() + static_cast<ptrdiff_t>(i + n));
        i += n;
      }
    }
    for (size_t g = factors.size() - fixed_tail; g < factors.size(); ++g) rhs.push_back(p.lhs[g]);
    std::string rhs_text;
    for (size_t g = 0; g < rhs.size(); ++g) {
      std::vector<std::string> items;
      for (const auto& n : rhs[g]) {
        std::string item = n;
        const uint64_t sz = p.size[n];
        const bool tail = g >= rhs.size() - fixed_tail;
        if (!tail && P(35)) {
          uint64_t lo, hi;
          if (P(4)) {
            lo = hi = R(0, sz);  // an empty slice
          } else {
            lo = R(0, sz - 1);
            hi = R(lo + 1, sz);
          }
          p.slice[n] = {lo, hi};
          std::string lo_t = std::to_string(lo), hi_t = std::to_string(hi);
          if (is_known(let, c, n) && P(50)) hi_t = fmt::format("{} - {}", n, sz - hi);
          if (P(20)) lo_t = fmt::format("({} * 2) / 2", lo);
          item += "[" + lo_t + ":" + hi_t + "]";
        }
        items.push_back(item);
      }
      if (items.size() == 1 && P(60)) {
        rhs_text += items[0] + " ";
      } else {
        rhs_text += "(" + fmt::format("{}", fmt::join(items, " ")) + ") ";
      }
    }
    p.rhs = rhs;
    p.rows = true;
    text = lhs_text + "-> " + rhs_text;
  }

  static bool is_known(const json& let, const Case& c, const std::string& n) {
    return let.contains(n) || c.config.contains(n) ||
           (c.map.contains("axes") && c.map["axes"].contains(n));
  }

  std::vector<uint64_t> factors(size_t n, uint64_t max) {
    std::vector<uint64_t> f;
    for (size_t i = 0; i < n; ++i) f.push_back(R(1, max));
    return f;
  }

  Stored& add_stored(Case& c, std::string name, DType dt, std::vector<uint64_t> shape,
                     uint32_t& idx) {
    idx = static_cast<uint32_t>(c.stored.size());
    c.stored.push_back(
        Stored{(prefixed_ && P(50) ? "model." : "") + std::move(name), dt, std::move(shape), {}});
    return c.stored.back();
  }

  DType dtype() {
    static const DType d[] = {DType::U8, DType::BF16, DType::F32, DType::F64, DType::I16};
    return d[R(0, 4)];
  }

  // One `from` rule: index (by literal, expression, config, let, or `for`), and rows.
  void single(Case& c, int k) {
    RefRule r;
    RefPart p;
    json rule, let = json::object();
    const DType dt = dtype();
    const uint64_t rank = R(1, 4);
    const uint64_t nidx = rank > 1 && P(40) ? R(1, std::min<uint64_t>(2, rank - 1)) : 0;
    std::vector<uint64_t> shape;
    for (uint64_t i = 0; i < nidx; ++i) shape.push_back(R(1, 3));
    const bool by_for = nidx > 0 && P(40);
    const bool matched = !by_for && P(20);
    const uint64_t rest_rank = rank - nidx;
    std::vector<std::vector<uint64_t>> fac;
    const bool rows = rest_rank >= 2 && P(85);
    for (;;) {
      fac.clear();
      uint64_t n = 1;
      for (uint64_t i = 0; i + 1 < rest_rank; ++i) {
        fac.push_back(factors(rows ? R(1, 3) : 1, rows ? 4 : 6));
        n *= numel(fac.back());
      }
      if (n <= 256) break;
    }
    std::vector<uint64_t> rest;
    for (const auto& f : fac) rest.push_back(numel(f));
    rest.push_back(R(1, 5));
    shape.insert(shape.end(), rest.begin(), rest.end());
    const std::string pre = fmt::format("r{}", k);
    json index = json::array();
    for (uint64_t d = 0; d < nidx; ++d) {
      const uint64_t v = R(0, shape[d] - 1);
      p.index.push_back(v);
      json e;
      if (d == 0 && by_for) {
        e = "L";
      } else {
        index_text(c, let, fmt::format("{}i{}", pre, d), v, e);
      }
      index.push_back(e);
    }
    p.by_for = by_for;
    r.hf = fmt::format("out.{}", k);
    std::string from = fmt::format("st.{}.w", k);
    if (by_for) {
      r.hf += ".{L}";
      for (uint64_t l = 0; l < shape[0]; ++l) r.binding.push_back(l);
      json count = shape[0];
      if (P(50)) {
        c.config[pre + "_n"] = shape[0];
        count = pre + "_n";
      }
      rule["for"] = {{"L", count}};
    }
    if (matched) {
      r.hf += ".{L}";
      std::vector<uint64_t> vals = {0, 1, 2, 5, 10, 11};
      shuffle(vals);
      vals.resize(R(1, 3));
      std::sort(vals.begin(), vals.end());
      r.binding = vals;
      for (auto l : vals) {
        uint32_t i;
        add_stored(c, fmt::format("st.{}.{}.w", k, l), dt, shape, i);
        p.stored.push_back(i);
      }
      from = fmt::format("st.{}.{{L}}.w", k);
    } else {
      uint32_t i;
      add_stored(c, from, dt, shape, i);
      p.stored.push_back(i);
    }
    rule["hf"] = r.hf;
    rule["from"] = from;
    if (nidx > 0) rule["index"] = index;
    if (rows) {
      std::string text;
      make_rows(c, let, p, pre, fac, 0, false, text);
      rule["rows"] = text;
    }
    if (!let.empty()) rule["let"] = let;
    r.parts.push_back(std::move(p));
    if (P(40)) {  // a `shape` check that holds
      std::vector<uint64_t> oshape;
      auto& s = c.stored[r.parts[0].stored[0]];
      s.data.assign(numel(s.shape) * esize(s.dtype), '\0');
      reference(s, r.parts[0], r.binding.empty() ? std::nullopt : std::optional{r.binding[0]},
                oshape);
      s.data.clear();
      rule["shape"] = oshape;
    }
    c.map["tensors"].push_back(rule);
    c.rules.push_back(std::move(r));
  }

  // A `concat` rule of 1-3 parts whose outputs agree beyond axis 0.
  void concat(Case& c, int k) {
    RefRule r;
    json rule, parts = json::array(), rule_let = json::object();
    const DType dt = dtype();
    const uint64_t trank = R(0, 2);
    std::vector<uint64_t> tail;
    for (uint64_t i = 0; i < trank; ++i) tail.push_back(R(1, 4));
    const bool by_for = P(25);
    const uint64_t nl = R(1, 3);
    r.hf = fmt::format("cat.{}", k);
    if (by_for) {
      r.hf += ".{L}";
      for (uint64_t l = 0; l < nl; ++l) r.binding.push_back(l);
      rule["for"] = {{"L", nl}};
    }
    const uint64_t nparts = R(1, 3);
    for (uint64_t pi = 0; pi < nparts; ++pi) {
      RefPart p;
      json part, let = json::object();
      const bool part_let = P(50);
      json& lets = part_let ? let : rule_let;
      const std::string pre = fmt::format("c{}p{}", k, pi);
      std::vector<uint64_t> shape;
      json index = json::array();
      if (by_for) {
        shape.push_back(nl);
        p.by_for = true;
        p.index.push_back(0);
        index.push_back("L");
      }
      if (P(30)) {
        const uint64_t n = R(1, 3), v = R(0, n - 1);
        shape.push_back(n);
        p.index.push_back(v);
        json e;
        index_text(c, lets, pre + "i", v, e);
        index.push_back(e);
      }
      const bool rows = trank >= 1 && P(70);
      std::vector<std::vector<uint64_t>> fac;
      if (rows) {
        fac.push_back(factors(R(1, 3), 3));
        for (size_t i = 0; i + 1 < tail.size(); ++i) fac.push_back({tail[i]});
        shape.push_back(numel(fac[0]));
      } else {
        shape.push_back(R(1, 4));
      }
      shape.insert(shape.end(), tail.begin(), tail.end());
      uint32_t si;
      const auto& s = add_stored(c, fmt::format("st.{}.{}.w", k, pi), dt, shape, si);
      p.stored.push_back(si);
      part["from"] = s.name.starts_with("model.") ? s.name.substr(6) : s.name;
      if (!index.empty()) part["index"] = index;
      if (rows) {
        std::string text;
        make_rows(c, lets, p, pre, fac, fac.size() - 1, true, text);
        part["rows"] = text;
      }
      if (!let.empty()) part["let"] = let;
      parts.push_back(part);
      r.parts.push_back(std::move(p));
    }
    rule["hf"] = r.hf;
    rule["concat"] = parts;
    if (!rule_let.empty()) rule["let"] = rule_let;
    c.map["tensors"].push_back(rule);
    c.rules.push_back(std::move(r));
  }

  Case make() {
    Case c;
    prefixed_ = P(30);
    c.map = {{"ckptfs_map", 1}, {"name", "random"}, {"tensors", json::array()}};
    if (prefixed_) c.map["prefixes"] = {"model."};
    const int nrules = static_cast<int>(R(1, 4));
    for (int k = 0; k < nrules; ++k) {
      if (P(30)) {
        concat(c, k);
      } else {
        single(c, k);
      }
    }
    // Tensors that are dropped, by pattern or by a `when` that does not hold; an optional
    // rule that reads nothing.
    if (P(40)) {
      uint32_t i;
      add_stored(c, fmt::format("junk.{}.buf", R(0, 99)), DType::U8, {R(1, 5)}, i);
      c.map["drop"] = {"junk.*"};
    }
    if (P(30)) {
      uint32_t i;
      add_stored(c, "head.w", DType::F32, {2, 3}, i);
      c.config["tied"] = true;
      c.map["tensors"].push_back({{"hf", "lm_head"}, {"from", "head.w"}, {"when", "!tied"}});
    }
    if (P(20)) {
      c.map["tensors"].push_back({{"hf", "maybe"}, {"from", "absent.w"}, {"optional", true}});
    }
    return c;
  }

 private:
  bool prefixed_ = false;
};

// Compiles one random case and checks every byte of every output.
void check_case(uint64_t seed, int* ran_rows = nullptr) {
  Gen g(seed);
  Case c = g.make();
  std::mt19937_64 rng(seed * 7919 + 1);
  layout::BuildOptions opts;
  opts.map = map_of(c.map);
  opts.hf_config = c.config.dump();
  // Stored tensors hold random bytes: fill before the reference reads them.
  for (auto& s : c.stored) s.data = test::random_bytes(rng, numel(s.shape) * esize(s.dtype));
  auto v = build_view(c.stored, opts, rng, static_cast<int>(1 + seed % 3));
  SCOPED_TRACE(fmt::format("seed {}\nmap {}\nconfig {}", seed, c.map.dump(), c.config.dump()));
  ASSERT_TRUE(v.ck->valid()) << problems(*v.ck);
  const auto want = expected_of(c);
  ASSERT_EQ(v.ck->tensors.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    const auto& t = v.ck->tensors[i];
    EXPECT_EQ(t.name, want[i].name);
    EXPECT_EQ(t.dtype, want[i].dtype) << t.name;
    EXPECT_EQ(t.shape, want[i].shape) << t.name;
    EXPECT_EQ(t.nbytes, want[i].bytes.size()) << t.name;
  }
  if (ran_rows) {
    for (const auto& r : c.rules) {
      for (const auto& p : r.parts) *ran_rows += p.rows;
    }
  }
  // Every output file read whole, its header parsed, every tensor's bytes compared; then random
  // sub-ranges against the whole read.
  for (uint32_t f = 0; f < v.ck->outputs.size(); ++f) {
    const auto& out = v.ck->outputs[f];
    const std::string whole = read_range(v, f, 0, out.size);
    ASSERT_EQ(whole.size(), out.size);
    ASSERT_EQ(whole.substr(0, out.header.size()), out.header);
    uint64_t hlen = 0;
    for (int b = 7; b >= 0; --b)
      hlen = hlen << 8 | static_cast<unsigned char>(whole[static_cast<size_t>(b)]);
    const json h = json::parse(whole.substr(8, hlen));
    for (uint32_t ti : out.tensors) {
      const auto& t = v.ck->tensors[ti];
      const auto& w = want[ti];
      EXPECT_EQ(whole.substr(t.out_offset, t.nbytes), w.bytes) << t.name;
      ASSERT_TRUE(h.contains(t.name)) << t.name;
      EXPECT_EQ(h[t.name]["dtype"], std::string(format::dtype_name(w.dtype)));
      EXPECT_EQ(h[t.name]["shape"].get<std::vector<uint64_t>>(), w.shape);
      EXPECT_EQ(h[t.name]["data_offsets"][0].get<uint64_t>() + 8 + hlen, t.out_offset);
      EXPECT_EQ(h[t.name]["data_offsets"][1].get<uint64_t>() + 8 + hlen, t.out_offset + t.nbytes);
    }
    for (int i = 0; i < 8; ++i) {
      const uint64_t a = rng() % (out.size + 1);
      const uint64_t n = rng() % (out.size - a + 1);
      ASSERT_EQ(read_range(v, f, a, n), whole.substr(a, n)) << "range " << a << "+" << n;
    }
  }
}

TEST(MapProperty, RandomMapsMatchANaiveReference) {
  const auto t0 = std::chrono::steady_clock::now();
  int rows = 0;
  const int cases = 300;
  for (uint64_t seed = 1; seed <= cases; ++seed) {
    check_case(seed, &rows);
    if (::testing::Test::HasFailure()) return;
  }
  EXPECT_GT(rows, cases / 2) << "the generator should exercise rows rearrangements";
  const auto secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  RecordProperty("seconds", fmt::format("{:.2f}", secs));
}

}  // namespace

// =========================================================================================
// Rows naming every axis; the hf_config template; Megatron-LM's args in common.pt
// =========================================================================================

TEST(MapCompile, RowsNamingEveryAxisSplitABiasLikeItsWeight) {
  // A stacked fused bias [L=2, groups 2 x part 6]: q is part[0:4], k part[4:5], v part[5:6].
  const json map = map_with(json::array({{{"hf", "q.{L}"},
                                          {"from", "b"},
                                          {"for", {{"L", 2}}},
                                          {"index", {"L"}},
                                          {"rows", "(g part) -> (g part[0:4])"},
                                          {"let", {{"g", 2}}},
                                          {"shape", {8}}},
                                         {{"hf", "k.{L}"},
                                          {"from", "b"},
                                          {"for", {{"L", 2}}},
                                          {"index", {"L"}},
                                          {"rows", "(g part) -> (g part[4:5])"},
                                          {"let", {{"g", 2}}}},
                                         {{"hf", "v.{L}"},
                                          {"from", "b"},
                                          {"for", {{"L", 2}}},
                                          {"index", {"L"}},
                                          {"rows", "(g part) -> (g part[5:6])"},
                                          {"let", {{"g", 2}}}}}));
  std::vector<Stored> stored = {st("b", {2, 12}, DType::BF16)};
  auto v = compile(map, json::object(), stored);
  ASSERT_TRUE(v.ck->valid()) << problems(*v.ck);
  const auto& d = stored[0].data;
  for (uint64_t l = 0; l < 2; ++l) {
    std::vector<uint64_t> q, k, vv;
    for (uint64_t g = 0; g < 2; ++g) {
      for (uint64_t j = 0; j < 4; ++j) q.push_back(l * 12 + g * 6 + j);
      k.push_back(l * 12 + g * 6 + 4);
      vv.push_back(l * 12 + g * 6 + 5);
    }
    EXPECT_EQ(tensor_bytes(v, fmt::format("q.{}", l)), rows_of(d, 2, q));
    EXPECT_EQ(tensor_bytes(v, fmt::format("k.{}", l)), rows_of(d, 2, k));
    EXPECT_EQ(tensor_bytes(v, fmt::format("v.{}", l)), rows_of(d, 2, vv));
    EXPECT_EQ(find_tensor(*v.ck, fmt::format("k.{}", l))->shape, std::vector<uint64_t>{2});
  }
  // A 1-D tensor's one axis named: allowed.
  auto bad = compile(
      one_rule({{"hf", "x"}, {"from", "b"}, {"rows", "(g part) -> (g part)"}, {"let", {{"g", 2}}}}),
      json::object(), {st("b", {12})});
  ASSERT_TRUE(bad.ck->valid()) << problems(*bad.ck);  // every axis: allowed
  auto bad2 = compile(one_rule({{"hf", "x"}, {"from", "b"}, {"rows", "a -> a"}}), json::object(),
                      {st("b", {2, 3, 4})});
  EXPECT_PROBLEM(bad2, "b", "describes 1 axes", "has 2 leading axes", "1-D tensor's one axis");
  // Naming every axis of a 2-D tensor would be a transpose in runs of one element: refused.
  auto tr = compile(one_rule({{"hf", "x"}, {"from", "b"}, {"rows", "a b -> b a"}}), json::object(),
                    {st("b", {3, 4})});
  EXPECT_PROBLEM(tr, "b", "describes 2 axes", "has 1 leading axes");
}

TEST(MapParse, HfConfigTemplatesAreChecked) {
  const json rule = {{"hf", "a"}, {"from", "a"}};
  auto with = [&](json h, json extra = json::object()) {
    json m = one_rule(rule, extra);
    m["hf_config"] = std::move(h);
    return m;
  };
  EXPECT_EQ(refusal(with({{"model_type", "llama"},
                          {"n", {{"$int", "a | b / 2"}}},
                          {"t", {{"$bool", "!x.y"}, {"else", true}}},
                          {"e", {{"$copy", "eps | layernorm_epsilon"}}},
                          {"k", {{"$int", "g"}, {"if", "gqa"}, {"else", {{"$int", "h"}}}}},
                          {"nested", {{"list", {1, {{"$copy", "x"}}}}}}},
                         {{"hf_config_requires", {{"swiglu", true}, {"norm", "RMSNorm"}}}})),
            "");
  expect_refused(with(json::array()), {"'hf_config' is", "not an object"});
  expect_refused(with({{"$int", "a"}}), {"'hf_config' is"});
  expect_refused(with({{"n", {{"$int", "a +"}}}}), {"hf_config 'n'", "expression"});
  expect_refused(with({{"n", {{"$int", "a"}, {"$copy", "b"}}}}), {"exactly one of"});
  expect_refused(with({{"n", {{"$bool", "a b"}}}}), {"'$bool'", "not a field"});
  expect_refused(with({{"n", {{"$copy", "a | | b"}}}}), {"'$copy'", "field | field"});
  expect_refused(with({{"n", {{"$copy", "a"}, {"if", "!"}}}}), {"'if'"});
  expect_refused(with({{"n", {{"$copy", "a"}, {"unless", "b"}}}}), {"'unless'", "unknown key"});
  expect_refused(with({{"n", {{"$copy", "a"}, {"else", {{"$int", "("}}}}}}), {"expression"});
  expect_refused(one_rule(rule, {{"hf_config_requires", {{"a", 1}}}}), {"hf_config_requires"});
  expect_refused(with({{"n", 1}}, {{"hf_config_requires", {{"a", json::array()}}}}),
                 {"hf_config_requires", "'a'"});
  // $leading (with 'of' and 'then') and $map (with 'cases'): their keys go together.
  EXPECT_EQ(refusal(with({{"k", {{"$leading", "freq"}, {"of", 0}, {"then", 1}, {"else", 0}}},
                          {"m", {{"$map", "rope_type"}, {"cases", {{"rope", "default"}}}}},
                          {"b", {{"$map", "topk"}, {"cases", {{"1", false}}}, {"else", true}}}})),
            "");
  expect_refused(with({{"k", {{"$leading", "freq"}, {"of", 0}}}}), {"'of' and 'then'"});
  expect_refused(with({{"k", {{"$int", "a"}, {"of", 0}, {"then", 1}}}}), {"'of' and 'then'"});
  expect_refused(with({{"k", {{"$leading", "freq"}, {"of", "0"}, {"then", 1}}}}),
                 {"'of'", "not an integer or a bool"});
  expect_refused(with({{"k", {{"$leading", "a b"}, {"of", 0}, {"then", 1}}}}), {"not a field"});
  expect_refused(with({{"m", {{"$map", "a"}}}}), {"'cases' goes with $map"});
  expect_refused(with({{"m", {{"$copy", "a"}, {"cases", {{"x", 1}}}}}}), {"'cases' goes with"});
  expect_refused(with({{"m", {{"$map", "a"}, {"cases", json::object()}}}}), {"1 to"});
  // A case's value is a template value itself, checked as one; $refuse takes a reason.
  EXPECT_EQ(refusal(with({{"m", {{"$map", "a"}, {"cases", {{"x", {{"$int", "b"}}}}}}},
                          {"r", {{"$refuse", "why"}, {"if", "c"}}}})),
            "");
  expect_refused(with({{"m", {{"$map", "a"}, {"cases", {{"x", {{"$int", "b +"}}}}}}}}),
                 {"hf_config 'm[x]'", "expression"});
  expect_refused(with({{"m", {{"$map", "a"}, {"cases", {{"x", {{"$copy", "a"}, {"u", 1}}}}}}}}),
                 {"'u'", "unknown key"});
  expect_refused(with({{"r", {{"$refuse", ""}}}}), {"'$refuse'", "reason"});
  expect_refused(with({{"r", {{"$refuse", 1}}}}), {"'$refuse'", "reason"});
  expect_refused(with({{"r", {{"$refuse", "a"}, {"$copy", "b"}}}}), {"exactly one of"});
  // Deep templates are bounded by the strict JSON's depth; wide ones by a count.
  json wide = json::object();
  for (int i = 0; i < 5000; ++i) wide[fmt::format("k{}", i)] = i;
  expect_refused(with(wide), {"more than 4096 values"});
}

// A tiny Megatron GPT's stored tensors and a map reading its sizes from a template.
std::vector<Stored> meg_tiny() {
  return {st("embedding.word_embeddings.weight", {12, 8}),
          st("decoder.final_layernorm.weight", {8}),
          st("decoder.layers.mlp.linear_fc2.weight", {2, 8, 6})};
}
json meg_template_map() {
  return map_with(json::array({{{"hf", "model.embed_tokens.weight"},
                                {"from", "embedding.word_embeddings.weight"},
                                {"rows", "v -> v[0:vocab_size]"}},
                               {{"hf", "model.norm.weight"},
                                {"from", "decoder.final_layernorm.weight"},
                                {"shape", {"hidden_size"}}},
                               {{"hf", "model.layers.{L}.mlp.down_proj.weight"},
                                {"from", "decoder.layers.mlp.linear_fc2.weight"},
                                {"for", {{"L", "num_hidden_layers"}}},
                                {"index", {"L"}},
                                {"shape", {"hidden_size", "intermediate_size"}}}}),
                  {{"detect", {{"all", {"embedding.word_embeddings.weight"}}}},
                   {"hf_config",
                    {{"architectures", {"LlamaForCausalLM"}},
                     {"hidden_size", {{"$int", "hidden_size"}}},
                     {"intermediate_size", {{"$int", "ffn_hidden_size"}}},
                     {"num_hidden_layers", {{"$int", "num_layers"}}},
                     {"num_key_value_heads",
                      {{"$int", "num_query_groups"},
                       {"if", "group_query_attention"},
                       {"else", {{"$int", "num_attention_heads"}}}}},
                     {"vocab_size", {{"$int", "padded_vocab_size | vocab_size"}}},
                     {"rms_norm_eps", {{"$copy", "norm_epsilon | layernorm_epsilon"}}},
                     {"tie_word_embeddings", {{"$bool", "!untie_embeddings_and_output_weights"}}},
                     {"rope_theta", {{"$copy", "rotary_base"}, {"else", 10000}}},
                     {"moe", {{"$int", "num_experts"}, {"if", "num_experts"}}},
                     {"dtype", {{"$copy", "params_dtype"}}}}},
                   {"hf_config_requires", {{"swiglu", true}, {"rotary_percent", 1.0}}}});
}
json meg_args() {
  return {{"num_layers", 2},
          {"hidden_size", 8},
          {"ffn_hidden_size", 6},
          {"num_attention_heads", 4},
          {"num_query_groups", 1},
          {"group_query_attention", false},
          {"vocab_size", nullptr},
          {"padded_vocab_size", 12},
          {"layernorm_epsilon", 1e-5},
          {"untie_embeddings_and_output_weights", true},
          {"swiglu", true},
          {"rotary_percent", 1},
          {"num_experts", nullptr},
          {"params_dtype", "bfloat16"}};
}

View build_native(const json& map, const json& native, bool named, std::string own = {},
                  std::string hf_config = {}) {
  std::mt19937_64 rng(3);
  std::vector<Stored> stored = meg_tiny();
  layout::BuildOptions opts;
  if (named) opts.map = map_of(map);
  opts.hf_config = std::move(hf_config);
  return build_view(stored, opts, rng, 2, "Megatron-Core torch_dist", std::move(own),
                    native.dump());
}

TEST(MapNative, TheTemplateMakesConfigJsonFromTheNativeConfigAndSizesTheMap) {
  auto v = build_native(meg_template_map(), meg_args(), true);
  ASSERT_TRUE(v.ck->valid()) << problems(*v.ck);
  EXPECT_EQ(v.ck->tensors.size(), 4u);
  const json c = json::parse(v.ck->config_json);
  const json want = {{"architectures", {"LlamaForCausalLM"}},
                     {"hidden_size", 8},
                     {"intermediate_size", 6},
                     {"num_hidden_layers", 2},
                     {"num_key_value_heads", 4},  // no GQA: the heads, not num_query_groups
                     {"vocab_size", 12},          // the padded vocabulary
                     {"rms_norm_eps", 1e-5},
                     {"tie_word_embeddings", false},
                     {"rope_theta", 10000},   // absent: the else
                     {"dtype", "bfloat16"}};  // "moe": its `if` does not hold, left out
  EXPECT_EQ(c, want) << c.dump();
  // With GQA the groups; a field present wins over the else; a directory's own config.json and
  // -o hf_config win over the template (and the view shows no made config.json).
  json a = meg_args();
  a["group_query_attention"] = true;
  a["num_query_groups"] = 2;
  a["rotary_base"] = 500000;
  a["num_experts"] = 8;
  auto g = build_native(meg_template_map(), a, true);
  ASSERT_TRUE(g.ck->valid()) << problems(*g.ck);
  const json gc = json::parse(g.ck->config_json);
  EXPECT_EQ(gc["num_key_value_heads"], 2);
  EXPECT_EQ(gc["rope_theta"], 500000);
  EXPECT_EQ(gc["moe"], 8);
  const json own = {
      {"hidden_size", 8}, {"intermediate_size", 6}, {"num_hidden_layers", 2}, {"vocab_size", 10}};
  auto o = build_native(meg_template_map(), meg_args(), true, own.dump());
  ASSERT_TRUE(o.ck->valid()) << problems(*o.ck);
  EXPECT_TRUE(o.ck->config_json.empty());
  EXPECT_EQ(find_tensor(*o.ck, "model.embed_tokens.weight")->shape[0], 10u);
  auto h = build_native(meg_template_map(), meg_args(), true, {}, own.dump());
  ASSERT_TRUE(h.ck->valid()) << problems(*h.ck);
  EXPECT_EQ(json::parse(h.ck->config_json), own);
  // Detected (not named): the same, from the detect clause.
  auto d = build_native(meg_template_map(), meg_args(), false);
  (void)d;  // the built-ins are detected, not this map: covered through the mount
}

TEST(MapNative, WhatTheTemplateCannotMakeIsRefusedNamingTheFieldAndTheFile) {
  json a = meg_args();
  a["swiglu"] = false;
  auto r = build_native(meg_template_map(), a, true);
  EXPECT_PROBLEM(r, "", "common.pt (Megatron-LM's args)", "hf_config_requires", "swiglu");
  json b = meg_args();
  b.erase("num_layers");
  auto m = build_native(meg_template_map(), b, true);
  EXPECT_PROBLEM(m, "", "hf_config 'num_hidden_layers'", "num_layers", "common.pt");
  json c = meg_args();
  c["untie_embeddings_and_output_weights"] = "yes";
  auto t = build_native(meg_template_map(), c, true);
  EXPECT_PROBLEM(t, "", "tie_word_embeddings", "not a boolean");
  // Sizes that disagree with the stored shapes: the rule and the tensor.
  json d = meg_args();
  d["ffn_hidden_size"] = 5;
  auto s = build_native(meg_template_map(), d, true);
  EXPECT_PROBLEM(s, "decoder.layers.mlp.linear_fc2.weight", "rule 3", "intermediate_size");
  // No template: the native config sizes nothing.
  json plain = meg_template_map();
  plain.erase("hf_config");
  plain.erase("hf_config_requires");
  auto n = build_native(plain, meg_args(), true);
  EXPECT_PROBLEM(n, "", "has no 'hf_config' template");
}

TEST(MapNative, LeadingCountsASplitPointAndMapLooksUpAValue) {
  // DeepSeek V3's first_k_dense_replace from Megatron-LM's moe_layer_freq (a list, or 1: every
  // layer MoE), its norm_topk_prob from moe_router_topk, its rope type from rope_type.
  json map = meg_template_map();
  map["hf_config"]["first_k_dense_replace"] = {
      {"$leading", "moe_layer_freq"}, {"of", 0}, {"then", 1}, {"else", 0}};
  map["hf_config"]["norm_topk_prob"] = {
      {"$map", "moe_router_topk"}, {"cases", {{"1", false}}}, {"else", true}};
  map["hf_config"]["rope_type"] = {{"$map", "rope_type"}, {"cases", {{"rope", "default"}}}};
  const auto config = [&](const json& changes) {
    json a = meg_args();
    a["rope_type"] = "rope";
    a.update(changes);
    return build_native(map, a, true);
  };
  struct Want {
    json changes;
    uint64_t dense;
    bool norm;
  };
  for (const auto& w : std::vector<Want>{
           {{{"moe_layer_freq", {0, 0, 1, 1}}, {"moe_router_topk", 8}}, 2, true},
           {{{"moe_layer_freq", {1, 1}}, {"moe_router_topk", 1}}, 0, false},
           {{{"moe_layer_freq", {false, true}}}, 1, true},  // bools as 0 and 1; topk absent
           {{{"moe_layer_freq", 1}}, 0, true},              // 1: every layer
           {{{"moe_layer_freq", {0, 0}}}, 2, true},         // no MoE layer at all
           {json::object(), 0, true}}) {                    // absent: the else
    auto v = config(w.changes);
    ASSERT_TRUE(v.ck->valid()) << w.changes.dump() << problems(*v.ck);
    const json c = json::parse(v.ck->config_json);
    EXPECT_EQ(c["first_k_dense_replace"], w.dense) << w.changes.dump();
    EXPECT_EQ(c["norm_topk_prob"], w.norm) << w.changes.dump();
    EXPECT_EQ(c["rope_type"], "default");
  }
  // What the HF architecture cannot say is refused, naming the key, the field and the element.
  {
    auto r = config({{"moe_layer_freq", {0, 1, 0, 1}}});
    EXPECT_PROBLEM(r, "", "'first_k_dense_replace'", "moe_layer_freq[2] is 0", "common.pt");
  }
  {
    auto r = config({{"moe_layer_freq", 2}});
    EXPECT_PROBLEM(r, "", "moe_layer_freq is 2", "neither a list nor 1");
  }
  {
    auto r = config({{"moe_layer_freq", {0, 7}}});
    EXPECT_PROBLEM(r, "", "moe_layer_freq[1] is 7");
  }
  {
    auto r = config({{"rope_type", "yarn"}});
    EXPECT_PROBLEM(r, "", "'rope_type'", "\"yarn\"", "not one of rope");
  }
  {
    auto r = config({{"rope_type", nullptr}});
    EXPECT_PROBLEM(r, "", "'rope_type'", "no value for rope_type");
  }
  {
    auto r = config({{"rope_type", 1.5}});
    EXPECT_PROBLEM(r, "", "'rope_type'", "rope_type is 1.5, not one of rope");
  }
  {
    auto r = config({{"rope_type", json::array()}});
    EXPECT_PROBLEM(r, "", "'rope_type'", "not a string, a number or a bool");
  }
}

TEST(MapNative, DeepSeekRopeIsDefaultOrYarnAsMegatronCoreComputesIt) {
  // The built-in megatron-deepseek-v3 template's rope_parameters: $map cases that are templates
  // themselves, a "null" case (rope_type None: yarn under MLA, Megatron-LM's default), numbers
  // matched as numbers (mscale 1 and 1.0 alike), and $refuse where HF's DeepSeek V3 would compute
  // another rotary embedding than Megatron-Core's YarnRotaryEmbedding.
  const auto builtin = format::find_builtin_map("megatron-deepseek-v3");
  ASSERT_NE(builtin, nullptr);
  json map = meg_template_map();
  map["hf_config"]["rope_parameters"] = builtin->hf_config.at("rope_parameters");
  const auto rope = [&](const json& changes) {
    json a = meg_args();
    a["rotary_base"] = 10000.0;
    a.update(changes);
    return build_native(map, a, true);
  };
  const auto rendered = [&](const json& changes) {
    auto v = rope(changes);
    EXPECT_TRUE(v.ck->valid()) << changes.dump() << problems(*v.ck);
    return v.ck->valid() ? json::parse(v.ck->config_json)["rope_parameters"] : json();
  };
  EXPECT_EQ(rendered({{"rope_type", "rope"}, {"rotary_scaling_factor", 40.0}}),
            json({{"rope_type", "default"}, {"rope_theta", 10000.0}}));
  // Megatron-LM's args for DeepSeek V2-Lite: --rotary-scaling-factor 40 --mscale 0.707
  // --mscale-all-dim 0.707; beta_fast, beta_slow and original_max_position_embeddings are not
  // Megatron-LM arguments: MLATransformerConfig's defaults, unless the args carry them.
  const json v2lite = {{"rope_type", nullptr},
                       {"rotary_scaling_factor", 40.0},
                       {"mscale", 0.707},
                       {"mscale_all_dim", 0.707}};
  const json yarn = {{"rope_type", "yarn"}, {"rope_theta", 10000.0},
                     {"factor", 40.0},      {"original_max_position_embeddings", 4096},
                     {"beta_fast", 32},     {"beta_slow", 1},
                     {"mscale", 0.707},     {"mscale_all_dim", 0.707}};
  EXPECT_EQ(rendered(v2lite), yarn);
  json named = v2lite;
  named["rope_type"] = "yarn";
  EXPECT_EQ(rendered(named), yarn);
  json absent = v2lite;
  absent.erase("rope_type");
  EXPECT_EQ(rendered(absent), yarn);
  json carried = v2lite;
  carried.update({{"original_max_position_embeddings", 16}, {"beta_fast", 8}, {"beta_slow", 2}});
  EXPECT_EQ(rendered(carried)["original_max_position_embeddings"], 16);
  EXPECT_EQ(rendered(carried)["beta_fast"], 8);
  // Megatron-LM's defaults (mscale 1.0, mscale_all_dim 0.0): HF computes the same with the 0.
  auto d = rendered({{"rope_type", "yarn"},
                     {"rotary_scaling_factor", 4.0},
                     {"mscale", 1},
                     {"mscale_all_dim", 0.0}});
  EXPECT_EQ(d["mscale"], 1);
  EXPECT_EQ(d["mscale_all_dim"], 0.0);
  EXPECT_EQ(d["factor"], 4.0);
  {
    auto r = rope({{"rope_type", "yarn"}, {"mscale", 0.707}, {"mscale_all_dim", 0.0}});
    EXPECT_PROBLEM(r, "", "'rope_parameters[yarn].mscale_all_dim[0]'", "would ignore mscale",
                   "common.pt");
  }
  {
    auto r = rope({{"rope_type", nullptr}, {"mscale", 0}, {"mscale_all_dim", 1.0}});
    EXPECT_PROBLEM(r, "", "'rope_parameters[null].mscale[0]'", "mscale 0 under yarn");
  }
  {
    auto r = rope({{"rope_type", "ntk"}});
    EXPECT_PROBLEM(r, "", "rope_type is \"ntk\", not one of null, rope, yarn");
  }
}

// ---- Megatron-LM's args in common.pt ----------------------------------------------------

std::string args_seed(const std::string& name) {
  const char* d = std::getenv("CKPTFS_ARGS_SEEDS");
  const std::filesystem::path dir = d ? d : std::filesystem::path("tests/fuzz/seeds-args");
  std::ifstream f(dir / name, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

TEST(MegatronArgs, ReadsTheArgsMegatronLmSaves) {
  // Megatron-LM core_v0.16.1's parse_args (655 fields, with AttnBackend, signal.Signals and
  // torch dtypes in them), torch.save'd as its save_checkpoint does.
  const auto bytes = args_seed("megatron-lm-core_v0.16.1-args.pt");
  ASSERT_FALSE(bytes.empty()) << "set CKPTFS_ARGS_SEEDS";
  auto a = format::read_megatron_args(bytes, "iter_0000010/common.pt");
  ASSERT_TRUE(a) << a.error().message;
  EXPECT_EQ((*a)["num_layers"], 2);
  EXPECT_EQ((*a)["num_query_groups"], 2);
  EXPECT_EQ((*a)["group_query_attention"], true);
  EXPECT_EQ((*a)["layernorm_epsilon"], 1e-5);
  EXPECT_EQ((*a)["params_dtype"], "bfloat16");
  EXPECT_EQ((*a)["normalization"], "RMSNorm");
  EXPECT_EQ((*a)["vocab_size"], 200);
  EXPECT_TRUE((*a)["padded_vocab_size"].is_null());
  EXPECT_FALSE(a->contains("attention_backend"));  // an enum: left out
  EXPECT_FALSE(a->contains("cuda_graph_scope"));   // an empty list: left out
  EXPECT_GT(a->size(), 500u);
  // The data.pkl alone reads the same.
  auto p = format::parse_megatron_args_pickle(args_seed("megatron-lm-core_v0.16.1-args.pkl"), "p");
  ASSERT_TRUE(p) << p.error().message;
  EXPECT_EQ(*p, *a);
}

std::string pkl(std::string_view body) { return std::string("\x80\x02", 2) + std::string(body); }
std::string str(std::string_view s) {
  return "X" + std::string{static_cast<char>(s.size()), 0, 0, 0} + std::string(s);
}

TEST(MegatronArgs, HostileOrForeignCommonPtIsRefusedNamingTheFile) {
  const auto ns = [](std::string fields) {
    return pkl("}" + str("args") + "cargparse\nNamespace\n)\x81}(" + fields + "ubs.");
  };
  auto ok = format::parse_megatron_args_pickle(
      ns(str("num_layers") + "K\x03" + str("params_dtype") + "ctorch\nbfloat16\n" + str("x") + "N" +
         str("num_layers") + "K\x04"),
      "common.pt");
  ASSERT_TRUE(ok) << ok.error().message;
  EXPECT_EQ((*ok)["num_layers"], 4);  // set twice: the last wins
  EXPECT_EQ((*ok)["params_dtype"], "bfloat16");
  EXPECT_TRUE((*ok)["x"].is_null());
  // Lists and tuples of ints and bools are kept (moe_layer_freq's pattern); other lists, empty
  // ones and longer ones than the cap are left out.
  std::string longer = "](";
  for (int i = 0; i < 4097; ++i) longer += "K\x01";
  longer += "e";
  const std::string zero("K\x00", 2), one_f("G?\xf0\x00\x00\x00\x00\x00\x00", 9);
  auto lists = format::parse_megatron_args_pickle(
      ns(str("freq") + "](" + zero + "K\x01" + "\x88" + "e" + str("tup") + "(K\x02" + "\x89" + "t" +
         str("names") + "](" + str("full") + "e" + str("mixed") + "](K\x01" + one_f + "e" +
         str("long") + longer + str("empty") + "]"),
      "common.pt");
  ASSERT_TRUE(lists) << lists.error().message;
  EXPECT_EQ((*lists)["freq"], json::array({0, 1, true}));
  EXPECT_EQ((*lists)["tup"], json::array({2, false}));
  EXPECT_FALSE(lists->contains("empty"));  // says nothing
  EXPECT_FALSE(lists->contains("names"));
  EXPECT_FALSE(lists->contains("mixed"));
  EXPECT_FALSE(lists->contains("long"));
  struct Case {
    std::string bytes;
    std::vector<std::string_view> says;
  };
  const std::vector<Case> cases = {
      {pkl("}" + str("args") + "cposix\nsystem\n" + str("true") + "\x85Rs."),
       {"common.pt", "posix.system", "not one this reader allows"}},
      {pkl("}" + str("args") + "cbuiltins\neval\n)\x81s."), {"builtins.eval"}},
      {pkl("}" + str("iteration") + "K\x0as."), {"no 'args'"}},
      {pkl("}" + str("args") + "K\x01s."), {"'args'", "argparse.Namespace"}},
      {pkl("]."), {"a dict"}},
      {pkl("}" + str("args") + "cargparse\nNamespace\n)\x81}(K\x01K\x02ubs."), {"a str"}},
      {ns(str("bad") + std::string("X\x02\x00\x00\x00\xff\xfe", 7)), {"not valid UTF-8"}},
      {pkl("}("), {"without STOP"}},
  };
  for (const auto& c : cases) {
    auto r = format::parse_megatron_args_pickle(std::string(c.bytes), "common.pt");
    ASSERT_FALSE(r) << c.says.front();
    for (auto s : c.says)
      EXPECT_NE(r.error().message.find(s), std::string::npos) << r.error().message;
  }
  // Not a zip, a truncated one, one without data.pkl: refused naming the file.
  for (std::string bad :
       {std::string("\x80\x02}."), args_seed("megatron-lm-core_v0.16.1-args.pt").substr(0, 4000),
        std::string(40, 'P')}) {
    auto r = format::read_megatron_args(bad, "iter_0000010/common.pt");
    ASSERT_FALSE(r);
    EXPECT_NE(r.error().message.find("iter_0000010/common.pt"), std::string::npos)
        << r.error().message;
  }
  // Many fields: capped.
  std::string many;
  for (int i = 0; i < 5000; ++i) many += str(fmt::format("f{}", i)) + "K\x01";
  auto m = format::parse_megatron_args_pickle(ns(many), "common.pt");
  ASSERT_FALSE(m);
  EXPECT_NE(m.error().message.find("more than 4096 fields"), std::string::npos)
      << m.error().message;
}
