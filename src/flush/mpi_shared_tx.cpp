// flush/mpi_shared_tx: the shared-target transaction (mpi_shared_tx.hpp): the head's shards go
// to the local flusher's staging, the others to their owners over the Link; the commit waits
// for every owner's fsync. OpenMPI builds only.
#include "mpi_shared_tx.hpp"

#include <fmt/format.h>

#include "ckptfs/format/record.hpp"
#include "ckptfs/util/path.hpp"
#include "mpi_link.hpp"

namespace ckptfs::flush::mpi {
namespace {

class MpiTransaction final : public Transaction {
 public:
  MpiTransaction(std::unique_ptr<Transaction> local, Link& link, uint64_t tx,
                 std::vector<int> owners, std::string what, RateLimiter& rate)
      : local_(std::move(local)),
        shards_(link, tx, std::move(owners), std::move(what)),
        rate_(rate) {}
  ~MpiTransaction() override { abort(); }

  // Opens every remote shard on its owner; all or nothing.
  Status open_remote(const std::string& rel) {
    std::vector<std::pair<uint64_t, uint32_t>> ids;
    Status first;
    for (uint32_t i = 0; i < shards_.size(); ++i) {
      if (shards_.mine(i)) continue;
      const std::string path =
          join_rel(join_rel(join_rel(rel, format::kStateDirName), local_->staging_name()),
                   fmt::format("rank-{:05d}", i + 1));
      auto id = shards_.link().start(shards_.owner(i), shards_.command(Op::Open, i), path,
                                     shards_.shard_what(i));
      if (!id) {
        first = std::move(id).error();
        break;
      }
      ids.emplace_back(*id, i);
    }
    CKPTFS_CHECK(shards_.wait_all(ids, "open"));
    return first;
  }

  Status pwrite(uint32_t shard, uint64_t offset, std::string_view bytes) override {
    if (shards_.mine(shard)) {
      rate_.throttle(bytes.size());
      return local_->pwrite(shard, offset, bytes);
    }
    return shards_.write(shard, offset, bytes);
  }

  Status pread(uint32_t shard, uint64_t off, char* dst, size_t n) override {
    // Once every owner acknowledged its fsync (a commit), the staged files in the shared
    // target hold every byte: read them here.
    if (shards_.mine(shard) || synced_) return local_->pread(shard, off, dst, n);
    return shards_.read(shard, off, dst, n);
  }

  Status sync() override {
    if (!synced_) CKPTFS_CHECK(shards_.sync());
    return local_->sync();
  }

  // Every owner fsyncs and acknowledges first: nothing is committed that a rank has not made
  // durable. MPI mode commits durably always (the record and directories too).
  Status commit(const CommitInfo& info, bool /*durable*/) override {
    CKPTFS_CHECK(shards_.sync());
    synced_ = true;
    CKPTFS_CHECK(local_->commit(info, true));
    close_remote();
    return {};
  }

  Status set_owner(uid_t uid, gid_t gid, mode_t mode) override {
    return local_->set_owner(uid, gid, mode);
  }

  void abort() override {
    close_remote();
    local_->abort();
  }

  std::string staging_name() const override { return local_->staging_name(); }

 private:
  void close_remote() {
    if (closed_) return;
    closed_ = true;
    shards_.tell_all(Op::Close);
  }

  std::unique_ptr<Transaction> local_;  // staging, the head's shards, the commit
  OwnedShards shards_;
  RateLimiter& rate_;
  bool synced_ = false;  // every owner acknowledged the fsync of the complete shards
  bool closed_ = false;  // the owners were told to forget the transaction
};

}  // namespace

Result<std::unique_ptr<Transaction>> begin_shared(std::unique_ptr<Transaction> local, Link& link,
                                                  uint64_t tx, std::vector<int> owners,
                                                  std::string what, RateLimiter& rate,
                                                  const std::string& rel) {
  auto t = std::make_unique<MpiTransaction>(std::move(local), link, tx, std::move(owners),
                                            std::move(what), rate);
  CKPTFS_CHECK(t->open_remote(rel));  // on failure the destructor aborts
  return std::unique_ptr<Transaction>(std::move(t));
}

}  // namespace ckptfs::flush::mpi
