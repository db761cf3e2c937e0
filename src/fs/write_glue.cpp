// fs/write_glue: the façade's write calls: a handle open for writing made, and each call on a
// handle handed to the write path (write_path.hpp).
#include <fcntl.h>

#include "impl.hpp"
#include "readers.hpp"

namespace ckptfs::fs {

Result<OpenOut> Filesystem::Impl::open_for_write(const Node& n, int flags) {
  CKPTFS_TRY(auto wf, writing.open(n, flags));
  OpenOut out;
  out.fh = adopt_writer(std::move(wf), n.ino);
  return out;
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
