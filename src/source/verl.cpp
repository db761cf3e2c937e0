// Reading a verl FSDP checkpoint directory (fsdp_config.json, model_world_size_W_rank_R.pt).
#include "ckptfs/source/verl.hpp"

#include <sys/stat.h>

#include <algorithm>
#include <map>
#include <span>
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

// Problems kept per checkpoint: enough to act on, and a checkpoint of thousands of ranks that
// all disagree cannot grow the daemon with messages.
constexpr size_t kMaxProblems = 32;

std::string dims(std::span<const uint64_t> v) { return fmt::format("[{}]", fmt::join(v, ", ")); }

bool same_placements(const std::vector<Placement>& a, const std::vector<Placement>& b) {
  return std::equal(a.begin(), a.end(), b.begin(), b.end(), [](const auto& x, const auto& y) {
    return x.kind == y.kind && x.dim == y.dim;
  });
}

// One rank's file, read: its archive's members and its state dict. Rank 0's is kept while the
// others are read (the reference they are checked against); every other rank's is dropped as
// soon as what its chunks need is taken from it.
struct RankFile {
  std::string name;
  struct stat st {};
  format::zip::TorchArchive archive;
  format::RankStateDict sd;
};

// Opens a rank file and refuses it at once when it is the same file as a rank read before it.
Result<RankFile> read_rank(int dirfd, const std::string& name,
                           std::map<std::pair<dev_t, ino_t>, std::string>& seen) {
  RankFile r;
  r.name = name;
  CKPTFS_TRY(UniqueFd fd, open_regular_at(dirfd, name, name, &r.st));
  if (auto [it, fresh] = seen.emplace(std::pair{r.st.st_dev, r.st.st_ino}, name); !fresh) {
    return make_error(EINVAL,
                      "{}: the same file as {} (device {}, inode {}: hard links; verl writes one "
                      "file per rank)",
                      name, it->second, r.st.st_dev, r.st.st_ino);
  }
  const auto size = static_cast<uint64_t>(r.st.st_size);
  auto read = [&](uint64_t off, std::span<char> out) -> Status {
    if (off > size || out.size() > size - off) {
      return make_error(EINVAL, "{}: a read past the end of the file", name);
    }
    return pread_exact(fd.get(), out.data(), out.size(), off, name);
  };
  CKPTFS_TRY(auto members, format::zip::members(size, read, name));
  CKPTFS_TRY(r.archive, format::zip::torch_archive(std::move(members), name));
  if (r.archive.pickle.size > format::kMaxVerlPickleBytes) {
    return make_error(EINVAL, "{}: data.pkl of {} bytes (at most {})", name, r.archive.pickle.size,
                      format::kMaxVerlPickleBytes);
  }
  std::string pkl(r.archive.pickle.size, '\0');
  CKPTFS_CHECK(read(r.archive.pickle.offset, std::span<char>(pkl.data(), pkl.size())));
  CKPTFS_TRY(r.sd, format::parse_rank_state_dict(pkl, name));
  return r;
}

// What the chunks of one of rank 0's tensors need of every rank, kept while the ranks are read
// one at a time: per rank holding it, one record of `width()` numbers: the rank, the offset of
// its bytes in its file (kNowhere where it holds none that are served), its mesh coordinate
// (one per placement) and its local size (one per dimension).
struct Held {
  static constexpr uint64_t kNowhere = UINT64_MAX;
  size_t mesh_dims = 0, ndim = 0;
  std::vector<uint64_t> v;
  [[nodiscard]] size_t width() const { return 2 + mesh_dims + ndim; }
  [[nodiscard]] size_t size() const { return v.size() / width(); }
  [[nodiscard]] std::span<const uint64_t> at(size_t i) const {
    return std::span<const uint64_t>(v).subspan(i * width(), width());
  }
};

// Where a rank's piece of `t0` lies in the full tensor: offsets and sizes, nullopt if the piece
// is a replica of another rank's (a Replicate mesh dimension at a coordinate past 0). `coord`
// and `local` are the rank's mesh coordinate and local size; `mesh` the mesh's size on each
// dimension.
struct Piece {
  std::vector<uint64_t> offsets, sizes;
};
Result<std::optional<Piece>> piece_of(const RankTensor& t0, std::span<const uint64_t> coord,
                                      std::span<const uint64_t> local,
                                      const std::vector<uint64_t>& mesh) {
  Piece p;
  p.offsets.assign(t0.global_size.size(), 0);
  p.sizes = t0.global_size;
  std::vector<bool> split(t0.global_size.size(), false);
  bool replica = false;
  for (size_t i = 0; i < t0.placements.size(); ++i) {
    const Placement& pl = t0.placements[i];
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
    const uint64_t n = t0.global_size[pl.dim], parts = mesh[i];
    const uint64_t each = parts == 0 ? 0 : n / parts + (n % parts != 0);
    const uint64_t start = checked_mul(coord[i], each).value_or(UINT64_MAX);
    p.offsets[pl.dim] = std::min(start, n);
    p.sizes[pl.dim] = std::min(n - p.offsets[pl.dim], each);
  }
  if (!std::equal(p.sizes.begin(), p.sizes.end(), local.begin(), local.end())) {
    return make_error(EINVAL,
                      "holds a local tensor of size {} where its placement (mesh coordinate {}) "
                      "gives {} of {}",
                      dims(local), dims(coord), dims(p.sizes), dims(t0.global_size));
  }
  if (replica) return std::optional<Piece>();
  return std::optional<Piece>(std::move(p));
}

// The ranks of one checkpoint, read one at a time against rank 0.
class Reader {
 public:
  Reader(int dirfd, uint32_t world, layout::BuildInput& in)
      : dirfd_(dirfd), world_(world), in_(in), shard0_(static_cast<uint32_t>(in.shards.size())) {}

  void problem(std::string file, std::string tensor, std::string msg) {
    if (in_.problems.size() >= kMaxProblems) {
      ++more_;
      return;
    }
    in_.problems.push_back({std::move(file), std::move(tensor), std::move(msg)});
  }
  [[nodiscard]] bool failed() const { return !in_.problems.empty(); }
  void finish() {
    if (more_ > 0) problem_more();
  }

  // Reads rank r's file, checks it against rank 0 and keeps what its chunks need; false when it
  // cannot be served (the problems say why).
  bool rank(uint32_t r) {
    const std::string name = format::verl_rank_name("model", world_, r);
    auto file = read_rank(dirfd_, name, seen_);
    if (!file) {
      problem(name, "",
              file.error().code == ENOENT
                  ? fmt::format("missing: {} says {} ranks", format::kVerlConfigName, world_)
                  : file.error().message);
      return false;
    }
    if (r == 0) {
      ref_ = std::move(file).value();
      for (size_t i = 0; i < ref_.sd.tensors.size(); ++i) {
        if (!by_key_.emplace(ref_.sd.tensors[i].key, i).second) {
          problem(name, ref_.sd.tensors[i].key, "twice in the state dict");
          return false;
        }
      }
      held_.resize(ref_.sd.tensors.size());
      for (size_t i = 0; i < held_.size(); ++i) {
        const auto& t0 = ref_.sd.tensors[i];
        held_[i].mesh_dims = t0.dtensor ? t0.placements.size() : 0;
        held_[i].ndim = t0.global_size.size();
      }
      take(0, ref_);
    } else {
      take(r, *file);
    }
    add_shard(name, r == 0 ? ref_.st : file->st);
    return !failed();
  }

  // The chunks, once every rank was read and agreed.
  void declare() {
    const auto& first = ref_.sd;
    if (!first.not_tensors.empty()) {
      in_.left_out.push_back(fmt::format("{}: {} non-tensor item(s) not served (e.g. '{}')",
                                         ref_.name, first.not_tensors.size(),
                                         first.not_tensors.front()));
    }
    OutputPacker packer;
    for (size_t i = 0; i < first.tensors.size(); ++i) {
      const RankTensor& t0 = first.tensors[i];
      auto numel = checked_numel(t0.global_size);
      auto bytes = numel ? format::byte_size(t0.dtype, *numel) : std::nullopt;
      if (!bytes) {
        problem(ref_.name, t0.key, fmt::format("size {} overflows", dims(t0.global_size)));
        continue;
      }
      const uint32_t k = packer.place(*bytes);
      const Held& h = held_[i];
      for (size_t j = 0; j < h.size(); ++j) {
        const auto rec = h.at(j);
        const auto r = static_cast<uint32_t>(rec[0]);
        const uint64_t at = rec[1];
        const auto coord = rec.subspan(2, h.mesh_dims);
        const auto local = rec.subspan(2 + h.mesh_dims, h.ndim);
        const std::string name = format::verl_rank_name("model", world_, r);
        std::optional<Piece> piece;
        if (t0.dtensor) {
          auto p = piece_of(t0, coord, local, mesh_);
          if (!p) {
            problem(name, t0.key, p.error().message);
            continue;
          }
          piece = std::move(*p);
        } else {
          piece = Piece{std::vector<uint64_t>(t0.global_size.size(), 0), t0.global_size};
        }
        if (!piece || checked_numel(piece->sizes).value_or(0) == 0) continue;
        if (at == Held::kNowhere) {  // a rank's local tensor found empty where it is not
          problem(name, t0.key, "holds no bytes for its piece");
          continue;
        }
        layout::DeclaredChunk d;
        d.shard = shard0_ + r;
        d.tensor = t0.key;
        d.dtype = t0.dtype;
        d.file_offset = at;
        d.offsets = std::move(piece->offsets);
        d.sizes = std::move(piece->sizes);
        d.full_shape = t0.global_size;
        d.k = k;
        in_.declared->chunks.push_back(std::move(d));
      }
    }
    in_.declared->outputs = packer.outputs();
    if (first.tensors.empty()) problem(ref_.name, "", "no tensors");
    if (!in_.lora) {
      auto peft = std::find_if(first.tensors.begin(), first.tensors.end(), [](const RankTensor& t) {
        return t.key.starts_with("base_model.model.") && t.key.find(".lora_") != std::string::npos;
      });
      if (peft != first.tensors.end()) {
        in_.notes.push_back(fmt::format(
            "'{}' is a PEFT LoRA name, but there is no {}: the tensors are served as stored, "
            "not as a base model and an adapter",
            peft->key, format::kLoraTrainMetaName));
      }
    }
  }

 private:
  void problem_more() {
    in_.problems.push_back(
        {"", "", fmt::format("and {} more problem(s) with the rank files", more_)});
    more_ = 0;
  }

  void add_shard(const std::string& name, const struct stat& st) {
    layout::ShardInput si;
    si.name = name;
    si.stamp = stamp_of(st);
    si.access = layout::Access{st.st_uid, st.st_gid, static_cast<uint32_t>(st.st_mode & 07777)};
    si.atime_ns = static_cast<int64_t>(st.st_atim.tv_sec) * 1'000'000'000 + st.st_atim.tv_nsec;
    in_.shards.push_back(std::move(si));
  }

  // Checks rank r's state dict against rank 0's (the same keys, each with the same dtype, global
  // size and placements) and keeps, per tensor, what its chunk needs (Held).
  void take(uint32_t r, const RankFile& f) {
    std::vector<bool> found(held_.size(), false);
    for (const RankTensor& t : f.sd.tensors) {
      auto it = by_key_.find(t.key);
      if (it == by_key_.end()) {
        problem(f.name, t.key, fmt::format("not in {}", ref_.name));
        continue;
      }
      const size_t i = it->second;
      if (found[i]) {
        problem(f.name, t.key, "twice in the state dict");
        continue;
      }
      found[i] = true;
      const RankTensor& t0 = ref_.sd.tensors[i];
      if (t.dtensor != t0.dtensor || t.dtype != t0.dtype || t.global_size != t0.global_size ||
          !same_placements(t.placements, t0.placements)) {
        problem(f.name, t0.key,
                fmt::format("{} {} here, {} {} in {} (dtype, size or placements differ)",
                            format::dtype_name(t.dtype), dims(t.global_size),
                            format::dtype_name(t0.dtype), dims(t0.global_size), ref_.name));
        continue;
      }
      if (!t.dtensor && r != 0) continue;  // a plain tensor is rank 0's
      std::vector<uint64_t> coord = t.coordinate;
      bool replica = false;
      if (t.dtensor) {
        if (coord.empty() && t.placements.size() != 1) {
          problem(f.name, t.key,
                  "a DTensor on a multi-dimensional mesh records no mesh coordinate");
          continue;
        }
        if (coord.empty()) coord.assign(1, r);  // a 1-D mesh without a recorded coordinate
        if (mesh_.size() < coord.size()) mesh_.resize(coord.size(), 0);
        bool past = false;
        for (size_t d = 0; d < coord.size(); ++d) {
          past = past || coord[d] >= world_;
          if (!past) mesh_[d] = std::max(mesh_[d], coord[d] + 1);
          replica =
              replica || (t.placements[d].kind == Placement::Kind::Replicate && coord[d] != 0);
        }
        if (past) {
          problem(f.name, t.key,
                  fmt::format("mesh coordinate {} past the world size {}", dims(coord), world_));
          continue;
        }
      }
      uint64_t at = Held::kNowhere;
      if (!replica && checked_numel(t.local.size).value_or(0) != 0) {
        auto off = format::tensor_offset_in_archive(f.archive, t.local,
                                                    fmt::format("{}: tensor '{}'", f.name, t.key));
        if (!off) {
          problem(f.name, t.key, off.error().message);
          continue;
        }
        at = *off;
      }
      Held& h = held_[i];
      h.v.push_back(r);
      h.v.push_back(at);
      h.v.insert(h.v.end(), coord.begin(), coord.end());
      h.v.insert(h.v.end(), t.local.size.begin(), t.local.size.end());
    }
    for (size_t i = 0; i < held_.size(); ++i) {
      if (!found[i]) {
        problem(f.name, ref_.sd.tensors[i].key,
                fmt::format("missing here, present in {}", ref_.name));
      }
    }
  }

  int dirfd_;
  uint32_t world_;
  layout::BuildInput& in_;
  uint32_t shard0_;                                      // rank r's file is in_.shards[shard0_ + r]
  size_t more_ = 0;                                      // problems beyond kMaxProblems
  RankFile ref_;                                         // rank 0's file, the reference
  std::unordered_map<std::string_view, size_t> by_key_;  // into ref_.sd.tensors
  std::vector<Held> held_;                               // per tensor of ref_.sd
  std::vector<uint64_t> mesh_;  // per mesh dimension: one past the highest coordinate so far
  std::map<std::pair<dev_t, ino_t>, std::string> seen_;  // the rank files read, by identity
};

}  // namespace

namespace {
bool is_model_rank(const DirEntry& e) {
  auto n = format::parse_verl_rank_name(e.name);
  return n && n->kind == "model";
}
}  // namespace

bool is_verl_entry(const DirEntry& e) {
  return e.name == format::kVerlConfigName || e.name == format::kLoraTrainMetaName ||
         is_model_rank(e);
}

bool is_verl_dir(const std::vector<DirEntry>& entries) {
  bool config = false, model = false;
  for (const auto& e : entries) {
    if (e.name == format::kVerlConfigName) config = S_ISREG(e.st.st_mode);
    if (is_model_rank(e)) model = true;
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
  // verl writes 1 (its default strategy, fsdp) or 2 (fsdp2); both save DTensors, since verl
  // always gives FSDP1 a device mesh. Each rank file says what it holds either way.
  if (cfg->fsdp_version && *cfg->fsdp_version != 1 && *cfg->fsdp_version != 2) {
    return problem(
        config_name, "",
        fmt::format("FSDP_version {}: verl writes 1 (FSDP) or 2 (FSDP2)", *cfg->fsdp_version));
  }
  // A PEFT LoRA model: lora_train_meta.json beside the rank files (layout/lora.hpp).
  const std::string meta_name(format::kLoraTrainMetaName);
  if (std::any_of(entries.begin(), entries.end(),
                  [&](const DirEntry& e) { return e.name == meta_name; })) {
    auto meta = read_small_file_beneath(dirfd, meta_name, 1 << 20);
    if (!meta) return problem(meta_name, "", meta.error().message);
    auto m = format::parse_lora_train_meta(*meta, meta_name);
    if (!m) return problem(meta_name, "", m.error().message);
    in.lora = layout::LoraInput{meta_name, m->r, m->lora_alpha, m->task_type};
  }
  const uint32_t world = cfg->world_size;
  Reader rd(dirfd, world, in);
  size_t other_state = 0;
  std::vector<bool> listed(world, false);
  // The rank files by identity: two ranks that are one file (hard links) are refused before any
  // file is read. verl writes one file per rank; a world of links to one file would otherwise
  // be read and parsed once per rank.
  std::map<std::pair<dev_t, ino_t>, uint32_t> ids;
  for (const auto& e : entries) {
    auto n = format::parse_verl_rank_name(e.name);
    if (!n) continue;
    if (n->kind != "model") {
      ++other_state;
    } else if (n->world != world) {
      rd.problem(e.name, "",
                 fmt::format("a rank file for world size {}, where {} says {}", n->world,
                             config_name, world));
    } else {
      listed[n->rank] = true;
      if (!S_ISREG(e.st.st_mode)) continue;  // refused when it is opened
      auto [it, fresh] = ids.emplace(std::pair{e.st.st_dev, e.st.st_ino}, n->rank);
      if (fresh) continue;
      const uint32_t lo = std::min(it->second, n->rank), hi = std::max(it->second, n->rank);
      it->second = lo;
      rd.problem(format::verl_rank_name("model", world, hi), "",
                 fmt::format("the same file as {} (device {}, inode {}: hard links); verl writes "
                             "one file per rank",
                             format::verl_rank_name("model", world, lo), e.st.st_dev, e.st.st_ino));
    }
  }
  if (other_state > 0) {
    in.left_out.push_back(fmt::format(
        "{} optimizer and extra-state rank file(s) (optim_*, extra_state_*): training state, "
        "not served",
        other_state));
  }
  for (uint32_t r = 0; r < world; ++r) {
    if (!listed[r]) {
      rd.problem(format::verl_rank_name("model", world, r), "",
                 fmt::format("missing: {} says {} ranks", config_name, world));
    }
  }
  // Rank by rank: rank 0 whole, then each other rank checked against it and dropped.
  for (uint32_t r = 0; r < world && !rd.failed(); ++r) {
    if (!rd.rank(r)) break;
  }
  if (!rd.failed()) rd.declare();
  rd.finish();
}

}  // namespace ckptfs::source
