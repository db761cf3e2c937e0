// The OpenMPI flusher: `mpirun -np N ckptfs mount SRC MNT`, one process per node. Rank 0 (the
// head) serves the FUSE mount; its MpiFlusher sends the bytes of every shard it does not own
// to the rank that does, and ranks >= 1 run serve_rank() until the head shuts them down.
//
// Shard i (0-based; file shard-{i+1}) is owned by MPI rank i % N (owner_of). Two modes:
//  - shared target (the default): every rank sees SRC at the same path (Lustre, NFS, one
//    machine). The head makes the staging exactly as the local flusher does
//    (D/.ckptfs/tx-*/rank-0000x, sized, under its flock) and tells each owner which staged file
//    to open; the owner pwrites the bytes it is sent, fsyncs when asked and acknowledges. The
//    head writes the commit record and rolls forward only after every owner acknowledged its
//    fsync.
//  - node-local targets (-o target=PATH): each rank keeps its shards under its own directory
//    (flush/store.hpp); the head's commit record in SRC names each shard's owner and path.
// See docs/architecture.md ("Parallel flush").
//
// The first part of this header is pure: always compiled, unit-tested without MPI. Its units:
// src/flush/mpi_wire.cpp (wire format), mpi_flow.cpp (backpressure, write combining, rate
// limiting), mpi_target.cpp (target paths), mpi_dispatch.cpp (what a rank does with a
// command). The second part exists only in a build with OpenMPI (CKPTFS_HAVE_MPI); no MPI type
// appears in it. Its units: mpi_runtime, mpi_link, mpi_shared_tx, mpi_node_local, mpi_flusher,
// mpi_rank (src/flush/).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ckptfs/flush/flusher.hpp"
#include "ckptfs/flush/store.hpp"
#include "ckptfs/util/result.hpp"

namespace ckptfs::flush::mpi {

// --- ownership -------------------------------------------------------------------------------

// The rank that owns shard `shard` (0-based) in a job of `nranks` ranks (>= 1): shard i on rank
// i % N, in both modes. Rank 0 is the head.
inline int owner_of(size_t shard, int nranks) {
  return static_cast<int>(shard % static_cast<size_t>(nranks));
}
// owner_of for each of `shards` shards.
inline std::vector<int> owners_of(size_t shards, int nranks) {
  std::vector<int> o(shards);
  for (size_t i = 0; i < shards; ++i) o[i] = owner_of(i, nranks);
  return o;
}

// --- wire format (mpi_wire.cpp) -----------------------------------------------------------
// Head -> rank: a Command (fixed 48-byte little-endian header) followed by its payload, in one
// MPI message on kTagCommand. Rank -> head: a Reply (fixed 24 bytes) followed by its payload,
// on kTagReply. Messages from the head to one rank arrive in the order they were posted (MPI's
// non-overtaking rule: one sender, one receiver, one communicator, one receive pattern).

inline constexpr int kTagCommand = 17;
inline constexpr int kTagReply = 18;
inline constexpr uint32_t kMagic = 0x434b4d31;  // "CKM1"

enum class Op : uint8_t {
  Open = 1,      // payload: path of the staged shard file, relative to the rank's target root
  Write = 2,     // payload: the bytes to pwrite at `offset` (no reply)
  Sync = 3,      // fsync every shard of `tx` this rank holds, then reply (the error latched)
  Read = 4,      // reply with `length` bytes of shard `shard` at `offset`
  Close = 5,     // forget `tx` (after its commit or abort; no reply)
  Shutdown = 6,  // leave serve_rank (no reply)
  // Node-local targets (-o target=; flush/store.hpp):
  Create = 7,  // payload: rel '\0' txname; make shard `shard` of `offset` bytes; reply
  Seal = 8,    // payload: the shard's final name; reply: its path below the target
  Abort = 9,   // forget `tx` and remove what it created (nothing committed; reply)
  // Read `length` bytes at `offset` of the committed shard whose path is the payload, and
  // whose size must be `tx` (the field carries the size here); reply with the bytes.
  ReadPath = 10,
  Drop = 11,   // payload: a replaced file's <rel>/.ckptfs/nl-... directory to remove; reply
  Sweep = 12,  // payload: names of nl- directories records name, '\0'-separated; reply: count
};
// Read and ReadPath: `length` is the bytes wanted, not the payload's size.
bool reads_bytes(Op op);
inline constexpr uint64_t kMaxPathBytes = 4096;

struct Command {
  Op op = Op::Shutdown;
  uint64_t id = 0;  // request id echoed by the reply; 0: no reply wanted
  uint64_t tx = 0;  // the head's transaction number
  uint32_t shard = 0;
  uint64_t offset = 0;
  uint64_t length = 0;  // Read: bytes wanted; otherwise the payload's size
};
inline constexpr size_t kCommandBytes = 48;

struct Reply {
  uint64_t id = 0;
  int32_t err = 0;  // 0 or an errno; the payload is then the message
};
inline constexpr size_t kReplyBytes = 24;

// The header and then the payload, in one buffer (what MPI sends).
std::string encode_command(const Command& c, std::string_view payload);
std::string encode_reply(const Reply& r, std::string_view payload);
// Checks the magic, the op and that the payload size agrees; the payload views `buf`.
Result<Command> decode_command(std::string_view buf, std::string_view* payload);
Result<Reply> decode_reply(std::string_view buf, std::string_view* payload);

// --- backpressure (mpi_flow.cpp) ------------------------------------------------------------

// The bytes of sends posted but not completed, bounded: a writer that would go over waits for
// completions. A message larger than the whole budget waits for an empty pool, then goes.
class InflightBudget {
 public:
  explicit InflightBudget(uint64_t capacity) : capacity_(capacity) {}
  // True once `n` bytes are accounted; false after `timeout` or once failed.
  bool acquire(uint64_t n, std::chrono::milliseconds timeout);
  void release(uint64_t n);
  // Wakes every waiter and makes acquire() fail from now on (the link is broken).
  void fail();
  [[nodiscard]] uint64_t in_flight() const;
  [[nodiscard]] uint64_t peak() const;
  [[nodiscard]] uint64_t capacity() const { return capacity_; }

 private:
  const uint64_t capacity_;
  mutable std::mutex mu_;  // guards used_, peak_, failed_
  std::condition_variable cv_;
  uint64_t used_ = 0;
  uint64_t peak_ = 0;
  bool failed_ = false;
};

// --- write combining (mpi_flow.cpp) ---------------------------------------------------------

// Coalesces the shard writes of one transaction that continue where the previous write to the
// same shard ended into messages of up to `limit` bytes. A column split sends one run per row
// (an 8192-wide bf16 row over 20 ranks: 820 bytes), and each shard's rows are consecutive in
// its file, so its runs merge into few large messages. A write that does not continue its
// shard's buffer, or that is `limit` bytes or more, sends the buffer first. Not thread-safe:
// a transaction's calls are serialized by its WriteFile.
class WriteCombiner {
 public:
  using Send = std::function<Status(uint32_t shard, uint64_t offset, std::string_view bytes)>;
  WriteCombiner(size_t limit, Send send) : limit_(limit), send_(std::move(send)) {}
  // The limit for a transaction with `shards` remote shards: 1 MiB, less when that many
  // buffers would hold over 64 MiB (at least 64 KiB).
  static size_t limit_for(size_t shards);

  Status add(uint32_t shard, uint64_t offset, std::string_view bytes);
  // Sends what is buffered for `shard` (before a read of it) or for every shard (before a
  // sync or commit). The first error is returned; the buffers are emptied either way.
  Status flush(uint32_t shard);
  Status flush_all();
  // Forgets what is buffered (an abort).
  void drop() { bufs_.clear(); }
  [[nodiscard]] uint64_t buffered() const;
  [[nodiscard]] uint64_t sends() const { return sends_; }

 private:
  struct Buf {
    uint64_t offset = 0;
    std::string bytes;
  };
  Status send(uint32_t shard, uint64_t offset, std::string_view bytes);

  const size_t limit_;
  Send send_;
  std::map<uint32_t, Buf> bufs_;
  uint64_t sends_ = 0;
};

// --- targets (mpi_target.cpp) ---------------------------------------------------------------

// `pattern` with %r replaced by the rank and %% by '%'; any other '%' is an error.
Result<std::string> expand_target(std::string_view pattern, int rank);

// The path of directory `display` relative to the mount's source `source` ("" for the source
// itself); every component must be a plain name (no "..", no "."): EINVAL otherwise.
Result<std::string> relative_to(std::string_view source, std::string_view display);

// --- rate limiting, the benchmark's capped targets (mpi_flow.cpp) ---------------------------

// A token bucket at `bytes_per_s` (0: unlimited) with one burst of `burst` bytes: take(n)
// returns how long the caller must sleep before its n bytes are within the rate.
class RateLimiter {
 public:
  using Clock = std::chrono::steady_clock;
  explicit RateLimiter(double bytes_per_s, uint64_t burst = 1 << 20)
      : rate_(bytes_per_s), burst_(burst) {}
  std::chrono::nanoseconds take(uint64_t n, Clock::time_point now);
  // take() with the current time, and the sleep.
  void throttle(uint64_t n);
  [[nodiscard]] bool limited() const { return rate_ > 0; }

 private:
  const double rate_;
  const uint64_t burst_;
  std::mutex mu_;                          // guards next_
  std::optional<Clock::time_point> next_;  // when the bytes taken so far are all paid
};

// --- options ---------------------------------------------------------------------------------

struct MpiOptions {
  std::string source;  // SRC, as the head sees it
  // -o target=PATH (%r: the rank): node-local targets, each rank's shards under its own
  // expansion of PATH. Empty: shared mode.
  std::string target;
  std::string rank_src;  // -o rank_src=PATH (%r): shared mode, SRC as rank r sees it
  [[nodiscard]] bool node_local() const { return !target.empty(); }
  std::chrono::milliseconds timeout{60'000};      // -o mpi_timeout: longest wait for an ack
  uint64_t inflight_bytes = uint64_t{256} << 20;  // -o mpi_inflight_mb: the send budget
  double target_rate_mb = 0;  // hidden -o target_rate_mb: cap each rank's writes (benchmark)
  // Hidden -o mpi_fault=R:MB (tests): rank R's shard writes fail with ENOSPC once it has
  // written MB MiB, as a rank whose storage filled up.
  int fault_rank = -1;
  uint64_t fault_after_bytes = 0;
};

// The directory rank `rank` keeps its shards under: node-local mode, its expansion of
// -o target=; shared mode, its expansion of -o rank_src=, or SRC.
Result<std::string> target_root(const MpiOptions& o, int rank);
// That directory's ShardStore; node-local targets are made (like mkdir -p) when missing, and
// claimed for SRC (claim_target).
Result<std::unique_ptr<ShardStore>> open_target(const MpiOptions& o, int rank);

// A node-local target belongs to one source: the first mount writes `source` into
// <root>/.ckptfs-owner, a mount of another source is refused (EEXIST, naming both). Each mount
// sweeps what its own records do not name, so two sources sharing a target would remove each
// other's shards.
inline constexpr std::string_view kTargetOwnerFile = ".ckptfs-owner";
Status claim_target(const std::string& root, const std::string& source);

// The largest Read or ReadPath a rank answers.
inline constexpr uint64_t kMaxReadBytes = uint64_t{64} << 20;

// --- a rank's commands (mpi_dispatch.cpp) ---------------------------------------------------

// A rank's answer to one command: the Reply (its id echoed, 0 or an errno) and its payload (the
// bytes read, a sealed path, a count, or the error's message).
struct Answer {
  Reply reply;
  std::string payload;
};

// What a rank does with one decoded command on its ShardStore: the whole of the rank server
// but the receiving and the sending (mpi_rank.cpp only receives, calls this and sends the
// answer back). Pure, no MPI. Never throws and never crashes on what the head sends: a
// malformed payload (a Create with no transaction name, an unsafe path, a read over
// kMaxReadBytes) or an unknown op is an error answer (EPROTO or EINVAL, with a message).
// std::nullopt: no reply goes back (Write, Close, Shutdown, and any command whose id is 0);
// a Write's error is latched in the store and reported at the next Sync.
std::optional<Answer> dispatch(ShardStore& store, const Command& c, std::string_view payload);
// The same for a rank whose target could not be opened: every command that takes a reply gets
// `why`, so the head's writers see it (and the Shutdown at unmount still arrives).
std::optional<Answer> refuse(const Command& c, const Error& why);

#if CKPTFS_HAVE_MPI

// MPI_Init_thread (asking for MPI_THREAD_MULTIPLE) in the constructor, MPI_Finalize in the
// destructor: one per process, owned by `ckptfs mount`. Also knows every rank's host name.
class Runtime {
 public:
  static Result<std::unique_ptr<Runtime>> init();
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  [[nodiscard]] int rank() const;
  [[nodiscard]] int size() const;
  [[nodiscard]] const std::string& host(int rank) const;
  // The thread level MPI provided; below MPI_THREAD_MULTIPLE every MPI call of the head is
  // serialized behind one mutex anyway (see mpi_link.hpp), so any level from SERIALIZED works.
  [[nodiscard]] std::string_view thread_level() const;
  // The destructor ends the job with MPI_Abort(code) instead of MPI_Finalize, which may wait
  // forever for a rank that was lost (OpenMPI 4.1 with --enable-recovery).
  void abort_at_exit(int code);

  struct Impl;
  Impl& impl() { return *impl_; }

 private:
  Runtime() = default;
  std::unique_ptr<Impl> impl_;
};

// The head's flusher. shutdown() (also run by the destructor) tells every rank to leave
// serve_rank; call it after the mount ended. It returns false when some rank was lost on the
// way (did not answer in time, or its sends never completed): the job cannot finalize.
class MpiFlusher : public Flusher {
 public:
  virtual bool shutdown() = 0;
};
Result<std::shared_ptr<MpiFlusher>> make_mpi_flusher(Runtime& rt, const MpiOptions& o);

// The loop of ranks >= 1: serves the head's commands until it says Shutdown. Returns the
// process's exit status.
int serve_rank(Runtime& rt, const MpiOptions& o);

#endif  // CKPTFS_HAVE_MPI

}  // namespace ckptfs::flush::mpi
