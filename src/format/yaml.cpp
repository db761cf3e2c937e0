// format/yaml: the YAML subset PyYAML's safe_dump writes, read into JSON with caps (yaml.hpp):
// documents, block and flow collections, properties (yaml_scalar.cpp: the scalars).
#include "ckptfs/format/yaml.hpp"

#include <algorithm>

#include "ckptfs/util/text.hpp"
#include "yaml_parser.hpp"

namespace ckptfs::format {
namespace yaml_detail {

size_t Parser::key_colon(std::string_view r) {
  if (r.empty()) return std::string_view::npos;
  const char c0 = r[0];
  if (c0 == '\'' || c0 == '"') {
    size_t i = 1;
    for (; i < r.size(); ++i) {
      if (c0 == '"' && r[i] == '\\') {
        ++i;
      } else if (r[i] == c0) {
        if (c0 == '\'' && i + 1 < r.size() && r[i + 1] == '\'') {
          ++i;
        } else {
          break;
        }
      }
    }
    if (i >= r.size()) return std::string_view::npos;
    ++i;
    while (i < r.size() && r[i] == ' ') ++i;
    if (i < r.size() && r[i] == ':' && (i + 1 == r.size() || r[i + 1] == ' ')) return i;
    return std::string_view::npos;
  }
  if (is_flow_indicator(c0) || c0 == '#' || c0 == '&' || c0 == '*' || c0 == '!' || c0 == '|' ||
      c0 == '>' || c0 == '%' || c0 == '@' || c0 == '`' || starts_sequence_entry(r) || r == "?" ||
      r.starts_with("? ")) {
    return std::string_view::npos;
  }
  for (size_t i = 0; i < r.size(); ++i) {
    if (r[i] == '#' && i > 0 && r[i - 1] == ' ') return std::string_view::npos;
    if (r[i] == ':' && (i + 1 == r.size() || r[i + 1] == ' ')) return i;
  }
  return std::string_view::npos;
}

Result<json> Parser::run(std::string_view text) {
  if (text.size() > limits_.max_bytes) {
    return make_error(EFBIG, "{}: {} bytes (at most {})", what_, text.size(), limits_.max_bytes);
  }
  if (text.starts_with("\xEF\xBB\xBF")) text.remove_prefix(3);
  if (!is_valid_utf8(text)) return make_error(EINVAL, "{}: not UTF-8 text", what_);
  // YAML 1.1 (PyYAML) breaks lines at NEL, LS and PS too; a config has no use for them, so a
  // document holding one raw is refused rather than read with other line breaks than PyYAML's.
  for (std::string_view brk : {"\xC2\x85", "\xE2\x80\xA8", "\xE2\x80\xA9"}) {
    if (const size_t at = text.find(brk); at != std::string_view::npos) {
      li_ =
          static_cast<size_t>(std::count(text.begin(), text.begin() + static_cast<long>(at), '\n'));
      return fail("a YAML 1.1 line break other than LF (U+0085, U+2028, U+2029) is not read");
    }
  }
  for (size_t b = 0; b < text.size() || lines_.empty();) {  // no line after a final break
    size_t e = text.find('\n', b);
    if (e == std::string_view::npos) e = text.size();
    std::string_view t = text.substr(b, e - b);
    if (t.ends_with('\r')) t.remove_suffix(1);
    Line l;
    l.text = t;
    size_t i = 0;
    while (i < t.size() && t[i] == ' ') ++i;
    if (i > kMaxIndent && i < t.size()) {
      li_ = lines_.size();
      return fail("indented more than {} columns", kMaxIndent);
    }
    l.indent = static_cast<int>(std::min(i, kMaxIndent));
    size_t j = i;
    while (j < t.size() && (t[j] == ' ' || t[j] == '\t')) ++j;
    l.empty = j == t.size();
    l.comment = !l.empty && t[j] == '#';
    for (char c : t) {
      const auto u = static_cast<unsigned char>(c);
      if ((u < 0x20 && c != '\t') || u == 0x7F) {
        li_ = lines_.size();
        return fail("a control character (0x{:02x})", u);
      }
    }
    if (!l.empty && !l.comment && j > i) {
      li_ = lines_.size();
      return fail("a tab in the indentation");
    }
    if (lines_.size() >= limits_.max_lines) {
      return make_error(EFBIG, "{}: more than {} lines", what_, limits_.max_lines);
    }
    lines_.push_back(l);
    if (e == text.size()) break;
    b = e + 1;
  }
  // Directives, then at most one "---".
  li_ = 0;
  while (!at_eof() && (lines_[li_].empty || lines_[li_].comment)) ++li_;
  while (!at_eof() && line().starts_with('%')) {
    ++li_;
    while (!at_eof() && (lines_[li_].empty || lines_[li_].comment)) ++li_;
  }
  col_ = at_eof() ? 0 : static_cast<size_t>(lines_[li_].indent);
  json root(nullptr);
  bool have_root = false;
  const auto marker = [](std::string_view t, std::string_view m) {
    return t == m || (t.starts_with(m) && (t[m.size()] == ' '));
  };
  if (!at_eof() && marker(line(), "---")) {
    col_ = 3;
    skip_spaces();
    if (rest_is_empty()) {
      next_content_line();
    } else {
      CKPTFS_TRY(root, inline_value(-1, 0));
      have_root = true;
    }
  }
  if (!at_eof() && !have_root && !marker(line(), "...") && !marker(line(), "---")) {
    CKPTFS_TRY(root, block_node(-1, 0));
  }
  if (!at_eof() && marker(line(), "...")) {
    next_content_line();
    if (!at_eof()) return fail("more than one document");
  }
  if (!at_eof()) {
    if (marker(line(), "---")) return fail("more than one document");
    return fail("unexpected text (indentation?): '{}'", printable(line().substr(0, 40)));
  }
  return root;
}

// A node on its own line(s): the cursor at the first content of a line indented past `parent`.
Result<json> Parser::block_node(int parent, size_t depth) {
  const int indent = lines_[li_].indent;
  if (indent <= parent) return json(nullptr);
  col_ = static_cast<size_t>(indent);
  if (starts_sequence_entry(rest())) return block_seq(indent, depth + 1);
  if (key_colon(rest()) != std::string_view::npos || starts_complex_key(rest())) {
    return block_map(indent, depth + 1);
  }
  return inline_value(parent, depth);
}

Result<std::string> Parser::block_key() {
  const std::string_view r = rest();
  const size_t colon = key_colon(r);
  if (colon == std::string_view::npos) return fail("expected a mapping key");
  std::string key;
  if (r[0] == '\'' || r[0] == '"') {
    const size_t at = li_;
    CKPTFS_TRY(key, quoted(r[0]));
    if (li_ != at) return fail("a quoted key over more than one line");
    skip_spaces();
  } else {
    std::string_view k = r.substr(0, colon);
    while (!k.empty() && k.back() == ' ') k.remove_suffix(1);
    if (k == "<<") return fail("a merge key ('<<') is not read");
    key = std::string(k);
    col_ += colon;
  }
  CKPTFS_CHECK(check_scalar(key));
  if (col_ >= line().size() || line()[col_] != ':') return fail("expected ':' after a key");
  ++col_;
  return key;
}

Result<json> Parser::block_map(int indent, size_t depth) {
  CKPTFS_CHECK(enter(depth));
  CKPTFS_CHECK(count_node());
  json out = json::object();
  for (;;) {
    std::string key;
    json v(nullptr);
    if (starts_complex_key(rest())) {
      // `? KEY` then `: VALUE` at the same column: safe_dump writes an empty key, one with a
      // line break, one over 128 characters or one in a block style so. A key must be a scalar.
      const size_t at = li_;
      ++col_;
      CKPTFS_TRY(json k, value_after_indicator(indent, depth, {false, true}));
      if (k.is_structured()) {
        li_ = at;
        return fail("a complex key that is a collection is not read");
      }
      key = k.is_string() ? k.get<std::string>() : k.dump();
      if (out.contains(key)) return fail("duplicate key '{}'", printable(key.substr(0, 64)));
      if (!at_eof() && lines_[li_].indent == indent) {
        col_ = static_cast<size_t>(indent);
        if (rest() == ":" || rest().starts_with(": ")) {
          ++col_;
          CKPTFS_TRY(v, value_after_indicator(indent, depth, {true, true}));
        }
      }
      if (v.is_null()) CKPTFS_CHECK(count_node());
    } else {
      CKPTFS_TRY(key, block_key());
      if (out.contains(key)) return fail("duplicate key '{}'", printable(key.substr(0, 64)));
      CKPTFS_TRY(v, value_after_indicator(indent, depth, {true, false}));
    }
    out[std::move(key)] = std::move(v);
    if (at_eof() || lines_[li_].indent < indent) break;
    if (lines_[li_].indent > indent) return fail("bad indentation of a mapping entry");
    col_ = static_cast<size_t>(indent);
    if (starts_sequence_entry(rest())) {
      return fail("a sequence entry where a mapping key was expected");
    }
    if (line().starts_with("---") || line().starts_with("...")) break;
  }
  return out;
}

Result<json> Parser::block_seq(int indent, size_t depth) {
  CKPTFS_CHECK(enter(depth));
  CKPTFS_CHECK(count_node());
  json out = json::array();
  for (;;) {
    col_ = static_cast<size_t>(indent) + 1;  // past '-'
    CKPTFS_TRY(json v, value_after_indicator(indent, depth, {false, true}));
    out.push_back(std::move(v));
    if (at_eof() || lines_[li_].indent != indent) break;
    col_ = static_cast<size_t>(indent);
    if (!starts_sequence_entry(rest())) break;  // an indentless sequence ends; its map goes on
  }
  if (!at_eof() && lines_[li_].indent > indent) return fail("bad indentation of a sequence entry");
  return out;
}

// The value after a key's ':' or an entry's '-' (the cursor just past it). `indent` is that
// key's or entry's column.
Result<json> Parser::value_after_indicator(int indent, size_t depth, After after) {
  skip_spaces();
  const size_t before = nodes_;
  CKPTFS_TRY(Props props, properties());
  json v(nullptr);
  const auto untagged = [&]() -> Status {
    if (props.tag) return fail("a tag on a collection is not read");
    return {};
  };
  if (rest_is_empty()) {
    const size_t at = li_;
    next_content_line();
    if (!at_eof() && lines_[li_].indent > indent) {
      if (props.tag) {
        li_ = at;
        return fail("a tag on a collection is not read");
      }
      CKPTFS_TRY(v, block_node(indent, depth));
    } else if (after.indentless && !at_eof() && lines_[li_].indent == indent &&
               starts_sequence_entry(lines_[li_].text.substr(static_cast<size_t>(indent)))) {
      col_ = static_cast<size_t>(indent);
      CKPTFS_CHECK(untagged());
      CKPTFS_TRY(v, block_seq(indent, depth + 1));  // PyYAML's indentless sequence
    } else {
      CKPTFS_CHECK(count_node());
      CKPTFS_TRY(v, scalar("", true, props.tag, at));  // an empty node: null, or "" as !!str
    }
  } else if (after.inline_collection && starts_sequence_entry(rest())) {
    CKPTFS_CHECK(untagged());
    CKPTFS_TRY(v, block_seq(static_cast<int>(col_), depth + 1));
  } else if (after.inline_collection &&
             (key_colon(rest()) != std::string_view::npos || starts_complex_key(rest()))) {
    CKPTFS_CHECK(untagged());
    CKPTFS_TRY(v, block_map(static_cast<int>(col_), depth + 1));
  } else {
    return inline_value(indent, depth, std::move(props));
  }
  remember(props.anchor, v, before);
  return v;
}

// `&anchor` (kept) and a tag: the core scalar tags PyYAML writes where a style would change a
// value's type (`!!int "5"`) are read; any other tag (`!!python/...`, `!local`) is refused.
Result<Parser::Props> Parser::properties() {
  Props p;
  for (;;) {
    const std::string_view r = rest();
    if (r.starts_with('!')) {
      if (p.tag) return fail("two tags on one node");
      const size_t n = property_end(r);
      const std::string_view t = r.substr(0, n);
      static constexpr std::pair<std::string_view, char> kCore[] = {
          {"!!str", 's'}, {"!!int", 'i'}, {"!!float", 'f'}, {"!!bool", 'b'}, {"!!null", 'n'}};
      for (const auto& [name, k] : kCore) {
        if (t == name) p.tag = k;
      }
      if (!p.tag) return fail("a tag ('{}') is not read", printable(t.substr(0, 64)));
      col_ += n;
      skip_spaces();
      continue;
    }
    if (!r.starts_with('&')) return p;
    if (p.anchor) return fail("two anchors on one node");
    const size_t n = property_end(r);
    if (n == 1) return fail("an anchor with no name");
    p.anchor = std::string(r.substr(1, n - 1));
    CKPTFS_CHECK(check_scalar(*p.anchor));
    col_ += n;
    skip_spaces();
  }
}

Result<json> Parser::alias() {
  const std::string_view r = rest();
  const size_t n = property_end(r);
  auto it = anchors_.find(r.substr(1, n - 1));
  if (it == anchors_.end()) return fail("an alias of no anchor ('{}')", printable(r.substr(0, n)));
  nodes_ += it->second.nodes;
  if (nodes_ > limits_.max_nodes) {
    return make_error(EFBIG, "{}: more than {} nodes (aliases included)", what_, limits_.max_nodes);
  }
  col_ += n;
  return it->second.value;
}

Result<json> Parser::inline_value(int parent, size_t depth, Props props) {
  const size_t before = nodes_;
  CKPTFS_TRY(Props more, properties());
  if ((more.anchor && props.anchor) || (more.tag && props.tag)) return fail("two anchors or tags");
  if (more.anchor) props.anchor = std::move(more.anchor);
  if (more.tag) props.tag = more.tag;
  const std::string_view r = rest();
  json v;
  if (r.empty() || r[0] == '#') {  // `--- !!str`: an empty node
    CKPTFS_CHECK(count_node());
    CKPTFS_TRY(v, scalar("", true, props.tag, li_));
    CKPTFS_CHECK(end_of_value_line());
    remember(props.anchor, v, before);
    return v;
  }
  const char c = r[0];
  if (props.tag && (c == '*' || c == '[' || c == '{'))
    return fail("a tag on a collection is not read");
  if (c == '*') {
    if (props.anchor) return fail("an anchor on an alias");
    CKPTFS_TRY(v, alias());
    CKPTFS_CHECK(end_of_value_line());
  } else if (c == '[' || c == '{') {
    CKPTFS_TRY(v, flow_node(depth + 1));
    CKPTFS_CHECK(end_of_value_line());
  } else if (c == '"' || c == '\'') {
    CKPTFS_CHECK(count_node());
    const size_t at = li_;
    CKPTFS_TRY(std::string s, quoted(c));
    CKPTFS_CHECK(end_of_value_line());
    CKPTFS_TRY(v, scalar(std::move(s), false, props.tag, at));
  } else if (c == '|' || c == '>') {
    const size_t at = li_;
    CKPTFS_TRY(std::string s, block_scalar(parent));
    CKPTFS_TRY(v, scalar(std::move(s), false, props.tag, at));
  } else if (c == '%' || c == '@' || c == '`' || is_flow_indicator(c) || starts_sequence_entry(r)) {
    return fail("a value may not start with '{}'", c);
  } else {
    const size_t at = li_;
    CKPTFS_TRY(std::string s, plain_block(parent));
    CKPTFS_TRY(v, scalar(std::move(s), true, props.tag, at));
  }
  remember(props.anchor, v, before);
  return v;
}

// A plain scalar in block context, folded over the more indented lines after it: its text.
Status Parser::skip_flow_space() {
  for (;;) {
    if (at_eof()) return fail("an unterminated flow collection");
    skip_spaces();
    while (col_ < line().size() && line()[col_] == '\t') ++col_;
    if (col_ < line().size() && line()[col_] != '#') return {};
    ++li_;
    col_ = 0;
  }
}

Result<std::string> Parser::flow_plain() {
  std::string out;
  for (;;) {
    const std::string_view r = rest();
    size_t n = 0;
    bool ended = false;  // by an indicator or a comment, not the end of the line
    for (; n < r.size(); ++n) {
      const char c = r[n];
      if (is_flow_indicator(c) || (c == '#' && n > 0 && r[n - 1] == ' ') ||
          (c == ':' && (n + 1 == r.size() || r[n + 1] == ' ' || is_flow_indicator(r[n + 1])))) {
        ended = true;
        break;
      }
    }
    std::string_view t = r.substr(0, n);
    while (!t.empty() && (t.back() == ' ' || t.back() == '\t')) t.remove_suffix(1);
    out += t;
    col_ += n;
    CKPTFS_CHECK(check_scalar(out));
    if (ended || out.empty()) break;
    // Folded onto the next line unless that line goes on with an indicator.
    size_t next = li_ + 1, empties = 0;
    while (next < lines_.size() && lines_[next].empty) ++next, ++empties;
    if (next >= lines_.size()) break;
    const std::string_view nt = lines_[next].text;
    const size_t b = nt.find_first_not_of(" \t");
    const char c = nt[b];
    if (is_flow_indicator(c) || c == '#' ||
        (c == ':' && (b + 1 == nt.size() || nt[b + 1] == ' ' || is_flow_indicator(nt[b + 1])))) {
      break;
    }
    if (empties == 0) {
      out += ' ';
    } else {
      out.append(empties, '\n');
    }
    li_ = next;
    col_ = b;
  }
  if (out.empty()) return fail("expected a value in a flow collection");
  return out;
}

Result<json> Parser::flow_node(size_t depth) {
  CKPTFS_CHECK(skip_flow_space());
  const size_t before = nodes_;
  CKPTFS_TRY(Props props, properties());
  CKPTFS_CHECK(skip_flow_space());
  const char c = line()[col_];
  const size_t at = li_;
  json v;
  if (props.tag && (c == '[' || c == '{' || c == '*'))
    return fail("a tag on a collection is not read");
  if (c == '[' || c == '{') {
    CKPTFS_CHECK(enter(depth));
    CKPTFS_CHECK(count_node());
    const bool seq = c == '[';
    const char close = seq ? ']' : '}';
    v = seq ? json::array() : json::object();
    ++col_;
    for (;;) {
      CKPTFS_CHECK(skip_flow_space());
      if (line()[col_] == close) {
        ++col_;
        break;
      }
      if (seq) {
        CKPTFS_TRY(json item, flow_node(depth + 1));
        CKPTFS_CHECK(skip_flow_space());
        if (line()[col_] == ':') return fail("a mapping pair inside a flow sequence");
        v.push_back(std::move(item));
      } else {
        CKPTFS_CHECK(count_node());
        std::string key;
        if (starts_complex_key(rest())) {  // `? KEY : VALUE`
          ++col_;
          CKPTFS_CHECK(skip_flow_space());
        }
        const char k = line()[col_];
        if (k == '"' || k == '\'') {
          CKPTFS_TRY(key, quoted(k));
        } else if (k == '[' || k == '{' || k == '*' || k == '&' || k == '!' || k == '?') {
          return fail("a key in a flow mapping must be a scalar");
        } else {
          CKPTFS_TRY(key, flow_plain());
        }
        if (key == "<<") return fail("a merge key ('<<') is not read");
        if (v.contains(key)) return fail("duplicate key '{}'", printable(key.substr(0, 64)));
        CKPTFS_CHECK(skip_flow_space());
        json val(nullptr);
        if (line()[col_] == ':') {
          ++col_;
          CKPTFS_CHECK(skip_flow_space());
          if (line()[col_] != ',' && line()[col_] != '}') {
            CKPTFS_TRY(val, flow_node(depth + 1));
          } else {
            CKPTFS_CHECK(count_node());
          }
        } else {
          CKPTFS_CHECK(count_node());
        }
        v[std::move(key)] = std::move(val);
      }
      CKPTFS_CHECK(skip_flow_space());
      if (line()[col_] == ',') {
        ++col_;
      } else if (line()[col_] != close) {
        return fail("expected ',' or '{}' in a flow collection", close);
      }
    }
  } else if (c == '"' || c == '\'') {
    CKPTFS_CHECK(count_node());
    CKPTFS_TRY(std::string s, quoted(c));
    CKPTFS_TRY(v, scalar(std::move(s), false, props.tag, at));
  } else if (c == '*') {
    if (props.anchor) return fail("an anchor on an alias");
    CKPTFS_TRY(v, alias());
  } else if (c == ']' || c == '}' || c == ',') {
    return fail("expected a value in a flow collection, found '{}'", c);
  } else {
    CKPTFS_CHECK(count_node());
    CKPTFS_TRY(std::string s, flow_plain());
    CKPTFS_TRY(v, scalar(std::move(s), true, props.tag, at));
  }
  remember(props.anchor, v, before);
  return v;
}

}  // namespace yaml_detail

Result<nlohmann::json> parse_yaml(std::string_view text, std::string_view what,
                                  const YamlLimits& limits) {
  yaml_detail::Parser p(what, limits);
  return p.run(text);
}

}  // namespace ckptfs::format
