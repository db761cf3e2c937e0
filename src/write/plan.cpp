// write/plan: the rank plan: how each tensor of a written file is cut into DCP chunks.
#include "ckptfs/write/plan.hpp"

#include <algorithm>
#include <memory>

#include <fmt/format.h>

#include "ckptfs/format/dcp.hpp"
#include "ckptfs/util/checked.hpp"

namespace ckptfs::write {
namespace {

std::vector<std::string_view> components(std::string_view s) {
  std::vector<std::string_view> out;
  size_t start = 0;
  while (true) {
    size_t dot = s.find('.', start);
    out.push_back(s.substr(start, dot == std::string_view::npos ? dot : dot - start));
    if (dot == std::string_view::npos) return out;
    start = dot + 1;
  }
}

bool component_matches(std::string_view pat, std::string_view name) {
  if (pat != "*") return pat == name;
  return !name.empty() &&
         std::all_of(name.begin(), name.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// Does `pattern` match a run of whole components of `fqn`?
bool pattern_matches(const std::vector<std::string_view>& pat,
                     const std::vector<std::string_view>& fqn) {
  if (pat.empty() || pat.size() > fqn.size()) return false;
  for (size_t start = 0; start + pat.size() <= fqn.size(); ++start) {
    bool all = true;
    for (size_t i = 0; i < pat.size() && all; ++i) all = component_matches(pat[i], fqn[start + i]);
    if (all) return true;
  }
  return false;
}

// The dim a TP style splits, or 0 (the even default) when unmatched or unknown.
uint32_t tp_dim(const PlanOptions& opts, std::string_view fqn) {
  const auto parts = components(fqn);
  size_t best_len = 0;
  uint32_t dim = 0;
  for (const auto& [pattern, style] : opts.tp_plan) {
    if (pattern.size() <= best_len || !pattern_matches(components(pattern), parts)) continue;
    best_len = pattern.size();
    dim = style == "rowwise" ? 1 : 0;
  }
  return dim;
}

// (a * b * c) mod 8 without overflow.
uint64_t mul_mod8(uint64_t a, uint64_t b, uint64_t c) { return ((a % 8) * (b % 8) * (c % 8)) % 8; }

}  // namespace

Result<Plan> plan(const format::Header& h, const PlanOptions& opts, std::string_view what) {
  if (opts.ranks == 0 || opts.ranks > kMaxRanks) {
    return make_error(EINVAL, "{}: rank count {} is outside [1, {}]", what, opts.ranks, kMaxRanks);
  }
  Plan p;
  p.ranks = opts.ranks;
  p.rank_bytes.assign(opts.ranks, 0);
  p.tensors.resize(h.tensors.size());
  std::vector<size_t> whole;  // tensors placed after the splits, to balance what they left
  for (size_t i = 0; i < h.tensors.size(); ++i) {
    const auto& t = h.tensors[i];
    auto& tp = p.tensors[i];
    tp.name = t.name;
    const uint64_t nbytes = t.nbytes();
    auto numel = checked_numel(t.shape);
    if (!numel) {
      return make_error(EOVERFLOW, "{}: tensor '{}': shape overflows 64 bits", what, t.name);
    }
    if (t.shape.size() < 2 || *numel == 0 || nbytes < opts.min_split_bytes) {
      whole.push_back(i);
      continue;
    }
    const uint32_t d = opts.split == PlanOptions::TpPlan ? tp_dim(opts, t.name) : 0;
    const uint64_t extent = t.shape[d];
    const uint64_t parts = std::min<uint64_t>(extent, opts.ranks);
    const uint64_t base = extent / parts;
    const uint64_t rem = extent % parts;
    // Elements per unit step along d, and per unit step along d - 1 (the row stride a
    // dim-1 split's runs repeat with).
    auto inner = checked_numel(std::span(t.shape).subspan(d + 1));
    const uint64_t bits = format::dtype_bits(t.dtype);
    uint64_t pos = 0;
    bool aligned = true;
    for (uint64_t r = 0; r < parts; ++r) {
      PlanChunk c;
      c.rank = static_cast<uint32_t>(r);
      c.offsets.assign(t.shape.size(), 0);
      c.sizes = t.shape;
      c.offsets[d] = pos;
      c.sizes[d] = base + (r < rem ? 1 : 0);
      pos += c.sizes[d];
      // A sub-byte split must start and end every run on a byte boundary (the shard is a
      // safetensors file, and runs are routed by byte).
      if (bits % 8 != 0 &&
          (mul_mod8(c.offsets[d], *inner, bits) != 0 || mul_mod8(c.sizes[d], *inner, bits) != 0 ||
           (d > 0 && mul_mod8(t.shape[d], *inner, bits) != 0))) {
        aligned = false;
        break;
      }
      auto cn = checked_numel(c.sizes);
      auto cb = cn ? format::byte_size(t.dtype, *cn) : std::nullopt;
      if (!cb) {
        return make_error(EINVAL, "{}: tensor '{}': chunk {} size does not fit", what, t.name, r);
      }
      c.nbytes = *cb;
      tp.chunks.push_back(std::move(c));
    }
    if (!aligned) {
      tp.chunks.clear();
      whole.push_back(i);
      continue;
    }
    tp.split_dim = d;
    for (const auto& c : tp.chunks) p.rank_bytes[c.rank] += c.nbytes;  // sums <= data_size
  }
  for (size_t i : whole) {
    const auto& t = h.tensors[i];
    auto& tp = p.tensors[i];
    const auto it = std::min_element(p.rank_bytes.begin(), p.rank_bytes.end());
    PlanChunk c;
    c.rank = static_cast<uint32_t>(it - p.rank_bytes.begin());
    c.offsets.assign(t.shape.size(), 0);
    c.sizes = t.shape;
    c.nbytes = t.nbytes();
    *it += c.nbytes;
    tp.split_dim = TensorPlan::kWhole;
    tp.chunks = {std::move(c)};
  }
  return p;
}

Result<layout::ShardSet> shard_headers(const format::Header& h, const Plan& p,
                                       std::string_view what) {
  if (p.tensors.size() != h.tensors.size() || p.rank_bytes.size() != p.ranks) {
    return make_error(EINVAL, "{}: plan has {} tensors for a header of {}", what, p.tensors.size(),
                      h.tensors.size());
  }
  std::vector<std::vector<format::TensorEntry>> entries(p.ranks);
  std::vector<format::ShardingInfo> info(p.ranks);
  layout::ShardSet s;
  s.chunk_offset.resize(p.tensors.size());
  for (size_t i = 0; i < p.tensors.size(); ++i) {
    const auto& t = h.tensors[i];
    const auto& tp = p.tensors[i];
    if (tp.name != t.name) {
      return make_error(EINVAL, "{}: tensor '{}': plan entry {} is for '{}'", what, t.name, i,
                        tp.name);
    }
    s.chunk_offset[i].resize(tp.chunks.size());
    for (const auto& c : tp.chunks) {
      if (c.rank >= p.ranks || info[c.rank].count(t.name) != 0) {
        return make_error(EINVAL,
                          "{}: tensor '{}': plan puts a chunk on rank {} of {} twice or "
                          "out of range",
                          what, t.name, c.rank, p.ranks);
      }
      format::TensorEntry e;
      e.name = t.name;
      e.dtype = t.dtype;
      e.shape = c.sizes;
      if (auto st = format::append_packed(entries[c.rank], std::move(e), c.nbytes); !st) {
        return make_error(EOVERFLOW, "{}: tensor '{}': rank {} shard size overflows", what, t.name,
                          c.rank);
      }
      info[c.rank][t.name] = format::ShardingEntry{c.offsets, t.shape};
    }
  }
  s.shards.resize(p.ranks);
  std::vector<std::shared_ptr<format::Header>> parsed(p.ranks);
  for (uint32_t r = 0; r < p.ranks; ++r) {
    std::map<std::string, std::string> md{
        {std::string(format::kShardingInfoKey), format::serialize_sharding_info(info[r])},
        {std::string(format::kDcpVersionKey), "1.0"},
        {"format", "pt"},
    };
    auto& sh = s.shards[r];
    sh.rank = r;
    sh.header = format::serialize_header(entries[r], md, 8);
    sh.data_size = entries[r].empty() ? 0 : entries[r].back().end;
    // Each shard carries its tensors' names twice (entries and DCP_SHARDING_INFO): a header
    // near the limit can give shards no reader would open.
    if (sh.header.size() - format::kHeaderLenBytes > format::kMaxHeaderSize) {
      return make_error(EFBIG,
                        "{}: rank {}'s shard header would be {} bytes, over the {} byte "
                        "safetensors limit",
                        what, r, sh.header.size() - format::kHeaderLenBytes,
                        format::kMaxHeaderSize);
    }
    // The same header parsed, made from what it was serialized from: the store checks read
    // it, so no one parses bytes written here.
    parsed[r] = std::make_shared<format::Header>();
    parsed[r]->json_len = sh.header.size() - format::kHeaderLenBytes;
    parsed[r]->data_size = sh.data_size;
    parsed[r]->metadata = std::move(md);
  }
  // Absolute chunk offsets, now that each header's length is known.
  std::vector<size_t> next(p.ranks, 0);
  for (size_t i = 0; i < p.tensors.size(); ++i) {
    for (size_t c = 0; c < p.tensors[i].chunks.size(); ++c) {
      const uint32_t r = p.tensors[i].chunks[c].rank;
      s.chunk_offset[i][c] = s.shards[r].header.size() + entries[r][next[r]++].begin;
    }
  }
  for (uint32_t r = 0; r < p.ranks; ++r) {
    parsed[r]->tensors = std::move(entries[r]);
    s.shards[r].parsed = std::move(parsed[r]);
  }
  return s;
}

}  // namespace ckptfs::write
