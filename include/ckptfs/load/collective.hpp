// Read once, share to all ranks: the collective the loader completes tensors with.
//
// With N ranks (one process per GPU, or threads standing in for them), every rank passes the
// same request list. Requests are dealt to ranks balanced by bytes (largest first, each to
// the rank with the fewest bytes so far; ties to the lowest rank): a deterministic plan
// every rank computes alone. Each rank reads only its own requests; then every request is
// broadcast from its reader into the other ranks' destinations. Storage is read once.
#pragma once

#include <array>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "ckptfs/util/result.hpp"

namespace ckptfs::load {

class Collective {
 public:
  virtual ~Collective() = default;
  [[nodiscard]] virtual unsigned rank() const = 0;
  [[nodiscard]] virtual unsigned size() const = 0;
  // Every rank learns whether every rank is ok (an all-reduce of a flag). Ranks that fail
  // locally still call it, so nobody waits forever in a broadcast.
  virtual Result<bool> all_ok(bool ok) = 0;
  // Every rank learns whether every rank passed the same value (the loader passes a hash of
  // its request list: ranks that disagree on the requests fail instead of exchanging bytes
  // that do not match).
  virtual Result<bool> all_same(uint64_t value) = 0;
  // Calls between begin_group() and end_group() may be batched (ncclGroupStart/End);
  // end_group() returns when every broadcast of the group is complete on this rank.
  virtual Status begin_group() { return {}; }
  virtual Status end_group() { return {}; }
  // Broadcasts `bytes` at `buf` from rank `root` into every other rank's `buf`. Every rank
  // calls it with the same bytes and root, in the same order.
  virtual Status broadcast(void* buf, uint64_t bytes, unsigned root) = 0;
};

// Which rank reads each request: balanced by bytes, deterministic.
std::vector<unsigned> assign_balanced(const std::vector<uint64_t>& bytes, unsigned ranks);

// N ranks as threads of one process (the tests'; host memory). Every member is used by its
// own thread. A barrier that waits more than `timeout_ms` fails (a rank that died).
class ThreadGroup : public std::enable_shared_from_this<ThreadGroup> {
 public:
  static std::shared_ptr<ThreadGroup> create(unsigned ranks, unsigned timeout_ms = 120000);
  // The collective for rank `r` (keeps the group alive).
  std::unique_ptr<Collective> member(unsigned r);

  ThreadGroup(unsigned ranks, unsigned timeout_ms) : ranks_(ranks), timeout_ms_(timeout_ms) {}
  Status barrier();
  [[nodiscard]] unsigned ranks() const { return ranks_; }

  // State of the collective in progress, written before a barrier and read after it.
  std::mutex mu;  // guards root_buf, flags and (with cv_) the barrier's counters
  const void* root_buf = nullptr;
  std::vector<uint8_t> flags;
  std::vector<uint64_t> values;

 private:
  unsigned ranks_;
  unsigned timeout_ms_;
  std::condition_variable cv_;
  unsigned arrived_ = 0;
  uint64_t generation_ = 0;
  bool broken_ = false;  // a barrier timed out: every later one fails at once
};

// NCCL (built when NCCL is found): broadcasts with ncclBroadcast on one stream of the
// caller's device; all_ok with an ncclAllReduce (min) of one int.
using NcclId = std::array<char, 128>;  // ncclUniqueId's bytes
// A new unique id (rank 0 makes it and hands it to the others out of band).
Result<NcclId> nccl_unique_id();
// Joins the communicator of `id` as `rank` of `ranks` on CUDA device `device`.
Result<std::unique_ptr<Collective>> make_nccl_collective(const NcclId& id, unsigned rank,
                                                         unsigned ranks, int device);

}  // namespace ckptfs::load
