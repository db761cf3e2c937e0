// layout/map_apply: which map a checkpoint gets (the one named, or the first built-in that
// detects it), the config.json that sizes it (the checkpoint's, -o hf_config, or the map's
// template over the native config), and the mapped tensors put in place of the stored ones.
#include <algorithm>

#include <fmt/format.h>

#include "ckptfs/format/names.hpp"
#include "ckptfs/layout/map_config.hpp"
#include "ckptfs/layout/model_map.hpp"

namespace ckptfs::layout {

std::string_view map_stored_name(const format::ModelMap& map, std::string_view name) {
  for (const auto& p : map.prefixes) {
    if (name.starts_with(p)) return name.substr(p.size());
  }
  return name;
}

std::optional<MapRefused> map_refuses(const format::ModelMap& map,
                                      const std::vector<Tensor>& stored) {
  if (map.refuse.empty()) return std::nullopt;
  for (uint32_t i = 0; i < stored.size(); ++i) {
    const auto n = map_stored_name(map, stored[i].name);
    for (const auto& r : map.refuse) {
      if (format::match_pattern(r.from, n)) return MapRefused{i, &r};
    }
  }
  return std::nullopt;
}

bool map_detects(const format::ModelMap& map, const std::vector<Tensor>& stored,
                 std::string_view fmt_name) {
  const auto& d = map.detect;
  if (d.empty()) return false;
  if (!d.format.empty() && fmt_name.find(d.format) == std::string_view::npos) return false;
  auto any_match = [&](const format::MapPattern& p) {
    return std::any_of(stored.begin(), stored.end(), [&](const Tensor& t) {
      return format::match_pattern(p, map_stored_name(map, t.name)).has_value();
    });
  };
  if (!std::all_of(d.all.begin(), d.all.end(), any_match)) return false;
  if (!d.any.empty() && !std::any_of(d.any.begin(), d.any.end(), any_match)) return false;
  if (std::any_of(d.none.begin(), d.none.end(), any_match)) return false;
  return true;
}

bool apply_model_map(const BuildInput& in, const BuildOptions& opts, Checkpoint& ck,
                     std::vector<uint32_t>& k) {
  auto problem = [&](std::string file, std::string tensor, std::string msg) {
    ck.problems.push_back(Problem{std::move(file), std::move(tensor), std::move(msg)});
  };
  std::shared_ptr<const format::ModelMap> m = opts.map;
  const bool named = m != nullptr;
  if (!m) {
    for (const auto& b : format::builtin_maps()) {
      if (map_detects(*b, ck.tensors, ck.format)) {
        m = b;
        break;
      }
    }
  }
  if (!m) return false;
  if (auto r = map_refuses(*m, ck.tensors)) {
    const auto& name = ck.tensors[r->tensor].name;
    if (named) {
      problem(
          "", name,
          fmt::format("map '{}' cannot serve this stored tensor: {}", m->name, r->refusal->why));
    } else {
      ck.map_note = fmt::format(
          "looks like map '{}' ({}); served under its stored names, because the map cannot serve "
          "stored tensor '{}': {}",
          m->name, m->about.empty() ? m->origin : m->about, name, r->refusal->why);
    }
    return false;
  }
  std::string text, what, from;  // from: for inspect (Checkpoint::config_from)
  // Why the checkpoint's own config (common.pt's args) made none: said with the refusal.
  std::string native_why;
  if (!in.config.empty()) {
    text = in.config;
    what = "config.json";
  } else if (!opts.hf_config.empty()) {
    text = opts.hf_config;
    what = opts.hf_config_what.empty() ? std::string("hf_config") : opts.hf_config_what;
    from = hf_config_origin(opts);
  } else if (!in.native_problem.empty()) {
    native_why = in.native_problem;
  } else if (!in.native_config.empty() && !m->hf_config.is_object()) {
    native_why = fmt::format("map '{}' has no 'hf_config' template to read {} with", m->name,
                             in.native_what);
  } else if (!in.native_config.empty()) {
    auto native = format::parse_map_config(in.native_config, in.native_what);
    auto made = native ? render_hf_config(*m, *native, in.native_what)
                       : Result<nlohmann::json>(std::move(native).error());
    if (made) {
      text = made->dump(2) + "\n";
      what = fmt::format("config.json made by map '{}' from {}", m->name, in.native_what);
      from = fmt::format("made by the map from {}", in.native_what);
    } else {
      native_why = made.error().message;
    }
  }
  if (text.empty()) {
    const std::string why = native_why.empty() ? std::string() : "; " + native_why;
    if (named) {
      problem(native_why.empty() ? "config.json" : in.native_what, "",
              fmt::format("map '{}' needs the model's config.json: the directory has none; give "
                          "one with -o hf_config=PATH (--hf-config PATH){}",
                          m->name, why));
    } else {
      ck.map_note = fmt::format(
          "looks like map '{}' ({}); served under its stored names, because it needs the "
          "model's config.json: give one with -o hf_config=PATH (--hf-config PATH){}",
          m->name, m->about.empty() ? m->origin : m->about, why);
    }
    return false;
  }
  auto config = format::parse_map_config(text, what);
  if (!config) {
    problem(what, "", config.error().message);
    return false;
  }
  auto compiled = compile_map(*m, *config, what, ck.tensors);
  if (!compiled.problems.empty()) {
    for (auto& p : compiled.problems) ck.problems.push_back(std::move(p));
    return false;
  }
  if (in.config.empty()) {
    ck.config_json = text;
    ck.config_from = from;
  }
  ck.map = m->name;
  ck.stored = std::move(ck.tensors);
  ck.tensors.clear();
  k.clear();
  OutputPacker packer;
  for (auto& mt : compiled.tensors) {
    Tensor t;
    t.name = std::move(mt.name);
    t.dtype = mt.dtype;
    t.src_dtype = mt.src_dtype;
    t.shape = std::move(mt.shape);
    t.strides.assign(t.shape.size(), 1);
    for (size_t d = t.shape.size(); d-- > 1;) t.strides[d - 1] = t.strides[d] * t.shape[d];
    t.numel = 1;
    for (auto d : t.shape) t.numel *= d;  // a selection of a stored tensor: no overflow
    t.nbytes = t.numel * (format::dtype_bits(t.dtype) / 8);
    t.mapped = true;
    t.runs = std::move(mt.runs);
    t.origin = std::move(mt.origin);
    k.push_back(packer.place(t.nbytes));
    ck.tensors.push_back(std::move(t));
  }
  if (compiled.dropped > 0) {
    ck.left_out.push_back(
        fmt::format("{} stored tensor(s) dropped by map '{}' (its 'drop' "
                    "and 'when' rules: a tied head, RoPE buffers)",
                    compiled.dropped, m->name));
  }
  return true;
}

}  // namespace ckptfs::layout
