// The checkpoint model: tensors, their chunks in rank shard files, and the consolidated
// files synthesized from them. Pure data and arithmetic: no I/O happens in this layer, so
// every rule here is tested without touching a disk.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ckptfs/format/dcp.hpp"
#include "ckptfs/format/dtype.hpp"
#include "ckptfs/format/index.hpp"
#include "ckptfs/format/model_map.hpp"
#include "ckptfs/format/names.hpp"
#include "ckptfs/format/safetensors.hpp"
#include "ckptfs/util/result.hpp"

namespace ckptfs::layout {

// Identity of a backing file when its header was read; used to revalidate cheaply and to
// refuse serving bytes from a file that was replaced since.
struct FileStamp {
  uint64_t dev = 0;
  uint64_t ino = 0;
  uint64_t size = 0;
  int64_t mtime_ns = 0;
  int64_t ctime_ns = 0;
  bool operator==(const FileStamp&) const = default;
};

// Owner and permission bits of a shard (st_mode's low 12 bits), for who may read what the
// view makes of it.
struct Access {
  uint32_t uid = 0, gid = 0, mode = 0;
  bool operator==(const Access&) const = default;
};

// One rank shard file as handed to the builder (already parsed by the source layer).
struct ShardInput {
  std::string name;  // file name relative to the checkpoint directory
  FileStamp stamp;
  std::shared_ptr<const format::Header> header;  // null when unreadable; see `error`
  std::string error;                             // why the header could not be used
  // A shard on a node-local target (a version 2 commit record): the MPI rank that holds it
  // and its path below that rank's target. -1: a file in the checkpoint directory.
  int32_t owner = -1;
  std::string remote_path;
  // Owner and mode: a local shard's file's, a node-local shard's record's (the writer's).
  Access access;
  int64_t atime_ns = 0;  // its access time (not part of the stamp: reads move it)
};

struct ShardFile {
  std::string name;
  FileStamp stamp;
  uint64_t data_start = 0;  // 8 + N
  format::ShardName parsed;
  int32_t owner = -1;  // as in ShardInput: not in the directory but on rank `owner`'s target
  std::string remote_path;
  Access access;         // as in ShardInput
  int64_t atime_ns = 0;  // as in ShardInput

  [[nodiscard]] bool remote() const { return owner >= 0; }
};

// Where a copy of a replicated chunk lives (kept for `verify --data`).
struct Replica {
  uint32_t shard = 0;
  uint64_t file_offset = 0;
};

struct Chunk {
  uint32_t shard = 0;        // index into Checkpoint::shards
  uint64_t file_offset = 0;  // absolute offset of the chunk's bytes in the shard file
  std::vector<uint64_t> offsets;
  std::vector<uint64_t> sizes;
  std::vector<Replica> replicas;
  uint32_t run_dim = 0;  // innermost dim not fully covered (0 if all are)
};

// Accelerates "which chunk holds this coordinate": per-dim boundaries and a dense cell
// table. Absent (empty cells) for very irregular grids, where a scan is used instead.
struct ChunkGrid {
  std::vector<std::vector<uint64_t>> bounds;  // per dim, sorted, includes 0 and shape[d]
  std::vector<uint32_t> cell_chunk;           // row-major over cells
};

// A run of a tensor made by a model map (layout/model_map): `count` blocks of `len` elements,
// block b read from element `src_elem + b * stride` of stored tensor `src` (an index into
// Checkpoint::stored), placed one after another from element `out_elem` of the mapped tensor.
// That pattern is repeated `reps` times, repetition q starting at stored element `src_elem +
// q * rep_stride`: a transposed matrix [R, C] is one run (len 1, count R, stride C, reps C,
// rep_stride 1), so its runs stay as few as its leading blocks.
struct MapRun {
  uint32_t src = 0;
  uint64_t out_elem = 0;
  uint64_t src_elem = 0;
  uint64_t len = 0;
  uint64_t count = 1;
  uint64_t stride = 0;
  uint64_t reps = 1;
  uint64_t rep_stride = 0;
  [[nodiscard]] uint64_t elems() const { return len * count * reps; }
  bool operator==(const MapRun&) const = default;
};

struct Tensor {
  std::string name;
  // The dtype served (header, sizes, bytes) and the dtype its chunks hold in the shards. They
  // differ only for a cast view (BuildOptions::dtype_policy); both are then format::castable.
  format::DType dtype = format::DType::U8;
  format::DType src_dtype = format::DType::U8;
  std::vector<uint64_t> shape;
  std::vector<uint64_t> strides;  // row-major element strides of the full tensor
  std::vector<Chunk> chunks;
  ChunkGrid grid;
  uint32_t output = 0;      // index into Checkpoint::outputs
  uint64_t out_offset = 0;  // absolute offset of this tensor's bytes in its output file
  uint64_t nbytes = 0;      // served bytes (numel elements of `dtype`)
  uint64_t numel = 0;

  // Made by a model map: its bytes are `runs` of Checkpoint::stored tensors, and `chunks` is
  // empty. `origin` says which stored tensor and rule made it.
  bool mapped = false;
  std::vector<MapRun> runs;
  std::string origin;

  // A LoRA checkpoint served merged (BuildOptions::lora_merged): this base weight [out, in] is
  // served as W + scale * (B @ A), computed on read (layout/lora.hpp says how it rounds). `a` and
  // `b` index Checkpoint::tensors: lora_A [r, in] and lora_B [out, r], in the hidden output of the
  // factors (format::kLoraFactorsFolder).
  struct Merge {
    uint32_t a = 0, b = 0;
    float scale = 0;
    bool operator==(const Merge&) const = default;
  };
  std::optional<Merge> merge;

  [[nodiscard]] bool is_cast() const { return dtype != src_dtype; }
};

struct OutputFile {
  std::string name;
  // Empty: shown in the checkpoint directory. Else the virtual folder of that directory it is
  // shown in (a LoRA checkpoint's adapter, Checkpoint::adapter): never in the index. A merged
  // LoRA view's factors are in format::kLoraFactorsFolder, which is never shown at all.
  std::string folder;
  uint32_t k = 0;                 // its number in model-k-of-m
  bool written = false;           // header and name from a commit record (written through ckptfs)
  std::vector<uint32_t> tensors;  // in file order
  std::string header;             // serialized: 8-byte length + padded JSON
  uint64_t size = 0;
  std::vector<uint32_t> shards;  // shard files this output reads from (sorted)
  // Non-empty tensors by data offset, for binary search in the extent map.
  std::vector<uint64_t> data_starts;
  std::vector<uint32_t> data_tensors;

  // Its path below the checkpoint directory: `name`, or `folder/name`.
  [[nodiscard]] std::string path() const { return folder.empty() ? name : folder + "/" + name; }
};

// A LoRA checkpoint's adapter (layout/lora.hpp): the folder `dir` of the checkpoint directory
// shows the output numbered `k` (adapter_model.safetensors) and `config_json`
// (adapter_config.json); the base model's outputs and the index stay in the directory itself.
struct Adapter {
  std::string dir;
  uint32_t k = 0;
  std::string config_json;
  uint32_t base_tensors = 0, adapter_tensors = 0, layers = 0;
  std::string note;  // what inspect says of the split
};

// A problem found while building. `file` and `tensor` are empty when not applicable.
struct Problem {
  std::string file;
  std::string tensor;
  std::string message;
  [[nodiscard]] std::string to_string() const;
};

struct Checkpoint {
  std::string dir;  // for messages
  // What the shards are: "safetensors rank shards", or Declared::format. When declared, the
  // declaring index lists every tensor (completeness evidence).
  std::string format = "safetensors rank shards";
  bool declared = false;
  std::vector<ShardFile> shards;
  std::vector<Tensor> tensors;
  std::vector<OutputFile> outputs;
  std::string index_json;
  std::vector<Problem> problems;
  // What the source layer ignored while reading it (stale or untrusted commit records): worth
  // a log line, not a reason to refuse.
  std::vector<std::string> notes;
  // What the source chose not to serve (a native checkpoint's optimizer state, non-tensor
  // items): `inspect` lists it; nothing is wrong.
  std::vector<std::string> left_out;
  bool from_mapping = false;  // output assignment came from fqn_to_file_index_mapping.json
  // Tensors whose full shape the shards store; the others' is inferred from their chunks (as
  // every reader does), so a missing last chunk cannot be told from a smaller tensor.
  uint32_t shapes_stored = 0;
  // A model map applied (docs/maps.md): its name, and the stored tensors the mapped ones read.
  // `map_note` says why a map was not applied where one was detected (no config.json).
  std::string map;
  std::vector<Tensor> stored;
  std::string map_note;
  // No map applied, and a stored name is a trainer's own (`native_name`, one a built-in map
  // reads: layout/map_report.hpp): `map_trials` says, per built-in map, why it does not apply.
  // The view then shows no config.json, so from_pretrained fails instead of building a model
  // of random weights.
  std::string native_name;
  std::vector<std::string> map_trials;
  [[nodiscard]] bool unmapped_native() const { return map.empty() && !native_name.empty(); }
  // config.json as the view shows it when it came from BuildOptions::hf_config (the directory
  // has none of its own) or a map's hf_config template; empty otherwise. `config_from` says
  // which ("-o hf_config=PATH", "map 'megatron-gpt' from iter_0000010/run_config.yaml
  // (Megatron-Bridge's model config)"), for inspect.
  std::string config_json;
  std::string config_from;
  // Some output was written through ckptfs (has a commit record): the directory's own index
  // file, if it has one, is the real one and none is synthesized.
  bool written = false;
  // A LoRA split applied (BuildInput::lora): where the adapter is shown. `index_json` is then
  // the base model's only, and empty when no base tensor was stored (verl's save_lora_only).
  std::optional<Adapter> adapter;
  // A LoRA split served merged instead (BuildOptions::lora_merged): what inspect says of it;
  // empty otherwise. `adapter` is then unset.
  std::string lora_merged;

  [[nodiscard]] bool valid() const { return problems.empty(); }
  // Every output was written through ckptfs and committed: its records prove it complete, so
  // it needs no settle time.
  [[nodiscard]] bool all_written() const {
    return !outputs.empty() && std::all_of(outputs.begin(), outputs.end(),
                                           [](const OutputFile& f) { return f.written; });
  }
  // The tensors whose chunks are in the shard files: the stored ones when a map applied.
  [[nodiscard]] const std::vector<Tensor>& chunked() const {
    return map.empty() ? tensors : stored;
  }
  [[nodiscard]] uint64_t total_bytes() const;
  // The output shown as `name` in the checkpoint directory itself (never one in a folder).
  [[nodiscard]] const OutputFile* find_output(std::string_view name) const;
};

struct BuildOptions {
  // Safetensors __metadata__ of the synthesized files (transformers accepts "pt").
  std::map<std::string, std::string> output_metadata = {{"format", "pt"}};
  // Grid cells allowed per tensor before falling back to a scan.
  uint64_t max_grid_cells = 1u << 22;
  // Which dtype each tensor is served in. Stored: as the shards hold it. Mapping: the dtype
  // NeMo's fqn_to_dtype_mapping.json names (BuildInput::dtypes), where both it and the stored
  // dtype are castable (F16, BF16, F32, F64); other tensors as stored. Cast: every tensor of
  // a castable dtype as `cast_to`, the rest as stored. Outputs written through ckptfs (commit
  // records) are never cast: their headers are the files written.
  enum class DtypePolicy : uint8_t { Stored, Mapping, Cast };
  DtypePolicy dtype_policy = DtypePolicy::Stored;
  format::DType cast_to = format::DType::F32;  // for Cast; must be castable
  // Model maps (docs/maps.md). `map`: the one named (-o map=), applied to every checkpoint not
  // written through ckptfs; null: built-ins are detected. `no_map`: map=none, nothing applied.
  // `hf_config`: config.json text for checkpoints without their own (-o hf_config=).
  std::shared_ptr<const format::ModelMap> map;
  bool no_map = false;
  std::string hf_config;
  std::string hf_config_what;  // its path, for messages
  // A PEFT LoRA state dict (BuildInput::lora) is served merged (-o lora=merged): the directory
  // shows the model PEFT's merge_and_unload() gives, and no adapter folder. With no base weight
  // stored (verl's save_lora_only) the adapter is shown as without it.
  bool lora_merged = false;
};

// How `-o hf_config` is named where it gave config.json (Checkpoint::config_from).
inline std::string hf_config_origin(const BuildOptions& o) {
  std::string s = "-o hf_config";
  if (!o.hf_config_what.empty()) {
    s += '=';
    s += o.hf_config_what;
  }
  return s;
}

// Sets the dtype policy from an option value: "auto" (NeMo's mapping), "stored", or a cast
// to "bf16", "fp16" or "fp32" (also "bfloat16", "float16"/"f16", "float32"/"f32").
Status set_dtype_policy(BuildOptions& opts, std::string_view value);

// A consolidated file written through ckptfs: its exact name and header bytes replace the
// synthesized ones for output k. The header must describe exactly that output's tensors.
struct OutputOverride {
  uint32_t k = 0;
  std::string name;
  std::string header;  // 8 + N bytes
  std::shared_ptr<const format::Header> parsed;
  std::string record;  // the record's file name, for messages
};

// Chunks that a checkpoint-wide index declares (torch DCP's `.metadata`), where the shard files
// have no headers of their own: BuildInput::shards are then those files, in this order (their
// `header` unused), and output files are numbered 1..outputs by the chunks' `k`.
struct DeclaredChunk {
  uint32_t shard = 0;  // index into BuildInput::shards
  std::string tensor;  // the name served
  format::DType dtype = format::DType::U8;
  uint64_t file_offset = 0;  // absolute offset of the chunk's bytes in the file
  std::vector<uint64_t> offsets;
  std::vector<uint64_t> sizes;
  std::optional<std::vector<uint64_t>> full_shape;
  uint32_t k = 1;  // output file number
};

struct Declared {
  std::string format;  // what declared them, for Checkpoint::format ("torch DCP (.metadata)")
  std::vector<DeclaredChunk> chunks;
  uint32_t outputs = 1;
};

// A PEFT LoRA model's state dict (verl with lora_rank > 0: lora_train_meta.json beside the rank
// files), to be split into the base model and the adapter (layout/lora.hpp).
struct LoraInput {
  std::string file;  // lora_train_meta.json, for messages
  uint32_t r = 0;
  int64_t lora_alpha = 0;
  std::optional<std::string> task_type;
};

struct BuildInput {
  std::string dir;
  std::vector<ShardInput> shards;
  std::optional<format::FqnMapping> mapping;   // .hf_metadata/fqn_to_file_index_mapping.json
  std::optional<format::DtypeMapping> dtypes;  // .hf_metadata/fqn_to_dtype_mapping.json
  std::vector<Problem> problems;               // found before building (unreadable mapping...)
  std::vector<std::string> notes;              // see Checkpoint::notes
  std::vector<std::string> left_out;           // see Checkpoint::left_out
  std::vector<OutputOverride> overrides;
  std::optional<Declared> declared;  // set: a checkpoint-wide index declares the chunks
  // The directory's own config.json (for model maps), read by the source; empty when none.
  std::string config;
  // A model config the checkpoint carries in its own format (Megatron-LM's `args` in common.pt),
  // as a JSON object's text, for a map's `hf_config` template; empty when none. `native_what`
  // names it ("common.pt (Megatron-LM's args)"); `native_problem` says why one that is there
  // could not be read (it then sizes nothing).
  std::string native_config;
  std::string native_what;
  std::string native_problem;
  // Set: the tensors are a PEFT LoRA state dict, split into base and adapter (no model map).
  std::optional<LoraInput> lora;
};

// save_pretrained's "5GB": the most bytes the native sources and the maps put in one output.
inline constexpr uint64_t kMaxOutputBytes = 5'000'000'000;

// Packs tensors, in order, into output files of at most kMaxOutputBytes each (a larger tensor
// has a file of its own): how many files a native or mapped checkpoint's view shows.
class OutputPacker {
 public:
  // The output file (1-based) a tensor of `bytes` goes in, placed after the previous ones.
  uint32_t place(uint64_t bytes);
  [[nodiscard]] uint32_t outputs() const { return k_; }

 private:
  uint32_t k_ = 1;
  uint64_t in_k_ = 0;  // bytes already in file k_
};

// Builds and validates the model. Never fails: every problem is recorded in `problems`, and
// a checkpoint with problems has no outputs (it is never presented as complete).
std::shared_ptr<const Checkpoint> build_checkpoint(BuildInput in, const BuildOptions& opts = {});

}  // namespace ckptfs::layout
