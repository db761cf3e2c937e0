// format/yaml's scalars: plain, quoted and block scalars' text, and their values as PyYAML's
// SafeLoader gives them (resolution, the core tags).
#include <charconv>
#include <cmath>
#include <limits>

#include "ckptfs/util/text.hpp"
#include "yaml_parser.hpp"

namespace ckptfs::format::yaml_detail {
namespace {

bool is_digit(char c) { return c >= '0' && c <= '9'; }

// Digits (and '_') of `base` from s[i]; at least one. Advances i.
bool digits(std::string_view s, size_t& i, int base) {
  const size_t b = i;
  for (; i < s.size(); ++i) {
    const char c = s[i];
    const bool ok =
        c == '_' || (base == 2 && (c == '0' || c == '1')) || (base == 8 && c >= '0' && c <= '7') ||
        (base == 10 && is_digit(c)) ||
        (base == 16 && (is_digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F')));
    if (!ok) break;
  }
  return i > b;
}

std::string without_underscores(std::string_view s) {
  std::string out;
  for (char c : s) {
    if (c != '_') out += c;
  }
  return out;
}

// ":[0-5]?[0-9]" groups from s[i] to the end (sexagesimal); at least one. `tail` allows a
// fraction after the last group (`\.[0-9_]*`, the float form).
bool sexagesimal_groups(std::string_view s, size_t i, bool tail) {
  size_t groups = 0;
  while (i < s.size() && s[i] == ':') {
    ++i;
    size_t n = 0;
    while (i < s.size() && is_digit(s[i]) && n < 2) ++i, ++n;
    if (n == 0 || (n == 2 && s[i - 2] > '5')) return false;
    ++groups;
  }
  if (tail && i < s.size() && s[i] == '.') {
    ++i;
    while (i < s.size() && (is_digit(s[i]) || s[i] == '_')) ++i;
  }
  return groups > 0 && i == s.size();
}

// "190:20:30" as 190 * 3600 + 20 * 60 + 30 (digits and ':' only, checked before).
long double sexagesimal_value(std::string_view s) {
  long double v = 0, part = 0;
  for (char c : s) {
    if (c == ':') {
      v = v * 60 + part;
      part = 0;
    } else {
      part = part * 10 + (c - '0');
    }
  }
  return v * 60 + part;
}

json number(long double v, bool integral) {
  if (integral && v >= static_cast<long double>(std::numeric_limits<int64_t>::min()) &&
      v <= static_cast<long double>(std::numeric_limits<int64_t>::max())) {
    return json(static_cast<int64_t>(v));
  }
  if (integral && v >= 0 && v <= static_cast<long double>(std::numeric_limits<uint64_t>::max())) {
    return json(static_cast<uint64_t>(v));
  }
  const auto d = static_cast<double>(v);
  if (!std::isfinite(d)) return json(nullptr);  // no JSON for it
  return json(d);
}

std::optional<json> resolve_int(std::string_view s) {
  size_t i = 0;
  bool neg = false;
  if (i < s.size() && (s[i] == '-' || s[i] == '+')) neg = s[i++] == '-';
  const std::string_view body = s.substr(i);
  if (body.empty()) return std::nullopt;
  int base = 10;
  size_t j = 0;
  if (body.starts_with("0b")) {
    base = 2, j = 2;
  } else if (body.starts_with("0x")) {
    base = 16, j = 2;
  } else if (body.size() > 1 && body[0] == '0') {
    base = 8, j = 1;
  } else if (body[0] == '0') {
    return json(int64_t{0});
  } else if (!(body[0] >= '1' && body[0] <= '9')) {
    return std::nullopt;
  }
  size_t k = j;
  if (!digits(body, k, base)) return std::nullopt;
  long double v = 0;
  if (k < body.size()) {  // sexagesimal: [1-9][0-9_]*(:[0-5]?[0-9])+
    if (base != 10 || !sexagesimal_groups(body, k, false)) return std::nullopt;
    v = sexagesimal_value(without_underscores(body));
  } else {
    for (char c : without_underscores(body.substr(j))) {
      const int d = is_digit(c) ? c - '0' : (c | 0x20) - 'a' + 10;
      v = v * base + d;
    }
  }
  return number(neg ? -v : v, true);
}

std::optional<json> resolve_float(std::string_view s) {
  size_t i = 0;
  bool neg = false;
  const bool signed_ = i < s.size() && (s[i] == '-' || s[i] == '+');
  if (signed_) neg = s[i++] == '-';
  const std::string_view body = s.substr(i);
  for (std::string_view inf : {".inf", ".Inf", ".INF"}) {
    if (body == inf) return json(nullptr);
  }
  for (std::string_view nan : {".nan", ".NaN", ".NAN"}) {
    if (s == nan) return json(nullptr);
  }
  size_t k = 0;
  const bool lead = digits(body, k, 10) && is_digit(body[0]);
  if (!lead && (signed_ || body.empty() || body[0] != '.')) return std::nullopt;
  if (lead && k < body.size() && body[k] == ':') {  // sexagesimal: 190:20:30.15
    if (!sexagesimal_groups(body, k, true) || body.find('.') == std::string_view::npos) {
      return std::nullopt;
    }
    long double v = 0;
    const std::string clean = without_underscores(body);
    const size_t dot = clean.find('.');
    v = sexagesimal_value(std::string_view(clean).substr(0, dot));
    double frac = 0;
    std::string f = "0";  // appended, not "0" + ...: g++ 12 -O3 warns (-Wrestrict) on that
    f.append(clean, dot);
    std::from_chars(f.data(), f.data() + f.size(), frac);
    return number(neg ? -(v + frac) : v + frac, false);
  }
  if (k >= body.size() || body[k] != '.') return std::nullopt;
  ++k;
  const size_t frac_from = k;
  while (k < body.size() && (is_digit(body[k]) || body[k] == '_')) ++k;
  if (!lead && k == frac_from) return std::nullopt;  // "." alone
  if (k < body.size()) {  // [eE][-+][0-9]+: the exponent's sign is required
    if ((body[k] != 'e' && body[k] != 'E') || k + 2 >= body.size() ||
        (body[k + 1] != '-' && body[k + 1] != '+')) {
      return std::nullopt;
    }
    k += 2;
    const size_t e = k;
    while (k < body.size() && is_digit(body[k])) ++k;
    if (k == e || k != body.size()) return std::nullopt;
  }
  std::string clean = neg ? "-" : "";
  clean += without_underscores(body);
  double d = 0;
  const auto r = std::from_chars(clean.data(), clean.data() + clean.size(), d);
  if (r.ec == std::errc::result_out_of_range) return json(nullptr);
  if (r.ec != std::errc() || !std::isfinite(d)) return json(nullptr);
  return json(d);
}

// A plain scalar's value, as PyYAML's SafeLoader (YAML 1.1) resolves it: null, a bool, an int
// (decimal, 0x, 0b, 0-octal, sexagesimal, '_'), a float (a dot required; an exponent's sign
// too), or the text; a non-finite float is null.
json resolve_plain(std::string_view s) {
  if (s.empty() || s == "~" || s == "null" || s == "Null" || s == "NULL") return json(nullptr);
  for (std::string_view t : {"yes", "Yes", "YES", "true", "True", "TRUE", "on", "On", "ON"}) {
    if (s == t) return json(true);
  }
  for (std::string_view f : {"no", "No", "NO", "false", "False", "FALSE", "off", "Off", "OFF"}) {
    if (s == f) return json(false);
  }
  if (auto v = resolve_int(s)) return std::move(*v);
  if (auto v = resolve_float(s)) return std::move(*v);
  return json(std::string(s));
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

}  // namespace

// A scalar's value: plain text resolved as SafeLoader resolves it, quoted and block text a
// string, and a core tag's type as PyYAML constructs it.
Result<json> Parser::scalar(std::string raw, bool plain, char tag, size_t line) const {
  switch (tag) {
    case 0:
      return plain ? resolve_plain(raw) : json(std::move(raw));
    case 's':
      return json(std::move(raw));
    case 'n':
      return json(nullptr);
    case 'b': {
      std::string low = raw;
      for (char& c : low) c = static_cast<char>(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
      if (low == "yes" || low == "true" || low == "on") return json(true);
      if (low == "no" || low == "false" || low == "off") return json(false);
      break;
    }
    case 'i':
      if (auto v = resolve_int(raw)) return std::move(*v);
      break;
    default: {  // 'f'
      if (auto v = resolve_float(raw)) return std::move(*v);
      if (auto v = resolve_int(raw)) return json(v->get<double>());
      const std::string clean = without_underscores(raw);
      double d = 0;
      const auto r = std::from_chars(clean.data(), clean.data() + clean.size(), d);
      if (r.ptr == clean.data() + clean.size() && r.ec == std::errc() && !clean.empty()) {
        return std::isfinite(d) ? json(d) : json(nullptr);
      }
      break;
    }
  }
  return make_error(EINVAL, "{}: line {}: '{}' is not a value of its tag", what_, line + 1,
                    printable(raw.substr(0, 40)));
}

Result<std::string> Parser::plain_block(int parent) {
  CKPTFS_CHECK(count_node());
  std::string out;
  const auto take = [&](std::string_view t) -> Status {
    size_t end = t.size();
    for (size_t i = 0; i < t.size(); ++i) {
      if (t[i] == '#' && i > 0 && t[i - 1] == ' ') {
        end = i;
        break;
      }
      if (t[i] == ':' && (i + 1 == t.size() || t[i + 1] == ' ')) {
        return fail("a mapping value is not allowed here ('{}')", printable(t.substr(0, 40)));
      }
    }
    t = t.substr(0, end);
    while (!t.empty() && (t.back() == ' ' || t.back() == '\t')) t.remove_suffix(1);
    out += t;
    return check_scalar(out);
  };
  CKPTFS_CHECK(take(rest()));
  bool commented = rest().find(" #") != std::string_view::npos;
  size_t breaks = 0;
  ++li_;
  while (!commented && !at_eof()) {
    const Line& l = lines_[li_];
    if (l.empty) {
      ++breaks, ++li_;
      continue;
    }
    if (l.comment || l.indent <= parent) break;
    if (l.text.starts_with("---") || l.text.starts_with("...")) break;
    if (breaks == 0) {
      out += ' ';
    } else {
      out.append(breaks, '\n');
    }
    breaks = 0;
    col_ = static_cast<size_t>(l.indent);
    CKPTFS_CHECK(take(rest()));
    commented = rest().find(" #") != std::string_view::npos;
    ++li_;
  }
  while (!at_eof() && (lines_[li_].empty || lines_[li_].comment)) ++li_;
  col_ = at_eof() ? 0 : static_cast<size_t>(lines_[li_].indent);
  return out;
}

// A single- or double-quoted scalar from the cursor (at its quote), over lines; the cursor ends
// just past the closing quote.
Result<std::string> Parser::quoted(char q) {
  std::string out;
  size_t keep = 0;  // out's length without the spaces before a line break
  ++col_;
  for (;;) {
    if (at_eof()) return fail("an unterminated quoted scalar");
    if (col_ >= line().size()) {  // a line break inside: folded
      out.resize(keep);
      size_t empties = 0;
      ++li_;
      while (!at_eof() && lines_[li_].empty) ++empties, ++li_;
      if (at_eof()) return fail("an unterminated quoted scalar");
      if (line().starts_with("---") || line().starts_with("...")) {
        return fail("a document marker inside a quoted scalar");
      }
      col_ = 0;
      while (col_ < line().size() && (line()[col_] == ' ' || line()[col_] == '\t')) ++col_;
      if (empties == 0) {
        out += ' ';
      } else {
        out.append(empties, '\n');
      }
      keep = out.size();
      continue;
    }
    const char c = line()[col_];
    if (c == q) {
      if (q == '\'' && col_ + 1 < line().size() && line()[col_ + 1] == '\'') {
        out += '\'';
        col_ += 2;
        keep = out.size();
        continue;
      }
      ++col_;
      break;
    }
    if (q == '"' && c == '\\') {
      if (col_ + 1 >= line().size()) {  // an escaped line break: joined with nothing
        ++li_;
        if (at_eof()) return fail("an unterminated quoted scalar");
        col_ = 0;
        while (col_ < line().size() && (line()[col_] == ' ' || line()[col_] == '\t')) ++col_;
        keep = out.size();
        continue;
      }
      const char e = line()[col_ + 1];
      col_ += 2;
      int hex = 0;
      switch (e) {
        case '0':
          out += '\0';
          break;
        case 'a':
          out += '\a';
          break;
        case 'b':
          out += '\b';
          break;
        case 't':
        case '\t':
          out += '\t';
          break;
        case 'n':
          out += '\n';
          break;
        case 'v':
          out += '\v';
          break;
        case 'f':
          out += '\f';
          break;
        case 'r':
          out += '\r';
          break;
        case 'e':
          out += '\x1b';
          break;
        case ' ':
          out += ' ';
          break;
        case '"':
          out += '"';
          break;
        case '/':
          out += '/';
          break;
        case '\\':
          out += '\\';
          break;
        case 'N':
          append_utf8(out, 0x85);
          break;
        case '_':
          append_utf8(out, 0xA0);
          break;
        case 'L':
          append_utf8(out, 0x2028);
          break;
        case 'P':
          append_utf8(out, 0x2029);
          break;
        case 'x':
          hex = 2;
          break;
        case 'u':
          hex = 4;
          break;
        case 'U':
          hex = 8;
          break;
        default:
          return fail("an unknown escape '\\{}'", printable(std::string_view(&e, 1)));
      }
      if (hex) {
        const std::string_view h = line().substr(col_, static_cast<size_t>(hex));
        uint32_t cp = 0;
        const auto r = std::from_chars(h.data(), h.data() + h.size(), cp, 16);
        if (h.size() != static_cast<size_t>(hex) || r.ptr != h.data() + h.size() || cp > 0x10FFFF ||
            (cp >= 0xD800 && cp <= 0xDFFF)) {
          return fail("a bad escape '\\{}{}'", e, printable(h));
        }
        append_utf8(out, cp);
        col_ += static_cast<size_t>(hex);
      }
      keep = out.size();
    } else {
      out += c;
      ++col_;
      if (c != ' ' && c != '\t') keep = out.size();
    }
    CKPTFS_CHECK(check_scalar(out));
  }
  return out;
}

// `|` or `>` with its chomping (`-`, `+`) and indentation indicator; the lines indented past
// `parent` after it: its text.
Result<std::string> Parser::block_scalar(int parent) {
  CKPTFS_CHECK(count_node());
  const bool literal = line()[col_] == '|';
  ++col_;
  char chomp = 'c';
  int explicit_indent = 0;
  for (int k = 0; k < 2 && col_ < line().size(); ++k) {
    const char c = line()[col_];
    if ((c == '-' || c == '+') && chomp == 'c') {
      chomp = c;
      ++col_;
    } else if (c >= '1' && c <= '9' && explicit_indent == 0) {
      explicit_indent = c - '0';
      ++col_;
    }
  }
  if (!rest_is_empty()) return fail("text after a block scalar's header");
  ++li_;
  int content = explicit_indent ? std::max(parent, 0) + explicit_indent : -1;
  std::vector<std::string_view> lines;
  for (; !at_eof(); ++li_) {
    const Line& l = lines_[li_];
    if (l.empty) {
      lines.push_back(content >= 0 && l.text.size() > static_cast<size_t>(content)
                          ? l.text.substr(static_cast<size_t>(content))
                          : std::string_view());
      continue;
    }
    if (content < 0) {
      if (l.indent <= parent) break;
      content = l.indent;
    }
    if (l.indent < content) break;
    lines.push_back(l.text.substr(static_cast<size_t>(content)));
  }
  size_t trailing = 0;
  while (!lines.empty() && lines.back().find_first_not_of(' ') == std::string_view::npos) {
    lines.pop_back();
    ++trailing;
  }
  std::string out;
  bool prev_normal = false, have = false;
  size_t empties = 0;  // empty lines since the last content line
  for (const std::string_view s : lines) {
    if (s.empty()) {
      ++empties;
      continue;
    }
    const bool normal = s[0] != ' ' && s[0] != '\t';
    if (!have) {
      out.append(empties, '\n');
    } else if (!literal && prev_normal && normal) {  // folded: a break between two lines
      if (empties == 0) {
        out += ' ';
      } else {
        out.append(empties, '\n');
      }
    } else {
      out.append(1 + empties, '\n');
    }
    out += s;
    empties = 0;
    have = true;
    prev_normal = normal;
    CKPTFS_CHECK(check_scalar(out));
  }
  if (!lines.empty() && chomp != '-') out += '\n';
  if (chomp == '+') out.append(trailing, '\n');
  CKPTFS_CHECK(check_scalar(out));
  while (!at_eof() && (lines_[li_].empty || lines_[li_].comment)) ++li_;
  col_ = at_eof() ? 0 : static_cast<size_t>(lines_[li_].indent);
  return out;
}

// Spaces, line breaks and comments inside a flow collection.
}  // namespace ckptfs::format::yaml_detail
