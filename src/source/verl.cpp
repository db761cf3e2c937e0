// Reading a verl FSDP checkpoint directory (fsdp_config.json, model_world_size_W_rank_R.pt).
#include "ckptfs/source/verl.hpp"

#include <sys/stat.h>

#include <algorithm>
#include <map>
#include <unordered_map>

#include <fmt/format.h>

#include "ckptfs/format/verl.hpp"
#include "ckptfs/format/zip.hpp"
#include "ckptfs/source/distcp.hpp"
#include "ckptfs/util/checked.hpp"
#include "ckptfs/util/fd.hpp"
#include "ckptfs/util/path.hpp"

namespace ckptfs::source {
namespace {

using format::Placement;
using format::RankTensor;

std::string dims(const std::vector<uint64_t>& v) { return fmt::format("[{}]", fmt::join(v, ", ")); }

bool same_placements(const std::vector<Placement>& a, const std::vector<Placement>& b) {
  return std::equal(a.begin(), a.end(), b.begin(), b.end(), [](const auto& x, const auto& y) {
    return x.kind == y.kind && x.dim == y.dim;
  });
}

// One rank's file, read: its archive's members and its state dict.
struct Rank {
  uint32_t shard = 0;  // index into BuildInput::shards
  std::string name;
  format::zip::TorchArchive archive;
  format::RankStateDict sd;
  std::unordered_map<std::string_view, size_t> by_key;  // into sd.tensors
};

Result<Rank> read_rank(int dirfd, const std::string& name, layout::BuildInput& in) {
  struct stat st {};
  CKPTFS_TRY(UniqueFd fd, open_regular_at(dirfd, name, name, &st));
  const auto size = static_cast<uint64_t>(st.st_size);
  auto read = [&](uint64_t off, std::span<char> out) -> Status {
    if (off > size || out.size() > size - off) {
      return make_error(EINVAL, "{}: a read past the end of the file", name);
    }
    return pread_exact(fd.get(), out.data(), out.size(), off, name);
  };
  CKPTFS_TRY(auto members, format::zip::members(size, read, name));
  Rank r;
  r.name = name;
  CKPTFS_TRY(r.archive, format::zip::torch_archive(std::move(members), name));
  if (r.archive.pickle.size > format::kMaxVerlPickleBytes) {
    return make_error(EINVAL, "{}: data.pkl of {} bytes (at most {})", name, r.archive.pickle.size,
                      format::kMaxVerlPickleBytes);
  }
  std::string pkl(r.archive.pickle.size, '\0');
  CKPTFS_CHECK(read(r.archive.pickle.offset, std::span<char>(pkl.data(), pkl.size())));
  CKPTFS_TRY(r.sd, format::parse_rank_state_dict(pkl, name));
  for (size_t i = 0; i < r.sd.tensors.size(); ++i) {
    if (!r.by_key.emplace(r.sd.tensors[i].key, i).second) {
      return make_error(EINVAL, "{}: tensor '{}' twice in the state dict", name,
                        r.sd.tensors[i].key);
    }
  }
  layout::ShardInput si;
  si.name = name;
  si.stamp = stamp_of(st);
  si.access = layout::Access{st.st_uid, st.st_gid, static_cast<uint32_t>(st.st_mode & 07777)};
  si.atime_ns = static_cast<int64_t>(st.st_atim.tv_sec) * 1'000'000'000 + st.st_atim.tv_nsec;
  r.shard = static_cast<uint32_t>(in.shards.size());
  in.shards.push_back(std::move(si));
  return r;
}

// Where rank `rank`'s piece of `t` lies in the full tensor: offsets and sizes, nullopt if the
// piece is a replica of another rank's (a Replicate mesh dimension at a coordinate past 0).
struct Piece {
  std::vector<uint64_t> offsets, sizes;
};
Result<std::optional<Piece>> piece_of(const RankTensor& t, uint32_t rank,
                                      const std::vector<uint64_t>& mesh) {
  Piece p;
  p.offsets.assign(t.global_size.size(), 0);
  p.sizes = t.global_size;
  if (!t.dtensor) {
    if (rank != 0) return std::optional<Piece>();
    return std::optional<Piece>(std::move(p));
  }
  std::vector<uint64_t> coord = t.coordinate;
  if (coord.empty()) coord.assign(1, rank);  // checked: a 1-D mesh without a recorded coordinate
  std::vector<bool> split(t.global_size.size(), false);
  bool replica = false;
  for (size_t i = 0; i < t.placements.size(); ++i) {
    const Placement& pl = t.placements[i];
    if (pl.kind == Placement::Kind::Replicate) {
      replica = replica || coord[i] != 0;
      continue;
    }
    if (split[pl.dim]) {
      return make_error(
          EINVAL, "two mesh dimensions shard dimension {} (nested sharding is not served)", pl.dim);
    }
    split[pl.dim] = true;
    // torch.chunk: pieces of ceil(n / parts) rows, the last ones shorter or empty.
    const uint64_t n = t.global_size[pl.dim], parts = mesh[i];
    const uint64_t each = parts == 0 ? 0 : n / parts + (n % parts != 0);
    const uint64_t start = checked_mul(coord[i], each).value_or(UINT64_MAX);
    p.offsets[pl.dim] = std::min(start, n);
    p.sizes[pl.dim] = std::min(n - p.offsets[pl.dim], each);
  }
  if (p.sizes != t.local.size) {
    return make_error(EINVAL,
                      "holds a local tensor of size {} where its placement (mesh coordinate {}) "
                      "gives {} of {}",
                      dims(t.local.size), dims(coord), dims(p.sizes), dims(t.global_size));
  }
  if (replica) return std::optional<Piece>();
  return std::optional<Piece>(std::move(p));
}

}  // namespace

bool is_verl_entry(const DirEntry& e) {
  if (e.name == format::kVerlConfigName) return true;
  auto n = format::parse_verl_rank_name(e.name);
  return n && n->kind == "model";
}

bool is_verl_dir(const std::vector<DirEntry>& entries) {
  bool config = false, model = false;
  for (const auto& e : entries) {
    if (e.name == format::kVerlConfigName) config = S_ISREG(e.st.st_mode);
    if (e.name != format::kVerlConfigName && is_verl_entry(e)) model = true;
  }
  return config && model && !has_shards(entries) && !is_distcp_dir(entries);
}

void read_verl_input(int dirfd, const std::vector<DirEntry>& entries, layout::BuildInput& in) {
  const std::string config_name(format::kVerlConfigName);
  auto problem = [&](std::string file, std::string tensor, std::string msg) {
    in.problems.push_back({std::move(file), std::move(tensor), std::move(msg)});
  };
  in.declared.emplace();
  in.declared->format = "verl FSDP (model_world_size_W_rank_R.pt, fsdp_config.json)";
  auto text = read_small_file_beneath(dirfd, config_name, 1 << 20);
  if (!text) return problem(config_name, "", text.error().message);
  auto cfg = format::parse_verl_config(*text, config_name);
  if (!cfg) return problem(config_name, "", cfg.error().message);
  if (cfg->fsdp_version && *cfg->fsdp_version != 2) {
    return problem(config_name, "",
                   fmt::format("FSDP_version {}: only FSDP2's DTensor shards are served (FSDP1 "
                               "saves ShardedTensors)",
                               *cfg->fsdp_version));
  }
  const uint32_t world = cfg->world_size;
  size_t other_state = 0;
  for (const auto& e : entries) {
    auto n = format::parse_verl_rank_name(e.name);
    if (!n) continue;
    if (n->kind != "model") {
      ++other_state;
    } else if (n->world != world) {
      problem(e.name, "",
              fmt::format("a rank file for world size {}, where {} says {}", n->world, config_name,
                          world));
    }
  }
  if (other_state > 0) {
    in.left_out.push_back(fmt::format(
        "{} optimizer and extra-state rank file(s) (optim_*, extra_state_*): training state, "
        "not served",
        other_state));
  }
  if (!in.problems.empty()) return;

  std::vector<Rank> ranks;
  ranks.reserve(world);
  for (uint32_t r = 0; r < world; ++r) {
    const std::string name = format::verl_rank_name("model", world, r);
    auto rank = read_rank(dirfd, name, in);
    if (!rank) {
      problem(name, "",
              rank.error().code == ENOENT
                  ? fmt::format("missing: {} says {} ranks", config_name, world)
                  : rank.error().message);
      continue;
    }
    ranks.push_back(std::move(rank).value());
  }
  if (!in.problems.empty()) return;

  // The mesh's size on each dimension: one past the highest coordinate any rank records.
  std::vector<uint64_t> mesh;
  for (uint32_t r = 0; r < world; ++r) {
    for (const auto& t : ranks[r].sd.tensors) {
      if (!t.dtensor) continue;
      if (t.coordinate.empty() && t.placements.size() != 1) {
        return problem(ranks[r].name, t.key,
                       "a DTensor on a multi-dimensional mesh records no mesh coordinate");
      }
      std::vector<uint64_t> c = t.coordinate.empty() ? std::vector<uint64_t>{r} : t.coordinate;
      if (mesh.size() < c.size()) mesh.resize(c.size(), 0);
      for (size_t i = 0; i < c.size(); ++i) {
        if (c[i] >= world) {
          return problem(ranks[r].name, t.key,
                         fmt::format("mesh coordinate {} past the world size {}", dims(c), world));
        }
        mesh[i] = std::max(mesh[i], c[i] + 1);
      }
    }
  }

  const auto& first = ranks[0].sd;
  if (!first.not_tensors.empty()) {
    in.left_out.push_back(fmt::format("{}: {} non-tensor item(s) not served (e.g. '{}')",
                                      ranks[0].name, first.not_tensors.size(),
                                      first.not_tensors.front()));
  }
  OutputPacker packer;
  for (const auto& t0 : first.tensors) {
    auto numel = checked_numel(t0.global_size);
    auto bytes = numel ? format::byte_size(t0.dtype, *numel) : std::nullopt;
    if (!bytes) {
      problem(ranks[0].name, t0.key, fmt::format("size {} overflows", dims(t0.global_size)));
      continue;
    }
    const uint32_t k = packer.place(*bytes);
    for (uint32_t r = 0; r < world; ++r) {
      const Rank& rank = ranks[r];
      auto it = rank.by_key.find(t0.key);
      if (it == rank.by_key.end()) {
        problem(rank.name, t0.key, fmt::format("missing here, present in {}", ranks[0].name));
        continue;
      }
      const RankTensor& t = rank.sd.tensors[it->second];
      if (t.dtensor != t0.dtensor || t.dtype != t0.dtype || t.global_size != t0.global_size ||
          !same_placements(t.placements, t0.placements)) {
        problem(rank.name, t0.key,
                fmt::format("{} {} here, {} {} in {} (dtype, size or placements differ)",
                            format::dtype_name(t.dtype), dims(t.global_size),
                            format::dtype_name(t0.dtype), dims(t0.global_size), ranks[0].name));
        continue;
      }
      auto piece = piece_of(t, r, mesh);
      if (!piece) {
        problem(rank.name, t0.key, piece.error().message);
        continue;
      }
      if (!*piece || checked_numel((*piece)->sizes).value_or(0) == 0) continue;
      const std::string what = fmt::format("{}: tensor '{}'", rank.name, t0.key);
      auto at = format::tensor_offset_in_archive(rank.archive, t.local, what);
      if (!at) {
        problem(rank.name, t0.key, at.error().message);
        continue;
      }
      layout::DeclaredChunk d;
      d.shard = rank.shard;
      d.tensor = t0.key;
      d.dtype = t0.dtype;
      d.file_offset = *at;
      d.offsets = std::move((*piece)->offsets);
      d.sizes = std::move((*piece)->sizes);
      d.full_shape = t0.global_size;
      d.k = k;
      in.declared->chunks.push_back(std::move(d));
    }
  }
  for (uint32_t r = 1; r < world; ++r) {
    for (const auto& t : ranks[r].sd.tensors) {
      if (!ranks[0].by_key.contains(t.key)) {
        problem(ranks[r].name, t.key, fmt::format("not in {}", ranks[0].name));
      }
    }
  }
  in.declared->outputs = packer.outputs();
  if (first.tensors.empty()) problem(ranks[0].name, "", "no tensors");
}

}  // namespace ckptfs::source
