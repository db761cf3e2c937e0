// libFuzzer target: shard headers -> DCP metadata -> checkpoint model -> extent map.
//
// The input is split at "\n--\n" into up to four shard files; each one that parses becomes a
// rank shard. A valid checkpoint is then read through the extent map, whose segments must
// stay inside their sources and add up to the requested length: as stored, and as a cast
// view (every float tensor served as BF16, F16 or F32, picked by the input's size).
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "ckptfs/format/names.hpp"
#include "ckptfs/layout/extent_map.hpp"

using namespace ckptfs;

namespace {

void check_reads(const layout::Checkpoint& ck, const std::vector<std::string>& files) {
  std::vector<layout::Segment> segs;
  for (uint32_t f = 0; f < ck.outputs.size(); ++f) {
    const auto& out = ck.outputs[f];
    const uint64_t step = out.size / 7 + 1;
    for (uint64_t off = 0; off < out.size; off += step) {
      layout::map_range(ck, f, off, step, segs);
      uint64_t total = 0;
      for (const auto& s : segs) {
        total += s.len;
        if (s.is_memory()) {
          if (s.src + s.len > out.header.size()) __builtin_trap();
        } else if (s.shard >= files.size() || s.src + s.src_len() > files[s.shard].size()) {
          __builtin_trap();
        }
      }
      if (total != std::min(step, out.size - off)) __builtin_trap();
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view in(reinterpret_cast<const char*>(data), size);
  layout::BuildInput bi;
  bi.dir = "fuzz";
  std::vector<std::string> files;
  for (uint32_t r = 1; r <= 4 && !in.empty(); ++r) {
    auto cut = in.find("\n--\n");
    std::string_view part = in.substr(0, cut);
    in = cut == std::string_view::npos ? std::string_view() : in.substr(cut + 4);
    layout::ShardInput si;
    si.name = format::shard_file_name(r, 1, 1);
    si.stamp.size = part.size();
    auto h = format::parse_file_bytes(part, si.name);
    if (h.ok()) {
      si.header = std::make_shared<const format::Header>(std::move(h).value());
    } else {
      si.error = h.error().message;
    }
    files.emplace_back(part);
    bi.shards.push_back(std::move(si));
  }
  layout::BuildOptions cast;
  cast.dtype_policy = layout::BuildOptions::DtypePolicy::Cast;
  const format::DType targets[] = {format::DType::BF16, format::DType::F16, format::DType::F32};
  cast.cast_to = targets[size % 3];
  if (auto ck = layout::build_checkpoint(bi, cast); ck->valid()) check_reads(*ck, files);
  if (auto ck = layout::build_checkpoint(std::move(bi)); ck->valid()) check_reads(*ck, files);
  return 0;
}
