// Checkpoint file names.
//   rank shard:    shard-{r}-model-{k}-of-{m}.safetensors   (r = rank + 1)
//   consolidated:  model-{k}-of-{m}.safetensors, or model.safetensors
//   index:         model.safetensors.index.json
// Numbers are zero-padded to 5 digits when written; any digit count is accepted when read.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "ckptfs/util/result.hpp"

namespace ckptfs::format {

inline constexpr std::string_view kIndexFileName = "model.safetensors.index.json";
// NeMo AutoModel writes this script beside its shards to make the consolidated checkpoint the
// view already is; NeMo's own consolidated output leaves it out, and so do the view and
// `ckptfs consolidate`.
inline constexpr std::string_view kNemoConsolidateScript = "consolidate.sh";
inline constexpr std::string_view kSingleFileName = "model.safetensors";
inline constexpr std::string_view kHfMetadataDir = ".hf_metadata";
// verl's FSDP checkpoints keep config.json and the tokenizer in this folder.
inline constexpr std::string_view kVerlHfDir = "huggingface";
// Folders of a checkpoint directory whose files the consolidated form shows beside the model
// files (config.json, the tokenizer), in this order, where the directory has no such name.
inline constexpr std::string_view kLiftedDirs[] = {kHfMetadataDir, kVerlHfDir};
inline constexpr std::string_view kFqnMappingFileName = "fqn_to_file_index_mapping.json";
// NeMo AutoModel 0.7: the dtype each tensor had in the base model's HF checkpoint.
inline constexpr std::string_view kFqnDtypeMappingFileName = "fqn_to_dtype_mapping.json";
inline constexpr std::string_view kSafetensorsSuffix = ".safetensors";
// A LoRA checkpoint's adapter (layout/lora.hpp): a folder of the checkpoint directory holding
// what PEFT's save_pretrained writes, so PeftModel.from_pretrained(base, DIR/lora_adapter) loads
// it (the name verl's model merger gives the same folder).
inline constexpr std::string_view kLoraAdapterDir = "lora_adapter";
inline constexpr std::string_view kAdapterModelName = "adapter_model.safetensors";
inline constexpr std::string_view kAdapterConfigName = "adapter_config.json";
// A LoRA checkpoint served merged (-o lora=merged): the folder of the output holding the LoRA
// factors the merged weights are computed from. Never shown, listed or looked up: only `inspect`
// names it.
inline constexpr std::string_view kLoraFactorsFolder = "(lora factors)";

struct ShardName {
  uint32_t shard = 0;  // rank + 1
  uint32_t k = 0;      // output file index, 1-based
  uint32_t m = 0;      // number of output files
};

struct ModelName {
  uint32_t k = 1;
  uint32_t m = 1;
  bool single = false;  // model.safetensors
};

std::optional<ShardName> parse_shard_name(std::string_view name);
std::optional<ModelName> parse_model_name(std::string_view name);
// The one model-name predicate: model.safetensors or model-K-of-M.safetensors.
inline bool is_model_name(std::string_view name) { return parse_model_name(name).has_value(); }
// A name the consolidated output uses: model-K-of-M / model.safetensors, or the index.
inline bool is_model_output_name(std::string_view name) {
  return name == kIndexFileName || is_model_name(name);
}
bool is_safetensors_name(std::string_view name);
// "shard-*.safetensors": treated as part of the checkpoint (and refused when it is not a
// well-formed, regular rank shard) rather than silently ignored.
bool looks_like_shard_name(std::string_view name);

// verl's FSDP rank files: `<kind>_world_size_<W>_rank_<R>.pt`, kind "model", "optim" or
// "extra_state"; W from 1 to kMaxVerlWorld, R below W, both written without leading zeros.
inline constexpr uint32_t kMaxVerlWorld = 1u << 20;
struct VerlRankName {
  std::string kind;
  uint32_t world = 0;
  uint32_t rank = 0;
};
std::optional<VerlRankName> parse_verl_rank_name(std::string_view name);
std::string verl_rank_name(std::string_view kind, uint32_t world, uint32_t rank);

// The one check of a tensor name where it enters from an untrusted file (a DCP key, a verl
// state-dict key, a model map's HF name): not empty, well-formed UTF-8 (it is written into a
// JSON header), and not `__metadata__` (the safetensors header's own field). `what` names the
// file in the message.
inline constexpr std::string_view kReservedTensorName = "__metadata__";
Status check_tensor_name(std::string_view name, std::string_view what);

std::string model_file_name(uint32_t k, uint32_t m);
std::string shard_file_name(uint32_t shard, uint32_t k, uint32_t m);

}  // namespace ckptfs::format
