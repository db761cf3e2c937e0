// format/model_map: the model map format (docs/maps.md): strict, capped parsing of a map's JSON
// into rules, and the small languages inside it (expressions, name patterns, row rearrangements).
//
// Parsing checks everything that needs no checkpoint: keys, types, syntax, caps, each `rows`
// name used once, and refuses by name every request for arithmetic on the bytes. What needs a
// checkpoint and its config.json (sizes, shapes, coverage) is layout/model_map's.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "ckptfs/util/result.hpp"

namespace ckptfs::format {

inline constexpr size_t kMaxMapBytes = 1 << 20;
inline constexpr size_t kMaxMapRules = 4096;
inline constexpr size_t kMaxExprChars = 256;
inline constexpr size_t kMaxExprNames = 64;
inline constexpr size_t kMaxRowsNames = 16;
inline constexpr size_t kMaxPatternChars = 512;
inline constexpr size_t kMaxConcatParts = 64;
inline constexpr size_t kMaxConfigBytes = 1 << 20;

// Integer expression: `+ - * /`, parentheses, decimal literals and names; `|` separates
// alternatives (the first whose names all resolve is used). Kept as postfix programs.
struct MapExpr {
  struct Op {
    enum Kind : uint8_t { Num, Name, Add, Sub, Mul, Div } kind = Num;
    uint64_t num = 0;   // Num
    uint32_t name = 0;  // Name: index into names
  };
  std::vector<std::vector<Op>> alts;
  std::vector<std::string> names;
  std::string text;
};

// What a name is worth: nullopt when unknown (the alternative is then skipped).
using MapLookup = std::function<std::optional<uint64_t>(std::string_view)>;

// Parses an expression (docs/maps.md): capped, nesting at most 32.
Result<MapExpr> parse_map_expr(std::string_view text);

// Evaluates an expression: overflow, a negative result, division by zero or an inexact
// division are errors naming the expression.
Result<uint64_t> eval_expr(const MapExpr& e, const MapLookup& lookup);

// A name pattern: literal text with `{NAME}` captures (a decimal index: 0 or no leading zero)
// and, in `drop` and `detect` only, `*` (any run of characters).
struct MapPattern {
  struct Piece {
    enum Kind : uint8_t { Lit, Cap, Star } kind = Lit;
    std::string text;  // Lit: the literal; Cap: the capture's name
  };
  std::vector<Piece> pieces;
  std::string text;
  [[nodiscard]] std::vector<std::string> captures() const;
};

// Matches `name` against `p`; captured values (in order of captures) on success. Linear in
// name x pattern, never backtracks exponentially.
std::optional<std::vector<uint64_t>> match_pattern(const MapPattern& p, std::string_view name);
// Substitutes captures (`values` by capture name) into a pattern without stars.
std::string expand_pattern(const MapPattern& p,
                           const std::vector<std::pair<std::string, uint64_t>>& values);

// `LHS -> RHS` over the leading axes (every axis but the last), or over the one axis of a 1-D
// tensor when the LHS names it (its elements are then its rows: a bias split like its weight).
struct MapRows {
  struct Out {
    uint32_t axis = 0;              // index into names
    std::optional<MapExpr> lo, hi;  // a slice [lo:hi] of the axis
  };
  std::vector<std::string> names;          // every axis name of the LHS, in LHS order
  std::vector<std::vector<uint32_t>> lhs;  // per input leading axis, its names
  std::vector<std::vector<Out>> rhs;       // per output leading axis
  std::string text;
};

struct MapIndex {
  std::string capture;           // a capture name, or
  std::optional<MapExpr> value;  // an expression
};

struct MapPart {
  MapPattern from;
  std::vector<MapIndex> index;
  std::optional<MapRows> rows;
  std::vector<std::pair<std::string, MapExpr>> let;
};

struct MapRule {
  uint32_t number = 0;  // 1-based position in `tensors`, for messages
  MapPattern hf;
  std::vector<MapPart> parts;  // one for `from`, several for `concat`
  bool concat = false;
  std::vector<std::pair<std::string, MapExpr>> let;
  std::vector<std::pair<std::string, MapExpr>> for_;  // capture -> count
  // `offset`: capture -> a size added to its value where `hf` writes it (torchtitan's
  // mtp_layers.{M} are HF's model.layers.{num_hidden_layers + M}).
  std::vector<std::pair<std::string, MapExpr>> offset;
  std::optional<std::vector<MapExpr>> shape;
  // `split_last`: the HF tensor's last axis written as these axes, row-major (their product is
  // the stored last axis): the same bytes in the same order, only the shape differs.
  std::optional<std::vector<MapExpr>> split_last;
  // `transpose: [-2, -1]`: the HF tensor is the stored one (after `index`) with its last two
  // axes swapped; read element by element with a stride (layout::MapRun, layout::Segment).
  bool transpose = false;
  std::string when;  // a config key, "" when absent
  bool when_not = false;
  bool optional = false;
  bool may_be_absent = false;  // `"optional": "absent"`: the HF tensor may have no source at all
  std::string text;            // one line describing the rule, for inspect
};

struct MapDetect {
  std::vector<MapPattern> all, any, none;
  std::string format;  // contained in the checkpoint's format string
  [[nodiscard]] bool empty() const {
    return all.empty() && any.empty() && none.empty() && format.empty();
  }
};

// `refuse`: stored tensors the map knows it cannot serve (they would need arithmetic on the
// bytes, or a target no map can make), and why, in the map's own words.
struct MapRefusal {
  MapPattern from;
  std::string why;
};

struct ModelMap {
  std::string name;
  std::string about;
  std::string origin;  // "built-in" or the file it was read from
  MapDetect detect;
  std::vector<std::string> prefixes;
  std::vector<std::pair<std::string, MapExpr>> axes;
  std::vector<MapRule> rules;
  std::vector<MapPattern> drop;
  // `hf_config`: the config.json template (docs/maps.md), checked; null when the map has none.
  nlohmann::json hf_config;
  // `hf_config_requires`: native field -> the scalar it must hold for the template to apply
  // (a field the native config lacks passes); null when none.
  nlohmann::json hf_config_requires;
  std::vector<MapRefusal> refuse;
};

// Parses a map. `what` names it in errors (a path, or "built-in map 'x'").
Result<ModelMap> parse_model_map(std::string_view text, std::string_view what);

// A config.json: a JSON object (strict, capped at kMaxConfigBytes).
Result<nlohmann::json> parse_map_config(std::string_view text, std::string_view what);

// The built-in maps (maps/*.json compiled in), in detection order. Parsed once.
const std::vector<std::shared_ptr<const ModelMap>>& builtin_maps();
std::shared_ptr<const ModelMap> find_builtin_map(std::string_view name);

}  // namespace ckptfs::format
