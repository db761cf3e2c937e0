// fs_model/generator: the random choice of each step's op and of the bytes files get.
//
// Every draw from the rng happens in the order the test made them before the split (the seeds'
// sequences are the same ones), and the content of a writer is drawn only when the model says
// its create succeeds.
#include "generator.hpp"

#include <fcntl.h>
#include <stdio.h>

#include <algorithm>

#include <fmt/format.h>

#include "ckptfs/format/names.hpp"
#include "ckptfs/format/safetensors.hpp"
#include "fixture.hpp"

namespace ckptfs::fsmodel {

std::string tensors_file(std::mt19937_64& rng, const std::string& prefix) {
  // Unique tensor names per file made, so two files in one directory never repeat a tensor and
  // a file always fits the checkpoint of its directory (the fit rule is not what this test
  // exercises). Mostly small tensors (each goes whole to one rank); sometimes one over 64 KiB,
  // which the even split cuts on dim 0 across ranks.
  const uint64_t rows = rng() % 5 == 0 ? 260 + rng() % 80 : 1 + rng() % 24;
  const uint64_t w = rows * 64 * 4, b = 64 * 4, e = 3 * 4;
  std::string json =
      fmt::format(R"({{"{3}z.weight": {{"dtype":"F32","shape":[{0},64],"data_offsets":[0,{1}]}}, )"
                  R"("{3}a.bias":{{"dtype":"F32","shape":[64],"data_offsets":[{1},{2}]}},)"
                  R"("{3}m.embed":{{"dtype":"F32","shape":[3],"data_offsets":[{2},{4}]}},)"
                  R"("__metadata__":{{"format":"pt"}}}})",
                  rows, w, w + b, prefix, w + b + e);
  json.append(rng() % 9, ' ');
  while ((8 + json.size()) % 8 != 0) json.push_back(' ');
  std::string out = format::with_length_prefix(json);
  out += test::random_bytes(rng, w + b + e);
  return out;
}

std::string plain_file(std::mt19937_64& rng) {
  const size_t n = rng() % 4 == 0 ? 0 : rng() % 12000;
  std::string s = test::random_bytes(rng, n);
  if (s.size() >= 8) s[7] = static_cast<char>(0xff);
  return s;
}

// A directory for the next operation: mostly a subdirectory (where model names are used).
std::string Generator::pick_dir() {
  const auto all = m_.dir_names();
  if (all.size() > 1 && pick(5) != 0) return all[1 + pick(all.size() - 1)];
  return all[0];
}

// A name in `d`: half the time one that exists there (a file), else any of the pool.
std::string Generator::pick_name(const Dir& d, bool model_bias) {
  std::vector<std::string> have;
  for (const auto& [n, e] : d.entries) {
    if (e.kind != Entry::Directory) have.push_back(n);
  }
  const auto models = model_names(d.family);
  if (model_bias && !models.empty() && pick(2) == 0) return pick_of(models);
  if (!have.empty() && pick(2) == 0) return pick_of(have);
  return pick_of(Model::file_names(d));
}

Op Generator::next() {
  const uint64_t r = pick(100);
  if (r < 14) return op_create();
  if (r < 44) return op_write();
  if (r < 54) return op_close(false);
  if (r < 58) return op_close(true);
  if (r < 62) return op_fsync();
  if (r < 76) return op_rename();
  if (r < 83) return op_unlink();
  if (r < 88) return op_mkdir();
  if (r < 92) return op_rmdir();
  if (r < 97) return op_src_change();
  Op op;
  op.kind = Op::Wait;
  return op;
}

std::vector<Op> Generator::finish_one() const {
  const Handle& h = *m_.handles.begin()->second;
  std::vector<Op> out;
  for (size_t i = h.next; i < h.pieces.size(); ++i) {
    Op w;
    w.kind = Op::Write;
    w.handle = h.id;
    std::tie(w.off, w.len) = h.pieces[i];
    out.push_back(w);
  }
  Op c = close_op(h);
  c.incomplete = false;  // once the writes above are done
  out.push_back(c);
  return out;
}

Op Generator::close_op(const Handle& h) const {
  Op op;
  op.kind = Op::Close;
  op.handle = h.id;
  op.where = h.dir ? m_.name_of(h.dir) + "/" + h.name : "orphan";
  op.incomplete = !h.complete();
  return op;
}

Op Generator::op_create() {
  const std::string dname = pick_dir();
  const Dir& d = m_.dir(dname);
  Op op;
  op.kind = Op::Create;
  op.dir = dname;
  if (pick(40) == 0) {  // the reserved name
    op.name = ".ckptfs";
    op.flags = O_RDWR | O_CREAT;
    return op;
  }
  // Mostly a new name (temp names as save_pretrained's, or a model name directly).
  std::string name = pick_of(Model::file_names(d));
  for (int i = 0; i < 3 && d.entries.count(name); ++i) name = pick_of(Model::file_names(d));
  const bool excl = pick(4) != 0;
  auto it = d.entries.find(name);
  // O_TRUNC over an existing name only for a closed, whole, non-model file (a plain rewrite;
  // an O_TRUNC rewrite of a consolidated file is test_writefile's).
  if (!excl && it != d.entries.end() &&
      !(it->second.kind == Entry::File && !it->second.stored && !is_model(name))) {
    return {};
  }
  // Content: a model name gets a consolidated file (a plain file closed under a model name of
  // a checkpoint directory is refused at close and hidden: test_writefile covers that).
  op.tensors = is_model(name) || pick(3) != 0;
  op.name = name;
  op.flags = O_RDWR | O_CREAT | (excl ? O_EXCL : O_TRUNC);
  op.handle = m_.next_id;
  if (excl && it != d.entries.end()) return op;  // EEXIST: no writer, no content
  op.bytes = op.tensors ? tensors_file(rng_, fmt::format("t{}.", op.handle)) : plain_file(rng_);
  // Pieces at random cut points, written in order or shuffled (out of order: the write path
  // stages the file whole and splits it at close).
  std::vector<uint64_t> cuts{0, op.bytes.size()};
  const int extra = static_cast<int>(pick(6));
  for (int i = 0; i < extra && !op.bytes.empty(); ++i) cuts.push_back(pick(op.bytes.size()));
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  for (size_t i = 0; i + 1 < cuts.size(); ++i)
    op.pieces.emplace_back(cuts[i], cuts[i + 1] - cuts[i]);
  if (op.pieces.size() > 1 && pick(2) == 0) {
    std::shuffle(op.pieces.begin(), op.pieces.end(), rng_);
    op.in_order = std::is_sorted(op.pieces.begin(), op.pieces.end());
  }
  return op;
}

Op Generator::op_write() {
  std::vector<const Handle*> open;
  for (const auto& [id, h] : m_.handles) {
    if (!h->complete()) open.push_back(h.get());
  }
  if (open.empty()) return {};
  const Handle& h = *pick_of(open);
  Op op;
  op.kind = Op::Write;
  op.handle = h.id;
  std::tie(op.off, op.len) = h.pieces[h.next];
  return op;
}

Op Generator::op_close(bool mid) {
  std::vector<const Handle*> can;
  for (const auto& [id, h] : m_.handles) {
    const bool model = h->dir != nullptr && is_model(h->name);
    // A model name is closed only once every byte is written (a consolidated file cut short
    // under a model name is refused at close: test_writefile). A FLUSH with the file still
    // open (a dup'd descriptor closed) only under other names (there it stores the file
    // whole; under a model name it would commit what has arrived).
    if (model ? h->complete() && !mid : true) can.push_back(h.get());
  }
  if (can.empty()) return {};
  const Handle& h = *pick_of(can);
  Op op = close_op(h);
  if (mid) op.kind = Op::Flush;
  return op;
}

Op Generator::op_fsync() {
  std::vector<const Handle*> hs;
  for (const auto& [id, h] : m_.handles) {
    // Not generated: fsync of a complete consolidated file under a model name. It commits the
    // file then (semantics.md: "a failed commit by close() (or fsync())"), and the model has
    // no state for a file committed while its writer still holds it open (TODO).
    if (h->dir != nullptr && is_model(h->name) && h->tensors && h->complete()) continue;
    hs.push_back(h.get());
  }
  if (hs.empty()) return {};
  Op op;
  op.kind = Op::Fsync;
  op.handle = pick_of(hs)->id;
  op.flags = pick(2) == 0 ? 1 : 0;
  return op;
}

Op Generator::op_rename() {
  const auto dnames = m_.dir_names();
  // Directories: among the root's names.
  if (pick(6) == 0) return rename_dir();
  const std::string sdn = pick_dir(), tdn = pick(4) == 0 ? pick_of(dnames) : sdn;
  const Dir& sd = m_.dir(sdn);
  const Dir& td = m_.dir(tdn);
  const std::string sname = pick_name(sd), tname = pick_name(td, true);
  if (&sd == &td && sname == tname) return {};
  Op op;
  op.kind = Op::Rename;
  op.dir = sdn;
  op.name = sname;
  op.to_dir = tdn;
  op.to_name = tname;
  op.flags = pick(5) == 0 ? RENAME_NOREPLACE : 0;
  auto sit = sd.entries.find(sname);
  auto tit = td.entries.find(tname);
  // Not generated: renames of a name a writer renamed over (its pending stored file), onto
  // it, or of a directory by a file name (those are rename_dir's).
  if (sit != sd.entries.end() &&
      (sit->second.pending >= 0 || sit->second.kind == Entry::Directory)) {
    return {};
  }
  if (tit != td.entries.end() &&
      (tit->second.pending >= 0 || tit->second.kind == Entry::Directory)) {
    return {};
  }
  // A model name is only given a consolidated file (see op_create).
  const bool s_tensors = sit != sd.entries.end() &&
                         (sit->second.kind == Entry::Writing ? m_.handle(sit->second.handle).tensors
                                                             : sit->second.tensors);
  if (sit != sd.entries.end() && is_model(tname) && !s_tensors) return {};
  // A file being written goes onto a model name only in its own directory (moved elsewhere it
  // is stored whole, semantics.md, and under a model name of a checkpoint directory it would
  // then be refused at close and hidden: not what this test models).
  if (sit != sd.entries.end() && sit->second.kind == Entry::Writing && is_model(tname) &&
      m_.handle(sit->second.handle).home != &td) {
    return {};
  }
  return op;
}

Op Generator::rename_dir() {
  const Dir& root = m_.root;
  std::string a = pick_of(kDirNames);
  for (int i = 0; i < 3 && !root.entries.count(a); ++i) a = pick_of(kDirNames);
  std::string b = pick_of(kDirNames);
  if (pick(4) == 0) b = pick_of(kPlainNames);
  Op leftover;  // the SRC change alone, where the rename is not generated
  if (pick(3) == 0) {
    // Over a directory the view shows empty whose .ckptfs holds what a killed daemon left
    // (its staging): ckptfs removes its own empty state as it goes, so that is how such a
    // directory comes about. Rare by chance, so made.
    std::vector<std::string> empty;
    for (const auto& [n, e] : root.entries) {
      if (n != a && e.kind == Entry::Directory && e.dir->entries.empty()) empty.push_back(n);
    }
    if (!empty.empty()) {
      b = pick_of(empty);
      leftover.kind = Op::SrcLeftover;
      leftover.to_name = b;
    }
  }
  if (a == b) return leftover;
  Op op;
  op.kind = Op::RenameDir;
  op.name = a;
  op.to_name = b;
  op.flags = pick(5) == 0 ? RENAME_NOREPLACE : 0;
  op.leftover = leftover.kind == Op::SrcLeftover;
  auto ait = root.entries.find(a), bit = root.entries.find(b);
  if (ait != root.entries.end() && ait->second.kind != Entry::Directory) return leftover;
  if (bit != root.entries.end() && bit->second.pending >= 0) return leftover;
  return op;
}

Op Generator::op_unlink() {
  const std::string dname = pick_dir();
  const Dir& d = m_.dir(dname);
  std::string name = pick_name(d);
  if (dname.empty() && pick(4) == 0) name = pick_of(kDirNames);
  auto it = d.entries.find(name);
  if (it != d.entries.end() && it->second.pending >= 0) return {};  // see op_rename
  Op op;
  op.kind = Op::Unlink;
  op.dir = dname;
  op.name = name;
  return op;
}

Op Generator::op_mkdir() {
  Op op;
  op.kind = Op::Mkdir;
  op.name = pick(15) == 0 ? ".ckptfs" : pick_of(kDirNames);
  if (op.name != ".ckptfs" && !m_.root.entries.count(op.name)) {
    op.family = 1 + static_cast<int>(pick(2));  // the new directory's model names
  }
  return op;
}

Op Generator::op_rmdir() {
  std::vector<std::string> names = kDirNames;
  names.push_back(kPlainNames[0]);
  Op op;
  op.kind = Op::Rmdir;
  op.name = pick_of(names);
  // Mostly one the model says is empty.
  for (const auto& n : kDirNames) {
    auto e = m_.root.entries.find(n);
    if (pick(2) == 0 && e != m_.root.entries.end() && e->second.kind == Entry::Directory &&
        e->second.dir->entries.empty()) {
      op.name = n;
    }
  }
  return op;
}

// A change made directly in SRC (another process on the machine, or another node): a plain
// file written or deleted with ordinary calls; then time passes (revalidate).
Op Generator::op_src_change() {
  Op op;
  op.dir = pick_dir();
  const Dir& d = m_.dir(op.dir);
  op.name = pick_of(kPlainNames);
  auto it = d.entries.find(op.name);
  if (it != d.entries.end() && it->second.kind != Entry::File) return {};
  if (it != d.entries.end() && pick(2) == 0) {
    op.kind = Op::SrcDelete;
  } else {
    op.kind = Op::SrcWrite;
    op.bytes = plain_file(rng_);
  }
  return op;
}

}  // namespace ckptfs::fsmodel
