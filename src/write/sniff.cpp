// write/sniff: tells, from a written file's first bytes, whether it is safetensors to route.
#include "ckptfs/write/sniff.hpp"

#include <nlohmann/json.hpp>

#include "ckptfs/format/dcp.hpp"
#include "ckptfs/format/json_depth.hpp"
#include "ckptfs/util/checked.hpp"

namespace ckptfs::write {

Result<format::Header> parse_header_unsized(std::string_view json, std::string_view what) {
  // A lenient first pass finds the end of the data the header claims; the strict parser then
  // checks everything (duplicates, tiling, sizes) against exactly that size. Parsing twice
  // avoids copying the strict parser into this layer.
  // nlohmann's DOM parser (and its destructor) recurse: a hostile header is refused first.
  if (format::json_too_deep_at(json) != std::string_view::npos) {
    return make_error(EINVAL, "{}: header is nested deeper than {} levels", what,
                      format::kMaxJsonDepth);
  }
  auto root = nlohmann::json::parse(json.begin(), json.end(), nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object()) {
    return make_error(EINVAL, "{}: header is not a JSON object", what);
  }
  uint64_t data_end = 0;
  for (auto it = root.begin(); it != root.end(); ++it) {
    if (it.key() == "__metadata__" || !it.value().is_object()) continue;
    auto off = it.value().find("data_offsets");
    if (off == it.value().end() || !off->is_array() || off->size() != 2) continue;
    const auto& end = (*off)[1];
    if (end.is_number_unsigned()) data_end = std::max(data_end, end.get<uint64_t>());
  }
  auto size = checked_add(format::kHeaderLenBytes + json.size(), data_end);
  if (!size) {
    return make_error(EOVERFLOW, "{}: header describes a file size that overflows", what);
  }
  return format::parse_header_json(json, *size, what);
}

Sniffed sniff(std::string_view prefix, uint64_t file_size, std::string_view what) {
  Sniffed s;
  auto other = [&](std::string why) {
    s.kind = Kind::Other;
    s.header.reset();
    s.why = std::move(why);
    return s;
  };
  if (file_size != 0 && file_size < format::kHeaderLenBytes + kMinHeaderLen) {
    return other(fmt::format("{}: {} bytes is too short for a safetensors file", what, file_size));
  }
  if (prefix.size() < format::kHeaderLenBytes) {
    s.kind = Kind::NeedMore;
    return s;
  }
  const uint64_t n = format::read_length_prefix(prefix.data());
  if (n < kMinHeaderLen || n > format::kMaxHeaderSize) {
    return other(fmt::format("{}: header length {} is outside [{}, {}]", what, n, kMinHeaderLen,
                             format::kMaxHeaderSize));
  }
  s.header_len = n;
  const uint64_t data_start = format::kHeaderLenBytes + n;  // n <= 1e8: cannot overflow
  if (file_size != 0 && data_start > file_size) {
    return other(fmt::format("{}: header length {} runs past the end of the {} byte file", what, n,
                             file_size));
  }
  if (prefix.size() > format::kHeaderLenBytes && prefix[format::kHeaderLenBytes] != '{') {
    return other(fmt::format("{}: header does not start with '{{'", what));
  }
  if (prefix.size() < data_start) {
    s.kind = Kind::NeedMore;
    return s;
  }
  const std::string_view json = prefix.substr(format::kHeaderLenBytes, n);
  auto h = file_size != 0 ? format::parse_header_json(json, file_size, what)
                          : parse_header_unsized(json, what);
  if (!h) return other(h.error().message);
  const bool sharded = h->find_metadata(format::kShardingInfoKey) != nullptr;
  s.kind = sharded ? Kind::RankShard : Kind::Consolidated;
  s.header = std::move(h).value();
  return s;
}

}  // namespace ckptfs::write
