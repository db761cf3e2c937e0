// Internal to the format layer: the small languages inside a model map (format/map_lang.cpp) and
// the checks of its hf_config template (format/map_template.cpp).
#pragma once

#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "ckptfs/format/model_map.hpp"
#include "ckptfs/util/result.hpp"

namespace ckptfs::format::detail {

inline bool is_ident_start(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
}
inline bool is_ident_char(char c) { return is_ident_start(c) || (c >= '0' && c <= '9'); }

// `a + b * (c - 1) | d`: capped at kMaxExprChars and kMaxExprNames, nesting 32.
Result<MapExpr> parse_expr(std::string_view s);
// Literal text, `{NAME}` captures, and `*` where `allow_star`.
Result<MapPattern> parse_pattern(std::string_view s, bool allow_star);
// `LHS -> RHS` over the leading axes.
Result<MapRows> parse_rows(std::string_view s);

// --- format/map_template.cpp ---
// A name from the map as written, for a message: control bytes escaped, at most 80 bytes.
std::string as_written(std::string_view s);
// Whether `key` is a word that needs arithmetic on the bytes (a map may not use one).
bool is_arithmetic(std::string_view key);
// A config.json field path: identifiers joined by single dots, at most 128 bytes.
bool is_key_path(std::string_view s);
// The `hf_config` template (docs/maps.md), checked: an object of config.json keys whose values
// are literals or `$` forms, under kMaxTemplateNodes nodes.
Status check_hf_config(const nlohmann::json& j);

}  // namespace ckptfs::format::detail
