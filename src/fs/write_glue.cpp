// fs/write_glue: the façade's write calls: a handle open for writing made, and each call on a
// handle handed to the write path (write_path.hpp).
#include <fcntl.h>

#include <optional>

#include "ckptfs/format/names.hpp"
#include "ckptfs/util/path.hpp"
#include "impl.hpp"
#include "readers.hpp"

namespace ckptfs::fs {

Result<OpenOut> Filesystem::Impl::open_for_write(const Node& n, int flags) {
  CKPTFS_TRY(auto wf, writing.open(n, flags));
  OpenOut out;
  out.fh = adopt_writer(std::move(wf), n.ino);
  return out;
}

Result<OpenOut> Filesystem::Impl::open_backed_writer(const Node& n, int flags) {
  // On a file system the kernel does not write through the mount, the writes come as
  // requests: counted cached before the file is opened, so an O_TRUNC open refused beside
  // backed readers (ETXTBSY, -o passthrough=on) truncates nothing.
  // A consolidated file's node names its directory; the file is the name in it.
  const std::string rel = n.kind == Kind::File ? n.rel : join_rel(n.rel, n.key.name);
  bool backed = write::kernel_may_write(root.get());
  if (backed) {
    backed = io_modes.open_write(n.ino);
  } else {
    CKPTFS_CHECK(io_modes.open_cached(n.ino, rel));
  }
  auto wf = writing.open(n, flags);
  if (!wf) {
    io_modes.release(n.ino, backed);
    return std::move(wf).error();
  }
  return backed_writer(std::move(*wf), n.ino, rel, backed);
}

Result<OpenOut> Filesystem::Impl::backed_writer(std::shared_ptr<write::WriteFile> wf, Ino ino,
                                                std::string_view rel, std::optional<bool> counted) {
  bool backed = false;
  if (counted) {
    backed = *counted;
  } else {
    backed = io_modes.open_write(ino);
  }
  if (backed && !wf->kernel_writes()) {
    // The daemon holds or routes this file's bytes (another writer streams it), or SRC's file
    // system cannot tell what was written (write/file.hpp): its writes come as requests, once
    // the backed opens of the inode are gone.
    io_modes.release(ino, true);
    CKPTFS_CHECK(io_modes.open_cached(ino, rel));
    backed = false;
  }
  if (backed && format::is_model_name(split_rel(rel).name)) wf->guard_model_name();
  OpenOut out;
  if (backed) out.backing_fd = wf->backing_fd();
  out.fh = adopt_writer(std::move(wf), ino);
  if (auto h = handles.file(out.fh)) {
    (*h)->io = backed ? FileHandle::Io::Backed : FileHandle::Io::Cached;
  }
  return out;
}

std::shared_ptr<write::WriteFile> Filesystem::Impl::backed_writer_of(Ino ino) const {
  // A consolidated file's getattr and open ask: the handles are looked through only where
  // the inode has backed opens (a rewrite), which it has nowhere else.
  if (!io_modes.has_backed(ino)) return nullptr;
  std::shared_ptr<write::WriteFile> wf;
  handles.find_file([&](const FileHandle& h) {
    if (h.ino != ino || !h.writable || !h.wf || h.io != FileHandle::Io::Backed) return false;
    wf = h.wf;
    return true;
  });
  return wf;
}

// A handle open for writing on `wf`, for the kernel's inode `ino`.
uint64_t Filesystem::Impl::adopt_writer(std::shared_ptr<write::WriteFile> wf, Ino ino) {
  wf->writers.fetch_add(1);
  auto h = std::make_unique<FileHandle>();
  h->reader = std::make_shared<WriteFileReader>(wf);
  h->wf = std::move(wf);
  h->ino = ino;
  h->writable = true;
  return handles.add(std::move(h));
}

Result<size_t> Filesystem::Impl::write(uint64_t fh, uint64_t off, std::string_view bytes) {
  CKPTFS_TRY(FileHandle * h, handles.file(fh));
  if (!h->wf || !h->writable) return make_error(EBADF, "not open for writing");
  CKPTFS_CHECK(h->wf->write(off, bytes));
  status.writes.fetch_add(1, std::memory_order_relaxed);
  status.bytes_written.fetch_add(bytes.size(), std::memory_order_relaxed);
  return bytes.size();
}

Status Filesystem::Impl::flush(uint64_t fh, const Caller& who) {
  CKPTFS_TRY(FileHandle * h, handles.file(fh));
  if (!h->wf || !h->writable) return {};
  note_writer_of(h->ino, who);
  return writing.close(h->ino, *h->wf);
}

Status Filesystem::Impl::fsync(uint64_t fh, bool datasync) {
  CKPTFS_TRY(FileHandle * h, handles.file(fh));
  if (!h->wf) return {};
  return writing.fsync(h->ino, *h->wf, datasync);
}

}  // namespace ckptfs::fs
