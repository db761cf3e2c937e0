// DCP sharding metadata: __metadata__["DCP_SHARDING_INFO"] of a rank shard.
//
//   {"<fqn>": {"saved_offsets": [o0, o1, ...], "shape": [optional full shape]}, ...}
//
// saved_offsets is where this file's chunk starts in the full tensor. Newer writers may add
// keys; we use "shape" when present and ignore keys we don't know.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ckptfs/util/result.hpp"

namespace ckptfs::format {

inline constexpr std::string_view kShardingInfoKey = "DCP_SHARDING_INFO";
inline constexpr std::string_view kDcpVersionKey = "DCP_VERSION";

struct ShardingEntry {
  std::vector<uint64_t> saved_offsets;
  std::optional<std::vector<uint64_t>> full_shape;
};

using ShardingInfo = std::map<std::string, ShardingEntry>;

Result<ShardingInfo> parse_sharding_info(std::string_view json, std::string_view what);
std::string serialize_sharding_info(const ShardingInfo& info);

}  // namespace ckptfs::format
