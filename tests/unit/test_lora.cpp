// The LoRA split (layout/lora): the naming rules of a PEFT LoRA state dict, the refusals, and the
// builder pass on declared chunks (the base model under HF names in the directory, the adapter
// in lora_adapter/ under PEFT's saved names, adapter_config.json), with no file touched; the
// merged view (-o lora=merged: W + scale * (B @ A) through map_range and gather, on memfd shards);
// and verl's side of it (format/verl): lora_train_meta.json, FSDP_version 1, FSDP1's
// ShardedTensors.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <map>
#include <random>

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "ckptfs/format/cast.hpp"
#include "ckptfs/format/verl.hpp"
#include "ckptfs/io/gather.hpp"
#include "ckptfs/layout/extent_map.hpp"
#include "ckptfs/layout/lora.hpp"
#include "ckptfs/util/fd.hpp"
#include "fixture.hpp"

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
                                                int64_t alpha = 16, bool merged = false) {
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
  layout::BuildOptions opts;
  opts.lora_merged = merged;
  return layout::build_checkpoint(std::move(in), opts);
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

// ---- the merged view (-o lora=merged) -----------------------------------------------------

using format::DType;

// Values of dtype `d` (F32, BF16 or F16) from a normal distribution of scale `sd`, as bytes.
std::string values(std::mt19937_64& rng, DType d, size_t n, float sd) {
  std::normal_distribution<float> dist(0.0f, sd);
  std::vector<float> f(n);
  for (auto& x : f) x = dist(rng);
  std::string out(n * (format::dtype_bits(d) / 8), '\0');
  format::convert(DType::F32, d, f.data(), out.data(), n);
  return out;
}

std::vector<float> widened(DType d, const std::string& b) {
  std::vector<float> f(b.size() / (format::dtype_bits(d) / 8));
  format::convert(d, DType::F32, b.data(), f.data(), f.size());
  return f;
}

// Rounds an F32 value to `d` and back.
float through(DType d, float x) {
  char tmp[4];
  format::convert(DType::F32, d, &x, tmp, 1);
  format::convert(d, DType::F32, tmp, &x, 1);
  return x;
}

// A LoRA layer q_proj (W [rows, cols] as `wd`, A [r, cols] and B [rows, r] as `fd`) and a norm,
// over two safetensors rank shards: W's rows split 4 / rows - 4, A's rows split 1 / r - 1 (so the
// factors are read across shards too), B whole in the second shard.
struct MergedCase {
  uint64_t rows = 6, cols = 5, r = 2;
  int64_t alpha = 3;
  DType wd = DType::BF16, fd = DType::BF16;
  std::string w, a, b, norm;
  std::shared_ptr<const layout::Checkpoint> ck;
  std::vector<UniqueFd> fds;
  std::vector<int> raw;

  void build(bool merged, uint64_t seed) {
    std::mt19937_64 rng(seed);
    w = values(rng, wd, rows * cols, 1.0f);
    a = values(rng, fd, r * cols, 0.5f);
    b = values(rng, fd, rows * r, 0.05f);
    norm = values(rng, DType::F32, cols, 1.0f);
    const uint64_t wsz = format::dtype_bits(wd) / 8, fsz = format::dtype_bits(fd) / 8;
    const std::string q = P + "model.layers.0.q_proj";
    auto chunk = [](std::string name, DType d, std::vector<uint64_t> off, std::vector<uint64_t> sz,
                    std::vector<uint64_t> full, std::string data) {
      return test::ChunkSpec{std::move(name), d, std::move(off), std::move(sz), std::move(full),
                             std::move(data)};
    };
    std::vector<test::ShardSpec> specs = {
        {format::shard_file_name(1, 1, 1),
         {chunk(q + ".base_layer.weight", wd, {0, 0}, {4, cols}, {rows, cols},
                w.substr(0, 4 * cols * wsz)),
          chunk(q + ".lora_A.default.weight", fd, {0, 0}, {1, cols}, {r, cols},
                a.substr(0, cols * fsz)),
          chunk(P + "model.norm.weight", DType::F32, {0}, {cols}, {{cols}}, norm)}},
        {format::shard_file_name(2, 1, 1),
         {chunk(q + ".base_layer.weight", wd, {4, 0}, {rows - 4, cols}, {rows, cols},
                w.substr(4 * cols * wsz)),
          chunk(q + ".lora_A.default.weight", fd, {1, 0}, {r - 1, cols}, {r, cols},
                a.substr(cols * fsz)),
          chunk(q + ".lora_B.default.weight", fd, {0, 0}, {rows, r}, {rows, r}, b)}},
    };
    layout::BuildInput in;
    in.dir = "actor";
    const auto files = test::add_shards(in, specs);
    in.lora =
        layout::LoraInput{"lora_train_meta.json", static_cast<uint32_t>(r), alpha, "CAUSAL_LM"};
    layout::BuildOptions opts;
    opts.lora_merged = merged;
    ck = layout::build_checkpoint(std::move(in), opts);
    for (const auto& sh : ck->shards) {
      int fd = ::memfd_create("shard", MFD_CLOEXEC);
      const auto& bytes = files.at(sh.name);
      EXPECT_EQ(::pwrite(fd, bytes.data(), bytes.size(), 0), static_cast<ssize_t>(bytes.size()));
      fds.emplace_back(fd);
      raw.push_back(fd);
    }
  }

  // W + alpha / r * (B @ A) as PEFT merges it on CPU, written out with its own loops: the
  // product in F32 (fused multiply-adds, k in order, as torch's MKL GEMM sums it), scaled, rounded
  // to lora_B's dtype, added to W in F32, rounded to W's dtype.
  [[nodiscard]] std::string expected() const {
    const auto W = widened(wd, w), A = widened(fd, a), B = widened(fd, b);
    const auto scale = static_cast<float>(static_cast<double>(alpha) / static_cast<double>(r));
    std::vector<float> out(rows * cols);
    for (uint64_t i = 0; i < rows; ++i) {
      for (uint64_t j = 0; j < cols; ++j) {
        float d = 0;
        for (uint64_t k = 0; k < r; ++k) d = std::fma(B[i * r + k], A[k * cols + j], d);
        out[i * cols + j] = W[i * cols + j] + through(fd, d * scale);
      }
    }
    std::string bytes(w.size(), '\0');
    format::convert(DType::F32, wd, out.data(), bytes.data(), out.size());
    return bytes;
  }

  [[nodiscard]] std::string read(uint32_t file, uint64_t off, uint64_t len,
                                 io::FactorCache* cache) const {
    std::vector<layout::Segment> segs;
    layout::map_range(*ck, file, off, len, segs);
    uint64_t n = 0;
    for (const auto& g : segs) n += g.len;
    std::string out(n, '\0');
    io::GatherSource src{ck.get(), raw, ck->outputs[file].header, {}};
    src.factors = cache;
    auto st = io::gather(src, segs, out.data());
    EXPECT_TRUE(st.ok()) << st.error().message;
    return out;
  }
};

TEST(LoraMerged, TheDirectoryShowsTheMergedModelAndNoAdapter) {
  MergedCase c;
  c.build(true, 1);
  const auto& ck = *c.ck;
  ASSERT_TRUE(ck.valid()) << problems(ck);
  EXPECT_FALSE(ck.adapter);
  EXPECT_NE(ck.lora_merged.find("1 base weights served as W + 3/2 * (B @ A)"), std::string::npos)
      << ck.lora_merged;
  ASSERT_EQ(ck.outputs.size(), 2u);
  EXPECT_EQ(ck.outputs[0].path(), "model-00001-of-00001.safetensors");
  EXPECT_EQ(ck.outputs[1].folder, format::kLoraFactorsFolder);  // never shown
  auto index = nlohmann::json::parse(ck.index_json);
  EXPECT_EQ(index["weight_map"].size(), 2u);
  // The merged weight's output is read from every shard its factors are in.
  EXPECT_EQ(ck.outputs[0].shards, (std::vector<uint32_t>{0, 1}));
  const layout::Tensor* w = nullptr;
  for (const auto& t : ck.tensors) {
    if (t.name == "model.layers.0.q_proj.weight") w = &t;
  }
  ASSERT_NE(w, nullptr);
  ASSERT_TRUE(w->merge);
  EXPECT_EQ(w->merge->scale, 1.5f);
  EXPECT_EQ(ck.tensors[w->merge->a].name, P + "model.layers.0.q_proj.lora_A.weight");
  EXPECT_EQ(ck.tensors[w->merge->b].name, P + "model.layers.0.q_proj.lora_B.weight");
}

// Every byte range of the merged file, in every dtype pair PEFT merges: equal to the merged
// weight's bytes; the norm and the header as unmerged; with and without the factor cache.
TEST(LoraMerged, EveryRangeReadsWPlusScaledBA) {
  struct Case {
    DType wd, fd;
    uint64_t rows = 6, cols = 5, step = 3;
  };
  for (auto [wd, fd, rows, cols, step] :
       {Case{DType::BF16, DType::BF16}, Case{DType::F32, DType::F32}, Case{DType::F16, DType::F16},
        Case{DType::F32, DType::BF16}, Case{DType::BF16, DType::F32},
        // W over several of gather's blocks (kCastBlock source bytes each); enough elements
        // that rounding the delta to lora_B's BF16 first changes some of them.
        Case{DType::BF16, DType::F32, 520, 300, 4099},
        Case{DType::BF16, DType::BF16, 520, 300, 4099}}) {
    SCOPED_TRACE(fmt::format("W {} [{}, {}], factors {}", format::dtype_name(wd), rows, cols,
                             format::dtype_name(fd)));
    MergedCase c;
    c.wd = wd;
    c.fd = fd;
    c.rows = rows;
    c.cols = cols;
    c.build(true, 2);
    ASSERT_TRUE(c.ck->valid()) << problems(*c.ck);
    const auto& ck = *c.ck;
    const auto& f = ck.outputs[0];
    io::FactorCache cache;
    const std::string whole = c.read(0, 0, f.size, &cache);
    ASSERT_EQ(whole.size(), f.size);
    EXPECT_EQ(whole.substr(0, f.header.size()), f.header);
    const std::string want = c.expected();
    EXPECT_NE(want, c.w);  // the adapter changes the weight: the test can tell
    for (uint32_t ti : f.tensors) {
      const auto& t = ck.tensors[ti];
      const std::string got = whole.substr(t.out_offset, t.nbytes);
      EXPECT_EQ(got, t.merge ? want : c.norm) << t.name;
    }
    for (uint64_t off = 0; off < f.size; off += step) {
      for (uint64_t len : {1ull, 2ull, 5ull, 11ull, 64ull, 300'001ull}) {
        ASSERT_EQ(c.read(0, off, len, off % 2 ? &cache : nullptr),
                  whole.substr(off, std::min(len, f.size - off)))
            << off << "+" << len;
      }
    }
  }
}

// What lora=merged cannot merge is refused naming the tensor, and an adapter alone (verl's
// save_lora_only) is shown as it is, saying why nothing was merged.
TEST(LoraMerged, WhatCannotBeMergedIsSaid) {
  MergedCase c;
  c.wd = DType::F64;
  c.build(true, 3);
  ASSERT_FALSE(c.ck->valid());
  EXPECT_TRUE(std::any_of(c.ck->problems.begin(), c.ck->problems.end(), [&](const auto& p) {
    return p.tensor == P + "model.layers.0.q_proj.base_layer.weight" &&
           p.message.find("-o lora=merged: a base weight of F64") != std::string::npos;
  })) << problems(*c.ck);
  MergedCase split;  // the same F64 weight unmerged: served
  split.wd = DType::F64;
  split.build(false, 3);
  EXPECT_TRUE(split.ck->valid()) << problems(*split.ck);

  std::vector<T> only;
  for (const auto& t : peft_state_dict(2)) {
    if (t.name.find(".lora_") != std::string::npos) only.push_back(t);
  }
  auto ck = build(only, 2, 16, /*merged=*/true);
  ASSERT_TRUE(ck->valid()) << problems(*ck);
  ASSERT_TRUE(ck->adapter);
  EXPECT_TRUE(ck->lora_merged.empty());
  EXPECT_NE(ck->adapter->note.find("-o lora=merged: no base weight to merge into"),
            std::string::npos)
      << ck->adapter->note;
  ASSERT_EQ(ck->notes.size(), 1u);  // logged by the daemon
  EXPECT_NE(ck->notes[0].find("actor: -o lora=merged: the rank files hold no base weight"),
            std::string::npos)
      << ck->notes[0];
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
