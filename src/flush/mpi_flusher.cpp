// flush/mpi_flusher: the head's Flusher under mpirun (MpiFlusher, make_mpi_flusher): begins a
// shared-target or node-local transaction per file written, removes files, shuts the ranks
// down. OpenMPI builds only.
#include <fcntl.h>

#include <atomic>
#include <chrono>
#include <random>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "ckptfs/flush/mpi.hpp"
#include "ckptfs/flush/store.hpp"
#include "mpi_link.hpp"
#include "mpi_node_local.hpp"
#include "mpi_runtime.hpp"
#include "mpi_shared_tx.hpp"

namespace ckptfs::flush::mpi {
namespace {

class MpiFlusherImpl final : public MpiFlusher {
 public:
  MpiFlusherImpl(Runtime& rt, Comm comm, const MpiOptions& o, std::unique_ptr<ShardStore> self)
      : rt_(rt),
        opts_(o),
        local_(make_local_flusher()),
        rate_(o.target_rate_mb * 1e6),
        link_(std::make_unique<Link>(rt, std::move(comm), o)),
        self_(std::move(self)) {
    if (self_) {
      owners_ = std::make_unique<Owners>(Owners{*link_, *self_});
      reader_ = make_node_local_reader(*owners_);
      std::random_device rd;
      epoch_ = (uint64_t{rd()} << 32) ^ rd() ^
               static_cast<uint64_t>(std::chrono::system_clock::now().time_since_epoch().count());
    }
  }
  ~MpiFlusherImpl() override { shutdown(); }

  bool shutdown() override {
    if (stopped_.exchange(true)) return clean_;
    spdlog::info("mpi: telling {} rank(s) to stop; peak in flight {} MiB", rt_.size() - 1,
                 link_->budget().peak() >> 20);
    link_->shutdown();
    clean_ = link_->clean();
    if (!clean_) link_->leak_comm();
    return clean_;
  }

  uint32_t default_ranks() const override { return static_cast<uint32_t>(rt_.size()); }

  Result<std::unique_ptr<Transaction>> begin(const Target& t, const layout::ShardSet& set,
                                             std::string what) override {
    CKPTFS_TRY(auto rel, relative_to(opts_.source, t.display));
    const uint64_t n = next_tx_.fetch_add(1) + 1;
    if (owners_) {
      // Node-local: SRC gets only the lock (and, at the commit, the record).
      CKPTFS_TRY(auto local, local_->begin(t, layout::ShardSet{}, what));
      int d = ::fcntl(t.dirfd, F_DUPFD_CLOEXEC, 0);
      if (d < 0) return errno_error(fmt::format("{}: dup failed", t.display));
      return begin_node_local(
          std::move(local), *owners_, n, fmt::format("{}{:016x}-{}", kNodeLocalTxPrefix, epoch_, n),
          std::move(rel), UniqueFd(d), t.display, set, rt_.size(), std::move(what), rate_);
    }
    CKPTFS_TRY(auto local, local_->begin(t, set, what));
    return begin_shared(std::move(local), *link_, n, owners_of(set.shards.size(), rt_.size()),
                        std::move(what), rate_, rel);
  }

  // A file the kernel writes is in the head's SRC: its guard is local, as its one shard at
  // close is (a link of the file). The split after close sends it to the owners (begin()).
  bool adopts_files() const override { return local_->adopts_files(); }
  Flusher& in_place() override { return *local_; }
  bool shards_in_place() const override { return !owners_; }
  Result<std::unique_ptr<Transaction>> begin_kernel_write(const Target& t,
                                                          std::string what) override {
    return local_->begin_kernel_write(t, std::move(what));
  }
  bool recover(const Target& t) override { return local_->recover(t); }

  // Node-local: the record goes first (nothing names the shards any more), then the shards.
  Status remove(const Target& t, uint32_t k, uint32_t m) override {
    if (!owners_) return local_->remove(t, k, m);
    auto dirs = remote_dirs(t.dirfd, k, m, t.display);
    CKPTFS_CHECK(local_->remove(t, k, m));
    drop_dirs(*owners_, dirs, t.display);
    return {};
  }

  std::shared_ptr<const io::ShardReader> reader() const override { return reader_; }

  // At mount: removes, on every rank, the node-local directories no record names (writes a
  // crash cut short, replaced files whose removal was cut short).
  void sweep() {
    if (owners_) sweep_node_local(*owners_, opts_.source);
  }

 private:
  Runtime& rt_;
  const MpiOptions opts_;
  std::unique_ptr<Flusher> local_;
  RateLimiter rate_;  // the head's own shard writes, capped like a rank's (benchmark only)
  std::unique_ptr<Link> link_;
  std::unique_ptr<ShardStore> self_;               // node-local: rank 0's own target
  std::unique_ptr<Owners> owners_;                 // node-local only
  std::shared_ptr<const io::ShardReader> reader_;  // node-local only
  uint64_t epoch_ = 0;                             // names this mount's nl- directories
  std::atomic<uint64_t> next_tx_{0};
  std::atomic<bool> stopped_{false};
  bool clean_ = true;  // set by the first shutdown()
};

}  // namespace

Result<std::shared_ptr<MpiFlusher>> make_mpi_flusher(Runtime& rt, const MpiOptions& o) {
  CKPTFS_TRY(Comm comm, Comm::dup());
  std::unique_ptr<ShardStore> self;
  Status head_target;
  if (o.node_local()) {
    auto st = open_target(o, 0);
    if (st) {
      self = std::move(st).value();
    } else {
      head_target = std::move(st).error();
    }
  }
  auto fl = std::make_shared<MpiFlusherImpl>(rt, std::move(comm), o, std::move(self));
  if (!head_target) {
    // Refused before anything is mounted (the head must store its own shards); the ranks are
    // told to stop, so the job ends instead of waiting for them.
    fl->shutdown();
    return std::move(head_target).error();
  }
  fl->sweep();
  return std::shared_ptr<MpiFlusher>(std::move(fl));
}

}  // namespace ckptfs::flush::mpi
