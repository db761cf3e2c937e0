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
#include <list>
#include <map>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "ckptfs/flush/mpi.hpp"
#include "ckptfs/format/record.hpp"
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
class Backoff {
 public:
  explicit Backoff(std::chrono::microseconds cap) : cap_(cap) {}
  void progressed() { wait_ = std::chrono::microseconds(0); }
  void idle() {
    if (wait_.count() > 0) std::this_thread::sleep_for(wait_);
    wait_ = std::min(cap_, wait_ * 2 + std::chrono::microseconds(5));
  }

 private:
  std::chrono::microseconds cap_;
  std::chrono::microseconds wait_{0};
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
        backoff.idle();
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

class MpiTransaction final : public Transaction {
 public:
  MpiTransaction(std::unique_ptr<Transaction> local, Link& link, uint64_t tx,
                 std::vector<int> owners, std::string what, RateLimiter& rate)
      : local_(std::move(local)),
        link_(link),
        tx_(tx),
        owners_(std::move(owners)),
        what_(std::move(what)),
        rate_(rate) {}
  ~MpiTransaction() override { abort(); }

  std::vector<int> remote_ranks() const {
    std::vector<int> r;
    for (int o : owners_) {
      if (o != 0 && std::find(r.begin(), r.end(), o) == r.end()) r.push_back(o);
    }
    return r;
  }

  // Opens every remote shard on its owner; all or nothing.
  Status open_remote(const std::string& rel) {
    std::vector<std::pair<uint64_t, uint32_t>> ids;
    Status first;
    for (uint32_t i = 0; i < owners_.size(); ++i) {
      if (owners_[i] == 0) continue;
      const std::string path =
          join_rel(join_rel(join_rel(rel, format::kStateDirName), local_->staging_name()),
                   fmt::format("rank-{:05d}", i + 1));
      Command c;
      c.op = Op::Open;
      c.tx = tx_;
      c.shard = i;
      auto id = link_.start(owners_[i], c, path, shard_what(i));
      if (!id) {
        first = std::move(id).error();
        break;
      }
      ids.emplace_back(*id, i);
    }
    CKPTFS_CHECK(wait_all(ids, "open"));
    return first;
  }

  Status pwrite(uint32_t shard, uint64_t offset, std::string_view bytes) override {
    if (owners_[shard] == 0) {
      rate_.throttle(bytes.size());
      return local_->pwrite(shard, offset, bytes);
    }
    Command c;
    c.op = Op::Write;
    c.tx = tx_;
    c.shard = shard;
    c.offset = offset;
    return link_.post(owners_[shard], c, bytes, true, shard_what(shard));
  }

  Status pread(uint32_t shard, uint64_t off, char* dst, size_t n) override {
    // Once every owner acknowledged its fsync (a commit), the staged files in the shared
    // target hold every byte: read them here.
    if (owners_[shard] == 0 || synced_) return local_->pread(shard, off, dst, n);
    constexpr size_t kPiece = 16 << 20;
    for (size_t done = 0; done < n;) {
      const size_t len = std::min(kPiece, n - done);
      Command c;
      c.op = Op::Read;
      c.tx = tx_;
      c.shard = shard;
      c.offset = off + done;
      c.length = len;
      CKPTFS_TRY(std::string got,
                 link_.call(owners_[shard], c, {}, shard_what(shard) + " (read back)"));
      if (got.size() != len) {
        return make_error(EIO, "{}: {} sent {} bytes, not {}", shard_what(shard),
                          link_.who(owners_[shard]), got.size(), len);
      }
      std::memcpy(dst + done, got.data(), len);
      done += len;
    }
    return {};
  }

  Status sync() override {
    if (!synced_) CKPTFS_CHECK(remote_sync());
    return local_->sync();
  }

  // Every owner fsyncs and acknowledges first: nothing is committed that a rank has not made
  // durable. MPI mode commits durably always (the record and directories too).
  Status commit(const CommitInfo& info, bool /*durable*/) override {
    CKPTFS_CHECK(remote_sync());
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
  std::string shard_what(uint32_t i) const { return fmt::format("{}: shard {}", what_, i + 1); }

  // `step` names the request in messages ("open", "sync").
  Status wait_all(const std::vector<std::pair<uint64_t, uint32_t>>& ids, std::string_view step) {
    const auto deadline = std::chrono::steady_clock::now() + link_.timeout();
    Status first;
    for (const auto& [id, shard] : ids) {
      auto r = link_.wait(id, deadline, fmt::format("{} ({})", shard_what(shard), step));
      if (!r && first) first = std::move(r).error();
    }
    return first;
  }

  Status remote_sync() {
    std::vector<std::pair<uint64_t, uint32_t>> ids;
    for (int r : remote_ranks()) {
      Command c;
      c.op = Op::Sync;
      c.tx = tx_;
      const uint32_t shard =
          static_cast<uint32_t>(std::find(owners_.begin(), owners_.end(), r) - owners_.begin());
      CKPTFS_TRY(uint64_t id, link_.start(r, c, {}, shard_what(shard)));
      ids.emplace_back(id, shard);
    }
    return wait_all(ids, "sync");
  }

  void close_remote() {
    if (closed_) return;
    closed_ = true;
    for (int r : remote_ranks()) {
      Command c;
      c.op = Op::Close;
      c.tx = tx_;
      if (auto st = link_.post(r, c, {}, false, what_); !st) {
        spdlog::debug("{}", st.error().message);
      }
    }
  }

  std::unique_ptr<Transaction> local_;  // staging, the head's shards, the commit
  Link& link_;
  const uint64_t tx_;
  const std::vector<int> owners_;  // shard index -> MPI rank
  const std::string what_;
  RateLimiter& rate_;
  bool synced_ = false;  // every owner acknowledged the fsync of the complete shards
  bool closed_ = false;  // the owners were told to forget the transaction
};

class MpiFlusherImpl final : public MpiFlusher {
 public:
  MpiFlusherImpl(Runtime& rt, Comm comm, const MpiOptions& o)
      : rt_(rt),
        opts_(o),
        local_(make_local_flusher()),
        rate_(o.target_rate_mb * 1e6),
        link_(std::make_unique<Link>(rt, std::move(comm), o)) {}
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
    CKPTFS_TRY(auto local, local_->begin(t, set, what));
    std::vector<int> owners(set.shards.size());
    for (size_t i = 0; i < owners.size(); ++i) owners[i] = static_cast<int>(i % rt_.size());
    auto tx = std::make_unique<MpiTransaction>(std::move(local), *link_, next_tx_.fetch_add(1) + 1,
                                               std::move(owners), std::move(what), rate_);
    CKPTFS_CHECK(tx->open_remote(rel));  // on failure the destructor aborts
    return std::unique_ptr<Transaction>(std::move(tx));
  }

  bool recover(const Target& t) override { return local_->recover(t); }

  Status remove(const Target& t, uint32_t k, uint32_t m) override {
    return local_->remove(t, k, m);
  }

 private:
  Runtime& rt_;
  const MpiOptions opts_;
  std::unique_ptr<Flusher> local_;
  RateLimiter rate_;  // the head's own shard writes, capped like a rank's (benchmark only)
  std::unique_ptr<Link> link_;
  std::atomic<uint64_t> next_tx_{0};
  std::atomic<bool> stopped_{false};
  bool clean_ = true;  // set by the first shutdown()
};

// --- ranks >= 1 ------------------------------------------------------------------------------

struct Held {
  UniqueFd fd;
  std::string path;
  std::optional<Error> err;  // the first failed write, reported at the next Sync
};

class RankServer {
 public:
  RankServer(Runtime& rt, MPI_Comm comm, UniqueFd root, std::string root_path, const MpiOptions& o)
      : rt_(rt),
        comm_(comm),
        root_(std::move(root)),
        root_path_(std::move(root_path)),
        rate_(o.target_rate_mb * 1e6),
        fault_(rt.rank() == o.fault_rank),
        fault_after_(o.fault_after_bytes) {}

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

  Status handle(const Command& c, std::string_view payload) {
    const auto key = std::make_pair(c.tx, c.shard);
    switch (c.op) {
      case Op::Open: {
        const std::string rel(payload);
        auto fd = open_beneath(root_.get(), rel, O_RDWR | O_NOFOLLOW);
        if (!fd) {
          return reply_error(c.id, std::move(fd).error().context(root_path_));
        }
        struct stat st {};
        if (::fstat(fd->get(), &st) != 0 || !S_ISREG(st.st_mode)) {
          return reply_error(c.id,
                             make_error(EINVAL, "{}/{}: not a regular file", root_path_, rel));
        }
        held_[key] = Held{std::move(fd).value(), root_path_ + "/" + rel, std::nullopt};
        return reply(c.id, 0, {});
      }
      case Op::Write: {
        auto it = held_.find(key);
        if (it == held_.end()) return {};  // aborted meanwhile (Close came first): dropped
        if (it->second.err) return {};
        rate_.throttle(payload.size());
        written_ += payload.size();
        if (fault_ && written_ > fault_after_) {
          it->second.err =
              make_error(ENOSPC, "{}: No space left on device (-o mpi_fault)", it->second.path);
          return {};
        }
        if (auto st = pwrite_all(it->second.fd.get(), payload.data(), payload.size(), c.offset,
                                 it->second.path);
            !st) {
          it->second.err = std::move(st).error();
        }
        return {};
      }
      case Op::Sync: {
        for (auto it = held_.lower_bound({c.tx, 0}); it != held_.end() && it->first.first == c.tx;
             ++it) {
          if (!it->second.err && ::fsync(it->second.fd.get()) != 0) {
            it->second.err = errno_error(it->second.path + ": fsync failed");
          }
          if (it->second.err) return reply_error(c.id, *it->second.err);
        }
        return reply(c.id, 0, {});
      }
      case Op::Read: {
        auto it = held_.find(key);
        if (it == held_.end()) {
          return reply_error(c.id, make_error(EIO, "shard {} of transaction {} is not open here",
                                              c.shard + 1, c.tx));
        }
        // A shard whose write failed has holes: never hand them out as its bytes.
        if (it->second.err) return reply_error(c.id, *it->second.err);
        std::string data(static_cast<size_t>(c.length), '\0');
        if (auto st = pread_exact(it->second.fd.get(), data.data(), data.size(), c.offset,
                                  it->second.path);
            !st) {
          return reply_error(c.id, st.error());
        }
        return reply(c.id, 0, data);
      }
      case Op::Close:
        held_.erase(held_.lower_bound({c.tx, 0}), held_.upper_bound({c.tx, UINT32_MAX}));
        return {};
      case Op::Shutdown:
        return {};
    }
    return {};
  }

  Runtime& rt_;
  MPI_Comm comm_;
  UniqueFd root_;
  std::string root_path_;
  RateLimiter rate_;
  const bool fault_;            // -o mpi_fault names this rank
  const uint64_t fault_after_;  // ... and the bytes it writes before its writes fail
  uint64_t written_ = 0;        // shard bytes this rank has been sent
  std::map<std::pair<uint64_t, uint32_t>, Held> held_;  // (tx, shard) -> its staged file
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
  return std::shared_ptr<MpiFlusher>(std::make_shared<MpiFlusherImpl>(rt, std::move(comm), o));
}

int serve_rank(Runtime& rt, const MpiOptions& o) {
  auto comm = Comm::dup();
  if (!comm) {
    spdlog::error("mpi rank {}: {}", rt.rank(), comm.error().message);
    return 1;
  }
  std::string root_path = o.source;
  if (!o.target.empty()) {
    auto t = expand_target(o.target, rt.rank());
    if (t) root_path = *t;
  }
  auto root = open_file(root_path, O_RDONLY | O_DIRECTORY);
  if (!root) {
    // Served anyway: every Open is refused with this error, so the head's writers store their
    // files whole, and the shutdown at unmount still arrives.
    spdlog::error("mpi rank {}: {}", rt.rank(), root.error().message);
  }
  spdlog::info("mpi rank {} of {} on {} (pid {}): writing shards under {}", rt.rank(), rt.size(),
               rt.host(rt.rank()), ::getpid(), root_path);
  RankServer server(rt, comm->get(), root ? std::move(root).value() : UniqueFd(), root_path, o);
  const int rc = server.run();
  spdlog::info("mpi rank {}: done", rt.rank());
  return rc;
}

}  // namespace ckptfs::flush::mpi
