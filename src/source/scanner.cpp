// source/scanner: lists source directories, caches shard headers and builds their checkpoints.
#include "ckptfs/source/scanner.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <unordered_map>

#include <spdlog/spdlog.h>

#include "ckptfs/format/index.hpp"
#include "ckptfs/format/megatron_args.hpp"
#include "ckptfs/format/names.hpp"
#include "ckptfs/format/record.hpp"
#include "ckptfs/format/transformer_config.hpp"
#include "ckptfs/source/distcp.hpp"
#include "ckptfs/source/maps.hpp"
#include "ckptfs/source/verl.hpp"
#include "ckptfs/util/fd.hpp"
#include "ckptfs/util/path.hpp"

namespace ckptfs::source {
namespace {

constexpr uint64_t kTrimAfterHeaderBytes = 8ull << 20;

const std::string kMappingRel =
    std::string(format::kHfMetadataDir) + "/" + std::string(format::kFqnMappingFileName);
const std::string kDtypeMappingRel =
    std::string(format::kHfMetadataDir) + "/" + std::string(format::kFqnDtypeMappingFileName);

}  // namespace

Result<std::vector<DirEntry>> list_dir(int dirfd, std::string_view skip) {
  int dup = ::openat(dirfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dup < 0) {
    int e = errno;
    return make_error(e, "cannot open directory: {}", std::strerror(e));
  }
  DIR* d = ::fdopendir(dup);
  if (!d) {
    int e = errno;
    ::close(dup);
    return make_error(e, "cannot read directory: {}", std::strerror(e));
  }
  std::vector<DirEntry> out;
  errno = 0;
  while (struct dirent* de = ::readdir(d)) {
    std::string_view name(de->d_name);
    if (name == "." || name == ".." || (!skip.empty() && name == skip)) continue;
    DirEntry e;
    e.name = std::string(name);
    if (::fstatat(dirfd, de->d_name, &e.st, AT_SYMLINK_NOFOLLOW) != 0) continue;  // raced away
    out.push_back(std::move(e));
  }
  ::closedir(d);
  std::sort(out.begin(), out.end(),
            [](const DirEntry& a, const DirEntry& b) { return a.name < b.name; });
  return out;
}

Result<std::vector<DirEntry>> list_checkpoint_dir(int dirfd, std::string_view skip) {
  CKPTFS_TRY(auto entries, list_dir(dirfd, skip));
  auto sub = std::find_if(entries.begin(), entries.end(), [](const DirEntry& e) {
    return e.name == kAccelerateModelDir && S_ISDIR(e.st.st_mode);
  });
  if (sub == entries.end()) return entries;
  auto fd = open_at(dirfd, std::string(kAccelerateModelDir), O_RDONLY | O_DIRECTORY | O_NOFOLLOW);
  if (!fd) return entries;  // raced away or unreadable: not part of the checkpoint
  auto inner = list_dir(fd->get());
  if (!inner) return entries;
  std::vector<DirEntry> nested;
  for (auto& e : *inner) {
    if (!is_distcp_entry(e)) continue;
    e.name = std::string(kAccelerateModelDir) + "/" + e.name;
    nested.push_back(std::move(e));
  }
  entries.insert(entries.end(), std::make_move_iterator(nested.begin()),
                 std::make_move_iterator(nested.end()));
  std::sort(entries.begin(), entries.end(),
            [](const DirEntry& a, const DirEntry& b) { return a.name < b.name; });
  return entries;
}

layout::FileStamp stamp_of(const struct stat& st) {
  return layout::FileStamp{static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino),
                           static_cast<uint64_t>(st.st_size), mtime_ns(st), ctime_ns(st)};
}

bool is_shard_entry(const DirEntry& e) { return format::looks_like_shard_name(e.name); }

bool is_rank_shard(const DirEntry& e) {
  return S_ISREG(e.st.st_mode) && format::parse_shard_name(e.name).has_value();
}

bool has_shards(const std::vector<DirEntry>& entries) {
  return std::any_of(entries.begin(), entries.end(), is_rank_shard);
}

bool has_remote_records(int dirfd, const std::vector<DirEntry>& entries) {
  for (const auto& [rel, st] : record_files(dirfd, entries)) {
    auto text = read_small_file_beneath(dirfd, rel, format::kMaxSideFileSize);
    if (!text) continue;
    // Cheap test first: only a version 2 record names an owner.
    if (text->find("\"owner\"") == std::string::npos) continue;
    if (auto rec = format::parse_record(*text, rel); rec && rec->remote()) return true;
  }
  return false;
}

bool is_checkpoint_dir(int dirfd, const std::vector<DirEntry>& entries) {
  return has_shards(entries) || is_distcp_dir(entries) || is_verl_dir(entries) ||
         is_accelerate_dir(entries) || has_remote_records(dirfd, entries);
}

bool is_input_entry(const DirEntry& e) {
  return is_shard_entry(e) || is_distcp_entry(e) || is_verl_entry(e) ||
         (e.name == kAccelerateModelDir && S_ISDIR(e.st.st_mode));
}

bool trusted_state(const struct stat& st) {
  return (st.st_uid == 0 || st.st_uid == ::geteuid()) && (st.st_mode & (S_IWGRP | S_IWOTH)) == 0;
}

std::vector<std::pair<std::string, struct stat>> record_files(int dirfd,
                                                              const std::vector<DirEntry>& entries,
                                                              size_t* untrusted) {
  std::vector<std::pair<std::string, struct stat>> out;
  const bool has_state = std::any_of(entries.begin(), entries.end(), [](const DirEntry& e) {
    return e.name == format::kStateDirName && S_ISDIR(e.st.st_mode);
  });
  if (!has_state) return out;
  auto fd = open_at(dirfd, std::string(format::kStateDirName), O_RDONLY | O_DIRECTORY | O_NOFOLLOW);
  if (!fd) return out;
  struct stat sst {};
  if (::fstat(fd->get(), &sst) != 0) return out;
  auto list = list_dir(fd->get());
  if (!list) return out;
  const bool dir_ok = trusted_state(sst);
  for (auto& e : *list) {
    if (!S_ISREG(e.st.st_mode) || !format::parse_record_name(e.name)) continue;
    if (!dir_ok || !trusted_state(e.st)) {
      if (untrusted) ++*untrusted;
      continue;
    }
    out.emplace_back(std::string(format::kStateDirName) + "/" + e.name, e.st);
  }
  return out;
}

Signature signature_of(int dirfd, const std::vector<DirEntry>& entries) {
  Signature sig;
  for (const auto& e : entries) {
    if (!is_input_entry(e)) continue;
    sig.files.emplace_back(e.name, stamp_of(e.st));
    sig.newest_mtime_ns = std::max(sig.newest_mtime_ns, mtime_ns(e.st));
    sig.newest_change_ns = std::max({sig.newest_change_ns, mtime_ns(e.st), ctime_ns(e.st)});
  }
  for (const auto& [rel, st] : record_files(dirfd, entries)) {
    sig.files.emplace_back(rel, stamp_of(st));
    sig.newest_mtime_ns = std::max(sig.newest_mtime_ns, mtime_ns(st));
    sig.newest_change_ns = std::max({sig.newest_change_ns, mtime_ns(st), ctime_ns(st)});
  }
  // A DCP checkpoint's config.json sizes its model map (read_dir_config): a change rebuilds.
  // (Not accelerate's CKPT/config.json: that layout's inputs all sit in its folder, and it has
  // no close evidence of its own; one file of CKPT would count as evidence for them all.)
  // So do Megatron-LM's common.pt and Megatron-Bridge's run_config.yaml (the model config a
  // map's config.json is made of).
  if (is_distcp_dir(entries)) {
    for (const auto& e : entries) {
      if (e.name != "config.json" && e.name != format::kMegatronCommonName &&
          e.name != format::kBridgeRunConfigName) {
        continue;
      }
      sig.files.emplace_back(e.name, stamp_of(e.st));
    }
  }
  for (const auto* rel : {&kMappingRel, &kDtypeMappingRel}) {
    if (auto st = stat_beneath(dirfd, *rel); st.ok()) {
      sig.files.emplace_back(*rel, stamp_of(*st));
      sig.newest_mtime_ns = std::max(sig.newest_mtime_ns, mtime_ns(*st));
      sig.newest_change_ns = std::max({sig.newest_change_ns, mtime_ns(*st), ctime_ns(*st)});
    }
  }
  return sig;
}

namespace {

// What an entry keeps alive, roughly: the parsed names, shapes and metadata.
uint64_t approx_bytes(const HeaderCache::Entry& e) {
  uint64_t n = 256 + e.error.size();
  if (const auto* h = e.header.get()) {
    n += sizeof(format::Header);
    for (const auto& t : h->tensors) {
      n += sizeof(format::TensorEntry) + t.name.size() + t.shape.size() * sizeof(uint64_t);
    }
    for (const auto& [k, v] : h->metadata) n += 64 + k.size() + v.size();
  }
  return n;
}

}  // namespace

std::optional<HeaderCache::Entry> HeaderCache::find(const layout::FileStamp& s) {
  std::lock_guard lock(mu_);
  auto it = map_.find({s.dev, s.ino});
  if (it == map_.end() || !(it->second.stamp == s)) return std::nullopt;
  lru_.splice(lru_.begin(), lru_, it->second.lru);
  return it->second.entry;
}

void HeaderCache::put(const layout::FileStamp& s, Entry e) {
  const uint64_t n = approx_bytes(e);
  std::lock_guard lock(mu_);
  if (auto it = map_.find({s.dev, s.ino}); it != map_.end()) erase_locked(it);
  if (n > max_bytes_) return;  // the View holding it is enough; re-read if it changes
  while (bytes_ + n > max_bytes_ && !lru_.empty()) erase_locked(map_.find(lru_.back()));
  lru_.push_front({s.dev, s.ino});
  map_.emplace(lru_.front(), Item{s, std::move(e), n, lru_.begin()});
  bytes_ += n;
}

void HeaderCache::evict(const layout::FileStamp& s) {
  std::lock_guard lock(mu_);
  if (auto it = map_.find({s.dev, s.ino}); it != map_.end() && it->second.stamp == s) {
    erase_locked(it);
  }
}

void HeaderCache::erase_locked(std::map<Key, Item>::iterator it) {
  bytes_ -= it->second.bytes;
  lru_.erase(it->second.lru);
  map_.erase(it);
}

uint64_t HeaderCache::bytes() const {
  std::lock_guard lock(mu_);
  return bytes_;
}

std::shared_ptr<const layout::Checkpoint> load_checkpoint(int dirfd,
                                                          const std::vector<DirEntry>& entries,
                                                          const std::string& display,
                                                          HeaderCache& cache,
                                                          const layout::BuildOptions& opts) {
  return layout::build_checkpoint(read_input(dirfd, entries, display, cache, opts), opts);
}

static layout::BuildInput read_input_unguarded(int dirfd, const std::vector<DirEntry>& entries,
                                               const std::string& display, HeaderCache& cache,
                                               const layout::BuildOptions& opts);

// Never throws: what a reader throws (memory, most often) is the build's problem.
layout::BuildInput read_input(int dirfd, const std::vector<DirEntry>& entries,
                              const std::string& display, HeaderCache& cache,
                              const layout::BuildOptions& opts) {
  std::string why;
  try {
    return read_input_unguarded(dirfd, entries, display, cache, opts);
  } catch (const std::bad_alloc&) {
    why = "out of memory while reading the checkpoint's files";
  } catch (const std::exception& e) {
    why = fmt::format("reading the checkpoint's files failed: {}", e.what());
  }
  layout::BuildInput in;
  in.dir = display;
  in.problems.push_back({"", "", std::move(why)});
  return in;
}

static layout::BuildInput read_input_unguarded(int dirfd, const std::vector<DirEntry>& entries,
                                               const std::string& display, HeaderCache& cache,
                                               const layout::BuildOptions& opts) {
  layout::BuildInput in;
  in.dir = display;
  if (is_distcp_dir(entries)) {
    read_distcp_input(dirfd, in);
    in.config = read_dir_config(dirfd);
    return in;
  }
  if (is_verl_dir(entries)) {
    read_verl_input(dirfd, entries, in);
    return in;
  }
  if (is_accelerate_dir(entries)) {
    const std::string sub(kAccelerateModelDir);
    auto fd = open_at(dirfd, sub, O_RDONLY | O_DIRECTORY | O_NOFOLLOW);
    if (!fd) {
      in.problems.push_back({sub, "", fd.error().message});
      return in;
    }
    read_distcp_input(fd->get(), in, sub + "/");
    in.config = read_dir_config(dirfd);
    return in;
  }
  for (const auto& e : entries) {
    if (!is_shard_entry(e)) continue;
    layout::ShardInput si;
    si.name = e.name;
    if (!S_ISREG(e.st.st_mode)) {
      si.stamp = stamp_of(e.st);
      si.error = S_ISLNK(e.st.st_mode)
                     ? "is a symlink; shard files must be regular files (symlinks are not followed)"
                 : S_ISDIR(e.st.st_mode) ? "is a directory, not a shard file"
                                         : "is not a regular file";
      in.shards.push_back(std::move(si));
      continue;
    }
    struct stat st {};
    auto fd = open_regular_at(dirfd, e.name, e.name, &st);
    if (!fd) {
      si.stamp = stamp_of(e.st);
      si.error = fd.error().message;
      in.shards.push_back(std::move(si));
      continue;
    }
    si.stamp = stamp_of(st);
    si.access = layout::Access{st.st_uid, st.st_gid, static_cast<uint32_t>(st.st_mode & 07777)};
    si.atime_ns = static_cast<int64_t>(st.st_atim.tv_sec) * 1'000'000'000 + st.st_atim.tv_nsec;
    if (auto hit = cache.find(si.stamp)) {
      si.header = hit->header;
      si.error = hit->error;
    } else {
      auto h = format::read_header(fd->get(), si.stamp.size, e.name);
      if (h.ok() && h->json_len > kTrimAfterHeaderBytes) {
        // Parsing a header that large left tens of MB of freed JSON nodes in malloc's arenas;
        // hand them back so one hostile header does not keep the daemon's RSS up.
        ::malloc_trim(0);
      }
      HeaderCache::Entry ce;
      if (h.ok()) {
        ce.header = std::make_shared<const format::Header>(std::move(h).value());
      } else {
        // The parser already names the file; keep only its explanation.
        std::string msg = h.error().message;
        if (msg.starts_with(e.name + ": ")) msg.erase(0, e.name.size() + 2);
        ce.error = msg;
      }
      cache.put(si.stamp, ce);
      si.header = ce.header;
      si.error = ce.error;
    }
    in.shards.push_back(std::move(si));
  }
  // The mapping is read only from a real .hf_metadata directory: a symlink named .hf_metadata
  // is never followed (as everywhere in the source), so it is as if there were none.
  const bool has_meta_dir = std::any_of(entries.begin(), entries.end(), [](const DirEntry& e) {
    return e.name == format::kHfMetadataDir && S_ISDIR(e.st.st_mode);
  });
  struct stat st {};
  auto mfd = has_meta_dir ? open_regular_beneath(dirfd, kMappingRel, Resolve::Auto, &st)
                          : Result<UniqueFd>(make_error(ENOENT, "no .hf_metadata directory"));
  if (mfd.ok()) {
    std::string text;
    if (static_cast<uint64_t>(st.st_size) > format::kMaxSideFileSize) {
      in.problems.push_back({kMappingRel, "",
                             fmt::format("{} bytes, larger than the {} byte side-file limit",
                                         st.st_size, format::kMaxSideFileSize)});
    } else {
      text.resize(static_cast<size_t>(st.st_size));
      auto rd = pread_exact(mfd->get(), text.data(), text.size(), 0, kMappingRel);
      if (!rd) {
        in.problems.push_back({kMappingRel, "", rd.error().message});
      } else if (auto m = format::parse_fqn_mapping(text, kMappingRel); m.ok()) {
        in.mapping = std::move(m).value();
      } else {
        in.problems.push_back({"", "", m.error().message});
      }
    }
  } else if (mfd.error().code != ENOENT) {
    in.problems.push_back({kMappingRel, "", mfd.error().message});
  }
  // NeMo's dtype mapping, read only when the view serves it (dtype=auto).
  if (has_meta_dir && opts.dtype_policy == layout::BuildOptions::DtypePolicy::Mapping) {
    auto text = read_small_file_beneath(dirfd, kDtypeMappingRel, format::kMaxSideFileSize);
    if (text.ok()) {
      if (auto m = format::parse_dtype_mapping(*text, kDtypeMappingRel); m.ok()) {
        in.dtypes = std::move(m).value();
      } else {
        in.problems.push_back({"", "", m.error().message});
      }
    } else if (text.error().code != ENOENT) {
      in.problems.push_back({"", "", text.error().message});
    }
  }
  read_records(dirfd, entries, display, in);
  return in;
}

void read_records(int dirfd, const std::vector<DirEntry>& entries, const std::string& display,
                  layout::BuildInput& in) {
  size_t untrusted = 0;
  const auto files = record_files(dirfd, entries, &untrusted);
  if (untrusted > 0) {
    in.notes.push_back(fmt::format(
        "{}/{}: {} commit record(s) not read: the directory or the record is not owned by root "
        "or by this daemon's user, or others may write it (only ckptfs writes .ckptfs)",
        display, format::kStateDirName, untrusted));
  }
  if (files.empty()) return;
  // The directory's shards by file number, once: matching is linear in records and entries.
  std::map<std::pair<uint32_t, uint32_t>, std::vector<const DirEntry*>> by_file;
  for (const auto& e : entries) {
    if (auto p = format::parse_shard_name(e.name)) by_file[{p->k, p->m}].push_back(&e);
  }
  std::vector<std::string> stale;
  size_t stale_count = 0;
  for (const auto& [rel, lst] : files) {
    auto text = read_small_file_beneath(dirfd, rel, format::kMaxSideFileSize);
    if (!text) {
      if (text.error().code != ENOENT) in.problems.push_back({"", "", text.error().message});
      continue;  // ENOENT: raced away
    }
    auto rec = format::parse_record(*text, rel);
    if (!rec) {
      in.problems.push_back({"", "", rec.error().message});
      continue;
    }
    if (!rec->tx.empty()) {
      const std::string tx = std::string(format::kStateDirName) + "/" + rec->tx;
      if (stat_beneath(dirfd, tx).ok()) {
        in.problems.push_back(
            {rel, "",
             fmt::format("the commit of {} is still being completed ({} exists); a read-write "
                         "ckptfs mount of this directory finishes it",
                         rec->name, tx)});
        continue;
      }
    }
    // The record must describe the shards there now: every shard of its file, same sizes.
    // One that does not (shards replaced or removed outside ckptfs) is stale and ignored.
    // A record of node-local shards names shards that are not here: then no shard of its file
    // may be here either (they would be a later, local write of the same file).
    std::string why;
    const auto here = by_file.find({rec->k, rec->m});
    const size_t seen = here == by_file.end() ? 0 : here->second.size();
    if (seen > 0 && rec->remote()) {
      why = fmt::format("{} is here, the record says its shards are on node-local targets",
                        here->second.front()->name);
    } else if (seen > 0) {
      std::unordered_map<std::string_view, uint64_t> sizes;
      sizes.reserve(rec->shards.size());
      for (const auto& sh : rec->shards) sizes.emplace(sh.name, sh.size);
      for (const DirEntry* e : here->second) {
        auto it = sizes.find(e->name);
        if (it == sizes.end()) {
          why = fmt::format("{} is not in it", e->name);
        } else if (!S_ISREG(e->st.st_mode) || static_cast<uint64_t>(e->st.st_size) != it->second) {
          why =
              fmt::format("{} is {} bytes, the record says {}", e->name, e->st.st_size, it->second);
        }
        if (!why.empty()) break;
      }
    }
    if (why.empty() && !rec->remote() && seen != rec->shards.size()) {
      why = "some of its shards are missing";
    }
    if (!why.empty()) {
      if (++stale_count <= 3) stale.push_back(fmt::format("{} ({})", rel, why));
      continue;
    }
    if (rec->remote()) {
      // Node-local shards: built from the headers the record carries; their bytes are read
      // from the owning rank (io::ShardReader). Their stamp is the record's, and so are
      // their owner and mode: the writer's, or root's alone for a record that has none.
      for (auto& sh : rec->shards) {
        layout::ShardInput si;
        si.name = sh.name;
        si.stamp = layout::FileStamp{0, 0, sh.size, mtime_ns(lst), ctime_ns(lst)};
        si.header = sh.parsed;
        si.owner = sh.owner;
        si.remote_path = sh.path;
        si.access = rec->has_owner ? layout::Access{rec->uid, rec->gid, rec->mode}
                                   : layout::Access{0, 0, 0400};
        in.shards.push_back(std::move(si));
      }
    }
    layout::OutputOverride o;
    o.k = rec->k;
    o.name = rec->name;
    o.header = std::move(rec->header);
    o.parsed = std::make_shared<const format::Header>(std::move(rec->parsed));
    o.record = rel;
    in.overrides.push_back(std::move(o));
  }
  if (stale_count > 0) {
    std::string list;
    for (const auto& x : stale) list += (list.empty() ? "" : "; ") + x;
    in.notes.push_back(fmt::format("{}: ignoring {} stale commit record(s): {}{}", display,
                                   stale_count, list, stale_count > stale.size() ? "; ..." : ""));
  }
}

Result<std::shared_ptr<const layout::Checkpoint>> load_checkpoint_path(
    const std::string& dir, const layout::BuildOptions& opts) {
  CKPTFS_TRY(UniqueFd fd, open_file(dir, O_RDONLY | O_DIRECTORY));
  CKPTFS_TRY(auto entries, list_checkpoint_dir(fd.get()));
  if (!is_checkpoint_dir(fd.get(), entries)) {
    return make_error(ENOENT,
                      "{}: no rank shard files (shard-R-model-K-of-M.safetensors), no DCP "
                      "checkpoint (.metadata and *.distcp) and no verl FSDP checkpoint "
                      "(fsdp_config.json and model_world_size_W_rank_R.pt)",
                      dir);
  }
  HeaderCache cache;
  return load_checkpoint(fd.get(), entries, dir, cache, opts);
}

namespace {

Status walk(int dirfd, const std::string& path, Found& out, int depth) {
  if (depth > kMaxSearchDepth) {
    out.too_deep.push_back(path);
    return {};
  }
  auto entries = list_checkpoint_dir(dirfd);
  if (!entries) return std::move(entries).error().context(path);
  if (is_checkpoint_dir(dirfd, *entries)) out.dirs.push_back(path);
  // accelerate's checkpoint: its model folder is the checkpoint found here, and its
  // optimizer_N/ folders (DCP checkpoints of optimizer state only) are training state.
  const bool accelerate = is_accelerate_dir(*entries);
  for (const auto& e : *entries) {
    if (!S_ISDIR(e.st.st_mode) || e.name.find('/') != std::string::npos) continue;
    if (accelerate && (e.name == kAccelerateModelDir || e.name.starts_with("optimizer_"))) continue;
    auto sub = open_at(dirfd, e.name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW);
    if (!sub) continue;
    CKPTFS_CHECK(walk(sub->get(), path + "/" + e.name, out, depth + 1));
  }
  return {};
}

}  // namespace

Result<Found> find_checkpoint_dirs(const std::string& root) {
  CKPTFS_TRY(UniqueFd fd, open_file(root, O_RDONLY | O_DIRECTORY));
  Found out;
  std::string base = root;
  while (base.size() > 1 && base.back() == '/') base.pop_back();
  CKPTFS_CHECK(walk(fd.get(), base, out, 0));
  std::sort(out.dirs.begin(), out.dirs.end());
  return out;
}

}  // namespace ckptfs::source
