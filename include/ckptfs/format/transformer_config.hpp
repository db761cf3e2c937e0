// format/transformer_config: the model config Megatron-Bridge keeps in YAML beside a torch_dist
// checkpoint (`iter_N/run_config.yaml`), as a native config in Megatron-LM's args names.
//
// Megatron-Bridge's save_checkpoint writes its ConfigContainer with to_yaml (yaml.safe_dump)
// into each iteration's directory; its `model:` section is the model provider, a megatron-core
// TransformerConfig (GPTModelProvider, MLA providers) with every field: `num_layers: 2`,
// `params_dtype: {_call_: false, _target_: torch.bfloat16}`, `activation_func: {_target_:
// torch.nn.functional.silu}`. Its common.pt holds no Megatron-LM `args`. The file is untrusted:
// read by format/yaml (capped, no tags), then reduced to what a model map's hf_config template
// reads (format/megatron_args' kinds and caps): scalar fields, non-empty lists of ints and bools,
// a `_target_` that is not called (`_call_: false`) as its name (`torch.bfloat16` -> "bfloat16",
// torch.nn.functional.silu as that name); called targets (enums) and other objects are left out.
//
// TransformerConfig names most fields as Megatron-LM's args do (it is what parse_args fills);
// the few it names otherwise are added under the args' names, so one template reads both (a name
// the config already holds is never replaced):
//   swiglu                              = gated_linear_unit and activation_func is silu
//                                         (TransformerConfig's defaults: False, gelu)
//   untie_embeddings_and_output_weights = not share_embeddings_and_output_weights
//   num_experts                         = num_moe_experts
//   group_query_attention               = num_query_groups is set
//   max_position_embeddings             = seq_length
// `vocab_size` is the tokenizer's (unpadded: the provider pads when it builds the embedding), so
// the templates' `padded_vocab_size | vocab_size` gives the unpadded size and the maps drop the
// padding rows, as Megatron-Bridge's own HF export does.
#pragma once

#include <cstdint>
#include <string_view>

#include <nlohmann/json.hpp>

#include "ckptfs/util/result.hpp"

namespace ckptfs::format {

inline constexpr std::string_view kBridgeRunConfigName = "run_config.yaml";
inline constexpr uint64_t kMaxRunConfigBytes = 4ull << 20;

// run_config.yaml's `model` (its text) as a native config. A document with no `model` mapping
// fails with ENOENT; one that cannot be read fails with EINVAL or EFBIG, naming `what`.
Result<nlohmann::json> read_bridge_run_config(std::string_view text, std::string_view what);

// A TransformerConfig's fields (a JSON object, as YAML gives them) as a native config.
Result<nlohmann::json> native_from_transformer_config(const nlohmann::json& fields,
                                                      std::string_view what);

}  // namespace ckptfs::format
