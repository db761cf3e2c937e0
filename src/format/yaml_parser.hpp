// format/yaml's parser, a cursor over lines (yaml.cpp: documents, collections, flow;
// yaml_scalar.cpp: scalars and their values). Internal to src/format.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "ckptfs/format/json_depth.hpp"
#include "ckptfs/format/yaml.hpp"

namespace ckptfs::format::yaml_detail {

using nlohmann::json;

struct Line {
  std::string_view text;  // without its line break
  int indent = 0;         // leading spaces
  bool empty = false;     // nothing but spaces
  bool comment = false;   // its first non-space is '#'
};

constexpr size_t kMaxIndent = 4096;  // columns; safe_dump indents 2 a level

inline bool is_flow_indicator(char c) {
  return c == ',' || c == '[' || c == ']' || c == '{' || c == '}';
}

// A plain scalar's value, as PyYAML's SafeLoader (YAML 1.1) resolves it: null, a bool, an int
// (decimal, 0x, 0b, 0-octal, sexagesimal, '_'), a float (a dot required; an exponent's sign
// too), or the text; a non-finite float is null.
json resolve_plain(std::string_view s);
std::optional<json> resolve_int(std::string_view s);
std::optional<json> resolve_float(std::string_view s);
std::string without_underscores(std::string_view s);
void append_utf8(std::string& out, uint32_t cp);

class Parser {
 public:
  Parser(std::string_view what, const YamlLimits& limits) : what_(what), limits_(limits) {}

  Result<json> run(std::string_view text);

 private:
  template <typename... Args>
  Error fail(fmt::format_string<Args...> f, Args&&... args) const {
    return make_error(EINVAL, "{}: line {}: {}", what_, std::min(li_, lines_.size()) + 1,
                      fmt::format(f, std::forward<Args>(args)...));
  }

  bool at_eof() const { return li_ >= lines_.size(); }
  std::string_view line() const { return lines_[li_].text; }
  std::string_view rest() const { return line().substr(std::min(col_, line().size())); }
  void skip_spaces() {
    while (col_ < line().size() && line()[col_] == ' ') ++col_;
  }
  // Nothing left on the line but spaces and a comment.
  bool rest_is_empty() const {
    std::string_view r = rest();
    size_t i = 0;
    while (i < r.size() && r[i] == ' ') ++i;
    return i == r.size() || r[i] == '#';
  }
  // To the next line that holds content (li_ past the end when none).
  void next_content_line() {
    ++li_;
    while (!at_eof() && (lines_[li_].empty || lines_[li_].comment)) ++li_;
    col_ = at_eof() ? 0 : static_cast<size_t>(lines_[li_].indent);
  }
  Status count_node() {
    if (++nodes_ > limits_.max_nodes) {
      return make_error(EFBIG, "{}: more than {} nodes", what_, limits_.max_nodes);
    }
    return {};
  }
  Status enter(size_t depth) const {
    if (depth > kMaxJsonDepth) return fail("nested deeper than {} levels", kMaxJsonDepth);
    return {};
  }
  Status check_scalar(const std::string& s) const {
    if (s.size() > limits_.max_scalar_bytes) {
      return make_error(EFBIG, "{}: line {}: a scalar of more than {} bytes", what_, li_ + 1,
                        limits_.max_scalar_bytes);
    }
    return {};
  }

  static bool starts_sequence_entry(std::string_view r) { return r == "-" || r.starts_with("- "); }
  static bool starts_complex_key(std::string_view r) { return r == "?" || r.starts_with("? "); }
  // Where a block mapping key's ':' is in `r` (npos: `r` is no key).
  static size_t key_colon(std::string_view r);

  struct Props {
    std::optional<std::string> anchor;
    char tag = 0;  // a core scalar tag: 's'tr, 'i'nt, 'f'loat, 'b'ool, 'n'ull; 0: none
  };
  Result<json> block_node(int parent, size_t depth);
  Result<json> block_map(int indent, size_t depth);
  Result<json> block_seq(int indent, size_t depth);
  // What may follow an indicator: a sequence at its own column on the next lines (PyYAML's
  // indentless sequence, after a key), a collection starting on the indicator's line (after
  // `- `, `? ` and a complex key's `: `).
  struct After {
    bool indentless = false;
    bool inline_collection = false;
  };
  Result<json> value_after_indicator(int indent, size_t depth, After after);
  Result<json> inline_value(int parent, size_t depth, Props props);
  Result<json> inline_value(int parent, size_t depth) {
    return inline_value(parent, depth, Props());
  }
  Result<std::string> block_key();
  Result<Props> properties();
  Result<json> scalar(std::string raw, bool plain, char tag, size_t line) const;
  Result<json> alias();
  Result<std::string> quoted(char quote);
  Result<std::string> plain_block(int parent);
  Result<std::string> block_scalar(int parent);
  Result<json> flow_node(size_t depth);
  Result<std::string> flow_plain();
  Status skip_flow_space();
  Status end_of_value_line() {
    if (!rest_is_empty())
      return fail("unexpected text after a value: '{}'", printable(rest().substr(0, 40)));
    next_content_line();
    return {};
  }
  Status remember(const std::optional<std::string>& anchor, const json& v, size_t nodes_before) {
    if (anchor) anchors_[*anchor] = {v, nodes_ - nodes_before};
    return {};
  }

  std::string_view what_;
  YamlLimits limits_;
  std::vector<Line> lines_;
  size_t li_ = 0;   // the cursor: line
  size_t col_ = 0;  // and column
  size_t nodes_ = 0;
  struct Anchored {
    json value;
    size_t nodes = 0;
  };
  std::map<std::string, Anchored, std::less<>> anchors_;
};

}  // namespace ckptfs::format::yaml_detail
