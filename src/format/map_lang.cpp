// format/map_lang: the small languages inside a model map: expressions, name patterns, rows.
#include "map_lang.hpp"

#include <algorithm>
#include <cctype>

#include <fmt/format.h>

#include "ckptfs/util/checked.hpp"

namespace ckptfs::format {
namespace detail {
namespace {

constexpr int kMaxExprDepth = 32;

// ---- expressions -------------------------------------------------------------------------

class ExprParser {
 public:
  ExprParser(std::string_view s, MapExpr& e) : s_(s), e_(e) {}

  Status parse() {
    for (;;) {
      e_.alts.emplace_back();
      prog_ = &e_.alts.back();
      CKPTFS_CHECK(sum(0));
      skip();
      if (pos_ == s_.size()) break;
      if (s_[pos_] != '|') return fail("unexpected '{}'", s_[pos_]);
      ++pos_;
    }
    return {};
  }

 private:
  template <typename... A>
  Error fail(fmt::format_string<A...> f, A&&... a) {
    return Error{EINVAL, fmt::format("expression '{}' at {}: {}", s_, pos_,
                                     fmt::format(f, std::forward<A>(a)...))};
  }
  void skip() {
    while (pos_ < s_.size() && s_[pos_] == ' ') ++pos_;
  }
  Status sum(int depth) {
    CKPTFS_CHECK(product(depth));
    for (;;) {
      skip();
      if (pos_ >= s_.size() || (s_[pos_] != '+' && s_[pos_] != '-')) return {};
      auto k = s_[pos_++] == '+' ? MapExpr::Op::Add : MapExpr::Op::Sub;
      CKPTFS_CHECK(product(depth));
      prog_->push_back({k, 0, 0});
    }
  }
  Status product(int depth) {
    CKPTFS_CHECK(atom(depth));
    for (;;) {
      skip();
      if (pos_ >= s_.size() || (s_[pos_] != '*' && s_[pos_] != '/')) return {};
      auto k = s_[pos_++] == '*' ? MapExpr::Op::Mul : MapExpr::Op::Div;
      CKPTFS_CHECK(atom(depth));
      prog_->push_back({k, 0, 0});
    }
  }
  Status atom(int depth) {
    if (depth > kMaxExprDepth) return fail("nested deeper than {}", kMaxExprDepth);
    skip();
    if (pos_ >= s_.size()) return fail("expected a number, a name or '('");
    const char c = s_[pos_];
    if (c == '(') {
      ++pos_;
      CKPTFS_CHECK(sum(depth + 1));
      skip();
      if (pos_ >= s_.size() || s_[pos_] != ')') return fail("expected ')'");
      ++pos_;
      return {};
    }
    if (std::isdigit(static_cast<unsigned char>(c))) {
      uint64_t v = 0;
      while (pos_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[pos_]))) {
        auto m = checked_mul(v, 10);
        auto a = m ? checked_add(*m, static_cast<uint64_t>(s_[pos_] - '0')) : std::nullopt;
        if (!a || *a > (uint64_t{1} << 62)) return fail("number too large");
        v = *a;
        ++pos_;
      }
      prog_->push_back({MapExpr::Op::Num, v, 0});
      return {};
    }
    if (is_ident_start(c)) {
      const size_t b = pos_;
      while (pos_ < s_.size() && (is_ident_char(s_[pos_]) || s_[pos_] == '.')) ++pos_;
      std::string name(s_.substr(b, pos_ - b));
      if (name.back() == '.') return fail("name '{}' ends with '.'", name);
      auto it = std::find(e_.names.begin(), e_.names.end(), name);
      if (it == e_.names.end()) {
        if (e_.names.size() >= kMaxExprNames) return fail("more than {} names", kMaxExprNames);
        e_.names.push_back(std::move(name));
        it = e_.names.end() - 1;
      }
      prog_->push_back({MapExpr::Op::Name, 0, static_cast<uint32_t>(it - e_.names.begin())});
      return {};
    }
    return fail("unexpected '{}'", c);
  }

  std::string_view s_;
  MapExpr& e_;
  std::vector<MapExpr::Op>* prog_ = nullptr;
  size_t pos_ = 0;
};

}  // namespace

Result<MapExpr> parse_expr(std::string_view s) {
  if (s.size() > kMaxExprChars) {
    return make_error(EINVAL, "expression of {} characters (at most {})", s.size(), kMaxExprChars);
  }
  MapExpr e;
  e.text = std::string(s);
  CKPTFS_CHECK(ExprParser(s, e).parse());
  return e;
}

// ---- patterns ----------------------------------------------------------------------------

Result<MapPattern> parse_pattern(std::string_view s, bool allow_star) {
  if (s.empty()) return make_error(EINVAL, "empty name pattern");
  if (s.size() > kMaxPatternChars) {
    return make_error(EINVAL, "name pattern of {} characters (at most {})", s.size(),
                      kMaxPatternChars);
  }
  MapPattern p;
  p.text = std::string(s);
  for (size_t i = 0; i < s.size();) {
    if (s[i] == '{') {
      const size_t end = s.find('}', i);
      if (end == std::string_view::npos) {
        return make_error(EINVAL, "pattern '{}': '{{' without '}}'", s);
      }
      std::string name(s.substr(i + 1, end - i - 1));
      if (name.empty() || !is_ident_start(name[0]) ||
          !std::all_of(name.begin(), name.end(), is_ident_char)) {
        return make_error(EINVAL, "pattern '{}': capture '{{{}}}' is not a name", s, name);
      }
      if (!p.pieces.empty() && p.pieces.back().kind != MapPattern::Piece::Lit) {
        return make_error(EINVAL, "pattern '{}': capture '{{{}}}' follows another capture or '*'",
                          s, name);
      }
      for (const auto& q : p.pieces) {
        if (q.kind == MapPattern::Piece::Cap && q.text == name) {
          return make_error(EINVAL, "pattern '{}': capture '{{{}}}' twice", s, name);
        }
      }
      p.pieces.push_back({MapPattern::Piece::Cap, std::move(name)});
      i = end + 1;
    } else if (s[i] == '*') {
      if (!allow_star) return make_error(EINVAL, "pattern '{}': '*' is allowed only in drop", s);
      if (!p.pieces.empty() && p.pieces.back().kind != MapPattern::Piece::Lit) {
        return make_error(EINVAL, "pattern '{}': '*' follows a capture or '*'", s);
      }
      p.pieces.push_back({MapPattern::Piece::Star, {}});
      ++i;
    } else if (s[i] == '}') {
      return make_error(EINVAL, "pattern '{}': '}}' without '{{'", s);
    } else {
      if (p.pieces.empty() || p.pieces.back().kind != MapPattern::Piece::Lit) {
        if (!p.pieces.empty() && p.pieces.back().kind == MapPattern::Piece::Cap &&
            std::isdigit(static_cast<unsigned char>(s[i]))) {
          return make_error(EINVAL, "pattern '{}': a digit right after a capture is ambiguous", s);
        }
        p.pieces.push_back({MapPattern::Piece::Lit, {}});
      }
      p.pieces.back().text.push_back(s[i]);
      ++i;
    }
  }
  return p;
}

// ---- rows --------------------------------------------------------------------------------

namespace {

class RowsParser {
 public:
  RowsParser(std::string_view s, MapRows& r) : s_(s), r_(r) {}

  Status parse() {
    const size_t arrow = s_.find("->");
    if (arrow == std::string_view::npos || s_.find("->", arrow + 2) != std::string_view::npos) {
      return fail("expected exactly one '->'");
    }
    CKPTFS_CHECK(lhs(s_.substr(0, arrow)));
    CKPTFS_CHECK(rhs(arrow + 2));
    std::vector<int> used(r_.names.size(), 0);
    for (const auto& g : r_.rhs) {
      for (const auto& o : g) ++used[o.axis];
    }
    for (size_t i = 0; i < used.size(); ++i) {
      if (used[i] != 1) {
        return fail(
            "axis '{}' appears {} times after '->' (exactly once: every row is kept or "
            "sliced, never repeated or summed)",
            r_.names[i], used[i]);
      }
    }
    if (r_.lhs.empty()) return fail("no axes before '->'");
    if (r_.rhs.empty()) return fail("no axes after '->'");
    return {};
  }

 private:
  template <typename... A>
  Error fail(fmt::format_string<A...> f, A&&... a) {
    return Error{EINVAL, fmt::format("rows '{}': {}", s_, fmt::format(f, std::forward<A>(a)...))};
  }
  static bool space(char c) { return c == ' '; }

  Result<std::string> ident(std::string_view s, size_t& i) {
    const size_t b = i;
    if (i >= s.size() || !is_ident_start(s[i])) return fail("expected an axis name");
    while (i < s.size() && is_ident_char(s[i])) ++i;
    return std::string(s.substr(b, i - b));
  }

  Status lhs(std::string_view s) {
    size_t i = 0;
    for (;;) {
      while (i < s.size() && space(s[i])) ++i;
      if (i >= s.size()) return {};
      std::vector<uint32_t> group;
      auto add = [&](std::string n) -> Status {
        if (std::find(r_.names.begin(), r_.names.end(), n) != r_.names.end()) {
          return fail("axis '{}' twice before '->'", n);
        }
        if (r_.names.size() >= kMaxRowsNames) return fail("more than {} axes", kMaxRowsNames);
        r_.names.push_back(std::move(n));
        group.push_back(static_cast<uint32_t>(r_.names.size() - 1));
        return {};
      };
      if (s[i] == '(') {
        ++i;
        for (;;) {
          while (i < s.size() && space(s[i])) ++i;
          if (i < s.size() && s[i] == ')') break;
          CKPTFS_TRY(auto n, ident(s, i));
          CKPTFS_CHECK(add(std::move(n)));
        }
        ++i;
        if (group.empty()) return fail("empty group '()'");
      } else {
        CKPTFS_TRY(auto n, ident(s, i));
        CKPTFS_CHECK(add(std::move(n)));
      }
      r_.lhs.push_back(std::move(group));
    }
  }

  Result<MapRows::Out> out_axis(size_t& i) {
    CKPTFS_TRY(auto n, ident(s_, i));
    auto it = std::find(r_.names.begin(), r_.names.end(), n);
    if (it == r_.names.end()) return fail("axis '{}' after '->' is not before it", n);
    MapRows::Out o;
    o.axis = static_cast<uint32_t>(it - r_.names.begin());
    if (i < s_.size() && s_[i] == '[') {
      const size_t end = s_.find(']', i);
      if (end == std::string_view::npos) return fail("'[' without ']'");
      std::string_view inner = s_.substr(i + 1, end - i - 1);
      const size_t colon = inner.find(':');
      if (colon == std::string_view::npos || inner.find(':', colon + 1) != std::string_view::npos) {
        return fail("slice '[{}]' is not 'lo:hi'", inner);
      }
      CKPTFS_TRY(o.lo, parse_expr(inner.substr(0, colon)));
      CKPTFS_TRY(o.hi, parse_expr(inner.substr(colon + 1)));
      i = end + 1;
    }
    return o;
  }

  Status rhs(size_t i) {
    for (;;) {
      while (i < s_.size() && space(s_[i])) ++i;
      if (i >= s_.size()) return {};
      std::vector<MapRows::Out> group;
      if (s_[i] == '(') {
        ++i;
        for (;;) {
          while (i < s_.size() && space(s_[i])) ++i;
          if (i < s_.size() && s_[i] == ')') break;
          CKPTFS_TRY(auto o, out_axis(i));
          group.push_back(std::move(o));
        }
        ++i;
        if (group.empty()) return fail("empty group '()'");
      } else {
        CKPTFS_TRY(auto o, out_axis(i));
        group.push_back(std::move(o));
      }
      r_.rhs.push_back(std::move(group));
    }
  }

  std::string_view s_;
  MapRows& r_;
};

}  // namespace

Result<MapRows> parse_rows(std::string_view s) {
  if (s.size() > kMaxExprChars * 2) {
    return make_error(EINVAL, "rows of {} characters (at most {})", s.size(), kMaxExprChars * 2);
  }
  MapRows r;
  r.text = std::string(s);
  CKPTFS_CHECK(RowsParser(s, r).parse());
  return r;
}

}  // namespace detail

std::vector<std::string> MapPattern::captures() const {
  std::vector<std::string> out;
  for (const auto& p : pieces) {
    if (p.kind == Piece::Cap) out.push_back(p.text);
  }
  return out;
}

Result<uint64_t> eval_expr(const MapExpr& e, const MapLookup& lookup) {
  for (const auto& prog : e.alts) {
    std::vector<uint64_t> st;
    st.reserve(prog.size());
    bool unknown = false;
    for (const auto& op : prog) {
      if (op.kind == MapExpr::Op::Num) {
        st.push_back(op.num);
        continue;
      }
      if (op.kind == MapExpr::Op::Name) {
        auto v = lookup(e.names[op.name]);
        if (!v) {
          unknown = true;
          break;
        }
        st.push_back(*v);
        continue;
      }
      if (st.size() < 2) return make_error(EINVAL, "expression '{}' is malformed", e.text);
      const uint64_t b = st.back();
      st.pop_back();
      const uint64_t a = st.back();
      std::optional<uint64_t> r;
      switch (op.kind) {
        case MapExpr::Op::Add:
          r = checked_add(a, b);
          break;
        case MapExpr::Op::Sub:
          if (a < b)
            return make_error(EINVAL, "expression '{}': {} - {} is negative", e.text, a, b);
          r = a - b;
          break;
        case MapExpr::Op::Mul:
          r = checked_mul(a, b);
          break;
        case MapExpr::Op::Div:
          if (b == 0 || a % b != 0) {
            return make_error(EINVAL, "expression '{}': {} / {} does not divide exactly", e.text, a,
                              b);
          }
          r = a / b;
          break;
        default:
          break;
      }
      if (!r || *r > (uint64_t{1} << 62)) {
        return make_error(EOVERFLOW, "expression '{}' overflows", e.text);
      }
      st.back() = *r;
    }
    if (unknown) continue;
    if (st.size() != 1) return make_error(EINVAL, "expression '{}' is malformed", e.text);
    return st[0];
  }
  std::vector<std::string> missing;
  for (const auto& n : e.names) {
    if (!lookup(n)) missing.push_back(n);
  }
  return make_error(ENOENT, "expression '{}': no value for {}", e.text, fmt::join(missing, ", "));
}

std::optional<std::vector<uint64_t>> match_pattern(const MapPattern& p, std::string_view name) {
  const bool star = std::any_of(p.pieces.begin(), p.pieces.end(),
                                [](const auto& q) { return q.kind == MapPattern::Piece::Star; });
  if (!star) {
    std::vector<uint64_t> vals;
    size_t i = 0;
    for (const auto& q : p.pieces) {
      if (q.kind == MapPattern::Piece::Lit) {
        if (name.substr(i, q.text.size()) != q.text) return std::nullopt;
        i += q.text.size();
        continue;
      }
      const size_t b = i;
      uint64_t v = 0;
      while (i < name.size() && std::isdigit(static_cast<unsigned char>(name[i])) && i - b < 10) {
        v = v * 10 + static_cast<uint64_t>(name[i] - '0');
        ++i;
      }
      if (i == b || (name[b] == '0' && i - b > 1)) return std::nullopt;
      if (i < name.size() && std::isdigit(static_cast<unsigned char>(name[i]))) return std::nullopt;
      vals.push_back(v);
    }
    if (i != name.size()) return std::nullopt;
    return vals;
  }
  // With stars: a set of reachable positions per piece (no capture values).
  std::vector<char> at(name.size() + 1, 0), next(name.size() + 1, 0);
  at[0] = 1;
  for (const auto& q : p.pieces) {
    std::fill(next.begin(), next.end(), 0);
    for (size_t i = 0; i <= name.size(); ++i) {
      if (!at[i]) continue;
      if (q.kind == MapPattern::Piece::Lit) {
        if (name.substr(i, q.text.size()) == q.text) next[i + q.text.size()] = 1;
      } else if (q.kind == MapPattern::Piece::Star) {
        for (size_t j = i; j <= name.size(); ++j) {
          if (next[j]) break;  // the rest is already reachable
          next[j] = 1;
        }
      } else {
        size_t j = i;
        while (j < name.size() && std::isdigit(static_cast<unsigned char>(name[j]))) {
          ++j;
          if (!(name[i] == '0' && j - i > 1)) next[j] = 1;
        }
      }
    }
    std::swap(at, next);
  }
  if (!at[name.size()]) return std::nullopt;
  return std::vector<uint64_t>{};
}

std::string expand_pattern(const MapPattern& p,
                           const std::vector<std::pair<std::string, uint64_t>>& values) {
  std::string out;
  for (const auto& q : p.pieces) {
    if (q.kind == MapPattern::Piece::Lit) {
      out += q.text;
    } else if (q.kind == MapPattern::Piece::Cap) {
      for (const auto& [n, v] : values) {
        if (n == q.text) {
          out += std::to_string(v);
          break;
        }
      }
    } else {
      out += '*';
    }
  }
  return out;
}

}  // namespace ckptfs::format
