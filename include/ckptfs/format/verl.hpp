// verl's FSDP checkpoint: the rank file names, fsdp_config.json, and the state-dict pickle of
// DTensors inside each `model_world_size_W_rank_R.pt`, read into plain per-rank records.
//
// verl's FSDPCheckpointManager saves `torch.save(model.state_dict())` on every rank. Under
// FSDP2 each value is a DTensor, pickled as `_rebuild_from_type_v2(_rebuild_wrapper_subclass,
// DTensor, (DTensor, dtype, global size, stride, ...), {'_local_tensor': <the rank's tensor>,
// '_spec': DTensorSpec(mesh, placements, tensor_meta, ...)})`; a value that is not sharded is a
// plain tensor. Only the globals those need are allowed (FSDP1's ShardedTensor is not one of
// them, so it is refused by name); nothing is executed.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ckptfs/format/distcp.hpp"
#include "ckptfs/format/names.hpp"
#include "ckptfs/format/pickle.hpp"
#include "ckptfs/util/result.hpp"

namespace ckptfs::format {

inline constexpr std::string_view kVerlConfigName = "fsdp_config.json";
inline constexpr uint64_t kMaxVerlPickleBytes = 256ull << 20;  // one rank's data.pkl

// A verl checkpoint's own file: a rank file of any kind, or fsdp_config.json (never copied into
// its consolidated form).
bool is_verl_file_name(std::string_view name);

// fsdp_config.json: {"FSDP_version": 2, "world_size": W} (parsed strictly).
struct VerlConfig {
  uint32_t world_size = 0;
  std::optional<int64_t> fsdp_version;
};
Result<VerlConfig> parse_verl_config(std::string_view text, std::string_view what);

struct Placement {
  enum class Kind : uint8_t { Replicate, Shard };
  Kind kind = Kind::Replicate;
  uint32_t dim = 0;  // Shard: the tensor dimension split over this mesh dimension
};

// One value of a rank's state dict.
struct RankTensor {
  std::string key;
  bool dtensor = false;
  DType dtype = DType::U8;
  std::vector<uint64_t> global_size;  // the DTensor's; a plain tensor's own
  std::vector<Placement> placements;  // DTensor: one per mesh dimension
  std::vector<uint64_t> coordinate;   // DTensor: this rank's place in the mesh, if recorded
  TorchTensorRecord local;            // the rank's own tensor, in the archive's storages
};

struct RankStateDict {
  std::vector<RankTensor> tensors;       // in the state dict's order
  std::vector<std::string> not_tensors;  // keys whose values are not tensors (never served)
};

// Parses a rank's data.pkl. `what` names the file in messages. Every key must be a name a
// tensor may have (format::check_tensor_name: not empty, valid UTF-8, not `__metadata__`).
Result<RankStateDict> parse_rank_state_dict(std::string_view bytes, std::string_view what);

}  // namespace ckptfs::format
