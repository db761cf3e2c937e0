// format/transformer_config: a TransformerConfig kept in YAML (run_config.yaml) as a native config.
#include "ckptfs/format/transformer_config.hpp"

#include <cmath>
#include <optional>
#include <string>

#include <fmt/format.h>

#include "ckptfs/format/megatron_args.hpp"
#include "ckptfs/format/yaml.hpp"

namespace ckptfs::format {
namespace {

using nlohmann::json;

constexpr size_t kMaxTargetChars = 256;

// `{_call_: false, _target_: NAME}`: a reference to NAME, not a call: its name, and a torch
// dtype (`torch.bfloat16`) as the dtype's (as common.pt's args give it). Anything else: none.
std::optional<std::string> uncalled_target(const json& v) {
  if (!v.is_object() || v.size() != 2) return std::nullopt;
  const auto t = v.find("_target_");
  const auto c = v.find("_call_");
  if (t == v.end() || c == v.end() || !t->is_string() || !c->is_boolean() || c->get<bool>()) {
    return std::nullopt;
  }
  const auto& name = t->get_ref<const std::string&>();
  if (name.empty() || name.size() > kMaxTargetChars) return std::nullopt;
  constexpr std::string_view kTorch = "torch.";
  if (name.starts_with(kTorch) && name.size() > kTorch.size() &&
      name.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789_", kTorch.size()) ==
          std::string::npos) {
    return name.substr(kTorch.size());
  }
  return name;
}

// The value kept for a field, as format/megatron_args keeps args' values; none: left out.
std::optional<json> native_value(const json& v) {
  switch (v.type()) {
    case json::value_t::null:
    case json::value_t::boolean:
    case json::value_t::number_integer:
    case json::value_t::number_unsigned:
      return v;
    case json::value_t::number_float:
      if (!std::isfinite(v.get<double>())) return std::nullopt;
      return v;
    case json::value_t::string:
      if (v.get_ref<const std::string&>().size() > kMaxNativeFieldChars) return std::nullopt;
      return v;
    case json::value_t::array: {
      if (v.empty() || v.size() > kMaxNativeListItems) return std::nullopt;
      for (const auto& e : v) {
        if (!e.is_boolean() && !e.is_number_integer()) return std::nullopt;
      }
      return v;
    }
    case json::value_t::object:
      if (auto name = uncalled_target(v)) return json(std::move(*name));
      return std::nullopt;
    default:
      return std::nullopt;
  }
}

}  // namespace

Result<json> native_from_transformer_config(const json& fields, std::string_view what) {
  if (!fields.is_object()) return make_error(EINVAL, "{}: the model config is not a mapping", what);
  json out = json::object();
  for (auto it = fields.begin(); it != fields.end(); ++it) {
    const std::string& name = it.key();
    if (name.empty() || name.size() > 256 || name.starts_with('_')) continue;  // _target_
    auto v = native_value(it.value());
    if (!v) continue;
    if (out.size() >= kMaxNativeConfigFields) {
      return make_error(EINVAL, "{}: the model config has more than {} fields", what,
                        kMaxNativeConfigFields);
    }
    out[name] = std::move(*v);
  }
  // The args' names for what TransformerConfig names otherwise (transformer_config.hpp).
  const auto absent = [&](const char* n) { return !out.contains(n); };
  const auto boolean = [&](const char* n, bool dflt) {
    const auto f = out.find(n);
    return f != out.end() && f->is_boolean() ? f->get<bool>() : dflt;
  };
  if (absent("swiglu")) {
    const auto act = out.find("activation_func");
    const bool silu = act != out.end() && act->is_string() &&
                      act->get_ref<const std::string&>() == "torch.nn.functional.silu";
    out["swiglu"] = boolean("gated_linear_unit", false) && silu;
  }
  if (const auto s = out.find("share_embeddings_and_output_weights");
      absent("untie_embeddings_and_output_weights") && s != out.end() && s->is_boolean()) {
    out["untie_embeddings_and_output_weights"] = !s->get<bool>();
  }
  if (const auto e = out.find("num_moe_experts"); absent("num_experts") && e != out.end()) {
    out["num_experts"] = *e;
  }
  if (const auto g = out.find("num_query_groups");
      absent("group_query_attention") && g != out.end()) {
    out["group_query_attention"] = !g->is_null();
  }
  if (const auto s = out.find("seq_length"); absent("max_position_embeddings") && s != out.end()) {
    out["max_position_embeddings"] = *s;
  }
  return out;
}

Result<json> read_bridge_run_config(std::string_view text, std::string_view what) {
  YamlLimits limits;
  limits.max_bytes = kMaxRunConfigBytes;
  CKPTFS_TRY(json doc, parse_yaml(text, what, limits));
  const auto model = doc.is_object() ? doc.find("model") : doc.end();
  if (!doc.is_object() || model == doc.end() || !model->is_object()) {
    return make_error(ENOENT, "{}: no 'model' mapping (Megatron-Bridge's ConfigContainer has one)",
                      what);
  }
  return native_from_transformer_config(*model, what);
}

}  // namespace ckptfs::format
