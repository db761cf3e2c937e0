// Internal to the format layer: strict JSON parsing shared by the parsers.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "ckptfs/format/json_depth.hpp"
#include "ckptfs/util/result.hpp"

namespace ckptfs::format::detail {

using format::kMaxJsonDepth;  // the one depth guard: ckptfs/format/json_depth.hpp

// "what: " or "" when `what` is empty (callers that attach the file name themselves).
inline std::string prefix(std::string_view what) {
  return what.empty() ? std::string() : std::string(what) + ": ";
}

// Parses JSON, refusing nesting deeper than kMaxJsonDepth and duplicate keys in any object
// (nlohmann keeps the last one silently; the reference loader refuses them). `kind` names
// the document in errors. When `top_keys` is given it receives the top-level object's keys
// in document order (the parsed object is std::map-backed: ordered_json would make large
// objects quadratic). Linear in the size of the text.
Result<nlohmann::json> parse_json_strict(std::string_view text, std::string_view what,
                                         std::string_view kind,
                                         std::vector<std::string>* top_keys = nullptr);

// A short description of a parsed value for error messages: "an object with 3 keys", "an
// array of 2 elements", a number as nlohmann prints it, or a string quoted, truncated to
// about 40 characters, with control characters and invalid UTF-8 escaped. Never recursive
// and never longer than ~200 bytes, whatever the value holds: parsed values come from
// untrusted files, so they must never be serialized whole into a message.
std::string describe(const nlohmann::json& v);

}  // namespace ckptfs::format::detail
