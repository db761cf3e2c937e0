// `ckptfs load CKPT`: parses the command line, runs the loader (src/load) and prints what it
// did. The engine lives in src/load; this file only parses and prints.
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "ckptfs/cli/args.hpp"
#include "ckptfs/load/backend.hpp"
#include "ckptfs/load/checksum.hpp"
#include "ckptfs/load/loader.hpp"
#include "ckptfs/load/source.hpp"
#include "ckptfs/source/scanner.hpp"
#include "ckptfs/util/text.hpp"

namespace ckptfs::cli {
namespace {

constexpr std::string_view kUsage =
    R"(usage: ckptfs load CKPT [--device cpu|cuda:N] [--threads T] [--chunk-mb C] [--ring N]
                   [--direct] [--stage] [--dtype D] [--bench] [--json]
                   [--map M] [--hf-config PATH]

Loads every tensor of the checkpoint in CKPT into memory of the device, without a mount,
and reports bytes, seconds and GB/s. CKPT holds rank shards (read through the extent map,
validated as the mount does: a checkpoint with problems is refused, each problem listed) or
consolidated model.safetensors / model-K-of-M.safetensors files. Reads are made by T threads
in pieces of C MiB into a ring of N staging buffers (pinned memory) and copied to the GPU
(cudaMemcpyAsync on a few streams); with --device cpu each piece is read straight into the
destination memory (--stage: through the ring and a memcpy, as for a GPU). Every tensor is
checksummed (XXH64 of each 1 MiB block, summed; see docs/loader.md) as it is read.

options:
  --device D    cpu (default) or cuda:N; cuda fails when there is no such GPU or this
                ckptfs was built without CUDA
  --threads T   reader threads (default: {})
  --chunk-mb C  staging buffer size in MiB (default: 16)
  --ring N      staging buffers (default: 2 x threads)
  --direct      read long runs with O_DIRECT (bypassing the page cache); falls back to
                buffered reads where the file system refuses it
  --stage       cpu: through the staging ring too (the GPU pipeline with memcpy)
  --dtype D     auto (default, as the mount), stored, bf16, fp16 or fp32 (rank shards only)
  --map M       model map (docs/maps.md): a built-in's name, a .json map, or none; default:
                the built-in whose detect clause fits
  --hf-config PATH
                config.json for a mapped checkpoint without its own
  --bench       time the load alone: no checksum while loading, then a checksum of the
                destination memory afterwards (untimed)
  --json        one JSON object on stdout (per-tensor checksums included)
  -h, --help    this text
)";

std::string hex(uint64_t v) { return fmt::format("{:016x}", v); }

// An error, one printable line per line of its message (a refused checkpoint lists one
// problem a line).
void print_error(std::string_view msg) {
  fmt::print(stderr, "ckptfs load: ");
  size_t at = 0;
  while (true) {
    const size_t nl = msg.find('\n', at);
    fmt::print(stderr, "{}\n",
               printable(msg.substr(at, nl == std::string_view::npos ? nl : nl - at)));
    if (nl == std::string_view::npos) break;
    at = nl + 1;
  }
}

}  // namespace

int cmd_load(std::span<char*> argv) {
  static constexpr OptSpec spec[] = {
      {"device", 0, true},  {"threads", 'j', true}, {"chunk-mb", 0, true}, {"ring", 0, true},
      {"direct", 0, false}, {"dtype", 0, true},     {"bench", 0, false},   {"json", 0, false},
      {"stage", 0, false},  {"map", 0, true},       {"hf-config", 0, true}};
  const std::string usage = fmt::format(kUsage, load::default_threads());
  auto parsed = parse_command(argv, spec, {"load", usage, "CKPT", 1});
  if (auto* rc = std::get_if<int>(&parsed)) return *rc;
  const auto& args = std::get<Args>(parsed);
  load::LoadOptions lo;
  auto number = [&](std::string_view name, unsigned lo_v, unsigned hi_v, unsigned& out) {
    auto t = args.get(name);
    if (!t) return true;
    auto v = parse_unsigned(*t, fmt::format("--{}", name));
    if (!v || *v < lo_v || *v > hi_v) {
      fmt::print(stderr, "ckptfs load: --{} must be {}..{}\n", name, lo_v, hi_v);
      return false;
    }
    out = *v;
    return true;
  };
  unsigned chunk_mb = 16;
  if (!number("threads", 1, load::kMaxThreads, lo.threads) ||
      !number("chunk-mb", 1, 4096, chunk_mb) ||
      !number("ring", 1, load::kMaxRingSlots, lo.ring_slots)) {
    return 2;
  }
  lo.chunk = uint64_t{chunk_mb} << 20;
  const bool bench = args.has("bench");
  const bool json = args.has("json");
  lo.checksum = !bench;
  if (args.has("stage")) lo.staging = load::LoadOptions::Staging::Always;
  const std::string device = args.get("device").value_or("cpu");
  const std::string dir = args.positional[0];
  load::SourceOptions so;
  so.dtype = args.get("dtype").value_or("auto");
  so.direct = args.has("direct");
  so.map = args.get("map").value_or("");
  so.hf_config = args.get("hf-config").value_or("");

  const bool huge_pages = load::huge_pages_pay_here();
  auto backend = load::make_backend(device, huge_pages);
  if (!backend) {
    print_error(backend.error().message);
    return backend.error().code == EINVAL ? 2 : 1;
  }
  auto src = load::Source::open(dir, so);
  if (!src) {
    print_error(src.error().message);
    if (src.error().code != ENOENT) return 1;
    if (auto below = source::find_checkpoint_dirs(dir); below && !below->dirs.empty()) {
      fmt::print(stderr, "checkpoints found below it:\n");
      for (const auto& d : below->dirs) fmt::print(stderr, "  {}\n", printable(d));
    }
    return 1;
  }
  auto reqs = load::all_tensors(**src);
  auto r = load::load(**src, reqs, **backend, lo);
  if (!r) {
    print_error(r.error().message);
    return 1;
  }
  std::vector<std::pair<std::string, uint64_t>> sums;
  for (size_t i = 0; i < reqs.size(); ++i) {
    uint64_t c = 0;
    if (bench) {
      auto v = load::checksum_dest(**backend, reqs[i].dst, reqs[i].bytes, lo.chunk);
      if (!v) {
        print_error(v.error().message);
        return 1;
      }
      c = *v;
    } else {
      c = r->stats.checksums[i];
    }
    sums.emplace_back(reqs[i].name, c);
  }
  const auto& st = r->stats;
  const uint64_t total = load::combine_checksums(sums);
  const double gbps = st.seconds > 0 ? static_cast<double>(st.bytes) / st.seconds / 1e9 : 0.0;
  const unsigned threads = lo.threads ? lo.threads : load::default_threads();
  const char* kind =
      (*src)->kind() == load::Source::Kind::RankShards ? "rank_shards" : "consolidated";
  if (json) {
    nlohmann::ordered_json j;
    j["dir"] = dir;
    j["input"] = kind;
    j["device"] = (*backend)->name();
    j["tensors"] = reqs.size();
    j["bytes"] = st.bytes;
    j["bytes_read"] = st.bytes_read;
    j["seconds"] = st.seconds;
    j["gbps"] = gbps;
    j["threads"] = threads;
    j["chunk_mb"] = chunk_mb;
    j["ring"] = lo.ring_slots ? lo.ring_slots : 2 * threads;
    j["direct"] = so.direct;
    j["direct_fallback"] = st.direct_fallback;
    j["staged"] = (*backend)->on_device() || args.has("stage");
    j["huge_pages"] = huge_pages && !(*backend)->on_device();
    j["bench"] = bench;
    j["checksum"] = hex(total);
    nlohmann::ordered_json per = nlohmann::ordered_json::object();
    for (const auto& [name, c] : sums) per[name] = hex(c);
    j["checksums"] = std::move(per);
    fmt::print("{}\n", j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
  } else {
    fmt::print("{}: {} tensors, {:.3f} GB ({}) into {} in {:.3f} s: {:.2f} GB/s\n", printable(dir),
               reqs.size(), static_cast<double>(st.bytes) / 1e9, kind, (*backend)->name(),
               st.seconds, gbps);
    fmt::print("read {} bytes with {} threads, {} MiB chunks{}{}\n", st.bytes_read, threads,
               chunk_mb, so.direct ? ", O_DIRECT" : "",
               st.direct_fallback ? " (some reads buffered: O_DIRECT refused)" : "");
    fmt::print("checksum {}\n", hex(total));
  }
  return 0;
}

}  // namespace ckptfs::cli
