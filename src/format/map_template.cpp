// format/map_template: the checks of a model map's `hf_config` template (docs/maps.md: keys,
// `$` forms, the node cap), and the words and names the document parser shares with them.
#include <algorithm>
#include <iterator>
#include <string>

#include <fmt/format.h>

#include "ckptfs/util/checked.hpp"
#include "ckptfs/util/text.hpp"
#include "json_strict.hpp"
#include "map_lang.hpp"

namespace ckptfs::format::detail {
namespace {

// Words a map may not use: each needs arithmetic on the bytes.
constexpr std::string_view kArithmetic[] = {"transpose", "permute", "sum",  "add",
                                            "mean",      "scale",   "mul",  "cast",
                                            "dtype",     "reshape", "view", "t"};

}  // namespace

std::string as_written(std::string_view s) {
  return s.size() <= 80 ? printable(s) : printable(s.substr(0, 80)) + "...";
}

bool is_arithmetic(std::string_view key) {
  return std::find(std::begin(kArithmetic), std::end(kArithmetic), key) != std::end(kArithmetic);
}

bool is_key_path(std::string_view s) {
  return !s.empty() && s.size() <= 128 && is_ident_start(s[0]) &&
         std::all_of(s.begin(), s.end(), [](char c) { return is_ident_char(c) || c == '.'; }) &&
         s.back() != '.' && s.find("..") == std::string_view::npos;
}

namespace {

using nlohmann::json;

constexpr size_t kMaxTemplateNodes = 4096;

// `KEY` or `!KEY`.
bool is_condition(std::string_view s) { return is_key_path(s.starts_with('!') ? s.substr(1) : s); }

// `KEY | KEY | ...`: field copies, first present wins.
bool is_copy_list(std::string_view s) {
  size_t n = 0;
  for (size_t b = 0;; ++n) {
    const size_t bar = s.find('|', b);
    std::string_view alt = s.substr(b, bar == std::string_view::npos ? s.npos : bar - b);
    while (!alt.empty() && alt.front() == ' ') alt.remove_prefix(1);
    while (!alt.empty() && alt.back() == ' ') alt.remove_suffix(1);
    if (!is_key_path(alt) || n >= kMaxExprNames) return false;
    if (bar == std::string_view::npos) return true;
    b = bar + 1;
  }
}

bool is_computed(const json& j) {
  if (!j.is_object()) return false;
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key().starts_with('$')) return true;
  }
  return false;
}

// A template value: a JSON literal, or a computed value `{"$int": EXPR}`, `{"$bool": "KEY" |
// "!KEY"}`, `{"$copy": "KEY | KEY"}`, `{"$leading": "KEY", "of": S, "then": S}` (S a number or
// a bool), `{"$map": "KEY", "cases": {TEXT: VALUE, ...}}` (each VALUE a template value),
// `{"$refuse": "WHY"}`, each with an optional "if" (a condition) and "else" (a template value).
// Objects and lists are walked.
Status check_template(const json& j, const std::string& where, size_t& nodes) {
  if (++nodes > kMaxTemplateNodes) {
    return make_error(EINVAL, "hf_config: more than {} values", kMaxTemplateNodes);
  }
  if (j.is_array()) {
    for (size_t i = 0; i < j.size(); ++i) {
      CKPTFS_CHECK(check_template(j[i], fmt::format("{}[{}]", where, i), nodes));
    }
    return {};
  }
  if (!j.is_object()) return {};
  if (!is_computed(j)) {
    for (auto it = j.begin(); it != j.end(); ++it) {
      CKPTFS_CHECK(check_template(it.value(), where + "." + as_written(it.key()), nodes));
    }
    return {};
  }
  int kinds = 0;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const auto& k = it.key();
    const auto& v = it.value();
    const std::string at = fmt::format("hf_config '{}': '{}'", where, as_written(k));
    if (k == "$int") {
      ++kinds;
      if (!v.is_string())
        return make_error(EINVAL, "{} is {}, not an expression", at, detail::describe(v));
      auto e = parse_expr(v.get<std::string>());
      if (!e) return std::move(e).error().context(at);
    } else if (k == "$bool") {
      ++kinds;
      if (!v.is_string() || !is_condition(v.get<std::string>())) {
        return make_error(EINVAL, "{} is not a field or '!field'", at);
      }
    } else if (k == "$copy") {
      ++kinds;
      if (!v.is_string() || !is_copy_list(v.get<std::string>())) {
        return make_error(EINVAL, "{} is not 'field | field ...'", at);
      }
    } else if (k == "$refuse") {
      ++kinds;
      if (!v.is_string() || v.get<std::string>().empty() || v.get<std::string>().size() > 512) {
        return make_error(EINVAL, "{} is not a reason of 1 to 512 bytes", at);
      }
    } else if (k == "$leading" || k == "$map") {
      ++kinds;
      if (!v.is_string() || !is_key_path(v.get<std::string>())) {
        return make_error(EINVAL, "{} is not a field", at);
      }
    } else if (k == "of" || k == "then") {
      if (!(v.is_number_integer() || v.is_boolean())) {
        return make_error(EINVAL, "{} is {}, not an integer or a bool", at, detail::describe(v));
      }
    } else if (k == "cases") {
      if (!v.is_object() || v.empty() || v.size() > kMaxExprNames) {
        return make_error(EINVAL, "{} is not an object of 1 to {} cases", at, kMaxExprNames);
      }
      for (auto c = v.begin(); c != v.end(); ++c) {
        if (c.key().empty() || c.key().size() > 128) {
          return make_error(EINVAL, "{}: case '{}' is not a value's text", at, as_written(c.key()));
        }
        CKPTFS_CHECK(
            check_template(c.value(), fmt::format("{}[{}]", where, as_written(c.key())), nodes));
      }
    } else if (k == "if") {
      if (!v.is_string() || !is_condition(v.get<std::string>())) {
        return make_error(EINVAL, "{} is not a field or '!field'", at);
      }
    } else if (k == "else") {
      CKPTFS_CHECK(check_template(v, where, nodes));
    } else if (is_arithmetic(k)) {
      return make_error(EINVAL, "{} needs arithmetic on values the template does not do", at);
    } else {
      return make_error(EINVAL,
                        "{}: unknown key (a computed value has one of $int, $bool, "
                        "$copy, $leading, $map, $refuse, and 'if', 'else')",
                        at);
    }
  }
  if (kinds != 1) {
    return make_error(EINVAL,
                      "hf_config '{}': a computed value has exactly one of $int, $bool, "
                      "$copy, $leading, $map, $refuse",
                      where);
  }
  // `of` and `then` belong to $leading (both required), `cases` to $map (required).
  const bool leading = j.contains("$leading"), mapped = j.contains("$map");
  if (leading != (j.contains("of") && j.contains("then")) ||
      (!leading && (j.contains("of") || j.contains("then")))) {
    return make_error(EINVAL, "hf_config '{}': 'of' and 'then' go together with $leading", where);
  }
  if (mapped != j.contains("cases")) {
    return make_error(EINVAL, "hf_config '{}': 'cases' goes with $map, and $map needs it", where);
  }
  return {};
}

}  // namespace

Status check_hf_config(const json& j) {
  if (!j.is_object() || is_computed(j)) {
    return make_error(EINVAL, "'hf_config' is {}, not an object of config.json keys",
                      detail::describe(j));
  }
  size_t nodes = 0;
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key().empty()) return make_error(EINVAL, "hf_config: an empty key");
    CKPTFS_CHECK(check_template(it.value(), as_written(it.key()), nodes));
  }
  return {};
}

}  // namespace ckptfs::format::detail
