// Internal to the format layer: the small languages inside a model map (format/map_lang.cpp).
#pragma once

#include <string_view>

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

}  // namespace ckptfs::format::detail
