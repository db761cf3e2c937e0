// The one nesting guard for untrusted JSON, run before any parser sees the text.
#pragma once

#include <cstddef>
#include <string_view>

namespace ckptfs::format {

// Deepest nesting of arrays and objects accepted in untrusted JSON. Real documents nest 3 or
// 4 levels; the cap exists because code that walks a value recursively (nlohmann's DOM parser
// and destructor, dump(), comparisons) would overflow the stack on a hostile 100,000-level
// value.
inline constexpr size_t kMaxJsonDepth = 64;

// Offset of the bracket that opens nesting level kMaxJsonDepth + 1, or npos. A single pass
// with no recursion. Brackets inside strings do not count; a backslash skips the next byte so
// an escaped quote does not end the string. Unbalanced text is not this scan's business: the
// parser refuses it afterwards.
size_t json_too_deep_at(std::string_view text);

}  // namespace ckptfs::format
