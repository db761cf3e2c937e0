// The LoRA split (layout/lora): the naming rules of a PEFT LoRA state dict, the refusals, and the
// builder pass on declared chunks (the base model under HF names in the directory, the adapter
// in lora_adapter/ under PEFT's saved names, adapter_config.json), with no file touched; and
// verl's side of it (format/verl): lora_train_meta.json, FSDP_version 1, FSDP1's ShardedTensors.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "ckptfs/format/verl.hpp"
#include "ckptfs/layout/lora.hpp"

namespace {

using namespace ckptfs;
using layout::lora::place;

std::string problems(const layout::Checkpoint& ck) {
  std::string s;
  for (const auto& p : ck.problems) s += p.to_string() + "\n";
  return s;
}

// ---- naming rules ----------------------------------------------------------------------------

TEST(LoraNames, PeftNamesToHfAndSavedAdapterNames) {
  struct Case {
    std::string stored;
    bool adapter;
    std::string name, module;
  };
  for (const Case& c : {
           Case{"base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight", false,
                "model.layers.0.self_attn.q_proj.weight", ""},
           Case{"base_model.model.model.layers.0.self_attn.q_proj.base_layer.bias", false,
                "model.layers.0.self_attn.q_proj.bias", ""},
           Case{"base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight", true,
                "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
                "model.layers.0.self_attn.q_proj"},
           Case{"base_model.model.model.layers.1.mlp.down_proj.lora_B.default.weight", true,
                "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight",
                "model.layers.1.mlp.down_proj"},
           Case{"base_model.model.model.embed_tokens.weight", false, "model.embed_tokens.weight",
                ""},
           Case{"base_model.model.lm_head.weight", false, "lm_head.weight", ""},
           Case{"base_model.model.model.norm.weight", false, "model.norm.weight", ""},
           // A module named "default" is a module, not the adapter name.
           Case{"base_model.model.default.lora_A.default.weight", true,
                "base_model.model.default.lora_A.weight", "default"},
       }) {
    SCOPED_TRACE(c.stored);
    auto p = place(c.stored);
    ASSERT_TRUE(p.ok()) << p.error().message;
    EXPECT_EQ(p->adapter, c.adapter);
    EXPECT_EQ(p->name, c.name);
    EXPECT_EQ(p->module, c.module);
  }
}

TEST(LoraNames, WhatIsNotServedIsRefusedSayingWhy) {
  struct Case {
    std::string stored, says;
  };
  for (const Case& c : {
           Case{"model.layers.0.self_attn.q_proj.weight", "not under 'base_model.model.'"},
           Case{"base_model.model.model.embed_tokens.lora_embedding_A.default",
                "'lora_embedding_A' is a LoRA parameter not served"},
           Case{"base_model.model.model.layers.0.q_proj.lora_magnitude_vector.default.weight",
                "no DoRA"},
           Case{"base_model.model.model.layers.0.q_proj.lora_A.other.weight",
                "adapter 'other': only the adapter 'default'"},
           Case{"base_model.model.model.layers.0.q_proj.lora_B.default.bias", "no LoRA bias"},
           Case{"base_model.model.lora_A.default.weight", "not at <module>.lora_A.default.weight"},
           Case{"base_model.model.model.q_proj.lora_A.default.weight.x",
                "not at <module>.lora_A.default.weight"},
           Case{"base_model.model.lm_head.modules_to_save.default.weight", "modules_to_save"},
           Case{"base_model.model.lm_head.original_module.weight", "modules_to_save"},
           Case{"base_model.model.model.base_layer.q_proj.weight", "'base_layer' is not at"},
           Case{"base_model.model.model..weight", "an empty name component"},
           Case{"base_model.model.", "an empty name component"},
           Case{"base_model.model.__metadata__", "__metadata__"},
       }) {
    SCOPED_TRACE(c.stored);
    auto p = place(c.stored);
    ASSERT_FALSE(p.ok()) << p->name;
    EXPECT_NE(p.error().message.find(c.says), std::string::npos) << p.error().message;
  }
}

// ---- the builder pass ------------------------------------------------------------------------

struct T {
  std::string name;
  std::vector<uint64_t> shape;
};

// A declared checkpoint of one shard file holding `tensors` (F32, one chunk each), with
// lora_train_meta.json's `r` unless r is 0.
std::shared_ptr<const layout::Checkpoint> build(const std::vector<T>& tensors, uint32_t r,
                                                int64_t alpha = 16) {
  layout::BuildInput in;
  in.dir = "actor";
  layout::ShardInput s;
  s.name = "model_world_size_1_rank_0.pt";
  s.stamp.size = 1ull << 40;
  in.shards.push_back(s);
  in.declared.emplace();
  in.declared->format = "test";
  uint64_t at = 0;
  for (const auto& t : tensors) {
    layout::DeclaredChunk d;
    d.tensor = t.name;
    d.dtype = format::DType::F32;
    d.file_offset = at;
    d.offsets.assign(t.shape.size(), 0);
    d.sizes = t.shape;
    d.full_shape = t.shape;
    uint64_t n = 4;
    for (auto x : t.shape) n *= x;
    at += n;
    in.declared->chunks.push_back(std::move(d));
  }
  if (r > 0) in.lora = layout::LoraInput{"lora_train_meta.json", r, alpha, "CAUSAL_LM"};
  return layout::build_checkpoint(std::move(in));
}

const std::string P = "base_model.model.";

// A two-layer PEFT state dict as verl saves it (every base weight and the adapter).
std::vector<T> peft_state_dict(uint32_t r) {
  std::vector<T> v = {{P + "model.embed_tokens.weight", {10, 8}}};
  for (const char* m : {"model.layers.0.q_proj", "model.layers.1.q_proj"}) {
    v.push_back({P + m + ".base_layer.weight", {6, 8}});
    v.push_back({P + m + ".lora_A.default.weight", {r, 8}});
    v.push_back({P + m + ".lora_B.default.weight", {6, r}});
  }
  v.push_back({P + "model.norm.weight", {8}});
  v.push_back({P + "lm_head.weight", {10, 8}});
  return v;
}

TEST(LoraSplit, TheBaseModelInTheDirectoryTheAdapterInItsFolder) {
  auto ck = build(peft_state_dict(2), 2, 4);
  ASSERT_TRUE(ck->valid()) << problems(*ck);
  ASSERT_TRUE(ck->adapter);
  ASSERT_EQ(ck->outputs.size(), 2u);
  const auto& base = ck->outputs[0];
  const auto& adapter = ck->outputs[1];
  EXPECT_EQ(base.name, "model-00001-of-00001.safetensors");
  EXPECT_TRUE(base.folder.empty());
  EXPECT_EQ(adapter.path(), "lora_adapter/adapter_model.safetensors");
  EXPECT_EQ(ck->find_output("adapter_model.safetensors"), nullptr);  // not in the directory
  std::vector<std::string> in_base, in_adapter;
  for (uint32_t t : base.tensors) in_base.push_back(ck->tensors[t].name);
  for (uint32_t t : adapter.tensors) in_adapter.push_back(ck->tensors[t].name);
  EXPECT_EQ(in_base,
            (std::vector<std::string>{"lm_head.weight", "model.embed_tokens.weight",
                                      "model.layers.0.q_proj.weight",
                                      "model.layers.1.q_proj.weight", "model.norm.weight"}));
  EXPECT_EQ(in_adapter, (std::vector<std::string>{P + "model.layers.0.q_proj.lora_A.weight",
                                                  P + "model.layers.0.q_proj.lora_B.weight",
                                                  P + "model.layers.1.q_proj.lora_A.weight",
                                                  P + "model.layers.1.q_proj.lora_B.weight"}));
  // The index is the base model's: the adapter is not part of it.
  auto index = nlohmann::json::parse(ck->index_json);
  EXPECT_EQ(index["weight_map"].size(), 5u);
  EXPECT_FALSE(index["weight_map"].contains(P + "model.layers.0.q_proj.lora_A.weight"));
  auto cfg = nlohmann::json::parse(ck->adapter->config_json);
  EXPECT_EQ(cfg["r"], 2);
  EXPECT_EQ(cfg["lora_alpha"], 4);
  EXPECT_EQ(cfg["peft_type"], "LORA");
  EXPECT_EQ(cfg["task_type"], "CAUSAL_LM");
  EXPECT_EQ(cfg["bias"], "none");
  EXPECT_EQ(cfg["use_rslora"], false);
  EXPECT_EQ(cfg["target_modules"],
            (nlohmann::json{"model.layers.0.q_proj", "model.layers.1.q_proj"}));
  EXPECT_TRUE(cfg["base_model_name_or_path"].is_null());
  EXPECT_EQ(ck->adapter->base_tensors, 5u);
  EXPECT_EQ(ck->adapter->adapter_tensors, 4u);
  EXPECT_EQ(ck->adapter->layers, 2u);
}

TEST(LoraSplit, AnAdapterAloneShowsNoModelAndNoIndex) {
  std::vector<T> only;
  for (const auto& t : peft_state_dict(2)) {
    if (t.name.find(".lora_") != std::string::npos) only.push_back(t);
  }
  auto ck = build(only, 2);
  ASSERT_TRUE(ck->valid()) << problems(*ck);
  ASSERT_EQ(ck->outputs.size(), 1u);
  EXPECT_EQ(ck->outputs[0].path(), "lora_adapter/adapter_model.safetensors");
  EXPECT_TRUE(ck->index_json.empty());
  ASSERT_TRUE(ck->adapter);
  EXPECT_NE(ck->adapter->note.find("save_lora_only"), std::string::npos) << ck->adapter->note;
}

TEST(LoraSplit, WithoutLoraTrainMetaNothingIsSplit) {
  auto ck = build(peft_state_dict(2), 0);
  ASSERT_TRUE(ck->valid()) << problems(*ck);
  EXPECT_FALSE(ck->adapter);
  ASSERT_EQ(ck->outputs.size(), 1u);
  EXPECT_EQ(ck->tensors[0].name, P + "model.embed_tokens.weight");
}

TEST(LoraSplit, AnAdapterThatCannotLoadIsRefusedNamingTheTensor) {
  struct Case {
    std::string what;
    std::vector<T> tensors;
    std::string tensor, says;
  };
  auto sd = peft_state_dict(2);
  auto without = [&](const std::string& name) {
    auto v = sd;
    std::erase_if(v, [&](const T& t) { return t.name == name; });
    return v;
  };
  auto without_all = [&](std::vector<std::string> names) {
    auto v = sd;
    std::erase_if(v, [&](const T& t) {
      return std::find(names.begin(), names.end(), t.name) != names.end();
    });
    return v;
  };
  auto with = [&](T extra) {
    auto v = sd;
    v.push_back(std::move(extra));
    return v;
  };
  auto reshaped = [&](const std::string& name, std::vector<uint64_t> shape) {
    auto v = sd;
    for (auto& t : v) {
      if (t.name == name) t.shape = shape;
    }
    return v;
  };
  const std::string q0 = P + "model.layers.0.q_proj";
  for (const Case& c : {
           Case{"another r", reshaped(q0 + ".lora_A.default.weight", {3, 8}),
                q0 + ".lora_A.default.weight", "lora_train_meta.json says r=2"},
           Case{"lora_A alone", without(q0 + ".lora_B.default.weight"),
                q0 + ".lora_A.default.weight", "has lora_A without lora_B"},
           Case{"a base layer without its pair",
                without_all({q0 + ".lora_A.default.weight", q0 + ".lora_B.default.weight"}),
                q0 + ".base_layer.weight", "with no LoRA pair"},
           Case{"a base layer of another shape", reshaped(q0 + ".base_layer.weight", {6, 9}),
                q0 + ".base_layer.weight", "(base [out, in] expected)"},
           Case{"no base layer where base weights are stored", without(q0 + ".base_layer.weight"),
                q0 + ".lora_A.default.weight", "has no"},
           Case{"two names served as one", with({q0 + ".weight", {6, 8}}), q0 + ".weight",
                "served as 'model.layers.0.q_proj.weight'"},
           Case{"a name outside the rules", with({"lm_head.weight", {10, 8}}), "lm_head.weight",
                "not under 'base_model.model.'"},
       }) {
    SCOPED_TRACE(c.what);
    auto ck = build(c.tensors, 2);
    ASSERT_FALSE(ck->valid());
    EXPECT_TRUE(ck->outputs.empty());
    EXPECT_TRUE(std::any_of(ck->problems.begin(), ck->problems.end(), [&](const auto& p) {
      return p.tensor == c.tensor && p.message.find(c.says) != std::string::npos &&
             p.file == "model_world_size_1_rank_0.pt";
    })) << problems(*ck);
  }
  // lora_train_meta.json, and not one LoRA layer.
  std::vector<T> plain = {{P + "model.norm.weight", {8}}};
  auto ck = build(plain, 2);
  ASSERT_FALSE(ck->valid());
  EXPECT_NE(problems(*ck).find("lora_train_meta.json: no LoRA layer"), std::string::npos)
      << problems(*ck);
}

// Thousands of bad names give a bounded list of problems.
TEST(LoraSplit, ProblemsAreBounded) {
  std::vector<T> bad;
  for (int i = 0; i < 5000; ++i) bad.push_back({fmt::format("layer{}.weight", i), {2}});
  auto ck = build(bad, 2);
  ASSERT_FALSE(ck->valid());
  EXPECT_LE(ck->problems.size(), 33u);
  EXPECT_NE(ck->problems.back().message.find("more LoRA naming problem"), std::string::npos)
      << problems(*ck);
}

// ---- verl's files ----------------------------------------------------------------------------

TEST(VerlLora, TrainMeta) {
  auto m = format::parse_lora_train_meta(R"({"r": 8, "lora_alpha": 16, "task_type": "CAUSAL_LM"})",
                                         "lora_train_meta.json");
  ASSERT_TRUE(m.ok()) << m.error().message;
  EXPECT_EQ(m->r, 8u);
  EXPECT_EQ(m->lora_alpha, 16);
  EXPECT_EQ(m->task_type, "CAUSAL_LM");
  m = format::parse_lora_train_meta(R"({"r": 8, "lora_alpha": 0})", "m");
  ASSERT_TRUE(m.ok()) << m.error().message;
  EXPECT_FALSE(m->task_type);
  for (const char* bad : {R"({"lora_alpha": 16})", R"({"r": 0, "lora_alpha": 16})", R"({"r": 8})",
                          R"({"r": 8, "lora_alpha": -1})", R"({"r": 8.5, "lora_alpha": 16})",
                          R"({"r": 8, "lora_alpha": 16, "task_type": "a b"})",
                          R"({"r": 8, "lora_alpha": 16, "task_type": 3})",
                          R"({"r": 2000000, "lora_alpha": 1})", R"([8, 16])", "{"}) {
    SCOPED_TRACE(bad);
    auto r = format::parse_lora_train_meta(bad, "lora_train_meta.json");
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.error().message.find("lora_train_meta.json"), std::string::npos)
        << r.error().message;
  }
}

// FSDP1 without a device mesh: the rank file's pickle builds ShardedTensors. Said so.
TEST(VerlLora, Fsdp1ShardedTensorsAreRefusedByName) {
  using namespace std::string_literals;
  const std::string pkl =
      "\x80\x02"
      "ccollections\nOrderedDict\nq\x00)Rq\x01(X\x01\x00\x00\x00w"
      "ctorch.distributed._shard.sharded_tensor.api\nShardedTensor\nq\x02"s;
  auto r = format::parse_rank_state_dict(pkl, "model_world_size_2_rank_0.pt");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.error().message.find(
                "model_world_size_2_rank_0.pt: FSDP1 without a device mesh saves ShardedTensors"),
            std::string::npos)
      << r.error().message;
}

}  // namespace
