// layout/map_config: the values a model map reads from a config (dotted paths), and the config.json
// a map's hf_config template makes of a native config (docs/maps.md).
#include "ckptfs/layout/map_config.hpp"

#include <charconv>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace ckptfs::layout {

const nlohmann::json* config_field(const nlohmann::json& config, std::string_view key) {
  const nlohmann::json* j = &config;
  size_t b = 0;
  for (;;) {
    const size_t dot = key.find('.', b);
    const std::string part(key.substr(b, dot == std::string_view::npos ? key.npos : dot - b));
    if (!j->is_object()) return nullptr;
    auto it = j->find(part);
    if (it == j->end()) return nullptr;
    j = &*it;
    if (dot == std::string_view::npos) break;
    b = dot + 1;
  }
  return j->is_null() ? nullptr : j;
}

std::optional<uint64_t> config_value(const nlohmann::json& config, std::string_view key) {
  const nlohmann::json* j = config_field(config, key);
  if (!j) return std::nullopt;
  if (j->is_boolean()) return j->get<bool>() ? 1 : 0;
  if (j->is_number_unsigned()) return j->get<uint64_t>();
  if (j->is_number_integer() && j->get<int64_t>() >= 0)
    return static_cast<uint64_t>(j->get<int64_t>());
  return std::nullopt;
}

namespace {

class Renderer {
 public:
  Renderer(const nlohmann::json& native, std::string_view what) : native_(native), what_(what) {}

  // The value of template node `t` at `where`; nullopt: left out (an `if` that does not hold,
  // with no `else`).
  Result<std::optional<nlohmann::json>> value(const nlohmann::json& t, const std::string& where) {
    if (t.is_array()) {
      nlohmann::json out = nlohmann::json::array();
      for (size_t i = 0; i < t.size(); ++i) {
        CKPTFS_TRY(auto v, value(t[i], fmt::format("{}[{}]", where, i)));
        if (v) out.push_back(std::move(*v));
      }
      return std::optional<nlohmann::json>(std::move(out));
    }
    if (!t.is_object()) return std::optional<nlohmann::json>(t);
    bool computed = false;
    for (auto it = t.begin(); it != t.end(); ++it) computed = computed || it.key().starts_with('$');
    if (!computed) {
      nlohmann::json out = nlohmann::json::object();
      for (auto it = t.begin(); it != t.end(); ++it) {
        CKPTFS_TRY(auto v, value(it.value(), where + "." + it.key()));
        if (v) out[it.key()] = std::move(*v);
      }
      return std::optional<nlohmann::json>(std::move(out));
    }
    const auto otherwise = [&](std::string why) -> Result<std::optional<nlohmann::json>> {
      if (auto e = t.find("else"); e != t.end()) return value(*e, where);
      if (why.empty()) return std::optional<nlohmann::json>();  // an `if` that does not hold
      return make_error(EINVAL, "hf_config '{}': {} in {}", where, why, what_);
    };
    if (auto c = t.find("if"); c != t.end() && !holds(c->get<std::string>())) return otherwise("");
    if (auto e = t.find("$int"); e != t.end()) {
      auto expr = format::parse_map_expr(e->get<std::string>());
      if (!expr) return std::move(expr).error().context(fmt::format("hf_config '{}'", where));
      auto v =
          format::eval_expr(*expr, [this](std::string_view n) { return config_value(native_, n); });
      if (!v) {
        if (v.error().code == ENOENT) return otherwise(v.error().message);
        return std::move(v).error().context(fmt::format("hf_config '{}' ({})", where, what_));
      }
      return std::optional<nlohmann::json>(*v);
    }
    if (auto e = t.find("$bool"); e != t.end()) {
      const auto s = e->get<std::string>();
      const bool neg = s.starts_with('!');
      const auto key = std::string_view(s).substr(neg ? 1 : 0);
      const auto* f = config_field(native_, key);
      if (!f || !(f->is_boolean() || f->is_number_integer())) {
        return otherwise(
            fmt::format("'{}' is {}, not a boolean", key, f ? f->type_name() : "missing"));
      }
      const bool v = f->is_boolean() ? f->get<bool>() : f->get<int64_t>() != 0;
      return std::optional<nlohmann::json>(v != neg);
    }
    if (auto e = t.find("$leading"); e != t.end()) return leading(t, e->get<std::string>(), where);
    if (auto e = t.find("$refuse"); e != t.end()) {
      return make_error(EINVAL, "hf_config '{}': {} in {}", where, e->get<std::string>(), what_);
    }
    if (auto e = t.find("$map"); e != t.end()) {
      const auto key = e->get<std::string>();
      const auto& cases = t.at("cases");
      const auto* f = config_field(native_, key);
      const auto c = map_case(cases, f);
      if (c != cases.end()) return value(*c, fmt::format("{}[{}]", where, c.key()));
      if (!f) return otherwise(fmt::format("no value for {}", key));
      if (!(f->is_string() || f->is_boolean() || f->is_number())) {
        return otherwise(
            fmt::format("'{}' is {}, not a string, a number or a bool", key, f->type_name()));
      }
      std::vector<std::string> names;
      for (auto n = cases.begin(); n != cases.end(); ++n) names.push_back(n.key());
      return otherwise(
          fmt::format("{} is {}, not one of {}", key, f->dump(), fmt::join(names, ", ")));
    }
    const auto list = t.at("$copy").get<std::string>();
    std::vector<std::string> tried;
    for (size_t b = 0;;) {
      const size_t bar = list.find('|', b);
      std::string alt = list.substr(b, bar == std::string::npos ? std::string::npos : bar - b);
      alt.erase(0, alt.find_first_not_of(' '));
      alt.erase(alt.find_last_not_of(' ') + 1);
      if (const auto* f = config_field(native_, alt)) return std::optional<nlohmann::json>(*f);
      tried.push_back(alt);
      if (bar == std::string::npos) break;
      b = bar + 1;
    }
    return otherwise(fmt::format("no value for {}", fmt::join(tried, ", ")));
  }

 private:
  // `{"$leading": KEY, "of": A, "then": B}`: how many elements of the list KEY, from its start,
  // equal A; every later one must equal B. A number or a bool stands for a list of itself
  // throughout (Megatron-LM's moe_layer_freq 1: every layer an MoE layer).
  Result<std::optional<nlohmann::json>> leading(const nlohmann::json& t, const std::string& key,
                                                const std::string& where) {
    const auto* f = config_field(native_, key);
    const auto& of = t.at("of");
    const auto& then = t.at("then");
    const auto same = [](const nlohmann::json& x, const nlohmann::json& want) {
      if (!(x.is_boolean() || x.is_number_integer())) return false;
      const int64_t a = x.is_boolean() ? int64_t{x.get<bool>()} : x.get<int64_t>();
      const int64_t b = want.is_boolean() ? int64_t{want.get<bool>()} : want.get<int64_t>();
      return a == b;
    };
    const auto refuse = [&](std::string why) -> Result<std::optional<nlohmann::json>> {
      return make_error(EINVAL, "hf_config '{}': {} in {}", where, why, what_);
    };
    if (!f) {
      if (auto e = t.find("else"); e != t.end()) return value(*e, where);
      return refuse(fmt::format("no value for {}", key));
    }
    if (!f->is_array()) {
      if (same(*f, then)) return std::optional<nlohmann::json>(0);
      return refuse(fmt::format("{} is {}: neither a list nor {} (every element {})", key,
                                f->dump(), then.dump(), then.dump()));
    }
    uint64_t n = 0;
    while (n < f->size() && same((*f)[n], of)) ++n;
    for (size_t i = n; i < f->size(); ++i) {
      if (!same((*f)[i], then)) {
        return refuse(fmt::format(
            "{}[{}] is {}: after the leading {} every element must be {} (the HF architecture "
            "names one split point)",
            key, i, (*f)[i].dump(), of.dump(), then.dump()));
      }
    }
    return std::optional<nlohmann::json>(n);
  }

  // The case of `cases` a field's value selects: a string as it is; true, false; a number whose
  // case text is the same number (`1`, `1.0` and `1e0` alike); "null" for no value (absent or
  // null). cases.end() for none.
  static nlohmann::json::const_iterator map_case(const nlohmann::json& cases,
                                                 const nlohmann::json* f) {
    if (!f) return cases.find("null");
    if (f->is_string()) return cases.find(f->get<std::string>());
    if (f->is_boolean() || f->is_number_integer()) {
      if (auto c = cases.find(f->dump()); c != cases.end()) return c;  // true, 17
    }
    if (!f->is_number()) return cases.end();
    const double want = f->get<double>();
    for (auto c = cases.begin(); c != cases.end(); ++c) {
      double got = 0;
      const auto& k = c.key();
      const auto [end, ec] = std::from_chars(k.data(), k.data() + k.size(), got);
      if (ec == std::errc() && end == k.data() + k.size() && got == want) return c;
    }
    return cases.end();
  }

  bool holds(const std::string& cond) const {
    const bool neg = cond.starts_with('!');
    const bool v =
        config_value(native_, std::string_view(cond).substr(neg ? 1 : 0)).value_or(0) != 0;
    return v != neg;
  }

  const nlohmann::json& native_;
  std::string_view what_;
};

}  // namespace

Result<nlohmann::json> render_hf_config(const format::ModelMap& map, const nlohmann::json& native,
                                        std::string_view native_what) {
  if (!map.hf_config.is_object()) {
    return make_error(ENOENT, "map '{}' has no 'hf_config' template", map.name);
  }
  if (map.hf_config_requires.is_object()) {
    for (auto it = map.hf_config_requires.begin(); it != map.hf_config_requires.end(); ++it) {
      const auto* f = config_field(native, it.key());
      if (!f) continue;  // older args lack newer fields: their default is the one required
      const auto& want = it.value();
      const bool same = (f->is_number() && want.is_number())
                            ? f->get<double>() == want.get<double>()
                            : *f == want;
      if (!same) {
        return make_error(EINVAL,
                          "map '{}' reads only models with {} = {} (hf_config_requires); {} has "
                          "{}: the HF architecture it names would compute another model",
                          map.name, it.key(), want.dump(), native_what, f->dump());
      }
    }
  }
  Renderer r(native, native_what);
  nlohmann::json out = nlohmann::json::object();
  for (auto it = map.hf_config.begin(); it != map.hf_config.end(); ++it) {
    auto v = r.value(it.value(), it.key());
    if (!v) return std::move(v).error().context(fmt::format("map '{}'", map.name));
    if (*v) out[it.key()] = std::move(**v);
  }
  return out;
}

}  // namespace ckptfs::layout
