// format/megatron_args: the model config Megatron-LM keeps in a torch_dist checkpoint's common.pt.
//
// Megatron-LM's save_checkpoint saves `{"args": argparse.Namespace, "checkpoint_version",
// "iteration", "model", ...}` with megatron-core's dist_checkpointing.save, which writes what is
// not a ShardedTensor into `common.pt` (torch.save: a zip archive holding `<stem>/data.pkl`).
// Its `args` carry what an HF config.json needs (num_layers, hidden_size, num_query_groups,
// params_dtype...). The archive and its pickle are untrusted: the zip is read as a torch
// archive's is (stored members, in range, no overlaps, capped), the pickle through the restricted
// unpickler with the globals a real common.pt holds (argparse.Namespace, torch dtypes, the
// enums Megatron-LM keeps in its args, tensor records) and nothing else; nothing is called. The
// result is a JSON object of the Namespace's scalar fields: ints, finite floats, bools, None
// (null), UTF-8 strings (at most kMaxNativeFieldChars), torch dtypes (their name,
// "bfloat16") and non-empty lists or tuples of ints and bools (at most kMaxNativeListItems: a
// per-layer pattern such as moe_layer_freq, a JSON array); other values (other lists, enums,
// objects) are left out.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "ckptfs/util/result.hpp"

namespace ckptfs::format {

inline constexpr std::string_view kMegatronCommonName = "common.pt";
inline constexpr uint64_t kMaxMegatronCommonBytes = 64ull << 20;        // common.pt, read whole
inline constexpr uint64_t kMaxMegatronCommonPickleBytes = 16ull << 20;  // its data.pkl
inline constexpr size_t kMaxNativeConfigFields = 4096;
inline constexpr size_t kMaxNativeFieldChars = 4096;
inline constexpr size_t kMaxNativeListItems = 4096;

// `args` of a common.pt archive (its bytes), as a JSON object of its scalar fields. An archive
// with no `args` at the top of its dict (megatron-core's own saves, which keep none) fails with
// ENOENT; anything else that cannot be read fails with EINVAL, naming `what`.
Result<nlohmann::json> read_megatron_args(std::string_view archive, std::string_view what);

// The same from the archive's data.pkl alone.
Result<nlohmann::json> parse_megatron_args_pickle(std::string&& pickle, std::string_view what);

}  // namespace ckptfs::format
