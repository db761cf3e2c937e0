// flush/mpi_runtime (internal to flush/, OpenMPI builds only): the MPI-level helpers every MPI
// unit shares: MPI error text, the polling backoff, and the job's error-returning communicator.
// Runtime itself (init, finalize, sizes, thread level) is declared in ckptfs/flush/mpi.hpp.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>

#include "ckptfs/util/result.hpp"

namespace ckptfs::flush::mpi {

// MPI_Error_string of `rc`.
std::string mpi_error_string(int rc);
// EIO naming `what` and MPI's text for `rc`.
Error mpi_error(int rc, std::string_view what);

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
  static Result<Comm> dup();
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

}  // namespace ckptfs::flush::mpi
