#include "ckptfs/fs/filesystem.hpp"

#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <unordered_map>

#include <spdlog/spdlog.h>

#include "ckptfs/format/names.hpp"
#include "ckptfs/layout/extent_map.hpp"
#include "ckptfs/source/scanner.hpp"
#include "ckptfs/util/fd.hpp"
#include "ckptfs/util/path.hpp"

namespace ckptfs::fs {
namespace {

using Clock = std::chrono::steady_clock;

int64_t now_realtime_ns() {
  struct timespec ts {};
  ::clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

void set_times(struct stat& st, int64_t ns) {
  struct timespec ts {
    static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)
  };
  st.st_mtim = ts;
  st.st_ctim = ts;
  st.st_atim = ts;
}

bool is_model_output_name(std::string_view n) {
  return n == format::kIndexFileName || format::parse_model_name(n).has_value();
}

// Names a checkpoint directory hides: its shards, .hf_metadata, and real files that the
// synthesized ones replace.
bool hidden_in_checkpoint(const source::DirEntry& e) {
  return source::is_shard_entry(e) || e.name == format::kHfMetadataDir ||
         is_model_output_name(e.name);
}

std::string parent_of(std::string_view rel) {
  auto slash = rel.rfind('/');
  return slash == std::string_view::npos ? std::string() : std::string(rel.substr(0, slash));
}

// --- readers --------------------------------------------------------------------------

class MemoryReader final : public FileReader {
 public:
  MemoryReader(std::shared_ptr<const void> owner, std::string_view bytes)
      : owner_(std::move(owner)), bytes_(bytes) {}
  uint64_t size() const override { return bytes_.size(); }
  void plan(uint64_t off, uint64_t len, ReadPlan& out) const override {
    out.segs.clear();
    out.src = GatherSource{nullptr, {}, bytes_, "index"};
    out.size = 0;
    if (off >= bytes_.size()) return;
    uint64_t n = std::min<uint64_t>(len, bytes_.size() - off);
    out.segs.push_back(layout::Segment{layout::Segment::kMemory, off, n});
    out.size = n;
  }

 private:
  std::shared_ptr<const void> owner_;
  std::string_view bytes_;
};

class PassthroughReader final : public FileReader {
 public:
  PassthroughReader(UniqueFd fd, uint64_t size, std::string name)
      : fd_(std::move(fd)), raw_(fd_.get()), size_(size), name_(std::move(name)) {}
  uint64_t size() const override { return size_; }
  void plan(uint64_t off, uint64_t len, ReadPlan& out) const override {
    out.segs.clear();
    out.src = GatherSource{nullptr, std::span<const int>(&raw_, 1), {}, name_};
    // The file may have grown or shrunk since open: read what is there, like a plain file.
    out.size = len;
    out.segs.push_back(layout::Segment{0, off, len});
  }

 private:
  UniqueFd fd_;
  int raw_;
  uint64_t size_;
  std::string name_;
};

}  // namespace

// One version of a checkpoint directory.
struct View {
  std::shared_ptr<const layout::Checkpoint> ckpt;
  uint64_t generation = 0;
  int64_t mtime_ns = 0;
  bool complete = false;  // valid and settled: consolidated files are shown
  std::string rel;        // checkpoint directory, relative to the source root
  uint64_t dir_dev = 0, dir_ino = 0;
  uid_t uid = 0;  // owner of the checkpoint directory, shown as the owner of its files
  gid_t gid = 0;

  mutable std::mutex fd_mu;  // guards fds
  mutable std::weak_ptr<const struct ShardFds> fds;
};

// Shard fds of one View, opened on first open of a consolidated file and verified against
// the stamps the View was built from.
struct ShardFds {
  std::vector<UniqueFd> owned;
  std::vector<int> raw;                     // -1 where not needed
  std::atomic<int64_t>* counter = nullptr;  // Impl::open_shard_fds, released on destruction
  int64_t count = 0;
  ShardFds() = default;
  ShardFds(const ShardFds&) = delete;
  ShardFds& operator=(const ShardFds&) = delete;
  ~ShardFds() {
    if (counter) counter->fetch_sub(count);
  }
};

namespace {

class OutputReader final : public FileReader {
 public:
  OutputReader(std::shared_ptr<const View> view, std::shared_ptr<const ShardFds> fds,
               uint32_t output)
      : view_(std::move(view)), fds_(std::move(fds)), output_(output) {}
  uint64_t size() const override { return view_->ckpt->outputs[output_].size; }
  void plan(uint64_t off, uint64_t len, ReadPlan& out) const override {
    const auto& ck = *view_->ckpt;
    layout::map_range(ck, output_, off, len, out.segs);
    out.src = GatherSource{&ck, fds_->raw, ck.outputs[output_].header, {}};
    out.size = 0;
    for (const auto& s : out.segs) out.size += s.len;
  }

 private:
  std::shared_ptr<const View> view_;
  std::shared_ptr<const ShardFds> fds_;
  uint32_t output_;
};

enum class Kind : uint8_t { Dir, File, Symlink, Other, Output, Index, ShardsDir };

struct Node {
  Ino ino = 0;
  Kind kind = Kind::Other;
  std::string rel;  // backing path (real nodes) or the checkpoint directory (virtual, .shards)
  uint64_t dev = 0, bino = 0;        // backing identity (real nodes and .shards' directory)
  std::shared_ptr<const View> view;  // Output / Index
  uint32_t output = 0;
  uint64_t nlookup = 0;
  layout::FileStamp cached;  // stamp when last opened: decides keep_cache
};

struct Key {
  uint8_t type;  // 0 real, 1 virtual file, 2 .shards
  uint64_t dev, ino, gen;
  std::string name;
  auto operator<=>(const Key&) const = default;
};

struct DirState {
  std::mutex mu;  // guards every field below; taken before Impl::mu_, never after
  bool checked = false;
  Clock::time_point next_check;
  bool is_checkpoint = false;
  source::Signature sig;
  std::shared_ptr<const View> view;
  uint64_t generation = 0;
};

struct DirHandle {
  std::vector<DirEntryOut> entries;
};

struct FileHandle {
  std::shared_ptr<const FileReader> reader;
};

}  // namespace

Result<size_t> execute(const ReadPlan& p, char* dst) {
  if (p.passthrough()) {
    const auto& seg = p.segs[0];
    size_t done = 0;
    while (done < seg.len) {
      ssize_t n =
          ::pread(p.src.fds[0], dst + done, seg.len - done, static_cast<off_t>(seg.src + done));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        int e = errno;
        return make_error(e, "{}: read failed: {}", p.src.file, std::strerror(e));
      }
      if (n == 0) break;
      done += static_cast<size_t>(n);
    }
    return done;
  }
  CKPTFS_CHECK(gather(p.src, p.segs, dst));
  return static_cast<size_t>(p.size);
}

Result<size_t> FileReader::read(uint64_t off, size_t len, char* dst) const {
  ReadPlan p;
  plan(off, len, p);
  return execute(p, dst);
}

struct Filesystem::Impl {
  Options opts;
  std::string source;
  UniqueFd root;
  uint64_t root_dev = 0, root_ino = 0;
  source::HeaderCache headers;
  // Shard fds held by open consolidated files, bounded by RLIMIT_NOFILE (less a reserve for
  // FUSE, passthrough files and the header scans).
  std::atomic<int64_t> open_shard_fds{0};
  int64_t fd_budget = 0;
  Notifier* notifier = nullptr;

  // Lock order: DirState::mu -> mu_. The header cache has its own leaf lock.
  mutable std::mutex mu_;  // guards nodes_, keys_, next_ino_, dirs_
  std::unordered_map<Ino, std::shared_ptr<Node>> nodes_;
  std::map<Key, Ino> keys_;  // stable inode numbers for the life of the mount
  Ino next_ino_ = kRootIno + 1;
  std::map<std::pair<uint64_t, uint64_t>, std::shared_ptr<DirState>> dirs_;

  // --- inode numbers and nodes ---------------------------------------------------------

  Ino ino_for_locked(const Key& k) {
    if (k.type == 0 && k.dev == root_dev && k.ino == root_ino) return kRootIno;
    auto [it, inserted] = keys_.emplace(k, 0);
    if (inserted) it->second = next_ino_++;
    return it->second;
  }

  Ino ino_for(const Key& k) {
    std::lock_guard lock(mu_);
    return ino_for_locked(k);
  }

  // A copy of the node, taken under the lock (rel may change when the source is renamed).
  std::optional<Node> get(Ino ino) {
    std::lock_guard lock(mu_);
    auto it = nodes_.find(ino);
    if (it == nodes_.end()) return std::nullopt;
    return *it->second;
  }

  // Registers (or finds) the node for `key`, counts one lookup, and returns a copy.
  Node remember(const Key& key, Node proto) {
    std::lock_guard lock(mu_);
    Ino ino = ino_for_locked(key);
    auto& slot = nodes_[ino];
    if (!slot) {
      proto.ino = ino;
      slot = std::make_shared<Node>(std::move(proto));
    } else {
      slot->rel = proto.rel;  // the inode (or its directory) may have moved within the source
    }
    slot->nlookup++;
    return *slot;
  }

  // Records the stamp a plain file was opened with; returns whether it matches the last one.
  bool swap_cached_stamp(Ino ino, const layout::FileStamp& stamp) {
    std::lock_guard lock(mu_);
    auto it = nodes_.find(ino);
    if (it == nodes_.end()) return false;
    bool same = it->second->cached == stamp;
    it->second->cached = stamp;
    return same;
  }

  static Kind kind_of(mode_t m) {
    if (S_ISDIR(m)) return Kind::Dir;
    if (S_ISREG(m)) return Kind::File;
    if (S_ISLNK(m)) return Kind::Symlink;
    return Kind::Other;
  }

  // --- directory state (the checkpoint view of a real directory) ------------------------

  std::shared_ptr<DirState> dir_state(uint64_t dev, uint64_t ino) {
    std::lock_guard lock(mu_);
    auto& s = dirs_[{dev, ino}];
    if (!s) s = std::make_shared<DirState>();
    return s;
  }

  // Returns the current view of directory `rel` (null when it is no checkpoint),
  // revalidating it when its TTL has passed. `dir_ino` is its FUSE inode, for invalidation.
  std::shared_ptr<const View> view_of(const std::string& rel, const struct stat& dst, Ino dir_ino,
                                      bool force = false) {
    auto st = dir_state(static_cast<uint64_t>(dst.st_dev), static_cast<uint64_t>(dst.st_ino));
    std::lock_guard lock(st->mu);
    auto now = Clock::now();
    if (st->checked && !force && now < st->next_check) return st->view;
    st->checked = true;
    st->next_check = now + opts.revalidate;

    auto dirfd = open_beneath(root.get(), rel, O_RDONLY | O_DIRECTORY);
    if (!dirfd) return st->view;  // vanished: keep serving what open files hold
    auto entries = source::list_dir(dirfd->get(), hidden_child(rel));
    if (!entries) return st->view;
    const bool is_ckpt = source::has_shards(*entries);
    std::shared_ptr<const View> old = st->view;
    if (!is_ckpt) {
      st->is_checkpoint = false;
      st->sig = {};
      st->view = nullptr;
      if (old) changed(old, nullptr, dir_ino);
      return nullptr;
    }
    auto sig = source::signature_of(dirfd->get(), *entries);
    // Quiet since the newest change of any shard, including being moved in (ctime) and the
    // directory itself being created or renamed into place.
    const int64_t changed_ns = std::max({sig.newest_change_ns, mtime_ns(dst), ctime_ns(dst)});
    const int64_t quiet_ns = now_realtime_ns() - changed_ns;
    const int64_t settle_ns =
        std::chrono::duration_cast<std::chrono::nanoseconds>(opts.settle).count();
    const bool settled = quiet_ns >= settle_ns;
    if (!settled) {
      auto wait = std::chrono::nanoseconds(settle_ns - quiet_ns);
      st->next_check = std::min(st->next_check, now + wait);
    }
    if (st->is_checkpoint && old && sig == st->sig &&
        old->complete == (settled && old->ckpt->valid())) {
      return old;
    }
    std::shared_ptr<const layout::Checkpoint> ck;
    if (old && sig == st->sig) {
      ck = old->ckpt;  // only the settle state changed
    } else {
      ck = source::load_checkpoint(dirfd->get(), *entries, source_path(rel), headers, opts.build);
      if (!ck->valid()) {
        for (const auto& p : ck->problems) {
          spdlog::error("{}: checkpoint not shown: {}", source_path(rel), p.to_string());
        }
      }
    }
    auto v = std::make_shared<View>();
    v->ckpt = ck;
    v->generation = ++st->generation;
    v->mtime_ns = std::max(sig.newest_mtime_ns, mtime_ns(dst));
    v->complete = settled && ck->valid();
    v->rel = rel;
    v->dir_dev = static_cast<uint64_t>(dst.st_dev);
    v->dir_ino = static_cast<uint64_t>(dst.st_ino);
    v->uid = dst.st_uid;
    v->gid = dst.st_gid;
    st->is_checkpoint = true;
    st->sig = std::move(sig);
    st->view = v;
    if (v->complete) {
      spdlog::info("{}: serving {} consolidated file(s), {} tensors", source_path(rel),
                   ck->outputs.size(), ck->tensors.size());
    }
    changed(old, v, dir_ino);
    return v;
  }

  // Tells the kernel which names of directory `dir_ino` may have changed.
  void changed(const std::shared_ptr<const View>& old, const std::shared_ptr<const View>& now,
               Ino dir_ino) {
    if (!notifier) return;
    std::set<std::string> names;
    for (const auto* v : {old.get(), now.get()}) {
      if (!v || !v->complete) continue;
      for (const auto& o : v->ckpt->outputs) names.insert(o.name);
      names.insert(std::string(format::kIndexFileName));
    }
    for (const auto& n : names) notifier->inval_entry(dir_ino, n);
    notifier->inval_inode(dir_ino);
  }

  std::string source_path(const std::string& rel) const {
    return rel.empty() ? source : source + "/" + rel;
  }

  // --- attributes ----------------------------------------------------------------------

  // Fresh attributes of a real node, or ESTALE when its path now names another file.
  Result<struct stat> real_attr(const Node& n) {
    CKPTFS_TRY(struct stat st, stat_beneath(root.get(), n.rel));
    if (static_cast<uint64_t>(st.st_dev) != n.dev || static_cast<uint64_t>(st.st_ino) != n.bino) {
      return make_error(ESTALE, "{}: replaced", n.rel);
    }
    decorate_real(n.ino, n.rel, st);
    return st;
  }

  void decorate_real(Ino ino, const std::string& rel, struct stat& st) {
    if (S_ISDIR(st.st_mode)) {
      if (auto v = view_of(rel, st, ino); v && v->mtime_ns > mtime_ns(st)) {
        st.st_mtim = timespec{static_cast<time_t>(v->mtime_ns / 1000000000),
                              static_cast<long>(v->mtime_ns % 1000000000)};
      }
    }
    st.st_ino = ino;
  }

  struct stat virtual_attr(const Node& n) const {
    struct stat st {};
    st.st_ino = n.ino;
    st.st_mode = S_IFREG | 0444;
    st.st_nlink = 1;
    uint64_t size = n.kind == Kind::Index ? n.view->ckpt->index_json.size()
                                          : n.view->ckpt->outputs[n.output].size;
    st.st_size = static_cast<off_t>(size);
    st.st_blocks = static_cast<blkcnt_t>((size + 511) / 512);
    st.st_blksize = 1 << 20;
    set_times(st, n.view->mtime_ns);
    st.st_uid = n.view->uid;
    st.st_gid = n.view->gid;
    return st;
  }

  // --- lookups ---------------------------------------------------------------------------

  Result<EntryOut> lookup_real(const std::string& rel) {
    CKPTFS_TRY(struct stat st, stat_beneath(root.get(), rel));
    Node proto;
    proto.kind = kind_of(st.st_mode);
    proto.rel = rel;
    proto.dev = static_cast<uint64_t>(st.st_dev);
    proto.bino = static_cast<uint64_t>(st.st_ino);
    Node n = remember(Key{0, proto.dev, proto.bino, 0, {}}, std::move(proto));
    decorate_real(n.ino, rel, st);
    return EntryOut{n.ino, st};
  }

  Result<EntryOut> lookup_virtual(const std::shared_ptr<const View>& v, const std::string& dir_rel,
                                  Kind kind, uint32_t output, const std::string& name) {
    Node proto;
    proto.kind = kind;
    proto.rel = dir_rel;  // where the checkpoint directory is now (it may have been renamed)
    proto.view = v;
    proto.output = output;
    Node n = remember(Key{1, v->dir_dev, v->dir_ino, v->generation, name}, std::move(proto));
    return EntryOut{n.ino, virtual_attr(n)};
  }

  // The name in directory `rel` that must never be stat'ed (see Options::hide_rel).
  std::string_view hidden_child(const std::string& rel) const {
    const auto& h = opts.hide_rel;
    if (h.empty()) return {};
    if (rel.empty())
      return h.find('/') == std::string::npos ? std::string_view(h) : std::string_view();
    if (h.size() > rel.size() + 1 && h.starts_with(rel) && h[rel.size()] == '/' &&
        h.find('/', rel.size() + 1) == std::string::npos) {
      return std::string_view(h).substr(rel.size() + 1);
    }
    return {};
  }

  Result<EntryOut> lookup_in_dir(const Node& dir, std::string_view name_sv) {
    std::string name(name_sv);
    if (name == hidden_child(dir.rel)) return make_error(ENOENT, "the mount point itself");
    CKPTFS_TRY(struct stat dst, stat_beneath(root.get(), dir.rel));
    auto v = view_of(dir.rel, dst, dir.ino);
    const std::string rel = join_rel(dir.rel, name);
    if (!v) return lookup_real(rel);
    if (v->complete) {
      const auto& ck = *v->ckpt;
      for (uint32_t i = 0; i < ck.outputs.size(); ++i) {
        if (ck.outputs[i].name == name) return lookup_virtual(v, dir.rel, Kind::Output, i, name);
      }
      if (name == format::kIndexFileName) return lookup_virtual(v, dir.rel, Kind::Index, 0, name);
    }
    if (name == kShardsDirName && opts.show_shards) {
      Node proto;
      proto.kind = Kind::ShardsDir;
      proto.rel = dir.rel;
      proto.dev = static_cast<uint64_t>(dst.st_dev);
      proto.bino = static_cast<uint64_t>(dst.st_ino);
      Node n = remember(Key{2, proto.dev, proto.bino, 0, {}}, std::move(proto));
      struct stat st = dst;
      st.st_ino = n.ino;
      st.st_mode = S_IFDIR | 0555;
      return EntryOut{n.ino, st};
    }
    if (name == format::kHfMetadataDir || is_model_output_name(name) ||
        format::looks_like_shard_name(name)) {
      // Hidden in a checkpoint directory (only a real, regular shard is hidden; anything
      // else with such a name would have been shown, so check).
      auto st = stat_beneath(root.get(), rel);
      if (!st) return std::move(st).error();
      source::DirEntry e{name, *st};
      if (hidden_in_checkpoint(e)) return make_error(ENOENT, "{}: hidden", rel);
      return lookup_real(rel);
    }
    auto real = lookup_real(rel);
    if (real.ok() || real.error().code != ENOENT) return real;
    // Lifted from .hf_metadata/ (never the mapping file).
    if (name == format::kFqnMappingFileName) return real;
    const std::string lifted = join_rel(join_rel(dir.rel, format::kHfMetadataDir), name);
    auto st = stat_beneath(root.get(), lifted);
    if (!st || !S_ISREG(st->st_mode)) return real;
    return lookup_real(lifted);
  }

  Result<EntryOut> lookup_in_shards(const Node& dir, std::string_view name) {
    const std::string rel = join_rel(dir.rel, name);
    CKPTFS_TRY(struct stat st, stat_beneath(root.get(), rel));
    source::DirEntry e{std::string(name), st};
    if (!hidden_in_checkpoint(e) || e.name == format::kHfMetadataDir) {
      return make_error(ENOENT, "{}: not a hidden file", rel);
    }
    return lookup_real(rel);
  }

  // --- listings --------------------------------------------------------------------------

  Result<std::vector<DirEntryOut>> list(const Node& dir) {
    CKPTFS_TRY(struct stat dst, stat_beneath(root.get(), dir.rel));
    CKPTFS_TRY(UniqueFd fd, open_beneath(root.get(), dir.rel, O_RDONLY | O_DIRECTORY));
    CKPTFS_TRY(auto entries, source::list_dir(fd.get(), hidden_child(dir.rel)));
    std::vector<DirEntryOut> out;
    auto real = [&](const source::DirEntry& e) {
      out.push_back(DirEntryOut{
          e.name,
          ino_for(Key{
              0, static_cast<uint64_t>(e.st.st_dev), static_cast<uint64_t>(e.st.st_ino), 0, {}}),
          static_cast<mode_t>(e.st.st_mode & S_IFMT)});
    };
    if (dir.kind == Kind::ShardsDir) {
      for (const auto& e : entries) {
        if (hidden_in_checkpoint(e) && e.name != format::kHfMetadataDir) real(e);
      }
      return out;
    }
    auto v = view_of(dir.rel, dst, dir.ino);
    if (!v) {
      for (const auto& e : entries) real(e);
      return out;
    }
    std::set<std::string> names;
    for (const auto& e : entries) {
      if (hidden_in_checkpoint(e)) continue;
      real(e);
      names.insert(e.name);
    }
    if (auto meta = open_beneath(fd.get(), std::string(format::kHfMetadataDir),
                                 O_RDONLY | O_DIRECTORY | O_NOFOLLOW);
        meta.ok()) {
      if (auto lifted = source::list_dir(meta->get()); lifted.ok()) {
        for (const auto& e : *lifted) {
          if (!S_ISREG(e.st.st_mode) || e.name == format::kFqnMappingFileName ||
              names.count(e.name) || is_model_output_name(e.name) ||
              format::looks_like_shard_name(e.name) || e.name == kShardsDirName) {
            continue;
          }
          real(e);
          names.insert(e.name);
        }
      }
    }
    if (v->complete) {
      const auto& ck = *v->ckpt;
      for (const auto& o : ck.outputs) {
        out.push_back(DirEntryOut{
            o.name, ino_for(Key{1, v->dir_dev, v->dir_ino, v->generation, o.name}), S_IFREG});
      }
      std::string idx(format::kIndexFileName);
      out.push_back(
          DirEntryOut{idx, ino_for(Key{1, v->dir_dev, v->dir_ino, v->generation, idx}), S_IFREG});
    }
    if (opts.show_shards) {
      out.push_back(DirEntryOut{
          std::string(kShardsDirName),
          ino_for(
              Key{2, static_cast<uint64_t>(dst.st_dev), static_cast<uint64_t>(dst.st_ino), 0, {}}),
          S_IFDIR});
    }
    std::sort(out.begin(), out.end(),
              [](const DirEntryOut& a, const DirEntryOut& b) { return a.name < b.name; });
    return out;
  }

  // --- opening ---------------------------------------------------------------------------

  // Opens the shards of View `v`, whose directory is now at `rel` (it may have been renamed
  // since the View was built; its identity is checked).
  Result<std::shared_ptr<const ShardFds>> shard_fds(const std::shared_ptr<const View>& v,
                                                    const std::string& rel) {
    std::lock_guard lock(v->fd_mu);
    if (auto f = v->fds.lock()) return f;
    const auto& ck = *v->ckpt;
    const auto n = static_cast<int64_t>(ck.shards.size());
    if (open_shard_fds.fetch_add(n) + n > fd_budget) {
      open_shard_fds.fetch_sub(n);
      spdlog::error(
          "{}: opening its {} shards would pass the fd limit ({} shard fds already open, "
          "budget {}); raise `ulimit -n`",
          source_path(rel), n, open_shard_fds.load(), fd_budget);
      return make_error(EMFILE, "shard fd budget exhausted");
    }
    auto fds = std::make_shared<ShardFds>();
    fds->counter = &open_shard_fds;
    fds->count = n;
    fds->owned.resize(ck.shards.size());
    fds->raw.assign(ck.shards.size(), -1);
    auto dir = open_beneath(root.get(), rel, O_RDONLY | O_DIRECTORY);
    struct stat dst {};
    if (!dir || ::fstat(dir->get(), &dst) != 0 || static_cast<uint64_t>(dst.st_dev) != v->dir_dev ||
        static_cast<uint64_t>(dst.st_ino) != v->dir_ino) {
      return make_error(ESTALE, "{}: checkpoint directory moved", rel);
    }
    for (uint32_t s = 0; s < ck.shards.size(); ++s) {
      auto fd = open_at(dir->get(), ck.shards[s].name, O_RDONLY | O_NOFOLLOW);
      if (!fd && fd.error().code != ENOENT) {
        spdlog::error("{}/{}: {}", source_path(rel), ck.shards[s].name, fd.error().message);
        return std::move(fd).error();
      }
      struct stat st {};
      if (!fd || ::fstat(fd->get(), &st) != 0 || source::stamp_of(st) != ck.shards[s].stamp) {
        spdlog::warn("{}/{}: changed since the view was built; revalidating", source_path(rel),
                     ck.shards[s].name);
        return make_error(ESTALE, "{}: shard changed", ck.shards[s].name);
      }
      fds->raw[s] = fd->get();
      fds->owned[s] = std::move(fd).value();
    }
    v->fds = fds;
    return std::shared_ptr<const ShardFds>(fds);
  }

  void force_revalidate(const View& v) {
    auto st = dir_state(v.dir_dev, v.dir_ino);
    std::lock_guard lock(st->mu);
    st->next_check = Clock::now();
  }
};

Filesystem::Filesystem(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Filesystem::~Filesystem() = default;

Result<std::unique_ptr<Filesystem>> Filesystem::create(const std::string& source, Options opts) {
  auto impl = std::make_unique<Impl>();
  impl->opts = std::move(opts);
  impl->source = source;
  CKPTFS_TRY(impl->root, open_file(source, O_RDONLY | O_DIRECTORY));
  struct stat st {};
  if (::fstat(impl->root.get(), &st) != 0) {
    return make_error(errno, "{}: cannot stat: {}", source, std::strerror(errno));
  }
  struct rlimit rl {};
  ::getrlimit(RLIMIT_NOFILE, &rl);
  impl->fd_budget =
      rl.rlim_cur == RLIM_INFINITY ? (1 << 20) : static_cast<int64_t>(rl.rlim_cur) - 256;
  impl->root_dev = static_cast<uint64_t>(st.st_dev);
  impl->root_ino = static_cast<uint64_t>(st.st_ino);
  Node root;
  root.ino = kRootIno;
  root.kind = Kind::Dir;
  root.dev = impl->root_dev;
  root.bino = impl->root_ino;
  root.nlookup = 1;
  impl->nodes_.emplace(kRootIno, std::make_shared<Node>(std::move(root)));
  return std::unique_ptr<Filesystem>(new Filesystem(std::move(impl)));
}

void Filesystem::set_notifier(Notifier* n) { impl_->notifier = n; }

Result<EntryOut> Filesystem::lookup(Ino parent, std::string_view name) {
  if (!is_valid_component(name)) return make_error(ENOENT, "invalid name");
  auto dir = impl_->get(parent);
  if (!dir) return make_error(ESTALE, "unknown inode {}", parent);
  if (dir->kind == Kind::Dir) return impl_->lookup_in_dir(*dir, name);
  if (dir->kind == Kind::ShardsDir) return impl_->lookup_in_shards(*dir, name);
  return make_error(ENOTDIR, "inode {} is not a directory", parent);
}

void Filesystem::forget(Ino ino, uint64_t n) {
  std::lock_guard lock(impl_->mu_);
  auto it = impl_->nodes_.find(ino);
  if (it == impl_->nodes_.end() || ino == kRootIno) return;
  auto& node = *it->second;
  if (n > node.nlookup) {
    spdlog::critical("forget({}, {}) with only {} lookups", ino, n, node.nlookup);
    std::abort();
  }
  node.nlookup -= n;
  if (node.nlookup == 0) impl_->nodes_.erase(it);
}

Result<struct stat> Filesystem::getattr(Ino ino) {
  auto n = impl_->get(ino);
  if (!n) return make_error(ESTALE, "unknown inode {}", ino);
  switch (n->kind) {
    case Kind::Output:
    case Kind::Index:
      return impl_->virtual_attr(*n);
    case Kind::ShardsDir: {
      CKPTFS_TRY(struct stat st, stat_beneath(impl_->root.get(), n->rel));
      st.st_ino = n->ino;
      st.st_mode = S_IFDIR | 0555;
      return st;
    }
    default:
      return impl_->real_attr(*n);
  }
}

Result<std::string> Filesystem::readlink(Ino ino) {
  auto n = impl_->get(ino);
  if (!n) return make_error(ESTALE, "unknown inode {}", ino);
  if (n->kind != Kind::Symlink) return make_error(EINVAL, "not a symlink");
  std::string parent = parent_of(n->rel);
  std::string last = n->rel.substr(parent.empty() ? 0 : parent.size() + 1);
  CKPTFS_TRY(UniqueFd dir, open_beneath(impl_->root.get(), parent, O_PATH | O_DIRECTORY));
  std::string buf(PATH_MAX, '\0');
  ssize_t len = ::readlinkat(dir.get(), last.c_str(), buf.data(), buf.size());
  if (len < 0) return make_error(errno, "{}: readlink failed: {}", n->rel, std::strerror(errno));
  buf.resize(static_cast<size_t>(len));
  return buf;
}

Result<uint64_t> Filesystem::opendir(Ino ino) {
  auto n = impl_->get(ino);
  if (!n) return make_error(ESTALE, "unknown inode {}", ino);
  if (n->kind != Kind::Dir && n->kind != Kind::ShardsDir) {
    return make_error(ENOTDIR, "not a directory");
  }
  if (n->kind == Kind::Dir) CKPTFS_CHECK(impl_->real_attr(*n));
  CKPTFS_TRY(auto entries, impl_->list(*n));
  auto h = std::make_unique<DirHandle>();
  h->entries = std::move(entries);
  return reinterpret_cast<uint64_t>(h.release());
}

Status Filesystem::readdir(uint64_t dh, uint64_t offset,
                           const std::function<bool(const DirEntryOut&, uint64_t)>& add) {
  auto* h = reinterpret_cast<DirHandle*>(dh);
  for (uint64_t i = offset; i < h->entries.size(); ++i) {
    if (!add(h->entries[i], i + 1)) break;
  }
  return {};
}

void Filesystem::releasedir(uint64_t dh) { delete reinterpret_cast<DirHandle*>(dh); }

Result<OpenOut> Filesystem::open(Ino ino, int flags) {
  auto n = impl_->get(ino);
  if (!n) return make_error(ESTALE, "unknown inode {}", ino);
  if ((flags & O_ACCMODE) != O_RDONLY || (flags & O_TRUNC)) {
    return make_error(EROFS, "read-only view");
  }
  auto h = std::make_unique<FileHandle>();
  OpenOut out;
  switch (n->kind) {
    case Kind::Output: {
      auto fds = impl_->shard_fds(n->view, n->rel);
      if (!fds) {
        impl_->force_revalidate(*n->view);
        return std::move(fds).error();
      }
      h->reader = std::make_shared<OutputReader>(n->view, *fds, n->output);
      out.keep_cache = true;  // this inode only ever has this version's bytes
      out.is_virtual = true;
      break;
    }
    case Kind::Index:
      h->reader = std::make_shared<MemoryReader>(n->view, n->view->ckpt->index_json);
      out.keep_cache = true;
      out.is_virtual = true;
      break;
    case Kind::File: {
      CKPTFS_TRY(UniqueFd fd, open_beneath(impl_->root.get(), n->rel, O_RDONLY | O_NOFOLLOW));
      struct stat st {};
      if (::fstat(fd.get(), &st) != 0) return make_error(errno, "{}: stat failed", n->rel);
      if (static_cast<uint64_t>(st.st_dev) != n->dev ||
          static_cast<uint64_t>(st.st_ino) != n->bino) {
        return make_error(ESTALE, "{}: replaced", n->rel);
      }
      auto stamp = source::stamp_of(st);
      out.keep_cache = impl_->swap_cached_stamp(n->ino, stamp);
      h->reader = std::make_shared<PassthroughReader>(
          std::move(fd), static_cast<uint64_t>(st.st_size), impl_->source_path(n->rel));
      break;
    }
    case Kind::Dir:
    case Kind::ShardsDir:
      return make_error(EISDIR, "is a directory");
    default:
      return make_error(EACCES, "special files cannot be opened through the view");
  }
  out.fh = reinterpret_cast<uint64_t>(h.release());
  return out;
}

Status Filesystem::read(uint64_t fh, uint64_t off, size_t len, ReadPlan& plan) {
  auto* h = reinterpret_cast<FileHandle*>(fh);
  h->reader->plan(off, len, plan);
  return {};
}

std::shared_ptr<const FileReader> Filesystem::reader(uint64_t fh) const {
  return reinterpret_cast<FileHandle*>(fh)->reader;
}

void Filesystem::release(uint64_t fh) { delete reinterpret_cast<FileHandle*>(fh); }

Result<struct statvfs> Filesystem::statfs() {
  struct statvfs sv {};
  if (::fstatvfs(impl_->root.get(), &sv) != 0) {
    return make_error(errno, "statfs failed: {}", std::strerror(errno));
  }
  return sv;
}

Status Filesystem::modify(Ino, std::string_view what) {
  return make_error(EROFS, "{}: the view is read-only", what);
}

size_t Filesystem::live_nodes() const {
  std::lock_guard lock(impl_->mu_);
  return impl_->nodes_.size();
}

void Filesystem::invalidate_all() {
  std::vector<std::shared_ptr<DirState>> all;
  {
    std::lock_guard lock(impl_->mu_);
    for (auto& [k, v] : impl_->dirs_) all.push_back(v);
  }
  for (auto& s : all) {
    std::lock_guard lock(s->mu);
    s->next_check = Clock::now();
  }
}

}  // namespace ckptfs::fs
