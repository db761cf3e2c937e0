// layout/map_config: the values a model map reads from a config (dotted paths), and the config.json
// a map's hf_config template makes of a native config (docs/maps.md).
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

#include <nlohmann/json.hpp>

#include "ckptfs/format/model_map.hpp"
#include "ckptfs/util/result.hpp"

namespace ckptfs::layout {

// A config's field by key or dotted path ("text_config.hidden_size"), as it is; null when absent
// or JSON null. The one walk of a config by name: sizes, detection and templates use it.
const nlohmann::json* config_field(const nlohmann::json& config, std::string_view key);

// A config value by key or dotted path, as a size: unsigned integers, and booleans as 0 and 1;
// nullopt for anything else.
std::optional<uint64_t> config_value(const nlohmann::json& config, std::string_view key);

// The config.json a map's `hf_config` template makes of a native config (a JSON object:
// Megatron-LM's args), `native_what` naming it in messages. Fails naming the template key and the
// native fields when a computed value has no value and no `else`.
Result<nlohmann::json> render_hf_config(const format::ModelMap& map, const nlohmann::json& native,
                                        std::string_view native_what);

}  // namespace ckptfs::layout
