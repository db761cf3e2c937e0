// fs_model/model: the reference model's rules: what each op must answer and what it leaves.
#include "model.hpp"

#include <fcntl.h>
#include <stdio.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>

#include <fmt/format.h>

#include "ckptfs/format/names.hpp"

namespace ckptfs::fsmodel {

namespace stdfs = std::filesystem;

const std::vector<std::string> kPlainNames = {"a.txt", "b.bin", "notes.json"};
const std::vector<std::string> kTempNames = {".tmp1a2b3c", ".tmpzz9"};
const std::vector<std::string> kDirNames = {"d0", "d1", "d2"};

std::vector<std::string> model_names(int family) {
  if (family == 1) return {"model.safetensors"};
  if (family == 2) return {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"};
  return {};
}

bool is_model(const std::string& name) { return format::is_model_name(name); }

std::string Op::describe() const {
  const char* noreplace = flags == RENAME_NOREPLACE ? " NOREPLACE" : "";
  switch (kind) {
    case None:
      return "(nothing)";
    case Create:
      if (bytes.empty() && pieces.empty() && name == ".ckptfs") {
        return fmt::format("create {}/.ckptfs", dir);
      }
      return fmt::format("create {}/{} {} {} #{} ({} bytes in {} pieces{})", dir, name,
                         flags & O_EXCL ? "O_EXCL" : "O_TRUNC", tensors ? "tensors" : "plain",
                         handle, bytes.size(), pieces.size(), in_order ? "" : ", out of order");
    case Write:
      return fmt::format("write #{} [{}, +{})", handle, off, len);
    case Close:
      return fmt::format("close #{} ({}{})", handle, where, incomplete ? ", incomplete" : "");
    case Flush:
      return fmt::format("flush #{} (still open)", handle);
    case Fsync:
      return fmt::format("{} #{}", flags ? "fdatasync" : "fsync", handle);
    case Rename:
      return fmt::format("rename {}/{} -> {}/{}{}", dir, name, to_dir, to_name, noreplace);
    case RenameDir:
      return fmt::format("{}rename dir {} -> {}{}",
                         leftover ? fmt::format("SRC: leftover {}/.ckptfs/staging; ", to_name) : "",
                         name, to_name, noreplace);
    case Unlink:
      return fmt::format("unlink {}/{}", dir, name);
    case Mkdir:
      return fmt::format("mkdir {}", name);
    case Rmdir:
      return fmt::format("rmdir {}", name);
    case SrcWrite:
      return fmt::format("SRC: write {}/{} ({} bytes); time passes", dir, name, bytes.size());
    case SrcDelete:
      return fmt::format("SRC: rm {}/{}; time passes", dir, name);
    case SrcLeftover:
      return fmt::format("SRC: leftover {}/.ckptfs/staging", to_name);
    case Wait:
      return "time passes (past settle and revalidate)";
  }
  return "?";
}

// --- queries ------------------------------------------------------------------------------------

std::vector<std::string> Model::dir_names() const {
  std::vector<std::string> out{""};
  for (const auto& [n, e] : root.entries) {
    if (e.kind == Entry::Directory) out.push_back(n);
  }
  return out;
}

std::string Model::name_of(const Dir* d) const {
  if (d == &root) return "";
  for (const auto& [n, e] : root.entries) {
    if (e.kind == Entry::Directory && e.dir.get() == d) return n;
  }
  return "?";
}

std::vector<std::string> Model::file_names(const Dir& d) {
  std::vector<std::string> out = kPlainNames;
  out.insert(out.end(), kTempNames.begin(), kTempNames.end());
  for (const auto& m : model_names(d.family)) out.push_back(m);
  return out;
}

void Model::add_dir(const std::string& name, int family) {
  Entry e;
  e.kind = Entry::Directory;
  e.dir = std::make_unique<Dir>();
  e.dir->family = family;
  root.entries[name] = std::move(e);
}

// --- rules --------------------------------------------------------------------------------------

bool Model::has_shards(const Dir& d) {
  return std::any_of(d.entries.begin(), d.entries.end(), [](const auto& kv) {
    return kv.second.kind == Entry::File && kv.second.stored;
  });
}

bool Model::hidden(const Dir& d, const std::string& name, const Entry& e) {
  return e.kind == Entry::Writing && is_model(name) && has_shards(d);
}

bool Model::plain_model_other(const Dir& d, const std::string& name, const std::string& except) {
  return std::any_of(d.entries.begin(), d.entries.end(), [&](const auto& kv) {
    return kv.first != name && kv.first != except && is_model(kv.first) &&
           kv.second.kind == Entry::File && !kv.second.stored;
  });
}

bool Model::orphan_over_stored(const Handle& h) {
  return h.dir == nullptr && is_model(h.last_name) && h.tensors && (!h.complete() || h.flushed);
}

void Model::orphan(Handle& h) {
  h.last_dir = h.dir;
  h.last_name = h.name;
  h.dir = nullptr;
}

// The handle's entry (Writing, or the stored file it was renamed over).
void Model::orphan_entries_of(Entry& e) {
  if (e.kind == Entry::Writing) orphan(*handles.at(e.handle));
  if (e.kind == Entry::File && e.pending >= 0) orphan(*handles.at(e.pending));
}

void Model::forget_dir(const Dir* d) {
  for (auto& [id, h] : handles) {
    if (h->dir == d) orphan(*h);
    if (h->home == d) h->home = nullptr;
    if (h->last_dir == d) h->last_dir = nullptr;
  }
}

bool Model::writer_from(const Dir* d) const {
  return std::any_of(handles.begin(), handles.end(),
                     [&](const auto& kv) { return kv.second->home == d; });
}

// --- what each op must answer -------------------------------------------------------------------

Expect Model::expect(const Op& op, bool kernel) {
  switch (op.kind) {
    case Op::Create: {
      if (op.name == ".ckptfs") {  // semantics.md: the name .ckptfs is reserved everywhere (EPERM)
        hit("create .ckptfs refused");
        // kernel: at the root the name is the status directory, which the kernel's lookup
        // finds; open(O_CREAT) of an existing directory is EISDIR from the VFS, never asked.
        if (kernel && op.dir.empty()) return {EISDIR, "create of the status directory /.ckptfs"};
        return {EPERM, "create .ckptfs"};
      }
      if ((op.flags & O_EXCL) && dir(op.dir).entries.count(op.name)) {
        hit("create EEXIST");
        return {EEXIST, "create O_EXCL of an existing name"};
      }
      return {};
    }
    case Op::Rename:
      return expect_rename(op, kernel);
    case Op::RenameDir:
      return expect_rename_dir(op);
    case Op::Unlink: {
      const Dir& d = dir(op.dir);
      auto it = d.entries.find(op.name);
      if (it == d.entries.end()) {
        hit("unlink ENOENT");
        return {ENOENT, "unlink of a missing name"};
      }
      if (it->second.kind == Entry::Directory) {
        hit("unlink of a directory EISDIR");
        return {EISDIR, "unlink of a directory"};
      }
      // kernel: unlink(2) looks the name up first, and a name the view hides is not found
      // (ENOENT, never asked); asked directly, ckptfs removes the file being written.
      if (kernel && hidden(d, op.name, it->second)) {
        hit("unlink of a hidden name ENOENT (kernel)");
        return {ENOENT, "unlink of a name the view hides"};
      }
      return {};
    }
    case Op::Mkdir:
      if (op.name == ".ckptfs") {
        // semantics.md: reserved. At the root the kernel answers EEXIST itself (its lookup finds
        // the status directory) and never asks; asked directly, the filesystem says EPERM.
        hit("mkdir .ckptfs refused");
        return kernel ? Expect{EEXIST, "mkdir .ckptfs at the root (the kernel's lookup)"}
                      : Expect{EPERM, "mkdir .ckptfs at the root"};
      }
      if (root.entries.count(op.name)) {
        hit("mkdir EEXIST");
        return {EEXIST, "mkdir of an existing name"};
      }
      return {};
    case Op::Rmdir: {
      auto it = root.entries.find(op.name);
      const std::string p = src_path(op.name);
      const bool src_empty = !stdfs::is_directory(p) || stdfs::is_empty(p);
      if (it == root.entries.end()) {
        hit("rmdir ENOENT");
        return {ENOENT, "rmdir of a missing name"};
      }
      if (it->second.kind != Entry::Directory) {
        hit("rmdir of a file ENOTDIR");
        return {ENOTDIR, "rmdir of a file"};
      }
      if (!it->second.dir->entries.empty()) {
        hit("rmdir ENOTEMPTY");
        return {ENOTEMPTY, "rmdir of a non-empty directory"};
      }
      // semantics.md: rmdir of a directory whose view is empty also removes what the view hides
      // in it (.ckptfs), but "a directory with a file being written through the mount ...
      // answers ENOTEMPTY" (one created there and still open, wherever its name went since,
      // whose write state is there: a directory empty in SRC too is simply removed).
      if (!src_empty && writer_from(it->second.dir.get())) {
        hit("rmdir of a view-empty dir with a file being written ENOTEMPTY");
        return {ENOTEMPTY, "rmdir of a directory a file is being written from"};
      }
      return {};
    }
    default:  // writes, closes, flushes, fsyncs, SRC changes and waits succeed
      return {};
  }
}

Expect Model::expect_rename(const Op& op, bool kernel) {
  const Dir& sd = dir(op.dir);
  const Dir& td = dir(op.to_dir);
  auto sit = sd.entries.find(op.name);
  auto tit = td.entries.find(op.to_name);
  const bool t_exists = tit != td.entries.end();
  if (sit == sd.entries.end() && t_exists && is_model(op.to_name)) {
    // The source is looked up first, as the kernel does: ENOENT whatever the target holds
    // (issue 21 found EEXIST and EINVAL here when the target was a checkpoint's model name;
    // fixed in issue 34).
    hit("rename of a missing name onto a checkpoint's model name ENOENT");
  }
  if (sit == sd.entries.end()) {
    hit("rename ENOENT");
    return {ENOENT, "rename of a missing name"};
  }
  // kernel: rename(2) looks the source up first; a name the view hides is not found.
  if (kernel && hidden(sd, op.name, sit->second)) {
    hit("rename of a hidden name ENOENT (kernel)");
    return {ENOENT, "rename of a name the view hides"};
  }
  const bool noreplace = op.flags == RENAME_NOREPLACE;
  const Entry& s = sit->second;
  if (s.kind == Entry::File && s.stored) {  // semantics.md: rename of a consolidated file: EXDEV
    // kernel: the VFS refuses RENAME_NOREPLACE onto a name its lookup found (EEXIST) before
    // ckptfs is asked.
    if (kernel && noreplace && t_exists && !hidden(td, op.to_name, tit->second)) {
      hit("rename NOREPLACE EEXIST");
      return {EEXIST, "rename NOREPLACE of a consolidated file over an existing name"};
    }
    hit("rename of a stored file EXDEV");
    return {EXDEV, "rename of a consolidated file"};
  }
  if (t_exists && noreplace) {
    hit("rename NOREPLACE EEXIST");
    return {EEXIST, "rename NOREPLACE over an existing name"};
  }
  return {};
}

Expect Model::expect_rename_dir(const Op& op) {
  auto ait = root.entries.find(op.name), bit = root.entries.find(op.to_name);
  if (ait == root.entries.end()) return {ENOENT, "rename of a missing directory"};
  if (bit == root.entries.end()) return {};
  if (op.flags == RENAME_NOREPLACE) return {EEXIST, "rename NOREPLACE of a directory"};
  if (bit->second.kind != Entry::Directory) {
    hit("rename dir over a file ENOTDIR");
    return {ENOTDIR, "rename of a directory over a file"};
  }
  if (!bit->second.dir->entries.empty()) {
    hit("rename dir over a non-empty dir ENOTEMPTY");
    return {ENOTEMPTY, "rename of a directory over a non-empty one"};
  }
  // A directory the view shows empty that holds the write path's hidden .ckptfs (left by a
  // file written there, even after it was removed) is replaced, as rmdir removes it (issue 21
  // found ENOTEMPTY here; fixed in issue 34). Not while a file created there is still being
  // written (its write state is there, wherever its name went since): ENOTEMPTY, as rmdir
  // answers.
  const bool b_state = stdfs::exists(src_path(op.to_name) + "/.ckptfs");
  if (b_state && writer_from(bit->second.dir.get())) {
    hit("rename dir over a view-empty dir with a file being written ENOTEMPTY");
    return {ENOTEMPTY, "rename of a directory over one with a file being written"};
  }
  if (b_state) hit("rename dir over a view-empty dir holding .ckptfs");
  return {};
}

// --- what each op leaves ------------------------------------------------------------------------

Effect Model::apply(const Op& op) {
  switch (op.kind) {
    case Op::None:
    case Op::Wait:
    case Op::SrcLeftover:
      return {};
    case Op::Create: {
      Dir& d = dir(op.dir);
      auto h = std::make_unique<Handle>();
      h->id = op.handle;
      next_id = std::max(next_id, op.handle + 1);
      h->dir = &d;
      h->home = &d;
      h->name = op.name;
      h->tensors = op.tensors;
      h->target = op.bytes;
      h->pieces = op.pieces;
      h->in_order = op.in_order;
      hit(op.tensors ? "create tensors" : "create plain");
      if (!(op.flags & O_EXCL)) hit("create O_TRUNC over a file");
      d.entries.erase(op.name);
      Entry e;
      e.kind = Entry::Writing;
      e.handle = h->id;
      d.entries[op.name] = std::move(e);
      handles[h->id] = std::move(h);
      return {};
    }
    case Op::Write: {
      Handle& h = handle(op.handle);
      ++h.next;
      if (h.buf.size() < op.off + op.len) h.buf.resize(op.off + op.len, '\0');
      h.buf.replace(op.off, op.len, h.target, op.off, op.len);
      hit(h.in_order ? "write in order" : "write out of order");
      return {};
    }
    case Op::Close:
      return apply_close(op);
    case Op::Flush: {
      Handle& h = handle(op.handle);
      hit("flush of a file still open");
      if (orphan_over_stored(h)) hit("close of an orphan whose old name holds a stored file");
      h.flushed = true;
      return {};
    }
    case Op::Fsync:
      hit("fsync");
      // For orphan_over_stored: an fsync stores what has arrived as a FLUSH does.
      handle(op.handle).flushed = true;
      return {};
    case Op::Rename:
      return apply_rename(op);
    case Op::RenameDir: {
      auto ait = root.entries.find(op.name), bit = root.entries.find(op.to_name);
      hit(bit != root.entries.end() ? "rename dir over an empty dir" : "rename dir");
      Entry moved = std::move(ait->second);
      root.entries.erase(ait);
      if (bit != root.entries.end()) forget_dir(bit->second.dir.get());
      root.entries[op.to_name] = std::move(moved);
      return {};
    }
    case Op::Unlink: {
      Dir& d = dir(op.dir);
      auto it = d.entries.find(op.name);
      // semantics.md: unlink of a consolidated file removes its shards and record.
      hit(it->second.kind == Entry::Writing ? "unlink of a file being written"
          : it->second.stored               ? "unlink of a stored file"
                                            : "unlink");
      orphan_entries_of(it->second);
      const bool stored = it->second.kind == Entry::File && it->second.stored;
      d.entries.erase(it);
      Effect out;
      if (stored) out.shards_gone.emplace(op.dir, op.name);
      return out;
    }
    case Op::Mkdir:
      hit("mkdir");
      add_dir(op.name, op.family);
      return {};
    case Op::Rmdir: {
      hit("rmdir");
      auto it = root.entries.find(op.name);
      // Writers of files whose names were removed keep writing, orphaned.
      forget_dir(it->second.dir.get());
      root.entries.erase(it);
      return {};
    }
    case Op::SrcDelete:
      dir(op.dir).entries.erase(op.name);
      hit("SRC delete");
      return {};
    case Op::SrcWrite: {
      Entry e;
      e.kind = Entry::File;
      e.bytes = op.bytes;
      dir(op.dir).entries[op.name] = std::move(e);
      hit("SRC write");
      return {};
    }
  }
  return {};
}

// close(): FLUSH then RELEASE. What the name holds after it (semantics.md, Writes).
Effect Model::apply_close(const Op& op) {
  std::unique_ptr<Handle> gone = std::move(handles.at(op.handle));
  handles.erase(op.handle);
  const bool model = gone->dir != nullptr && is_model(gone->name);
  if (gone->dir == nullptr) {
    hit("close of an orphan");
    if (orphan_over_stored(*gone)) hit("close of an orphan whose old name holds a stored file");
    return {};
  }
  Dir& d = *gone->dir;
  Entry& e = d.entries.at(gone->name);
  if (e.pending == gone->id) hit("close of a writer renamed over a stored file");
  e = Entry{};
  e.kind = Entry::File;
  e.bytes = gone->buf;
  e.tensors = gone->tensors && gone->complete();
  // semantics.md: a consolidated file closed under a model name is stored as rank shards,
  // unless the directory shows plain files under other model names (stored whole).
  // semantics.md: "A consolidated file moved to another directory before it is closed is
  // stored whole".
  e.stored = model && e.tensors && !plain_model_other(d, gone->name) && gone->dir == gone->home;
  if (model && e.tensors) {
    hit(e.stored ? (gone->in_order ? "commit routed" : "commit staged")
                 : "commit whole (plain model names)");
  } else {
    hit(gone->complete() ? "close stored whole" : "close incomplete (non-model name)");
  }
  Effect out;
  out.stored_as.emplace(name_of(&d), gone->name);
  return out;
}

Effect Model::apply_rename(const Op& op) {
  Dir& sd = dir(op.dir);
  Dir& td = dir(op.to_dir);
  auto sit = sd.entries.find(op.name);
  auto tit = td.entries.find(op.to_name);
  hit(tit != td.entries.end() ? "rename over an existing name" : "rename");
  Entry moved = std::move(sit->second);
  sd.entries.erase(sit);
  tit = td.entries.find(op.to_name);  // the erase may have been of... another name: find again
  if (moved.kind == Entry::Writing) {
    Handle& h = handle(moved.handle);
    h.dir = &td;
    h.name = op.to_name;
    if (is_model(op.to_name)) hit("rename of a file being written onto a model name");
    if (is_model(op.name) && !is_model(op.to_name))
      hit("rename of a file being written off a model name");
    if (tit != td.entries.end() && tit->second.kind == Entry::File && tit->second.stored) {
      // semantics.md ("Once close() returned 0, the file reads back byte for byte under its
      // name until someone replaces or removes it"; "the stored old version is intact until
      // the commit"): the stored file shows until the writer closes.
      hit("rename of a file being written over a stored file");
      tit->second.pending = h.id;
      return {};
    }
  } else if (is_model(op.to_name)) {
    // semantics.md: "A plain file renamed onto a model name once no writer has it open ... is
    // split at that rename" (whole where the directory shows plain files under other model
    // names).
    moved.stored = moved.tensors && !plain_model_other(td, op.to_name, &sd == &td ? op.name : "");
    if (moved.stored) hit("split at the rename");
  }
  if (tit != td.entries.end()) {
    if (tit->second.kind == Entry::Writing) hit("rename over a file being written");
    orphan_entries_of(tit->second);
    td.entries.erase(tit);
  }
  const bool file = moved.kind == Entry::File;
  td.entries[op.to_name] = std::move(moved);
  Effect out;
  if (file) out.stored_as.emplace(op.to_dir, op.to_name);
  return out;
}

}  // namespace ckptfs::fsmodel
