#include "json_strict.hpp"

#include <unordered_set>
#include <vector>

namespace ckptfs::format::detail {

Result<nlohmann::json> parse_json_strict(std::string_view text, std::string_view what,
                                         std::string_view kind,
                                         std::vector<std::string>* top_keys) {
  using nlohmann::json;
  std::vector<std::unordered_set<std::string>> keys;
  std::string dup;
  json::parser_callback_t cb = [&](int /*depth*/, json::parse_event_t ev, json& parsed) {
    switch (ev) {
      case json::parse_event_t::object_start:
        keys.emplace_back();
        break;
      case json::parse_event_t::object_end:
        if (!keys.empty()) keys.pop_back();
        break;
      case json::parse_event_t::key:
        if (!keys.empty() && !keys.back().insert(parsed.get<std::string>()).second && dup.empty()) {
          dup = parsed.get<std::string>();
        }
        if (top_keys && keys.size() == 1) top_keys->push_back(parsed.get<std::string>());
        break;
      default:
        break;
    }
    return true;
  };
  json j;
  try {
    j = json::parse(text.begin(), text.end(), cb, /*allow_exceptions=*/true);
  } catch (const json::exception& e) {
    return make_error(EINVAL, "{}{} is not valid JSON: {}", prefix(what), kind, e.what());
  }
  if (!dup.empty()) {
    return make_error(EINVAL, "{}{} has duplicate key '{}'", prefix(what), kind, dup);
  }
  return j;
}

std::string dump_safe(const nlohmann::json& j, int indent) {
  return j.dump(indent, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace ckptfs::format::detail
