// fs/namespace: what a name resolves to and what a directory lists (lookup, listing), including
// the writer's view of a checkpoint directory. What stat says of a node is fs/attributes.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <set>

#include "ckptfs/format/names.hpp"
#include "ckptfs/util/path.hpp"
#include "ckptfs/write/store_checks.hpp"
#include "impl.hpp"
#include "names.hpp"
#include "readers.hpp"

namespace ckptfs::fs {

using format::is_model_output_name;

// --- the writer's view ------------------------------------------------------------------------
// Directory node `dir` as the writer's view tells directories apart (its birth time too).
WriterViews::DirId Filesystem::Impl::dir_id(const Node& dir) {
  struct statx sx {};
  const bool top = dir.rel.empty();
  int64_t birth = 0;
  if (::statx(root.get(), top ? "" : dir.rel.c_str(),
              AT_SYMLINK_NOFOLLOW | (top ? AT_EMPTY_PATH : 0), STATX_BTIME, &sx) == 0 &&
      (sx.stx_mask & STATX_BTIME)) {
    birth = static_cast<int64_t>(sx.stx_btime.tv_sec) * kNsPerSec + sx.stx_btime.tv_nsec;
  }
  return WriterViews::DirId{dir.dev, dir.bino, birth};
}
// The parent of directory node `dir` in SRC (none for the root).
std::optional<WriterViews::DirId> Filesystem::Impl::parent_id(const Node& dir) {
  if (dir.links.empty()) return std::nullopt;
  auto p = nodes.get(dir.links.front().first);
  if (!p) return std::nullopt;
  return dir_id(*p);
}
// `who` wrote in directory `dir`.
void Filesystem::Impl::note_writer(const Node& dir, const Caller& who) {
  if (who.pid > 0) writers->note(dir_id(dir), parent_id(dir), who.pid);
}
// `who` wrote in the directory of file node `ino`.
void Filesystem::Impl::note_writer_of(Ino ino, const Caller& who) {
  if (who.pid <= 0) return;
  auto n = nodes.get(ino);
  if (!n || n->links.empty()) return;
  if (auto d = nodes.get(n->links.front().first)) note_writer(*d, who);
}
// Whether `who` sees checkpoint directory `dir` as written.
bool Filesystem::Impl::sees_written(const Node& dir, const Caller& who) {
  if (who.pid <= 0 || writers->none()) return false;
  return writers->sees_written(dir_id(dir), parent_id(dir), who.pid);
}

// st_ino of a directory node as stat shows it.
uint64_t Filesystem::Impl::dir_ino_shown(const Node& n) const {
  if (n.kind == Kind::ShardsDir) return virtual_ino(n.dev, n.bino, 0, kShardsDirName);
  if (n.kind == Kind::StatusDir) return status_attr(n).st_ino;
  if (n.kind == Kind::AdapterDir) return virtual_attr(n).st_ino;
  return nodes.shown_ino(n.dev, n.bino);
}

// Tells the kernel to drop the entries of `dir` whose real file is gone from SRC, or was
// replaced by another (a step deleted and its name reused): nothing else would, since SRC
// changes behind the kernel's back, and each such entry keeps a node, its view and the
// directory's state alive in the daemon until the kernel forgets it. `entries` is the new
// listing of `dir`, sorted by name.
void Filesystem::Impl::drop_vanished(const Node& dir,
                                     const std::vector<source::DirEntry>& entries) {
  if (!notifier) return;
  std::vector<std::string> gone;
  nodes.for_each_kid(dir.ino, [&](const std::string& name, const Node* n) {
    // Synthesized names are announced by their views; lifted .hf_metadata files live
    // elsewhere than the listing shows.
    if (!n || n->key.space != Space::Real) return;
    if (n->rel != join_rel(dir.rel, name)) return;
    auto e = std::lower_bound(
        entries.begin(), entries.end(), name,
        [](const source::DirEntry& a, const std::string& b) { return a.name < b; });
    if (e == entries.end() || e->name != name || !(real_key(e->st) == n->key)) {
      gone.push_back(name);
    }
  });
  for (const auto& name : gone) notifier->inval_entry(dir.ino, name);
}

// --- lookups ---------------------------------------------------------------------------

Result<EntryOut> Filesystem::Impl::lookup_real(const std::string& rel, Ino parent,
                                               std::string_view name) {
  CKPTFS_TRY(struct stat st, stat_beneath(root.get(), rel));
  Node proto;
  proto.kind = kind_of(st.st_mode);
  proto.rel = rel;
  proto.dev = static_cast<uint64_t>(st.st_dev);
  proto.bino = static_cast<uint64_t>(st.st_ino);
  Node n = nodes.remember(real_key(st), std::move(proto), parent, name);
  decorate_real(n.ino, rel, st);
  return EntryOut{n.ino, st};
}

Status Filesystem::Impl::may_reach_lifted(const std::string& rel, const Caller& who) {
  const std::string folder = parent_of(rel);
  const std::string last = last_of(folder);
  if (folder.empty() || std::find(std::begin(format::kLiftedDirs), std::end(format::kLiftedDirs),
                                  last) == std::end(format::kLiftedDirs)) {
    return {};
  }
  CKPTFS_TRY(struct stat st, stat_beneath(root.get(), folder));
  if (!may(Perm::of(st), who, X_OK)) {
    return make_error(EACCES, "{}: uid {} may not search {}", rel, who.uid, folder);
  }
  return {};
}

Result<EntryOut> Filesystem::Impl::lookup_virtual(const std::shared_ptr<const View>& v,
                                                  const std::string& dir_rel, Ino dir_ino,
                                                  Kind kind, uint32_t output,
                                                  const std::string& name,
                                                  std::string_view folder) {
  Node proto;
  proto.kind = kind;
  proto.rel = dir_rel;  // where the checkpoint directory is now (it may have been renamed)
  proto.view = v;
  proto.output = output;
  // A file of a folder of the view is keyed by its path: never the node of a name in the
  // directory itself.
  std::string key = folder.empty() ? name : fmt::format("{}/{}", folder, name);
  Node n =
      nodes.remember(Key{Space::Virtual, 0, v->dir_dev, v->dir_ino, v->generation, std::move(key)},
                     std::move(proto), dir_ino, name);
  return EntryOut{n.ino, virtual_attr(n)};
}

namespace {
// Whether SRC's file `rel` (`name` of directory `dir_rel`, beneath `root`) is a consolidator's
// header, its data to come (write::StoreChecks::consolidators_header): one stat where SRC has
// no such file.
bool consolidators_header(int root, const std::string& dir_rel, const std::string& rel,
                          const std::string& name) {
  auto st = stat_beneath(root, rel);
  if (!st || !S_ISREG(st->st_mode)) return false;
  auto dfd = open_beneath(root, dir_rel, O_RDONLY | O_DIRECTORY);
  return dfd && write::StoreChecks::consolidators_header(dfd->get(), name);
}
// The same, for `name` of directory `dirfd` listed as `entries` (sorted by name).
bool consolidators_header_in(int dirfd, const std::vector<source::DirEntry>& entries,
                             const std::string& name) {
  auto e =
      std::lower_bound(entries.begin(), entries.end(), name,
                       [](const source::DirEntry& a, const std::string& b) { return a.name < b; });
  return e != entries.end() && e->name == name && S_ISREG(e->st.st_mode) &&
         write::StoreChecks::consolidators_header(dirfd, name);
}
}  // namespace

// The name in directory `rel` that must never be stat'ed (see Options::hide_rel).
Result<EntryOut> Filesystem::Impl::lookup_in_dir(const Node& dir, std::string_view name_sv,
                                                 const Caller& who) {
  std::string name(name_sv);
  if (name == hidden_child(dir.rel)) return make_error(ENOENT, "the mount point itself");
  if (names::is_status_dir(dir.ino, name)) {
    return lookup_status(dir.ino, Kind::StatusDir, name);
  }
  if (names::is_state(name)) return make_error(ENOENT, "{}: the write path's own state", name);
  CKPTFS_TRY(struct stat dst, stat_beneath(root.get(), dir.rel));
  const std::string rel = join_rel(dir.rel, name);
  // The writer's view: what the caller's process wrote resolves for it alone (uncached); a
  // name it did not write falls through (ENOENT).
  auto as_written = [&]() -> std::optional<Result<EntryOut>> {
    auto real = lookup_real(rel, dir.ino, name);
    if (real.ok()) real->uncached = true;
    if (real.ok() || real.error().code != ENOENT) return real;
    return std::nullopt;
  };
  if (auto w =
          is_model_output_name(name) ? nullptr : views.view_of(dir.rel, dst, dir.ino, Need::Any);
      w && !w->records && sees_written(dir, who)) {
    if (auto real = as_written()) return std::move(*real);
  }
  // config.json too may be the view's (-o hf_config, a map's), and it is hidden beside a
  // trainer's own names that no map serves: it needs the current view (names::needs_view).
  const bool consolidated_name = names::needs_view(name);
  auto v = views.view_of(dir.rel, dst, dir.ino, consolidated_name ? Need::Current : Need::Any);
  if (consolidated_name) v = views.wait_settled(dir, std::move(v));
  if (!v) return lookup_real(rel, dir.ino, name);
  if (name == kConfigName && v->complete && v->ckpt->unmapped_native()) {
    return make_error(ENOENT,
                      "{}: hidden: the stored names are a trainer's own ('{}') and no model map "
                      "serves them (ckptfs inspect says why)",
                      rel, v->ckpt->native_name);
  }
  if (name == names::kPending && v->settling) {
    return lookup_virtual(v, dir.rel, dir.ino, Kind::Pending, 0, name);
  }
  if (v->complete) {
    const auto& ck = *v->ckpt;
    for (uint32_t i = 0; i < ck.outputs.size(); ++i) {
      if (!ck.outputs[i].folder.empty() || ck.outputs[i].name != name) continue;
      if (!consolidators_header(root.get(), dir.rel, rel, name)) {
        return lookup_virtual(v, dir.rel, dir.ino, Kind::Output, i, name);
      }
      // A consolidator saving again: the header it closed is its writer's, which reopens it
      // to append. Nobody else sees the name until it is stored complete, as in a plain
      // directory, where it holds a header alone: never the file it replaces beside the
      // save's new ones (a model of two saves).
      if (sees_written(dir, who)) {
        if (auto real = as_written()) return std::move(*real);
      }
      return make_error(ENOENT,
                        "{}: hidden while its writer saves it again (its header is "
                        "written, its data to come)",
                        rel);
    }
    if (name == format::kIndexFileName) {
      if (ck.written || ck.index_json.empty()) return lookup_real(rel, dir.ino, name);
      return lookup_virtual(v, dir.rel, dir.ino, Kind::Index, kIndexFile, name);
    }
  }
  if (is_model_output_name(name) && sees_written(dir, who)) {
    // The writer's view, for a model name the view does not show (its checkpoint is not
    // complete yet): torch's consolidation into several files writes every header first and
    // reopens each to append, so a file stored on its close leaves the others' headers to their
    // writer (write/store_checks: header_alone).
    if (auto real = as_written()) return std::move(*real);
  }
  if (name == kShardsDirName && opts.show_shards) {
    Node proto;
    proto.kind = Kind::ShardsDir;
    proto.rel = dir.rel;
    proto.dev = static_cast<uint64_t>(dst.st_dev);
    proto.bino = static_cast<uint64_t>(dst.st_ino);
    Node n = nodes.remember(Key{Space::ShardsDir, 0, proto.dev, proto.bino, 0, {}},
                            std::move(proto), dir.ino, name);
    struct stat st = dst;
    st.st_ino = virtual_ino(n.dev, n.bino, 0, kShardsDirName);
    st.st_mode = S_IFDIR | 0555;
    return EntryOut{n.ino, st};
  }
  if (names::hidden_in_checkpoint(name)) {
    return make_error(ENOENT, "{}: hidden in a checkpoint directory", rel);
  }
  auto real = lookup_real(rel, dir.ino, name);
  if (real.ok() || real.error().code != ENOENT) return real;
  // A LoRA checkpoint's adapter folder, where SRC has no entry of that name.
  if (v->complete && v->ckpt->adapter && name == v->ckpt->adapter->dir) {
    return lookup_virtual(v, dir.rel, dir.ino, Kind::AdapterDir, 0, name);
  }
  // Lifted from .hf_metadata/ (never the mapping files) or verl's huggingface/, the first
  // that has it. No symlink is followed on the way.
  if (names::is_mapping_file(name)) return real;
  for (std::string_view from : format::kLiftedDirs) {
    const std::string lifted = join_rel(join_rel(dir.rel, from), name);
    auto st = stat_beneath(root.get(), lifted);
    if (st && S_ISREG(st->st_mode)) {
      CKPTFS_CHECK(may_reach_lifted(lifted, who));
      return lookup_real(lifted, dir.ino, name);
    }
  }
  // A checkpoint without a config.json of its own shows -o hf_config's (or the one its map
  // made); the view is current here (above), also on the first lookup after mounting.
  if (name == kConfigName && v->complete && !v->ckpt->config_json.empty()) {
    return lookup_virtual(v, dir.rel, dir.ino, Kind::Index, kConfigFile, name);
  }
  return real;
}

// The files of a LoRA checkpoint's adapter folder (node `dir`, of one View): the adapter's
// output and adapter_config.json.
Result<EntryOut> Filesystem::Impl::lookup_in_adapter(const Node& dir, std::string_view name) {
  const auto& v = dir.view;
  const auto& ck = *v->ckpt;
  const std::string n(name);
  if (name == format::kAdapterConfigName) {
    return lookup_virtual(v, dir.rel, dir.ino, Kind::Index, kAdapterConfigFile, n, dir.key.name);
  }
  for (uint32_t i = 0; i < ck.outputs.size(); ++i) {
    if (ck.outputs[i].folder == dir.key.name && ck.outputs[i].name == name) {
      return lookup_virtual(v, dir.rel, dir.ino, Kind::Output, i, n, dir.key.name);
    }
  }
  return make_error(ENOENT, "{}/{}: not in the adapter folder", dir.key.name, n);
}

// The entries of a LoRA checkpoint's adapter folder (node `dir`), as lookup_in_adapter finds them.
std::vector<DirEntryOut> Filesystem::Impl::list_adapter(const Node& dir) const {
  const auto& ck = *dir.view->ckpt;
  std::vector<DirEntryOut> out;
  auto add = [&](std::string_view name) {
    const std::string key = fmt::format("{}/{}", dir.key.name, name);
    out.push_back(DirEntryOut{std::string(name),
                              virtual_ino(dir.key.dev, dir.key.ino, dir.key.gen, key), S_IFREG});
  };
  add(format::kAdapterConfigName);
  for (const auto& o : ck.outputs) {
    if (o.folder == dir.key.name) add(o.name);
  }
  std::sort(out.begin(), out.end(),
            [](const DirEntryOut& a, const DirEntryOut& b) { return a.name < b.name; });
  return out;
}

Result<EntryOut> Filesystem::Impl::lookup_in_shards(const Node& dir, std::string_view name) {
  const std::string rel = join_rel(dir.rel, name);
  CKPTFS_CHECK(stat_beneath(root.get(), rel));  // ENOENT first, as for any name
  if (!names::in_shards_folder(name, opts.show_shards)) {
    return make_error(ENOENT, "{}: not a hidden file", rel);
  }
  return lookup_real(rel, dir.ino, name);
}

// --- listings --------------------------------------------------------------------------

Result<std::vector<DirEntryOut>> Filesystem::Impl::list(const Node& dir, const Caller& who) {
  CKPTFS_TRY(struct stat dst, stat_beneath(root.get(), dir.rel));
  CKPTFS_TRY(UniqueFd fd, open_beneath(root.get(), dir.rel, O_RDONLY | O_DIRECTORY));
  CKPTFS_TRY(auto entries, source::list_dir(fd.get(), hidden_child(dir.rel)));
  drop_vanished(dir, entries);
  std::vector<DirEntryOut> out;
  auto real = [&](const source::DirEntry& e) {
    out.push_back(DirEntryOut{
        e.name,
        nodes.shown_ino(static_cast<uint64_t>(e.st.st_dev), static_cast<uint64_t>(e.st.st_ino)),
        static_cast<mode_t>(e.st.st_mode & S_IFMT)});
  };
  if (dir.kind == Kind::ShardsDir) {
    for (const auto& e : entries) {
      if (names::in_shards_folder(e.name, opts.show_shards)) real(e);
    }
    return out;
  }
  // The writer's view lists what was written, as in SRC (the view's own check first: it
  // also watches the directory and recovers what a crash left).
  const bool writer = dir.kind == Kind::Dir && sees_written(dir, who);
  auto v = views.view_of(dir.rel, dst, dir.ino, writer ? Need::Any : Need::Current);
  const bool as_written = writer && v && !v->records;
  if (as_written) {  // the writer's view: rank shards and side files as in SRC
    for (const auto& e : entries) {
      if (!names::is_state(e.name)) real(e);
    }
    return out;
  }
  if (writer && v) v = views.view_of(dir.rel, dst, dir.ino, Need::Current);
  if (!v) {
    for (const auto& e : entries) {
      if (!names::is_state(e.name)) real(e);
    }
    return out;
  }
  // A directory written through the view shows its own index file, and none synthesized.
  const bool written = v->complete && v->ckpt->written;
  // Beside a trainer's own names that no map serves, no config.json (namespace: lookup).
  const bool no_config = v->complete && v->ckpt->unmapped_native();
  std::set<std::string> listed;
  if (no_config) listed.insert(std::string(kConfigName));  // never listed, real or lifted
  for (const auto& e : entries) {
    if (names::is_state(e.name)) continue;
    if (no_config && e.name == kConfigName) continue;
    if (names::hidden_in_listing(e.name, opts.show_shards) &&
        !(written && e.name == format::kIndexFileName && S_ISREG(e.st.st_mode))) {
      continue;
    }
    real(e);
    listed.insert(e.name);
  }
  for (std::string_view from : format::kLiftedDirs) {
    auto meta = open_beneath(fd.get(), std::string(from), O_RDONLY | O_DIRECTORY | O_NOFOLLOW);
    if (!meta) continue;
    // Its names are listed for whoever could list the folder itself in SRC.
    struct stat mst {};
    if (::fstat(meta->get(), &mst) != 0 || !may(Perm::of(mst), who, R_OK)) continue;
    if (auto lifted = source::list_dir(meta->get()); lifted.ok()) {
      for (const auto& e : *lifted) {
        // Never the mapping files (fqn_to_dtype_mapping.json is hidden, as NeMo's export).
        if (!S_ISREG(e.st.st_mode) || listed.count(e.name) || names::never_lifted(e.name)) {
          continue;
        }
        real(e);
        listed.insert(e.name);
      }
    }
  }
  if (v->complete) {
    const auto& ck = *v->ckpt;
    for (const auto& o : ck.outputs) {
      if (!o.folder.empty()) continue;                                   // listed in its folder
      if (consolidators_header_in(fd.get(), entries, o.name)) continue;  // as lookup_in_dir
      out.push_back(
          DirEntryOut{o.name, virtual_ino(v->dir_dev, v->dir_ino, v->generation, o.name), S_IFREG});
    }
    if (ck.adapter && !listed.count(ck.adapter->dir)) {
      out.push_back(DirEntryOut{ck.adapter->dir,
                                virtual_ino(v->dir_dev, v->dir_ino, v->generation, ck.adapter->dir),
                                S_IFDIR});
    }
    if (!written && !ck.index_json.empty()) {
      out.push_back(DirEntryOut{
          std::string(format::kIndexFileName),
          virtual_ino(v->dir_dev, v->dir_ino, v->generation, format::kIndexFileName), S_IFREG});
    }
    if (!ck.config_json.empty() && !listed.count(std::string(kConfigName)) && !no_config) {
      out.push_back(DirEntryOut{std::string(kConfigName),
                                virtual_ino(v->dir_dev, v->dir_ino, v->generation, kConfigName),
                                S_IFREG});
    }
  }
  if (v->settling) {
    out.push_back(DirEntryOut{std::string(names::kPending),
                              virtual_ino(v->dir_dev, v->dir_ino, v->generation, names::kPending),
                              S_IFREG});
  }
  if (opts.show_shards) {
    out.push_back(DirEntryOut{std::string(kShardsDirName),
                              virtual_ino(static_cast<uint64_t>(dst.st_dev),
                                          static_cast<uint64_t>(dst.st_ino), 0, kShardsDirName),
                              S_IFDIR});
  }
  std::sort(out.begin(), out.end(),
            [](const DirEntryOut& a, const DirEntryOut& b) { return a.name < b.name; });
  return out;
}

Result<EntryOut> Filesystem::Impl::lookup(Ino parent, std::string_view name, const Caller& who) {
  if (name.size() > NAME_MAX) return make_error(ENAMETOOLONG, "a name of {} bytes", name.size());
  if (!is_valid_component(name)) return make_error(ENOENT, "invalid name");
  auto dir = nodes.get(parent);
  if (!dir) return make_error(ESTALE, "unknown inode {}", parent);
  if (dir->kind == Kind::Dir) return lookup_in_dir(*dir, name, who);
  if (dir->kind == Kind::ShardsDir) return lookup_in_shards(*dir, name);
  if (dir->kind == Kind::AdapterDir) return lookup_in_adapter(*dir, name);
  if (dir->kind == Kind::StatusDir) {
    if (name != kStatusFileName) return make_error(ENOENT, "no such status file");
    return lookup_status(parent, Kind::StatusFile, name);
  }
  return make_error(ENOTDIR, "inode {} is not a directory", parent);
}

void Filesystem::Impl::forget(Ino ino, uint64_t n) {
  // Released after the table's lock: DirState::mu comes first.
  std::shared_ptr<DirState> dropped = nodes.forget(ino, n);
  if (!dropped) return;
  // Its shards' headers go from the cache too: a forgotten directory is most often one deleted
  // from SRC (see drop_vanished), whose headers would otherwise sit there until evicted.
  std::lock_guard lock(dropped->mu);
  for (const auto& [name, stamp] : dropped->sig.files) headers.evict(stamp);
}

Result<uint64_t> Filesystem::Impl::opendir(Ino ino, const Caller& who) {
  auto n = nodes.get(ino);
  if (!n) return make_error(ESTALE, "unknown inode {}", ino);
  if (n->kind != Kind::Dir && n->kind != Kind::ShardsDir && n->kind != Kind::StatusDir &&
      n->kind != Kind::AdapterDir) {
    return make_error(ENOTDIR, "not a directory");
  }
  if (n->kind == Kind::Dir) CKPTFS_CHECK(real_attr(*n));
  std::vector<DirEntryOut> entries;
  if (n->kind == Kind::StatusDir) {
    Node file;
    file.kind = Kind::StatusFile;
    file.key.name = std::string(kStatusFileName);
    entries.push_back({file.key.name, status_attr(file).st_ino, S_IFREG});
  } else if (n->kind == Kind::AdapterDir) {
    entries = list_adapter(*n);
  } else {
    CKPTFS_TRY(entries, list(*n, who));
  }
  auto h = std::make_unique<DirHandle>();
  // "." and ".." first, as a real directory lists them (d_ino as stat shows them).
  const uint64_t self = dir_ino_shown(*n);
  uint64_t parent = self;
  if (!n->links.empty()) {
    if (auto p = nodes.get(n->links.front().first)) parent = dir_ino_shown(*p);
  }
  h->entries.reserve(entries.size() + 2);
  h->entries.push_back(DirEntryOut{".", self, S_IFDIR});
  h->entries.push_back(DirEntryOut{"..", parent, S_IFDIR});
  for (auto& e : entries) h->entries.push_back(std::move(e));
  return handles.add(std::move(h));
}

Status Filesystem::Impl::readdir(uint64_t dh, uint64_t offset,
                                 const std::function<bool(const DirEntryOut&, uint64_t)>& add) {
  CKPTFS_TRY(DirHandle * h, handles.dir(dh));
  for (uint64_t i = offset; i < h->entries.size(); ++i) {
    if (!add(h->entries[i], i + 1)) break;
  }
  return {};
}

}  // namespace ckptfs::fs
