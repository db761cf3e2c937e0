// The OpenMPI flusher (include/ckptfs/flush/mpi.hpp): the head's MpiFlusher and Link, and the
// serve loop of ranks >= 1. Built only with OpenMPI (meson feature 'mpi').
//
// Threads on the head: FUSE workers call Transaction methods (one transaction at a time per
// file, serialized by its WriteFile), and one progress thread (Link::run) completes sends and
// receives replies. Every MPI call of the head is made under Link::mpi_mu_, so the head needs
// only MPI_THREAD_SERIALIZED; all its calls are non-blocking (Isend, Test, Improbe) except the
// Mrecv of a reply already probed, so the lock is never held while waiting on a peer.
#include <fcntl.h>
#include <mpi.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <list>
#include <map>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "ckptfs/flush/mpi.hpp"
#include "ckptfs/flush/store.hpp"
#include "ckptfs/format/names.hpp"
#include "ckptfs/format/record.hpp"
#include "ckptfs/source/scanner.hpp"
#include "ckptfs/util/fd.hpp"
#include "ckptfs/util/path.hpp"

namespace ckptfs::flush::mpi {

struct Runtime::Impl {
  int rank = 0;
  int size = 1;
  int provided = 0;
  int abort_code = 0;  // nonzero: the destructor calls MPI_Abort with it, not MPI_Finalize
  std::vector<std::string> hosts;
};

namespace {

std::string mpi_error_string(int rc) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, buf, &len) != MPI_SUCCESS) return fmt::format("MPI error {}", rc);
  return std::string(buf, static_cast<size_t>(len));
}

Error mpi_error(int rc, std::string_view what) {
  return make_error(EIO, "{}: {}", what, mpi_error_string(rc));
}

// Sleeps a little longer each time nothing happened (up to `cap`), not at all after progress:
// polling MPI without burning a core that the writers need (the CI machine has two).
// Right after progress the next message usually follows within microseconds (a reader's next
// request, the reply it waits for): the first idle rounds only yield the core.
class Backoff {
 public:
  explicit Backoff(std::chrono::microseconds cap) : cap_(cap) {}
  void progressed() {
    wait_ = std::chrono::microseconds(0);
    spins_ = 0;
  }
  // `cap`: a shorter ceiling for now (someone is waiting for a reply).
  void idle(std::optional<std::chrono::microseconds> cap = std::nullopt) {
    if (spins_ < kSpins) {
      ++spins_;
      std::this_thread::yield();
      return;
    }
    if (wait_.count() > 0) std::this_thread::sleep_for(wait_);
    wait_ = std::min(cap.value_or(cap_), wait_ * 2 + std::chrono::microseconds(5));
  }

 private:
  static constexpr int kSpins = 64;
  std::chrono::microseconds cap_;
  std::chrono::microseconds wait_{0};
  int spins_ = 0;
};

// A duplicate of MPI_COMM_WORLD that reports errors instead of aborting (MPI_ERRORS_RETURN).
// Creating and freeing it are collective: the head (in make_mpi_flusher) and every rank (in
// serve_rank) make exactly one, in the same order after Runtime::init.
class Comm {
 public:
  static Result<Comm> dup() {
    Comm c;
    if (int rc = MPI_Comm_dup(MPI_COMM_WORLD, &c.comm_); rc != MPI_SUCCESS) {
      return mpi_error(rc, "MPI_Comm_dup");
    }
    MPI_Comm_set_errhandler(c.comm_, MPI_ERRORS_RETURN);
    return c;
  }
  Comm() = default;
  Comm(Comm&& o) noexcept : comm_(std::exchange(o.comm_, MPI_COMM_NULL)) {}
  Comm& operator=(Comm&&) = delete;
  Comm(const Comm&) = delete;
  ~Comm() {
    if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  }
  [[nodiscard]] MPI_Comm get() const { return comm_; }
  // Forgets the communicator without freeing it: after a rank was lost, a free may wait on it.
  void leak() { comm_ = MPI_COMM_NULL; }

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
};

// --- the head's side of the wire -------------------------------------------------------------

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
              std::string_view what) {
    auto p = std::make_unique<Pending>();
    p->buf = encode_command(c, payload);
    if (budgeted) {
      if (!budget_.acquire(p->buf.size(), timeout_)) {
        if (auto e = broken()) return std::move(*e).context(what);
        lost_ = true;
        return make_error(EIO, "{}: {} took no data for {} s ({} MiB in flight, the bound)", what,
                          who(dest), timeout_.count() / 1000.0, budget_.in_flight() >> 20);
      }
      p->budgeted = p->buf.size();
    }
    if (auto e = broken()) {
      budget_.release(p->budgeted);
      return std::move(*e).context(what);
    }
    int rc;
    {
      std::lock_guard m(mpi_mu_);
      rc = MPI_Isend(p->buf.data(), static_cast<int>(p->buf.size()), MPI_BYTE, dest, kTagCommand,
                     comm_.get(), &p->req);
    }
    if (rc != MPI_SUCCESS) {
      budget_.release(p->budgeted);
      auto e = mpi_error(rc, fmt::format("{}: send to {}", what, who(dest)));
      break_link(e);
      return e;
    }
    {
      std::lock_guard lock(mu_);
      incoming_.push_back(std::move(p));
    }
    work_.notify_one();
    return {};
  }

  // Sends a command whose reply is awaited with wait().
  Result<uint64_t> start(int dest, Command c, std::string_view payload, std::string_view what) {
    c.id = next_id_.fetch_add(1) + 1;
    {
      std::lock_guard lock(mu_);
      waiters_[c.id].dest = dest;
    }
    if (auto st = post(dest, c, payload, false, what); !st) {
      std::lock_guard lock(mu_);
      waiters_.erase(c.id);
      return std::move(st).error();
    }
    return c.id;
  }

  // The reply's payload, or its error (the rank's errno and message, naming the rank and
  // host), or EIO when no reply came within the timeout.
  Result<std::string> wait(uint64_t id, std::chrono::steady_clock::time_point deadline,
                           std::string_view what) {
    std::unique_lock lock(mu_);
    auto it = waiters_.find(id);
    if (it == waiters_.end()) return make_error(EIO, "{}: no such request", what);
    replied_.wait_until(lock, deadline, [&] { return it->second.done || broken_.has_value(); });
    Slot s = std::move(it->second);
    waiters_.erase(it);
    if (!s.done) {
      if (broken_) return Error(*broken_).context(what);
      lost_ = true;
      return make_error(EIO, "{}: {} did not answer within {} s (-o mpi_timeout)", what,
                        who(s.dest), timeout_.count() / 1000.0);
    }
    if (s.err != 0) return make_error(s.err, "{}: {}: {}", what, who(s.dest), s.payload);
    return std::move(s.payload);
  }

  Result<std::string> call(int dest, const Command& c, std::string_view payload,
                           std::string_view what) {
    CKPTFS_TRY(uint64_t id, start(dest, c, payload, what));
    return wait(id, std::chrono::steady_clock::now() + timeout_, what);
  }

  // A Read or ReadPath (`c` gives the op, the transaction or size, the shard) of n bytes at
  // `off` into dst, in requests of at most 16 MiB.
  Status read(int dest, Command c, std::string_view payload, uint64_t off, char* dst, size_t n,
              std::string_view what) {
    constexpr size_t kPiece = 16 << 20;
    for (size_t done = 0; done < n;) {
      const size_t len = std::min(kPiece, n - done);
      c.offset = off + done;
      c.length = len;
      CKPTFS_TRY(std::string got, call(dest, c, payload, what));
      if (got.size() != len) {
        return make_error(EIO, "{}: {} sent {} bytes, not {}", what, who(dest), got.size(), len);
      }
      std::memcpy(dst + done, got.data(), len);
      done += len;
    }
    return {};
  }

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
  void shutdown() {
    if (shut_.exchange(true)) return;
    for (int r = 1; r < rt_.size(); ++r) {
      Command c;
      c.op = Op::Shutdown;
      if (auto st = post(r, c, {}, false, "shutdown"); !st) {
        spdlog::warn("{}", st.error().message);
      }
    }
    stop();
  }

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

  void break_link(const Error& e) {
    {
      std::lock_guard lock(mu_);
      if (!broken_) {
        spdlog::error("mpi: {}; every later flush fails", e.message);
        broken_ = e;
      }
    }
    budget_.fail();
    replied_.notify_all();
  }

  void stop() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    work_.notify_one();
    if (thread_.joinable()) thread_.join();
  }

  void deliver(int source, std::string_view msg) {
    std::string_view payload;
    auto r = decode_reply(msg, &payload);
    if (!r) {
      spdlog::error("mpi: from {}: {}", who(source), r.error().message);
      return;
    }
    {
      std::lock_guard lock(mu_);
      auto it = waiters_.find(r->id);
      if (it == waiters_.end() || it->second.dest != source) return;  // timed out already
      it->second.done = true;
      it->second.err = r->err;
      it->second.payload.assign(payload);
    }
    replied_.notify_all();
  }

  // The progress thread: completes sends (releasing their budget), receives replies. Leaves
  // once stopped with nothing in flight, or stopped and a timeout later with sends that never
  // complete (a dead rank).
  void run() {
    std::list<std::unique_ptr<Pending>> active;
    std::string buf;
    Backoff backoff(std::chrono::microseconds(500));
    std::optional<std::chrono::steady_clock::time_point> stop_deadline;
    for (;;) {
      {
        std::unique_lock lock(mu_);
        active.splice(active.end(), incoming_);
        if (stop_ && !stop_deadline) stop_deadline = std::chrono::steady_clock::now() + timeout_;
        if (active.empty() && waiters_.empty()) {
          if (stop_) break;
          work_.wait_for(lock, std::chrono::milliseconds(200));
          continue;
        }
        if (stop_deadline && std::chrono::steady_clock::now() > *stop_deadline) {
          spdlog::warn("mpi: {} send(s) never completed; leaving them", active.size());
          for (auto& p : active) p.release();  // MPI may still read the buffer: never free it
          abandoned_ = true;
          break;
        }
      }
      bool progressed = false;
      std::unique_lock m(mpi_mu_);
      for (auto it = active.begin(); it != active.end();) {
        int flag = 0;
        if (int rc = MPI_Test(&(*it)->req, &flag, MPI_STATUS_IGNORE); rc != MPI_SUCCESS) {
          break_link(mpi_error(rc, "MPI_Test"));
          flag = 1;
        }
        if (!flag) {
          ++it;
          continue;
        }
        budget_.release((*it)->budgeted);
        it = active.erase(it);
        progressed = true;
      }
      for (int i = 0; i < 64; ++i) {
        int flag = 0;
        MPI_Message msg;
        MPI_Status st;
        if (int rc = MPI_Improbe(MPI_ANY_SOURCE, kTagReply, comm_.get(), &flag, &msg, &st);
            rc != MPI_SUCCESS) {
          break_link(mpi_error(rc, "MPI_Improbe"));
          break;
        }
        if (!flag) break;
        int n = 0;
        MPI_Get_count(&st, MPI_BYTE, &n);
        buf.resize(static_cast<size_t>(n));
        if (int rc = MPI_Mrecv(buf.data(), n, MPI_BYTE, &msg, MPI_STATUS_IGNORE);
            rc != MPI_SUCCESS) {
          break_link(mpi_error(rc, "MPI_Mrecv"));
          break;
        }
        deliver(st.MPI_SOURCE, buf);
        progressed = true;
      }
      m.unlock();  // never sleep holding the MPI lock: writers post sends meanwhile
      if (progressed) {
        backoff.progressed();
      } else {
        bool awaited = false;
        {
          std::lock_guard lock(mu_);
          awaited = !waiters_.empty();
        }
        // A caller blocked on a reply (a read back, an acknowledgement) gets it within 50 us
        // of its arrival; an idle link sleeps up to 0.5 ms between polls.
        backoff.idle(awaited ? std::optional(std::chrono::microseconds(50)) : std::nullopt);
      }
    }
  }

  Runtime& rt_;
  Comm comm_;
  const std::chrono::milliseconds timeout_;
  InflightBudget budget_;
  std::atomic<uint64_t> next_id_{0};
  std::atomic<bool> shut_{false};
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

// --- the head's transaction ------------------------------------------------------------------

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
  [[nodiscard]] Command command(Op op, uint32_t shard = 0) const {
    Command c;
    c.op = op;
    c.tx = tx_;
    c.shard = shard;
    return c;
  }

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
                  std::vector<std::string>* replies = nullptr) {
    const auto deadline = std::chrono::steady_clock::now() + link_.timeout();
    Status first;
    for (const auto& [id, shard] : ids) {
      auto r = link_.wait(id, deadline, fmt::format("{} ({})", shard_what(shard), step));
      if (!r) {
        if (first) first = std::move(r).error();
      } else if (replies) {
        (*replies)[shard] = std::move(r).value();
      }
    }
    return first;
  }

  // Sends what is buffered, then every remote owner fsyncs its shards of the transaction and
  // acknowledges; `own` (the head's own fsync) runs while they do.
  Status sync(const std::function<Status()>& own = {}) {
    CKPTFS_CHECK(combiner_.flush_all());
    std::vector<std::pair<uint64_t, uint32_t>> ids;
    for (int r : remote_ranks()) {
      const auto shard =
          static_cast<uint32_t>(std::find(owner_.begin(), owner_.end(), r) - owner_.begin());
      CKPTFS_TRY(uint64_t id, link_.start(r, command(Op::Sync), {}, shard_what(shard)));
      ids.emplace_back(id, shard);
    }
    Status mine = own ? own() : Status{};
    CKPTFS_CHECK(wait_all(ids, "sync"));
    return mine;
  }

  // Tells every remote owner `op` (Close, Abort) with no reply; buffered writes are dropped.
  void tell_all(Op op) {
    combiner_.drop();
    for (int r : remote_ranks()) {
      if (auto st = link_.post(r, command(op), {}, false, what_); !st) {
        spdlog::debug("{}", st.error().message);
      }
    }
  }

 private:
  std::vector<int> remote_ranks() const {
    std::vector<int> r;
    for (int o : owner_) {
      if (o != 0 && std::find(r.begin(), r.end(), o) == r.end()) r.push_back(o);
    }
    return r;
  }

  Link& link_;
  const uint64_t tx_;
  const std::vector<int> owner_;
  const std::string what_;
  WriteCombiner combiner_;  // the remote shards' writes, coalesced into messages
};

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

// --- node-local targets (-o target=) ----------------------------------------------------------

// Where a shard lives: rank 0's own ShardStore, or another rank's over the Link.
struct Owners {
  Link& link;
  ShardStore& self;
};

// The directory of a record's shard path (<rel>/.ckptfs/nl-...), and its last component.
std::string tx_dir_of(std::string_view path) {
  const size_t slash = path.rfind('/');
  return std::string(slash == std::string_view::npos ? std::string_view() : path.substr(0, slash));
}
std::string base_name(std::string_view path) {
  const size_t slash = path.rfind('/');
  return std::string(slash == std::string_view::npos ? path : path.substr(slash + 1));
}

// The node-local directories of the record of file k of m in `dirfd`'s .ckptfs, if it is a
// version 2 record: (owner, directory) pairs, each once.
std::vector<std::pair<int, std::string>> remote_dirs(int dirfd, uint32_t k, uint32_t m,
                                                     const std::string& display) {
  std::vector<std::pair<int, std::string>> out;
  auto entries = source::list_dir(dirfd);
  if (!entries) return out;
  // Trusted records only (source::record_files): one anyone else could write names nothing.
  for (const auto& [rel, st] : source::record_files(dirfd, *entries)) {
    const size_t base = format::kStateDirName.size() + 1;
    auto mn = format::parse_model_name(
        std::string_view(rel).substr(base, rel.size() - base - format::kRecordSuffix.size()));
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

// Removes node-local directories of a replaced or removed file. Best effort: what is left is
// garbage no record names, which the next mount's sweep removes; the commit stands either way.
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

class NodeLocalTransaction final : public Transaction {
 public:
  NodeLocalTransaction(std::unique_ptr<Transaction> local, Owners& owners, uint64_t tx,
                       std::string txname, std::string rel, UniqueFd dir, std::string display,
                       const write::ShardSet& set, int nranks, std::string what, RateLimiter& rate)
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
  // Shard i on rank i % nranks.
  static std::vector<int> owners_of(size_t shards, int nranks) {
    std::vector<int> o(shards);
    for (size_t i = 0; i < shards; ++i) o[i] = static_cast<int>(i % static_cast<size_t>(nranks));
    return o;
  }

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

// Committed node-local shards, read for the view: rank 0's from its own store, the others'
// with ReadPath requests.
class NodeLocalReader final : public ShardReader {
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
      reader_ = std::make_shared<NodeLocalReader>(*owners_);
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

  Result<std::unique_ptr<Transaction>> begin(const Target& t, const write::ShardSet& set,
                                             std::string what) override {
    CKPTFS_TRY(auto rel, relative_to(opts_.source, t.display));
    const uint64_t n = next_tx_.fetch_add(1) + 1;
    if (owners_) {
      // Node-local: SRC gets only the lock (and, at the commit, the record).
      CKPTFS_TRY(auto local, local_->begin(t, write::ShardSet{}, what));
      int d = ::fcntl(t.dirfd, F_DUPFD_CLOEXEC, 0);
      if (d < 0) return errno_error(fmt::format("{}: dup failed", t.display));
      auto tx = std::make_unique<NodeLocalTransaction>(
          std::move(local), *owners_, n, fmt::format("{}{:016x}-{}", kNodeLocalTxPrefix, epoch_, n),
          std::move(rel), UniqueFd(d), t.display, set, rt_.size(), std::move(what), rate_);
      CKPTFS_CHECK(tx->create());  // on failure the destructor removes what was made
      return std::unique_ptr<Transaction>(std::move(tx));
    }
    CKPTFS_TRY(auto local, local_->begin(t, set, what));
    std::vector<int> owners(set.shards.size());
    for (size_t i = 0; i < owners.size(); ++i) owners[i] = static_cast<int>(i % rt_.size());
    auto tx = std::make_unique<MpiTransaction>(std::move(local), *link_, n, std::move(owners),
                                               std::move(what), rate_);
    CKPTFS_CHECK(tx->open_remote(rel));  // on failure the destructor aborts
    return std::unique_ptr<Transaction>(std::move(tx));
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

  std::shared_ptr<const ShardReader> reader() const override { return reader_; }

  // At mount: removes, on every rank, the node-local directories no record names (writes a
  // crash cut short, replaced files whose removal was cut short).
  void sweep() {
    if (!owners_) return;
    std::set<std::string, std::less<>> keep;
    auto root = open_file(opts_.source, O_RDONLY | O_DIRECTORY);
    if (!root || !referenced_dirs(root->get(), opts_.source, 0, keep)) {
      spdlog::warn(
          "mpi: not sweeping the node-local targets: the records under {} could not "
          "all be read",
          opts_.source);
      return;
    }
    std::string payload;
    for (const auto& k : keep) {
      if (!payload.empty()) payload.push_back('\0');
      payload += k;
    }
    for (int r = 0; r < rt_.size(); ++r) {
      Result<std::string> n = std::string("0");
      if (r == 0) {
        auto m = self_->sweep(keep);
        n = m ? Result<std::string>(std::to_string(*m)) : Result<std::string>(m.error());
      } else {
        Command c;
        c.op = Op::Sweep;
        n = link_->call(r, c, payload, "sweep");
      }
      if (!n) {
        spdlog::warn("mpi: sweeping rank {}: {}", r, n.error().message);
      } else if (*n != "0") {
        spdlog::info("mpi: rank {} removed {} node-local directories no record names", r, *n);
      }
    }
  }

 private:
  Runtime& rt_;
  const MpiOptions opts_;
  std::unique_ptr<Flusher> local_;
  RateLimiter rate_;  // the head's own shard writes, capped like a rank's (benchmark only)
  std::unique_ptr<Link> link_;
  std::unique_ptr<ShardStore> self_;         // node-local: rank 0's own target
  std::unique_ptr<Owners> owners_;           // node-local only
  std::shared_ptr<NodeLocalReader> reader_;  // node-local only
  uint64_t epoch_ = 0;                       // names this mount's nl- directories
  std::atomic<uint64_t> next_tx_{0};
  std::atomic<bool> stopped_{false};
  bool clean_ = true;  // set by the first shutdown()
};

// --- ranks >= 1 ------------------------------------------------------------------------------

class RankServer {
 public:
  RankServer(Runtime& rt, MPI_Comm comm, std::unique_ptr<ShardStore> store, Error store_error,
             const MpiOptions& o)
      : rt_(rt),
        comm_(comm),
        store_(std::move(store)),
        store_error_(std::move(store_error)),
        rate_(o.target_rate_mb * 1e6) {
    if (store_ && rt.rank() == o.fault_rank) store_->inject_enospc_after(o.fault_after_bytes);
  }

  int run() {
    std::string buf;
    Backoff backoff(std::chrono::microseconds(1000));
    for (;;) {
      int flag = 0;
      MPI_Message msg;
      MPI_Status st;
      if (int rc = MPI_Improbe(0, kTagCommand, comm_, &flag, &msg, &st); rc != MPI_SUCCESS) {
        spdlog::error("mpi rank {}: {}", rt_.rank(), mpi_error_string(rc));
        return 1;
      }
      if (!flag) {
        backoff.idle();
        continue;
      }
      backoff.progressed();
      int n = 0;
      MPI_Get_count(&st, MPI_BYTE, &n);
      buf.resize(static_cast<size_t>(n));
      if (int rc = MPI_Mrecv(buf.data(), n, MPI_BYTE, &msg, MPI_STATUS_IGNORE); rc != MPI_SUCCESS) {
        spdlog::error("mpi rank {}: {}", rt_.rank(), mpi_error_string(rc));
        return 1;
      }
      std::string_view payload;
      auto c = decode_command(buf, &payload);
      if (!c) {
        spdlog::error("mpi rank {}: {}", rt_.rank(), c.error().message);
        continue;
      }
      if (c->op == Op::Shutdown) return 0;
      if (auto st2 = handle(*c, payload); !st2) {
        spdlog::error("mpi rank {}: {}", rt_.rank(), st2.error().message);
        return 1;
      }
    }
  }

 private:
  Status reply(uint64_t id, int err, std::string_view payload) {
    if (id == 0) return {};
    Reply r;
    r.id = id;
    r.err = err;
    const std::string m = encode_reply(r, payload);
    if (int rc = MPI_Send(m.data(), static_cast<int>(m.size()), MPI_BYTE, 0, kTagReply, comm_);
        rc != MPI_SUCCESS) {
      return mpi_error(rc, "reply to the head");
    }
    return {};
  }
  Status reply_error(uint64_t id, const Error& e) {
    return reply(id, e.code > 0 ? e.code : EIO, e.message);
  }
  Status reply_status(uint64_t id, const Status& st) {
    return st ? reply(id, 0, {}) : reply_error(id, st.error());
  }

  Status handle(const Command& c, std::string_view payload) {
    if (!store_) {
      // No usable target: every request is refused with why, so the head's writers get the
      // error and the shutdown at unmount still arrives.
      return c.op == Op::Write || c.op == Op::Close ? Status{} : reply_error(c.id, store_error_);
    }
    auto& s = *store_;
    switch (c.op) {
      case Op::Open:
        return reply_status(c.id, s.open_staged(c.tx, c.shard, payload));
      case Op::Create: {
        const size_t nul = payload.find('\0');
        if (nul == std::string_view::npos) {
          return reply_error(c.id, make_error(EPROTO, "create: no transaction name"));
        }
        return reply_status(c.id, s.create(c.tx, payload.substr(nul + 1), c.shard,
                                           payload.substr(0, nul), c.offset));
      }
      case Op::Write:
        rate_.throttle(payload.size());
        (void)s.write(c.tx, c.shard, c.offset, payload);  // latched: reported at the Sync
        return {};
      case Op::Sync:
        return reply_status(c.id, s.sync(c.tx));
      case Op::Seal: {
        auto path = s.seal(c.tx, c.shard, payload);
        return path ? reply(c.id, 0, *path) : reply_error(c.id, path.error());
      }
      case Op::Read:
      case Op::ReadPath: {
        if (c.length > kMaxReadBytes) {
          return reply_error(c.id,
                             make_error(EINVAL, "read of {} bytes: over the limit", c.length));
        }
        std::string data(static_cast<size_t>(c.length), '\0');
        auto st = c.op == Op::Read ? s.read(c.tx, c.shard, c.offset, data.data(), data.size())
                                   : s.read_path(payload, c.tx, c.offset, data.data(), data.size());
        return st ? reply(c.id, 0, data) : reply_error(c.id, st.error());
      }
      case Op::Close:
        s.close(c.tx);
        return {};
      case Op::Abort:
        s.abort(c.tx);
        return reply(c.id, 0, {});
      case Op::Drop:
        return reply_status(c.id, s.drop(payload));
      case Op::Sweep: {
        std::set<std::string, std::less<>> keep;
        for (std::string_view rest = payload; !rest.empty();) {
          const size_t nul = rest.find('\0');
          keep.emplace(rest.substr(0, nul));
          if (nul == std::string_view::npos) break;
          rest.remove_prefix(nul + 1);
        }
        auto n = s.sweep(keep);
        return n ? reply(c.id, 0, std::to_string(*n)) : reply_error(c.id, n.error());
      }
      case Op::Shutdown:
        return {};
    }
    return {};
  }

  Runtime& rt_;
  MPI_Comm comm_;
  std::unique_ptr<ShardStore> store_;  // null when the target could not be opened
  Error store_error_;                  // ... and why
  RateLimiter rate_;
};

}  // namespace

// --- Runtime ---------------------------------------------------------------------------------

Result<std::unique_ptr<Runtime>> Runtime::init() {
  auto rt = std::unique_ptr<Runtime>(new Runtime());
  int provided = 0;
  if (int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
      rc != MPI_SUCCESS) {
    return mpi_error(rc, "MPI_Init_thread");
  }
  rt->impl_ = std::make_unique<Impl>();  // from here on the destructor finalizes
  auto& im = *rt->impl_;
  im.provided = provided;
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  MPI_Comm_rank(MPI_COMM_WORLD, &im.rank);
  MPI_Comm_size(MPI_COMM_WORLD, &im.size);
  if (provided < MPI_THREAD_SERIALIZED) {
    return make_error(ENOTSUP, "MPI provides thread level {}, ckptfs needs at least SERIALIZED",
                      provided);
  }
  char name[MPI_MAX_PROCESSOR_NAME] = {};
  int len = 0;
  MPI_Get_processor_name(name, &len);
  std::vector<char> all(static_cast<size_t>(MPI_MAX_PROCESSOR_NAME) * im.size, '\0');
  if (int rc = MPI_Allgather(name, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, all.data(),
                             MPI_MAX_PROCESSOR_NAME, MPI_CHAR, MPI_COMM_WORLD);
      rc != MPI_SUCCESS) {
    return mpi_error(rc, "MPI_Allgather of host names");
  }
  for (int r = 0; r < im.size; ++r) {
    const char* p = all.data() + static_cast<size_t>(r) * MPI_MAX_PROCESSOR_NAME;
    im.hosts.emplace_back(p, strnlen(p, MPI_MAX_PROCESSOR_NAME));
  }
  return rt;
}

Runtime::~Runtime() {
  if (!impl_) return;
  if (impl_->abort_code != 0) {
    spdlog::error("mpi: a rank was lost; ending the job (MPI_Abort) instead of finalizing");
    MPI_Abort(MPI_COMM_WORLD, impl_->abort_code);
  }
  MPI_Finalize();
}

void Runtime::abort_at_exit(int code) { impl_->abort_code = code; }

int Runtime::rank() const { return impl_->rank; }
int Runtime::size() const { return impl_->size; }
const std::string& Runtime::host(int rank) const { return impl_->hosts.at(rank); }

std::string_view Runtime::thread_level() const {
  switch (impl_->provided) {
    case MPI_THREAD_SINGLE:
      return "single";
    case MPI_THREAD_FUNNELED:
      return "funneled";
    case MPI_THREAD_SERIALIZED:
      return "serialized";
    default:
      return "multiple";
  }
}

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

int serve_rank(Runtime& rt, const MpiOptions& o) {
  auto comm = Comm::dup();
  if (!comm) {
    spdlog::error("mpi rank {}: {}", rt.rank(), comm.error().message);
    return 1;
  }
  auto store = open_target(o, rt.rank());
  Error why;
  if (!store) {
    // Served anyway: every request is refused with this error, so the head's writers see it,
    // and the shutdown at unmount still arrives.
    spdlog::error("mpi rank {}: {}", rt.rank(), store.error().message);
    why = store.error();
  } else {
    spdlog::info("mpi rank {} of {} on {} (pid {}): {} shards under {}", rt.rank(), rt.size(),
                 rt.host(rt.rank()), ::getpid(), o.node_local() ? "storing its" : "writing",
                 (*store)->root_path());
  }
  RankServer server(rt, comm->get(), store ? std::move(store).value() : nullptr, std::move(why), o);
  const int rc = server.run();
  spdlog::info("mpi rank {}: done", rt.rank());
  return rc;
}

}  // namespace ckptfs::flush::mpi
