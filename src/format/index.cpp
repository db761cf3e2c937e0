// format/index: model.safetensors.index.json, parsed and serialized.
#include "ckptfs/format/index.hpp"

#include <nlohmann/json.hpp>

#include "json_strict.hpp"

namespace ckptfs::format {

std::string serialize_index(const Index& index) {
  nlohmann::json j;  // std::map-backed: keys come out sorted
  j["metadata"] = {{"total_size", index.total_size}, {"total_parameters", index.total_parameters}};
  nlohmann::json wm = nlohmann::json::object();
  for (const auto& [k, v] : index.weight_map) wm[k] = v;
  j["weight_map"] = std::move(wm);
  return j.dump(2, ' ', false, nlohmann::json::error_handler_t::strict) + "\n";
}

Result<Index> parse_index(std::string_view text, std::string_view what) {
  CKPTFS_TRY(nlohmann::json j, detail::parse_json_strict(text, what, "index"));
  if (!j.is_object()) return make_error(EINVAL, "{}: index is not a JSON object", what);
  Index idx;
  auto md = j.find("metadata");
  if (md != j.end() && md->is_object()) {
    auto ts = md->find("total_size");
    if (ts != md->end() && ts->is_number_unsigned()) idx.total_size = ts->get<uint64_t>();
    auto tp = md->find("total_parameters");
    if (tp != md->end() && tp->is_number_unsigned()) idx.total_parameters = tp->get<uint64_t>();
  }
  auto wm = j.find("weight_map");
  if (wm == j.end() || !wm->is_object()) {
    return make_error(EINVAL, "{}: index has no 'weight_map' object", what);
  }
  for (auto it = wm->begin(); it != wm->end(); ++it) {
    if (!it.value().is_string()) {
      return make_error(EINVAL, "{}: weight_map entry for '{}' is not a string", what, it.key());
    }
    idx.weight_map.emplace_back(it.key(), it.value().get<std::string>());
  }
  return idx;
}

Result<FqnMapping> parse_fqn_mapping(std::string_view text, std::string_view what) {
  std::vector<std::string> order;
  CKPTFS_TRY(nlohmann::json j, detail::parse_json_strict(text, what, "mapping", &order));
  if (!j.is_object()) return make_error(EINVAL, "{}: mapping is not a JSON object", what);
  FqnMapping out;
  out.reserve(order.size());
  for (const auto& key : order) {
    const auto& v = j.at(key);
    if (!v.is_number_unsigned() || v.get<uint64_t>() < 1 || v.get<uint64_t>() > 99999) {
      return make_error(EINVAL, "{}: tensor '{}': file index is {}, not an integer in 1..99999",
                        what, key, detail::describe(v));
    }
    out.emplace_back(key, static_cast<uint32_t>(v.get<uint64_t>()));
  }
  return out;
}

Result<DtypeMapping> parse_dtype_mapping(std::string_view text, std::string_view what) {
  std::vector<std::string> order;
  CKPTFS_TRY(nlohmann::json j, detail::parse_json_strict(text, what, "dtype mapping", &order));
  if (!j.is_object()) return make_error(EINVAL, "{}: dtype mapping is not a JSON object", what);
  DtypeMapping out;
  out.reserve(order.size());
  for (const auto& key : order) {
    const auto& v = j.at(key);
    const auto* name = v.is_string() ? &v.get_ref<const std::string&>() : nullptr;
    auto d = name ? parse_dtype(*name) : std::nullopt;
    if (!d) {
      return make_error(EINVAL, "{}: tensor {}: dtype is {}, not a safetensors dtype name", what,
                        detail::describe(nlohmann::json(key)), detail::describe(v));
    }
    out.emplace_back(key, *d);
  }
  return out;
}

std::string serialize_fqn_mapping(const FqnMapping& mapping) {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  for (const auto& [k, v] : mapping) j[k] = v;
  return j.dump(2) + "\n";
}

Result<std::map<std::string, std::string>> parse_tp_plan(std::string_view text,
                                                         std::string_view what) {
  CKPTFS_TRY(nlohmann::json j, detail::parse_json_strict(text, what, "config"));
  std::map<std::string, std::string> out;
  if (!j.is_object()) return make_error(EINVAL, "{}: config is not a JSON object", what);
  auto it = j.find("base_model_tp_plan");
  if (it == j.end() || it->is_null()) return out;
  if (!it->is_object()) {
    return make_error(EINVAL, "{}: base_model_tp_plan is not an object", what);
  }
  for (auto e = it->begin(); e != it->end(); ++e) {
    if (!e.value().is_string()) {
      return make_error(EINVAL, "{}: base_model_tp_plan entry '{}' is not a string", what, e.key());
    }
    out.emplace(e.key(), e.value().get<std::string>());
  }
  return out;
}

}  // namespace ckptfs::format
