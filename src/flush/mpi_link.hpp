// flush/mpi_link (internal to flush/, OpenMPI builds only): the head's transport to the ranks.
// Link sends commands, matches replies and runs the progress thread; OwnedShards is one
// transaction's shards over it (which rank owns which, coalesced writes, sync, close/abort),
// what both kinds of transaction (mpi_shared_tx, mpi_node_local) send to the other owners.
//
// Threads on the head: FUSE workers call Transaction methods (one transaction at a time per
// file, serialized by its WriteFile), and one progress thread (Link::run) completes sends and
// receives replies. Every MPI call of the head is made under Link::mpi_mu_, so the head needs
// only MPI_THREAD_SERIALIZED; all its calls are non-blocking (Isend, Test, Improbe) except the
// Mrecv of a reply already probed, so the lock is never held while waiting on a peer.
// Lock order: Link::mpi_mu_ before Link::mu_ (run() takes mu_ inside mpi_mu_ to deliver a
// reply; nothing takes mpi_mu_ while holding mu_).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "ckptfs/flush/mpi.hpp"
#include "mpi_runtime.hpp"

namespace ckptfs::flush::mpi {

// The head's side of the wire: one per MpiFlusher, over its own communicator.
class Link {
 public:
  Link(Runtime& rt, Comm comm, const MpiOptions& o)
      : rt_(rt), comm_(std::move(comm)), timeout_(o.timeout), budget_(o.inflight_bytes) {
    thread_ = std::thread([this] { run(); });
  }
  ~Link() { stop(); }

  [[nodiscard]] std::string who(int rank) const {
    return fmt::format("rank {} ({})", rank, rt_.host(rank));
  }
  [[nodiscard]] std::chrono::milliseconds timeout() const { return timeout_; }
  [[nodiscard]] int size() const { return rt_.size(); }
  [[nodiscard]] const InflightBudget& budget() const { return budget_; }

  // Sends a command with no reply. `budgeted`: its bytes count against the in-flight bound,
  // and the caller waits (backpressure) while the bound is reached.
  Status post(int dest, const Command& c, std::string_view payload, bool budgeted,
              std::string_view what);

  // Sends a command whose reply is awaited with wait().
  Result<uint64_t> start(int dest, Command c, std::string_view payload, std::string_view what);

  // The reply's payload, or its error (the rank's errno and message, naming the rank and
  // host), or EIO when no reply came within the timeout.
  Result<std::string> wait(uint64_t id, std::chrono::steady_clock::time_point deadline,
                           std::string_view what);

  Result<std::string> call(int dest, const Command& c, std::string_view payload,
                           std::string_view what) {
    CKPTFS_TRY(uint64_t id, start(dest, c, payload, what));
    return wait(id, std::chrono::steady_clock::now() + timeout_, what);
  }

  // A Read or ReadPath (`c` gives the op, the transaction or size, the shard) of n bytes at
  // `off` into dst, in requests of at most 16 MiB.
  Status read(int dest, Command c, std::string_view payload, uint64_t off, char* dst, size_t n,
              std::string_view what);

  // Whether every rank answered and every send completed so far: false once a rank was
  // lost (a timeout), the link broke, or the shutdown left sends that never completed. Then
  // MPI_Comm_free and MPI_Finalize may wait forever for the lost rank (seen with
  // --enable-recovery), so the caller ends the job with MPI_Abort instead.
  [[nodiscard]] bool clean() {
    std::lock_guard lock(mu_);
    return !lost_ && !broken_ && !abandoned_;
  }
  void leak_comm() { comm_.leak(); }

  // Tells every rank to leave serve_rank, waits (bounded) for the sends, stops the thread.
  void shutdown();

 private:
  struct Pending {
    std::string buf;  // the message; MPI reads it until the request completes
    uint64_t budgeted = 0;
    MPI_Request req = MPI_REQUEST_NULL;
  };
  struct Slot {
    int dest = 0;
    bool done = false;
    int err = 0;
    std::string payload;
  };

  std::optional<Error> broken() {
    std::lock_guard lock(mu_);
    return broken_;
  }

  // Fails every waiter and every later request with `e` (the first error wins).
  void break_link(const Error& e);
  // Stops the progress thread (see run) and joins it.
  void stop();
  // Hands a reply received from `source` to its waiter (dropped when it timed out already).
  void deliver(int source, std::string_view msg);

  // The progress thread: completes sends (releasing their budget), receives replies. Leaves
  // once stopped with nothing in flight, or stopped and a timeout later with sends that never
  // complete (a dead rank).
  void run();

  Runtime& rt_;
  Comm comm_;
  const std::chrono::milliseconds timeout_;
  InflightBudget budget_;
  std::atomic<uint64_t> next_id_{0};
  std::atomic<bool> shut_{false};
  // Lock order: mpi_mu_, then mu_, then budget_'s own.
  std::mutex mpi_mu_;  // serializes every MPI call the head makes (see the file comment)
  std::mutex mu_;      // guards incoming_, waiters_, broken_, stop_; never held in MPI calls
  std::condition_variable work_;     // incoming_ or stop_ changed
  std::condition_variable replied_;  // a Slot became done, or broken_ was set
  std::list<std::unique_ptr<Pending>> incoming_;
  std::map<uint64_t, Slot> waiters_;
  std::optional<Error> broken_;
  bool stop_ = false;
  bool abandoned_ = false;         // the shutdown left sends that never completed
  std::atomic<bool> lost_{false};  // some rank did not answer, or took no data, in time
  std::thread thread_;
};

// One transaction's shards and the ranks that own them (shard i on rank owner[i]; rank 0 is
// the head): what both kinds of transaction send to the other owners. Writes to remote shards
// are coalesced (WriteCombiner); a read of one first sends what is buffered for it.
class OwnedShards {
 public:
  OwnedShards(Link& link, uint64_t tx, std::vector<int> owner, std::string what)
      : link_(link),
        tx_(tx),
        owner_(std::move(owner)),
        what_(std::move(what)),
        combiner_(WriteCombiner::limit_for(static_cast<size_t>(
                      std::count_if(owner_.begin(), owner_.end(), [](int o) { return o != 0; }))),
                  [this](uint32_t shard, uint64_t offset, std::string_view bytes) {
                    Command c = command(Op::Write, shard);
                    c.offset = offset;
                    return link_.post(owner_[shard], c, bytes, true, shard_what(shard));
                  }) {}

  [[nodiscard]] Link& link() const { return link_; }
  [[nodiscard]] uint64_t tx() const { return tx_; }
  [[nodiscard]] uint32_t size() const { return static_cast<uint32_t>(owner_.size()); }
  [[nodiscard]] int owner(uint32_t i) const { return owner_[i]; }
  [[nodiscard]] bool mine(uint32_t i) const { return owner_[i] == 0; }
  [[nodiscard]] const std::string& what() const { return what_; }
  [[nodiscard]] std::string shard_what(uint32_t i) const {
    return fmt::format("{}: shard {}", what_, i + 1);
  }
  [[nodiscard]] Command command(Op op, uint32_t shard = 0) const;

  Status write(uint32_t shard, uint64_t offset, std::string_view bytes) {
    return combiner_.add(shard, offset, bytes);
  }
  Status read(uint32_t shard, uint64_t off, char* dst, size_t n) {
    CKPTFS_CHECK(combiner_.flush(shard));  // the owner answers after the writes it got
    return link_.read(owner_[shard], command(Op::Read, shard), {}, off, dst, n,
                      shard_what(shard) + " (read back)");
  }

  // Waits for the replies of requests about shards (`ids`: request id, shard) with one
  // deadline; `step` names them in messages. `replies`, when given, gets each payload at its
  // shard's index. The first error.
  Status wait_all(const std::vector<std::pair<uint64_t, uint32_t>>& ids, std::string_view step,
                  std::vector<std::string>* replies = nullptr);

  // Sends what is buffered, then every remote owner fsyncs its shards of the transaction and
  // acknowledges; `own` (the head's own fsync) runs while they do.
  Status sync(const std::function<Status()>& own = {});

  // Tells every remote owner `op` (Close, Abort) with no reply; buffered writes are dropped.
  void tell_all(Op op);

 private:
  std::vector<int> remote_ranks() const;

  Link& link_;
  const uint64_t tx_;
  const std::vector<int> owner_;
  const std::string what_;
  WriteCombiner combiner_;  // the remote shards' writes, coalesced into messages
};

}  // namespace ckptfs::flush::mpi
