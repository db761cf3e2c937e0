// layout/model_map: a model map compiled against a checkpoint's stored tensors and its
// config.json into HF tensors made of element runs of the stored ones (docs/maps.md).
//
// Pure arithmetic, like the rest of the layout: the extent map then serves a mapped tensor's
// bytes through the stored tensors' own chunks, so the view stays zero-copy.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "ckptfs/format/model_map.hpp"
#include "ckptfs/layout/checkpoint.hpp"

namespace ckptfs::layout {

inline constexpr uint64_t kMaxMappedTensors = 65536;
inline constexpr uint64_t kMaxRunsPerTensor = uint64_t{1} << 24;
inline constexpr uint64_t kMaxRunsTotal = uint64_t{1} << 22;  // 48 bytes each
inline constexpr uint64_t kMaxForCount = uint64_t{1} << 20;
// Work a map may ask of the compiler, whatever it makes: bindings tried (every rule's), and
// rows enumerated (a real model's maps need a few million).
inline constexpr uint64_t kMaxBindingsTotal = uint64_t{1} << 20;
inline constexpr uint64_t kMaxRowsTotal = uint64_t{1} << 27;
// Parts of one HF tensor that read one stored tensor with overlapping element ranges are
// checked block by block: at most this many blocks (16 bytes each), else the tensor is refused.
inline constexpr uint64_t kMaxOverlapBlocks = uint64_t{1} << 18;

struct MappedTensor {
  std::string name;
  format::DType dtype = format::DType::U8;
  format::DType src_dtype = format::DType::U8;
  std::vector<uint64_t> shape;
  std::vector<MapRun> runs;
  std::string origin;  // "layers.0.attention.wq.weight rows ... (rule 3)", for inspect
};

struct CompiledMap {
  std::vector<MappedTensor> tensors;  // in rule order
  std::vector<Problem> problems;
  uint32_t dropped = 0;  // stored tensors deliberately not served
};

// The stored name a map matches: `name` without the first of `map.prefixes` it starts with.
std::string_view map_stored_name(const format::ModelMap& map, std::string_view name);

// Whether the map's detect clause holds for these stored tensors and checkpoint format. A map
// with no detect clause is never detected (it must be named).
bool map_detects(const format::ModelMap& map, const std::vector<Tensor>& stored,
                 std::string_view format);

// The first stored tensor one of the map's `refuse` patterns matches (its index in `stored`),
// with that refusal; nullopt when none does.
struct MapRefused {
  uint32_t tensor = 0;
  const format::MapRefusal* refusal = nullptr;
};
std::optional<MapRefused> map_refuses(const format::ModelMap& map,
                                      const std::vector<Tensor>& stored);

// Compiles `map` against `stored` (their served dtypes) and `config` (`config_what` names it in
// messages). Never throws; every problem names the tensor and, where one is at fault, the axis.
CompiledMap compile_map(const format::ModelMap& map, const nlohmann::json& config,
                        std::string_view config_what, const std::vector<Tensor>& stored);

// build_checkpoint's map pass: BuildOptions::map, else the first built-in whose detect clause
// holds, compiled with the directory's config.json (BuildInput::config) or BuildOptions::
// hf_config, else the map's `hf_config` template over BuildInput::native_config. On success
// `ck.tensors` are the mapped tensors (`ck.stored` the stored ones), `k` each one's output file
// (packed in rule order, kMaxOutputBytes each), and it returns true. Otherwise nothing changes but
// a problem (a named map that does not fit, or that refuses one of the stored tensors) or
// ck.map_note (a detected map with no config.json to size it, or whose `refuse` holds: the
// checkpoint stays under its stored names).
bool apply_model_map(const BuildInput& in, const BuildOptions& opts, Checkpoint& ck,
                     std::vector<uint32_t>& k);

}  // namespace ckptfs::layout
