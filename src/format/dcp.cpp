// format/dcp: DCP_SHARDING_INFO, parsed strictly and serialized.
#include "ckptfs/format/dcp.hpp"

#include <nlohmann/json.hpp>

#include "json_strict.hpp"

namespace ckptfs::format {
namespace {

Result<std::vector<uint64_t>> dims(const nlohmann::json& j, std::string_view what,
                                   std::string_view fqn, std::string_view key) {
  if (!j.is_array()) {
    return make_error(EINVAL, "{}tensor \'{}\': DCP_SHARDING_INFO '{}' is not an array",
                      detail::prefix(what), fqn, key);
  }
  std::vector<uint64_t> out;
  out.reserve(j.size());
  for (const auto& v : j) {
    if (!v.is_number_unsigned()) {
      return make_error(EINVAL,
                        "{}tensor '{}': DCP_SHARDING_INFO '{}' holds {} where a non-negative "
                        "integer is required",
                        detail::prefix(what), fqn, key, detail::describe(v));
    }
    out.push_back(v.get<uint64_t>());
  }
  return out;
}

}  // namespace

Result<ShardingInfo> parse_sharding_info(std::string_view text, std::string_view what) {
  using detail::prefix;
  CKPTFS_TRY(nlohmann::json root, detail::parse_json_strict(text, what, "DCP_SHARDING_INFO"));
  if (!root.is_object()) {
    return make_error(EINVAL, "{}DCP_SHARDING_INFO is not a JSON object", prefix(what));
  }
  ShardingInfo info;
  for (auto it = root.begin(); it != root.end(); ++it) {
    const auto& v = it.value();
    if (!v.is_object()) {
      return make_error(EINVAL, "{}tensor \'{}\': DCP_SHARDING_INFO entry is not an object",
                        detail::prefix(what), it.key());
    }
    ShardingEntry e;
    auto off = v.find("saved_offsets");
    if (off == v.end()) {
      return make_error(EINVAL, "{}tensor \'{}\': DCP_SHARDING_INFO has no 'saved_offsets'",
                        detail::prefix(what), it.key());
    }
    CKPTFS_TRY(e.saved_offsets, dims(*off, what, it.key(), "saved_offsets"));
    auto shape = v.find("shape");
    if (shape != v.end()) {
      CKPTFS_TRY(std::vector<uint64_t> s, dims(*shape, what, it.key(), "shape"));
      e.full_shape = std::move(s);
    }
    info.emplace(it.key(), std::move(e));
  }
  return info;
}

std::string serialize_sharding_info(const ShardingInfo& info) {
  nlohmann::json root = nlohmann::json::object();
  for (const auto& [fqn, e] : info) {
    nlohmann::json v = {{"saved_offsets", e.saved_offsets}};
    if (e.full_shape) v["shape"] = *e.full_shape;
    root[fqn] = std::move(v);
  }
  return root.dump();
}

}  // namespace ckptfs::format
