// util/text: printable forms of untrusted names for messages.
#include "ckptfs/util/text.hpp"

#include <fmt/format.h>
#include <spdlog/pattern_formatter.h>

namespace ckptfs {
namespace {

bool is_bidi_control(uint32_t cp) {
  return cp == 0x061C || cp == 0x200E || cp == 0x200F || (cp >= 0x202A && cp <= 0x202E) ||
         (cp >= 0x2066 && cp <= 0x2069);
}

// Decodes one UTF-8 sequence at s[i]; returns its length (0 when invalid) and the code point.
size_t decode_utf8(std::string_view s, size_t i, uint32_t& cp) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  size_t len;
  uint32_t min;
  if (b0 < 0x80) {
    cp = b0;
    return 1;
  } else if ((b0 & 0xE0) == 0xC0) {
    len = 2, cp = b0 & 0x1F, min = 0x80;
  } else if ((b0 & 0xF0) == 0xE0) {
    len = 3, cp = b0 & 0x0F, min = 0x800;
  } else if ((b0 & 0xF8) == 0xF0) {
    len = 4, cp = b0 & 0x07, min = 0x10000;
  } else {
    return 0;
  }
  if (i + len > s.size()) return 0;
  for (size_t k = 1; k < len; ++k) {
    const auto b = static_cast<unsigned char>(s[i + k]);
    if ((b & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (b & 0x3F);
  }
  if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
  return len;
}

// Escapes the message text of each log record; the rest of the pattern is ours.
class SafeMessageFlag final : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm&,
              spdlog::memory_buf_t& dest) override {
    const std::string safe = printable(std::string_view(msg.payload.data(), msg.payload.size()));
    dest.append(safe.data(), safe.data() + safe.size());
  }
  std::unique_ptr<custom_flag_formatter> clone() const override {
    return std::make_unique<SafeMessageFlag>();
  }
};

}  // namespace

bool is_valid_utf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    uint32_t cp = 0;
    const size_t len = decode_utf8(s, i, cp);
    if (len == 0) return false;
    i += len;
  }
  return true;
}

std::string printable(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    uint32_t cp = 0;
    const size_t len = decode_utf8(s, i, cp);
    if (len == 0) {
      out += fmt::format("\\x{:02x}", static_cast<unsigned char>(s[i]));
      ++i;
      continue;
    }
    if (cp == '\n') {
      out += "\\n";
    } else if (cp == '\r') {
      out += "\\r";
    } else if (cp == '\t') {
      out += "\\t";
    } else if (cp < 0x20 || cp == 0x7F) {
      out += fmt::format("\\x{:02x}", cp);
    } else if ((cp >= 0x80 && cp <= 0x9F) || is_bidi_control(cp)) {
      out += fmt::format("\\u{{{:04x}}}", cp);
    } else {
      out.append(s.substr(i, len));
    }
    i += len;
  }
  return out;
}

std::unique_ptr<spdlog::formatter> safe_log_formatter() {
  auto f = std::make_unique<spdlog::pattern_formatter>();
  // spdlog's default pattern, with the message replaced by its escaped form.
  f->add_flag<SafeMessageFlag>('*').set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%n] [%^%l%$] %*");
  return f;
}

}  // namespace ckptfs
