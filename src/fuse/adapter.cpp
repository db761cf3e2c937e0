// fuse/adapter: translates libfuse's low-level requests to fs::Filesystem calls and back, one
// short translation per operation, and wires a mount together (run_mount). The session and its
// signals (session.*), the notify thread (notify.*) and the decided options (config.*) are their
// own rooms.
#include "ckptfs/fuse/adapter.hpp"

#include <fcntl.h>
#include <fuse_lowlevel.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <mutex>

#include <spdlog/spdlog.h>

#include "ckptfs/fs/prefetch.hpp"
#include "ckptfs/fuse/backing.hpp"
#include "ckptfs/util/sd_notify.hpp"
#include "config.hpp"
#include "notify.hpp"
#include "session.hpp"

namespace ckptfs::fuse {
namespace {

constexpr size_t kMaxRead = 1 << 20;  // FUSE requests are at most 256 pages

struct Context {
  fs::Filesystem* fs = nullptr;
  const MountOptions* opts = nullptr;
  fuse_session* se = nullptr;
  fs::Prefetcher* prefetch = nullptr;
  Backing* backing = nullptr;  // FUSE passthrough of plain files, where enabled
  std::string devnum;          // the mount's bdi "major:minor"
  std::once_flag read_ahead;   // set once the kernel has processed our INIT reply
};

// The kernel caps the bdi's read-ahead at INIT time, so it is raised on the first request
// after INIT (the kernel sends none before the INIT reply is processed).
Context& ctx(fuse_req_t req) {
  auto& c = *static_cast<Context*>(fuse_req_userdata(req));
  std::call_once(c.read_ahead, [&c] { set_read_ahead(c.devnum, c.opts->read_ahead_kb); });
  return c;
}

void reply_error(fuse_req_t req, const Error& e, std::string_view op) {
  // Answers that are part of normal operation are not logged as errors.
  static constexpr int kQuiet[] = {ENOENT, EROFS,   ESTALE, EACCES, EEXIST,  ENOTEMPTY,    EXDEV,
                                   EPERM,  ENOTDIR, EISDIR, EINVAL, ENOTSUP, ENAMETOOLONG, ELOOP};
  if (std::find(std::begin(kQuiet), std::end(kQuiet), e.code) == std::end(kQuiet)) {
    spdlog::error("{}: {}", op, e.message);
    ctx(req).fs->note_error(e.code);  // for .ckptfs/status.json
  }
  fuse_reply_err(req, e.code);
}

// No exception crosses into libfuse (a C library): every callback's body runs under guarded(),
// which answers the request with ENOMEM (bad_alloc) or EIO for an exception the body let out.
// Bodies reply last, so a throw never follows a reply; the few that work after replying (open's
// prefetch) catch for themselves.
void fail_request(fuse_req_t req, const char* op, int err, const char* what) noexcept {
  try {
    spdlog::error("{}: {} (answered {})", op, what, std::strerror(err));
  } catch (...) {  // logging failed too: the answer still goes out
  }
  fuse_reply_err(req, err);
}

template <typename Body>
void guarded(fuse_req_t req, const char* op, Body&& body) noexcept {
  try {
    body();
  } catch (const std::bad_alloc&) {
    fail_request(req, op, ENOMEM, "out of memory");
  } catch (const std::exception& e) {
    fail_request(req, op, EIO, e.what());
  } catch (...) {
    fail_request(req, op, EIO, "unknown exception");
  }
}

// forget answers nothing: a body that throws still owes fuse_reply_none.
template <typename Body>
void guarded_none(fuse_req_t req, Body&& body) noexcept {
  try {
    body();
    return;
  } catch (const std::exception& e) {
    try {
      spdlog::error("forget: {}", e.what());
    } catch (...) {
    }
  } catch (...) {
  }
  fuse_reply_none(req);
}

fuse_entry_param entry_of(const fs::EntryOut& e, const MountOptions& o) {
  fuse_entry_param p{};
  p.ino = e.ino;
  p.generation = 1;
  p.attr = e.attr;
  // A name of the writer's view is its alone: the kernel keeps no entry others could use.
  p.attr_timeout = e.uncached ? 0 : o.attr_timeout;
  p.entry_timeout = e.uncached ? 0 : o.entry_timeout;
  return p;
}

// Who asks, without the supplementary groups (enough for lookups and listings: the pid).
fs::Caller requester(fuse_req_t req) {
  const fuse_ctx* fc = fuse_req_ctx(req);
  return fs::Caller{fc->uid, fc->gid, {}, fc->pid};
}

// --- operations ---------------------------------------------------------------------------

void op_init(void* userdata, fuse_conn_info* conn) {
  auto& c = *static_cast<Context*>(userdata);
  if (c.opts->splice) {
    if (conn->capable & FUSE_CAP_SPLICE_WRITE) conn->want |= FUSE_CAP_SPLICE_WRITE;
    if (conn->capable & FUSE_CAP_SPLICE_MOVE) conn->want |= FUSE_CAP_SPLICE_MOVE;
  } else {
    conn->want &= ~(FUSE_CAP_SPLICE_WRITE | FUSE_CAP_SPLICE_MOVE);
  }
  if (conn->capable & FUSE_CAP_PARALLEL_DIROPS) conn->want |= FUSE_CAP_PARALLEL_DIROPS;
  if (conn->capable & FUSE_CAP_CACHE_SYMLINKS) conn->want |= FUSE_CAP_CACHE_SYMLINKS;
  if (c.backing) c.backing->ask_in_init();
  // libfuse refuses INIT unless init() repeats the max_read mount option.
  if (c.opts->max_read) conn->max_read = c.opts->max_read;
  const auto bg = fs::fuse_background(c.opts->read_ahead_kb, kMaxRead >> 10);
  conn->max_background = bg.max_background;
  conn->congestion_threshold = bg.congestion_threshold;
  spdlog::debug("fuse init: max_write={} max_readahead={} max_read={} background={}/{} splice={}",
                conn->max_write, conn->max_readahead, conn->max_read, bg.max_background,
                bg.congestion_threshold, c.opts->splice);
}

void do_lookup(fuse_req_t req, fuse_ino_t parent, const char* name) {
  auto& c = ctx(req);
  auto r = c.fs->lookup(parent, name, requester(req));
  if (!r) return reply_error(req, r.error(), "lookup");
  auto e = entry_of(*r, *c.opts);
  fuse_reply_entry(req, &e);
}

// A lookup or listing that needs a directory's view built (or being built) is parked on the
// directory (fs::Filesystem::when_ready) and answered by a builder thread once the build ends:
// no FUSE worker reads a header or waits for another's build, so one directory's build never
// stalls the others.
void op_lookup(fuse_req_t req, fuse_ino_t parent, const char* name) {
  std::string n(name);  // libfuse's buffer is gone once this returns
  auto resume = [req, parent, n] {
    guarded(req, "lookup", [&] { do_lookup(req, parent, n.c_str()); });
  };
  if (!ctx(req).fs->when_ready(parent, n, resume)) return;
  do_lookup(req, parent, name);
}

void op_forget(fuse_req_t req, fuse_ino_t ino, uint64_t n) {
  ctx(req).fs->forget(ino, n);
  fuse_reply_none(req);
}

void op_forget_multi(fuse_req_t req, size_t count, fuse_forget_data* f) {
  for (size_t i = 0; i < count; ++i) ctx(req).fs->forget(f[i].ino, f[i].nlookup);
  fuse_reply_none(req);
}

void op_getattr(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  auto& c = ctx(req);
  auto r = fi ? c.fs->getattr_handle(fi->fh) : c.fs->getattr(ino);
  if (!r) return reply_error(req, r.error(), "getattr");
  fuse_reply_attr(req, &*r, c.opts->attr_timeout);
}

void op_readlink(fuse_req_t req, fuse_ino_t ino) {
  auto r = ctx(req).fs->readlink(ino);
  if (!r) return reply_error(req, r.error(), "readlink");
  fuse_reply_readlink(req, r->c_str());
}

void do_opendir(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  auto r = ctx(req).fs->opendir(ino, requester(req));
  if (!r) return reply_error(req, r.error(), "opendir");
  fi->fh = *r;
  fuse_reply_open(req, fi);
}

void op_opendir(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  auto resume = [req, ino, copy = *fi]() mutable {  // libfuse's fi is gone once this returns
    guarded(req, "opendir", [&] { do_opendir(req, ino, &copy); });
  };
  if (!ctx(req).fs->when_ready(ino, "", resume)) return;
  do_opendir(req, ino, fi);
}

void op_readdir(fuse_req_t req, fuse_ino_t, size_t size, off_t off, fuse_file_info* fi) {
  std::vector<char> buf(size);
  size_t used = 0;
  auto st = ctx(req).fs->readdir(
      fi->fh, static_cast<uint64_t>(off), [&](const fs::DirEntryOut& e, uint64_t next) {
        struct stat st {};
        st.st_ino = e.ino;
        st.st_mode = e.type;
        size_t need = fuse_add_direntry(req, buf.data() + used, size - used, e.name.c_str(), &st,
                                        static_cast<off_t>(next));
        if (need > size - used) return false;
        used += need;
        return true;
      });
  if (!st) return reply_error(req, st.error(), "readdir");
  fuse_reply_buf(req, buf.data(), used);
}

void op_releasedir(fuse_req_t req, fuse_ino_t, fuse_file_info* fi) {
  ctx(req).fs->releasedir(fi->fh);
  fuse_reply_err(req, 0);
}

// The request's credentials, for the access check of synthesized files.
fs::Caller caller_of(fuse_req_t req) {
  const fuse_ctx* fc = fuse_req_ctx(req);
  fs::Caller who{fc->uid, fc->gid, {}, fc->pid};
  if (who.uid == 0) return who;
  who.groups.resize(64);
  int n = fuse_req_getgroups(req, static_cast<int>(who.groups.size()), who.groups.data());
  if (n > static_cast<int>(who.groups.size())) {
    who.groups.resize(static_cast<size_t>(n));
    n = fuse_req_getgroups(req, n, who.groups.data());
  }
  // Without the groups (no /proc), only the primary group counts: stricter, never looser.
  who.groups.resize(n > 0 ? std::min(static_cast<size_t>(n), who.groups.size()) : 0);
  return who;
}

// An open the kernel writes through: no prefetch push may store into its inode meanwhile
// (Prefetcher::write_opened). By the access mode, which RELEASE's flags keep too.
bool opened_for_writing(int flags) { return (flags & O_ACCMODE) != O_RDONLY; }

void op_open(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  auto& c = ctx(req);
  auto r = c.fs->open(ino, fi->flags, caller_of(req));
  if (!r) return reply_error(req, r.error(), "open");
  const bool writes = c.prefetch && opened_for_writing(fi->flags);
  if (writes) c.prefetch->write_opened(ino);
  fi->fh = r->fh;
  fi->keep_cache = r->keep_cache;
  fi->direct_io = r->direct_io;
  int backing_id = 0;
  if (r->backing_fd >= 0) {
    backing_id = c.backing ? c.backing->acquire(ino, r->backing_fd) : 0;
    if (backing_id > 0) {
      Backing::mark_next_open(backing_id);
    } else {
      c.fs->backing_refused(r->fh);
    }
  }
  // Take what the prefetcher needs before replying: once the reply is out, the kernel may
  // send RELEASE on another thread and the handle is gone.
  std::shared_ptr<const fs::FileReader> reader;
  if (c.prefetch && r->is_virtual) reader = c.fs->reader(r->fh);
  if (fuse_reply_open(req, fi) != 0) {
    Backing::clear_mark();
    if (c.fs->release(r->fh) && backing_id > 0) c.backing->release(ino);  // the opener went away
    if (writes) c.prefetch->write_closed(ino);
    return;
  }
  if (!reader) return;
  try {  // after the reply: guarded() must not answer again
    c.prefetch->on_open(ino, std::move(reader));
  } catch (const std::exception& e) {
    spdlog::warn("open: no prefetch of inode {}: {}", ino, e.what());
  }
}

void op_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, fuse_file_info* fi) {
  auto& c = ctx(req);
  thread_local fs::ReadPlan plan;
  thread_local std::vector<char> buf(kMaxRead);
  size = std::min(size, kMaxRead);
  auto st = c.fs->read(fi->fh, static_cast<uint64_t>(off), size, plan);
  if (!st) return reply_error(req, st.error(), "read");
  if (c.prefetch && plan.src.ckpt != nullptr) {
    c.prefetch->on_miss(ino, c.fs->reader(fi->fh), static_cast<uint64_t>(off), size);
  }
  auto splice = c.opts->splice ? fs::splice_ready(plan) : Result<bool>(false);
  if (!splice) return reply_error(req, splice.error(), "read");
  if (*splice) {
    // Zero-copy: fd-backed buffers the kernel splices, header bytes from memory.
    const size_t n = plan.segs.size();
    std::vector<char> storage(sizeof(fuse_bufvec) + n * sizeof(fuse_buf));
    auto* bv = new (storage.data()) fuse_bufvec{};
    bv->count = n;
    bv->idx = 0;
    bv->off = 0;
    for (size_t i = 0; i < n; ++i) {
      const auto& s = plan.segs[i];
      fuse_buf& b = bv->buf[i];
      b = fuse_buf{};
      b.size = s.len;
      if (s.is_memory()) {
        b.mem = const_cast<char*>(plan.src.header.data() + s.src);
      } else {
        b.flags = static_cast<fuse_buf_flags>(FUSE_BUF_IS_FD | FUSE_BUF_FD_SEEK);
        b.fd = plan.src.fds[s.shard];
        b.pos = static_cast<off_t>(s.src);
      }
    }
    fuse_reply_data(req, bv, FUSE_BUF_SPLICE_MOVE);
    return;
  }
  auto n = fs::execute(plan, buf.data());
  if (!n) return reply_error(req, n.error(), "read");
  fuse_reply_buf(req, buf.data(), *n);
}

void op_release(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  auto& c = ctx(req);
  if (c.fs->release(fi->fh) && c.backing) c.backing->release(ino);
  if (c.prefetch && opened_for_writing(fi->flags)) c.prefetch->write_closed(ino);
  fuse_reply_err(req, 0);
}

void op_statfs(fuse_req_t req, fuse_ino_t) {
  auto r = ctx(req).fs->statfs();
  if (!r) return reply_error(req, r.error(), "statfs");
  fuse_reply_statfs(req, &*r);
}

// --- writes: each a call into the fs layer, which refuses them on a read-only view ------

void reply_entry(fuse_req_t req, const Result<fs::EntryOut>& r, std::string_view op) {
  if (!r) return reply_error(req, r.error(), op);
  auto e = entry_of(*r, *ctx(req).opts);
  fuse_reply_entry(req, &e);
}

void reply_status(fuse_req_t req, const Status& st, std::string_view op) {
  if (!st) return reply_error(req, st.error(), op);
  fuse_reply_err(req, 0);
}

void op_mknod(fuse_req_t req, fuse_ino_t p, const char* name, mode_t mode, dev_t) {
  reply_entry(req, ctx(req).fs->mknod(p, name, mode, caller_of(req)), "mknod");
}
void op_mkdir(fuse_req_t req, fuse_ino_t p, const char* name, mode_t mode) {
  reply_entry(req, ctx(req).fs->mkdir(p, name, mode, caller_of(req)), "mkdir");
}
void op_symlink(fuse_req_t req, const char* target, fuse_ino_t p, const char* name) {
  reply_entry(req, ctx(req).fs->symlink(target, p, name, caller_of(req)), "symlink");
}
void op_link(fuse_req_t req, fuse_ino_t ino, fuse_ino_t p, const char* name) {
  reply_entry(req, ctx(req).fs->link(ino, p, name, caller_of(req)), "link");
}
void op_unlink(fuse_req_t req, fuse_ino_t p, const char* name) {
  reply_status(req, ctx(req).fs->unlink(p, name, caller_of(req)), "unlink");
}
void op_rmdir(fuse_req_t req, fuse_ino_t p, const char* name) {
  reply_status(req, ctx(req).fs->rmdir(p, name, caller_of(req)), "rmdir");
}
void op_rename(fuse_req_t req, fuse_ino_t p, const char* name, fuse_ino_t np, const char* nname,
               unsigned flags) {
  reply_status(req, ctx(req).fs->rename(p, name, np, nname, flags, caller_of(req)), "rename");
}

void op_setattr(fuse_req_t req, fuse_ino_t ino, struct stat* attr, int to_set, fuse_file_info* fi) {
  auto& c = ctx(req);
  fs::SetAttr a;
  if (to_set & FUSE_SET_ATTR_MODE) a.mode = attr->st_mode;
  if (to_set & FUSE_SET_ATTR_UID) a.uid = attr->st_uid;
  if (to_set & FUSE_SET_ATTR_GID) a.gid = attr->st_gid;
  if (to_set & FUSE_SET_ATTR_SIZE) a.size = static_cast<uint64_t>(attr->st_size);
  if (to_set & FUSE_SET_ATTR_ATIME_NOW) {
    a.atime = timespec{0, UTIME_NOW};
  } else if (to_set & FUSE_SET_ATTR_ATIME) {
    a.atime = attr->st_atim;
  }
  if (to_set & FUSE_SET_ATTR_MTIME_NOW) {
    a.mtime = timespec{0, UTIME_NOW};
  } else if (to_set & FUSE_SET_ATTR_MTIME) {
    a.mtime = attr->st_mtim;
  }
  auto r = c.fs->setattr(ino, a, fi ? std::optional<uint64_t>(fi->fh) : std::nullopt);
  if (!r) return reply_error(req, r.error(), "setattr");
  fuse_reply_attr(req, &*r, c.opts->attr_timeout);
}

void op_create(fuse_req_t req, fuse_ino_t p, const char* name, mode_t mode, fuse_file_info* fi) {
  auto& c = ctx(req);
  auto r = c.fs->create(p, name, mode, fi->flags, caller_of(req));
  if (!r) return reply_error(req, r.error(), "create");
  const bool writes = c.prefetch && opened_for_writing(fi->flags);
  if (writes) c.prefetch->write_opened(r->entry.ino);  // a consolidated name written anew
  fi->fh = r->open.fh;
  auto e = entry_of(r->entry, *c.opts);
  int backing_id = 0;
  if (r->open.backing_fd >= 0) {  // the kernel writes the file itself (write passthrough)
    backing_id = c.backing ? c.backing->acquire(r->entry.ino, r->open.backing_fd) : 0;
    if (backing_id > 0) {
      Backing::mark_next_open(backing_id);
    } else {
      c.fs->backing_refused(r->open.fh);
    }
  }
  if (fuse_reply_create(req, &e, fi) != 0) {
    Backing::clear_mark();
    if (c.fs->release(r->open.fh) && backing_id > 0) c.backing->release(r->entry.ino);
    if (writes) c.prefetch->write_closed(r->entry.ino);
  }
}

void op_write(fuse_req_t req, fuse_ino_t, const char* buf, size_t size, off_t off,
              fuse_file_info* fi) {
  auto r = ctx(req).fs->write(fi->fh, static_cast<uint64_t>(off), std::string_view(buf, size));
  if (!r) return reply_error(req, r.error(), "write");
  fuse_reply_write(req, *r);
}

void op_flush(fuse_req_t req, fuse_ino_t, fuse_file_info* fi) {
  reply_status(req, ctx(req).fs->flush(fi->fh, requester(req)), "flush");
}
void op_fsync(fuse_req_t req, fuse_ino_t, int datasync, fuse_file_info* fi) {
  reply_status(req, ctx(req).fs->fsync(fi->fh, datasync != 0), "fsync");
}
void op_fsyncdir(fuse_req_t req, fuse_ino_t ino, int, fuse_file_info*) {
  reply_status(req, ctx(req).fs->fsyncdir(ino), "fsyncdir");
}

// Extended attributes and preallocation are not part of the view.
void op_setxattr(fuse_req_t req, fuse_ino_t, const char*, const char*, size_t, int) {
  fuse_reply_err(req, ctx(req).opts->fs.read_only ? EROFS : ENOTSUP);
}
void op_removexattr(fuse_req_t req, fuse_ino_t, const char*) {
  fuse_reply_err(req, ctx(req).opts->fs.read_only ? EROFS : ENOTSUP);
}
void op_fallocate(fuse_req_t req, fuse_ino_t, int, off_t, off_t, fuse_file_info*) {
  fuse_reply_err(req, ctx(req).opts->fs.read_only ? EROFS : EOPNOTSUPP);
}

// The callbacks libfuse calls: each runs its op_* body under guarded() (no exception crosses
// into libfuse).
fuse_lowlevel_ops make_ops() {
  fuse_lowlevel_ops ops{};
  ops.init = [](void* userdata, fuse_conn_info* conn) {
    try {
      op_init(userdata, conn);
    } catch (const std::exception& e) {  // the defaults stand
      spdlog::error("init: {}", e.what());
    }
  };
  ops.lookup = [](fuse_req_t r, fuse_ino_t p, const char* n) {
    guarded(r, "lookup", [&] { op_lookup(r, p, n); });
  };
  ops.forget = [](fuse_req_t r, fuse_ino_t i, uint64_t n) {
    guarded_none(r, [&] { op_forget(r, i, n); });
  };
  ops.forget_multi = [](fuse_req_t r, size_t n, fuse_forget_data* f) {
    guarded_none(r, [&] { op_forget_multi(r, n, f); });
  };
  ops.getattr = [](fuse_req_t r, fuse_ino_t i, fuse_file_info* fi) {
    guarded(r, "getattr", [&] { op_getattr(r, i, fi); });
  };
  ops.readlink = [](fuse_req_t r, fuse_ino_t i) {
    guarded(r, "readlink", [&] { op_readlink(r, i); });
  };
  ops.opendir = [](fuse_req_t r, fuse_ino_t i, fuse_file_info* fi) {
    guarded(r, "opendir", [&] { op_opendir(r, i, fi); });
  };
  ops.readdir = [](fuse_req_t r, fuse_ino_t i, size_t n, off_t o, fuse_file_info* fi) {
    guarded(r, "readdir", [&] { op_readdir(r, i, n, o, fi); });
  };
  ops.releasedir = [](fuse_req_t r, fuse_ino_t i, fuse_file_info* fi) {
    guarded(r, "releasedir", [&] { op_releasedir(r, i, fi); });
  };
  ops.open = [](fuse_req_t r, fuse_ino_t i, fuse_file_info* fi) {
    guarded(r, "open", [&] { op_open(r, i, fi); });
  };
  ops.read = [](fuse_req_t r, fuse_ino_t i, size_t n, off_t o, fuse_file_info* fi) {
    guarded(r, "read", [&] { op_read(r, i, n, o, fi); });
  };
  ops.release = [](fuse_req_t r, fuse_ino_t i, fuse_file_info* fi) {
    guarded(r, "release", [&] { op_release(r, i, fi); });
  };
  ops.statfs = [](fuse_req_t r, fuse_ino_t i) { guarded(r, "statfs", [&] { op_statfs(r, i); }); };
  ops.mknod = [](fuse_req_t r, fuse_ino_t p, const char* n, mode_t m, dev_t d) {
    guarded(r, "mknod", [&] { op_mknod(r, p, n, m, d); });
  };
  ops.mkdir = [](fuse_req_t r, fuse_ino_t p, const char* n, mode_t m) {
    guarded(r, "mkdir", [&] { op_mkdir(r, p, n, m); });
  };
  ops.unlink = [](fuse_req_t r, fuse_ino_t p, const char* n) {
    guarded(r, "unlink", [&] { op_unlink(r, p, n); });
  };
  ops.rmdir = [](fuse_req_t r, fuse_ino_t p, const char* n) {
    guarded(r, "rmdir", [&] { op_rmdir(r, p, n); });
  };
  ops.symlink = [](fuse_req_t r, const char* t, fuse_ino_t p, const char* n) {
    guarded(r, "symlink", [&] { op_symlink(r, t, p, n); });
  };
  ops.rename = [](fuse_req_t r, fuse_ino_t p, const char* n, fuse_ino_t np, const char* nn,
                  unsigned f) { guarded(r, "rename", [&] { op_rename(r, p, n, np, nn, f); }); };
  ops.link = [](fuse_req_t r, fuse_ino_t i, fuse_ino_t p, const char* n) {
    guarded(r, "link", [&] { op_link(r, i, p, n); });
  };
  ops.setattr = [](fuse_req_t r, fuse_ino_t i, struct stat* a, int set, fuse_file_info* fi) {
    guarded(r, "setattr", [&] { op_setattr(r, i, a, set, fi); });
  };
  ops.create = [](fuse_req_t r, fuse_ino_t p, const char* n, mode_t m, fuse_file_info* fi) {
    guarded(r, "create", [&] { op_create(r, p, n, m, fi); });
  };
  ops.write = [](fuse_req_t r, fuse_ino_t i, const char* b, size_t n, off_t o, fuse_file_info* fi) {
    guarded(r, "write", [&] { op_write(r, i, b, n, o, fi); });
  };
  ops.setxattr = [](fuse_req_t r, fuse_ino_t i, const char* n, const char* v, size_t s, int f) {
    guarded(r, "setxattr", [&] { op_setxattr(r, i, n, v, s, f); });
  };
  ops.removexattr = [](fuse_req_t r, fuse_ino_t i, const char* n) {
    guarded(r, "removexattr", [&] { op_removexattr(r, i, n); });
  };
  ops.fallocate = [](fuse_req_t r, fuse_ino_t i, int m, off_t o, off_t l, fuse_file_info* fi) {
    guarded(r, "fallocate", [&] { op_fallocate(r, i, m, o, l, fi); });
  };
  ops.flush = [](fuse_req_t r, fuse_ino_t i, fuse_file_info* fi) {
    guarded(r, "flush", [&] { op_flush(r, i, fi); });
  };
  ops.fsync = [](fuse_req_t r, fuse_ino_t i, int d, fuse_file_info* fi) {
    guarded(r, "fsync", [&] { op_fsync(r, i, d, fi); });
  };
  ops.fsyncdir = [](fuse_req_t r, fuse_ino_t i, int d, fuse_file_info* fi) {
    guarded(r, "fsyncdir", [&] { op_fsyncdir(r, i, d, fi); });
  };
  return ops;
}

// --- session lifecycle ------------------------------------------------------------------

}  // namespace

int run_mount(const MountOptions& given) {
  const Decided decided = decide(given);
  MountOptions o = decided.opts;
  auto fsr = fs::Filesystem::create(o.source, o.fs);
  if (!fsr) {
    fmt::print(stderr, "ckptfs mount: {}\n", fsr.error().message);
    return 1;
  }
  auto& fsys = **fsr;

  std::vector<std::string> argv_s{"ckptfs"};
  // default_permissions: the kernel checks the modes shown (a synthesized file's are derived
  // from its shards'); nodev, nosuid: device nodes and set-id bits in SRC mean nothing here.
  std::string opts =
      "default_permissions,nodev,nosuid,fsname=ckptfs:" + o.source + ",subtype=ckptfs";
  if (o.auto_unmount) opts += ",auto_unmount";
  for (const auto& x : o.fuse_opts) opts += "," + x;
  argv_s.push_back("-o");
  argv_s.push_back(opts);
  std::vector<char*> argv;
  for (auto& s : argv_s) argv.push_back(s.data());
  fuse_args args = FUSE_ARGS_INIT(static_cast<int>(argv.size()), argv.data());
  // libfuse may allocate a new argument vector while parsing; freed after the session.
  struct ArgsGuard {
    fuse_args* a;
    ~ArgsGuard() { fuse_opt_free_args(a); }
  } args_guard{&args};

  Context c;
  c.fs = &fsys;
  c.opts = &o;
  auto ops = make_ops();
  Session se;
  if (!se.create(&args, ops, &c)) {
    fmt::print(stderr, "ckptfs mount: cannot create the FUSE session (bad -o option?)\n");
    return 1;
  }
  c.se = se.get();
  if (!se.signals()) {
    fmt::print(stderr, "ckptfs mount: cannot install signal handlers\n");
    return 1;
  }
  if (!se.mount(o.mountpoint)) {
    fmt::print(stderr, "ckptfs mount: cannot mount {} (see the message above)\n", o.mountpoint);
    return 1;
  }
  c.devnum = mount_devnum(o.mountpoint);
  Backing backing;
  if (o.fs.backing || o.fs.backing_writes) {
    if (backing.install(se.get())) {
      c.backing = &backing;
    } else {
      spdlog::warn("FUSE passthrough is off: libfuse refused the session's I/O hooks");
    }
  }
  if (!o.foreground) {
    // Forks: the parent exits 0 now that the mount is ready; the child serves.
    if (fuse_daemonize(0) != 0) return 1;
    setup_background_logging(o);
  }
  spdlog::info("mounted {} at {}", o.source, o.mountpoint);
  sd_notify(fmt::format("READY=1\nSTATUS=serving {} at {}", o.source, o.mountpoint));
  log_read_path(decided, c.backing != nullptr);

  int rc;
  {
    auto notify = make_notify_queue(se.get());
    fsys.set_notifier(notify.get());
    auto pusher = make_page_pusher(se.get());
    std::unique_ptr<fs::Prefetcher> pf;
    if (o.prefetch.value_or(false)) {
      fs::PrefetchConfig pc;
      pc.threads = o.prefetch_threads.value_or(2);
      pc.per_inode = pc.threads;
      pc.lead = uint64_t{std::max(o.read_ahead_kb, 128u)} << 10;
      pf = std::make_unique<fs::Prefetcher>(*pusher, pc);
    }
    c.prefetch = pf.get();
    if (pf) fsys.set_status_extra([p = pf.get()] { return p->figures(); });
    fuse_loop_config* cfg = fuse_loop_cfg_create();
    fuse_loop_cfg_set_clone_fd(cfg, 1);
    fuse_loop_cfg_set_max_threads(cfg, o.threads.value_or(8));
    // Idle workers stay: libfuse destroys a worker that finds more than `idle` others idle,
    // and re-creates one for the next burst of read-ahead requests.
    fuse_loop_cfg_set_idle_threads(cfg, o.threads.value_or(8));
    rc = fuse_session_loop_mt(se.get(), cfg);
    fuse_loop_cfg_destroy(cfg);
    fsys.stop_builds();  // no builder answers a request once the session stops serving
    c.prefetch = nullptr;
    fsys.set_status_extra({});
    pf.reset();
    fsys.set_notifier(nullptr);
  }
  spdlog::info("unmounting {}", o.mountpoint);
  sd_notify("STOPPING=1\nSTATUS=unmounting");
  // libfuse returns the number of the signal that ended the loop (SIGTERM, SIGINT, SIGHUP):
  // that is a clean unmount too. Only a negative value is an error.
  return rc >= 0 ? 0 : 1;
}

}  // namespace ckptfs::fuse
