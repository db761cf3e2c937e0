// Internal to the format layer: strict JSON parsing shared by the parsers.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "ckptfs/util/result.hpp"

namespace ckptfs::format::detail {

// "what: " or "" when `what` is empty (callers that attach the file name themselves).
inline std::string prefix(std::string_view what) {
  return what.empty() ? std::string() : std::string(what) + ": ";
}

// Parses JSON, refusing duplicate keys in any object (nlohmann keeps the last one silently;
// the reference loader refuses them). `kind` names the document in errors. When
// `top_keys` is given it receives the top-level object's keys in document order (the parsed
// object is std::map-backed: ordered_json would make large objects quadratic).
Result<nlohmann::json> parse_json_strict(std::string_view text, std::string_view what,
                                         std::string_view kind,
                                         std::vector<std::string>* top_keys = nullptr);

// Dumps JSON, replacing invalid UTF-8 (which error messages may quote from bad input).
std::string dump_safe(const nlohmann::json& j, int indent = -1);

}  // namespace ckptfs::format::detail
