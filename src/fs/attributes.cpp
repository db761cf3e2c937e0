// fs/attributes: what stat says of a node (getattr, readlink): a real file's, found again
// through another link or an open handle once its name is gone, a synthesized file's and a
// file's being written.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <climits>
#include <cstring>

#include "ckptfs/util/path.hpp"
#include "impl.hpp"
#include "names.hpp"
#include "readers.hpp"

namespace ckptfs::fs {

// Fresh attributes of a real node, or ESTALE when its path now names another file (or the
// same number reused for another type).
Result<struct stat> Filesystem::Impl::real_attr(const Node& n) {
  auto found = n.retired ? Result<struct stat>(make_error(ENOENT, "{}: gone", n.rel))
                         : stat_beneath(root.get(), n.rel);
  if (!found || !(real_key(*found) == n.key)) {
    if (n.ino == kRootIno) return found;
    // The path the node had no longer names it: another of its names (a hard link), or a
    // handle still open on it (an unlinked file), or ESTALE: the kernel looks it up again.
    if (auto st = by_other_link(n)) return *st;
    if (auto st = by_open_handle(n)) return *st;
    return make_error(ESTALE, "{}: {}", n.rel, found ? "replaced" : "gone");
  }
  struct stat st = *found;
  decorate_real(n.ino, n.rel, st);
  if (S_ISREG(st.st_mode)) {
    if (auto wf = writing.find(n.dev, n.bino)) {
      if (auto ws = wf->stat(); ws) {
        st.st_size = ws->st_size;
        st.st_blocks = ws->st_blocks;
      }
    }
  }
  return st;
}

// Attributes of node `n` under another name it was looked up by (its hard links), which it
// takes as its path from now on.
std::optional<struct stat> Filesystem::Impl::by_other_link(const Node& n) {
  if (n.retired) return std::nullopt;  // its number may name another file under those names
  for (const auto& [parent, name] : n.links) {
    auto p = nodes.get(parent);
    if (!p || p->kind != Kind::Dir) continue;
    const std::string rel = join_rel(p->rel, name);
    auto st = stat_beneath(root.get(), rel);
    if (!st || !(real_key(*st) == n.key)) continue;
    nodes.set_rel(n.ino, rel);
    decorate_real(n.ino, rel, *st);
    return *st;
  }
  return std::nullopt;
}

// Attributes of node `n` through a handle still open on it (fstat of an unlinked file).
std::optional<struct stat> Filesystem::Impl::by_open_handle(const Node& n) {
  std::shared_ptr<write::WriteFile> wf;
  struct stat st {};
  bool found = false;
  handles.find_file([&](const FileHandle& h) {
    if (h.ino != n.ino) return false;
    if (h.wf) {
      wf = h.wf;
      return true;
    }
    const auto* pr = dynamic_cast<const PassthroughReader*>(h.reader.get());
    if (pr && ::fstat(pr->fd(), &st) == 0 && real_key(st) == n.key) {
      found = true;
      return true;
    }
    return false;
  });
  if (wf) {  // outside the handles' lock: its own mutex may be held through a long copy
    auto ws = wf->stat();
    if (!ws) return std::nullopt;
    st = *ws;
    found = true;
  }
  if (!found) return std::nullopt;
  st.st_ino = nodes.shown_ino(n.dev, n.bino);
  return st;
}

// Attributes of a real entry as shown: a checkpoint directory's mtime follows its shards.
void Filesystem::Impl::decorate_real(Ino ino, const std::string& rel, struct stat& st) {
  if (S_ISDIR(st.st_mode)) {
    int64_t shown = INT64_MIN;
    views.view_of(rel, st, ino, Need::Any, &shown);
    if (shown > mtime_ns(st)) st.st_mtim = to_timespec(shown);
  }
  st.st_ino = nodes.shown_ino(static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino));
}

struct stat Filesystem::Impl::virtual_attr(const Node& n) const {
  struct stat st {};
  st.st_ino = virtual_ino(n.key.dev, n.key.ino, n.key.gen, n.key.name);
  if (n.kind == Kind::AdapterDir) {
    // As the .shards folder: searchable by all; its files carry the consolidated files' rules.
    st.st_mode = S_IFDIR | 0555;
    st.st_nlink = 2;
    st.st_blksize = 1 << 20;
    st.st_uid = n.view->shown.uid;
    st.st_gid = n.view->shown.gid;
    set_times(st, n.view->mtime_ns);
    return st;
  }
  st.st_mode = S_IFREG | (n.kind == Kind::Pending ? mode_t{0444} : n.view->shown.mode);
  st.st_nlink = 1;
  uint64_t size = n.kind == Kind::Index     ? memory_file(*n.view, n.output).size()
                  : n.kind == Kind::Pending ? n.view->pending.size()
                                            : n.view->ckpt->outputs[n.output].size;
  st.st_size = static_cast<off_t>(size);
  st.st_blocks = static_cast<blkcnt_t>((size + 511) / 512);
  st.st_blksize = 1 << 20;
  set_times(st, n.view->mtime_ns);
  st.st_uid = n.view->shown.uid;
  st.st_gid = n.view->shown.gid;
  if (n.kind == Kind::Output && n.view->ckpt->outputs[n.output].written) written_attr(n, st);
  return st;
}

// A file written through the mount shows what its writer gave it (carried by its shards,
// each set alike at commit and by setattr): its owner, its mode (write bits included) and
// its mtime. Shards that disagree (changed in SRC) show as a synthesized file does.
void Filesystem::Impl::written_attr(const Node& n, struct stat& st) {
  const auto& ck = *n.view->ckpt;
  const auto& out = ck.outputs[n.output];
  if (out.shards.empty()) return;
  const layout::Access& a = ck.shards[out.shards.front()].access;
  int64_t mtime = INT64_MIN, atime = INT64_MIN;
  for (uint32_t s : out.shards) {
    if (!(ck.shards[s].access == a)) return;
    mtime = std::max(mtime, ck.shards[s].stamp.mtime_ns);
    atime = std::max(atime, ck.shards[s].atime_ns);
  }
  st.st_mode = S_IFREG | (a.mode & 07777);
  st.st_uid = a.uid;
  st.st_gid = a.gid;
  set_times(st, mtime);
  st.st_atim = to_timespec(atime);
}

Result<struct stat> Filesystem::Impl::getattr(Ino ino) {
  auto n = nodes.get(ino);
  if (!n) return make_error(ESTALE, "unknown inode {}", ino);
  switch (n->kind) {
    case Kind::Output:
      if (auto wf = backed_writer_of(ino)) {
        // Being written anew by the kernel (write passthrough): its size and times are the new
        // file's, which its writer's appends and seeks go by.
        struct stat st = virtual_attr(*n);
        CKPTFS_TRY(const struct stat now, wf->stat());
        st.st_size = now.st_size;
        st.st_blocks = now.st_blocks;
        st.st_mtim = now.st_mtim;
        st.st_ctim = now.st_ctim;
        return st;
      }
      return virtual_attr(*n);
    case Kind::Index:
    case Kind::Pending:
    case Kind::AdapterDir:
      return virtual_attr(*n);
    case Kind::StatusDir:
    case Kind::StatusFile:
      return status_attr(*n);
    case Kind::ShardsDir: {
      CKPTFS_TRY(struct stat st, stat_beneath(root.get(), n->rel));
      st.st_ino = virtual_ino(n->dev, n->bino, 0, kShardsDirName);
      st.st_mode = S_IFDIR | 0555;
      return st;
    }
    default:
      return real_attr(*n);
  }
}

Result<std::string> Filesystem::Impl::readlink(Ino ino) {
  auto n = nodes.get(ino);
  if (!n) return make_error(ESTALE, "unknown inode {}", ino);
  if (n->kind != Kind::Symlink) return make_error(EINVAL, "not a symlink");
  const std::string last = last_of(n->rel);
  CKPTFS_TRY(UniqueFd dir, open_beneath(root.get(), parent_of(n->rel), O_PATH | O_DIRECTORY));
  std::string buf(PATH_MAX, '\0');
  ssize_t len = ::readlinkat(dir.get(), last.c_str(), buf.data(), buf.size());
  if (len < 0) return make_error(errno, "{}: readlink failed: {}", n->rel, std::strerror(errno));
  buf.resize(static_cast<size_t>(len));
  return buf;
}

Result<struct stat> Filesystem::Impl::getattr_handle(uint64_t fh) {
  CKPTFS_TRY(FileHandle * h, handles.file(fh));
  if (!h->wf) return getattr(h->ino);
  auto n = nodes.get(h->ino);
  if (n && n->kind == Kind::File) {
    if (auto st = getattr(h->ino); st) return st;  // the name still holds it
  }
  CKPTFS_TRY(struct stat st, h->wf->stat());
  st.st_ino = nodes.shown_ino(static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino));
  return st;
}

}  // namespace ckptfs::fs
