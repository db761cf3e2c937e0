// libFuzzer target: model maps (docs/maps.md), an untrusted input like any other.
//
// The input is a map's JSON, optionally followed by "\n#CONFIG\n" and a config.json. A map
// that parses is compiled (through build_checkpoint, as the mount does) against four fixed,
// tiny checkpoints held in memory: torchtitan Llama 3, Qwen 3 and Qwen 3 MoE, and a
// Megatron-Core GPT (stacked layers), each with its own config.json unless the input gives
// one. A checkpoint the map fits is then checked: every mapped tensor's runs tile its elements
// in order and stay inside their stored tensor, no stored element is read twice by one tensor,
// and map_range over every output file (whole, and in pieces) gives segments inside their
// sources that add up to the bytes asked for, which are then read.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "ckptfs/format/model_map.hpp"
#include "ckptfs/layout/checkpoint.hpp"
#include "ckptfs/layout/extent_map.hpp"

using namespace ckptfs;

namespace {

struct Fixture {
  layout::BuildInput input;
  std::vector<std::string> shards;
  std::string config;
};

struct T {
  std::string name;
  std::vector<uint64_t> shape;
};

// Each tensor in two chunks along axis 0 (one where the axis has a single row), spread over two
// shard files, in BF16; bytes are their offsets' low bits.
Fixture make(std::string format, const std::vector<T>& ts, std::string config) {
  Fixture fx;
  fx.shards.assign(2, std::string());
  fx.config = std::move(config);
  layout::Declared d;
  d.format = std::move(format);
  uint32_t next = 0;
  for (const auto& t : ts) {
    uint64_t row = 2;
    for (size_t k = 1; k < t.shape.size(); ++k) row *= t.shape[k];
    const uint64_t rows = t.shape.empty() ? 1 : t.shape[0];
    const uint64_t cut = rows > 1 ? rows / 2 : rows;
    for (auto [lo, hi] : {std::pair{uint64_t{0}, cut}, std::pair{cut, rows}}) {
      if (lo == hi) continue;
      layout::DeclaredChunk c;
      c.tensor = t.name;
      c.dtype = format::DType::BF16;
      c.full_shape = t.shape;
      c.offsets.assign(t.shape.size(), 0);
      c.sizes = t.shape;
      if (!t.shape.empty()) {
        c.offsets[0] = lo;
        c.sizes[0] = hi - lo;
      }
      c.shard = next++ % 2;
      auto& f = fx.shards[c.shard];
      c.file_offset = f.size();
      for (uint64_t i = 0; i < (hi - lo) * (t.shape.empty() ? 2 : row); ++i) {
        f.push_back(static_cast<char>(f.size() * 131 + 7));
      }
      d.chunks.push_back(std::move(c));
    }
  }
  for (uint32_t i = 0; i < 2; ++i) {
    layout::ShardInput s;
    s.name = "__" + std::to_string(i) + "_0.distcp";
    s.stamp.size = fx.shards[i].size();
    fx.input.shards.push_back(std::move(s));
  }
  fx.input.dir = "fuzz";
  fx.input.declared = std::move(d);
  return fx;
}

const std::vector<Fixture>& fixtures() {
  static const std::vector<Fixture> all = [] {
    std::vector<Fixture> v;
    // torchtitan Llama 3: hidden 8, 2 heads of 4 (1 kv head), ffn 12, vocab 7, 2 layers, untied.
    std::vector<T> llama = {
        {"tok_embeddings.weight", {7, 8}}, {"norm.weight", {8}}, {"lm_head.weight", {7, 8}}};
    for (int l = 0; l < 2; ++l) {
      const std::string p = "layers." + std::to_string(l) + ".";
      for (const T& t : std::vector<T>{{"attention.qkv_linear.wq.weight", {8, 8}},
                                       {"attention.qkv_linear.wk.weight", {4, 8}},
                                       {"attention.qkv_linear.wv.weight", {4, 8}},
                                       {"attention.wo.weight", {8, 8}},
                                       {"feed_forward.w1.weight", {12, 8}},
                                       {"feed_forward.w3.weight", {12, 8}},
                                       {"feed_forward.w2.weight", {8, 12}},
                                       {"attention_norm.weight", {8}},
                                       {"ffn_norm.weight", {8}}}) {
        llama.push_back({p + t.name, t.shape});
      }
    }
    v.push_back(make("torch DCP (.metadata, *.distcp)", llama,
                     R"({"hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1,
                         "intermediate_size": 12, "vocab_size": 7, "num_hidden_layers": 2,
                         "tie_word_embeddings": false})"));
    // torchtitan Qwen 3 (dense): 1 layer, head_dim 4, tied.
    std::vector<T> qwen = {{"tok_embeddings.weight", {7, 8}},
                           {"norm.weight", {8}},
                           {"layers.0.attention.qkv_linear.wq.weight", {8, 8}},
                           {"layers.0.attention.qkv_linear.wk.weight", {4, 8}},
                           {"layers.0.attention.qkv_linear.wv.weight", {4, 8}},
                           {"layers.0.attention.wo.weight", {8, 8}},
                           {"layers.0.attention.q_norm.weight", {4}},
                           {"layers.0.attention.k_norm.weight", {4}},
                           {"layers.0.feed_forward.w1.weight", {12, 8}},
                           {"layers.0.feed_forward.w3.weight", {12, 8}},
                           {"layers.0.feed_forward.w2.weight", {8, 12}},
                           {"layers.0.attention_norm.weight", {8}},
                           {"layers.0.ffn_norm.weight", {8}}};
    v.push_back(make("torch DCP (.metadata, *.distcp)", qwen,
                     R"({"hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1,
                         "head_dim": 4, "intermediate_size": 12, "vocab_size": 7,
                         "num_hidden_layers": 1, "tie_word_embeddings": true})"));
    // torchtitan Qwen 3 MoE: 1 layer, 2 experts, head_dim 4, tied.
    std::vector<T> moe = {{"tok_embeddings.weight", {7, 8}},
                          {"norm.weight", {8}},
                          {"layers.0.attention.qkv_linear.wq.weight", {8, 8}},
                          {"layers.0.attention.qkv_linear.wk.weight", {4, 8}},
                          {"layers.0.attention.qkv_linear.wv.weight", {4, 8}},
                          {"layers.0.attention.wo.weight", {8, 8}},
                          {"layers.0.attention.q_norm.weight", {4}},
                          {"layers.0.attention.k_norm.weight", {4}},
                          {"layers.0.moe.router.gate.weight", {2, 8}},
                          {"layers.0.moe.routed_experts.inner_experts.w1_EFD", {2, 6, 8}},
                          {"layers.0.moe.routed_experts.inner_experts.w3_EFD", {2, 6, 8}},
                          {"layers.0.moe.routed_experts.inner_experts.w2_EDF", {2, 8, 6}},
                          {"layers.0.moe.expert_bias_E", {2}},
                          {"layers.0.attention_norm.weight", {8}},
                          {"layers.0.ffn_norm.weight", {8}}};
    v.push_back(make("torch DCP (.metadata, *.distcp)", moe,
                     R"({"hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1,
                         "head_dim": 4, "moe_intermediate_size": 6, "num_experts": 2,
                         "vocab_size": 7, "num_hidden_layers": 1, "tie_word_embeddings": true})"));
    // Megatron-Core GPT: 2 stacked layers, 4 heads in 2 groups of head size 2, hidden 8, ffn 6,
    // vocabulary 10 padded to 12, TE spec (norms fused), untied.
    std::vector<T> meg = {
        {"embedding.word_embeddings.weight", {12, 8}},
        {"decoder.layers.self_attention.linear_qkv.layer_norm_weight", {2, 8}},
        {"decoder.layers.self_attention.linear_qkv.weight", {2, 16, 8}},
        {"decoder.layers.self_attention.linear_proj.weight", {2, 8, 8}},
        {"decoder.layers.mlp.linear_fc1.layer_norm_weight", {2, 8}},
        {"decoder.layers.mlp.linear_fc1.weight", {2, 12, 8}},
        {"decoder.layers.mlp.linear_fc2.weight", {2, 8, 6}},
        {"decoder.final_layernorm.weight", {8}},
        {"output_layer.weight", {12, 8}},
        {"decoder.layers.self_attention.core_attention._extra_state/shard_0_2", {3}}};
    v.push_back(make("Megatron-Core torch_dist (.metadata, *.distcp, metadata.json)", meg,
                     R"({"hidden_size": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
                         "intermediate_size": 6, "vocab_size": 10, "num_hidden_layers": 2,
                         "tie_word_embeddings": false})"));
    return v;
  }();
  return all;
}

// The runs of every mapped tensor tile it in order and stay inside their stored tensor, and no
// stored element is read twice by one tensor.
void check_runs(const layout::Checkpoint& ck) {
  for (const auto& t : ck.tensors) {
    if (!t.mapped) __builtin_trap();
    uint64_t out = 0;
    std::vector<std::vector<bool>> seen(ck.stored.size());
    for (const auto& r : t.runs) {
      if (r.src >= ck.stored.size() || r.out_elem != out || r.count == 0) __builtin_trap();
      const auto& s = ck.stored[r.src];
      if (r.len > s.numel || (r.count - 1) > (s.numel - r.len) / (r.stride ? r.stride : 1) ||
          r.src_elem > s.numel - r.len - (r.count - 1) * r.stride) {
        __builtin_trap();
      }
      auto& bits = seen[r.src];
      if (bits.empty()) bits.assign(s.numel, false);
      for (uint64_t k = 0; k < r.count; ++k) {
        for (uint64_t e = 0; e < r.len; ++e) {
          const uint64_t i = r.src_elem + k * r.stride + e;
          if (bits[i]) __builtin_trap();  // a stored element read twice
          bits[i] = true;
        }
      }
      out += r.len * r.count;
    }
    if (out != t.numel) __builtin_trap();
  }
}

void check_reads(const layout::Checkpoint& ck, const std::vector<std::string>& files) {
  std::vector<layout::Segment> segs;
  std::string buf;
  for (uint32_t f = 0; f < ck.outputs.size(); ++f) {
    const auto& out = ck.outputs[f];
    for (uint64_t step : {out.size, out.size / 5 + 1, uint64_t{3}}) {
      if (step == 3 && out.size > (1 << 16)) continue;
      for (uint64_t off = 0; off < out.size; off += step) {
        layout::map_range(ck, f, off, step, segs);
        uint64_t total = 0;
        for (const auto& s : segs) {
          total += s.len;
          if (s.is_memory()) {
            if (s.src + s.len > out.header.size()) __builtin_trap();
            continue;
          }
          if (s.shard >= files.size() || s.src + s.src_len() > files[s.shard].size()) {
            __builtin_trap();
          }
          buf.assign(files[s.shard], s.src, s.src_len());  // the bytes a read gathers
        }
        if (total != std::min(step, out.size - off)) __builtin_trap();
      }
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  std::string_view config;
  constexpr std::string_view kSep = "\n#CONFIG\n";
  if (auto at = text.find(kSep); at != std::string_view::npos) {
    config = text.substr(at + kSep.size());
    text = text.substr(0, at);
  }
  auto m = format::parse_model_map(text, "fuzz.json");
  if (!m) return 0;
  auto map = std::make_shared<const format::ModelMap>(std::move(m).value());
  for (const auto& fx : fixtures()) {
    layout::BuildOptions opts;
    opts.map = map;
    opts.hf_config = config.empty() ? fx.config : std::string(config);
    auto ck = layout::build_checkpoint(fx.input, opts);
    if (!ck->valid()) {
      if (!ck->outputs.empty() || ck->problems.empty()) __builtin_trap();
      continue;
    }
    if (ck->map != map->name) __builtin_trap();
    check_runs(*ck);
    check_reads(*ck, fx.shards);
  }
  return 0;
}
