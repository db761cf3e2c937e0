// The rank plan: how each tensor of a consolidated file is cut into DCP rank chunks, and the
// shard file headers that follow from it. Pure arithmetic, no I/O.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "ckptfs/format/safetensors.hpp"
#include "ckptfs/layout/shard_set.hpp"
#include "ckptfs/util/result.hpp"

namespace ckptfs::write {

struct PlanOptions {
  uint32_t ranks = 1;
  enum Split { EvenDim0, TpPlan } split = EvenDim0;
  // fqn pattern -> "colwise" | "rowwise", HF base_model_tp_plan style. A pattern matches whole
  // dot-separated components anywhere in the name ("layers.*.mlp.up_proj" matches
  // "model.layers.3.mlp.up_proj.weight"); '*' matches one all-digit component (a layer
  // number). The longest matching pattern wins. Other styles ("replicate", ...) fall back to
  // an even dim-0 split: any tiling reads back the same, the style only helps a DCP reader.
  std::map<std::string, std::string> tp_plan;
  uint64_t min_split_bytes = 64 * 1024;  // smaller tensors go whole to one rank
  // A file the kernel wrote is committed at close as its own one shard and split into `ranks`
  // shards after (WriteFile::take_resplit, write/resplit.hpp), where the flusher adopts files:
  // set by a caller that runs the splits it is handed.
  bool split_after_close = false;
};

// Shard names carry 5 digits; more ranks than this is a mistake, not a plan.
inline constexpr uint32_t kMaxRanks = 99'999;

struct PlanChunk {
  uint32_t rank = 0;  // 0-based; the shard file is shard-{rank+1}
  std::vector<uint64_t> offsets;
  std::vector<uint64_t> sizes;
  uint64_t nbytes = 0;
};

struct TensorPlan {
  static constexpr uint32_t kWhole = UINT32_MAX;
  std::string name;
  uint32_t split_dim = kWhole;    // kWhole: one chunk holding the whole tensor
  std::vector<PlanChunk> chunks;  // ascending offsets along split_dim; at most one per rank
};

struct Plan {
  uint32_t ranks = 0;
  std::vector<TensorPlan> tensors;   // same order as Header::tensors (data order)
  std::vector<uint64_t> rank_bytes;  // data bytes each rank holds
};

// Splits: chosen dim cut evenly, the first (extent % parts) ranks one row longer, never an
// empty chunk (an extent below `ranks` uses only that many ranks). Whole (one rank): 0-d and
// 1-d tensors, empty ones, ones under min_split_bytes, and sub-byte ones a split would cut
// inside a byte. Whole tensors are placed after all splits, in header order, each on the rank
// with the fewest bytes so far (ties: lowest rank).
Result<Plan> plan(const format::Header& h, const PlanOptions& opts, std::string_view what);

// Builds every rank's shard header: the rank's chunks as tensors (same names and dtypes, local
// shapes) packed in the original file's data order, and __metadata__ with DCP_SHARDING_INFO
// (saved_offsets and the full "shape"), "format": "pt", "DCP_VERSION": "1.0". A rank with
// no chunks still gets a valid shard: no tensors and DCP_SHARDING_INFO "{}", so the shard set
// of a file is always shard-00001..shard-{ranks} and a reader never mistakes a missing file
// for an empty rank. Each shard's header comes serialized and parsed (layout::ShardLayout).
Result<layout::ShardSet> shard_headers(const format::Header& h, const Plan& p,
                                       std::string_view what);

}  // namespace ckptfs::write
