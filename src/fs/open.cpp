// fs/open: opening a file for reading (a handle on the reader of what the node is), reads, release,
// and open_view_shards, which opens a View's shards with their stamps checked.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>

#include <spdlog/spdlog.h>

#include "ckptfs/source/shards.hpp"
#include "ckptfs/util/path.hpp"
#include "ckptfs/write/file.hpp"
#include "impl.hpp"
#include "readers.hpp"

namespace ckptfs::fs {

// Opens the shards of View `v`, whose directory is now at `rel` (it may have been renamed
// since the View was built; its identity is checked).
Result<std::shared_ptr<const ShardFds>> Filesystem::Impl::open_view_shards(
    const std::shared_ptr<const View>& v, const std::string& rel) {
  std::lock_guard lock(v->fd_mu);
  if (auto f = v->fds.lock()) return f;
  const auto& ck = *v->ckpt;
  const auto n = static_cast<int64_t>(ck.shards.size());
  if (open_shard_fds.fetch_add(n) + n > fd_budget) {
    open_shard_fds.fetch_sub(n);
    spdlog::error(
        "{}: opening its {} shards would pass the daemon's fd limit ({} shard fds already "
        "open, budget {}); raise the daemon's `ulimit -n`",
        source_path(rel), n, open_shard_fds.load(), fd_budget);
    // ENFILE rather than EMFILE: the limit is the daemon's, not the reader's.
    return make_error(ENFILE, "shard fd budget exhausted");
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
  fds->remote = flusher->reader();
  // The one shard opener; a shard on a node-local target is read through `remote`. Anything
  // not as the view was built from (gone, replaced, not a regular file) makes the reader
  // revalidate.
  auto opened =
      source::open_shards(ck, dir->get(), source_path(rel), "read", source::RemoteShards::Skip);
  if (!opened) {
    spdlog::warn("{}; revalidating", opened.error().message);
    return make_error(ESTALE, "{}", opened.error().message);
  }
  fds->owned = std::move(opened).value();
  for (size_t s = 0; s < fds->owned.size(); ++s) fds->raw[s] = fds->owned[s].get();
  v->fds = fds;
  return std::shared_ptr<const ShardFds>(fds);
}

Result<OpenOut> Filesystem::Impl::open(Ino ino, int flags, const Caller& who) {
  auto n = nodes.get(ino);
  if (!n) return make_error(ESTALE, "unknown inode {}", ino);
  if (n->superseded) {
    // Replaced by a write through the mount that has closed: the kernel held this version's
    // entry when it sent the open (the invalidation was still on its way, or the open went
    // through an fd's /proc link). Its readers' shard fds may still be open, but a new open
    // must get the new version: ESTALE makes the kernel look the name up again.
    return make_error(ESTALE, "{}/{}: a newer version is stored under its name", n->rel,
                      n->key.name);
  }
  // A lifted file (config.json from huggingface/): the kernel checked the path it sees, not
  // the folder the file is in. Its entry may be cached from another user's lookup.
  if (n->kind == Kind::File) CKPTFS_CHECK(may_reach_lifted(n->rel, who));
  if ((flags & O_ACCMODE) != O_RDONLY || (flags & O_TRUNC)) {
    if (opts.read_only) return make_error(EROFS, "read-only view");
    note_writer_of(ino, who);
    // A consolidated file written anew (O_TRUNC): a new file under its name, which the kernel
    // writes itself as it does a created one, unless the old version is open (its readers go
    // through the page cache).
    const bool anew = n->kind == Kind::Output && (flags & O_TRUNC) &&
                      n->view->ckpt->outputs[n->output].folder.empty();
    if ((n->kind == Kind::File || anew) && backs_writes()) return open_backed_writer(*n, flags);
    if (n->kind != Kind::File) return open_for_write(*n, flags);
    CKPTFS_CHECK(io_modes.open_cached(ino, n->rel));
    auto out = open_for_write(*n, flags);
    if (!out) {
      io_modes.release(ino, false);
    } else if (auto h = handles.file(out->fh)) {
      (*h)->io = FileHandle::Io::Cached;
    }
    return out;
  }
  if (n->kind == Kind::Output || n->kind == Kind::Index || n->kind == Kind::Pending) {
    const auto& in = n->view->inputs;
    if (!std::all_of(in.begin(), in.end(), [&](const Perm& p) { return may_read(p, who); })) {
      return make_error(EACCES, "{}: uid {} may not read every shard", n->rel, who.uid);
    }
  }
  auto h = std::make_unique<FileHandle>();
  h->ino = ino;
  OpenOut out;
  switch (n->kind) {
    case Kind::Output: {
      if (auto wf = backed_writer_of(ino)) {
        // Being written anew by a writer the kernel writes itself: one inode's opens are all
        // backed or none, so this reader reads what the new file holds now, from the same
        // file, as in a plain directory (the old version is gone for it).
        if (io_modes.open_read(ino, true)) {
          h->reader = std::make_shared<WriteFileReader>(wf);
          h->io = FileHandle::Io::Backed;
          out.backing_fd = wf->backing_fd();
          h->wf = std::move(wf);
          break;
        }
        io_modes.release(ino, false);  // counted cached: open_cached below decides
      }
      auto fds = open_view_shards(n->view, n->rel);
      if (!fds) {
        views.force_revalidate(*n->view);
        return std::move(fds).error();
      }
      // Through the page cache: counted, so that no writer the kernel writes itself joins it
      // (ETXTBSY, after a wait, for one that a writer overtook meanwhile).
      CKPTFS_CHECK(io_modes.open_cached(ino, n->rel));
      h->io = FileHandle::Io::Cached;
      h->reader = std::make_shared<OutputReader>(n->view, *fds, n->output);
      out.keep_cache = true;  // this inode only ever has this version's bytes
      out.is_virtual = true;
      break;
    }
    case Kind::Index:
      h->reader = std::make_shared<MemoryReader>(n->view, memory_file(*n->view, n->output));
      out.keep_cache = true;
      out.is_virtual = true;
      break;
    case Kind::Pending:
      h->reader = std::make_shared<MemoryReader>(n->view, n->view->pending);
      break;
    case Kind::StatusFile: {
      if (!who.root() && who.uid != ::geteuid()) {  // as its mode says (the kernel checks too)
        return make_error(EACCES, "status: uid {} is not the mount's owner", who.uid);
      }
      auto text = std::make_shared<const std::string>(status_json());
      h->reader = std::make_shared<MemoryReader>(text, *text);
      out.direct_io = true;
      break;
    }
    case Kind::File: {
      if (auto wf = writing.find(n->dev, n->bino)) {  // being written: what it holds now
        h->reader = std::make_shared<WriteFileReader>(wf);
        // Written by the kernel (write passthrough): read from the same file, as the kernel
        // requires of one inode's opens.
        if (io_modes.open_read(ino, wf->kernel_written())) {
          h->io = FileHandle::Io::Backed;
          out.backing_fd = wf->backing_fd();
        } else {
          h->io = FileHandle::Io::Cached;
        }
        h->wf = std::move(wf);
        h->ino = ino;
        break;
      }
      struct stat st {};
      auto opened = open_regular_beneath(root.get(), n->rel, Resolve::Auto, &st);
      if (!opened && opened.error().code == ENOENT) {
        // The name the kernel holds is stale (the file went, or its name now shows a
        // consolidated file): ESTALE makes it look the name up again.
        return make_error(ESTALE, "{}: gone", n->rel);
      }
      CKPTFS_TRY(UniqueFd fd, std::move(opened));
      if (!(real_key(st) == n->key)) return make_error(ESTALE, "{}: replaced", n->rel);
      auto reader = std::make_shared<PassthroughReader>(
          std::move(fd), static_cast<uint64_t>(st.st_size), source_path(n->rel));
      const bool could_back =
          opts.backing && (!opts.backing_where_writable || write::kernel_may_write(reader->fd()));
      if (io_modes.open_read(ino, could_back)) {
        // The kernel reads the file itself: the mount's page cache is not used (and the
        // kernel refuses keep_cache beside passthrough).
        h->io = FileHandle::Io::Backed;
        out.backing_fd = reader->fd();
      } else {
        h->io = FileHandle::Io::Cached;
        out.keep_cache = nodes.swap_cached_stamp(n->ino, source::stamp_of(st));
      }
      h->reader = std::move(reader);
      break;
    }
    case Kind::Dir:
    case Kind::ShardsDir:
    case Kind::StatusDir:
    case Kind::AdapterDir:
      return make_error(EISDIR, "is a directory");
    default:
      return make_error(EACCES, "special files cannot be opened through the view");
  }
  out.fh = handles.add(std::move(h));
  return out;
}

Status Filesystem::Impl::read(uint64_t fh, uint64_t off, size_t len, ReadPlan& plan) {
  CKPTFS_TRY(FileHandle * h, handles.file(fh));
  h->reader->plan(off, len, plan);
  uint64_t n = plan.size;
  if (plan.passthrough()) {  // planned as asked: what the file held at open is what counts
    const uint64_t size = h->reader->size();
    n = off >= size ? 0 : std::min<uint64_t>(len, size - off);
  }
  status.reads.fetch_add(1, std::memory_order_relaxed);
  status.bytes_read.fetch_add(n, std::memory_order_relaxed);
  return {};
}

std::shared_ptr<const FileReader> Filesystem::Impl::reader(uint64_t fh) const {
  auto h = handles.file(fh);
  return h ? (*h)->reader : nullptr;  // none for an unknown handle
}

void Filesystem::Impl::backing_refused(uint64_t fh) {
  auto found = handles.file(fh);
  if (!found || (*found)->io != FileHandle::Io::Backed) return;
  (*found)->io = FileHandle::Io::Cached;
  io_modes.demote((*found)->ino);
  // A kernel without passthrough (before 6.9): this file's writes come as requests into its
  // backing file (it is split at close), and later files take the request path from the start.
  if ((*found)->writable && writes_backed.exchange(false)) {
    spdlog::warn("write path: FUSE requests from now on (the kernel refused a backing file)");
  }
}

bool Filesystem::Impl::release(uint64_t fh) {
  auto found = handles.file(fh);
  if (!found) return false;  // not open: nothing to release
  FileHandle* h = *found;
  const bool backed = h->io == FileHandle::Io::Backed;
  if (h->io != FileHandle::Io::None) io_modes.release(h->ino, backed);
  std::shared_ptr<write::WriteFile> wf;
  if (h->writable && h->wf) {
    wf = h->wf;
    wf->writers.fetch_sub(1);
  }
  handles.drop_file(fh);
  // The last handle gone: drop the file's registry entry (its state goes with `wf`).
  if (wf && wf.use_count() == 1) {
    const auto dev = static_cast<uint64_t>(wf->dev()), ino = static_cast<uint64_t>(wf->ino());
    wf.reset();
    writing.find(dev, ino);  // drops the registry entry of a file no handle holds
  }
  return backed;
}

}  // namespace ckptfs::fs
