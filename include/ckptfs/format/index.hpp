// model.safetensors.index.json and NeMo's .hf_metadata/fqn_to_file_index_mapping.json and
// fqn_to_dtype_mapping.json.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ckptfs/format/dtype.hpp"
#include "ckptfs/util/result.hpp"

namespace ckptfs::format {

// Cap for small JSON side files (index, mapping, config).
inline constexpr uint64_t kMaxSideFileSize = 256ull << 20;

struct Index {
  uint64_t total_size = 0;
  uint64_t total_parameters = 0;
  std::vector<std::pair<std::string, std::string>> weight_map;  // tensor -> file
};

// transformers 5.x style: indent=2, keys sorted, trailing newline.
std::string serialize_index(const Index& index);
Result<Index> parse_index(std::string_view json, std::string_view what);

// Ordered {fqn: file_index} (1-based). Order is the file's order.
using FqnMapping = std::vector<std::pair<std::string, uint32_t>>;
Result<FqnMapping> parse_fqn_mapping(std::string_view json, std::string_view what);
std::string serialize_fqn_mapping(const FqnMapping& mapping);

// NeMo's .hf_metadata/fqn_to_dtype_mapping.json: {fqn: safetensors dtype name}, e.g.
// {"lm_head.weight": "BF16"}. Every value must be a dtype name of the safetensors table
// ("BF16", "F32", ...): anything else is an error naming the file and the tensor.
using DtypeMapping = std::vector<std::pair<std::string, DType>>;
Result<DtypeMapping> parse_dtype_mapping(std::string_view json, std::string_view what);

// The `base_model_tp_plan` of a transformers config.json ({pattern: style}); empty when the
// config has none. Entries whose style is not a string are refused.
Result<std::map<std::string, std::string>> parse_tp_plan(std::string_view config_json,
                                                         std::string_view what);

}  // namespace ckptfs::format
