// verl's FSDP rank files: their names, fsdp_config.json, lora_train_meta.json, and the DTensor
// state-dict pickle.
#include "ckptfs/format/verl.hpp"

#include <algorithm>
#include <climits>

#include <fmt/format.h>

#include "json_strict.hpp"

namespace ckptfs::format {
namespace {

using pickle::GlobalName;
using pickle::Kind;
using pickle::Ref;
using pickle::Walk;

constexpr std::string_view kPlacements = "torch.distributed.tensor.placement_types";
constexpr std::string_view kSpec = "torch.distributed.tensor._dtensor_spec";

const std::vector<GlobalName>& state_dict_globals() {
  static const std::vector<GlobalName> g = [] {
    auto base = torch_tensor_globals();
    std::vector<GlobalName> v(base.begin(), base.end());
    v.insert(v.end(), {
                          {"torch._tensor", "_rebuild_from_type_v2"},
                          {"torch._utils", "_rebuild_wrapper_subclass"},
                          {"torch.distributed.tensor", "DTensor"},
                          {kSpec, "DTensorSpec"},
                          {kSpec, "TensorMeta"},
                          {kSpec, "ShardOrderEntry"},
                          {"torch.distributed.device_mesh", "DeviceMesh"},
                          {"torch.distributed._mesh_layout", "_MeshLayout"},
                          {"torch.distributed._mesh_layout", "_FlatLayout"},
                          {kPlacements, "Shard"},
                          {kPlacements, "Replicate"},
                          {"torch", "device"},
                          {"torch.serialization", "_get_layout"},
                      });
    return v;
  }();
  return g;
}

// The (attribute, value) pairs of an object state as torch's _rebuild_from_type_v2 gets it:
// a dict, or a (dict or None, slots dict or None) pair. Both halves are read.
Result<std::vector<Ref>> state_pairs(const Walk& w, Ref state, std::string_view where) {
  const pickle::Value& s = w.at(state);
  std::vector<Ref> out;
  if (s.kind == Kind::Tuple && s.items.size() == 2) {
    for (Ref half : s.items) {
      if (w.at(half).kind == Kind::None) continue;
      CKPTFS_TRY(auto p, w.pairs(half, where));
      out.insert(out.end(), p.begin(), p.end());
    }
    return out;
  }
  CKPTFS_TRY(auto p, w.pairs(state, where));
  out.assign(p.begin(), p.end());
  return out;
}

Result<std::vector<Placement>> placements(const Walk& w, Ref r, size_t ndim,
                                          std::string_view where) {
  CKPTFS_TRY(auto items, w.sequence(r, where));
  std::vector<Placement> out;
  for (Ref item : items) {
    const pickle::Value& v = w.at(item);
    Placement pl;
    if (v.kind == Kind::Call && w.is_global(v.func, kPlacements, "Replicate")) {
      out.push_back(pl);
      continue;
    }
    CKPTFS_TRY(auto st, w.object_state(item, kPlacements, "Shard", where));
    auto dim_ref = w.field(st, "dim");
    if (!dim_ref) return make_error(EINVAL, "{}: a Shard placement with no 'dim'", where);
    CKPTFS_TRY(int64_t dim, w.integer(*dim_ref, std::string(where) + " Shard.dim"));
    if (dim < 0) dim += static_cast<int64_t>(ndim);
    if (dim < 0 || static_cast<uint64_t>(dim) >= ndim) {
      return make_error(EINVAL, "{}: Shard(dim={}) of a {}-dimensional tensor", where, dim, ndim);
    }
    pl.kind = Placement::Kind::Shard;
    pl.dim = static_cast<uint32_t>(dim);
    out.push_back(pl);
  }
  return out;
}

// One DTensor: _rebuild_from_type_v2(_rebuild_wrapper_subclass, DTensor, args, state).
Result<RankTensor> read_dtensor(const pickle::Pickle& p, const Walk& w, Ref value,
                                const std::string& where) {
  const pickle::Value& call = w.at(value);
  CKPTFS_TRY(auto args, w.sequence(call.args, where));
  if (args.size() != 4) {
    return make_error(EINVAL, "{}: _rebuild_from_type_v2 with {} arguments (4 expected)", where,
                      args.size());
  }
  if (!w.is_global(args[0], "torch._utils", "_rebuild_wrapper_subclass")) {
    return w.fail(where, "torch._utils._rebuild_wrapper_subclass", args[0]);
  }
  if (!w.is_global(args[1], "torch.distributed.tensor", "DTensor")) {
    return w.fail(where, "a torch.distributed.tensor.DTensor", args[1]);
  }
  CKPTFS_TRY(auto sub, w.sequence(args[2], where + " (its wrapper arguments)"));
  if (sub.size() < 4) {
    return make_error(EINVAL, "{}: _rebuild_wrapper_subclass with {} arguments", where, sub.size());
  }
  RankTensor t;
  t.dtensor = true;
  const pickle::Value& dt = w.at(sub[1]);
  auto d =
      dt.kind == Kind::Global && p.text(dt) == "torch" ? torch_dtype(p.name(dt)) : std::nullopt;
  if (!d) return w.fail(where + " dtype", "a torch dtype a safetensors file can hold", sub[1]);
  t.dtype = *d;
  CKPTFS_TRY(t.global_size, w.dims(sub[2], where + " (its global size)"));

  CKPTFS_TRY(auto state, state_pairs(w, args[3], where + " (its state)"));
  auto local = w.field(state, "_local_tensor");
  auto spec = w.field(state, "_spec");
  if (!local || !spec) {
    return make_error(EINVAL, "{}: a DTensor without '_local_tensor' and '_spec'", where);
  }
  CKPTFS_TRY(t.local, read_rebuild_tensor(p, *local, where + " (its local tensor)"));
  if (t.local.dtype != t.dtype) {
    return make_error(EINVAL, "{}: a {} DTensor whose local tensor is {}", where,
                      dtype_name(t.dtype), dtype_name(t.local.dtype));
  }
  if (t.local.size.size() != t.global_size.size()) {
    return make_error(EINVAL, "{}: a {}-dimensional DTensor with a {}-dimensional local tensor",
                      where, t.global_size.size(), t.local.size.size());
  }
  CKPTFS_TRY(auto sp, w.object_state(*spec, kSpec, "DTensorSpec", where + " (its spec)"));
  auto pl = w.field(sp, "placements");
  if (!pl) return make_error(EINVAL, "{}: a DTensorSpec without placements", where);
  CKPTFS_TRY(t.placements, placements(w, *pl, t.global_size.size(), where + " placements"));
  if (auto mesh = w.field(sp, "mesh")) {
    CKPTFS_TRY(auto ms, w.object_state(*mesh, "torch.distributed.device_mesh", "DeviceMesh",
                                       where + " (its device mesh)"));
    if (auto coord = w.field(ms, "_coordinate_on_dim"); coord && w.at(*coord).kind != Kind::None) {
      CKPTFS_TRY(t.coordinate, w.dims(*coord, where + " (its mesh coordinate)"));
      if (t.coordinate.size() != t.placements.size()) {
        return make_error(EINVAL, "{}: a mesh coordinate of {} dimensions for {} placements", where,
                          t.coordinate.size(), t.placements.size());
      }
    }
  }
  return t;
}

}  // namespace

bool is_verl_file_name(std::string_view name) {
  return name == kVerlConfigName || name == kLoraTrainMetaName ||
         parse_verl_rank_name(name).has_value();
}

Result<VerlConfig> parse_verl_config(std::string_view text, std::string_view what) {
  CKPTFS_TRY(auto j, detail::parse_json_strict(text, what, "verl FSDP config"));
  if (!j.is_object()) return make_error(EINVAL, "{}: not a JSON object", what);
  VerlConfig c;
  auto ws = j.find("world_size");
  if (ws == j.end() || !ws->is_number_unsigned() || ws->get<uint64_t>() == 0 ||
      ws->get<uint64_t>() > kMaxVerlWorld) {
    return make_error(EINVAL, "{}: 'world_size' must be an integer from 1 to {}", what,
                      kMaxVerlWorld);
  }
  c.world_size = static_cast<uint32_t>(ws->get<uint64_t>());
  if (auto v = j.find("FSDP_version"); v != j.end()) {
    if (!v->is_number_integer()) {
      return make_error(EINVAL, "{}: 'FSDP_version' is {}", what, detail::describe(*v));
    }
    c.fsdp_version = v->get<int64_t>();
  }
  return c;
}

Result<LoraTrainMeta> parse_lora_train_meta(std::string_view text, std::string_view what) {
  CKPTFS_TRY(auto j, detail::parse_json_strict(text, what, "verl LoRA metadata"));
  if (!j.is_object()) return make_error(EINVAL, "{}: not a JSON object", what);
  LoraTrainMeta m;
  auto r = j.find("r");
  if (r == j.end() || !r->is_number_unsigned() || r->get<uint64_t>() == 0 ||
      r->get<uint64_t>() > (uint64_t{1} << 20)) {
    return make_error(EINVAL, "{}: 'r' must be an integer from 1 to {}", what, uint64_t{1} << 20);
  }
  m.r = static_cast<uint32_t>(r->get<uint64_t>());
  auto a = j.find("lora_alpha");
  if (a == j.end() || !a->is_number_integer() || a->get<int64_t>() < 0 ||
      a->get<int64_t>() > INT32_MAX) {
    return make_error(EINVAL, "{}: 'lora_alpha' must be an integer from 0 to {}", what, INT32_MAX);
  }
  m.lora_alpha = a->get<int64_t>();
  if (auto t = j.find("task_type"); t != j.end() && !t->is_null()) {
    const bool ok = t->is_string() && !t->get_ref<const std::string&>().empty() &&
                    t->get_ref<const std::string&>().size() <= 64 &&
                    std::all_of(t->get_ref<const std::string&>().begin(),
                                t->get_ref<const std::string&>().end(), [](char c) {
                                  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') ||
                                         (c >= '0' && c <= '9') || c == '_';
                                });
    if (!ok) {
      return make_error(EINVAL, "{}: 'task_type' is {}, not a PEFT task type", what,
                        detail::describe(*t));
    }
    m.task_type = t->get<std::string>();
  }
  return m;
}

Result<RankStateDict> parse_rank_state_dict(std::string_view bytes, std::string_view what) {
  auto parsed = pickle::parse(bytes, state_dict_globals(), what);
  // FSDP1 without a device mesh: each value a ShardedTensor (GLOBAL 'c' module\n name\n, as
  // torch.save's protocol 2 writes it). Said so, rather than as the first global refused.
  if (!parsed && bytes.find("ctorch.distributed._shard.sharded_tensor.api\nShardedTensor\n") !=
                     std::string_view::npos) {
    return make_error(EINVAL,
                      "{}: FSDP1 without a device mesh saves ShardedTensors "
                      "(torch.distributed._shard), which are not served (reading one means "
                      "building objects from getattr() results, outside this reader's pickle "
                      "subset); verl passes a device mesh, and FSDP1 and FSDP2 then save DTensors, "
                      "which are",
                      what);
  }
  CKPTFS_TRY(pickle::Pickle p, std::move(parsed));
  const Walk w(p, what);
  CKPTFS_TRY(auto items, w.pairs(p.root(), "the state dict"));
  RankStateDict out;
  for (size_t k = 0; k + 1 < items.size(); k += 2) {
    CKPTFS_TRY(std::string_view key, w.text(items[k], "a state-dict key"));
    // Every key, served or not: it names a tensor of the view, or shows in inspect.
    CKPTFS_CHECK(check_tensor_name(key, what));
    const std::string where = fmt::format("{}: tensor '{}'", what, key);
    const Ref value = items[k + 1];
    const pickle::Value& v = w.at(value);
    if (v.kind == Kind::Call && w.is_global(v.func, "torch._tensor", "_rebuild_from_type_v2")) {
      CKPTFS_TRY(RankTensor t, read_dtensor(p, w, value, where));
      t.key = std::string(key);
      out.tensors.push_back(std::move(t));
    } else if (v.kind == Kind::Call &&
               (w.is_global(v.func, "torch._utils", "_rebuild_tensor_v2") ||
                w.is_global(v.func, "torch._utils", "_rebuild_tensor_v3"))) {
      RankTensor t;
      t.key = std::string(key);
      CKPTFS_TRY(t.local, read_rebuild_tensor(p, value, where));
      t.dtype = t.local.dtype;
      t.global_size = t.local.size;
      out.tensors.push_back(std::move(t));
    } else {
      out.not_tensors.emplace_back(key);
    }
  }
  return out;
}

}  // namespace ckptfs::format
