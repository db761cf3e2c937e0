// fs/filesystem: the façade; Filesystem's public calls, each handed to the room that owns it
// (src/fs/impl.hpp lists the rooms), and the making of a Filesystem.
#include "ckptfs/fs/filesystem.hpp"

#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "impl.hpp"

namespace ckptfs::fs {

Filesystem::Impl::Impl(Options o, std::string source_dir, UniqueFd root_fd,
                       const struct stat& root_st)
    : opts(std::move(o)),
      source(std::move(source_dir)),
      root(std::move(root_fd)),
      clock(opts.clock ? opts.clock : system_clock()),
      flusher(opts.flusher ? opts.flusher
                           : std::shared_ptr<flush::Flusher>(flush::make_local_flusher())),
      status(clock->realtime_ns()),
      writing(WritePath::Deps{opts, source, root.get(), clock, *flusher, nodes, headers}),
      views(DirViews::Deps{opts, source, root.get(), clock, nodes, headers, *flusher,
                           writing.registry(), status}) {
  struct rlimit rl {};
  ::getrlimit(RLIMIT_NOFILE, &rl);
  const int64_t limit =
      rl.rlim_cur == RLIM_INFINITY ? (int64_t{1} << 20) : static_cast<int64_t>(rl.rlim_cur);
  // A quarter of the limit (16..256) stays free for FUSE channels, logs, plain files and the
  // one shard at a time a header scan opens; the rest may be held by open consolidated files.
  fd_budget = limit - std::clamp<int64_t>(limit / 4, 16, 256);
  writers = std::make_unique<WriterViews>(
      opts.writer_view, [c = clock] { return c->now(); }, &WriterViews::process_of_tid);
  protected_regular =
      opts.protected_regular >= 0 ? opts.protected_regular : read_protected_regular();
  Node r;
  r.ino = kRootIno;
  r.key = real_key(root_st);
  r.kind = Kind::Dir;
  r.dev = static_cast<uint64_t>(root_st.st_dev);
  r.bino = static_cast<uint64_t>(root_st.st_ino);
  r.nlookup = 1;
  nodes.set_root(std::move(r));
}

Filesystem::Filesystem(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Filesystem::~Filesystem() = default;

Result<std::unique_ptr<Filesystem>> Filesystem::create(const std::string& source, Options opts) {
  CKPTFS_TRY(UniqueFd root, open_file(source, O_RDONLY | O_DIRECTORY));
  struct stat st {};
  if (::fstat(root.get(), &st) != 0) {
    return make_error(errno, "{}: cannot stat: {}", source, std::strerror(errno));
  }
  auto impl = std::make_unique<Impl>(std::move(opts), source, std::move(root), st);
  return std::unique_ptr<Filesystem>(new Filesystem(std::move(impl)));
}

void Filesystem::set_notifier(Notifier* n) {
  impl_->notifier = n;
  impl_->views.set_notifier(n);
  impl_->writing.set_notifier(n);
}

// --- builds.cpp ---------------------------------------------------------------------------

bool Filesystem::when_ready(Ino dir, std::string_view name, const std::function<void()>& resume) {
  return impl_->views.when_ready(dir, name, resume);
}
void Filesystem::stop_builds() { impl_->views.stop_builds(); }

// --- namespace.cpp ------------------------------------------------------------------------

Result<EntryOut> Filesystem::lookup(Ino parent, std::string_view name, const Caller& who) {
  return impl_->lookup(parent, name, who);
}
void Filesystem::forget(Ino ino, uint64_t nlookup) { impl_->forget(ino, nlookup); }
Result<struct stat> Filesystem::getattr(Ino ino) { return impl_->getattr(ino); }
Result<std::string> Filesystem::readlink(Ino ino) { return impl_->readlink(ino); }
Result<uint64_t> Filesystem::opendir(Ino ino, const Caller& who) {
  return impl_->opendir(ino, who);
}
Status Filesystem::readdir(uint64_t dh, uint64_t offset,
                           const std::function<bool(const DirEntryOut&, uint64_t)>& add) {
  return impl_->readdir(dh, offset, add);
}
void Filesystem::releasedir(uint64_t dh) { impl_->releasedir(dh); }
Result<struct stat> Filesystem::getattr_handle(uint64_t fh) { return impl_->getattr_handle(fh); }

// --- open.cpp -----------------------------------------------------------------------------

Result<OpenOut> Filesystem::open(Ino ino, int flags, const Caller& who) {
  return impl_->open(ino, flags, who);
}
Status Filesystem::read(uint64_t fh, uint64_t off, size_t len, ReadPlan& plan) {
  return impl_->read(fh, off, len, plan);
}
std::shared_ptr<const FileReader> Filesystem::reader(uint64_t fh) const {
  return impl_->reader(fh);
}
bool Filesystem::release(uint64_t fh) { return impl_->release(fh); }
void Filesystem::backing_refused(uint64_t fh) { impl_->backing_refused(fh); }

Result<struct statvfs> Filesystem::statfs() {
  struct statvfs sv {};
  if (::fstatvfs(impl_->root.get(), &sv) != 0) {
    return make_error(errno, "statfs failed: {}", std::strerror(errno));
  }
  return sv;
}

// --- mutate.cpp, rename.cpp ---------------------------------------------------------------

Result<CreateOut> Filesystem::create(Ino parent, std::string_view name, mode_t mode, int flags,
                                     const Caller& who) {
  return impl_->create(parent, name, mode, flags, who);
}
Result<EntryOut> Filesystem::mkdir(Ino parent, std::string_view name, mode_t mode,
                                   const Caller& who) {
  return impl_->mkdir(parent, name, mode, who);
}
Result<EntryOut> Filesystem::mknod(Ino parent, std::string_view name, mode_t mode,
                                   const Caller& who) {
  return impl_->mknod(parent, name, mode, who);
}
Result<EntryOut> Filesystem::symlink(std::string_view target, Ino parent, std::string_view name,
                                     const Caller& who) {
  return impl_->symlink(target, parent, name, who);
}
Result<EntryOut> Filesystem::link(Ino ino, Ino new_parent, std::string_view new_name,
                                  const Caller& who) {
  return impl_->link(ino, new_parent, new_name, who);
}
Status Filesystem::unlink(Ino parent, std::string_view name, const Caller& who) {
  return impl_->unlink(parent, name, who);
}
Status Filesystem::rmdir(Ino parent, std::string_view name, const Caller& who) {
  return impl_->rmdir(parent, name, who);
}
Status Filesystem::rename(Ino parent, std::string_view name, Ino new_parent,
                          std::string_view new_name, unsigned flags, const Caller& who) {
  return impl_->rename(parent, name, new_parent, new_name, flags, who);
}
Result<struct stat> Filesystem::setattr(Ino ino, const SetAttr& a, std::optional<uint64_t> fh) {
  return impl_->setattr(ino, a, fh);
}
Status Filesystem::fsyncdir(Ino ino) { return impl_->fsyncdir(ino); }

// --- write_glue.cpp -----------------------------------------------------------------------

Result<size_t> Filesystem::write(uint64_t fh, uint64_t off, std::string_view bytes) {
  return impl_->write(fh, off, bytes);
}
Status Filesystem::flush(uint64_t fh, const Caller& who) { return impl_->flush(fh, who); }
Status Filesystem::fsync(uint64_t fh, bool datasync) { return impl_->fsync(fh, datasync); }

// --- the daemon's own figures (status.cpp) --------------------------------------------------

Filesystem::Counts Filesystem::counts() const {
  const auto s = impl_->nodes.sizes();
  Counts c;
  c.nodes = s.nodes;
  c.keys = s.keys;
  c.dirs = s.dirs;
  c.header_bytes = impl_->headers.bytes();
  return c;
}

std::string Filesystem::status_json() const { return impl_->status_json(); }
size_t Filesystem::pending_splits() const { return impl_->writing.pending_splits(); }
void Filesystem::drain_splits() { impl_->writing.drain_splits(); }
void Filesystem::set_status_extra(StatusExtra extra) { impl_->status.set_extra(std::move(extra)); }
void Filesystem::note_error(int err) { impl_->status.note_error(err); }

void Filesystem::invalidate_all() { impl_->views.invalidate_all(); }

}  // namespace ckptfs::fs
