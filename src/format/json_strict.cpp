// format/json_strict: the depth guard and the strict JSON parser (no duplicate keys) every parser
// uses.
#include "json_strict.hpp"

#include <fmt/format.h>

namespace ckptfs::format {

size_t json_too_deep_at(std::string_view text) {
  size_t depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    switch (c) {
      case '"':
        in_string = true;
        break;
      case '[':
      case '{':
        if (++depth > kMaxJsonDepth) return i;
        break;
      case ']':
      case '}':
        if (depth > 0) --depth;
        break;
      default:
        break;
    }
  }
  return std::string_view::npos;
}

}  // namespace ckptfs::format

namespace ckptfs::format::detail {
namespace {

using nlohmann::json;

// Quoted strings in messages are cut here: values are shown for a hint, but a duplicate key
// is usually a tensor name, which the reader needs whole (MoE names run to ~60 characters).
constexpr size_t kMaxValueChars = 40;
constexpr size_t kMaxKeyChars = 256;

// Builds the DOM from nlohmann's SAX events, refusing duplicate keys as they arrive.
//
// This replaces json::parse with a parser callback, which is quadratic: after every nested
// object closes, nlohmann's callback DOM builder scans the whole parent object for a
// discarded member, so a header of n tensors (or a DCP_SHARDING_INFO of n entries) cost
// O(n^2) (20,000 tensors: ~10 s per shard). Here every event is O(log n) at worst: a key is
// inserted straight into its std::map, and a duplicate is seen by that insertion failing.
class StrictDomBuilder {
 public:
  explicit StrictDomBuilder(std::vector<std::string>* top_keys) : top_keys_(top_keys) {}

  bool null() { return place(json(nullptr)) != nullptr; }
  bool boolean(bool v) { return place(json(v)) != nullptr; }
  bool number_integer(json::number_integer_t v) { return place(json(v)) != nullptr; }
  bool number_unsigned(json::number_unsigned_t v) { return place(json(v)) != nullptr; }
  bool number_float(json::number_float_t v, const json::string_t& /*text*/) {
    return place(json(v)) != nullptr;
  }
  bool string(json::string_t& v) { return place(json(std::move(v))) != nullptr; }
  // The JSON lexer never produces binary values; kept for the SAX interface.
  bool binary(json::binary_t& v) { return place(json::binary(std::move(v))) != nullptr; }

  bool start_object(size_t /*elements*/) {
    open_.push_back(place(json(json::value_t::object)));
    return true;
  }
  bool key(json::string_t& k) {
    auto& obj = open_.back()->get_ref<json::object_t&>();
    // try_emplace leaves `k` untouched when the key exists, so it can still be reported.
    auto [it, inserted] = obj.try_emplace(std::move(k));
    if (!inserted) {
      duplicate_ = k;
      return false;
    }
    if (top_keys_ && open_.size() == 1) top_keys_->push_back(it->first);
    slot_ = &it->second;
    return true;
  }
  bool end_object() {
    open_.pop_back();
    return true;
  }
  bool start_array(size_t /*elements*/) {
    open_.push_back(place(json(json::value_t::array)));
    return true;
  }
  bool end_array() {
    open_.pop_back();
    return true;
  }
  bool parse_error(size_t /*position*/, const std::string& /*last_token*/,
                   const nlohmann::detail::exception& e) {
    error_ = e.what();
    return false;
  }

  json& root() { return root_; }
  [[nodiscard]] const std::string& duplicate() const { return duplicate_; }
  [[nodiscard]] const std::string& error() const { return error_; }

 private:
  // Stores a value where the document puts it next: the root, the end of the innermost open
  // array, or the member of the innermost open object whose key was just read. Pointers into
  // an open array stay valid: it only grows while its own innermost child is closed.
  json* place(json v) {
    if (open_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    json& parent = *open_.back();
    if (parent.is_array()) {
      auto& arr = parent.get_ref<json::array_t&>();
      arr.push_back(std::move(v));
      return &arr.back();
    }
    *slot_ = std::move(v);
    return slot_;
  }

  std::vector<std::string>* top_keys_;
  json root_;
  std::vector<json*> open_;  // open arrays and objects, innermost last
  json* slot_ = nullptr;     // the member whose key was read last
  std::string duplicate_;
  std::string error_;
};

// Cuts a message to about `max` bytes without splitting a UTF-8 sequence. nlohmann's parse
// errors quote the offending token, which may be a megabyte-long string of a hostile file.
std::string bounded(std::string s, size_t max = 240) {
  if (s.size() <= max) return s;
  size_t cut = max;
  while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xC0) == 0x80) --cut;
  s.resize(cut);
  s += "...";
  return s;
}

// Length of the well-formed UTF-8 sequence starting at s[i] (RFC 3629: no overlongs, no
// surrogates, nothing past U+10FFFF), or 0 when there is none.
size_t utf8_len(std::string_view s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[i + k]); };
  const unsigned char c = b(0);
  size_t n = 0;
  unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (c >= 0xC2 && c <= 0xDF) {
    n = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  if (i + n > s.size() || b(1) < lo || b(1) > hi) return 0;
  for (size_t k = 2; k < n; ++k) {
    if ((b(k) & 0xC0) != 0x80) return 0;
  }
  return n;
}

// A string quoted for a message: at most `max_chars` characters, control characters (C0,
// DEL, C1) and bytes that are not UTF-8 escaped, so a hostile name cannot forge terminal
// output or make a message megabytes long.
std::string quote_bounded(std::string_view s, size_t max_chars) {
  std::string out = "\"";
  size_t i = 0;
  for (size_t chars = 0; i < s.size() && chars < max_chars; ++chars) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
      ++i;
    } else if (c == '\n') {
      out += "\\n";
      ++i;
    } else if (c == '\t') {
      out += "\\t";
      ++i;
    } else if (c < 0x20 || c == 0x7F) {
      out += fmt::format("\\u{:04x}", c);
      ++i;
    } else if (c < 0x80) {
      out += static_cast<char>(c);
      ++i;
    } else if (size_t n = utf8_len(s, i); n == 0) {
      out += fmt::format("\\x{:02x}", c);
      ++i;
    } else if (n == 2 && c == 0xC2 && static_cast<unsigned char>(s[i + 1]) < 0xA0) {
      out += fmt::format("\\u{:04x}", static_cast<unsigned char>(s[i + 1]));  // C1 control
      i += n;
    } else {
      out.append(s.substr(i, n));
      i += n;
    }
  }
  out += '"';
  if (i < s.size()) out += fmt::format("... ({} bytes)", s.size());
  return out;
}

}  // namespace

Result<json> parse_json_strict(std::string_view text, std::string_view what, std::string_view kind,
                               std::vector<std::string>* top_keys) {
  if (size_t at = json_too_deep_at(text); at != std::string_view::npos) {
    return make_error(EINVAL, "{}{} is nested deeper than {} levels (at byte {})", prefix(what),
                      kind, kMaxJsonDepth, at);
  }
  StrictDomBuilder builder(top_keys);
  if (!json::sax_parse(text.begin(), text.end(), &builder, json::input_format_t::json,
                       /*strict=*/true)) {
    if (!builder.duplicate().empty() || builder.error().empty()) {
      return make_error(EINVAL, "{}{} has duplicate key {}", prefix(what), kind,
                        quote_bounded(builder.duplicate(), kMaxKeyChars));
    }
    return make_error(EINVAL, "{}{} is not valid JSON: {}", prefix(what), kind,
                      bounded(builder.error()));
  }
  return std::move(builder.root());
}

std::string describe(const json& v) {
  switch (v.type()) {
    case json::value_t::object: {
      const size_t n = v.size();
      if (n == 0) return "an empty object";
      return fmt::format("an object with {} key{}", n, n == 1 ? "" : "s");
    }
    case json::value_t::array: {
      const size_t n = v.size();
      if (n == 0) return "an empty array";
      return fmt::format("an array of {} element{}", n, n == 1 ? "" : "s");
    }
    case json::value_t::string:
      return "the string " + quote_bounded(v.get_ref<const std::string&>(), kMaxValueChars);
    case json::value_t::binary:
      return "binary data";
    case json::value_t::discarded:
      return "a discarded value";
    case json::value_t::null:
    case json::value_t::boolean:
    case json::value_t::number_integer:
    case json::value_t::number_unsigned:
    case json::value_t::number_float:
      break;
  }
  // A scalar: dump() prints it without recursing, in at most a few dozen bytes.
  return v.dump();
}

}  // namespace ckptfs::format::detail
