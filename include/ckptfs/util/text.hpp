// Making untrusted strings safe to print: tensor names, file names and messages quoting them
// come from files that anyone with write access to the source can craft.
#pragma once

#include <memory>
#include <string>
#include <string_view>

namespace spdlog {
class formatter;
}

namespace ckptfs {

// `s` with every character that could forge a line or steer a terminal escaped, so that one
// message stays one line and shows what it holds:
//  - C0 controls and DEL as \n, \r, \t or \xNN; C1 controls (U+0080..U+009F) as \u{NN};
//  - Unicode bidi controls (U+061C, U+200E/F, U+202A..U+202E, U+2066..U+2069) as \u{NNNN};
//  - bytes that are not valid UTF-8 as \xNN.
// Everything else, backslashes included, is kept, so escaping twice changes nothing more.
std::string printable(std::string_view s);

// Whether `s` is well-formed UTF-8 (RFC 3629: no overlongs, no surrogates, nothing past
// U+10FFFF): the one UTF-8 check, for names that must round-trip through JSON.
bool is_valid_utf8(std::string_view s);

// A spdlog formatter that applies `printable` to every message: installed on every logger the
// program creates, so no code path can write a raw name into a log.
std::unique_ptr<spdlog::formatter> safe_log_formatter();

}  // namespace ckptfs
