// format/safetensors: safetensors headers: the length prefix, the strict parse, serialization.
#include "ckptfs/format/safetensors.hpp"

#include <algorithm>
#include <cstring>
#include <unordered_set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "ckptfs/util/checked.hpp"
#include "ckptfs/util/fd.hpp"
#include "json_strict.hpp"

namespace ckptfs::format {
namespace {

using nlohmann::json;

Result<std::vector<uint64_t>> u64_array(const json& j, std::string_view what,
                                        std::string_view tensor, std::string_view field) {
  if (!j.is_array()) {
    return make_error(EINVAL, "{}: tensor '{}': '{}' is not an array", what, tensor, field);
  }
  std::vector<uint64_t> out;
  out.reserve(j.size());
  for (const auto& v : j) {
    if (!v.is_number_unsigned()) {
      return make_error(EINVAL,
                        "{}: tensor '{}': '{}' holds {} where a non-negative integer is required",
                        what, tensor, field, detail::describe(v));
    }
    out.push_back(v.get<uint64_t>());
  }
  return out;
}

}  // namespace

const TensorEntry* Header::find(std::string_view name) const {
  for (const auto& t : tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

const std::string* Header::find_metadata(std::string_view key) const {
  auto it = metadata.find(std::string(key));
  return it == metadata.end() ? nullptr : &it->second;
}

Result<Header> parse_header_json(std::string_view text, uint64_t file_size, std::string_view what) {
  if (text.size() > kMaxHeaderSize) {
    return make_error(EINVAL, "{}: header of {} bytes exceeds the {} byte limit", what, text.size(),
                      kMaxHeaderSize);
  }
  if (text.empty() || text.front() != '{') {
    return make_error(EINVAL, "{}: header does not start with '{{'", what);
  }
  CKPTFS_TRY(json root, detail::parse_json_strict(text, what, "header"));
  if (!root.is_object()) {
    return make_error(EINVAL, "{}: header is not a JSON object", what);
  }
  Header h;
  h.json_len = text.size();
  h.tensors.reserve(root.size());
  for (auto it = root.begin(); it != root.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      if (v.is_null()) continue;
      if (!v.is_object()) {
        return make_error(EINVAL, "{}: __metadata__ is not an object", what);
      }
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) {
          return make_error(EINVAL, "{}: __metadata__ value for '{}' is not a string", what,
                            m.key());
        }
        h.metadata.emplace(m.key(), m.value().get<std::string>());
      }
      continue;
    }
    if (!v.is_object()) {
      return make_error(EINVAL, "{}: tensor '{}': entry is not an object", what, name);
    }
    TensorEntry t;
    t.name = name;
    auto dt = v.find("dtype");
    if (dt == v.end() || !dt->is_string()) {
      return make_error(EINVAL, "{}: tensor '{}': missing or non-string 'dtype'", what, name);
    }
    auto parsed = parse_dtype(dt->get<std::string>());
    if (!parsed) {
      return make_error(EINVAL, "{}: tensor '{}': unknown dtype '{}'", what, name,
                        dt->get<std::string>());
    }
    t.dtype = *parsed;
    auto sh = v.find("shape");
    if (sh == v.end()) {
      return make_error(EINVAL, "{}: tensor '{}': missing 'shape'", what, name);
    }
    CKPTFS_TRY(t.shape, u64_array(*sh, what, name, "shape"));
    auto off = v.find("data_offsets");
    if (off == v.end()) {
      return make_error(EINVAL, "{}: tensor '{}': missing 'data_offsets'", what, name);
    }
    CKPTFS_TRY(std::vector<uint64_t> offs, u64_array(*off, what, name, "data_offsets"));
    if (offs.size() != 2) {
      return make_error(EINVAL, "{}: tensor '{}': 'data_offsets' must have 2 entries, has {}", what,
                        name, offs.size());
    }
    t.begin = offs[0];
    t.end = offs[1];
    if (t.end < t.begin) {
      return make_error(EINVAL, "{}: tensor '{}': data_offsets [{}, {}) end before they begin",
                        what, name, t.begin, t.end);
    }
    auto numel = checked_numel(t.shape);
    if (!numel) {
      return make_error(EOVERFLOW, "{}: tensor '{}': shape [{}] overflows 64 bits", what, name,
                        fmt::join(t.shape, ", "));
    }
    auto nbytes = byte_size(t.dtype, *numel);
    if (!nbytes) {
      return make_error(EINVAL,
                        "{}: tensor '{}': {} elements of {} are not a whole number of bytes or "
                        "overflow",
                        what, name, *numel, dtype_name(t.dtype));
    }
    if (*nbytes != t.end - t.begin) {
      return make_error(EINVAL,
                        "{}: tensor '{}': data_offsets [{}, {}) span {} bytes but shape [{}] of "
                        "{} needs {}",
                        what, name, t.begin, t.end, t.end - t.begin, fmt::join(t.shape, ", "),
                        dtype_name(t.dtype), *nbytes);
    }
    h.tensors.push_back(std::move(t));
  }
  std::sort(h.tensors.begin(), h.tensors.end(), [](const TensorEntry& a, const TensorEntry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t pos = 0;
  for (const auto& t : h.tensors) {
    if (t.begin != pos) {
      return make_error(
          EINVAL, "{}: tensor '{}': data starts at {} but the previous tensor ends at {} ({})",
          what, t.name, t.begin, pos, t.begin > pos ? "hole" : "overlap");
    }
    pos = t.end;
  }
  h.data_size = pos;
  auto expected = checked_add(kHeaderLenBytes + h.json_len, h.data_size);
  if (!expected) {
    return make_error(EINVAL, "{}: header describes a file size that overflows", what);
  }
  if (*expected > file_size) {
    // Name the first tensor whose bytes are missing.
    const uint64_t have = file_size - std::min(file_size, h.data_start());
    for (const auto& t : h.tensors) {
      if (t.end > have) {
        return make_error(EINVAL,
                          "{}: tensor '{}': file is {} bytes but its header describes {}: the "
                          "tensor's bytes [{}, {}) of the data are missing (truncated?)",
                          what, t.name, file_size, *expected, t.begin, t.end);
      }
    }
  }
  if (*expected != file_size) {
    return make_error(EINVAL, "{}: file is {} bytes but its header describes {}{}", what, file_size,
                      *expected, *expected > file_size ? " (truncated?)" : " (trailing bytes)");
  }
  return h;
}

Result<uint64_t> read_header_length(int fd, uint64_t file_size, std::string_view what) {
  if (file_size < kHeaderLenBytes) {
    return make_error(EINVAL, "{}: file of {} bytes is too short for a safetensors header", what,
                      file_size);
  }
  unsigned char lenbuf[8];
  CKPTFS_CHECK(pread_exact(fd, lenbuf, sizeof lenbuf, 0, what));
  const uint64_t n = read_length_prefix(lenbuf);
  if (n > kMaxHeaderSize) {
    return make_error(EINVAL, "{}: header length {} exceeds the {} byte limit", what, n,
                      kMaxHeaderSize);
  }
  if (n > file_size - kHeaderLenBytes) {
    return make_error(EINVAL, "{}: header length {} runs past the end of the {} byte file", what, n,
                      file_size);
  }
  return n;
}

Result<std::string> read_header_prefix(int fd, uint64_t n, std::string_view what) {
  std::string prefix(static_cast<size_t>(kHeaderLenBytes + n), '\0');
  CKPTFS_CHECK(pread_exact(fd, prefix.data(), prefix.size(), 0, what));
  return prefix;
}

Result<Header> read_header(int fd, uint64_t file_size, std::string_view what) {
  CKPTFS_TRY(const uint64_t n, read_header_length(fd, file_size, what));
  CKPTFS_TRY(const std::string prefix, read_header_prefix(fd, n, what));
  return parse_header_json(std::string_view(prefix).substr(kHeaderLenBytes), file_size, what);
}

Result<Header> parse_file_bytes(std::string_view bytes, std::string_view what) {
  if (bytes.size() < kHeaderLenBytes) {
    return make_error(EINVAL, "{}: file of {} bytes is too short for a safetensors header", what,
                      bytes.size());
  }
  const uint64_t n = read_length_prefix(bytes.data());
  if (n > kMaxHeaderSize) {
    return make_error(EINVAL, "{}: header length {} exceeds the {} byte limit", what, n,
                      kMaxHeaderSize);
  }
  if (n > bytes.size() - kHeaderLenBytes) {
    return make_error(EINVAL, "{}: header length {} runs past the end of the {} byte file", what, n,
                      bytes.size());
  }
  return parse_header_json(bytes.substr(kHeaderLenBytes, n), bytes.size(), what);
}

Status append_packed(std::vector<TensorEntry>& list, TensorEntry e, uint64_t bytes) {
  e.begin = list.empty() ? 0 : list.back().end;
  auto end = checked_add(e.begin, bytes);
  if (!end) return make_error(EOVERFLOW, "tensor '{}': the data size overflows", e.name);
  e.end = *end;
  list.push_back(std::move(e));
  return {};
}

std::string serialize_header(std::span<const TensorEntry> tensors,
                             const std::map<std::string, std::string>& metadata, size_t align) {
  // Written by hand rather than through an ordered JSON object: insertion into nlohmann's
  // ordered_json is linear, which made 10,000-tensor headers quadratic.
  auto quoted = [](const std::string& s) {
    return nlohmann::json(s).dump(-1, ' ', /*ensure_ascii=*/false,
                                  nlohmann::json::error_handler_t::strict);
  };
  std::string text = "{";
  bool first = true;
  if (!metadata.empty()) {
    text += "\"__metadata__\":{";
    for (const auto& [k, v] : metadata) {
      if (!first) text += ',';
      first = false;
      text += quoted(k);
      text += ':';
      text += quoted(v);
    }
    text += '}';
  }
  first = metadata.empty();
  for (const auto& t : tensors) {
    if (!first) text += ',';
    first = false;
    text += quoted(t.name);
    text += fmt::format(":{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{},{}]}}",
                        dtype_name(t.dtype), fmt::join(t.shape, ","), t.begin, t.end);
  }
  text += '}';
  if (align > 1) {
    size_t total = kHeaderLenBytes + text.size();
    size_t pad = (align - total % align) % align;
    text.append(pad, ' ');
  }
  return with_length_prefix(text);
}

std::string with_length_prefix(std::string_view json) {
  std::string out(kHeaderLenBytes, '\0');
  store_le64(out.data(), json.size());
  out += json;
  return out;
}

}  // namespace ckptfs::format
