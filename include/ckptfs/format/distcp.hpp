// torch DCP's native checkpoint: the `.metadata` pickle, and the torch.save archive each chunk
// is inside a `.distcp` file, read through the restricted unpickler into plain structs.
//
// `.metadata` is `pickle(Metadata)`: `state_dict_metadata` (flattened key -> tensor dtype,
// size and chunks, or BytesStorageMetadata for anything not a tensor), `storage_data`
// (MetadataIndex(fqn, chunk offsets) -> _StorageInfo(relative_path, offset, length,
// transform_descriptors)) and `planner_data` (flattened key -> its path in the nested dict).
// Each chunk's bytes are a `torch.save(tensor)` archive at [offset, offset + length) of its
// file; its data.pkl is `_rebuild_tensor_v2(persistent_id('storage', <dtype>Storage, key,
// location, numel), storage_offset, size, stride, ...)`.
//
// Only the globals those two pickles need are allowed (kMetadataGlobals, kTensorGlobals); a
// chunk stored with transform_descriptors (compression, other extensions) is refused by name.
// Every key must be a tensor name a safetensors header can hold (check_tensor_name); two
// storage entries whose bytes overlap in one file, and more than kMaxDistcpFiles files, are
// refused: DCP writes each item's bytes once, and a file per rank and writer thread.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ckptfs/format/dtype.hpp"
#include "ckptfs/format/pickle.hpp"
#include "ckptfs/format/zip.hpp"
#include "ckptfs/util/result.hpp"

namespace ckptfs::format {

inline constexpr std::string_view kDistcpMetadataName = ".metadata";
inline constexpr std::string_view kDistcpSuffix = ".distcp";
inline constexpr uint64_t kMaxDistcpMetadataBytes = 256ull << 20;
// Distinct files one `.metadata` may name: a file per rank and writer thread (Megatron writes
// a few per rank), so this is 64 Ki ranks of one file or 16 Ki ranks of four. The source opens
// them one at a time; the cap bounds the opens and stats of one rebuild of the view.
inline constexpr size_t kMaxDistcpFiles = 65536;

// `.metadata` or `*.distcp`: a DCP checkpoint's own files (never copied into its consolidated
// form, never hidden by the view).
bool is_distcp_file_name(std::string_view name);

// Megatron-Core's metadata.json beside a DCP checkpoint says `"sharded_backend": "torch_dist"`
// (parsed strictly: depth and duplicate keys refused; anything else is false).
inline constexpr std::string_view kMegatronMetadataName = "metadata.json";
bool is_megatron_torch_dist(std::string_view metadata_json);

std::span<const pickle::GlobalName> distcp_metadata_globals();
std::span<const pickle::GlobalName> torch_tensor_globals();

struct DistcpChunk {
  std::vector<uint64_t> offsets;  // in the full tensor
  std::vector<uint64_t> sizes;
  std::string file;     // relative_path: a file name in the checkpoint directory
  uint64_t offset = 0;  // of the chunk's torch.save archive in `file`
  uint64_t length = 0;
  // Stored with transform_descriptors (compression or another storage extension): its bytes
  // are not the archive torch.save wrote, so it cannot be served.
  bool transformed = false;
};

struct DistcpTensor {
  std::string key;  // the flattened state-dict key ("model.layers.0.mlp.up_proj.weight")
  std::vector<std::string> path;  // planner_data: its path in the nested dict (empty: none)
  DType dtype = DType::U8;
  std::vector<uint64_t> size;
  std::vector<DistcpChunk> chunks;
};

// Where one storage_data entry's bytes are (every entry: tensors served or not, bytes items).
struct DistcpStorage {
  std::string key;
  std::string file;
  uint64_t offset = 0;
  uint64_t length = 0;
};

struct DistcpMetadata {
  std::vector<DistcpTensor> tensors;     // in .metadata's order
  std::vector<std::string> bytes_items;  // keys stored as BytesStorageMetadata (not tensors)
  std::vector<DistcpStorage> storage;    // every storage_data entry, in order
};

// Parses `.metadata` bytes, taken by move: the unpickler holds them once, never a copy.
// `what` names the file in messages.
Result<DistcpMetadata> parse_distcp_metadata(std::string&& bytes, std::string_view what);

// What a torch.save archive's data.pkl says of the one tensor it holds.
struct TorchTensorRecord {
  DType dtype = DType::U8;
  std::string storage_key;      // its storage's member: <top>/data/<storage_key>
  uint64_t storage_numel = 0;   // elements in the storage
  uint64_t storage_offset = 0;  // elements before the tensor's first
  std::vector<uint64_t> size;
  std::vector<uint64_t> stride;
  // The tensor is row-major contiguous: its bytes are one run of its storage.
  [[nodiscard]] bool contiguous() const;
};

Result<TorchTensorRecord> parse_torch_tensor_pickle(std::string&& bytes, std::string_view what);
// The same, for a `_rebuild_tensor_v2/v3` call at `ref` inside a larger pickle.
Result<TorchTensorRecord> read_rebuild_tensor(const pickle::Pickle& p, pickle::Ref ref,
                                              std::string_view what);

// Where the tensor `r` describes starts in archive `a` (from the archive's first byte): its
// storage member, checked to hold the tensor; a non-contiguous layout is refused by name.
Result<uint64_t> tensor_offset_in_archive(const zip::TorchArchive& a, const TorchTensorRecord& r,
                                          std::string_view what);

// A torch dtype's attribute name ("float32", "bfloat16") or legacy storage class
// ("FloatStorage", "BFloat16Storage") as a safetensors dtype.
std::optional<DType> torch_dtype(std::string_view name);
std::optional<DType> torch_storage_dtype(std::string_view storage_class);

}  // namespace ckptfs::format
