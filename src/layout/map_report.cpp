// layout/map_report: what each built-in map's detect clause found in a checkpoint no map serves.
#include "ckptfs/layout/map_report.hpp"

#include <algorithm>

#include <fmt/format.h>

#include "ckptfs/format/model_map.hpp"
#include "ckptfs/layout/model_map.hpp"

namespace ckptfs::layout {
namespace {

// The literal text a pattern starts with (before its first capture or star).
std::string_view literal_start(const format::MapPattern& p) {
  if (p.pieces.empty() || p.pieces.front().kind != format::MapPattern::Piece::Lit) return {};
  return p.pieces.front().text;
}

// The first stored name `p` matches (after the map's prefixes), or nullptr.
const Tensor* first_match(const format::ModelMap& m, const format::MapPattern& p,
                          const std::vector<Tensor>& stored) {
  const std::string_view lit = literal_start(p);
  for (const auto& t : stored) {
    const std::string_view name = map_stored_name(m, t.name);
    if (!name.starts_with(lit)) continue;
    if (format::match_pattern(p, name)) return &t;
  }
  return nullptr;
}

// Why map `m`'s detect clause does not hold: its first clause that fails.
std::string why_not(const format::ModelMap& m, const std::vector<Tensor>& stored,
                    std::string_view fmt_name) {
  const auto& d = m.detect;
  if (d.empty()) return "no detect clause (it applies only when named with -o map=)";
  if (!d.format.empty() && fmt_name.find(d.format) == std::string_view::npos) {
    return fmt::format("needs the format '{}'; this is {}", d.format, fmt_name);
  }
  for (const auto& p : d.all) {
    if (!first_match(m, p, stored)) return fmt::format("no stored name like '{}'", p.text);
  }
  if (!d.any.empty() && std::none_of(d.any.begin(), d.any.end(), [&](const auto& p) {
        return first_match(m, p, stored) != nullptr;
      })) {
    return fmt::format("no stored name like '{}' (or the others it accepts)", d.any.front().text);
  }
  for (const auto& p : d.none) {
    if (const Tensor* t = first_match(m, p, stored)) {
      return fmt::format("stored '{}' is one it does not map ('{}')", t->name, p.text);
    }
  }
  return "its detect clause holds";
}

}  // namespace

MapReport explain_unmapped(const std::vector<Tensor>& stored, std::string_view format) {
  MapReport r;
  // A name an HF checkpoint holds too ("lm_head.weight", read as it is by torchtitan's maps)
  // says nothing of the trainer: only the others do.
  std::vector<std::string_view> hf_names;
  for (const auto& m : format::builtin_maps()) {
    for (const auto& rule : m->rules) hf_names.push_back(rule.hf.text);
  }
  for (const auto& m : format::builtin_maps()) {
    if (r.native.empty()) {
      auto is_hf = [&](const std::string& text) {
        return std::find(hf_names.begin(), hf_names.end(), text) != hf_names.end();
      };
      auto native = [&](const format::MapPattern& p) {
        // Also with a prefix the map strips: torchtitan's "model." + "norm.weight" is HF's.
        if (is_hf(p.text) ||
            std::any_of(m->prefixes.begin(), m->prefixes.end(),
                        [&](const std::string& pre) { return is_hf(pre + p.text); })) {
          return false;
        }
        if (const Tensor* t = first_match(*m, p, stored)) r.native = t->name;
        return !r.native.empty();
      };
      for (const auto& rule : m->rules) {
        if (std::any_of(rule.parts.begin(), rule.parts.end(),
                        [&](const format::MapPart& part) { return native(part.from); })) {
          break;
        }
      }
      if (r.native.empty()) (void)std::any_of(m->detect.all.begin(), m->detect.all.end(), native);
    }
    r.trials.push_back(fmt::format("{}: {}", m->name, why_not(*m, stored, format)));
  }
  return r;
}

}  // namespace ckptfs::layout
