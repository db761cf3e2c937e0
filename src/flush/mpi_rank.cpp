// flush/mpi_rank: the rank server of ranks >= 1 (serve_rank): receives the head's commands
// with MPI_Improbe / MPI_Mrecv, hands each to dispatch (mpi_dispatch.cpp, pure) and sends the
// answer back. OpenMPI builds only.
#include <unistd.h>

#include <spdlog/spdlog.h>

#include "ckptfs/flush/mpi.hpp"
#include "ckptfs/flush/store.hpp"
#include "mpi_runtime.hpp"

namespace ckptfs::flush::mpi {
namespace {

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
      // The rate cap (a benchmark's slow target) holds back this rank's shard writes.
      if (store_ && c->op == Op::Write) rate_.throttle(payload.size());
      auto a = store_ ? dispatch(*store_, *c, payload) : refuse(*c, store_error_);
      if (auto st2 = send(a); !st2) {
        spdlog::error("mpi rank {}: {}", rt_.rank(), st2.error().message);
        return 1;
      }
    }
  }

 private:
  Status send(const std::optional<Answer>& a) {
    if (!a) return {};
    const std::string m = encode_reply(a->reply, a->payload);
    if (int rc = MPI_Send(m.data(), static_cast<int>(m.size()), MPI_BYTE, 0, kTagReply, comm_);
        rc != MPI_SUCCESS) {
      return mpi_error(rc, "reply to the head");
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
