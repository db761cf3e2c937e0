// fs_model/harness: the Runner: each op applied to a Driver and judged by the model, SRC's
// storage checked after each commit, and the whole tree checked after every step.
#include "harness.hpp"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ckptfs/format/names.hpp"
#include "ckptfs/util/fd.hpp"
#include "fixture.hpp"

namespace ckptfs::fsmodel {

namespace stdfs = std::filesystem;

int env_int(const char* name, int dflt) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : dflt;
}

namespace {

std::string where(const std::string& dname, const std::string& name) {
  return "/" + dname + (dname.empty() ? "" : "/") + name;
}

std::string differ(const std::string& got, const std::string& want) {
  size_t i = 0;
  while (i < got.size() && i < want.size() && got[i] == want[i]) ++i;
  return fmt::format("got {} bytes, the model says {}; first difference at {}", got.size(),
                     want.size(), i);
}

}  // namespace

Runner::Runner(Driver& d, uint64_t seed, int ops, Counters& cov)
    : d_(d), seed_(seed), ops_(ops), rng_(seed), cov_(cov), m_(d.src(), cov), gen_(m_, rng_) {}

std::optional<std::string> Runner::go() {
  const auto ranks = d_.start(1 + static_cast<uint32_t>(rng_() % 3));
  if (!ranks) return "start: " + ranks.error().message;
  log_.push_back(fmt::format("ranks={}", *ranks));
  // Two directories to start with (one of each model-name family); the sequence may remove,
  // rename and make them again.
  for (int fam : {1, 2}) {
    const std::string name = kDirNames[static_cast<size_t>(fam - 1)];
    if (auto a = d_.mkdir(name); a.err) return "mkdir " + name + ": " + a.msg;
    m_.add_dir(name, fam);
  }
  for (step_ = 0; step_ < ops_; ++step_) {
    if (auto e = run(gen_.next())) return fail(*e);
    if (auto e = check()) return fail(*e);
  }
  // Close what is still open, checking each close.
  while (!m_.handles.empty()) {
    for (const Op& op : gen_.finish_one()) {
      if (auto e = run(op)) return fail(*e);
    }
    if (auto e = check()) return fail(*e);
  }
  return std::nullopt;
}

std::string Runner::fail(const std::string& what) const {
  std::string s =
      fmt::format("seed {} step {}: {}\n(replay: CKPTFS_MODEL_SEED={} CKPTFS_MODEL_OPS={})\nops:\n",
                  seed_, step_, what, seed_, ops_);
  const char* replay = std::getenv("CKPTFS_MODEL_SEED");  // a replay prints every step
  const size_t keep = replay && *replay ? log_.size() : 40;
  const size_t from = log_.size() > keep ? log_.size() - keep : 0;
  for (size_t i = from; i < log_.size(); ++i) s += "  " + log_[i] + "\n";
  return s;
}

void Runner::note(std::string s) { log_.push_back(fmt::format("[{}] {}", step_, std::move(s))); }

// --- one op -------------------------------------------------------------------------------------

std::optional<std::string> Runner::run(const Op& op) {
  if (op.kind == Op::None) return std::nullopt;
  note(op.describe());
  switch (op.kind) {
    case Op::Wait:
      d_.pass_time();
      return std::nullopt;
    case Op::SrcWrite:
    case Op::SrcDelete:
    case Op::SrcLeftover:
      return change_src(op);
    default:
      break;
  }
  if (op.kind == Op::RenameDir && op.leftover) {
    Op l;
    l.kind = Op::SrcLeftover;
    l.to_name = op.to_name;
    if (auto e = change_src(l)) return e;
  }
  const Expect want = m_.expect(op, d_.through_kernel());
  Answer got;
  size_t wrote = 0;
  switch (op.kind) {
    case Op::Create:
      got = d_.create(op.dir, op.name, op.flags, op.handle);
      break;
    case Op::Write:
      got = d_.write(op.handle, op.off,
                     std::string_view(m_.handle(op.handle).target).substr(op.off, op.len), wrote);
      break;
    case Op::Close:
      got = d_.close(op.handle);
      break;
    case Op::Flush:
      got = d_.flush(op.handle);
      break;
    case Op::Fsync:
      got = d_.fsync(op.handle, op.flags != 0);
      break;
    case Op::Rename:
      got = d_.rename(op.dir, op.name, op.to_dir, op.to_name, static_cast<unsigned>(op.flags));
      break;
    case Op::RenameDir:
      got = d_.rename("", op.name, "", op.to_name, static_cast<unsigned>(op.flags));
      break;
    case Op::Unlink:
      got = d_.unlink(op.dir, op.name);
      break;
    case Op::Mkdir:
      got = d_.mkdir(op.name);
      break;
    case Op::Rmdir:
      got = d_.rmdir(op.name);
      break;
    default:
      return "no driver call for " + op.describe();
  }
  if (auto e = judge(op, want, got)) return e;
  if (want.err) {
    if (op.kind == Op::Mkdir && op.name == ".ckptfs") {
      const FileStat s = d_.stat("", ".ckptfs");
      if (s.ans.err || !s.is_dir) return "stat /.ckptfs: no status directory " + s.ans.msg;
    }
    return std::nullopt;
  }
  if (op.kind == Op::Write && wrote != op.len) {
    return fmt::format("write #{} at {}: wrote {} of {}", op.handle, op.off, wrote, op.len);
  }
  return check_effect(m_.apply(op));
}

std::optional<std::string> Runner::judge(const Op& op, const Expect& want,
                                         const Answer& got) const {
  if (want.err) {
    if (got.err == 0) {
      return fmt::format("{}: succeeded, the model says errno {} ({})", want.what, want.err,
                         std::strerror(want.err));
    }
    if (got.err != want.err) {
      return fmt::format("{}: errno {} ({}), the model says {} ({})", want.what, got.err, got.msg,
                         want.err, std::strerror(want.err));
    }
    return std::nullopt;
  }
  if (got.err) return fmt::format("{}: errno {} ({})", op.describe(), got.err, got.msg);
  return std::nullopt;
}

// A change made directly in SRC; a plain file written or removed is then seen once time passed.
std::optional<std::string> Runner::change_src(const Op& op) {
  if (op.kind == Op::SrcLeftover) {
    const std::string p = m_.src_path(op.to_name) + "/.ckptfs";
    stdfs::create_directories(p);
    std::ofstream(p + "/staging") << "left by a killed daemon";
    return std::nullopt;
  }
  const std::string path = m_.src_path(op.dir) + "/" + op.name;
  if (op.kind == Op::SrcDelete) {
    if (::unlink(path.c_str()) != 0) return fmt::format("unlink {} in SRC failed", path);
  } else {
    test::write_file(path, op.bytes);
  }
  d_.pass_time();
  m_.apply(op);
  src_changed_ = true;
  return std::nullopt;
}

std::optional<std::string> Runner::check_effect(const Effect& e) {
  if (e.stored_as) return check_src(e.stored_as->first, e.stored_as->second);
  if (e.shards_gone) {
    const auto& [dname, name] = *e.shards_gone;
    auto mn = format::parse_model_name(name);
    if (stdfs::exists(m_.src_path(dname) + "/" + format::shard_file_name(1, mn->k, mn->m))) {
      return fmt::format("unlink {}/{}: its shards are still in SRC", dname, name);
    }
  }
  return std::nullopt;
}

// What SRC holds for a closed file: rank shards and no real file, or the file whole.
std::optional<std::string> Runner::check_src(const std::string& dname, const std::string& name) {
  const Entry& e = m_.dir(dname).entries.at(name);
  const std::string dp = m_.src_path(dname);
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
  m_.hit("stored as shards (seen in SRC)");
  return std::nullopt;
}

// --- the check after every step -----------------------------------------------------------------

// Reads [0, size + 7) in two reads split at a random offset; asking past the end gets a short
// read.
ReadParts Runner::split(uint64_t size) {
  const uint64_t at = rng_() % (size + 1);
  return {{0, at}, {at, size - at + 7}};
}

std::optional<std::string> Runner::check_file(const std::string& dname, const std::string& name,
                                              const Entry& e) {
  const std::string w = where(dname, name);
  const FileStat st = d_.stat(dname, name);
  if (st.ans.err) return fmt::format("stat {}: errno {} ({})", w, st.ans.err, st.ans.msg);
  if (e.kind == Entry::Directory) {
    if (!st.is_dir) return fmt::format("{}: not a directory", w);
    return std::nullopt;
  }
  if (!st.is_reg) return fmt::format("{}: not a regular file", w);
  const Handle* h = e.kind == Entry::Writing ? &m_.handle(e.handle) : nullptr;
  // The stored version while a writer renamed over it has not closed (see apply_rename).
  const std::string& want = h ? h->buf : e.bytes;
  if (st.size != want.size()) {
    return fmt::format("stat {}: size {}, the model says {}", w, st.size, want.size());
  }
  std::string got;
  if (h) {  // through the writer's own handle
    if (auto a = d_.read_handle(h->id, split(want.size()), got); a.err) {
      return fmt::format("{} (writer's handle): {}", w, a.msg);
    }
    if (got != want) return fmt::format("{} (writer's handle): {}", w, differ(got, want));
    m_.hit("read of a file being written (writer's handle)");
  }
  if (auto a = d_.read_name(dname, name, split(want.size()), got); a.err) {
    return fmt::format("{}: {}", w, a.msg);
  }
  if (got != want) return fmt::format("{}: {}", w, differ(got, want));
  if (h) m_.hit("read of a file being written (open by name)");
  if (e.pending >= 0) m_.hit("read of a stored file a writer renamed over");
  if (e.kind == Entry::File && e.stored) m_.hit("read of a stored file after commit");
  if (e.kind == Entry::File && !e.stored && e.tensors && is_model(name))
    m_.hit("read of a model file stored whole");
  return std::nullopt;
}

std::optional<std::string> Runner::check_hidden(const std::string& dname, const std::string& name,
                                                const Entry& e) {
  const std::string w = where(dname, name);
  const FileStat st = d_.stat(dname, name);
  if (st.ans.err != ENOENT) {
    return fmt::format("stat {} (hidden while being written): {}", w,
                       st.ans.err ? st.ans.msg : "found");
  }
  const Handle& h = m_.handle(e.handle);
  std::string got;
  if (auto a = d_.read_handle(h.id, split(h.buf.size()), got); a.err) {
    return fmt::format("{} (writer's handle): {}", w, a.msg);
  }
  if (got != h.buf) return fmt::format("{} (writer's handle): {}", w, differ(got, h.buf));
  m_.hit("file being written hidden in a checkpoint directory");
  return std::nullopt;
}

std::optional<std::string> Runner::check() {
  for (const auto& dname : m_.dir_names()) {
    const Dir& d = m_.dir(dname);
    // The listing: the model's names, nothing else (semantics.md: shard files, .ckptfs and
    // the commit records are hidden; no index is synthesized in a directory written through
    // the mount; no .ckptfs-pending, since files written through the mount need no settle).
    std::vector<std::string> got, want;
    if (auto a = d_.list(dname, got); a.err) return fmt::format("readdir /{}: {}", dname, a.msg);
    for (const auto& [n, e] : d.entries) {
      if (!Model::hidden(d, n, e)) want.push_back(n);
    }
    std::sort(got.begin(), got.end());
    if (got != want) {
      std::vector<std::string> src;
      for (const auto& e : stdfs::recursive_directory_iterator(m_.src_path(dname))) {
        src.push_back(e.path().string().substr(m_.src_path(dname).size() + 1));
      }
      return fmt::format("readdir /{}: [{}], the model says [{}]; SRC holds [{}]", dname,
                         fmt::join(got, " "), fmt::join(want, " "), fmt::join(src, " "));
    }
    for (const auto& [n, e] : d.entries) {
      auto err = Model::hidden(d, n, e) ? check_hidden(dname, n, e) : check_file(dname, n, e);
      if (err) return err;
    }
    // A name the model does not hold: ENOENT.
    std::vector<std::string> pool = Model::file_names(d);
    if (dname.empty()) pool.insert(pool.end(), kDirNames.begin(), kDirNames.end());
    for (const auto& n : pool) {
      if (d.entries.count(n)) continue;
      const FileStat s = d_.stat(dname, n);
      if (s.ans.err != ENOENT) {
        return fmt::format("stat {}: {}, the model says ENOENT", where(dname, n),
                           s.ans.err ? s.ans.msg : "found");
      }
      break;  // one per directory and step
    }
  }
  if (src_changed_) {
    m_.hit("SRC change observed");
    src_changed_ = false;
  }
  return std::nullopt;
}

}  // namespace ckptfs::fsmodel
