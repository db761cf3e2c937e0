// fs/write_glue: files being written through the mount: opening them for writing, settling them
// at close or fsync (stored as rank shards, or whole), and the rules for storing a model name.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>

#include <spdlog/spdlog.h>

#include "ckptfs/format/names.hpp"
#include "ckptfs/format/record.hpp"
#include "ckptfs/layout/checkpoint.hpp"
#include "ckptfs/source/distcp.hpp"
#include "ckptfs/source/verl.hpp"
#include "ckptfs/util/path.hpp"
#include "ckptfs/write/sniff.hpp"
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

// --- a model name holds a consolidated file or nothing ------------------------------------
//
// In a checkpoint directory the view shows, under a model name, the consolidated file its
// shards make: a real file of that name is hidden. So a file that ends up whole under such a
// name (not a consolidated safetensors file, cut short, too large a header to split, no
// memory or staging for it) must not be reported stored when nobody could read it back.

auto Filesystem::Impl::name_state(int dirfd, const std::vector<source::DirEntry>& entries,
                                  std::string_view name) -> NameState {
  NameState ns;
  const auto mn = format::parse_model_name(name);
  if (!mn) return ns;
  ns.native = native_format(dirfd);
  if (!ns.native.empty()) {
    ns.others = true;
    return ns;
  }
  bool mine_recorded = false, other_same_km = false;
  for (const auto& [rel, st] : source::record_files(dirfd, entries)) {
    const std::string_view file = format::parse_record_name(rel).value_or("");
    if (file == name) {
      mine_recorded = true;
      continue;
    }
    ns.others = true;
    if (auto om = format::parse_model_name(file); om && om->k == mn->k && om->m == mn->m) {
      other_same_km = true;
    }
  }
  // Shards of (k, m) are this name's when its record names them, or when the name is the
  // one the view synthesizes for them and no record gives them another name.
  const bool km_mine = mine_recorded || (!mn->single && !other_same_km);
  for (const auto& e : entries) {
    auto p = format::parse_shard_name(e.name);
    if (!p) continue;
    if (p->k == mn->k && p->m == mn->m && km_mine) {
      ns.stored = true;
    } else {
      ns.others = true;
    }
  }
  ns.stored = ns.stored || mine_recorded;
  return ns;
}

std::string Filesystem::Impl::native_format(int dirfd) {
  auto entries = source::list_checkpoint_dir(dirfd);
  if (!entries) return {};
  if (source::is_distcp_dir(*entries)) return "torch DCP";
  if (source::is_accelerate_dir(*entries)) return "accelerate FSDP (torch DCP)";
  if (source::is_verl_dir(*entries)) return "verl FSDP";
  return {};
}

// After a close left file `name` of directory `dirfd` whole for reason `why`: the name keeps
// its stored consolidated file if it has one (a writer killed mid-save must not cost the
// version it was replacing), and a directory of rank shards would hide it; either way close()
// fails with `why`. Otherwise it is a plain file of a plain directory, shown as written.
Status Filesystem::Impl::place_whole(int dirfd, const std::string& display, const std::string& name,
                                     const Error& why) {
  if (why.code == EIO) {
    // Cut short: kept as the bytes received (a consolidated file that ends early must never
    // read as complete), which is not what the writer made; close() says so.
    return Error{EIO, why.message + "; kept as the bytes received"};
  }
  auto entries = source::list_dir(dirfd);
  if (!entries) return std::move(entries).error().context(display);
  const NameState ns = name_state(dirfd, *entries, name);
  if (!ns.stored && !ns.others) return {};
  const std::string msg = fmt::format(
      "{}; not stored: {}", why.message,
      !ns.native.empty()
          ? fmt::format("in a {} checkpoint directory every model name shows the consolidated "
                        "view of its native files, and this one would be hidden (write it in "
                        "another directory, or under another name)",
                        ns.native)
      : ns.stored ? "the name keeps the consolidated file stored under it (write a complete "
                    "consolidated safetensors file, or rename a file over it)"
                  : "in a directory of rank shards a model name shows a consolidated file, and "
                    "this one would be hidden");
  spdlog::warn("{}", msg);
  return Error{why.code ? why.code : EINVAL, msg};
}

// Whether storing file `name` of directory `dirfd` as rank shards would hide plain files: the
// directory is no checkpoint yet, and regular files under other model names (not being
// written through the mount) are shown there now. Such a file is stored whole instead.
bool Filesystem::Impl::split_hides_plain(int dirfd, std::string_view name) {
  auto entries = source::list_dir(dirfd);
  if (!entries || source::is_checkpoint_dir(dirfd, *entries)) return false;
  for (const auto& e : *entries) {
    if (!S_ISREG(e.st.st_mode) || e.name == name || !format::parse_model_name(e.name)) continue;
    auto w = writes.find(static_cast<uint64_t>(e.st.st_dev), static_cast<uint64_t>(e.st.st_ino));
    if (!w || w->writers.load() == 0) return true;
  }
  return false;
}

// Whether the directory's checkpoint stays valid with file `name` stored as the rank shards of
// `p`, in place of what the name (its file number) stores now: the same builder the view
// uses, on the directory's other shards and records plus these. EINVAL names the first
// problem (another file count, a tensor already in another file, no tensor at all, ...).
Status Filesystem::Impl::validate_store(int dirfd, const std::string& display,
                                        std::string_view name, const write::Prospect& p) {
  const auto mn = format::parse_model_name(name);
  if (!mn) return make_error(EINVAL, "{}: not a model name", name);
  CKPTFS_TRY(auto entries, source::list_dir(dirfd));
  std::erase_if(entries, [&](const source::DirEntry& e) {
    auto sh = format::parse_shard_name(e.name);
    return sh && sh->k == mn->k && sh->m == mn->m;  // what the commit replaces
  });
  auto in = source::read_input(dirfd, entries, display, headers, opts.build);
  // ...and what the records of that file number name (node-local shards are no entries).
  std::erase_if(in.shards, [&](const layout::ShardInput& si) {
    auto sh = format::parse_shard_name(si.name);
    return sh && sh->k == mn->k && sh->m == mn->m;
  });
  std::erase_if(in.overrides, [&](const layout::OutputOverride& o) {
    auto om = format::parse_model_name(o.name);
    return om && om->k == mn->k && om->m == mn->m;
  });
  const auto unsized = [](std::string_view bytes, const std::string& what) {
    return write::parse_header_unsized(bytes.substr(format::kHeaderLenBytes), what);
  };
  for (uint32_t r = 0; r < p.shard_headers.size(); ++r) {
    layout::ShardInput si;
    si.name = format::shard_file_name(r + 1, mn->k, mn->m);
    CKPTFS_TRY(auto h, unsized(p.shard_headers[r], si.name));
    si.header = std::make_shared<const format::Header>(std::move(h));
    in.shards.push_back(std::move(si));
  }
  layout::OutputOverride o;
  o.k = mn->k;
  o.name = std::string(name);
  o.header = std::string(p.header);
  CKPTFS_TRY(auto h, unsized(p.header, o.name));
  o.parsed = std::make_shared<const format::Header>(std::move(h));
  o.record = o.name;
  in.overrides.push_back(std::move(o));
  auto ck = layout::build_checkpoint(std::move(in), opts.build);
  if (!ck->valid()) {
    return make_error(EINVAL, "{}/{}: the directory's checkpoint would be invalid with it: {}",
                      display, name, ck->problems.front().to_string());
  }
  if (ck->find_output(name) == nullptr) {  // a file of no tensors has no shard to show it
    return make_error(EINVAL, "{}/{}: it holds no tensor, so no rank shard would show it", display,
                      name);
  }
  return {};
}

// The rules for storing file `name` of directory `dirfd` (write::StoreRules).
write::StoreRules Filesystem::Impl::store_rules(int dirfd, const std::string& display,
                                                std::string_view name) {
  write::StoreRules r;
  if (!format::parse_model_name(name)) return r;
  if (auto native = native_format(dirfd); !native.empty()) {
    // Never split into rank shards beside native files (the directory would change format):
    // kept whole, and close() reports it hidden (place_whole).
    r.whole = Error{EINVAL, fmt::format("{}/{}", display, name)};
    return r;
  }
  if (split_hides_plain(dirfd, name)) {
    r.whole = Error{0, ""};
    return r;
  }
  r.validate = [this, dirfd, display](std::string_view n, const write::Prospect& p) {
    return validate_store(dirfd, display, n, p);
  };
  return r;
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
        p, p.dirfd < 0 ? write::StoreRules{} : store_rules(p.dirfd, p.dir_display, p.name)));
    if (p.dirfd < 0) return {};
    auto why = wf.stored_whole();
    if (!why) return {};
    return place_whole(p.dirfd, p.dir_display, p.name, *why);
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
