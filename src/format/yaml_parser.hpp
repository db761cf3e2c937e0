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
#include "ckptfs/util/text.hpp"

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
  void remember(const std::optional<std::string>& anchor, const json& v, size_t nodes_before) {
    if (anchor) anchors_[*anchor] = {v, nodes_ - nodes_before};
  }
  // Where the name of a tag (`!!int`), an anchor (`&a`) or an alias (`*a`) at the start of `r`
  // ends: at a space or a flow indicator.
  static size_t property_end(std::string_view r) {
    size_t n = 1;
    while (n < r.size() && r[n] != ' ' && !is_flow_indicator(r[n])) ++n;
    return n;
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
