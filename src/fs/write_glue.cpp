// fs/write_glue: files being written through the mount: opening them for writing, and settling
// them at close or fsync (stored as rank shards, or whole, by write/store_checks' rules).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>

#include <spdlog/spdlog.h>

#include "ckptfs/format/names.hpp"
#include "ckptfs/util/path.hpp"
#include "impl.hpp"
#include "readers.hpp"

namespace ckptfs::fs {

// `display`: the directory's path, which its messages name.
write::PlanOptions Filesystem::Impl::plan_options(int dirfd, const std::string& display) {
  write::PlanOptions p;
  p.ranks = opts.ranks ? opts.ranks : flusher->default_ranks();
  p.split = opts.split;
  if (p.split == write::PlanOptions::TpPlan) {
    if (auto text = read_small_file_beneath(dirfd, "config.json", 16u << 20); text) {
      if (auto plan = format::parse_tp_plan(*text, display + "/config.json"); plan) {
        p.tp_plan = std::move(plan).value();
      } else {
        spdlog::warn("{}; splitting on dim 0", plan.error().message);
      }
    }
  }
  return p;
}

// The state of a regular file opened for writing, shared by every handle on it.
Result<std::shared_ptr<write::WriteFile>> Filesystem::Impl::start_writing(UniqueFd fd,
                                                                          const DirRef& d,
                                                                          const std::string& name,
                                                                          bool fresh) {
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return make_error(errno, "stat failed");
  const DevIno key{static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino)};
  // The state registered under this number, unless it belongs to a file since unlinked
  // (committed, or removed while open) whose number this one reuses.
  if (auto wf = writes.find(key.first, key.second); wf && wf->linked()) return wf;
  CKPTFS_TRY(auto wf,
             write::WriteFile::open(std::move(fd), d.fd.get(), source_path(d.node.rel), fresh,
                                    *flusher, plan_options(d.fd.get(), source_path(d.node.rel)),
                                    source_path(join_rel(d.node.rel, name)), budget.get()));
  // The state another opener registered meanwhile, if any.
  return writes.add(key, std::move(wf), DevIno{d.dev, d.ino}, format::looks_like_shard_name(name));
}

Result<OpenOut> Filesystem::Impl::open_for_write(const Node& n, int flags) {
  std::string dir_rel, name;
  UniqueFd fd;
  bool fresh = (flags & O_TRUNC) != 0;
  if (n.kind == Kind::File) {
    dir_rel = parent_of(n.rel);
    name = last_of(n.rel);
  } else if (n.kind == Kind::Output && !n.view->ckpt->outputs[n.output].folder.empty()) {
    return make_error(EPERM, "{}: a LoRA adapter's file is made of the rank files; not written",
                      source_path(join_rel(n.rel, n.key.name)));
  } else if (n.kind == Kind::Output && (flags & O_TRUNC)) {
    // Replacing a consolidated file: a new file under its name, committed at close.
    dir_rel = n.rel;
    name = n.key.name;
  } else if (n.kind == Kind::Dir || n.kind == Kind::ShardsDir || n.kind == Kind::StatusDir ||
             n.kind == Kind::AdapterDir) {
    return make_error(EISDIR, "is a directory");
  } else if (n.kind == Kind::Pending || n.kind == Kind::StatusFile) {
    return make_error(EACCES, "{}: written by ckptfs only", n.key.name);
  } else if (n.kind == Kind::Output || n.kind == Kind::Index) {
    return make_error(EPERM,
                      "{}: a consolidated file is not changed in place; write it anew (O_TRUNC) "
                      "or write a new file and rename it over",
                      source_path(join_rel(n.rel, n.key.name)));
  } else {
    return make_error(EACCES, "special files cannot be opened through the view");
  }
  DirRef d;
  d.impl = this;
  CKPTFS_TRY(d.fd, open_beneath(root.get(), dir_rel, O_RDONLY | O_DIRECTORY));
  if (::fstat(d.fd.get(), &d.st) != 0) return make_error(errno, "stat failed");
  d.dev = static_cast<uint64_t>(d.st.st_dev);
  d.ino = static_cast<uint64_t>(d.st.st_ino);
  d.node.rel = dir_rel;
  const int oflags = O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC;
  if (n.kind == Kind::File) {
    int raw = ::openat(d.fd.get(), name.c_str(), oflags);
    if (raw < 0) return make_error(errno, "{}: {}", source_path(n.rel), std::strerror(errno));
    struct stat st {};
    CKPTFS_TRY(fd, require_regular(UniqueFd(raw), source_path(n.rel), &st));
    if (!(real_key(st) == n.key)) return make_error(ESTALE, "{}: replaced", n.rel);
    fresh = fresh || st.st_size == 0;
  } else {
    int raw = ::openat(d.fd.get(), name.c_str(), oflags | O_CREAT | O_TRUNC, 0600);
    if (raw < 0) return make_error(errno, "{}: {}", source_path(n.rel), std::strerror(errno));
    fd.reset(raw);
    // The new version keeps the owner and mode of the one it replaces (its shards'), which
    // its own shards then take at commit.
    if (!n.view->inputs.empty()) {
      const Perm& p = n.view->inputs.front();
      if ((::geteuid() == 0 && ::fchown(raw, p.uid, p.gid) != 0) ||
          ::fchmod(raw, p.mode & 07777) != 0) {
        return make_error(errno, "{}: cannot keep the owner and mode: {}", source_path(n.rel),
                          std::strerror(errno));
      }
    }
    fresh = true;
  }
  CKPTFS_TRY(auto wf, start_writing(std::move(fd), d, name, fresh));
  if (flags & O_TRUNC) CKPTFS_CHECK(wf->truncate(0));
  writes.touched(d.dev, d.ino);
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

// Runs `fn` (finalize or fsync) on the file of handle `h` where it is now, under its
// directory's lock (the view never lists a commit half done), and makes the view show the
// result at once.
Status Filesystem::Impl::settle_file(FileHandle& h, const SettleFn& fn) {
  auto n = nodes.get(h.ino);
  if (!n) return make_error(ESTALE, "unknown inode {}", h.ino);
  const bool real = n->kind == Kind::File;
  const std::string dir_rel = real ? parent_of(n->rel) : n->rel;
  const std::string name = real ? last_of(n->rel) : n->key.name;
  if (!h.wf->linked() && h.wf->state() != write::WriteFile::State::Committed) {
    // An orphan: its last name was unlinked or renamed over while it was open. As in a plain
    // directory, its close succeeds and its bytes go with it; what its old name holds now
    // (another file, another file's shards) is no business of it.
    return fn(*h.wf, write::Place{-1, "", source_path(dir_rel)});
  }
  auto dfd = open_beneath(root.get(), dir_rel, O_RDONLY | O_DIRECTORY);
  struct stat dst {};
  if (!dfd || ::fstat(dfd->get(), &dst) != 0) {
    // The directory is gone from where the file was: keep the bytes in the file itself.
    return fn(*h.wf, write::Place{-1, "", source_path(dir_rel)});
  }
  auto st = nodes.dir_state(static_cast<uint64_t>(dst.st_dev), static_cast<uint64_t>(dst.st_ino));
  Status result;
  {
    std::unique_lock lock(st->mu);
    st->built.wait(lock, [&] { return !st->building; });
    result = fn(*h.wf, write::Place{dfd->get(), name, source_path(dir_rel)});
    st->next_check = clock->now();
    if (result.ok()) {
      auto names = h.wf->stored_names();
      if (names.empty() && format::looks_like_shard_name(name)) names.push_back(name);
      writes.produced(dfd->get(), names);
    }
  }
  writes.touched(static_cast<uint64_t>(dst.st_dev), static_cast<uint64_t>(dst.st_ino));
  if (h.wf->state() == write::WriteFile::State::Committed) nodes.retire(n->ino);
  if (notifier &&
      (h.wf->state() == write::WriteFile::State::Committed || format::parse_model_name(name))) {
    // The name now shows the consolidated file (committed, or still the older one when this
    // one was cut short and stays hidden behind it): the kernel's entry still holds the file
    // as it was being written.
    for (const auto& [parent, link] : n->links) notifier->inval_entry(parent, link);
    // Before close() returns: an open of the name right after it must not find the entry
    // of the file as it was being written (its placeholder is gone: ENOENT).
    notifier->sync(std::chrono::seconds(2));
  }
  return result;
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
  return settle_file(*h, [this](write::WriteFile& wf, const write::Place& p) -> Status {
    CKPTFS_CHECK(wf.finalize(
        p, p.dirfd < 0 ? write::StoreRules{} : checks.rules(p.dirfd, p.dir_display, p.name)));
    if (p.dirfd < 0) return {};
    auto why = wf.stored_whole();
    if (!why) return {};
    return checks.place_whole(p.dirfd, p.dir_display, p.name, *why);
  });
}

Status Filesystem::Impl::fsync(uint64_t fh, bool datasync) {
  CKPTFS_TRY(FileHandle * h, handles.file(fh));
  if (!h->wf) return {};
  return settle_file(*h, [datasync](write::WriteFile& wf, const write::Place& p) {
    return wf.fsync(p, datasync);
  });
}

}  // namespace ckptfs::fs
