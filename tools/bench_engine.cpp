// Engine micro-benchmarks (figures in docs/benchmarks.md):
//   1. extent map: a 1 MiB range of a column-sharded tensor (8 ranks, BF16, 1 KiB runs);
//   2. model build for 10,000 tensors in 1,000 shard files (mount-time cost), both from
//      parsed headers in memory and from files on disk (header reads + parsing included);
//   3. header parse and model build for 20,000 and 100,000 tensors in 2 rank shards (MoE
//      checkpoints): few files with huge headers, where any per-tensor scan of all the
//      tensors shows up as quadratic time.
// Usage: bench_engine [--dir SCRATCH] [--many-only]
//   --dir        scratch directory for (2) (default: a temporary directory under /tmp)
//   --many-only  run only (3)
#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <new>
#include <string>
#include <vector>

#include <fmt/core.h>

#include "ckptfs/format/dcp.hpp"
#include "ckptfs/format/names.hpp"
#include "ckptfs/format/safetensors.hpp"
#include "ckptfs/layout/extent_map.hpp"
#include "ckptfs/source/scanner.hpp"

namespace {

std::atomic<uint64_t> g_allocs{0};  // counts operator new calls (benchmark-only global)

}  // namespace

void* operator new(size_t n) {
  g_allocs.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }

using namespace ckptfs;
using Clock = std::chrono::steady_clock;

namespace {

double secs(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// A shard file's bytes (header + zero data) holding the given chunks.
std::string shard_bytes(const std::vector<format::TensorEntry>& chunks,
                        const format::ShardingInfo& info, std::string* header_only = nullptr) {
  std::map<std::string, std::string> md{
      {"format", "pt"}, {"DCP_SHARDING_INFO", format::serialize_sharding_info(info)}};
  std::string h = format::serialize_header(chunks, md);
  uint64_t data = chunks.empty() ? 0 : chunks.back().end;
  if (header_only) *header_only = h;
  return h + std::string(data, '\0');
}

void bench_extent_map() {
  constexpr int kRanks = 8;
  constexpr uint64_t kRows = 4096, kColsPerRank = 512;  // BF16: 1 KiB runs
  layout::BuildInput in;
  in.dir = "bench";
  for (int r = 0; r < kRanks; ++r) {
    format::TensorEntry e{
        "w", format::DType::BF16, {kRows, kColsPerRank}, 0, kRows * kColsPerRank * 2};
    format::ShardingInfo info{{"w", {{0, uint64_t(r) * kColsPerRank}, std::nullopt}}};
    std::string header;
    shard_bytes({e}, info, &header);
    layout::ShardInput si;
    si.name = format::shard_file_name(r + 1, 1, 1);
    auto h = format::parse_header_json(std::string_view(header).substr(8), header.size() + e.end,
                                       si.name);
    if (!h) {
      fmt::print(stderr, "{}\n", h.error().message);
      std::exit(1);
    }
    si.header = std::make_shared<const format::Header>(std::move(h).value());
    in.shards.push_back(std::move(si));
  }
  auto ck = layout::build_checkpoint(std::move(in));
  if (!ck->valid()) {
    fmt::print(stderr, "invalid bench checkpoint\n");
    std::exit(1);
  }
  std::vector<layout::Segment> segs;
  segs.reserve(4096);
  const uint64_t start = ck->outputs[0].header.size();
  const uint64_t span = ck->outputs[0].size - start - (1 << 20);
  const int iters = 20000;
  uint64_t allocs0 = g_allocs.load();
  auto t0 = Clock::now();
  uint64_t total_segs = 0;
  for (int i = 0; i < iters; ++i) {
    uint64_t off = start + (uint64_t(i) * 7919 * 4096) % span;
    layout::map_range(*ck, 0, off, 1 << 20, segs);
    total_segs += segs.size();
  }
  auto t1 = Clock::now();
  uint64_t allocs = g_allocs.load() - allocs0;
  fmt::print(
      "| extent map: 1 MiB of a column-sharded BF16 tensor (8 ranks, 1 KiB runs) | {:.2f} us per "
      "range, {} runs per range, {:.3f} allocations per range |\n",
      secs(t0, t1) / iters * 1e6, total_segs / iters, double(allocs) / iters);
}

void bench_model_build(const std::string& scratch) {
  constexpr int kShards = 1000, kTensors = 10000;
  // 10,000 tensors in 1,000 files; each tensor row-sharded over 4 consecutive ranks.
  std::vector<std::vector<format::TensorEntry>> per(kShards);
  std::vector<format::ShardingInfo> info(kShards);
  for (int t = 0; t < kTensors; ++t) {
    std::string name = fmt::format("model.layers.{}.mlp.w{}.weight", t / 8, t % 8);
    int first = (t * 4) % kShards;
    for (int j = 0; j < 4; ++j) {
      int s = (first + j) % kShards;
      uint64_t pos = per[s].empty() ? 0 : per[s].back().end;
      per[s].push_back({name, format::DType::BF16, {16, 64}, pos, pos + 16 * 64 * 2});
      info[s][name] = {{uint64_t(j) * 16, 0}, std::nullopt};
    }
  }
  std::filesystem::create_directories(scratch);
  layout::BuildInput in;
  in.dir = scratch;
  for (int s = 0; s < kShards; ++s) {
    std::string header;
    std::string bytes = shard_bytes(per[s], info[s], &header);
    auto name = format::shard_file_name(s + 1, 1, 1);
    FILE* f = std::fopen((scratch + "/" + name).c_str(), "wb");
    std::fwrite(bytes.data(), 1, bytes.size(), f);
    std::fclose(f);
    layout::ShardInput si;
    si.name = name;
    auto h = format::parse_file_bytes(bytes, name);
    si.header = std::make_shared<const format::Header>(std::move(h).value());
    in.shards.push_back(std::move(si));
  }
  auto t0 = Clock::now();
  auto ck = layout::build_checkpoint(std::move(in));
  auto t1 = Clock::now();
  if (!ck->valid() || ck->tensors.size() != kTensors) {
    fmt::print(stderr, "model build failed: {}\n",
               ck->problems.empty() ? "" : ck->problems[0].to_string());
    std::exit(1);
  }
  fmt::print("| model build from parsed headers: 10,000 tensors, 1,000 shards | {:.1f} ms |\n",
             secs(t0, t1) * 1e3);
  auto t2 = Clock::now();
  auto loaded = source::load_checkpoint_path(scratch);
  auto t3 = Clock::now();
  if (!loaded || !(*loaded)->valid()) {
    fmt::print(stderr, "load failed\n");
    std::exit(1);
  }
  fmt::print("| scan + header reads + parse + build from disk (page cache warm) | {:.1f} ms |\n",
             secs(t2, t3) * 1e3);
}

// `n_tensors` tensors, each row-sharded over 2 ranks, so each of the 2 headers lists every
// tensor once and its DCP_SHARDING_INFO holds an entry per tensor.
void bench_many_tensors(int n_tensors) {
  constexpr int kRanks = 2;
  std::vector<std::string> headers(kRanks);
  std::vector<uint64_t> sizes(kRanks);
  for (int r = 0; r < kRanks; ++r) {
    std::vector<format::TensorEntry> chunks;
    chunks.reserve(n_tensors);
    format::ShardingInfo info;
    uint64_t pos = 0;
    for (int t = 0; t < n_tensors; ++t) {
      std::string name =
          fmt::format("model.layers.{}.mlp.experts.{}.down_proj.weight", t / 128, t % 128);
      chunks.push_back({name, format::DType::BF16, {4, 8}, pos, pos + 4 * 8 * 2});
      pos += 4 * 8 * 2;
      info[name] = {{uint64_t(r) * 4, 0}, std::nullopt};
    }
    headers[r] = shard_bytes(chunks, info);  // zero data: only the size matters here
    sizes[r] = headers[r].size();
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(headers[r][i]);
    headers[r].resize(8 + n);
  }
  layout::BuildInput in;
  in.dir = "bench";
  auto t0 = Clock::now();
  for (int r = 0; r < kRanks; ++r) {
    layout::ShardInput si;
    si.name = format::shard_file_name(r + 1, 1, 1);
    auto h = format::parse_header_json(std::string_view(headers[r]).substr(8), sizes[r], si.name);
    if (!h) {
      fmt::print(stderr, "{}\n", h.error().message);
      std::exit(1);
    }
    si.header = std::make_shared<const format::Header>(std::move(h).value());
    in.shards.push_back(std::move(si));
  }
  auto t1 = Clock::now();
  auto ck = layout::build_checkpoint(std::move(in));
  auto t2 = Clock::now();
  if (!ck->valid() || ck->tensors.size() != size_t(n_tensors)) {
    fmt::print(stderr, "model build failed: {}\n",
               ck->problems.empty() ? "" : ck->problems[0].to_string());
    std::exit(1);
  }
  fmt::print(
      "| {} tensors x {} ranks: header parse / model build (incl. DCP_SHARDING_INFO) | {:.1f} ms "
      "/ {:.1f} ms |\n",
      n_tensors, kRanks, secs(t0, t1) * 1e3, secs(t1, t2) * 1e3);
}

}  // namespace

int main(int argc, char** argv) {
  std::string scratch;
  bool many_only = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--dir" && i + 1 < argc) {
      scratch = argv[++i];
    } else if (a == "--many-only") {
      many_only = true;
    } else {
      fmt::print(stderr, "usage: bench_engine [--dir SCRATCH] [--many-only]\n");
      return 2;
    }
  }
  if (many_only) {
    fmt::print("| benchmark | result |\n|---|---|\n");
    bench_many_tensors(20'000);
    bench_many_tensors(100'000);
    return 0;
  }
  bool cleanup = scratch.empty();
  if (scratch.empty()) {
    char tmpl[] = "/tmp/ckptfs-bench-XXXXXX";
    scratch = ::mkdtemp(tmpl);
  }
  fmt::print("| benchmark | result |\n|---|---|\n");
  bench_extent_map();
  bench_model_build(scratch + "/ckpt");
  bench_many_tensors(20'000);
  bench_many_tensors(100'000);
  if (cleanup) std::filesystem::remove_all(scratch);
  return 0;
}
