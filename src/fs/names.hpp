// fs/names: the one list of the names the view hides or reserves, and where each rule applies.
#pragma once

#include <string_view>

#include "ckptfs/format/names.hpp"
#include "ckptfs/fs/filesystem.hpp"

namespace ckptfs::fs::names {

// The write path's state directory: hidden everywhere, and reserved (never made or used
// through the mount).
inline bool is_state(std::string_view n) { return n == format::kStateDirName; }

// The daemon's status directory (kStatusDirName) is found at the root of the mount only.
inline bool is_status_dir(Ino dir, std::string_view n) {
  return dir == kRootIno && n == kStatusDirName;
}

using format::kNemoConsolidateScript;  // hidden in a checkpoint directory

// Listed in a checkpoint directory while it settles: a read-only file saying what it waits for.
inline constexpr std::string_view kPending = ".ckptfs-pending";

// The mapping files of .hf_metadata/: read by the view, never shown.
inline bool is_mapping_file(std::string_view n) {
  return n == format::kFqnMappingFileName || n == format::kFqnDtypeMappingFileName;
}

// Names whose lookup needs the directory's current view (built, settled): the consolidated
// names, config.json (the view may supply it, or hide it over names no map serves) and a LoRA
// checkpoint's adapter folder.
inline bool needs_view(std::string_view n) {
  return format::is_model_output_name(n) || n == "config.json" || n == format::kLoraAdapterDir;
}

// THE list: names a checkpoint directory hides whatever the entry is: its shards, .hf_metadata,
// real files that the synthesized ones replace (model names), NeMo's script, and kPending.
inline bool hidden_in_checkpoint(std::string_view n) {
  return format::looks_like_shard_name(n) || n == format::kHfMetadataDir ||
         n == kNemoConsolidateScript || n == kPending || format::is_model_output_name(n);
}

// Left out of a checkpoint directory's listing: the list above and, with show_shards, a real
// entry named like the .shards folder (it is listed inside that folder instead, so no name is
// shown twice).
inline bool hidden_in_listing(std::string_view n, bool show_shards) {
  return hidden_in_checkpoint(n) || (show_shards && n == kShardsDirName);
}

// Listed and found in the .shards folder: what the listing leaves out but .hf_metadata (whose
// files are lifted into the directory instead).
inline bool in_shards_folder(std::string_view n, bool show_shards) {
  return hidden_in_listing(n, show_shards) && n != format::kHfMetadataDir;
}

// Never lifted from .hf_metadata/ (or verl's huggingface/) into a listing: the mapping files,
// and the names a checkpoint directory hides or shows itself.
inline bool never_lifted(std::string_view n) {
  return is_mapping_file(n) || hidden_in_checkpoint(n) || n == kShardsDirName;
}

// The name in directory `rel` (relative to SRC) that must never be stat'ed: the last component
// of `hide_rel` (Options::hide_rel, the mount point inside SRC) when `rel` is its directory.
inline std::string_view hidden_child(std::string_view hide_rel, std::string_view rel) {
  if (hide_rel.empty()) return {};
  if (rel.empty())
    return hide_rel.find('/') == std::string_view::npos ? hide_rel : std::string_view();
  if (hide_rel.size() > rel.size() + 1 && hide_rel.starts_with(rel) &&
      hide_rel[rel.size()] == '/' && hide_rel.find('/', rel.size() + 1) == std::string_view::npos) {
    return hide_rel.substr(rel.size() + 1);
  }
  return {};
}

}  // namespace ckptfs::fs::names
