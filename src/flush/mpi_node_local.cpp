// flush/mpi_node_local: node-local targets (mpi_node_local.hpp): the node-local transaction,
// the reader of committed shards, dropping a replaced file's shards, and the mount's sweep.
// OpenMPI builds only.
#include "mpi_node_local.hpp"

#include <fcntl.h>
#include <sys/stat.h>

#include <algorithm>
#include <set>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "ckptfs/format/names.hpp"
#include "ckptfs/format/record.hpp"
#include "ckptfs/source/scanner.hpp"
#include "ckptfs/util/path.hpp"
#include "mpi_link.hpp"

namespace ckptfs::flush::mpi {
namespace {

// The directory of a record's shard path (<rel>/.ckptfs/nl-...), and its last component.
std::string tx_dir_of(std::string_view path) { return std::string(split_rel(path).dir); }
std::string base_name(std::string_view path) { return std::string(split_rel(path).name); }

}  // namespace

std::vector<std::pair<int, std::string>> remote_dirs(int dirfd, uint32_t k, uint32_t m,
                                                     const std::string& display) {
  std::vector<std::pair<int, std::string>> out;
  auto entries = source::list_dir(dirfd);
  if (!entries) return out;
  // Trusted records only (source::record_files): one anyone else could write names nothing.
  for (const auto& [rel, st] : source::record_files(dirfd, *entries)) {
    const auto file = format::parse_record_name(rel);
    auto mn = file ? format::parse_model_name(*file) : std::nullopt;
    if (!mn || mn->k != k || mn->m != m) continue;
    auto text = read_small_file_beneath(dirfd, rel, format::kMaxSideFileSize);
    if (!text) continue;
    auto rec = format::parse_record(*text, display + "/" + rel);
    if (!rec || !rec->remote()) continue;
    for (const auto& sh : rec->shards) {
      std::pair<int, std::string> d{sh.owner, tx_dir_of(sh.path)};
      if (std::find(out.begin(), out.end(), d) == out.end()) out.push_back(std::move(d));
    }
  }
  return out;
}

void drop_dirs(Owners& owners, const std::vector<std::pair<int, std::string>>& dirs,
               std::string_view what) {
  for (const auto& [rank, dir] : dirs) {
    Status st;
    if (rank == 0) {
      st = owners.self.drop(dir);
    } else {
      Command c;
      c.op = Op::Drop;
      auto r = owners.link.call(rank, c, dir, fmt::format("{}: removing {}", what, dir));
      if (!r) st = std::move(r).error();
    }
    if (!st) spdlog::warn("{} (left for the next mount's sweep)", st.error().message);
  }
}
namespace {

class NodeLocalTransaction final : public Transaction {
 public:
  NodeLocalTransaction(std::unique_ptr<Transaction> local, Owners& owners, uint64_t tx,
                       std::string txname, std::string rel, UniqueFd dir, std::string display,
                       const layout::ShardSet& set, int nranks, std::string what, RateLimiter& rate)
      : local_(std::move(local)),
        self_(owners.self),
        shards_(owners.link, tx, owners_of(set.shards.size(), nranks), std::move(what)),
        txname_(std::move(txname)),
        rel_(std::move(rel)),
        dir_(std::move(dir)),
        display_(std::move(display)),
        rate_(rate),
        owners_(owners) {
    for (const auto& sh : set.shards) {
      headers_.push_back(sh.header);
      sizes_.push_back(sh.file_size());
    }
  }
  ~NodeLocalTransaction() override { abort(); }

  // Makes every shard on its owner; all or nothing (the destructor removes what was made).
  Status create() {
    std::vector<std::pair<uint64_t, uint32_t>> ids;
    Status first;
    std::string payload = rel_;
    payload.push_back('\0');
    payload += txname_;
    for (uint32_t i = 0; i < shards_.size(); ++i) {
      if (shards_.mine(i)) {
        if (auto st = self_.create(shards_.tx(), txname_, i, rel_, sizes_[i]); !st && first) {
          first = std::move(st).error().context(shards_.shard_what(i));
        }
        continue;
      }
      Command c = shards_.command(Op::Create, i);
      c.offset = sizes_[i];
      auto id = shards_.link().start(shards_.owner(i), c, payload, shards_.shard_what(i));
      if (!id) {
        if (first) first = std::move(id).error();
        break;
      }
      ids.emplace_back(*id, i);
    }
    if (auto st = shards_.wait_all(ids, "create"); !st && first) first = std::move(st).error();
    return first;
  }

  Status pwrite(uint32_t shard, uint64_t offset, std::string_view bytes) override {
    if (shards_.mine(shard)) {
      rate_.throttle(bytes.size());
      return self_.write(shards_.tx(), shard, offset, bytes);
    }
    return shards_.write(shard, offset, bytes);
  }

  Status pread(uint32_t shard, uint64_t off, char* dst, size_t n) override {
    if (shards_.mine(shard)) return self_.read(shards_.tx(), shard, off, dst, n);
    return shards_.read(shard, off, dst, n);
  }

  Status sync() override {
    CKPTFS_CHECK(sync_all());
    return local_->sync();
  }

  // Every owner fsyncs and names its shards; then the record (the commit point) goes into
  // SRC with each shard's owner, path and header; then the replaced version's directories
  // are removed. Nothing is committed that some rank has not made durable.
  Status commit(const CommitInfo& info, bool /*durable*/) override {
    CKPTFS_CHECK(sync_all());
    std::vector<std::string> paths(shards_.size());
    std::vector<std::pair<uint64_t, uint32_t>> ids;
    Status first;
    for (uint32_t i = 0; i < shards_.size(); ++i) {
      const std::string name = format::shard_file_name(i + 1, info.k, info.m);
      if (shards_.mine(i)) {
        auto p = self_.seal(shards_.tx(), i, name);
        if (!p) {
          if (first) first = std::move(p).error().context(shards_.shard_what(i));
        } else {
          paths[i] = std::move(p).value();
        }
        continue;
      }
      auto id = shards_.link().start(shards_.owner(i), shards_.command(Op::Seal, i), name,
                                     shards_.shard_what(i));
      if (!id) {
        if (first) first = std::move(id).error();
        break;
      }
      ids.emplace_back(*id, i);
    }
    if (auto st = shards_.wait_all(ids, "seal", &paths); !st && first) first = std::move(st);
    CKPTFS_CHECK(std::move(first));
    CommitInfo full = info;
    for (uint32_t i = 0; i < shards_.size(); ++i) {
      const std::string name = format::shard_file_name(i + 1, info.k, info.m);
      if (base_name(paths[i]) != name || tx_dir_of(paths[i]).empty()) {
        return make_error(EIO, "{}: {} sealed it as '{}'", shards_.shard_what(i),
                          shards_.link().who(shards_.owner(i)), paths[i]);
      }
      format::RecordShard sh;
      sh.name = name;
      sh.size = sizes_[i];
      sh.owner = shards_.owner(i);
      sh.path = paths[i];
      sh.header = headers_[i];
      full.remote_shards.push_back(std::move(sh));
    }
    auto old = remote_dirs(dir_.get(), info.k, info.m, display_);
    if (auto st = local_->commit(full, true); !st) {
      // A failure after the record's rename (an fsync of the directory, say) leaves the file
      // committed: its shards must stay. Only a record that does not name them lets them go.
      const auto now = remote_dirs(dir_.get(), info.k, info.m, display_);
      committed_ = std::any_of(now.begin(), now.end(),
                               [&](const auto& d) { return base_name(d.second) == txname_; });
      if (committed_) close_all();
      return st;
    }
    committed_ = true;
    close_all();
    std::erase_if(old, [&](const std::pair<int, std::string>& d) {
      return std::any_of(full.remote_shards.begin(), full.remote_shards.end(),
                         [&](const format::RecordShard& s) {
                           return s.owner == d.first && tx_dir_of(s.path) == d.second;
                         });
    });
    drop_dirs(owners_, old, shards_.what());
    return {};
  }

  Status set_owner(uid_t uid, gid_t gid, mode_t mode) override {
    return local_->set_owner(uid, gid, mode);
  }

  void abort() override {
    if (!committed_ && !aborted_) {
      aborted_ = true;
      self_.abort(shards_.tx());
      shards_.tell_all(Op::Abort);
    }
    local_->abort();
  }

  std::string staging_name() const override { return txname_; }

 private:
  Status sync_all() {
    return shards_.sync([&] { return self_.sync(shards_.tx()); });
  }

  void close_all() {
    self_.close(shards_.tx());
    shards_.tell_all(Op::Close);
  }

  std::unique_ptr<Transaction> local_;  // SRC side: lock, placeholder, the record's commit
  ShardStore& self_;                    // the head's own target
  OwnedShards shards_;
  const std::string txname_;  // nl-...: the shards' directory name on every owner
  const std::string rel_;     // the file's directory, relative to SRC
  UniqueFd dir_;              // that directory (the replaced record is read from it)
  const std::string display_;
  std::vector<std::string> headers_;
  std::vector<uint64_t> sizes_;
  RateLimiter& rate_;
  Owners& owners_;
  bool committed_ = false;
  bool aborted_ = false;
};

class NodeLocalReader final : public io::ShardReader {
 public:
  explicit NodeLocalReader(Owners& owners) : owners_(owners) {}
  Status read(int32_t owner, std::string_view path, uint64_t size, uint64_t off, char* dst,
              size_t n) const override {
    if (owner == 0) return owners_.self.read_path(path, size, off, dst, n);
    if (owner >= owners_.link.size()) {
      return make_error(EIO, "{}: owned by rank {}, but this job has {} rank(s)", path, owner,
                        owners_.link.size());
    }
    Command c;
    c.op = Op::ReadPath;
    c.tx = size;
    return owners_.link.read(owner, c, path, off, dst, n, fmt::format("reading {}", path));
  }

 private:
  Owners& owners_;
};

// The names of the node-local directories (nl-...) that some record below SRC names. False
// when that cannot be known for sure (a directory that cannot be listed, too deep, a record
// that names owners but does not parse): then nothing may be swept.
bool referenced_dirs(int dirfd, const std::string& display, int depth,
                     std::set<std::string, std::less<>>& keep) {
  if (depth > source::kMaxSearchDepth) {
    spdlog::warn("mpi: {}: deeper than {} levels; not swept", display, source::kMaxSearchDepth);
    return false;
  }
  auto entries = source::list_dir(dirfd);
  if (!entries) {
    spdlog::warn("mpi: {}: {}", display, entries.error().message);
    return false;
  }
  struct stat self {};
  if (::fstat(dirfd, &self) != 0) return false;
  bool ok = true;
  size_t untrusted = 0;
  const auto records = source::record_files(dirfd, *entries, &untrusted);
  if (untrusted > 0) {
    // Not ours, so never read; but whether they name something cannot be known: keep all.
    spdlog::warn("mpi: {}: {} commit record(s) others may write; not swept", display, untrusted);
    ok = false;
  }
  for (const auto& [rel, st] : records) {
    auto text = read_small_file_beneath(dirfd, rel, format::kMaxSideFileSize);
    if (!text) {
      ok = false;
      continue;
    }
    if (text->find("\"owner\"") == std::string::npos) continue;
    auto rec = format::parse_record(*text, display + "/" + rel);
    if (!rec) {
      spdlog::warn("mpi: {}", rec.error().message);
      ok = false;
      continue;
    }
    for (const auto& sh : rec->shards) keep.insert(base_name(tx_dir_of(sh.path)));
  }
  for (const auto& e : *entries) {
    if (!S_ISDIR(e.st.st_mode) || e.st.st_dev != self.st_dev || e.name == format::kStateDirName) {
      continue;
    }
    auto sub = open_at(dirfd, e.name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW);
    if (!sub) {
      ok = false;
      continue;
    }
    ok = referenced_dirs(sub->get(), display + "/" + e.name, depth + 1, keep) && ok;
  }
  return ok;
}

}  // namespace

Result<std::unique_ptr<Transaction>> begin_node_local(std::unique_ptr<Transaction> local,
                                                      Owners& owners, uint64_t tx,
                                                      std::string txname, std::string rel,
                                                      UniqueFd dir, std::string display,
                                                      const layout::ShardSet& set, int nranks,
                                                      std::string what, RateLimiter& rate) {
  auto t = std::make_unique<NodeLocalTransaction>(
      std::move(local), owners, tx, std::move(txname), std::move(rel), std::move(dir),
      std::move(display), set, nranks, std::move(what), rate);
  CKPTFS_CHECK(t->create());  // on failure the destructor removes what was made
  return std::unique_ptr<Transaction>(std::move(t));
}

std::shared_ptr<const io::ShardReader> make_node_local_reader(Owners& owners) {
  return std::make_shared<NodeLocalReader>(owners);
}

void sweep_node_local(Owners& owners, const std::string& source) {
  std::set<std::string, std::less<>> keep;
  auto root = open_file(source, O_RDONLY | O_DIRECTORY);
  if (!root || !referenced_dirs(root->get(), source, 0, keep)) {
    spdlog::warn(
        "mpi: not sweeping the node-local targets: the records under {} could not "
        "all be read",
        source);
    return;
  }
  std::string payload;
  for (const auto& k : keep) {
    if (!payload.empty()) payload.push_back('\0');
    payload += k;
  }
  for (int r = 0; r < owners.link.size(); ++r) {
    Result<std::string> n = std::string("0");
    if (r == 0) {
      auto m = owners.self.sweep(keep);
      n = m ? Result<std::string>(std::to_string(*m)) : Result<std::string>(m.error());
    } else {
      Command c;
      c.op = Op::Sweep;
      n = owners.link.call(r, c, payload, "sweep");
    }
    if (!n) {
      spdlog::warn("mpi: sweeping rank {}: {}", r, n.error().message);
    } else if (*n != "0") {
      spdlog::info("mpi: rank {} removed {} node-local directories no record names", r, *n);
    }
  }
}

}  // namespace ckptfs::flush::mpi
