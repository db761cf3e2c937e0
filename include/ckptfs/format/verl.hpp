// verl's FSDP checkpoint: the rank file names, fsdp_config.json, lora_train_meta.json, and the
// state-dict pickle of DTensors inside each `model_world_size_W_rank_R.pt`, read into plain
// per-rank records.
//
// verl's FSDPCheckpointManager saves `torch.save(model.state_dict())` on every rank. Under FSDP2,
// and under FSDP1 with a device mesh (verl always passes one), each value is a DTensor, pickled
// as `_rebuild_from_type_v2(_rebuild_wrapper_subclass, DTensor, (DTensor, dtype, global size,
// stride, ...), {'_local_tensor': <the rank's tensor>, '_spec': DTensorSpec(mesh, placements,
// tensor_meta, ...)})`; a value that is not sharded is a plain tensor. Only the globals those need
// are allowed; nothing is executed. FSDP1 without a device mesh saves ShardedTensors, whose pickle
// builds an object from `getattr(ShardedTensor, 'ProcessGroupState')`: refused, by name.
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
// Written beside the rank files by verl when the model is a PEFT LoRA model (lora_rank > 0).
inline constexpr std::string_view kLoraTrainMetaName = "lora_train_meta.json";
inline constexpr uint64_t kMaxVerlPickleBytes = 256ull << 20;  // one rank's data.pkl

// A verl checkpoint's own file: a rank file of any kind, or fsdp_config.json (never copied into
// its consolidated form).
bool is_verl_file_name(std::string_view name);

// fsdp_config.json: {"FSDP_version": 1 or 2, "world_size": W} (parsed strictly).
struct VerlConfig {
  uint32_t world_size = 0;
  std::optional<int64_t> fsdp_version;
};
Result<VerlConfig> parse_verl_config(std::string_view text, std::string_view what);

// lora_train_meta.json: {"r": R, "lora_alpha": A, "task_type": "CAUSAL_LM"} (parsed strictly;
// verl's FSDPCheckpointManager._get_lora_train_meta writes int(r) > 0, int(lora_alpha) and the
// PEFT task type's value). r from 1 to 2^20, lora_alpha from 0 to 2^31 - 1, task_type (optional:
// null when absent) 1 to 64 letters, digits or underscores.
struct LoraTrainMeta {
  uint32_t r = 0;
  int64_t lora_alpha = 0;
  std::optional<std::string> task_type;
};
Result<LoraTrainMeta> parse_lora_train_meta(std::string_view text, std::string_view what);

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
