// Internal to the format layer: strict JSON parsing shared by the parsers.
#pragma once

#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "ckptfs/util/result.hpp"

namespace ckptfs::format::detail {

// "what: " or "" when `what` is empty (callers that attach the file name themselves).
inline std::string prefix(std::string_view what) {
  return what.empty() ? std::string() : std::string(what) + ": ";
}

// Parses JSON, refusing duplicate keys in any object (nlohmann keeps the last one silently;
// the reference loader refuses them). `kind` names the document in errors.
Result<nlohmann::json> parse_json_strict(std::string_view text, std::string_view what,
                                         std::string_view kind);

// Dumps JSON, replacing invalid UTF-8 (which error messages may quote from bad input).
std::string dump_safe(const nlohmann::json& j, int indent = -1);

}  // namespace ckptfs::format::detail
