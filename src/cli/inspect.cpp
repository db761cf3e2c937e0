// `ckptfs inspect` and `ckptfs verify`.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <set>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "ckptfs/cli/args.hpp"
#include "ckptfs/cli/progress.hpp"
#include "ckptfs/source/maps.hpp"
#include "ckptfs/source/scanner.hpp"
#include "ckptfs/source/shards.hpp"
#include "ckptfs/util/checked.hpp"
#include "ckptfs/util/fd.hpp"
#include "ckptfs/util/text.hpp"

namespace ckptfs::cli {
namespace {

constexpr std::string_view kInspectUsage =
    R"(usage: ckptfs inspect DIR [--json] [--map M] [--hf-config PATH]

Lists every rank-sharded checkpoint at or below DIR: its shards, tensors (dtype, full shape,
chunk grid), the consolidated files ckptfs would present and their sizes, and every problem
found. Exits 0 when every checkpoint is valid, 1 when any has problems, 2 on usage errors.

options:
  --json      machine-readable output (stable keys; see docs/architecture.md)
  --map M     model map (docs/maps.md): a built-in's name, a .json map, or none; default:
              the built-in whose detect clause fits. Each HF tensor then shows its source
              tensor and the rule that made it
  --hf-config PATH
              config.json for mapped checkpoints without their own
  -h, --help  this text
)";

constexpr std::string_view kVerifyUsage =
    R"(usage: ckptfs verify DIR [--data] [--map M] [--hf-config PATH]

Checks every rank-sharded checkpoint at or below DIR and prints one line per problem.
Exits 0 when all are valid, 1 otherwise, 2 on usage errors.

options:
  --data      also read replicated chunks and check that every copy holds equal bytes
  --map M, --hf-config PATH
              as for inspect: the model map and config.json the mount would use
  -h, --help  this text
)";

std::string grid_str(const layout::Tensor& t) {
  if (t.grid.bounds.empty() && !t.shape.empty() && t.numel > 0) {
    return fmt::format("irregular({} chunks)", t.chunks.size());
  }
  std::vector<size_t> g;
  for (const auto& b : t.grid.bounds) g.push_back(b.size() - 1);
  if (t.numel == 0) return "empty";
  return fmt::format("{}", fmt::join(g, "x"));
}

nlohmann::ordered_json to_json(const layout::Checkpoint& c) {
  using J = nlohmann::ordered_json;
  J j;
  j["dir"] = c.dir;
  j["valid"] = c.valid();
  j["evidence"] = {{"tensor_set_listed", c.from_mapping},
                   {"shapes_stored", c.shapes_stored},
                   {"tensors", c.tensors.size()}};
  J shards = J::array();
  for (const auto& s : c.shards) {
    shards.push_back({{"name", s.name}, {"size", s.stamp.size}, {"rank", s.parsed.shard - 1}});
  }
  j["shards"] = std::move(shards);
  J outs = J::array();
  for (const auto& o : c.outputs) {
    outs.push_back({{"name", o.path()},
                    {"size", o.size},
                    {"tensors", o.tensors.size()},
                    {"header_size", o.header.size()}});
  }
  j["outputs"] = std::move(outs);
  J tensors = J::array();
  for (const auto& t : c.tensors) {
    J tj;
    tj["name"] = t.name;
    tj["dtype"] = std::string(format::dtype_name(t.dtype));
    tj["stored_dtype"] = std::string(format::dtype_name(t.src_dtype));
    tj["shape"] = t.shape;
    std::vector<size_t> g;
    for (const auto& b : t.grid.bounds) g.push_back(b.size() - 1);
    tj["grid"] = g;
    tj["nbytes"] = t.nbytes;
    if (t.mapped) tj["source"] = t.origin;
    if (!c.outputs.empty()) {
      tj["file"] = c.outputs[t.output].path();
      tj["offset"] = t.out_offset;
    }
    J chunks = J::array();
    for (const auto& ch : t.chunks) {
      J reps = J::array();
      for (const auto& r : ch.replicas) reps.push_back(c.shards[r.shard].name);
      chunks.push_back({{"file", c.shards[ch.shard].name},
                        {"offsets", ch.offsets},
                        {"sizes", ch.sizes},
                        {"replicas", std::move(reps)}});
    }
    tj["chunks"] = std::move(chunks);
    tensors.push_back(std::move(tj));
  }
  j["tensors"] = std::move(tensors);
  J probs = J::array();
  for (const auto& p : c.problems) {
    probs.push_back({{"file", p.file}, {"tensor", p.tensor}, {"message", p.message}});
  }
  j["problems"] = std::move(probs);
  j["format"] = c.format;
  j["notes"] = c.notes;
  j["left_out"] = c.left_out;
  j["map"] = c.map;
  if (!c.map_note.empty()) j["map_note"] = c.map_note;
  if (c.unmapped_native()) {
    j["unmapped_native"] = {{"name", c.native_name}, {"maps_tried", c.map_trials}};
  }
  if (c.adapter) {
    j["lora"] = {{"adapter_dir", c.adapter->dir},
                 {"base_tensors", c.adapter->base_tensors},
                 {"adapter_tensors", c.adapter->adapter_tensors},
                 {"layers", c.adapter->layers},
                 {"note", c.adapter->note}};
  }
  J stored = J::array();
  for (const auto& t : c.stored) stored.push_back({{"name", t.name}, {"shape", t.shape}});
  j["stored"] = std::move(stored);
  return j;
}

// Text output for a terminal: every string that comes from the source (directory and tensor
// names, messages quoting them) goes through printable(), so a name cannot forge a line or
// send escape sequences. --json output is JSON-escaped instead and keeps names exact.
void print_text(const layout::Checkpoint& c) {
  fmt::print("checkpoint {}: {}\n", printable(c.dir), c.valid() ? "valid" : "INVALID");
  fmt::print("  format: {}\n", c.format);
  if (!c.map.empty()) {
    fmt::print(
        "  model map: {}: {} HF tensors made of {} stored tensors{}\n", c.map, c.tensors.size(),
        c.stored.size(),
        c.config_json.empty() ? "" : fmt::format(" (config.json: {})", printable(c.config_from)));
  }
  if (!c.map_note.empty()) fmt::print("  model map: {}\n", printable(c.map_note));
  if (c.unmapped_native()) {
    fmt::print(
        "  model map: none fits, and the stored names are a trainer's own ('{}'): served under "
        "them, with no config.json (from_pretrained would build a model of random weights).\n"
        "  Give -o map=PATH (a map of your own, docs/maps.md; --map here) and, if it needs one, "
        "-o hf_config=PATH. The built-in maps:\n",
        printable(c.native_name));
    for (const auto& t : c.map_trials) fmt::print("    {}\n", printable(t));
  }
  fmt::print("  {} shard files, {} tensors, {} bytes of tensor data\n", c.shards.size(),
             c.tensors.size(), c.total_bytes());
  if (!c.outputs.empty()) {
    fmt::print(
        "  consolidated files{}:\n",
        c.from_mapping ? " (grouping from .hf_metadata/fqn_to_file_index_mapping.json)" : "");
    for (const auto& o : c.outputs) {
      fmt::print("    {}  {} bytes, {} tensors\n", o.path(), o.size, o.tensors.size());
    }
    if (c.adapter) {
      fmt::print("    {}/{}\n", c.adapter->dir, format::kAdapterConfigName);
    }
    if (!c.index_json.empty() || c.written) fmt::print("    {}\n", format::kIndexFileName);
  }
  if (!c.tensors.empty()) {
    fmt::print("  tensors:\n");
    for (const auto& t : c.tensors) {
      if (t.mapped) {
        fmt::print("    {}  {} [{}]  <- {}{}\n", printable(t.name), format::dtype_name(t.dtype),
                   fmt::join(t.shape, ", "), printable(t.origin),
                   c.outputs.empty() ? "" : "  -> " + c.outputs[t.output].path());
        continue;
      }
      size_t reps = 0;
      for (const auto& ch : t.chunks) reps += ch.replicas.size();
      // A cast view shows both: stored -> served.
      const std::string dt = t.is_cast() ? fmt::format("{} -> {}", format::dtype_name(t.src_dtype),
                                                       format::dtype_name(t.dtype))
                                         : std::string(format::dtype_name(t.dtype));
      fmt::print("    {}  {} [{}]  grid {}  {} chunk{}{}{}\n", printable(t.name), dt,
                 fmt::join(t.shape, ", "), grid_str(t), t.chunks.size(),
                 t.chunks.size() == 1 ? "" : "s", reps ? fmt::format(" (+{} replicas)", reps) : "",
                 c.outputs.empty() ? "" : "  -> " + c.outputs[t.output].path());
    }
  }
  if (!c.tensors.empty()) {
    // What proves the checkpoint whole, beyond sizes, headers and tiling (docs/semantics.md).
    fmt::print(
        "  completeness evidence: tensor set {}; full shapes stored for {} of {} tensors{}\n",
        c.declared       ? "listed by the checkpoint's own index (" + c.format + ")"
        : c.from_mapping ? std::string("listed by .hf_metadata/fqn_to_file_index_mapping.json")
                         : std::string("not listed anywhere (a tensor held by a missing rank "
                                       "alone would not be seen)"),
        c.shapes_stored, c.chunked().size(),
        c.shapes_stored == c.chunked().size()
            ? ""
            : " (the others are inferred from their chunks: a missing last rank would "
              "look like a smaller tensor)");
  }
  if (c.adapter) fmt::print("  lora: {}\n", printable(c.adapter->note));
  if (!c.left_out.empty()) {
    fmt::print("  left out:\n");
    for (const auto& n : c.left_out) fmt::print("    {}\n", printable(n));
  }
  if (!c.notes.empty()) {
    fmt::print("  notes:\n");
    for (const auto& n : c.notes) fmt::print("    {}\n", printable(n));
  }
  if (!c.problems.empty()) {
    fmt::print("  problems:\n");
    for (const auto& p : c.problems) fmt::print("    {}\n", printable(p.to_string()));
  }
}

struct Loaded {
  std::vector<std::shared_ptr<const layout::Checkpoint>> ckpts;
  std::vector<std::string> too_deep;  // directories the search did not enter
};

Result<Loaded> load_all(const std::string& dir, const layout::BuildOptions& base) {
  CKPTFS_TRY(auto found, source::find_checkpoint_dirs(dir));
  if (found.dirs.empty() && found.too_deep.empty()) {
    return make_error(
        ENOENT,
        "{}: no rank-sharded checkpoint found (no shard-R-model-K-of-M.safetensors files, no "
        "torch DCP .metadata with *.distcp files, no verl fsdp_config.json with "
        "model_world_size_W_rank_R.pt files)",
        dir);
  }
  Loaded out;
  out.too_deep = std::move(found.too_deep);
  for (const auto& d : found.dirs) {
    // As the mount shows it by default (dtype=auto: NeMo's dtype mapping applied).
    layout::BuildOptions opts = base;
    opts.dtype_policy = layout::BuildOptions::DtypePolicy::Mapping;
    CKPTFS_TRY(auto c, source::load_checkpoint_path(d, opts));
    out.ckpts.push_back(std::move(c));
  }
  return out;
}

// The search stops at a depth limit; what it did not enter is said, and is a failure.
void report_too_deep(std::string_view cmd, const Loaded& l) {
  for (const auto& d : l.too_deep) {
    fmt::print(stderr, "ckptfs {}: {}: not searched: deeper than {} levels (the depth limit)\n",
               cmd, printable(d), source::kMaxSearchDepth);
  }
}

// Compares every replica of every chunk with the primary copy, block by block.
void verify_replicas(const layout::Checkpoint& c, std::vector<std::string>& problems,
                     ProgressBar& bar, uint64_t& done, uint64_t total) {
  // Each shard once, checked to be the file the build read (source::open_shard).
  auto dir = open_file(c.dir, O_RDONLY | O_DIRECTORY);
  std::vector<UniqueFd> fds(c.shards.size());
  std::vector<std::string> failed(c.shards.size());
  auto fd_of = [&](uint32_t s) -> int {
    if (!fds[s].valid() && failed[s].empty()) {
      Result<UniqueFd> r = dir ? source::open_shard(c, s, dir->get(), c.dir, "verify")
                               : Result<UniqueFd>(dir.error());
      if (r) {
        fds[s] = std::move(r).value();
      } else {
        failed[s] = r.error().message;
        problems.push_back(failed[s]);
      }
    }
    return fds[s].get();
  };
  constexpr size_t kBlock = 1 << 20;
  std::vector<char> a(kBlock), b(kBlock);
  for (const auto& t : c.chunked()) {
    for (const auto& ch : t.chunks) {
      if (ch.replicas.empty()) continue;
      uint64_t nbytes = *format::byte_size(t.src_dtype, *checked_numel(ch.sizes));
      for (const auto& rep : ch.replicas) {
        // A shard that cannot be opened is a problem already said once.
        if (fd_of(ch.shard) < 0 || fd_of(rep.shard) < 0) continue;
        for (uint64_t off = 0; off < nbytes; off += kBlock) {
          size_t n = static_cast<size_t>(std::min<uint64_t>(kBlock, nbytes - off));
          auto ra = pread_exact(fd_of(ch.shard), a.data(), n, ch.file_offset + off,
                                c.dir + "/" + c.shards[ch.shard].name);
          auto rb = pread_exact(fd_of(rep.shard), b.data(), n, rep.file_offset + off,
                                c.dir + "/" + c.shards[rep.shard].name);
          done += 2 * n;
          bar.update(done, total);
          if (!ra || !rb) {
            problems.push_back(!ra ? ra.error().message : rb.error().message);
            break;
          }
          if (std::memcmp(a.data(), b.data(), n) != 0) {
            problems.push_back(fmt::format(
                "{}: tensor '{}': replica in {} differs from {} (chunk at offsets [{}])", c.dir,
                t.name, c.shards[rep.shard].name, c.shards[ch.shard].name,
                fmt::join(ch.offsets, ", ")));
            break;
          }
        }
      }
    }
  }
}

}  // namespace

int cmd_inspect(std::span<char*> argv) {
  static constexpr OptSpec spec[] = {{"json", 0, false}, {"map", 0, true}, {"hf-config", 0, true}};
  auto parsed = parse_command(argv, spec, {"inspect", kInspectUsage, "DIR", 1});
  if (auto* rc = std::get_if<int>(&parsed)) return *rc;
  auto* args = &std::get<Args>(parsed);
  layout::BuildOptions base;
  if (auto st = source::set_map_options(base, args->get("map").value_or(""),
                                        args->get("hf-config").value_or(""));
      !st) {
    fmt::print(stderr, "ckptfs inspect: {}\n", printable(st.error().message));
    return 2;
  }
  auto all = load_all(args->positional[0], base);
  if (!all) {
    fmt::print(stderr, "ckptfs inspect: {}\n", printable(all.error().message));
    return 1;
  }
  bool ok = all->too_deep.empty();
  for (const auto& c : all->ckpts) ok = ok && c->valid();
  if (args->has("json")) {
    nlohmann::ordered_json j;
    j["checkpoints"] = nlohmann::ordered_json::array();
    for (const auto& c : all->ckpts) j["checkpoints"].push_back(to_json(*c));
    j["not_searched"] = all->too_deep;
    // Messages may quote bytes of malformed input: never let them break the JSON.
    fmt::print("{}\n", j.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace));
  } else {
    for (const auto& c : all->ckpts) print_text(*c);
  }
  report_too_deep("inspect", *all);
  return ok ? 0 : 1;
}

int cmd_verify(std::span<char*> argv) {
  static constexpr OptSpec spec[] = {{"data", 0, false}, {"map", 0, true}, {"hf-config", 0, true}};
  auto parsed = parse_command(argv, spec, {"verify", kVerifyUsage, "DIR", 1});
  if (auto* rc = std::get_if<int>(&parsed)) return *rc;
  auto* args = &std::get<Args>(parsed);
  layout::BuildOptions base;
  if (auto st = source::set_map_options(base, args->get("map").value_or(""),
                                        args->get("hf-config").value_or(""));
      !st) {
    fmt::print(stderr, "ckptfs verify: {}\n", printable(st.error().message));
    return 2;
  }
  auto all = load_all(args->positional[0], base);
  if (!all) {
    fmt::print(stderr, "ckptfs verify: {}\n", printable(all.error().message));
    return 1;
  }
  std::vector<std::string> problems;
  // --data: a bar of the bytes compared (each replica and its primary copy).
  ProgressBar bar("verify --data", args->has("data") && ::isatty(STDERR_FILENO) == 1);
  uint64_t done = 0, total = 0;
  for (const auto& c : all->ckpts) {
    if (!bar.enabled() || !c->valid()) continue;
    for (const auto& t : c->chunked()) {
      for (const auto& ch : t.chunks) {
        if (ch.replicas.empty()) continue;
        total += 2 * ch.replicas.size() * *format::byte_size(t.src_dtype, *checked_numel(ch.sizes));
      }
    }
  }
  for (const auto& c : all->ckpts) {
    for (const auto& p : c->problems) {
      problems.push_back(p.file.empty() ? fmt::format("{}: {}", c->dir, p.to_string())
                                        : fmt::format("{}/{}", c->dir, p.to_string()));
    }
    if (c->valid() && args->has("data")) verify_replicas(*c, problems, bar, done, total);
  }
  bar.end();
  for (const auto& p : problems) fmt::print(stderr, "{}\n", printable(p));
  report_too_deep("verify", *all);
  if (problems.empty() && all->too_deep.empty()) {
    fmt::print("ok: {} checkpoint{} verified\n", all->ckpts.size(),
               all->ckpts.size() == 1 ? "" : "s");
    return 0;
  }
  return 1;
}

}  // namespace ckptfs::cli
