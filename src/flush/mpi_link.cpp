// flush/mpi_link: the head's transport to the ranks (Link, OwnedShards; see mpi_link.hpp for
// its threads and lock order). OpenMPI builds only.
#include "mpi_link.hpp"

#include <algorithm>
#include <cstring>

#include <spdlog/spdlog.h>

namespace ckptfs::flush::mpi {

// --- Link ------------------------------------------------------------------------------------

Status Link::post(int dest, const Command& c, std::string_view payload, bool budgeted,
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

Result<uint64_t> Link::start(int dest, Command c, std::string_view payload, std::string_view what) {
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

Result<std::string> Link::wait(uint64_t id, std::chrono::steady_clock::time_point deadline,
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
    return make_error(EIO, "{}: {} did not answer within {} s (-o mpi_timeout)", what, who(s.dest),
                      timeout_.count() / 1000.0);
  }
  if (s.err != 0) return make_error(s.err, "{}: {}: {}", what, who(s.dest), s.payload);
  return std::move(s.payload);
}

Status Link::read(int dest, Command c, std::string_view payload, uint64_t off, char* dst, size_t n,
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

void Link::shutdown() {
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

void Link::break_link(const Error& e) {
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

void Link::stop() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  work_.notify_one();
  if (thread_.joinable()) thread_.join();
}

void Link::deliver(int source, std::string_view msg) {
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

void Link::run() {
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
      if (int rc = MPI_Mrecv(buf.data(), n, MPI_BYTE, &msg, MPI_STATUS_IGNORE); rc != MPI_SUCCESS) {
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

// --- OwnedShards -----------------------------------------------------------------------------

Command OwnedShards::command(Op op, uint32_t shard) const {
  Command c;
  c.op = op;
  c.tx = tx_;
  c.shard = shard;
  return c;
}

Status OwnedShards::wait_all(const std::vector<std::pair<uint64_t, uint32_t>>& ids,
                             std::string_view step, std::vector<std::string>* replies) {
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

Status OwnedShards::sync(const std::function<Status()>& own) {
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

void OwnedShards::tell_all(Op op) {
  combiner_.drop();
  for (int r : remote_ranks()) {
    if (auto st = link_.post(r, command(op), {}, false, what_); !st) {
      spdlog::debug("{}", st.error().message);
    }
  }
}

std::vector<int> OwnedShards::remote_ranks() const {
  std::vector<int> r;
  for (int o : owner_) {
    if (o != 0 && std::find(r.begin(), r.end(), o) == r.end()) r.push_back(o);
  }
  return r;
}

}  // namespace ckptfs::flush::mpi
