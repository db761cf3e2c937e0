// format/yaml (the YAML subset PyYAML's safe_dump writes) and format/transformer_config
// (Megatron-Bridge's run_config.yaml as a native config). The expected values are PyYAML 6's
// yaml.safe_load of the same text.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "ckptfs/format/transformer_config.hpp"
#include "ckptfs/format/yaml.hpp"

using namespace ckptfs;
using namespace ckptfs::format;
using nlohmann::json;

namespace {

// Two model fields as Megatron-Bridge's to_yaml writes them: a callable referenced (not called),
// and an enum constructed.
constexpr const char* kBridgeTargets =
    "  activation_func:\n"
    "    _call_: false\n"
    "    _target_: torch.nn.functional.silu\n"
    "  attention_backend:\n"
    "    _args_:\n"
    "    - 5\n"
    "    _call_: true\n"
    "    _target_: megatron.core.transformer.enums.AttnBackend\n";

json yaml(std::string_view text) {
  auto r = parse_yaml(text, "t.yaml");
  EXPECT_TRUE(r.ok()) << (r.ok() ? "" : r.error().message) << "\n" << text;
  return r.ok() ? *r : json("<error>");
}

void refused(std::string_view text, std::string_view needle) {
  auto r = parse_yaml(text, "t.yaml");
  ASSERT_FALSE(r.ok()) << "accepted: " << text << "\n-> " << r->dump();
  EXPECT_NE(r.error().message.find(needle), std::string::npos) << r.error().message;
  EXPECT_NE(r.error().message.find("t.yaml"), std::string::npos) << r.error().message;
}

TEST(Yaml, PlainScalarsResolveAsSafeLoaderDoes) {
  const std::pair<const char*, json> cases[] = {
      {"a: 1", 1},
      {"a: -17", -17},
      {"a: +5", 5},
      {"a: 0", 0},
      {"a: 0x1F", 31},
      {"a: 0o17", "0o17"},  // YAML 1.2's octal is a string in 1.1
      {"a: 017", 15},
      {"a: 0b101", 5},
      {"a: 1_000", 1000},
      {"a: 1:30", 90},  // sexagesimal
      {"a: 1.0e-06", 1e-06},
      {"a: 1e-06", "1e-06"},  // no dot: a string in PyYAML
      {"a: 1.0e6", "1.0e6"},  // the exponent's sign is required
      {"a: 1.0e10", "1.0e10"},
      {"a: 1.0E+10", 1e10},
      {"a: 1000000.0", 1000000.0},
      {"a: .5", 0.5},
      {"a: -.5", "-.5"},  // PyYAML's `\.[0-9_]+` has no sign
      {"a: 3.", 3.0},
      {"a: .inf", nullptr},
      {"a: -.inf", nullptr},
      {"a: .nan", nullptr},
      {"a: true", true},
      {"a: False", false},
      {"a: yes", true},
      {"a: NO", false},
      {"a: on", true},
      {"a: off", false},
      {"a: null", nullptr},
      {"a: ~", nullptr},
      {"a:", nullptr},
      {"a: RMSNorm", "RMSNorm"},
      {"a: /tmp/x y", "/tmp/x y"},
      {"a: http://h:80/p", "http://h:80/p"},
      {"a: 09", "09"},
      {"a: 12345678901234567890", 12345678901234567890ull},
      {"a: b # a comment", "b"},
      {"a: b#c", "b#c"},
  };
  for (const auto& [text, want] : cases) {
    const json got = yaml(text);
    EXPECT_EQ(got, json({{"a", want}})) << text;
  }
}

TEST(Yaml, QuotedAndBlockScalars) {
  EXPECT_EQ(yaml("a: ''"), json({{"a", ""}}));
  EXPECT_EQ(yaml("a: '1'"), json({{"a", "1"}}));
  EXPECT_EQ(yaml("a: 'it''s'"), json({{"a", "it's"}}));
  EXPECT_EQ(yaml("a: \"tab\\there \\\"q\\\" \\u00e9 \\x41\""),
            json({{"a", "tab\there \"q\" \xc3\xa9 A"}}));
  // Folded over lines (PyYAML wraps long scalars at 80 columns).
  EXPECT_EQ(yaml("a: 'one two\n  three'\nb: 1"), json({{"a", "one two three"}, {"b", 1}}));
  EXPECT_EQ(yaml("a: \"one\n\n  two\\\n  three\""), json({{"a", "one\ntwothree"}}));
  EXPECT_EQ(yaml("a: one two\n  three\nb: 2"), json({{"a", "one two three"}, {"b", 2}}));
  EXPECT_EQ(yaml("a: |\n  x\n   y\n\nb: 1"), json({{"a", "x\n y\n"}, {"b", 1}}));
  EXPECT_EQ(yaml("a: |-\n  x\n  y\n"), json({{"a", "x\ny"}}));
  EXPECT_EQ(yaml("a: >\n  x\n  y\n\n  z\n"), json({{"a", "x y\nz\n"}}));
  EXPECT_EQ(yaml("a: |+\n  x\n\n"), json({{"a", "x\n\n"}}));
  // The core tags PyYAML writes where a style would change the type.
  EXPECT_EQ(
      yaml("a: !!int \"5\"\nb: !!float |-\n  1.0e-06\nc: !!bool 'on'\nd: !!null ''\ne: !!str 5\n"
           "f: !!float '1'\ng: !!str\n"),
      json({{"a", 5},
            {"b", 1e-06},
            {"c", true},
            {"d", nullptr},
            {"e", "5"},
            {"f", 1.0},
            {"g", ""}}));
}

TEST(Yaml, CollectionsAsSafeDumpWritesThem) {
  const std::string text =
      "_target_: megatron.bridge.training.config.ConfigContainer\n"
      "checkpoint:\n"
      "  async_save: false\n"
      "  load: /tmp/nemo_experiments/default/checkpoints\n"
      "model:\n" +
      std::string(kBridgeTargets) +
      "  config_logger_dir: ''\n"
      "  layernorm_epsilon: 1.0e-06\n"
      "  moe_layer_freq:\n"
      "  - 0\n"
      "  - 1\n"
      "  offload_modules: []\n"
      "  extra: {}\n"
      "  list_of_maps:\n"
      "  - name: x\n"
      "    value: 1\n"
      "  - - 2\n"
      "    - 3\n"
      "  -\n"
      "    deep: true\n"
      "  num_layers: 2\n"
      "peft: null\n";
  const json want = {
      {"_target_", "megatron.bridge.training.config.ConfigContainer"},
      {"checkpoint",
       {{"async_save", false}, {"load", "/tmp/nemo_experiments/default/checkpoints"}}},
      {"model",
       {{"activation_func", {{"_call_", false}, {"_target_", "torch.nn.functional.silu"}}},
        {"attention_backend",
         {{"_args_", {5}},
          {"_call_", true},
          {"_target_", "megatron.core.transformer.enums.AttnBackend"}}},
        {"config_logger_dir", ""},
        {"layernorm_epsilon", 1e-06},
        {"moe_layer_freq", {0, 1}},
        {"offload_modules", json::array()},
        {"extra", json::object()},
        {"list_of_maps",
         json::array({json({{"name", "x"}, {"value", 1}}), json({2, 3}), json({{"deep", true}})})},
        {"num_layers", 2}}},
      {"peft", nullptr}};
  EXPECT_EQ(yaml(text), want);
  // Flow collections as a person writes them, over lines, with comments.
  EXPECT_EQ(yaml("a: [1, 'two', {k: v, n: null}, [3]]  # c\nb: {x: [1,\n  2], y: }\n"),
            json({{"a", {1, "two", {{"k", "v"}, {"n", nullptr}}, {3}}},
                  {"b", {{"x", {1, 2}}, {"y", nullptr}}}}));
  // Documents: markers, comments, an empty one.
  EXPECT_EQ(yaml("%YAML 1.1\n---\n# c\na: 1\n...\n"), json({{"a", 1}}));
  EXPECT_EQ(yaml("--- 5\n...\n"), json(5));
  EXPECT_EQ(yaml(""), json(nullptr));
  EXPECT_EQ(yaml("# only a comment\n"), json(nullptr));
  EXPECT_EQ(yaml("a: 1\r\nb: 2\r\n"), json({{"a", 1}, {"b", 2}}));
  // Complex keys, as safe_dump writes an empty key and one with a line break.
  EXPECT_EQ(yaml("? ''\n: 1\n? |-\n  two\n  lines\n: - a\n  - b\nc: 2\n"),
            json({{"", 1}, {"two\nlines", {"a", "b"}}, {"c", 2}}));
  // Anchors and aliases.
  EXPECT_EQ(yaml("a: &x [1, 2]\nb: *x\nc: &y\n  k: 1\nd: *y\n"),
            json({{"a", {1, 2}}, {"b", {1, 2}}, {"c", {{"k", 1}}}, {"d", {{"k", 1}}}}));
}

TEST(Yaml, RefusalsNameTheLine) {
  refused("a: 1\nb: !!python/object:os.system x\n", "line 2: a tag");
  refused("a: !!binary aGk=\n", "a tag ('!!binary')");
  refused("a: !!int x\n", "'x' is not a value of its tag");
  refused("a: !!str\n  b: 1\n", "a tag on a collection");
  refused("? [a, b]\n: key\n", "line 1: a complex key that is a collection");
  refused("a: x\xe2\x80\xa8y\n", "line 1: a YAML 1.1 line break");
  refused("a: 1\na: 2\n", "line 2: duplicate key 'a'");
  refused("a:\n  <<: *x\n", "line 2: a merge key");
  refused("a:\n\tb: 1\n", "line 2: a tab in the indentation");
  refused("a: 1\n---\nb: 2\n", "more than one document");
  refused("a: *nothing\n", "an alias of no anchor");
  refused("a: 'open\n", "unterminated quoted scalar");
  refused("a: [1, 2\n", "unterminated flow collection");
  refused("a: b: c\n", "a mapping value is not allowed here");
  refused("a:\n  b: 1\n c: 2\n", "line 3");
  refused("a: \"\\q\"\n", "an unknown escape");
  refused("a: \"\\ud800\"\n", "a bad escape");
  refused(std::string("a: b\x01\n"), "a control character");
  refused("a: \xff\n", "not UTF-8");
  refused("- a\nb: 1\n", "line 2");
}

TEST(Yaml, CapsHold) {
  // Nesting at the JSON depth cap, and past it.
  std::string ok, deep;
  for (int i = 0; i < 60; ++i) ok += std::string(static_cast<size_t>(2 * i), ' ') + "k:\n";
  EXPECT_TRUE(parse_yaml(ok, "t.yaml").ok());
  deep = std::string(70, '[') + std::string(70, ']');
  auto r = parse_yaml(deep, "t.yaml");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find("nested deeper"), std::string::npos) << r.error().message;
  // Aliases that repeat a node exponentially (a "billion laughs") stop at the node cap.
  std::string laughs = "a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n";
  for (int i = 1; i < 12; ++i) {
    laughs += fmt::format("a{}: &a{} [", i, i);
    for (int k = 0; k < 10; ++k) laughs += fmt::format("{}*a{}", k ? ", " : "", i - 1);
    laughs += "]\n";
  }
  r = parse_yaml(laughs, "t.yaml");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, EFBIG);
  EXPECT_NE(r.error().message.find("nodes"), std::string::npos) << r.error().message;
  YamlLimits small;
  small.max_bytes = 8;
  EXPECT_EQ(parse_yaml("a: 123456789", "t.yaml", small).error().code, EFBIG);
  small = {};
  small.max_scalar_bytes = 4;
  EXPECT_EQ(parse_yaml("a: 123456789", "t.yaml", small).error().code, EFBIG);
  EXPECT_EQ(parse_yaml(std::string(1 << 19, '\n'), "t.yaml").error().code, EFBIG);  // lines
}

// What Megatron-Bridge's ConfigContainer.to_yaml writes (its model section, abridged from
// tests/fuzz/seeds-yaml), as the native config a map's hf_config template reads.
TEST(TransformerConfig, RunConfigModelAsArgsNames) {
  const std::string text =
      "_target_: megatron.bridge.training.config.ConfigContainer\n"
      "model:\n"
      "  _target_: megatron.bridge.models.gpt_provider.GPTModelProvider\n" +
      std::string(kBridgeTargets) +
      "  gated_linear_unit: true\n"
      "  hidden_size: 64\n"
      "  layernorm_epsilon: 1.0e-06\n"
      "  moe_layer_freq: 1\n"
      "  num_moe_experts: null\n"
      "  num_query_groups: 2\n"
      "  offload_modules: []\n"
      "  params_dtype:\n"
      "    _call_: false\n"
      "    _target_: torch.bfloat16\n"
      "  seq_length: 64\n"
      "  share_embeddings_and_output_weights: false\n"
      "  vocab_size: 250\n"
      "train:\n"
      "  train_iters: 10\n";
  auto r = read_bridge_run_config(text, "iter_0000010/run_config.yaml");
  ASSERT_TRUE(r.ok()) << r.error().message;
  const json want = {{"activation_func", "torch.nn.functional.silu"},
                     {"gated_linear_unit", true},
                     {"hidden_size", 64},
                     {"layernorm_epsilon", 1e-06},
                     {"moe_layer_freq", 1},
                     {"num_moe_experts", nullptr},
                     {"num_query_groups", 2},
                     {"params_dtype", "bfloat16"},
                     {"seq_length", 64},
                     {"share_embeddings_and_output_weights", false},
                     {"vocab_size", 250},
                     // under the args' names
                     {"swiglu", true},
                     {"untie_embeddings_and_output_weights", true},
                     {"num_experts", nullptr},
                     {"group_query_attention", true},
                     {"max_position_embeddings", 64}};
  EXPECT_EQ(*r, want) << r->dump(1);

  // A GeGLU model is no SwiGLU one; TransformerConfig's defaults (no GLU, gelu) neither.
  auto gelu = native_from_transformer_config(
      {{"gated_linear_unit", true},
       {"activation_func", {{"_call_", false}, {"_target_", "torch.nn.functional.gelu"}}}},
      "x");
  ASSERT_TRUE(gelu.ok());
  EXPECT_EQ((*gelu)["swiglu"], false);
  EXPECT_EQ((*native_from_transformer_config(json::object(), "x"))["swiglu"], false);
  // A name the config holds is never replaced; MHA has no query groups.
  auto kept = native_from_transformer_config({{"swiglu", true},
                                              {"num_query_groups", nullptr},
                                              {"max_position_embeddings", 8},
                                              {"seq_length", 4}},
                                             "x");
  EXPECT_EQ((*kept)["swiglu"], true);
  EXPECT_EQ((*kept)["group_query_attention"], false);
  EXPECT_EQ((*kept)["max_position_embeddings"], 8);

  auto none = read_bridge_run_config("train:\n  x: 1\n", "run_config.yaml");
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.error().code, ENOENT);
  auto bad = read_bridge_run_config("model:\n  a: !!python/name:os.system\n", "run_config.yaml");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.error().code, EINVAL);
  EXPECT_NE(bad.error().message.find("run_config.yaml: line 2: a tag"), std::string::npos)
      << bad.error().message;
}

// Every seed (real files: what Megatron-Bridge 0.3.1's to_yaml wrote) reads, and its model
// section gives the fields a template needs.
TEST(TransformerConfig, RealSeedsRead) {
  const char* dir = std::getenv("CKPTFS_YAML_SEEDS");
  ASSERT_NE(dir, nullptr) << "CKPTFS_YAML_SEEDS (tests/meson.build) names tests/fuzz/seeds-yaml";
  int n = 0;
  for (const char* name :
       {"megatron-bridge-0.3.1-qwen3.yaml", "megatron-bridge-0.3.1-qwen3-moe.yaml",
        "megatron-bridge-0.3.1-deepseek-v3-mla.yaml"}) {
    std::ifstream f(std::string(dir) + "/" + name, std::ios::binary);
    ASSERT_TRUE(f) << name;
    std::stringstream ss;
    ss << f.rdbuf();
    auto r = read_bridge_run_config(ss.str(), name);
    ASSERT_TRUE(r.ok()) << r.error().message;
    for (const char* k : {"num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                          "vocab_size", "swiglu", "untie_embeddings_and_output_weights",
                          "max_position_embeddings", "params_dtype", "normalization"}) {
      EXPECT_TRUE(r->contains(k)) << name << ": " << k;
    }
    EXPECT_EQ((*r)["swiglu"], true) << name;
    ++n;
  }
  EXPECT_EQ(n, 3);
}

}  // namespace
