// The commit record of a consolidated file written through the mount and stored as rank
// shards: what makes the shards that file again, byte for byte.
//
// Stored as <dir>/.ckptfs/<name>.commit, renamed into place last (its rename is the commit
// point). It holds the original header bytes, so a read of the file returns exactly what the
// writer wrote (key order, __metadata__, padding), and the shard files with their sizes, so a
// record that no longer describes the directory is recognised and ignored.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ckptfs/format/safetensors.hpp"
#include "ckptfs/util/result.hpp"

namespace ckptfs::format {

// The hidden directory of the write path, in every directory that holds written files.
inline constexpr std::string_view kStateDirName = ".ckptfs";
// A daemon's temporary file in a state directory ("unshare-<pid>-<n>", write/dedup): under
// flock while it is in use; the recovery of its directory removes one that nobody holds.
inline constexpr std::string_view kScratchPrefix = "unshare-";
inline constexpr std::string_view kRecordSuffix = ".commit";
// Version 1: every shard is a file in the record's directory. Version 2 (written by the
// OpenMPI flusher with node-local targets, -o target=): every shard lives on its owner's
// node-local target, and the record says which rank owns it, where and what its header is.
inline constexpr uint32_t kRecordVersion = 1;
inline constexpr uint32_t kRecordVersionRemote = 2;
// Owners are MPI ranks; shard names carry 5 digits.
inline constexpr uint32_t kMaxRecordOwner = 99'999;

struct RecordShard {
  std::string name;  // shard-R-model-K-of-M.safetensors, in the record's directory
  uint64_t size = 0;
  // Node-local shards (version 2) only. `owner`: the MPI rank whose target holds the shard;
  // `path`: where, relative to that target's root (plain components, ending in `name`);
  // `header`: the shard's 8 + N header bytes (the view is built from them without reading
  // the shard), parsed into `parsed` by parse_record.
  int32_t owner = -1;
  std::string path;
  std::string header;
  std::shared_ptr<const Header> parsed;

  [[nodiscard]] bool remote() const { return owner >= 0; }
};

struct Record {
  std::string name;  // the file's name as written (model.safetensors, model-0000k-of-...)
  uint32_t k = 1, m = 1;
  uint64_t size = 0;   // the file's size
  std::string header;  // the original 8 + N header bytes
  // Staging directory (under .ckptfs/) the shards are moved from after the commit; while it
  // exists the commit is still being rolled forward and the shards may be a mix.
  std::string tx;
  std::vector<RecordShard> shards;  // in rank order
  Header parsed;                    // `header` parsed (set by parse_record; not serialized)
  // The file's owner and permission bits when it was committed (the writer's). The view of a
  // node-local record shows and enforces them (no shard file in SRC carries them); a local
  // record's shards carry them too. Absent from records of older versions of ckptfs.
  bool has_owner = false;
  uint32_t uid = 0, gid = 0, mode = 0;

  // Its shards live on node-local targets (every shard has an owner; version 2).
  [[nodiscard]] bool remote() const { return !shards.empty() && shards.front().remote(); }
};

std::string serialize_record(const Record& r);
// Checks the JSON and that the header bytes parse as a safetensors header of `size` bytes,
// named model-k-of-m or model.safetensors consistently with k and m, and that the shard names
// belong to that k and m. Version 2 also: every shard has an owner below kMaxRecordOwner, a
// path of plain components (no "..", ".", empty or absolute) ending in its name, and header
// bytes that parse as a safetensors header of its size; a record never mixes local and remote
// shards. `what` names the record in errors.
Result<Record> parse_record(std::string_view text, std::string_view what);

// The record file name for a file.
std::string record_file_name(std::string_view file_name);

// The names file `file_name` (model-k-of-m) occupies once committed as `ranks` rank shards,
// relative to its directory: its shard files in rank order, then its record (under
// kStateDirName).
std::vector<std::string> stored_names(std::string_view file_name, uint32_t k, uint32_t m,
                                      uint32_t ranks);

// The file a record file name stands for, record_file_name's inverse: "model.safetensors" for
// "model.safetensors.commit" (also as ".ckptfs/model.safetensors.commit", the path
// source::record_files gives); nullopt for a name that is no record's (no suffix, or nothing
// before it). The one parser of record names.
std::optional<std::string_view> parse_record_name(std::string_view name);

}  // namespace ckptfs::format
