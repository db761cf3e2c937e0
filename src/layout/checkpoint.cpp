// layout/checkpoint: builds and validates the checkpoint model from shard headers (one cohesive
// thing: the builder's passes over one set of chunks).
#include "ckptfs/layout/checkpoint.hpp"

#include "ckptfs/layout/lora.hpp"
#include "ckptfs/layout/map_report.hpp"
#include "ckptfs/layout/model_map.hpp"

#include <algorithm>
#include <map>
#include <numeric>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include <fmt/format.h>

#include "ckptfs/format/cast.hpp"
#include "ckptfs/util/checked.hpp"

namespace ckptfs::layout {
namespace {

using format::DType;

struct TensorBuild {
  std::string name;
  DType dtype = DType::U8;
  size_t rank = 0;
  std::optional<std::vector<uint64_t>> full_shape;
  std::vector<Chunk> chunks;
  uint32_t k = 0;  // output index from shard names (0 = unset)
  bool broken = false;
};

std::string dims_str(const std::vector<uint64_t>& v) {
  return fmt::format("[{}]", fmt::join(v, ", "));
}

class Builder {
 public:
  Builder(BuildInput in, const BuildOptions& opts) : in_(std::move(in)), opts_(opts) {
    ck_ = std::make_shared<Checkpoint>();
    ck_->dir = in_.dir;
    ck_->problems = std::move(in_.problems);
    ck_->notes = std::move(in_.notes);
    ck_->left_out = std::move(in_.left_out);
  }

  std::shared_ptr<const Checkpoint> run() {
    if (in_.declared) {
      collect_declared();
    } else {
      collect_chunks();
    }
    check_output_counts();
    for (auto& tb : order_) finish_tensor(*tb);
    if (ck_->problems.empty()) apply_dtypes();
    if (ck_->problems.empty()) {
      if (in_.lora) {
        apply_lora();  // a PEFT LoRA state dict: split, never mapped
      } else {
        apply_map();
      }
    }
    // -o hf_config in every layout: a checkpoint with no config.json of its own (a mapped one
    // gets it from apply_map; accelerate's save_state writes none) shows it. A real or lifted
    // config.json in the directory is found first (fs/namespace.cpp).
    if (ck_->config_json.empty() && in_.config.empty() && !opts_.hf_config.empty() &&
        ck_->map_note.empty() && ck_->native_name.empty()) {
      ck_->config_json = opts_.hf_config;
      ck_->config_from = hf_config_origin(opts_);
    }
    if (ck_->problems.empty()) assign_outputs();
    if (ck_->problems.empty()) synthesize();
    if (!ck_->problems.empty()) {
      ck_->outputs.clear();
      ck_->index_json.clear();
    }
    return ck_;
  }

 private:
  void problem(std::string file, std::string tensor, std::string msg) {
    ck_->problems.push_back(Problem{std::move(file), std::move(tensor), std::move(msg)});
  }

  const std::string& shard_name(uint32_t s) const { return ck_->shards[s].name; }

  std::string chunk_files(const TensorBuild& tb) const {
    std::set<std::string> names;
    for (const auto& c : tb.chunks) names.insert(shard_name(c.shard));
    return fmt::format("{}", fmt::join(names, ", "));
  }

  TensorBuild& tensor(const std::string& name) {
    auto it = tensors_.find(name);
    if (it != tensors_.end()) return *it->second;
    auto tb = std::make_unique<TensorBuild>();
    tb->name = name;
    auto& ref = *tb;
    tensors_.emplace(name, tb.get());
    order_.push_back(std::move(tb));
    return ref;
  }

  void collect_chunks() {
    auto& inputs = in_.shards;
    std::sort(inputs.begin(), inputs.end(), [](const ShardInput& a, const ShardInput& b) {
      auto pa = format::parse_shard_name(a.name);
      auto pb = format::parse_shard_name(b.name);
      auto ka = pa ? std::tuple(pa->shard, pa->k, pa->m) : std::tuple(0u, 0u, 0u);
      auto kb = pb ? std::tuple(pb->shard, pb->k, pb->m) : std::tuple(0u, 0u, 0u);
      return ka != kb ? ka < kb : a.name < b.name;
    });
    for (auto& in : inputs) {
      auto parsed = format::parse_shard_name(in.name);
      if (!parsed) {
        problem(in.name, "", "not a rank shard file name (shard-R-model-K-of-M.safetensors)");
        continue;
      }
      if (!in.header) {
        problem(in.name, "", in.error.empty() ? "header could not be read" : in.error);
        continue;
      }
      const auto& h = *in.header;
      auto sidx = static_cast<uint32_t>(ck_->shards.size());
      ck_->shards.push_back(ShardFile{in.name, in.stamp, h.data_start(), *parsed, in.owner,
                                      in.remote_path, in.access, in.atime_ns});

      std::optional<format::ShardingInfo> info;
      if (const auto* s = h.find_metadata(format::kShardingInfoKey)) {
        auto r = format::parse_sharding_info(*s, "");  // the problem names the file
        if (!r) {
          problem(in.name, "", r.error().message);
          continue;
        }
        info = std::move(r).value();
        // A set of the header's names, not Header::find per entry: find is a linear scan,
        // and calling it for each of n entries made 20,000-tensor shards take seconds.
        std::unordered_set<std::string_view> names;
        names.reserve(h.tensors.size());
        for (const auto& te : h.tensors) names.insert(te.name);
        for (const auto& [fqn, e] : *info) {
          if (!names.contains(fqn)) {
            problem(in.name, fqn, "listed in DCP_SHARDING_INFO but has no header entry");
          }
        }
      }
      for (const auto& te : h.tensors) {
        std::optional<std::vector<uint64_t>> full;
        std::vector<uint64_t> offsets;
        if (info) {
          auto it = info->find(te.name);
          if (it == info->end()) {
            problem(in.name, te.name, "tensor has no DCP_SHARDING_INFO entry");
            continue;
          }
          offsets = it->second.saved_offsets;
          full = it->second.full_shape;
        } else {
          offsets.assign(te.shape.size(), 0);
        }
        add_chunk(sidx, te.name, te.dtype, h.data_start() + te.begin, std::move(offsets), te.shape,
                  full, parsed->k);
      }
    }
  }

  // Chunks a checkpoint-wide index declares (BuildInput::declared): the shard files keep
  // their order, and each chunk names its file, place, dtype and output.
  void collect_declared() {
    const auto m = in_.declared->outputs;
    ck_->format = in_.declared->format;
    ck_->declared = true;
    for (size_t i = 0; i < in_.shards.size(); ++i) {
      const auto& in = in_.shards[i];
      ck_->shards.push_back(ShardFile{in.name, in.stamp, 0,
                                      format::ShardName{static_cast<uint32_t>(i + 1), 1, m},
                                      in.owner, in.remote_path, in.access, in.atime_ns});
    }
    for (auto& d : in_.declared->chunks) {
      if (d.shard >= ck_->shards.size() || d.k == 0 || d.k > m) {
        problem(in_.dir, d.tensor, "a declared chunk names no shard file or output");  // a bug
        continue;
      }
      add_chunk(d.shard, d.tensor, d.dtype, d.file_offset, std::move(d.offsets), std::move(d.sizes),
                d.full_shape, d.k);
    }
  }

  // One chunk of tensor `name`: `sizes` at `offsets` of the full tensor, its bytes at
  // `file_offset` of shard `sidx`, bound for output `k`. Checks it against the tensor's other
  // chunks (dtype, rank, full shape, output).
  void add_chunk(uint32_t sidx, const std::string& name, DType dtype, uint64_t file_offset,
                 std::vector<uint64_t> offsets, std::vector<uint64_t> sizes,
                 const std::optional<std::vector<uint64_t>>& full, uint32_t k) {
    const std::string& file = shard_name(sidx);
    Chunk c;
    c.shard = sidx;
    c.file_offset = file_offset;
    c.sizes = std::move(sizes);
    c.offsets = std::move(offsets);
    auto& tb = tensor(name);
    if (c.offsets.size() != c.sizes.size()) {
      problem(
          file, name,
          fmt::format("saved_offsets {} has rank {} but the chunk shape {} has rank {}",
                      dims_str(c.offsets), c.offsets.size(), dims_str(c.sizes), c.sizes.size()));
      tb.broken = true;
      return;
    }
    if (full && full->size() != c.sizes.size()) {
      problem(file, name,
              fmt::format("full shape {} has rank {} but the chunk has rank {}", dims_str(*full),
                          full->size(), c.sizes.size()));
      tb.broken = true;
      return;
    }
    if (tb.chunks.empty() && !tb.broken) {
      tb.dtype = dtype;
      tb.rank = c.sizes.size();
      tb.full_shape = full;
      tb.k = k;
    } else {
      if (dtype != tb.dtype) {
        problem(file, name,
                fmt::format("dtype {} differs from {} in {}", format::dtype_name(dtype),
                            format::dtype_name(tb.dtype), chunk_files(tb)));
        tb.broken = true;
      }
      if (c.sizes.size() != tb.rank) {
        problem(file, name,
                fmt::format("number of dimensions {} differs from {} in {}", c.sizes.size(),
                            tb.rank, chunk_files(tb)));
        tb.broken = true;
      }
      if (full && tb.full_shape && *full != *tb.full_shape) {
        problem(file, name,
                fmt::format("full shape {} differs from {} in {}", dims_str(*full),
                            dims_str(*tb.full_shape), chunk_files(tb)));
        tb.broken = true;
      }
      if (full && !tb.full_shape) tb.full_shape = full;
      if (tb.k != k && !in_.mapping) {
        problem(file, name,
                fmt::format("tensor is in output file {} here but in file {} in {}", k, tb.k,
                            chunk_files(tb)));
        tb.broken = true;
      }
    }
    tb.chunks.push_back(std::move(c));
  }

  // Every shard name must agree on M (the number of output files): the most common value
  // wins and each file saying otherwise is named.
  void check_output_counts() {
    std::map<uint32_t, size_t> votes;
    for (const auto& s : ck_->shards) votes[s.parsed.m]++;
    if (votes.size() <= 1) return;
    auto best = std::max_element(votes.begin(), votes.end(),
                                 [](auto& a, auto& b) { return a.second < b.second; });
    for (const auto& s : ck_->shards) {
      if (s.parsed.m == best->first) continue;
      problem(s.name, "",
              fmt::format("name says {} output files but the other {} shard file(s) say {}",
                          s.parsed.m, best->second, best->first));
    }
  }

  // Shape, replica dedup, bounds, tiling and the lookup grid for one tensor.
  void finish_tensor(TensorBuild& tb) {
    if (tb.broken || tb.chunks.empty()) return;
    const size_t r = tb.rank;
    // Bounds of every chunk; infer the full shape when the metadata has none.
    std::vector<uint64_t> shape(r, 0);
    for (const auto& c : tb.chunks) {
      for (size_t d = 0; d < r; ++d) {
        auto e = checked_add(c.offsets[d], c.sizes[d]);
        if (!e) {
          problem(shard_name(c.shard), tb.name,
                  fmt::format("chunk at {} of size {} overflows", dims_str(c.offsets),
                              dims_str(c.sizes)));
          return;
        }
        shape[d] = std::max(shape[d], *e);
      }
    }
    if (tb.full_shape) {
      for (const auto& c : tb.chunks) {
        for (size_t d = 0; d < r; ++d) {
          if (c.offsets[d] + c.sizes[d] > (*tb.full_shape)[d]) {
            problem(shard_name(c.shard), tb.name,
                    fmt::format("chunk at {} of size {} lies outside the tensor shape {}",
                                dims_str(c.offsets), dims_str(c.sizes), dims_str(*tb.full_shape)));
            return;
          }
        }
      }
      shape = *tb.full_shape;
      ++ck_->shapes_stored;
    }
    auto numel = checked_numel(shape);
    auto nbytes = numel ? format::byte_size(tb.dtype, *numel) : std::nullopt;
    if (!numel || !nbytes || *nbytes > (UINT64_MAX >> 4)) {
      problem(chunk_files(tb), tb.name,
              fmt::format("full shape {} of {} overflows or is not a whole number of bytes",
                          dims_str(shape), format::dtype_name(tb.dtype)));
      return;
    }

    // Deduplicate replicas (identical offsets and sizes); drop empty chunks.
    std::vector<Chunk> chunks;
    {
      std::vector<size_t> idx(tb.chunks.size());
      std::iota(idx.begin(), idx.end(), 0);
      std::stable_sort(idx.begin(), idx.end(), [&](size_t a, size_t b) {
        const auto& ca = tb.chunks[a];
        const auto& cb = tb.chunks[b];
        return std::tie(ca.offsets, ca.sizes) < std::tie(cb.offsets, cb.sizes);
      });
      for (size_t i : idx) {
        auto& c = tb.chunks[i];
        auto cn = checked_numel(c.sizes);
        if (*numel != 0 && cn && *cn == 0) continue;
        if (!chunks.empty() && chunks.back().offsets == c.offsets &&
            chunks.back().sizes == c.sizes) {
          chunks.back().replicas.push_back(Replica{c.shard, c.file_offset});
          continue;
        }
        chunks.push_back(std::move(c));
      }
      if (chunks.empty()) chunks.push_back(std::move(tb.chunks.front()));
    }

    Tensor t;
    t.name = tb.name;
    t.dtype = tb.dtype;
    t.src_dtype = tb.dtype;
    t.shape = shape;
    t.numel = *numel;
    t.nbytes = *nbytes;
    t.strides.assign(r, 1);
    for (size_t d = r; d-- > 1;) t.strides[d - 1] = t.strides[d] * shape[d];
    for (auto& c : chunks) {
      uint32_t k = 0;
      for (size_t d = r; d-- > 0;) {
        if (c.sizes[d] != shape[d]) {
          k = static_cast<uint32_t>(d);
          break;
        }
      }
      c.run_dim = k;
    }
    t.chunks = std::move(chunks);
    if (*numel > 0) {
      if (!check_tiling(t)) return;
      if (!check_bit_alignment(t)) return;
    } else {
      // Empty tensor: nothing to tile; keep per-dim bounds for inspect.
      t.grid.bounds.assign(r, {});
      for (size_t d = 0; d < r; ++d) {
        auto& b = t.grid.bounds[d];
        b = {0, shape[d]};
        for (const auto& c : t.chunks) b.push_back(c.offsets[d] + c.sizes[d]);
        std::sort(b.begin(), b.end());
        b.erase(std::unique(b.begin(), b.end()), b.end());
        if (b.size() < 2) b.push_back(b.back());
      }
    }
    tensor_index_.emplace(t.name, static_cast<uint32_t>(ck_->tensors.size()));
    tensor_k_.push_back(tb.k);
    ck_->tensors.push_back(std::move(t));
  }

  std::string chunk_desc(const Tensor& t, uint32_t c) const {
    const auto& ch = t.chunks[c];
    return fmt::format("{} (offsets {}, shape {})", shard_name(ch.shard), dims_str(ch.offsets),
                       dims_str(ch.sizes));
  }

  std::string tensor_files(const Tensor& t) const {
    std::set<std::string> names;
    for (const auto& c : t.chunks) names.insert(shard_name(c.shard));
    return fmt::format("{}", fmt::join(names, ", "));
  }

  // Validates that the chunks tile the tensor exactly, and builds the lookup grid.
  bool check_tiling(Tensor& t) {
    const size_t r = t.shape.size();
    auto& g = t.grid;
    g.bounds.assign(r, {});
    for (size_t d = 0; d < r; ++d) {
      auto& b = g.bounds[d];
      b.push_back(0);
      b.push_back(t.shape[d]);
      for (const auto& c : t.chunks) {
        b.push_back(c.offsets[d]);
        b.push_back(c.offsets[d] + c.sizes[d]);
      }
      std::sort(b.begin(), b.end());
      b.erase(std::unique(b.begin(), b.end()), b.end());
    }
    uint64_t cells = 1;
    bool too_many = false;
    for (size_t d = 0; d < r; ++d) {
      auto n = checked_mul(cells, g.bounds[d].size() - 1);
      if (!n || *n > opts_.max_grid_cells) {
        too_many = true;
        break;
      }
      cells = *n;
    }
    if (too_many) {
      g = ChunkGrid{};
      return check_tiling_slow(t);
    }
    g.cell_chunk.assign(cells, UINT32_MAX);
    std::vector<size_t> lo(r), hi(r), cur(r);
    for (uint32_t ci = 0; ci < t.chunks.size(); ++ci) {
      const auto& c = t.chunks[ci];
      bool empty = false;
      for (size_t d = 0; d < r; ++d) {
        const auto& b = g.bounds[d];
        lo[d] = static_cast<size_t>(std::lower_bound(b.begin(), b.end(), c.offsets[d]) - b.begin());
        hi[d] = static_cast<size_t>(
            std::lower_bound(b.begin(), b.end(), c.offsets[d] + c.sizes[d]) - b.begin());
        if (lo[d] == hi[d]) empty = true;
      }
      if (empty) continue;
      cur = lo;
      while (true) {
        uint64_t cell = 0;
        for (size_t d = 0; d < r; ++d) cell = cell * (g.bounds[d].size() - 1) + cur[d];
        if (g.cell_chunk[cell] != UINT32_MAX) {
          problem(tensor_files(t), t.name,
                  fmt::format("chunks overlap: {} and {}", chunk_desc(t, g.cell_chunk[cell]),
                              chunk_desc(t, ci)));
          return false;
        }
        g.cell_chunk[cell] = ci;
        size_t d = r;
        while (d > 0) {
          --d;
          if (++cur[d] < hi[d]) break;
          cur[d] = lo[d];
          if (d == 0) goto next_chunk;
        }
        if (r == 0) break;
      }
    next_chunk:;
    }
    for (uint64_t cell = 0; cell < cells; ++cell) {
      if (g.cell_chunk[cell] != UINT32_MAX) continue;
      std::vector<uint64_t> at(r), to(r);
      uint64_t rem = cell;
      for (size_t d = r; d-- > 0;) {
        size_t n = g.bounds[d].size() - 1;
        size_t i = rem % n;
        rem /= n;
        at[d] = g.bounds[d][i];
        to[d] = g.bounds[d][i + 1];
      }
      problem(tensor_files(t), t.name,
              fmt::format("gap: no chunk covers the region from {} to {} of shape {} (missing "
                          "shard?)",
                          dims_str(at), dims_str(to), dims_str(t.shape)));
      return false;
    }
    return true;
  }

  // Fallback for grids too irregular for a cell table: volume sum plus a pairwise overlap
  // sweep ordered by the first dimension.
  bool check_tiling_slow(const Tensor& t) {
    const size_t r = t.shape.size();
    unsigned __int128 vol = 0;
    for (const auto& c : t.chunks) {
      unsigned __int128 v = 1;
      for (auto s : c.sizes) v *= s;
      vol += v;
    }
    std::vector<uint32_t> idx(t.chunks.size());
    std::iota(idx.begin(), idx.end(), 0);
    std::sort(idx.begin(), idx.end(), [&](uint32_t a, uint32_t b) {
      return t.chunks[a].offsets[0] < t.chunks[b].offsets[0];
    });
    for (size_t i = 0; i < idx.size(); ++i) {
      const auto& a = t.chunks[idx[i]];
      for (size_t j = i + 1; j < idx.size(); ++j) {
        const auto& b = t.chunks[idx[j]];
        if (b.offsets[0] >= a.offsets[0] + a.sizes[0]) break;
        bool overlap = true;
        for (size_t d = 0; d < r && overlap; ++d) {
          overlap =
              a.offsets[d] < b.offsets[d] + b.sizes[d] && b.offsets[d] < a.offsets[d] + a.sizes[d];
        }
        if (overlap) {
          problem(tensor_files(t), t.name,
                  fmt::format("chunks overlap: {} and {}", chunk_desc(t, idx[i]),
                              chunk_desc(t, idx[j])));
          return false;
        }
      }
    }
    if (vol != t.numel) {
      problem(tensor_files(t), t.name,
              fmt::format("gap: chunks cover {} of the {} elements of shape {} (missing shard?)",
                          static_cast<uint64_t>(vol), t.numel, dims_str(t.shape)));
      return false;
    }
    return true;
  }

  // Sub-byte dtypes: every run must start and end on a byte boundary in both the
  // consolidated tensor and the chunk, or bytes could not be served straight from shards.
  // A run of chunk c is x_0..x_{k-1} fixed, x_k spanning the chunk, inner dims full. Its
  // start bit is sum(x_d T_d) * bits: all are byte-aligned iff the chunk's first one is and
  // every step of a dim d < k that the chunk spans is. Chunk-side starts are multiples of the
  // run length, so that must be byte-aligned too. Arithmetic is mod 8.
  bool check_bit_alignment(const Tensor& t) {
    const uint64_t bits = format::dtype_bits(t.dtype);
    if (bits % 8 == 0 || t.shape.empty()) return true;
    auto mod8 = [bits](uint64_t a) { return ((a % 8) * bits) % 8; };
    for (uint32_t ci = 0; ci < t.chunks.size(); ++ci) {
      const auto& c = t.chunks[ci];
      const size_t k = c.run_dim;
      uint64_t base = 0;
      for (size_t d = 0; d < t.shape.size(); ++d)
        base += mod8((c.offsets[d] % 8) * (t.strides[d] % 8));
      bool ok = base % 8 == 0 && mod8((c.sizes[k] % 8) * (t.strides[k] % 8)) == 0;
      for (size_t d = 0; d < k && ok; ++d) ok = c.sizes[d] <= 1 || mod8(t.strides[d]) == 0;
      if (!ok) {
        problem(shard_name(c.shard), t.name,
                fmt::format("{} chunk {} splits elements inside a byte; sub-byte chunks must "
                            "start and end on byte boundaries",
                            format::dtype_name(t.dtype), chunk_desc(t, ci)));
        return false;
      }
    }
    return true;
  }

  void assign_outputs() {
    const bool use_map = in_.mapping.has_value();
    ck_->from_mapping = use_map;
    std::vector<uint32_t> order;  // tensor indexes in output order
    uint32_t m = 0;
    if (use_map) {
      std::unordered_map<std::string, uint32_t> k_of;
      for (const auto& [fqn, k] : *in_.mapping) {
        k_of.emplace(fqn, k);
        m = std::max(m, k);
        auto it = tensor_index_.find(fqn);
        if (it == tensor_index_.end()) {
          problem(
              std::string(format::kHfMetadataDir) + "/" + std::string(format::kFqnMappingFileName),
              fqn, "listed in the mapping file but found in no shard (missing shard?)");
          continue;
        }
        order.push_back(it->second);
      }
      for (uint32_t i = 0; i < ck_->tensors.size(); ++i) {
        auto it = k_of.find(ck_->tensors[i].name);
        if (it == k_of.end()) {
          problem(tensor_files(ck_->tensors[i]), ck_->tensors[i].name,
                  fmt::format("tensor is not in {}", format::kFqnMappingFileName));
          continue;
        }
        tensor_k_[i] = it->second;
      }
    } else {
      order.resize(ck_->tensors.size());
      std::iota(order.begin(), order.end(), 0);
      std::sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
        return ck_->tensors[a].name < ck_->tensors[b].name;
      });
      for (const auto& s : ck_->shards) m = std::max(m, s.parsed.m);
      if (!ck_->map.empty()) m = *std::max_element(tensor_k_.begin(), tensor_k_.end());
      if (ck_->adapter) m = lora_m_;
    }
    if (!ck_->problems.empty()) return;
    if (ck_->tensors.empty()) {
      problem("", "", "no tensors found");
      return;
    }
    std::map<uint32_t, uint32_t> out_of_k;  // k -> index into outputs, in k order
    for (uint32_t ti : order) out_of_k.emplace(tensor_k_[ti], 0);
    uint32_t idx = 0;
    for (auto& [k, o] : out_of_k) {
      o = idx++;
      OutputFile f;
      if (ck_->adapter && k == ck_->adapter->k) {
        f.name = std::string(format::kAdapterModelName);
        f.folder = ck_->adapter->dir;
      } else if (!ck_->lora_merged.empty() && k == lora_m_ + 1) {  // never shown
        f.name = std::string(format::kAdapterModelName);
        f.folder = std::string(format::kLoraFactorsFolder);
      } else {
        f.name = format::model_file_name(k, m);
      }
      f.k = k;
      ck_->outputs.push_back(std::move(f));
    }
    for (uint32_t ti : order) {
      auto o = out_of_k[tensor_k_[ti]];
      ck_->tensors[ti].output = o;
      ck_->outputs[o].tensors.push_back(ti);
    }
  }

  // The served dtype of each tensor (BuildOptions::dtype_policy); sizes follow it.
  void apply_dtypes() {
    using P = BuildOptions::DtypePolicy;
    if (opts_.dtype_policy == P::Stored) return;
    if (opts_.dtype_policy == P::Mapping && !in_.dtypes) return;
    std::unordered_map<std::string_view, DType> mapped;
    if (opts_.dtype_policy == P::Mapping) {
      // Entries naming no tensor of the checkpoint are ignored, as NeMo's consolidation does.
      for (const auto& [fqn, d] : *in_.dtypes) mapped.emplace(fqn, d);
    }
    for (auto& t : ck_->tensors) {
      if (!format::castable(t.src_dtype)) continue;
      DType to = t.src_dtype;
      if (opts_.dtype_policy == P::Cast) {
        to = opts_.cast_to;
      } else if (auto it = mapped.find(t.name);
                 it != mapped.end() && format::castable(it->second)) {
        to = it->second;
      }
      if (to == t.src_dtype || !format::castable(to)) continue;
      auto nbytes = format::byte_size(to, t.numel);
      if (!nbytes || *nbytes > (UINT64_MAX >> 4)) {
        problem(tensor_files(t), t.name,
                fmt::format("{} elements as {} overflow", t.numel, format::dtype_name(to)));
        return;
      }
      t.dtype = to;
      t.nbytes = *nbytes;
    }
  }

  // A model map (BuildOptions::map, or the first built-in whose detect clause holds) turns the
  // stored tensors into HF ones: ck_->stored keeps them, ck_->tensors becomes the mapped
  // tensors, packed in rule order into outputs of at most kMaxOutputBytes.
  void apply_map() {
    if (opts_.no_map || !in_.overrides.empty() || ck_->tensors.empty()) return;
    if (!apply_model_map(in_, opts_, *ck_, tensor_k_)) {
      // Served under its stored names: say so where they are a trainer's own (never a
      // silently wrong model).
      if (ck_->problems.empty()) {
        auto report = explain_unmapped(ck_->tensors, ck_->format);
        ck_->native_name = std::move(report.native);
        if (!ck_->native_name.empty()) ck_->map_trials = std::move(report.trials);
      }
      return;
    }
    tensor_index_.clear();
    for (uint32_t i = 0; i < ck_->tensors.size(); ++i)
      tensor_index_.emplace(ck_->tensors[i].name, i);
  }

  // A PEFT LoRA state dict (BuildInput::lora): the base model under HF names, the adapter in a
  // folder of its own (layout/lora.hpp).
  void apply_lora() {
    lora_m_ = lora::apply(*in_.lora, opts_.lora_merged, *ck_, tensor_k_);
    tensor_index_.clear();
    for (uint32_t i = 0; i < ck_->tensors.size(); ++i)
      tensor_index_.emplace(ck_->tensors[i].name, i);
  }

  // A tensor served as stored again (outputs written through ckptfs keep their headers).
  static void uncast(Tensor& t) {
    if (!t.is_cast()) return;
    t.dtype = t.src_dtype;
    t.nbytes = *format::byte_size(t.dtype, t.numel);  // checked when the tensor was built
  }

  // Output `f` takes the exact header of the file written through ckptfs: same tensors (name,
  // dtype, shape), data offsets from that header.
  bool apply_override(OutputFile& f, const OutputOverride& o, format::Index& index) {
    const auto& h = *o.parsed;
    if (h.tensors.size() != f.tensors.size()) {
      problem(o.record, "",
              fmt::format("describes {} tensors but shards of {} hold {}", h.tensors.size(), f.name,
                          f.tensors.size()));
      return false;
    }
    std::unordered_map<std::string_view, uint32_t> by_name;
    for (uint32_t ti : f.tensors) by_name.emplace(ck_->tensors[ti].name, ti);
    std::vector<uint32_t> order;
    std::set<uint32_t> shards;
    for (uint32_t ti : f.tensors) uncast(ck_->tensors[ti]);
    for (const auto& e : h.tensors) {  // sorted by data offset
      auto it = by_name.find(e.name);
      if (it == by_name.end()) {
        problem(o.record, e.name, fmt::format("not in the shards of {}", f.name));
        return false;
      }
      auto& t = ck_->tensors[it->second];
      if (t.dtype != e.dtype || t.shape != e.shape || t.nbytes != e.nbytes()) {
        problem(o.record, e.name,
                fmt::format("record says {} {}, shards say {} {}", format::dtype_name(e.dtype),
                            dims_str(e.shape), format::dtype_name(t.dtype), dims_str(t.shape)));
        return false;
      }
      t.out_offset = h.data_start() + e.begin;
      order.push_back(it->second);
      for (const auto& c : t.chunks) shards.insert(c.shard);
      if (t.nbytes > 0) {
        f.data_starts.push_back(t.out_offset);
        f.data_tensors.push_back(it->second);
      }
    }
    f.tensors = std::move(order);
    f.name = o.name;
    f.header = o.header;
    f.size = h.file_size();
    f.written = true;
    f.shards.assign(shards.begin(), shards.end());
    for (uint32_t ti : f.tensors) {
      const auto& t = ck_->tensors[ti];
      index.weight_map.emplace_back(t.name, f.name);
      index.total_size += t.nbytes;
      index.total_parameters += t.numel;
    }
    ck_->written = true;
    return true;
  }

  void synthesize() {
    format::Index index;
    for (auto& f : ck_->outputs) {
      if (auto o = std::find_if(in_.overrides.begin(), in_.overrides.end(),
                                [&](const OutputOverride& x) { return x.k == f.k; });
          o != in_.overrides.end()) {
        if (!apply_override(f, *o, index)) {
          ck_->outputs.clear();
          return;
        }
        continue;
      }
      std::vector<format::TensorEntry> entries;
      entries.reserve(f.tensors.size());
      std::set<uint32_t> shards;
      for (uint32_t ti : f.tensors) {
        const auto& t = ck_->tensors[ti];
        format::TensorEntry e;
        e.name = t.name;
        e.dtype = t.dtype;
        e.shape = t.shape;
        if (!format::append_packed(entries, std::move(e), t.nbytes)) {
          problem(f.name, t.name, "output file size overflows");
          ck_->outputs.clear();
          return;
        }
        for (const auto& c : t.chunks) shards.insert(c.shard);
        for (const auto& r : t.runs) {
          for (const auto& c : ck_->stored[r.src].chunks) shards.insert(c.shard);
        }
        if (t.merge) {  // a merged weight is read from its factors' shards too
          for (uint32_t fi : {t.merge->a, t.merge->b}) {
            for (const auto& c : ck_->tensors[fi].chunks) shards.insert(c.shard);
          }
        }
        if (!f.folder.empty()) continue;  // the adapter's: not the model's index
        index.weight_map.emplace_back(t.name, f.name);
        index.total_size += t.nbytes;
        index.total_parameters += t.numel;
      }
      f.header = format::serialize_header(entries, opts_.output_metadata);
      for (size_t i = 0; i < f.tensors.size(); ++i) {
        auto& t = ck_->tensors[f.tensors[i]];
        t.out_offset = f.header.size() + entries[i].begin;
        if (t.nbytes > 0) {
          f.data_starts.push_back(t.out_offset);
          f.data_tensors.push_back(f.tensors[i]);
        }
      }
      f.size = f.header.size() + (entries.empty() ? 0 : entries.back().end);
      f.shards.assign(shards.begin(), shards.end());
    }
    // No model file in the directory (a LoRA adapter alone): no index either.
    if (!index.weight_map.empty()) ck_->index_json = format::serialize_index(index);
  }

  BuildInput in_;
  const BuildOptions& opts_;
  std::shared_ptr<Checkpoint> ck_;
  std::unordered_map<std::string, TensorBuild*> tensors_;
  std::vector<std::unique_ptr<TensorBuild>> order_;
  std::unordered_map<std::string, uint32_t> tensor_index_;
  std::vector<uint32_t> tensor_k_;  // parallel to ck_->tensors
  uint32_t lora_m_ = 0;             // apply_lora: the base model's output files
};

}  // namespace

uint32_t OutputPacker::place(uint64_t bytes) {
  if (in_k_ > 0 && bytes > kMaxOutputBytes - std::min(in_k_, kMaxOutputBytes)) {
    ++k_;
    in_k_ = 0;
  }
  in_k_ = checked_add(in_k_, bytes).value_or(UINT64_MAX);
  return k_;
}

std::string Problem::to_string() const {
  std::string out;
  if (!file.empty()) out += file + ": ";
  if (!tensor.empty()) out += fmt::format("tensor '{}': ", tensor);
  out += message;
  return out;
}

uint64_t Checkpoint::total_bytes() const {
  uint64_t n = 0;
  for (const auto& t : tensors) n += t.nbytes;
  return n;
}

const OutputFile* Checkpoint::find_output(std::string_view name) const {
  for (const auto& f : outputs) {
    if (f.folder.empty() && f.name == name) return &f;
  }
  return nullptr;
}

Status set_dtype_policy(BuildOptions& opts, std::string_view v) {
  using P = BuildOptions::DtypePolicy;
  if (v == "auto") {
    opts.dtype_policy = P::Mapping;
  } else if (v == "stored") {
    opts.dtype_policy = P::Stored;
  } else if (v == "bf16" || v == "bfloat16") {
    opts.dtype_policy = P::Cast;
    opts.cast_to = DType::BF16;
  } else if (v == "fp16" || v == "f16" || v == "float16") {
    opts.dtype_policy = P::Cast;
    opts.cast_to = DType::F16;
  } else if (v == "fp32" || v == "f32" || v == "float32") {
    opts.dtype_policy = P::Cast;
    opts.cast_to = DType::F32;
  } else {
    return make_error(EINVAL, "dtype: expected auto, stored, bf16, fp16 or fp32, got '{}'", v);
  }
  return {};
}

// Never throws: a build that fails inside (memory, a name the JSON writer refuses) gives a
// checkpoint refused with that problem, so no caller is left holding a half-made state.
std::shared_ptr<const Checkpoint> build_checkpoint(BuildInput in, const BuildOptions& opts) {
  std::string dir = in.dir;
  std::string why;
  try {
    return Builder(std::move(in), opts).run();
  } catch (const std::bad_alloc&) {
    why = "out of memory while building the consolidated view";
  } catch (const std::exception& e) {
    why = fmt::format("the consolidated view could not be built: {}", e.what());
  }
  auto ck = std::make_shared<Checkpoint>();
  ck->dir = std::move(dir);
  ck->problems.push_back(Problem{"", "", std::move(why)});
  return ck;
}

}  // namespace ckptfs::layout
