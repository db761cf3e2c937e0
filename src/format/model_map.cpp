// format/model_map: parsing of model maps (docs/maps.md): the JSON document and the built-ins.
#include "ckptfs/format/model_map.hpp"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ckptfs/util/checked.hpp"
#include "ckptfs/util/text.hpp"
#include "json_strict.hpp"
#include "map_lang.hpp"

namespace ckptfs::format {
namespace {

using detail::as_written;
using detail::check_hf_config;
using detail::is_arithmetic;
using detail::is_ident_char;
using detail::is_ident_start;
using detail::is_key_path;
using detail::parse_expr;
using detail::parse_pattern;
using detail::parse_rows;

// ---- the JSON document -------------------------------------------------------------------

using nlohmann::json;

Result<std::string> get_string(const json& j, std::string_view key, std::string_view where) {
  if (!j.is_string()) {
    return make_error(EINVAL, "{}: '{}' is {}, not a string", where, key, detail::describe(j));
  }
  return j.get<std::string>();
}

// A size written as a JSON integer or an expression string.
Result<MapExpr> get_expr(const json& j, std::string_view key, std::string_view where) {
  if (j.is_number_unsigned()) return parse_expr(std::to_string(j.get<uint64_t>()));
  if (!j.is_string()) {
    return make_error(EINVAL, "{}: '{}' is {}, not an expression", where, key, detail::describe(j));
  }
  auto e = parse_expr(j.get<std::string>());
  if (!e) return std::move(e).error().context(fmt::format("{}: '{}'", where, key));
  return e;
}

Result<std::vector<std::pair<std::string, MapExpr>>> get_sizes(const json& j, std::string_view key,
                                                               std::string_view where) {
  if (!j.is_object()) {
    return make_error(EINVAL, "{}: '{}' is {}, not an object", where, key, detail::describe(j));
  }
  if (j.size() > kMaxExprNames) {
    return make_error(EINVAL, "{}: '{}' has {} names (at most {})", where, key, j.size(),
                      kMaxExprNames);
  }
  std::vector<std::pair<std::string, MapExpr>> out;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const auto& n = it.key();
    if (n.empty() || !is_ident_start(n[0]) || !std::all_of(n.begin(), n.end(), is_ident_char)) {
      return make_error(EINVAL, "{}: '{}': '{}' is not a name", where, key, n);
    }
    CKPTFS_TRY(auto e, get_expr(it.value(), n, where));
    out.emplace_back(n, std::move(e));
  }
  return out;
}

Result<std::vector<MapPattern>> get_patterns(const json& j, std::string_view key,
                                             std::string_view where, bool allow_star) {
  if (!j.is_array()) {
    return make_error(EINVAL, "{}: '{}' is {}, not a list", where, key, detail::describe(j));
  }
  if (j.size() > kMaxMapRules) {
    return make_error(EINVAL, "{}: '{}' has {} entries (at most {})", where, key, j.size(),
                      kMaxMapRules);
  }
  std::vector<MapPattern> out;
  for (const auto& e : j) {
    CKPTFS_TRY(auto s, get_string(e, key, where));
    auto p = parse_pattern(s, allow_star);
    if (!p) return std::move(p).error().context(fmt::format("{}: '{}'", where, key));
    out.push_back(std::move(p).value());
  }
  return out;
}

Status refuse_unknown(const json& j, std::initializer_list<std::string_view> keys,
                      std::string_view where) {
  for (auto it = j.begin(); it != j.end(); ++it) {
    const auto& k = it.key();
    if (std::find(keys.begin(), keys.end(), k) != keys.end()) continue;
    if (is_arithmetic(k)) {
      return make_error(
          EINVAL, "{}: '{}' needs arithmetic on the bytes; a zero-copy map cannot do it", where, k);
    }
    return make_error(EINVAL, "{}: unknown key '{}'", where, as_written(k));
  }
  return {};
}

Result<MapPart> get_part(const json& j, std::string_view where) {
  MapPart p;
  CKPTFS_TRY(auto from, get_string(j.at("from"), "from", where));
  auto fp = parse_pattern(from, false);
  if (!fp) return std::move(fp).error().context(fmt::format("{}: 'from'", where));
  p.from = std::move(fp).value();
  if (auto it = j.find("index"); it != j.end()) {
    if (!it->is_array() || it->size() > 16) {
      return make_error(EINVAL, "{}: 'index' is {}, not a list of at most 16", where,
                        detail::describe(*it));
    }
    for (const auto& e : *it) {
      MapIndex ix;
      if (e.is_string()) {
        const auto s = e.get<std::string>();
        if (!s.empty() && is_ident_start(s[0]) && std::all_of(s.begin(), s.end(), is_ident_char)) {
          ix.capture = s;  // a capture when the rule binds it, else a size (compile decides)
        }
      }
      CKPTFS_TRY(ix.value, get_expr(e, "index", where));
      p.index.push_back(std::move(ix));
    }
  }
  if (auto it = j.find("rows"); it != j.end()) {
    CKPTFS_TRY(auto s, get_string(*it, "rows", where));
    auto r = parse_rows(s);
    if (!r) return std::move(r).error().context(where);
    p.rows = std::move(r).value();
  }
  if (auto it = j.find("let"); it != j.end()) {
    CKPTFS_TRY(p.let, get_sizes(*it, "let", where));
  }
  return p;
}

Result<MapRule> get_rule(const json& j, uint32_t number) {
  std::string where = fmt::format("rule {}", number);
  if (!j.is_object())
    return make_error(EINVAL, "{} is {}, not an object", where, detail::describe(j));
  if (auto it = j.find("hf"); it != j.end() && it->is_string()) {
    where = fmt::format("rule {} ('{}')", number, as_written(it->get<std::string>()));
  }
  CKPTFS_CHECK(refuse_unknown(j,
                              {"hf", "from", "concat", "index", "rows", "let", "for", "shape",
                               "split_last", "transpose", "offset", "when", "optional"},
                              where));
  MapRule r;
  r.number = number;
  if (!j.contains("hf")) return make_error(EINVAL, "{}: no 'hf'", where);
  CKPTFS_TRY(auto hf, get_string(j.at("hf"), "hf", where));
  auto hp = parse_pattern(hf, false);
  if (!hp) return std::move(hp).error().context(fmt::format("{}: 'hf'", where));
  r.hf = std::move(hp).value();
  const bool has_from = j.contains("from");
  const bool has_concat = j.contains("concat");
  if (has_from == has_concat) {
    return make_error(EINVAL, "{}: exactly one of 'from' and 'concat'", where);
  }
  if (has_from) {
    CKPTFS_TRY(auto part, get_part(j, where));
    r.parts.push_back(std::move(part));
  } else {
    if (j.contains("index") || j.contains("rows")) {
      return make_error(EINVAL, "{}: 'index' and 'rows' belong in each 'concat' part", where);
    }
    const auto& c = j.at("concat");
    if (!c.is_array() || c.empty() || c.size() > kMaxConcatParts) {
      return make_error(EINVAL, "{}: 'concat' is {}, not a list of 1 to {} parts", where,
                        detail::describe(c), kMaxConcatParts);
    }
    r.concat = true;
    for (size_t i = 0; i < c.size(); ++i) {
      const std::string pw = fmt::format("{} part {}", where, i + 1);
      if (!c[i].is_object()) {
        return make_error(EINVAL, "{} is {}, not an object", pw, detail::describe(c[i]));
      }
      CKPTFS_CHECK(refuse_unknown(c[i], {"from", "index", "rows", "let"}, pw));
      if (!c[i].contains("from")) return make_error(EINVAL, "{}: no 'from'", pw);
      CKPTFS_TRY(auto part, get_part(c[i], pw));
      r.parts.push_back(std::move(part));
    }
  }
  if (auto it = j.find("let"); it != j.end()) {
    CKPTFS_TRY(r.let, get_sizes(*it, "let", where));
  }
  if (auto it = j.find("for"); it != j.end()) {
    CKPTFS_TRY(r.for_, get_sizes(*it, "for", where));
  }
  if (auto it = j.find("offset"); it != j.end()) {
    CKPTFS_TRY(r.offset, get_sizes(*it, "offset", where));
  }
  if (auto it = j.find("shape"); it != j.end()) {
    if (!it->is_array() || it->size() > 16) {
      return make_error(EINVAL, "{}: 'shape' is {}, not a list of at most 16", where,
                        detail::describe(*it));
    }
    std::vector<MapExpr> shape;
    for (const auto& e : *it) {
      CKPTFS_TRY(auto x, get_expr(e, "shape", where));
      shape.push_back(std::move(x));
    }
    r.shape = std::move(shape);
  }
  if (auto it = j.find("split_last"); it != j.end()) {
    if (!it->is_array() || it->empty() || it->size() > 16) {
      return make_error(EINVAL, "{}: 'split_last' is {}, not a list of 1 to 16 sizes", where,
                        detail::describe(*it));
    }
    std::vector<MapExpr> split;
    for (const auto& e : *it) {
      CKPTFS_TRY(auto x, get_expr(e, "split_last", where));
      split.push_back(std::move(x));
    }
    r.split_last = std::move(split);
  }
  if (auto it = j.find("transpose"); it != j.end()) {
    // The one permutation served: the last two axes swapped, read with a stride (no arithmetic
    // on the values). Others are refused, as before, for what they would need.
    if (!(it->is_array() && it->size() == 2 && (*it)[0].is_number_integer() &&
          (*it)[1].is_number_integer() && (*it)[0].get<int64_t>() == -2 &&
          (*it)[1].get<int64_t>() == -1)) {
      return make_error(EINVAL,
                        "{}: 'transpose' is {}; only [-2, -1] (the last two axes swapped) is "
                        "served, another permutation needs arithmetic on the bytes",
                        where, detail::describe(*it));
    }
    if (r.concat || r.parts[0].rows || r.split_last) {
      return make_error(EINVAL,
                        "{}: 'transpose' goes with one 'from', without 'rows' or "
                        "'split_last'",
                        where);
    }
    r.transpose = true;
  }
  if (auto it = j.find("when"); it != j.end()) {
    CKPTFS_TRY(auto w, get_string(*it, "when", where));
    r.when_not = !w.empty() && w[0] == '!';
    r.when = r.when_not ? w.substr(1) : w;
    if (r.when.empty() || r.when.size() > 128 || !is_ident_start(r.when[0]) ||
        !std::all_of(r.when.begin(), r.when.end(),
                     [](char c) { return is_ident_char(c) || c == '.'; })) {
      return make_error(EINVAL, "{}: 'when' is not a config key or '!key'", where);
    }
  }
  // `optional`: true (the rule may find no stored tensor; two or more rules making one HF tensor
  // are alternatives, one of which must), or "absent" (the HF tensor itself may be absent: none
  // of its rules need find one).
  if (auto it = j.find("optional"); it != j.end()) {
    if (it->is_boolean()) {
      r.optional = it->get<bool>();
    } else if (it->is_string() && it->get<std::string>() == "absent") {
      r.optional = r.may_be_absent = true;
    } else {
      return make_error(EINVAL, "{}: 'optional' is not true, false or \"absent\"", where);
    }
  }

  // Captures: each from-capture names its HF tensor; `for` binds the others.
  const auto hcaps = r.hf.captures();
  std::set<std::string> bound;
  for (const auto& [c, e] : r.for_) bound.insert(c);
  for (size_t pi = 0; pi < r.parts.size(); ++pi) {
    const auto& p = r.parts[pi];
    for (const auto& c : p.from.captures()) {
      if (std::find(hcaps.begin(), hcaps.end(), c) == hcaps.end()) {
        return make_error(EINVAL,
                          "{}: capture '{{{}}}' of 'from' is not in 'hf' (two stored tensors would "
                          "make one HF name)",
                          where, c);
      }
      if (bound.count(c) && pi == 0) {
        return make_error(EINVAL, "{}: capture '{}' is both matched and in 'for'", where, c);
      }
    }
    if (pi == 0) {
      for (const auto& c : p.from.captures()) bound.insert(c);
    }
  }
  for (const auto& c : hcaps) {
    if (!bound.count(c)) {
      return make_error(EINVAL, "{}: capture '{{{}}}' of 'hf' is bound by neither 'from' nor 'for'",
                        where, c);
    }
  }
  for (const auto& p : r.parts) {
    for (const auto& c : p.from.captures()) {
      if (!bound.count(c)) {
        return make_error(EINVAL, "{}: capture '{{{}}}' is not bound by the first part", where, c);
      }
    }
  }
  for (const auto& [c, e] : r.for_) {
    if (std::find(hcaps.begin(), hcaps.end(), c) == hcaps.end()) {
      return make_error(EINVAL, "{}: 'for' capture '{}' is not in 'hf'", where, c);
    }
  }
  for (const auto& [c, e] : r.offset) {
    if (std::find(hcaps.begin(), hcaps.end(), c) == hcaps.end()) {
      return make_error(EINVAL, "{}: 'offset' capture '{}' is not in 'hf'", where, c);
    }
  }

  // One line for inspect.
  std::string text;
  for (size_t pi = 0; pi < r.parts.size(); ++pi) {
    const auto& p = r.parts[pi];
    if (pi) text += " ++ ";
    text += p.from.text;
    if (!p.index.empty()) {
      std::vector<std::string> ix;
      for (const auto& i : p.index) ix.push_back(i.value->text);
      text += fmt::format("[{}]", fmt::join(ix, ", "));
    }
    if (p.rows) text += " rows " + p.rows->text;
  }
  for (const auto& [c, e] : r.offset) text += fmt::format(" ({{{}}} + {} in hf)", c, e.text);
  if (r.transpose) text += " last two axes swapped";
  if (r.split_last) {
    std::vector<std::string> ax;
    for (const auto& e : *r.split_last) ax.push_back(e.text);
    text += fmt::format(" last axis as [{}]", fmt::join(ax, ", "));
  }
  r.text = std::move(text);
  return r;
}

}  // namespace

Result<ModelMap> parse_model_map(std::string_view text, std::string_view what) {
  if (text.size() > kMaxMapBytes) {
    return make_error(EFBIG, "{}: map of {} bytes (at most {})", what, text.size(), kMaxMapBytes);
  }
  CKPTFS_TRY(json j, detail::parse_json_strict(text, what, "model map"));
  auto fail = [&](Error e) { return std::move(e).context(what); };
  if (!j.is_object()) return make_error(EINVAL, "{}: a model map is a JSON object", what);
  if (auto s = refuse_unknown(j,
                              {"ckptfs_map", "name", "about", "detect", "prefixes", "axes",
                               "tensors", "drop", "hf_config", "hf_config_requires", "refuse"},
                              "map");
      !s) {
    return fail(std::move(s).error());
  }
  auto v = j.find("ckptfs_map");
  if (v == j.end() || !v->is_number_unsigned() || v->get<uint64_t>() != 1) {
    return make_error(EINVAL, "{}: 'ckptfs_map' must be 1 (the format version)", what);
  }
  ModelMap m;
  auto n = j.find("name");
  if (n == j.end() || !n->is_string()) return make_error(EINVAL, "{}: no 'name'", what);
  m.name = n->get<std::string>();
  if (m.name.empty() || m.name.size() > 64 ||
      !std::all_of(m.name.begin(), m.name.end(), [](char c) {
        return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-';
      })) {
    return make_error(EINVAL, "{}: name {} is not [a-z0-9._-]{{1,64}}", what, detail::describe(*n));
  }
  if (auto a = j.find("about"); a != j.end()) {
    if (!a->is_string() || a->get<std::string>().size() > 512) {
      return make_error(EINVAL, "{}: 'about' is not a string of at most 512", what);
    }
    m.about = a->get<std::string>();
  }
  if (auto d = j.find("detect"); d != j.end()) {
    if (!d->is_object()) return make_error(EINVAL, "{}: 'detect' is not an object", what);
    if (auto s = refuse_unknown(*d, {"all", "any", "none", "format"}, "detect"); !s) {
      return fail(std::move(s).error());
    }
    for (auto [key, dst] : {std::pair{"all", &m.detect.all}, std::pair{"any", &m.detect.any},
                            std::pair{"none", &m.detect.none}}) {
      if (auto it = d->find(key); it != d->end()) {
        auto ps = get_patterns(*it, key, "detect", true);
        if (!ps) return fail(std::move(ps).error());
        *dst = std::move(ps).value();
      }
    }
    if (auto it = d->find("format"); it != d->end()) {
      auto s = get_string(*it, "format", "detect");
      if (!s) return fail(std::move(s).error());
      m.detect.format = std::move(s).value();
    }
  }
  if (auto p = j.find("prefixes"); p != j.end()) {
    if (!p->is_array() || p->size() > 16) {
      return make_error(EINVAL, "{}: 'prefixes' is not a list of at most 16", what);
    }
    for (const auto& e : *p) {
      if (!e.is_string() || e.get<std::string>().empty() || e.get<std::string>().size() > 128) {
        return make_error(EINVAL, "{}: 'prefixes' holds {}", what, detail::describe(e));
      }
      m.prefixes.push_back(e.get<std::string>());
    }
  }
  if (auto a = j.find("axes"); a != j.end()) {
    auto s = get_sizes(*a, "axes", "map");
    if (!s) return fail(std::move(s).error());
    m.axes = std::move(s).value();
  }
  auto t = j.find("tensors");
  if (t == j.end() || !t->is_array() || t->empty() || t->size() > kMaxMapRules) {
    return make_error(EINVAL, "{}: 'tensors' must be a list of 1 to {} rules", what, kMaxMapRules);
  }
  for (size_t i = 0; i < t->size(); ++i) {
    auto r = get_rule((*t)[i], static_cast<uint32_t>(i + 1));
    if (!r) return fail(std::move(r).error());
    m.rules.push_back(std::move(r).value());
  }
  if (auto d = j.find("drop"); d != j.end()) {
    auto ps = get_patterns(*d, "drop", "map", true);
    if (!ps) return fail(std::move(ps).error());
    m.drop = std::move(ps).value();
  }
  if (auto h = j.find("hf_config"); h != j.end()) {
    if (auto st = check_hf_config(*h); !st) return fail(std::move(st).error());
    m.hf_config = *h;
  }
  if (auto q = j.find("hf_config_requires"); q != j.end()) {
    if (!q->is_object() || q->size() > kMaxExprNames || !m.hf_config.is_object()) {
      return make_error(EINVAL,
                        "{}: 'hf_config_requires' is not an object of at most {} fields beside an "
                        "'hf_config'",
                        what, kMaxExprNames);
    }
    for (auto it = q->begin(); it != q->end(); ++it) {
      if (!is_key_path(it.key()) || it.value().is_structured() || it.value().is_null()) {
        return make_error(EINVAL, "{}: 'hf_config_requires' '{}': not a field and a scalar value",
                          what, as_written(it.key()));
      }
    }
    m.hf_config_requires = *q;
  }
  if (auto rf = j.find("refuse"); rf != j.end()) {
    if (!rf->is_array() || rf->size() > kMaxMapRules) {
      return make_error(EINVAL, "{}: 'refuse' is not a list of at most {} entries", what,
                        kMaxMapRules);
    }
    for (size_t i = 0; i < rf->size(); ++i) {
      const auto& e = (*rf)[i];
      const std::string rw = fmt::format("refuse {}", i + 1);
      if (!e.is_object()) {
        return make_error(EINVAL, "{}: {} is {}, not an object", what, rw, detail::describe(e));
      }
      if (auto s = refuse_unknown(e, {"from", "why"}, rw); !s) return fail(std::move(s).error());
      if (!e.contains("from") || !e.contains("why")) {
        return make_error(EINVAL, "{}: {} needs 'from' and 'why'", what, rw);
      }
      auto from = get_string(e.at("from"), "from", rw);
      if (!from) return fail(std::move(from).error());
      auto p = parse_pattern(*from, true);
      if (!p) return fail(std::move(p).error().context(fmt::format("{}: 'from'", rw)));
      auto why = get_string(e.at("why"), "why", rw);
      if (!why) return fail(std::move(why).error());
      if (why->empty() || why->size() > 512 || std::any_of(why->begin(), why->end(), [](char c) {
            return static_cast<unsigned char>(c) < 0x20;
          })) {
        return make_error(EINVAL, "{}: {}: 'why' is not one line of 1 to 512 bytes", what, rw);
      }
      m.refuse.push_back(MapRefusal{std::move(p).value(), std::move(why).value()});
    }
  }
  m.origin = std::string(what);
  return m;
}

Result<MapExpr> parse_map_expr(std::string_view text) { return parse_expr(text); }

Result<nlohmann::json> parse_map_config(std::string_view text, std::string_view what) {
  if (text.size() > kMaxConfigBytes) {
    return make_error(EFBIG, "{}: config of {} bytes (at most {})", what, text.size(),
                      kMaxConfigBytes);
  }
  CKPTFS_TRY(json j, detail::parse_json_strict(text, what, "config.json"));
  if (!j.is_object()) return make_error(EINVAL, "{}: config.json is not a JSON object", what);
  return j;
}

namespace detail {
// tools/embed_maps.py's output: (file name, text) in detection order.
const std::vector<std::pair<std::string_view, std::string_view>>& builtin_map_texts();
}  // namespace detail

const std::vector<std::shared_ptr<const ModelMap>>& builtin_maps() {
  static const std::vector<std::shared_ptr<const ModelMap>> maps = [] {
    std::vector<std::shared_ptr<const ModelMap>> out;
    for (const auto& [file, text] : detail::builtin_map_texts()) {
      auto m = parse_model_map(text, fmt::format("built-in map {}", file));
      if (!m) {
        // A build defect (tests/unit parses every built-in): never served, said once.
        fmt::print(stderr, "ckptfs: {}\n", m.error().message);
        continue;
      }
      m->origin = "built-in";
      out.push_back(std::make_shared<const ModelMap>(std::move(m).value()));
    }
    return out;
  }();
  return maps;
}

std::shared_ptr<const ModelMap> find_builtin_map(std::string_view name) {
  for (const auto& m : builtin_maps()) {
    if (m->name == name) return m;
  }
  return nullptr;
}

}  // namespace ckptfs::format
