// fs/mutate: changes to SRC through the mount (create, mkdir, mknod, symlink, link, unlink, rmdir,
// setattr, fsyncdir), with the kernel's checks made for what the kernel cannot see.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstring>

#include <spdlog/spdlog.h>

#include "ckptfs/format/names.hpp"
#include "ckptfs/format/record.hpp"
#include "ckptfs/source/scanner.hpp"
#include "ckptfs/util/path.hpp"
#include "impl.hpp"
#include "names.hpp"

namespace ckptfs::fs {

using format::is_model_output_name;

// --- a directory being changed ------------------------------------------------------------------

// The directory `parent`, about to get or lose `name`. The write path's own name is refused
// (`reserved`: EPERM to make it, ENOENT to use it), as is the mount point itself.
auto Filesystem::Impl::dir_for_change(Ino parent, std::string_view name, int reserved)
    -> Result<DirRef> {
  if (name.size() > NAME_MAX) {
    return make_error(ENAMETOOLONG, "a name of {} bytes", name.size());
  }
  if (!is_valid_component(name)) return make_error(EINVAL, "invalid name");
  auto n = nodes.get(parent);
  if (!n) return make_error(ESTALE, "unknown inode {}", parent);
  if (n->kind != Kind::Dir) {
    return make_error(
        n->kind == Kind::ShardsDir || n->kind == Kind::StatusDir || n->kind == Kind::AdapterDir
            ? EPERM
            : ENOTDIR,
        "not a writable directory");
  }
  if (names::is_state(name)) {
    return make_error(reserved, "{}: the name {} is reserved for ckptfs", source_path(n->rel),
                      format::kStateDirName);
  }
  if (name == hidden_child(n->rel)) return make_error(EPERM, "the mount point itself");
  DirRef d;
  d.impl = this;
  d.node = std::move(*n);
  CKPTFS_TRY(d.fd, open_beneath(root.get(), d.node.rel, O_RDONLY | O_DIRECTORY));
  if (::fstat(d.fd.get(), &d.st) != 0) {
    return make_error(errno, "{}: stat failed: {}", source_path(d.node.rel), std::strerror(errno));
  }
  d.dev = static_cast<uint64_t>(d.st.st_dev);
  d.ino = static_cast<uint64_t>(d.st.st_ino);
  return d;
}

// May `who` remove entry `name` of directory `d` as it is in SRC (ENOENT: nothing to check).
Status Filesystem::Impl::may_delete_entry(const DirRef& d, const std::string& name,
                                          const Caller& who) {
  if (who.root()) return {};
  return may_delete_at(d.fd.get(), Perm::of(d.st), name, who,
                       source_path(join_rel(d.node.rel, name)));
}

namespace {

// The rank shards of written output `out` (every one, those its bytes are not read from
// included: a rank given no tensor holds a header only), as its commit record names them now: a
// split after close may have committed since the view was built. A record is read only where the
// views read it (source::trusted_state: .ckptfs and the record the daemon's); otherwise the
// view's shards. `state`: .ckptfs, or -1 where there is none. EPERM for node-local shards.
Result<std::vector<std::string>> written_shards(const layout::Checkpoint& ck,
                                                const layout::OutputFile& out, int state,
                                                const std::string& rec, const std::string& where) {
  std::vector<std::string> names;
  bool remote = false;
  struct stat sst {
  }, rst{};
  if (state >= 0 && ::fstat(state, &sst) == 0 && source::trusted_state(sst) &&
      ::fstatat(state, rec.c_str(), &rst, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(rst.st_mode) &&
      source::trusted_state(rst)) {
    if (auto text = read_small_file_beneath(state, rec, format::kMaxSideFileSize)) {
      if (auto r = format::parse_record(*text, where); r && r->name == out.name) {
        remote = r->remote();
        for (const auto& sh : r->shards) names.push_back(sh.name);
      }
    }
  }
  if (names.empty()) {  // no record to go by: the view's
    const auto mn = format::parse_model_name(out.name);
    for (uint32_t s = 0; s < ck.shards.size(); ++s) {
      auto sn = format::parse_shard_name(ck.shards[s].name);
      if (std::binary_search(out.shards.begin(), out.shards.end(), s) ||
          (mn && sn && sn->k == mn->k && sn->m == mn->m)) {
        names.push_back(ck.shards[s].name);
        remote = remote || ck.shards[s].remote();
      }
    }
  }
  if (remote) {
    return make_error(EPERM,
                      "{}: its shards are on node-local targets; its attributes are its "
                      "commit record's",
                      where);
  }
  return names;
}

}  // namespace

// chmod, chown and utimens of a consolidated file written through the mount (it has a commit
// record): they are its shards' (every one of them, alike), as written_attr shows them. The
// shards change, so the view is a new version. Node-local shards live elsewhere: EPERM.
Result<struct stat> Filesystem::Impl::set_written_attr(const Node& n, const SetAttr& a,
                                                       const struct timespec times[2]) {
  const auto& ck = *n.view->ckpt;
  const auto& out = ck.outputs[n.output];
  const std::string where = source_path(join_rel(n.rel, n.key.name));
  CKPTFS_TRY(UniqueFd dir, open_beneath(root.get(), n.rel, O_RDONLY | O_DIRECTORY));
  struct stat dst {};
  if (::fstat(dir.get(), &dst) != 0) return errno_error(source_path(n.rel));
  const std::string rec = format::record_file_name(n.key.name);
  std::vector<std::string> shards;
  {
    // Under the directory's lock, as a split after close commits (WritePath::run_resplit): a
    // split after this sees its one shard changed and leaves it one shard.
    auto st = nodes.dir_state(static_cast<uint64_t>(dst.st_dev), static_cast<uint64_t>(dst.st_ino));
    std::unique_lock lock(st->mu);
    st->built.wait(lock, [&] { return !st->building; });
    // .ckptfs opened without following a link (as the views read records), then its record.
    auto state =
        open_at(dir.get(), std::string(format::kStateDirName), O_RDONLY | O_DIRECTORY | O_NOFOLLOW);
    if (!state && state.error().code != ENOENT) return std::move(state).error();
    CKPTFS_TRY(shards, written_shards(ck, out, state ? state->get() : -1, rec, where));
    for (const auto& sh : shards) {
      const char* name = sh.c_str();
      struct stat before {};
      const bool known = ::fstatat(dir.get(), name, &before, AT_SYMLINK_NOFOLLOW) == 0;
      if ((a.mode && ::fchmodat(dir.get(), name, *a.mode & 07777, 0) != 0) ||
          ((a.uid || a.gid) &&
           ::fchownat(dir.get(), name, a.uid ? *a.uid : static_cast<uid_t>(-1),
                      a.gid ? *a.gid : static_cast<gid_t>(-1), AT_SYMLINK_NOFOLLOW) != 0) ||
          ((a.atime || a.mtime) && ::utimensat(dir.get(), name, times, AT_SYMLINK_NOFOLLOW) != 0)) {
        return errno_error(fmt::format("{}: {}", where, sh));
      }
      // A split after close still pending for this shard (the file's one shard) expects it as
      // it is now: an attribute change is no change of its bytes. (A write through a descriptor
      // kept from before the close, landing between the two stats, would be taken along; the
      // kernel gives no way to tell it apart.)
      struct stat after {};
      if (known && ::fstatat(dir.get(), name, &after, AT_SYMLINK_NOFOLLOW) == 0 &&
          after.st_ino == before.st_ino && after.st_size == before.st_size) {
        writing.attr_changed(before, after);
      }
    }
    // Its commit record carries the file's times as its shards do (flush/local.cpp): the
    // directory's shown mtime is its newest input's.
    if ((a.atime || a.mtime) && state &&
        ::utimensat(state->get(), rec.c_str(), times, AT_SYMLINK_NOFOLLOW) != 0 &&
        errno != ENOENT) {
      return errno_error(fmt::format("{}: {}/{}", where, format::kStateDirName, rec));
    }
  }
  views.force_revalidate(*n.view);
  // What the next version shows, from the shards as they are now (another change made since
  // the view was built, a chmod before this utimens, is theirs too).
  struct stat st = virtual_attr(n);
  int64_t mtime = INT64_MIN, atime = INT64_MIN, ctime = INT64_MIN;
  for (const auto& name : shards) {
    struct stat sh {};
    if (::fstatat(dir.get(), name.c_str(), &sh, AT_SYMLINK_NOFOLLOW) != 0) {
      return errno_error(fmt::format("{}: {}", where, name));
    }
    st.st_mode = S_IFREG | (sh.st_mode & 07777);
    st.st_uid = sh.st_uid;
    st.st_gid = sh.st_gid;
    mtime = std::max(mtime, mtime_ns(sh));
    ctime = std::max(ctime, ctime_ns(sh));
    atime =
        std::max(atime, static_cast<int64_t>(sh.st_atim.tv_sec) * kNsPerSec + sh.st_atim.tv_nsec);
  }
  st.st_mtim = to_timespec(mtime);
  st.st_atim = to_timespec(atime);
  st.st_ctim = to_timespec(ctime);
  return st;
}

// Owner and mode of every shard output `o` of view `v` is made of.
std::vector<Perm> Filesystem::Impl::output_perms(const View& v, const layout::OutputFile& o) {
  std::vector<Perm> out;
  for (uint32_t s : o.shards) {
    const auto& a = v.ckpt->shards[s].access;
    out.push_back(Perm{a.uid, a.gid, static_cast<mode_t>(S_IFREG | (a.mode & 07777))});
  }
  return out;
}

auto Filesystem::Impl::shown_output(const DirRef& d, std::string_view name) -> Shown {
  if (!is_model_output_name(name)) return {};
  auto v = views.view_of(d.node.rel, d.st, d.node.ino, Need::Current);
  if (!v || !v->complete) return {};
  if (const auto* o = v->ckpt->find_output(name)) return {v, o};
  if (name == format::kIndexFileName && !v->ckpt->written && !v->ckpt->index_json.empty()) {
    return {v, nullptr};
  }
  return {};
}

// A new entry made for a caller other than root belongs to the caller (the daemon makes it
// as root); its group is the directory's when that has the set-group-ID bit.
void Filesystem::Impl::give_to(int fd, const DirRef& d, const std::string& name, const Caller& who,
                               bool by_name) {
  if (::geteuid() != 0 || who.uid == 0) return;
  const gid_t gid = (d.st.st_mode & S_ISGID) ? d.st.st_gid : who.gid;
  int rc = by_name ? ::fchownat(d.fd.get(), name.c_str(), who.uid, gid, AT_SYMLINK_NOFOLLOW)
                   : ::fchown(fd, who.uid, gid);
  if (rc != 0) {
    spdlog::warn("{}: cannot give it to uid {}: {}", source_path(join_rel(d.node.rel, name)),
                 who.uid, std::strerror(errno));
  }
}

// The same for the file `name` of directory `dirfd` as it is now, when this is its last name.
void Filesystem::Impl::retire_if_last(int dirfd, const std::string& name) {
  struct stat st {};
  if (::fstatat(dirfd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 || st.st_nlink > 1 ||
      S_ISDIR(st.st_mode)) {
    return;
  }
  nodes.retire_key(real_key(st));
}

// Whether what the view hides in directory `dir` (whose listing is empty) may go with it:
// only the remains of a broken checkpoint that has been quiet for the settle time, or the
// write path's state, never a checkpoint still settling or being written, nor the mount
// point itself.
bool Filesystem::Impl::hidden_removable(const Node& dir) {
  if (!hidden_child(dir.rel).empty()) return false;
  if (writing.open_in(DevIno{dir.dev, dir.bino})) return false;
  auto st = nodes.dir_state(dir.dev, dir.bino);
  std::lock_guard lock(st->mu);
  if (!st->view) return true;
  return st->settled && !st->building && !st->view->ckpt->valid() && !st->view_sig.files.empty();
}

// --- the operations ---------------------------------------------------------------------------

Status Filesystem::Impl::writable() const {
  if (opts.read_only) return make_error(EROFS, "read-only view");
  return {};
}

Result<CreateOut> Filesystem::Impl::create(Ino parent, std::string_view name, mode_t mode,
                                           int flags, const Caller& who) {
  CKPTFS_CHECK(writable());
  CKPTFS_TRY(auto d, dir_for_change(parent, name));
  const std::string n(name);
  const std::string where = source_path(join_rel(d.node.rel, name));
  if (auto shown = shown_output(d, name); shown.v) {
    // The name shows a consolidated file (or the index) the kernel had not looked up: it is
    // opened as open() opens that file, after the check the kernel makes on the mode shown.
    if (flags & O_EXCL) return make_error(EEXIST, "{}: exists", where);
    const bool index = shown.output == nullptr;
    const auto output =
        static_cast<uint32_t>(index ? 0 : shown.output - shown.v->ckpt->outputs.data());
    CKPTFS_TRY(EntryOut e, lookup_virtual(shown.v, d.node.rel, d.node.ino,
                                          index ? Kind::Index : Kind::Output, output, n));
    const int acc = flags & O_ACCMODE;
    const int mask =
        (acc != O_WRONLY ? R_OK : 0) | (acc != O_RDONLY || (flags & O_TRUNC) ? W_OK : 0);
    auto opened = may(Perm::of(e.attr), who, mask)
                      ? open(e.ino, flags & ~(O_CREAT | O_EXCL), who)
                      : Result<OpenOut>(make_error(EACCES, "{}: uid {} may not open it that way",
                                                   where, who.uid));
    if (!opened) {
      forget(e.ino, 1);  // the kernel never gets this entry
      return std::move(opened).error();
    }
    return CreateOut{e, *opened};
  }
  UniqueFd file;
  const int fd = ::openat(d.fd.get(), n.c_str(), O_CREAT | O_EXCL | O_RDWR | O_NOFOLLOW | O_CLOEXEC,
                          mode & 07777);
  const bool made = fd >= 0;
  if (made) {
    file.reset(fd);
    give_to(file.get(), d, n, who, false);
  } else {
    if (errno != EEXIST || (flags & O_EXCL)) return errno_error(where);
    // An entry the kernel did not see (a name the view hides, or one made meanwhile): opened as
    // the file it is, with the checks the kernel makes for an existing file. Its owner never
    // changes. A symlink answers ELOOP (none is followed), a directory EISDIR.
    const int raw =
        ::openat(d.fd.get(), n.c_str(), O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
    if (raw < 0) return errno_error(where);
    struct stat st {};
    CKPTFS_TRY(file, require_regular(UniqueFd(raw), where, &st));
    CKPTFS_CHECK(
        may_open_existing(Perm::of(d.st), Perm::of(st), flags, who, protected_regular, where));
    if (flags & O_TRUNC) {
      CKPTFS_TRY(const bool detached, writing.detach_stored(join_rel(d.node.rel, name), st));
      if (detached) {  // a new empty file under the name: this open truncates that one
        const int again = ::openat(d.fd.get(), n.c_str(),
                                   O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
        if (again < 0) return errno_error(where);
        CKPTFS_TRY(file, require_regular(UniqueFd(again), where, &st));
      }
    }
  }
  writing.touched(d.dev, d.ino);
  note_writer(d.node, who);
  CKPTFS_TRY(EntryOut e, lookup_real(join_rel(d.node.rel, name), parent, name));
  auto wf = writing.start(std::move(file), d.at(), n, made || (flags & O_TRUNC));
  if (!wf) {
    forget(e.ino, 1);
    return std::move(wf).error();
  }
  if (flags & O_TRUNC) CKPTFS_CHECK((*wf)->truncate(0));  // the inode may have been open already
  CreateOut out;
  out.entry = e;
  if (backs_writes()) {
    auto opened = backed_writer(std::move(*wf), e.ino, where);
    if (!opened) {
      forget(e.ino, 1);
      return std::move(opened).error();
    }
    out.open = *opened;
    return out;
  }
  out.open.fh = adopt_writer(std::move(*wf), e.ino);
  return out;
}

Result<EntryOut> Filesystem::Impl::mkdir(Ino parent, std::string_view name, mode_t mode,
                                         const Caller& who) {
  CKPTFS_CHECK(writable());
  CKPTFS_TRY(auto d, dir_for_change(parent, name));
  const std::string n(name);
  if (::mkdirat(d.fd.get(), n.c_str(), mode & 07777) != 0) {
    // A directory the view hides (.hf_metadata/ beside rank shards): the caller is saving
    // there again (NeMo's os.makedirs(exist_ok=True) then stats it), so it sees the directory
    // as written from now on, where that name resolves.
    if (errno == EEXIST) note_writer(d.node, who);
    return errno_error(source_path(join_rel(d.node.rel, name)));
  }
  give_to(-1, d, n, who, true);
  writing.touched(d.dev, d.ino);
  return lookup_real(join_rel(d.node.rel, name), parent, name);
}

Result<EntryOut> Filesystem::Impl::mknod(Ino parent, std::string_view name, mode_t mode,
                                         const Caller& who) {
  CKPTFS_CHECK(writable());
  if (!S_ISREG(mode) && !S_ISFIFO(mode)) {
    return make_error(EPERM, "only regular files and FIFOs can be made here");
  }
  CKPTFS_TRY(auto d, dir_for_change(parent, name));
  const std::string n(name);
  if (::mknodat(d.fd.get(), n.c_str(), mode & (S_IFMT | 07777), 0) != 0) {
    return errno_error(source_path(join_rel(d.node.rel, name)));
  }
  give_to(-1, d, n, who, true);
  writing.touched(d.dev, d.ino);
  return lookup_real(join_rel(d.node.rel, name), parent, name);
}

Result<EntryOut> Filesystem::Impl::symlink(std::string_view target, Ino parent,
                                           std::string_view name, const Caller& who) {
  CKPTFS_CHECK(writable());
  CKPTFS_TRY(auto d, dir_for_change(parent, name));
  const std::string n(name);
  if (::symlinkat(std::string(target).c_str(), d.fd.get(), n.c_str()) != 0) {
    return errno_error(source_path(join_rel(d.node.rel, name)));
  }
  give_to(-1, d, n, who, true);
  writing.touched(d.dev, d.ino);
  return lookup_real(join_rel(d.node.rel, name), parent, name);
}

Result<EntryOut> Filesystem::Impl::link(Ino ino, Ino new_parent, std::string_view new_name,
                                        const Caller& who) {
  CKPTFS_CHECK(writable());
  auto n = nodes.get(ino);
  if (!n) return make_error(ESTALE, "unknown inode {}", ino);
  if (n->kind != Kind::File || writing.find(n->dev, n->bino)) {
    return make_error(EPERM, "only plain files that are not being written can be linked");
  }
  CKPTFS_CHECK(may_reach_lifted(n->rel, who));
  CKPTFS_TRY(auto d, dir_for_change(new_parent, new_name));
  // A link never replaces anything (a hidden name exists in SRC: EEXIST from linkat), and in a
  // checkpoint directory a model name shows a consolidated file or nothing: a real file linked
  // there would be hidden, its bytes unreachable under the name just made.
  if (shown_virtual(d, new_name)) {
    return make_error(EEXIST, "{}: exists", join_rel(d.node.rel, new_name));
  }
  if (is_model_output_name(new_name) && views.view_of(d.node.rel, d.st, d.node.ino, Need::Any)) {
    return make_error(EPERM,
                      "{}: a model name in a checkpoint directory shows its consolidated "
                      "file; link under another name",
                      join_rel(d.node.rel, new_name));
  }
  CKPTFS_TRY(UniqueFd from, open_beneath(root.get(), parent_of(n->rel), O_PATH | O_DIRECTORY));
  const std::string last = last_of(n->rel);
  if (::linkat(from.get(), last.c_str(), d.fd.get(), std::string(new_name).c_str(), 0) != 0) {
    return errno_error(source_path(join_rel(d.node.rel, new_name)));
  }
  writing.touched(d.dev, d.ino);
  note_writer(d.node, who);
  return lookup_real(join_rel(d.node.rel, new_name), new_parent, new_name);
}

Status Filesystem::Impl::unlink(Ino parent, std::string_view name, const Caller& who) {
  CKPTFS_CHECK(writable());
  CKPTFS_TRY(auto d, dir_for_change(parent, name, ENOENT));
  const std::string n(name);
  if (auto out = shown_output(d, name); out.v) {
    if (!out.output) return {};  // a synthesized index: nothing is stored, it goes with them
    // The kernel checked the mode shown; what goes is every shard, each checked as the kernel
    // would check its removal (the sticky bit: shards of several owners).
    CKPTFS_CHECK(may_delete_each(Perm::of(d.st), output_perms(*out.v, *out.output), who,
                                 source_path(join_rel(d.node.rel, name))));
    auto st = d.state();
    std::unique_lock lock(st->mu);
    st->built.wait(lock, [&] { return !st->building; });
    const auto& ck = *out.v->ckpt;
    CKPTFS_CHECK(flusher->remove(d.target(source_path(d.node.rel)), out.output->k,
                                 ck.shards.empty() ? 1 : ck.shards[0].parsed.m));
    ::unlinkat(d.fd.get(), n.c_str(), 0);  // a placeholder of a newer version, if any
    st->next_check = clock->now();
    writing.touched(d.dev, d.ino);
    note_writer(d.node, who);
    return {};
  }
  CKPTFS_CHECK(may_delete_entry(d, n, who));
  retire_if_last(d.fd.get(), n);
  if (::unlinkat(d.fd.get(), n.c_str(), 0) != 0) {
    return errno_error(source_path(join_rel(d.node.rel, name)));
  }
  writing.touched(d.dev, d.ino);
  note_writer(d.node, who);
  views.recheck(d.dev, d.ino);
  return {};
}

Status Filesystem::Impl::rmdir(Ino parent, std::string_view name, const Caller& who) {
  CKPTFS_CHECK(writable());
  CKPTFS_TRY(auto d, dir_for_change(parent, name, ENOENT));
  const std::string n(name);
  const std::string rel = join_rel(d.node.rel, name);
  CKPTFS_CHECK(may_delete_entry(d, n, who));
  if (::unlinkat(d.fd.get(), n.c_str(), AT_REMOVEDIR) == 0) {
    writing.touched(d.dev, d.ino);
    return {};
  }
  if (errno != ENOTEMPTY && errno != EEXIST) return errno_error(source_path(rel));
  CKPTFS_CHECK(empty_hidden(d, parent, n, who));
  if (::unlinkat(d.fd.get(), n.c_str(), AT_REMOVEDIR) != 0) {
    return errno_error(source_path(rel));
  }
  writing.touched(d.dev, d.ino);
  return {};
}

Status Filesystem::Impl::empty_hidden(const DirRef& d, Ino parent, const std::string& n,
                                      const Caller& who) {
  // Not empty in SRC. If the view shows nothing in it, what remains is hidden (the write
  // path's state, a broken checkpoint's shards, an empty .hf_metadata): it goes too, as the
  // caller cannot see or remove it.
  const std::string rel = join_rel(d.node.rel, n);
  std::optional<Node> child = nodes.child(parent, n);
  if (!child || child->kind != Kind::Dir || child->rel != rel) {
    return make_error(ENOTEMPTY, "{}: not empty", source_path(rel));
  }
  CKPTFS_TRY(auto shown, list(*child));
  if (!shown.empty() || !hidden_removable(*child)) {
    return make_error(ENOTEMPTY, "{}: not empty", source_path(rel));
  }
  CKPTFS_TRY(UniqueFd cfd, open_at(d.fd.get(), n, O_RDONLY | O_DIRECTORY | O_NOFOLLOW));
  CKPTFS_TRY(auto left, source::list_dir(cfd.get()));
  // Only what the caller could have removed itself, were it shown (the daemon's own .ckptfs
  // counts as an entry of the directory).
  if (auto may = may_empty(cfd.get(), who, rel); !may) {
    return make_error(ENOTEMPTY, "{}: not empty ({})", source_path(rel), may.error().message);
  }
  for (const auto& e : left) flush::remove_tree(cfd.get(), e.name);
  return {};
}

Result<struct stat> Filesystem::Impl::setattr(Ino ino, const SetAttr& a,
                                              std::optional<uint64_t> fh) {
  CKPTFS_CHECK(writable());
  auto n = nodes.get(ino);
  if (!n) return make_error(ESTALE, "unknown inode {}", ino);
  struct timespec times[2] = {{0, UTIME_OMIT}, {0, UTIME_OMIT}};
  if (a.atime) times[0] = *a.atime;
  if (a.mtime) times[1] = *a.mtime;
  if (n->kind == Kind::Output && fh) {
    // A new version being written through a handle opened with O_TRUNC: its writer sizes it
    // (ftruncate before the data, as safetensors does) and may set its mode and times (cp -a
    // does, before closing it); its backing file carries them to its shards at commit.
    CKPTFS_TRY(FileHandle * h, handles.file(*fh));
    if (h->wf && h->writable) {
      if (a.size) CKPTFS_CHECK(h->wf->truncate(*a.size));
      CKPTFS_CHECK(h->wf->set_attr(a.mode, a.uid, a.gid, times));
      return getattr_handle(*fh);
    }
  }
  if (n->kind == Kind::Output && !a.size && n->view->ckpt->outputs[n->output].written) {
    return set_written_attr(*n, a, times);
  }
  if (n->kind == Kind::Output || n->kind == Kind::Index || n->kind == Kind::ShardsDir ||
      n->kind == Kind::Pending || n->kind == Kind::StatusDir || n->kind == Kind::StatusFile ||
      n->kind == Kind::AdapterDir) {
    return make_error(EPERM, "{}: a consolidated file's attributes follow its shards", n->rel);
  }
  std::shared_ptr<write::WriteFile> wf;
  if (fh) {
    CKPTFS_TRY(FileHandle * h, handles.file(*fh));
    wf = h->wf;
  }
  if (!wf && n->kind == Kind::File) wf = writing.find(n->dev, n->bino);
  const std::string where = source_path(n->rel);
  if (a.size) {
    if (n->kind == Kind::Dir) return make_error(EISDIR, "{}: is a directory", where);
    if (wf) {
      CKPTFS_CHECK(wf->truncate(*a.size));
    } else {
      CKPTFS_TRY(UniqueFd fd,
                 open_beneath(root.get(), n->rel, O_WRONLY | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY));
      CKPTFS_TRY(fd, require_regular(std::move(fd), where));
      if (::ftruncate(fd.get(), static_cast<off_t>(*a.size)) != 0) return errno_error(where);
    }
  }
  // The entry by its parent and name (the root by itself).
  const bool is_root = n->rel.empty();
  const std::string last = is_root ? std::string(".") : last_of(n->rel);
  CKPTFS_TRY(UniqueFd pfd,
             open_beneath(root.get(), is_root ? "" : parent_of(n->rel), O_PATH | O_DIRECTORY));
  if (a.mode && n->kind != Kind::Symlink) {
    if (::fchmodat(pfd.get(), last.c_str(), *a.mode & 07777, 0) != 0) return errno_error(where);
  }
  if (a.uid || a.gid) {
    if (::fchownat(pfd.get(), last.c_str(), a.uid ? *a.uid : static_cast<uid_t>(-1),
                   a.gid ? *a.gid : static_cast<gid_t>(-1), AT_SYMLINK_NOFOLLOW) != 0) {
      return errno_error(where);
    }
  }
  if (a.atime || a.mtime) {
    struct timespec ts[2] = {{0, UTIME_OMIT}, {0, UTIME_OMIT}};
    if (a.atime) ts[0] = *a.atime;
    if (a.mtime) ts[1] = *a.mtime;
    // A directory's times are set under its lock: a split after close commits there under it
    // and gives the directory back the mtime it found (WritePath::run_resplit).
    auto dir_st = n->kind == Kind::Dir ? nodes.dir_state(n->dev, n->bino) : nullptr;
    std::unique_lock<std::mutex> dir_lock;
    if (dir_st) dir_lock = std::unique_lock(dir_st->mu);
    if (::utimensat(pfd.get(), last.c_str(), ts, AT_SYMLINK_NOFOLLOW) != 0) {
      return errno_error(where);
    }
  }
  if (n->kind == Kind::Dir) {
    writing.touched(n->dev, n->bino);
    // A checkpoint directory shows its own mtime or its newest input's, taken at its last
    // check: a utimens of its own (cp -a, tar x, rsync -a end with it) is shown at once.
    views.recheck(n->dev, n->bino);
  }
  if (fh) return getattr_handle(*fh);
  return getattr(ino);
}

Status Filesystem::Impl::fsyncdir(Ino ino) {
  auto n = nodes.get(ino);
  if (!n) return make_error(ESTALE, "unknown inode {}", ino);
  if (n->kind != Kind::Dir) return {};
  CKPTFS_TRY(UniqueFd fd, open_beneath(root.get(), n->rel, O_RDONLY | O_DIRECTORY));
  if (::fsync(fd.get()) != 0) return errno_error(source_path(n->rel));
  return {};
}

}  // namespace ckptfs::fs
