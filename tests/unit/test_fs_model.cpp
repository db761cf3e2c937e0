// test_fs_model: the reference-model test of the write path (seeded random op sequences through
// fs::Filesystem, checked after every step against an in-memory model of the tree).
//
// Like mountpoint-s3's reference tests (tests/reftests/), without a kernel: each sequence drives
// fs::Filesystem as the FUSE adapter does (create, write pieces in any order, flush, fsync,
// release, rename, unlink, mkdir, rmdir) plus changes made directly in SRC, on a ManualClock, and
// after EVERY step compares what the view shows with the model: the names each directory lists,
// each file's type and size, and each file's bytes read back through Filesystem::read and its
// read plan (a file open for writing through the writer's handle and through a fresh open by
// name). Error codes of refused operations are checked too.
//
// The model is what a POSIX directory would hold, with ckptfs's documented deviations
// (docs/semantics.md, "Writes") encoded where they apply; each is marked "semantics.md:" below.
// What the generator never does, and why, is said at the generator.
//
// Replay: a failure prints the seed, the step and the operations that led there.
// CKPTFS_MODEL_SEED=S runs that one sequence; CKPTFS_MODEL_SEQS / CKPTFS_MODEL_OPS raise the
// number of sequences and their length (soak runs; the coverage minimums scale with the default).
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include "ckptfs/format/names.hpp"
#include "ckptfs/fs/filesystem.hpp"
#include "ckptfs/fs/seams.hpp"
#include "ckptfs/util/fd.hpp"
#include "fixture.hpp"

using namespace ckptfs;
namespace stdfs = std::filesystem;

// In a step returning std::optional<std::string> (the discrepancy): binds a Result's value, or
// returns its error as the discrepancy.
#define TRY_OR(decl, expr) TRY_OR_IMPL(CKPTFS_CONCAT(try_or_, __LINE__), decl, expr)
#define TRY_OR_IMPL(tmp, decl, expr)                      \
  auto tmp = (expr);                                      \
  if (!tmp.ok()) return #expr ": " + tmp.error().message; \
  decl = std::move(tmp).value()

namespace {

// --- contents ---------------------------------------------------------------------------------

// A consolidated safetensors file (as save_pretrained writes it, with a header laid out unlike
// ckptfs's own so an exact read-back proves the header was kept). Tensor names carry `prefix`,
// unique per file made, so two files in one directory never repeat a tensor and a file always
// fits the checkpoint of its directory (the fit rule is not what this test exercises).
std::string tensors_file(std::mt19937_64& rng, const std::string& prefix) {
  // Mostly small tensors (each goes whole to one rank); sometimes one over 64 KiB, which the
  // even split cuts on dim 0 across ranks.
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

// Bytes that are no safetensors file (the length prefix is far past the 100 MB header limit).
std::string plain_file(std::mt19937_64& rng) {
  const size_t n = rng() % 4 == 0 ? 0 : rng() % 12000;
  std::string s = test::random_bytes(rng, n);
  if (s.size() >= 8) s[7] = static_cast<char>(0xff);
  return s;
}

// --- the model ----------------------------------------------------------------------------------

struct Dir;

// A file open for writing (one create's handle).
struct Handle {
  int id = 0;
  uint64_t fh = 0;
  fs::Ino ino = 0;
  Dir* dir = nullptr;   // null once its name is gone (unlinked or replaced): an orphan
  Dir* home = nullptr;  // where it was created (its write state lives there)
  // An orphan's last name and directory.
  Dir* last_dir = nullptr;
  std::string last_name;
  std::string name;
  std::string target;  // the bytes the writer means to write
  bool tensors = false;
  std::vector<std::pair<uint64_t, uint64_t>> pieces;  // (offset, length), in write order
  size_t next = 0;
  std::string buf;  // what it wrote so far (holes read as zeros)
  bool in_order = true;
  bool flushed = false;  // a FLUSH (a dup'd descriptor closed) or fsync while still open
  [[nodiscard]] bool complete() const { return next == pieces.size(); }
};

struct Entry {
  enum Kind { File, Writing, Directory } kind = File;
  // File: its bytes; whether they are a consolidated safetensors file, and whether it is stored
  // as rank shards (a commit record) rather than whole.
  std::string bytes;
  bool tensors = false;
  bool stored = false;
  // File, stored: a writer renamed over it that has not closed yet (semantics.md: the stored
  // version reads back under the name until the new one commits).
  int pending = -1;
  int handle = -1;           // Writing
  std::unique_ptr<Dir> dir;  // Directory
};

struct Dir {
  // Which model names the generator uses here: 0 none (the root), 1 model.safetensors,
  // 2 model-0000k-of-00002.safetensors (so every file of a directory has the same file count).
  int family = 0;
  std::map<std::string, Entry> entries;
};

const std::vector<std::string> kPlainNames = {"a.txt", "b.bin", "notes.json"};
const std::vector<std::string> kTempNames = {".tmp1a2b3c", ".tmpzz9"};
const std::vector<std::string> kDirNames = {"d0", "d1", "d2"};
std::vector<std::string> model_names(int family) {
  if (family == 1) return {"model.safetensors"};
  if (family == 2) return {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"};
  return {};
}
bool is_model(const std::string& name) { return format::is_model_name(name); }

// Coverage: how often each operation and state was reached, over all sequences.
using Counters = std::map<std::string, uint64_t>;

int env_int(const char* name, int dflt) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : dflt;
}

class Sequence {
 public:
  Sequence(uint64_t seed, int ops, Counters& cov) : seed_(seed), ops_(ops), rng_(seed), cov_(cov) {}

  // Runs the sequence; returns the first discrepancy, with what led to it.
  std::optional<std::string> go() {
    clock_ = std::make_shared<fs::ManualClock>();
    fs::Options o;
    o.clock = clock_;
    o.revalidate = std::chrono::milliseconds(1000);
    o.settle = std::chrono::milliseconds(1000);
    o.ranks = 1 + static_cast<uint32_t>(rng_() % 3);
    // semantics.md: the writer's view shows a process that wrote in a checkpoint directory its
    // shard files; the model is what everyone else sees, so it is off here.
    o.writer_view = std::chrono::milliseconds(0);
    auto made = fs::Filesystem::create(tmp_.path(), o);
    if (!made) return "create: " + made.error().message;
    f_ = std::move(made).value();
    log_.push_back(fmt::format("ranks={}", o.ranks));
    // Two directories to start with (one of each model-name family); the sequence may remove,
    // rename and make them again.
    for (int fam : {1, 2}) {
      const std::string name = kDirNames[static_cast<size_t>(fam - 1)];
      if (!f_->mkdir(fs::kRootIno, name, 0755)) return "mkdir " + name;
      Entry e;
      e.kind = Entry::Directory;
      e.dir = std::make_unique<Dir>();
      e.dir->family = fam;
      root_.entries[name] = std::move(e);
    }
    for (step_ = 0; step_ < ops_; ++step_) {
      if (auto e = one_op()) return fail(*e);
      if (auto e = check()) return fail(*e);
    }
    // Close what is still open, checking each close.
    while (!handles_.empty()) {
      Handle& h = *handles_.begin()->second;
      while (!h.complete()) write_piece(h);
      if (auto e = close(h)) return fail(*e);
      if (auto e = check()) return fail(*e);
    }
    return std::nullopt;
  }

 private:
  std::string fail(const std::string& what) {
    std::string s = fmt::format(
        "seed {} step {}: {}\n(replay: CKPTFS_MODEL_SEED={} CKPTFS_MODEL_OPS={})\nops:\n", seed_,
        step_, what, seed_, ops_);
    const char* replay = std::getenv("CKPTFS_MODEL_SEED");  // a replay prints every step
    const size_t keep = replay && *replay ? log_.size() : 40;
    const size_t from = log_.size() > keep ? log_.size() - keep : 0;
    for (size_t i = from; i < log_.size(); ++i) s += "  " + log_[i] + "\n";
    return s;
  }
  void note(std::string s) { log_.push_back(fmt::format("[{}] {}", step_, std::move(s))); }
  void hit(const std::string& c) { ++cov_[c]; }
  uint64_t pick(uint64_t n) { return rng_() % n; }
  template <typename T>
  const T& pick_of(const std::vector<T>& v) {
    return v[pick(v.size())];
  }

  // --- paths ---
  std::string src_path(const std::string& dname) const {
    return dname.empty() ? tmp_.path() : tmp_.path() + "/" + dname;
  }
  // The directories, by name ("" is the root).
  std::vector<std::string> dir_names() const {
    std::vector<std::string> out{""};
    for (const auto& [n, e] : root_.entries) {
      if (e.kind == Entry::Directory) out.push_back(n);
    }
    return out;
  }
  // A directory for the next operation: mostly a subdirectory (where model names are used).
  std::string pick_dir() {
    const auto all = dir_names();
    if (all.size() > 1 && pick(5) != 0) return all[1 + pick(all.size() - 1)];
    return all[0];
  }
  // A name in `d`: half the time one that exists there (a file), else any of the pool.
  std::string pick_name(const Dir& d, bool model_bias = false) {
    std::vector<std::string> have;
    for (const auto& [n, e] : d.entries) {
      if (e.kind != Entry::Directory) have.push_back(n);
    }
    const auto models = model_names(d.family);
    if (model_bias && !models.empty() && pick(2) == 0) return pick_of(models);
    if (!have.empty() && pick(2) == 0) return pick_of(have);
    return pick_of(file_names(d));
  }
  Dir& dir(const std::string& dname) {
    return dname.empty() ? root_ : *root_.entries.at(dname).dir;
  }
  std::string name_of(const Dir* d) const {
    if (d == &root_) return "";
    for (const auto& [n, e] : root_.entries) {
      if (e.kind == Entry::Directory && e.dir.get() == d) return n;
    }
    return "?";
  }
  Result<fs::Ino> dir_ino(const std::string& dname) {
    if (dname.empty()) return fs::kRootIno;
    CKPTFS_TRY(auto e, f_->lookup(fs::kRootIno, dname));
    return e.ino;
  }
  // Names of a directory the generator uses for files.
  std::vector<std::string> file_names(const Dir& d) const {
    std::vector<std::string> out = kPlainNames;
    out.insert(out.end(), kTempNames.begin(), kTempNames.end());
    for (const auto& m : model_names(d.family)) out.push_back(m);
    return out;
  }

  // --- documented rules ---
  // semantics.md: in a directory of rank shards a model name shows the consolidated file its
  // shards make.
  static bool has_shards(const Dir& d) {
    return std::any_of(d.entries.begin(), d.entries.end(), [](const auto& kv) {
      return kv.second.kind == Entry::File && kv.second.stored;
    });
  }
  // semantics.md ("What the tree shows"): in a directory of rank shards "any real
  // model*.safetensors" is hidden. That includes a file still being written under a model name
  // (its backing file is a real file there): it is not listed and not found by name until it
  // commits; its writer reads it through its handle.
  static bool hidden(const Dir& d, const std::string& name, const Entry& e) {
    return e.kind == Entry::Writing && is_model(name) && has_shards(d);
  }
  // semantics.md: "In a directory that is no checkpoint yet and shows plain files under other
  // model names, a consolidated file is stored whole (splitting it would hide them)".
  static bool plain_model_other(const Dir& d, const std::string& name,
                                const std::string& except = "") {
    return std::any_of(d.entries.begin(), d.entries.end(), [&](const auto& kv) {
      return kv.first != name && kv.first != except && is_model(kv.first) &&
             kv.second.kind == Entry::File && !kv.second.stored;
    });
  }

  // --- operations ---
  std::optional<std::string> expect_err(const char* what, const Status& st, int code) {
    if (st.ok()) return fmt::format("{}: succeeded, the model says errno {}", what, code);
    if (st.error().code != code) {
      return fmt::format("{}: errno {} ({}), the model says {}", what, st.error().code,
                         st.error().message, code);
    }
    return std::nullopt;
  }
  template <typename T>
  std::optional<std::string> expect_err(const char* what, const Result<T>& r, int code) {
    if (r.ok()) return fmt::format("{}: succeeded, the model says errno {}", what, code);
    if (r.error().code != code) {
      return fmt::format("{}: errno {} ({}), the model says {}", what, r.error().code,
                         r.error().message, code);
    }
    return std::nullopt;
  }

  // The handle's entry (Writing, or the stored file it was renamed over).
  void orphan(Handle& h) {
    h.last_dir = h.dir;
    h.last_name = h.name;
    h.dir = nullptr;
  }
  void orphan_entries_of(Entry& e) {
    if (e.kind == Entry::Writing) orphan(*handles_.at(e.handle));
    if (e.kind == Entry::File && e.pending >= 0) orphan(*handles_.at(e.pending));
  }
  // A directory leaves the model: no handle points at it any more.
  void forget_dir(const Dir* d) {
    for (auto& [id, h] : handles_) {
      if (h->dir == d) orphan(*h);
      if (h->home == d) h->home = nullptr;
      if (h->last_dir == d) h->last_dir = nullptr;
    }
  }

  std::optional<std::string> op_create() {
    const std::string dname = pick_dir();
    Dir& d = dir(dname);
    if (pick(40) == 0) {  // semantics.md: the name .ckptfs is reserved everywhere (EPERM)
      note(fmt::format("create {}/.ckptfs", dname));
      TRY_OR(auto ino, dir_ino(dname));
      hit("create .ckptfs refused");
      return expect_err("create .ckptfs", f_->create(ino, ".ckptfs", 0644, O_RDWR | O_CREAT),
                        EPERM);
    }
    // Mostly a new name (temp names as save_pretrained's, or a model name directly).
    std::string name = pick_of(file_names(d));
    for (int i = 0; i < 3 && d.entries.count(name); ++i) name = pick_of(file_names(d));
    const bool excl = pick(4) != 0;
    auto it = d.entries.find(name);
    // O_TRUNC over an existing name only for a closed, whole, non-model file (a plain rewrite;
    // an O_TRUNC rewrite of a consolidated file is test_writefile's).
    if (!excl && it != d.entries.end() &&
        !(it->second.kind == Entry::File && !it->second.stored && !is_model(name))) {
      return std::nullopt;
    }
    // Content: a model name gets a consolidated file (a plain file closed under a model name of
    // a checkpoint directory is refused at close and hidden: test_writefile covers that).
    const bool tensors = is_model(name) || pick(3) != 0;
    TRY_OR(auto ino, dir_ino(dname));
    const int flags = O_RDWR | O_CREAT | (excl ? O_EXCL : O_TRUNC);
    note(fmt::format("create {}/{} {} {}", dname, name, excl ? "O_EXCL" : "O_TRUNC",
                     tensors ? "tensors" : "plain"));
    auto c = f_->create(ino, name, 0644, flags);
    if (excl && it != d.entries.end()) {
      hit("create EEXIST");
      return expect_err("create O_EXCL of an existing name", c, EEXIST);
    }
    if (!c) return fmt::format("create {}: {}", name, c.error().message);
    auto h = std::make_unique<Handle>();
    h->id = next_id_++;
    h->fh = c->open.fh;
    h->ino = c->entry.ino;
    h->dir = &d;
    h->home = &d;
    h->name = name;
    h->tensors = tensors;
    h->target = tensors ? tensors_file(rng_, fmt::format("t{}.", h->id)) : plain_file(rng_);
    // Pieces at random cut points, written in order or shuffled (out of order: the write path
    // stages the file whole and splits it at close).
    std::vector<uint64_t> cuts{0, h->target.size()};
    const int extra = static_cast<int>(pick(6));
    for (int i = 0; i < extra && !h->target.empty(); ++i) cuts.push_back(pick(h->target.size()));
    std::sort(cuts.begin(), cuts.end());
    cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
    for (size_t i = 0; i + 1 < cuts.size(); ++i)
      h->pieces.emplace_back(cuts[i], cuts[i + 1] - cuts[i]);
    if (h->pieces.size() > 1 && pick(2) == 0) {
      std::shuffle(h->pieces.begin(), h->pieces.end(), rng_);
      h->in_order = std::is_sorted(h->pieces.begin(), h->pieces.end());
    }
    hit(tensors ? "create tensors" : "create plain");
    if (!excl) hit("create O_TRUNC over a file");
    if (it != d.entries.end()) d.entries.erase(it);
    Entry e;
    e.kind = Entry::Writing;
    e.handle = h->id;
    d.entries[name] = std::move(e);
    handles_[h->id] = std::move(h);
    return std::nullopt;
  }

  void write_piece(Handle& h) {
    auto [off, len] = h.pieces[h.next++];
    note(fmt::format("write #{} [{}, +{})", h.id, off, len));
    auto r = f_->write(h.fh, off, std::string_view(h.target).substr(off, len));
    if (!r || *r != len) {
      pending_error_ = fmt::format("write #{} at {}: {}", h.id, off,
                                   r ? fmt::format("wrote {} of {}", *r, len) : r.error().message);
    }
    if (h.buf.size() < off + len) h.buf.resize(off + len, '\0');
    h.buf.replace(off, len, h.target, off, len);
    hit(h.in_order ? "write in order" : "write out of order");
  }

  std::optional<std::string> op_write() {
    std::vector<Handle*> open;
    for (auto& [id, h] : handles_) {
      if (!h->complete()) open.push_back(h.get());
    }
    if (open.empty()) return std::nullopt;
    write_piece(*pick_of(open));
    if (pending_error_) return std::exchange(pending_error_, std::nullopt);
    return std::nullopt;
  }

  // An orphan whose old name holds something else now (a stored file, other files' shards): its
  // FLUSH is judged by nothing but itself, and answers 0 as POSIX's close() does (issue 21 found
  // EINVAL here; fixed in issue 34).
  static bool orphan_over_stored(const Handle& h) {
    return h.dir == nullptr && is_model(h.last_name) && h.tensors && (!h.complete() || h.flushed);
  }

  // close(): FLUSH then RELEASE. What the name holds after it (semantics.md, Writes).
  std::optional<std::string> close(Handle& h) {
    const bool model = h.dir != nullptr && is_model(h.name);
    note(fmt::format("close #{} ({}{})", h.id, h.dir ? name_of(h.dir) + "/" + h.name : "orphan",
                     h.complete() ? "" : ", incomplete"));
    auto st = f_->flush(h.fh);
    f_->release(h.fh);
    std::unique_ptr<Handle> gone = std::move(handles_.at(h.id));
    handles_.erase(gone->id);
    if (!st) return fmt::format("close #{}: {}", gone->id, st.error().message);
    if (gone->dir == nullptr) {
      hit("close of an orphan");
      if (orphan_over_stored(*gone)) hit("close of an orphan whose old name holds a stored file");
      return std::nullopt;
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
    return check_src(d, gone->name, e);
  }

  // What SRC holds for a closed file: rank shards and no real file, or the file whole.
  std::optional<std::string> check_src(const Dir& d, const std::string& name, const Entry& e) {
    const std::string dp = src_path(name_of(&d));
    const bool real = stdfs::exists(dp + "/" + name);
    if (!e.stored) {
      if (!real) return fmt::format("{}/{} stored whole: no such file in SRC", dp, name);
      auto got = read_small_file(dp + "/" + name, 1 << 26);
      if (!got || *got != e.bytes) return fmt::format("{}/{}: SRC's bytes differ", dp, name);
      return std::nullopt;
    }
    auto mn = format::parse_model_name(name);
    const std::string shard = format::shard_file_name(1, mn->k, mn->m);
    if (real) return fmt::format("{}/{} stored as shards: a real file is there too", dp, name);
    if (!stdfs::exists(dp + "/" + shard)) return fmt::format("{}/{}: no shard {}", dp, name, shard);
    hit("stored as shards (seen in SRC)");
    return std::nullopt;
  }

  std::optional<std::string> op_close(bool mid) {
    std::vector<Handle*> can;
    for (auto& [id, h] : handles_) {
      const bool model = h->dir != nullptr && is_model(h->name);
      // A model name is closed only once every byte is written (a consolidated file cut short
      // under a model name is refused at close: test_writefile). A FLUSH with the file still
      // open (a dup'd descriptor closed) only under other names (there it stores the file
      // whole; under a model name it would commit what has arrived).
      if (model ? h->complete() && !mid : true) can.push_back(h.get());
    }
    if (can.empty()) return std::nullopt;
    Handle& h = *pick_of(can);
    if (!mid) return close(h);
    note(fmt::format("flush #{} (still open)", h.id));
    hit("flush of a file still open");
    auto st = f_->flush(h.fh);
    if (orphan_over_stored(h)) hit("close of an orphan whose old name holds a stored file");
    h.flushed = true;
    if (!st) return fmt::format("flush #{}: {}", h.id, st.error().message);
    return std::nullopt;
  }

  std::optional<std::string> op_fsync() {
    std::vector<Handle*> hs;
    for (auto& [id, h] : handles_) {
      // Not generated: fsync of a complete consolidated file under a model name. It commits the
      // file then (semantics.md: "a failed commit by close() (or fsync())"), and the model has
      // no state for a file committed while its writer still holds it open (TODO).
      if (h->dir != nullptr && is_model(h->name) && h->tensors && h->complete()) continue;
      hs.push_back(h.get());
    }
    if (hs.empty()) return std::nullopt;
    Handle& h = *pick_of(hs);
    note(fmt::format("fsync #{}", h.id));
    hit("fsync");
    auto st = f_->fsync(h.fh, pick(2) == 0);
    h.flushed = true;  // for orphan_refused: an fsync stores what has arrived as a FLUSH does
    if (!st) return fmt::format("fsync #{}: {}", h.id, st.error().message);
    return std::nullopt;
  }

  std::optional<std::string> op_rename() {
    const auto dnames = dir_names();
    // Directories: among the root's names.
    if (pick(6) == 0) return rename_dir();
    const std::string sdn = pick_dir(), tdn = pick(4) == 0 ? pick_of(dnames) : sdn;
    Dir& sd = dir(sdn);
    Dir& td = dir(tdn);
    const std::string sname = pick_name(sd), tname = pick_name(td, true);
    if (&sd == &td && sname == tname) return std::nullopt;
    const unsigned flags = pick(5) == 0 ? RENAME_NOREPLACE : 0;
    auto sit = sd.entries.find(sname);
    auto tit = td.entries.find(tname);
    const bool t_exists = tit != td.entries.end();
    // Not generated: renames of a name a writer renamed over (its pending stored file), onto
    // it, or of a directory by a file name (those are rename_dir's).
    if (sit != sd.entries.end() &&
        (sit->second.pending >= 0 || sit->second.kind == Entry::Directory)) {
      return std::nullopt;
    }
    if (t_exists && (tit->second.pending >= 0 || tit->second.kind == Entry::Directory))
      return std::nullopt;
    // A model name is only given a consolidated file (see op_create).
    const bool s_tensors =
        sit != sd.entries.end() &&
        (sit->second.kind == Entry::Writing ? handles_.at(sit->second.handle)->tensors
                                            : sit->second.tensors);
    if (sit != sd.entries.end() && is_model(tname) && !s_tensors) return std::nullopt;
    // A file being written goes onto a model name only in its own directory (moved elsewhere it
    // is stored whole, semantics.md, and under a model name of a checkpoint directory it would
    // then be refused at close and hidden: not what this test models).
    if (sit != sd.entries.end() && sit->second.kind == Entry::Writing && is_model(tname) &&
        handles_.at(sit->second.handle)->home != &td) {
      return std::nullopt;
    }
    TRY_OR(auto sino, dir_ino(sdn));
    TRY_OR(auto tino, dir_ino(tdn));
    note(fmt::format("rename {}/{} -> {}/{}{}", sdn, sname, tdn, tname, flags ? " NOREPLACE" : ""));
    auto st = f_->rename(sino, sname, tino, tname, flags);
    if (sit == sd.entries.end() && t_exists && is_model(tname)) {
      // The source is looked up first, as the kernel does: ENOENT whatever the target holds
      // (issue 21 found EEXIST and EINVAL here when the target was a checkpoint's model name;
      // fixed in issue 34).
      hit("rename of a missing name onto a checkpoint's model name ENOENT");
    }
    if (sit == sd.entries.end()) {
      hit("rename ENOENT");
      return expect_err("rename of a missing name", st, ENOENT);
    }
    Entry& s = sit->second;
    if (s.kind == Entry::File && s.stored) {  // semantics.md: rename of a consolidated file: EXDEV
      hit("rename of a stored file EXDEV");
      return expect_err("rename of a consolidated file", st, EXDEV);
    }
    if (t_exists && flags == RENAME_NOREPLACE) {
      hit("rename NOREPLACE EEXIST");
      return expect_err("rename NOREPLACE over an existing name", st, EEXIST);
    }
    if (!st) return fmt::format("rename: {}", st.error().message);
    hit(t_exists ? "rename over an existing name" : "rename");
    Entry moved = std::move(s);
    sd.entries.erase(sit);
    tit = td.entries.find(tname);  // the erase may have been of... another name: find again
    if (moved.kind == Entry::Writing) {
      Handle& h = *handles_.at(moved.handle);
      h.dir = &td;
      h.name = tname;
      if (is_model(tname)) hit("rename of a file being written onto a model name");
      if (is_model(sname) && !is_model(tname))
        hit("rename of a file being written off a model name");
      if (tit != td.entries.end() && tit->second.kind == Entry::File && tit->second.stored) {
        // semantics.md ("Once close() returned 0, the file reads back byte for byte under its
        // name until someone replaces or removes it"; "the stored old version is intact until
        // the commit"): the stored file shows until the writer closes.
        hit("rename of a file being written over a stored file");
        tit->second.pending = h.id;
        return std::nullopt;
      }
    } else if (is_model(tname)) {
      // semantics.md: "A plain file renamed onto a model name once no writer has it open ... is
      // split at that rename" (whole where the directory shows plain files under other model
      // names).
      moved.stored = moved.tensors && !plain_model_other(td, tname, &sd == &td ? sname : "");
      if (moved.stored) hit("split at the rename");
    }
    if (tit != td.entries.end()) {
      if (tit->second.kind == Entry::Writing) hit("rename over a file being written");
      orphan_entries_of(tit->second);
      td.entries.erase(tit);
    }
    td.entries[tname] = std::move(moved);
    if (td.entries[tname].kind == Entry::File) return check_src(td, tname, td.entries[tname]);
    return std::nullopt;
  }

  std::optional<std::string> rename_dir() {
    std::string a = pick_of(kDirNames);
    for (int i = 0; i < 3 && !root_.entries.count(a); ++i) a = pick_of(kDirNames);
    std::string b = pick_of(kDirNames);
    if (pick(4) == 0) b = pick_of(kPlainNames);
    if (pick(3) == 0) {
      // Over a directory the view shows empty whose .ckptfs holds what a killed daemon left
      // (its staging): ckptfs removes its own empty state as it goes, so that is how such a
      // directory comes about. Rare by chance, so made.
      std::vector<std::string> empty;
      for (const auto& [n, e] : root_.entries) {
        if (n != a && e.kind == Entry::Directory && e.dir->entries.empty()) empty.push_back(n);
      }
      if (!empty.empty()) {
        b = pick_of(empty);
        note(fmt::format("SRC: leftover {}/.ckptfs/staging", b));
        stdfs::create_directories(src_path(b) + "/.ckptfs");
        std::ofstream(src_path(b) + "/.ckptfs/staging") << "left by a killed daemon";
      }
    }
    if (a == b) return std::nullopt;
    auto ait = root_.entries.find(a), bit = root_.entries.find(b);
    const unsigned flags = pick(5) == 0 ? RENAME_NOREPLACE : 0;
    note(fmt::format("rename dir {} -> {}{}", a, b, flags ? " NOREPLACE" : ""));
    if (ait != root_.entries.end() && ait->second.kind != Entry::Directory) return std::nullopt;
    if (bit != root_.entries.end() && bit->second.pending >= 0) return std::nullopt;
    const bool b_state = stdfs::exists(src_path(b) + "/.ckptfs");  // see below
    auto st = f_->rename(fs::kRootIno, a, fs::kRootIno, b, flags);
    if (ait == root_.entries.end()) return expect_err("rename of a missing directory", st, ENOENT);
    if (bit != root_.entries.end()) {
      if (flags) return expect_err("rename NOREPLACE of a directory", st, EEXIST);
      if (bit->second.kind != Entry::Directory) {
        hit("rename dir over a file ENOTDIR");
        return expect_err("rename of a directory over a file", st, ENOTDIR);
      }
      if (!bit->second.dir->entries.empty()) {
        hit("rename dir over a non-empty dir ENOTEMPTY");
        return expect_err("rename of a directory over a non-empty one", st, ENOTEMPTY);
      }
      // A directory the view shows empty that holds the write path's hidden .ckptfs (left by a
      // file written there, even after it was removed) is replaced, as rmdir removes it (issue
      // 21 found ENOTEMPTY here; fixed in issue 34).
      // Not while a file created there is still being written (its write state is there,
      // wherever its name went since): ENOTEMPTY, as rmdir answers.
      if (b_state && std::any_of(handles_.begin(), handles_.end(), [&](const auto& kv) {
            return kv.second->home == bit->second.dir.get();
          })) {
        hit("rename dir over a view-empty dir with a file being written ENOTEMPTY");
        return expect_err("rename of a directory over one with a file being written", st,
                          ENOTEMPTY);
      }
      if (b_state) hit("rename dir over a view-empty dir holding .ckptfs");
    }
    if (!st) return fmt::format("rename dir: {}", st.error().message);
    hit(bit != root_.entries.end() ? "rename dir over an empty dir" : "rename dir");
    Entry moved = std::move(ait->second);
    root_.entries.erase(ait);
    if (bit != root_.entries.end()) forget_dir(bit->second.dir.get());
    root_.entries[b] = std::move(moved);
    return std::nullopt;
  }

  std::optional<std::string> op_unlink() {
    const std::string dname = pick_dir();
    Dir& d = dir(dname);
    std::string name = pick_name(d);
    if (dname.empty() && pick(4) == 0) name = pick_of(kDirNames);
    auto it = d.entries.find(name);
    if (it != d.entries.end() && it->second.pending >= 0) return std::nullopt;  // see op_rename
    TRY_OR(auto ino, dir_ino(dname));
    note(fmt::format("unlink {}/{}", dname, name));
    auto st = f_->unlink(ino, name);
    if (it == d.entries.end()) {
      hit("unlink ENOENT");
      return expect_err("unlink of a missing name", st, ENOENT);
    }
    if (it->second.kind == Entry::Directory) {
      hit("unlink of a directory EISDIR");
      return expect_err("unlink of a directory", st, EISDIR);
    }
    if (!st) return fmt::format("unlink: {}", st.error().message);
    // semantics.md: unlink of a consolidated file removes its shards and record.
    hit(it->second.kind == Entry::Writing ? "unlink of a file being written"
        : it->second.stored               ? "unlink of a stored file"
                                          : "unlink");
    orphan_entries_of(it->second);
    const bool stored = it->second.kind == Entry::File && it->second.stored;
    d.entries.erase(it);
    if (stored) {
      auto mn = format::parse_model_name(name);
      if (stdfs::exists(src_path(dname) + "/" + format::shard_file_name(1, mn->k, mn->m))) {
        return fmt::format("unlink {}/{}: its shards are still in SRC", dname, name);
      }
    }
    return std::nullopt;
  }

  std::optional<std::string> op_mkdir() {
    const std::string name = pick(15) == 0 ? ".ckptfs" : pick_of(kDirNames);
    note(fmt::format("mkdir {}", name));
    auto r = f_->mkdir(fs::kRootIno, name, 0755);
    if (name == ".ckptfs") {
      // semantics.md: reserved. At the root the kernel answers EEXIST itself (its lookup finds
      // the status directory) and never asks; asked directly, the filesystem says EPERM.
      hit("mkdir .ckptfs refused");
      if (!f_->lookup(fs::kRootIno, ".ckptfs").ok()) return "lookup /.ckptfs: no status directory";
      return expect_err("mkdir .ckptfs at the root", r, EPERM);
    }
    if (root_.entries.count(name)) {
      hit("mkdir EEXIST");
      return expect_err("mkdir of an existing name", r, EEXIST);
    }
    if (!r) return fmt::format("mkdir: {}", r.error().message);
    hit("mkdir");
    Entry e;
    e.kind = Entry::Directory;
    e.dir = std::make_unique<Dir>();
    e.dir->family = 1 + static_cast<int>(pick(2));
    root_.entries[name] = std::move(e);
    return std::nullopt;
  }

  std::optional<std::string> op_rmdir() {
    std::vector<std::string> names = kDirNames;
    names.push_back(kPlainNames[0]);
    std::string name = pick_of(names);
    // Mostly one the model says is empty.
    for (const auto& n : kDirNames) {
      auto e = root_.entries.find(n);
      if (pick(2) == 0 && e != root_.entries.end() && e->second.kind == Entry::Directory &&
          e->second.dir->entries.empty()) {
        name = n;
      }
    }
    auto it = root_.entries.find(name);
    note(fmt::format("rmdir {}", name));
    const bool src_empty = !stdfs::is_directory(src_path(name)) || stdfs::is_empty(src_path(name));
    auto st = f_->rmdir(fs::kRootIno, name);
    if (it == root_.entries.end()) {
      hit("rmdir ENOENT");
      return expect_err("rmdir of a missing name", st, ENOENT);
    }
    if (it->second.kind != Entry::Directory) {
      hit("rmdir of a file ENOTDIR");
      return expect_err("rmdir of a file", st, ENOTDIR);
    }
    if (!it->second.dir->entries.empty()) {
      hit("rmdir ENOTEMPTY");
      return expect_err("rmdir of a non-empty directory", st, ENOTEMPTY);
    }
    // semantics.md: rmdir of a directory whose view is empty also removes what the view hides
    // in it (.ckptfs), but "a directory with a file being written through the mount ...
    // answers ENOTEMPTY" (one created there and still open, wherever its name went since, whose
    // write state is there: a directory empty in SRC too is simply removed).
    if (!src_empty && std::any_of(handles_.begin(), handles_.end(), [&](const auto& kv) {
          return kv.second->home == it->second.dir.get();
        })) {
      hit("rmdir of a view-empty dir with a file being written ENOTEMPTY");
      return expect_err("rmdir of a directory a file is being written from", st, ENOTEMPTY);
    }
    if (!st) return fmt::format("rmdir of an empty directory: {}", st.error().message);
    hit("rmdir");
    // Writers of files whose names were removed keep writing, orphaned.
    forget_dir(it->second.dir.get());
    root_.entries.erase(it);
    return std::nullopt;
  }

  // A change made directly in SRC (another process on the machine, or another node): a plain
  // file written or deleted with ordinary calls; then the clock passes `revalidate`.
  std::optional<std::string> op_src_change() {
    const std::string dname = pick_dir();
    Dir& d = dir(dname);
    const std::string name = pick_of(kPlainNames);
    auto it = d.entries.find(name);
    if (it != d.entries.end() && it->second.kind != Entry::File) return std::nullopt;
    const std::string path = src_path(dname) + "/" + name;
    if (it != d.entries.end() && pick(2) == 0) {
      note(fmt::format("SRC: rm {}/{}", dname, name));
      if (::unlink(path.c_str()) != 0) return fmt::format("unlink {} in SRC failed", path);
      d.entries.erase(it);
      hit("SRC delete");
    } else {
      std::string bytes = plain_file(rng_);
      note(fmt::format("SRC: write {}/{} ({} bytes)", dname, name, bytes.size()));
      test::write_file(path, bytes);
      Entry e;
      e.kind = Entry::File;
      e.bytes = std::move(bytes);
      d.entries[name] = std::move(e);
      hit("SRC write");
    }
    clock_->advance(std::chrono::milliseconds(1100));
    src_changed_ = true;
    return std::nullopt;
  }

  std::optional<std::string> one_op() {
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
    note("clock +1.1 s");
    clock_->advance(std::chrono::milliseconds(1100));
    return std::nullopt;
  }

  // --- the check after every step ---

  // Reads [0, size + 7) of an open handle through Filesystem::read and its plan, in two reads
  // split at a random offset; asking past the end gets a short read.
  std::optional<std::string> read_fh(uint64_t fh, uint64_t size, std::string& out) {
    out.clear();
    const uint64_t split = pick(size + 1);
    const std::pair<uint64_t, uint64_t> parts[] = {{0, split}, {split, size - split + 7}};
    for (auto [off, len] : parts) {
      fs::ReadPlan plan;
      auto st = f_->read(fh, off, len, plan);
      if (!st) return fmt::format("read at {}: {}", off, st.error().message);
      std::string buf(len + plan.size, '\0');
      auto n = fs::execute(plan, buf.data());
      if (!n) return fmt::format("read at {}: {}", off, n.error().message);
      buf.resize(std::min<uint64_t>(*n, len));
      out += buf;
    }
    return std::nullopt;
  }

  static std::string differ(const std::string& got, const std::string& want) {
    size_t i = 0;
    while (i < got.size() && i < want.size() && got[i] == want[i]) ++i;
    return fmt::format("got {} bytes, the model says {}; first difference at {}", got.size(),
                       want.size(), i);
  }

  std::optional<std::string> check_file(fs::Ino dino, const std::string& where,
                                        const std::string& name, const Entry& e) {
    auto l = f_->lookup(dino, name);
    if (!l) return fmt::format("lookup {}: {}", where, l.error().message);
    auto st = f_->getattr(l->ino);
    if (!st) return fmt::format("getattr {}: {}", where, st.error().message);
    if (e.kind == Entry::Directory) {
      if (!S_ISDIR(st->st_mode)) return fmt::format("{}: not a directory", where);
      return std::nullopt;
    }
    if (!S_ISREG(st->st_mode)) return fmt::format("{}: not a regular file", where);
    const Handle* h = e.kind == Entry::Writing ? handles_.at(e.handle).get() : nullptr;
    // The stored version while a writer renamed over it has not closed (see op_rename).
    const std::string& want = h ? h->buf : e.bytes;
    if (static_cast<uint64_t>(st->st_size) != want.size()) {
      return fmt::format("getattr {}: size {}, the model says {}", where, st->st_size, want.size());
    }
    std::string got;
    if (h) {  // through the writer's own handle
      if (auto err = read_fh(h->fh, want.size(), got)) return where + " (writer's handle): " + *err;
      if (got != want) return fmt::format("{} (writer's handle): {}", where, differ(got, want));
      hit("read of a file being written (writer's handle)");
    }
    auto o = f_->open(l->ino, O_RDONLY);
    if (!o) return fmt::format("open {}: {}", where, o.error().message);
    auto err = read_fh(o->fh, want.size(), got);
    f_->release(o->fh);
    if (err) return where + ": " + *err;
    if (got != want) return fmt::format("{}: {}", where, differ(got, want));
    if (h) hit("read of a file being written (open by name)");
    if (e.pending >= 0) hit("read of a stored file a writer renamed over");
    if (e.kind == Entry::File && e.stored) hit("read of a stored file after commit");
    if (e.kind == Entry::File && !e.stored && e.tensors && is_model(name))
      hit("read of a model file stored whole");
    return std::nullopt;
  }

  std::optional<std::string> check_hidden(fs::Ino dino, const std::string& where,
                                          const std::string& name, const Entry& e) {
    auto l = f_->lookup(dino, name);
    if (l.ok() || l.error().code != ENOENT) {
      return fmt::format("lookup {} (hidden while being written): {}", where,
                         l.ok() ? "found" : l.error().message);
    }
    const Handle& h = *handles_.at(e.handle);
    std::string got;
    if (auto err = read_fh(h.fh, h.buf.size(), got)) return where + " (writer's handle): " + *err;
    if (got != h.buf) return fmt::format("{} (writer's handle): {}", where, differ(got, h.buf));
    hit("file being written hidden in a checkpoint directory");
    return std::nullopt;
  }

  std::optional<std::string> check() {
    for (const auto& dname : dir_names()) {
      auto dino = dir_ino(dname);
      if (!dino) return fmt::format("lookup of directory {}: {}", dname, dino.error().message);
      const Dir& d = dir(dname);
      // The listing: the model's names, nothing else (semantics.md: shard files, .ckptfs and
      // the commit records are hidden; no index is synthesized in a directory written through
      // the mount; no .ckptfs-pending, since files written through the mount need no settle).
      std::vector<std::string> got, want;
      auto dh = f_->opendir(*dino);
      if (!dh) return fmt::format("opendir {}: {}", dname, dh.error().message);
      auto st = f_->readdir(*dh, 0, [&](const fs::DirEntryOut& e, uint64_t) {
        if (e.name != "." && e.name != "..") got.push_back(e.name);
        return true;
      });
      f_->releasedir(*dh);
      if (!st) return fmt::format("readdir {}: {}", dname, st.error().message);
      for (const auto& [n, e] : d.entries) {
        if (!hidden(d, n, e)) want.push_back(n);
      }
      std::sort(got.begin(), got.end());
      if (got != want) {
        std::vector<std::string> src;
        for (const auto& e : stdfs::recursive_directory_iterator(src_path(dname))) {
          src.push_back(e.path().string().substr(src_path(dname).size() + 1));
        }
        return fmt::format("readdir /{}: [{}], the model says [{}]; SRC holds [{}]", dname,
                           fmt::join(got, " "), fmt::join(want, " "), fmt::join(src, " "));
      }
      for (const auto& [n, e] : d.entries) {
        if (hidden(d, n, e)) {
          if (auto err = check_hidden(*dino, "/" + dname + "/" + n, n, e)) return err;
          continue;
        }
        if (auto err = check_file(*dino, "/" + dname + (dname.empty() ? "" : "/") + n, n, e))
          return err;
      }
      // A name the model does not hold: ENOENT.
      std::vector<std::string> pool = file_names(d);
      if (dname.empty()) pool.insert(pool.end(), kDirNames.begin(), kDirNames.end());
      for (const auto& n : pool) {
        if (d.entries.count(n)) continue;
        auto l = f_->lookup(*dino, n);
        if (l.ok() || l.error().code != ENOENT) {
          return fmt::format("lookup /{}/{}: {}, the model says ENOENT", dname, n,
                             l.ok() ? "found" : l.error().message);
        }
        break;  // one per directory and step
      }
    }
    if (src_changed_) {
      hit("SRC change observed");
      src_changed_ = false;
    }
    return std::nullopt;
  }

  const uint64_t seed_;
  const int ops_;
  std::mt19937_64 rng_;
  Counters& cov_;
  test::TempDir tmp_;
  std::shared_ptr<fs::ManualClock> clock_;
  std::unique_ptr<fs::Filesystem> f_;
  Dir root_;
  std::map<int, std::unique_ptr<Handle>> handles_;
  int next_id_ = 1;
  int step_ = 0;
  bool src_changed_ = false;
  std::optional<std::string> pending_error_;
  std::vector<std::string> log_;
};

}  // namespace

TEST(FsModel, RandomSequencesMatchTheReferenceModel) {
  const int seqs = std::max(1, env_int("CKPTFS_MODEL_SEQS", 60));
  const int ops = std::max(1, env_int("CKPTFS_MODEL_OPS", 150));
  const char* one = std::getenv("CKPTFS_MODEL_SEED");
  spdlog::set_level(spdlog::level::warn);  // a line per commit otherwise
  Counters cov;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < seqs; ++i) {
    const uint64_t seed =
        one && *one ? std::strtoull(one, nullptr, 10) : 0x5eed0000u + static_cast<uint64_t>(i);
    Sequence run(seed, ops, cov);
    if (auto e = run.go()) {
      ADD_FAILURE() << *e;
      return;
    }
    if (one && *one) break;
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::string report;
  for (const auto& [k, v] : cov) report += fmt::format("  {:<58} {}\n", k, v);
  std::cout << fmt::format("{} sequences x {} ops in {:.1f} s; coverage:\n{}", seqs, ops, secs,
                           report);
  if (one && *one) return;  // a replay: no coverage minimums
  // Every state the generator is meant to reach, reached (scaled from the default 60 x 150;
  // about a third of what the default run reaches).
  const double scale = static_cast<double>(seqs) * ops / (60.0 * 150.0);
  const std::map<std::string, uint64_t> minimums = {
      {"SRC change observed", 126},
      {"SRC delete", 25},
      {"SRC write", 101},
      {"close incomplete (non-model name)", 112},
      {"close of a writer renamed over a stored file", 3},
      {"close of an orphan", 55},
      {"close of an orphan whose old name holds a stored file", 1},
      {"close stored whole", 128},
      {"commit routed", 37},
      {"commit staged", 20},
      {"create .ckptfs refused", 13},
      {"create EEXIST", 39},
      {"create O_TRUNC over a file", 105},
      {"create plain", 96},
      {"create tensors", 268},
      {"file being written hidden in a checkpoint directory", 378},
      {"flush of a file still open", 96},
      {"fsync", 118},
      {"mkdir", 43},
      {"mkdir .ckptfs refused", 11},
      {"mkdir EEXIST", 90},
      {"read of a file being written (open by name)", 9250},
      {"read of a file being written (writer's handle)", 9250},
      {"read of a stored file a writer renamed over", 162},
      {"read of a stored file after commit", 2141},
      {"rename", 39},
      {"rename ENOENT", 114},
      {"rename NOREPLACE EEXIST", 11},
      {"rename dir", 27},
      {"rename dir over a file ENOTDIR", 5},
      {"rename dir over a non-empty dir ENOTEMPTY", 14},
      {"rename dir over an empty dir", 3},
      {"rename dir over a view-empty dir holding .ckptfs", 1},
      {"rename of a missing name onto a checkpoint's model name ENOENT", 1},
      {"rename of a file being written off a model name", 8},
      {"rename of a file being written onto a model name", 17},
      {"rename of a file being written over a stored file", 3},
      {"rename of a stored file EXDEV", 9},
      {"rename over a file being written", 18},
      {"rename over an existing name", 53},
      {"rmdir", 23},
      {"rmdir ENOENT", 33},
      {"rmdir ENOTEMPTY", 49},
      {"rmdir of a file ENOTDIR", 8},
      {"rmdir of a view-empty dir with a file being written ENOTEMPTY", 1},
      {"split at the rename", 6},
      {"stored as shards (seen in SRC)", 64},
      {"unlink", 53},
      {"unlink ENOENT", 78},
      {"unlink of a directory EISDIR", 7},
      {"unlink of a file being written", 48},
      {"unlink of a stored file", 7},
      {"write in order", 467},
      {"write out of order", 368},
  };
  for (const auto& [k, min] : minimums) {
    const auto want = static_cast<uint64_t>(static_cast<double>(min) * std::min(scale, 1.0));
    EXPECT_GE(cov[k], want) << "the generator stopped reaching: " << k;
  }
}
