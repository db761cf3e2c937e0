// bench_router: the write router's own cost (figures in docs/benchmarks.md): StreamRouter::create
// and the routing of a TinyLlama-1.1B-shaped bf16 file (2.2 GB) in 1 MiB writes, as safetensors'
// writer sends them, into a sink that keeps nothing, so only the geometry is timed.
// Usage: bench_router [RANKS] [tp]   (tp: q_proj colwise, o_proj and down_proj rowwise)
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>
#include "ckptfs/format/safetensors.hpp"
#include "ckptfs/write/plan.hpp"
#include "ckptfs/write/router.hpp"
using namespace ckptfs;
struct Null : public write::ShardSink {
  uint64_t n = 0;
  Status pwrite(uint32_t, uint64_t, std::string_view b) override {
    n += b.size();
    return {};
  }
};
int main(int argc, char** argv) {
  const uint32_t ranks = argc > 1 ? std::stoi(argv[1]) : 2;
  const bool tp = argc > 2 && std::string(argv[2]) == "tp";
  std::vector<format::TensorEntry> es;
  uint64_t pos = 0;
  auto add = [&](std::string name, std::vector<uint64_t> shape) {
    format::TensorEntry e;
    e.name = name;
    e.dtype = format::DType::BF16;
    e.shape = shape;
    uint64_t n = 2;
    for (auto d : shape) n *= d;
    e.begin = pos;
    e.end = pos + n;
    pos += n;
    es.push_back(e);
  };
  add("model.embed_tokens.weight", {32000, 2048});
  for (int l = 0; l < 22; ++l) {
    std::string p = "model.layers." + std::to_string(l) + ".";
    add(p + "input_layernorm.weight", {2048});
    add(p + "mlp.down_proj.weight", {2048, 5632});
    add(p + "mlp.gate_proj.weight", {5632, 2048});
    add(p + "mlp.up_proj.weight", {5632, 2048});
    add(p + "post_attention_layernorm.weight", {2048});
    add(p + "self_attn.k_proj.weight", {256, 2048});
    add(p + "self_attn.o_proj.weight", {2048, 2048});
    add(p + "self_attn.q_proj.weight", {2048, 2048});
    add(p + "self_attn.v_proj.weight", {256, 2048});
  }
  add("lm_head.weight", {32000, 2048});
  std::string hb = format::serialize_header(es, {{"format", "pt"}});
  auto h = format::parse_header_json(std::string_view(hb).substr(8), hb.size() + pos, "m").value();
  write::PlanOptions po;
  po.ranks = ranks;
  if (tp) {
    po.split = write::PlanOptions::TpPlan;
    po.tp_plan = {{"layers.*.self_attn.q_proj", "colwise"},
                  {"layers.*.mlp.down_proj", "rowwise"},
                  {"layers.*.self_attn.o_proj", "rowwise"}};
  }
  auto p = write::plan(h, po, "m").value();
  auto s = write::shard_headers(h, p, "m").value();
  std::string buf(1 << 20, 'x');
  double best = 1e9;
  for (int rep = 0; rep < 5; ++rep) {
    Null sink;
    auto t0 = std::chrono::steady_clock::now();
    auto r =
        write::StreamRouter::create(hb, std::make_shared<const format::Header>(h), p, s, sink, "m")
            .value();
    auto t1 = std::chrono::steady_clock::now();
    uint64_t off = 0;
    const uint64_t size = hb.size() + pos;
    // header first, then 1 MiB writes (safetensors' buffered writer)
    (void)r.write(0, hb);
    off = hb.size();
    while (off < size) {
      uint64_t n = std::min<uint64_t>(buf.size(), size - off);
      if (!r.write(off, std::string_view(buf.data(), n))) return 1;
      off += n;
    }
    auto t2 = std::chrono::steady_clock::now();
    double c = std::chrono::duration<double>(t1 - t0).count(),
           w = std::chrono::duration<double>(t2 - t1).count();
    if (c + w < best) best = c + w;
    std::printf("create %.4f s  route %.4f s (%.1f GB/s)  bytes %.2f GB\n", c, w, sink.n / w / 1e9,
                sink.n / 1e9);
  }
  std::printf("best total %.4f s\n", best);
}
