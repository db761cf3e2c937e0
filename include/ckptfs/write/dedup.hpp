// write/dedup: one stored copy of a consolidator's output. A consolidated file closed beside
// the rank shards it was made from is stored as hard links of those shards, once its bytes are
// checked equal to their view.
//
// Two layouts, each a writer's own (origin_of says which applies to a directory):
//   OUT/model-*.safetensors beside OUT/sharded/ (kOriginDir): torch DCP's enable_consolidation
//     and torchtitan's last_save_in_hf;
//   MODEL/consolidated/ (kConsolidatedDir) below MODEL/'s rank shards: NeMo AutoModel's
//     save_consolidated. The origin is the directory above the output.
//
// torch DCP's HuggingFaceStorageWriter(enable_consolidation=True) and torchtitan's
// last_save_in_hf write rank shards into OUT/sharded/ (safetensors with DCP_SHARDING_INFO, which
// ckptfs serves as the consolidated files), then read them back and write the same consolidated
// files into OUT. Stored as they are written, the checkpoint would take its bytes twice. After
// the close (on the split-after-close thread, write/resplit), stage_links() builds the view of
// OUT/sharded/ as the mount shows it, reads the file's name there range by range (one byte
// geometry: layout::map_range and io::gather) and compares it with the file as written, header
// and data. Only if every byte is equal are the shards of that name (every rank's, those that hold
// no tensor of it included) linked into a new staging (Transaction::adopt), which
// commit_resplit then makes the file's stored form: OUT/shard-r-model-k-of-m.safetensors are
// the same inodes as OUT/sharded/'s, and the file's own bytes go. The two names then share their
// inodes: removing either directory leaves the other whole; a chmod, chown or utimens of one
// shows in the other (the commit gives the shards the file's own); a shard of the origin opened
// for writing through the mount first gives the stored file its own copy (unshare_stored).
#pragma once

#include <sys/stat.h>

#include <optional>
#include <string>
#include <string_view>

#include "ckptfs/flush/flusher.hpp"
#include "ckptfs/util/result.hpp"
#include "ckptfs/write/resplit.hpp"

namespace ckptfs::write {

// Where torch leaves the rank shards its output is made from, below the output's directory.
inline constexpr std::string_view kOriginDir = "sharded";
// Where NeMo writes its output, below the directory of the rank shards it is made from.
inline constexpr std::string_view kConsolidatedDir = "consolidated";

// Which directory a file closed in the directory `rel` (beneath SRC, "" for its root) may have
// been made from: its kOriginDir (torch) if `dirfd` has one (not a symlink), else, where `rel`
// ends in kConsolidatedDir, the directory above (NeMo). The cheap test: a stat at most.
enum class Origin { None, Below, Above };
Origin origin_of(int dirfd, std::string_view rel);

// The shards of `origin` (the directory origin_of named, open; `origin_display` names it)
// staged as `job`'s file's rank shards (hard links), when that name's view there reads exactly
// as the file; nullopt when not (another file, a byte that differs, a shard that changed
// meanwhile: logged at debug or info). Errors are the staging's.
Result<std::optional<StagedResplit>> stage_links(const ResplitJob& job, int origin,
                                                 const std::string& origin_display,
                                                 flush::Flusher& flusher);

// A new name for a scratch file of this daemon's in a state directory (format::kScratchPrefix,
// the pid, a counter): recovery (flush/local) removes one that nobody holds under flock, and
// never one of its own process's.
std::string scratch_name();

// File `name` of an origin, or of where it was renamed (its fstat `st`), about to be written
// through the mount: where directory `stored` (the one above for torch's layout, one below for
// NeMo's) stores a file as links of it, that stored shard gets a copy of its own first (same
// bytes, owner, mode and times, renamed over it), so a new save of the origin never changes, or
// truncates, what the other directory stored. Nothing to do when `stored`'s `name` is another
// file, or `stored` holds no state of this daemon's.
Status unshare_stored(int stored, const std::string& name, const struct stat& st,
                      const std::string& what);

// The same file about to be truncated (an open with O_TRUNC) in directory `dir`: where `stored`
// stores it as links, `dir`'s `name` becomes a new empty file instead (st's owner and mode,
// renamed over it), and no byte is copied: the truncate would have discarded them. True when
// it did; the opener must then open the name again (it is another file now).
Result<bool> detach_truncated(int stored, int dir, const std::string& name, const struct stat& st,
                              const std::string& what);

}  // namespace ckptfs::write
