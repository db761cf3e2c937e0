// flush/mpi_runtime: MPI itself for `ckptfs mount` under mpirun: MPI_Init_thread and
// MPI_Finalize (or MPI_Abort), the job's size, rank, hosts and thread level (Runtime in
// ckptfs/flush/mpi.hpp), and the shared helpers of mpi_runtime.hpp. OpenMPI builds only.
#include "mpi_runtime.hpp"

#include <cstring>
#include <vector>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "ckptfs/flush/mpi.hpp"

namespace ckptfs::flush::mpi {

struct Runtime::Impl {
  int rank = 0;
  int size = 1;
  int provided = 0;
  int abort_code = 0;  // nonzero: the destructor calls MPI_Abort with it, not MPI_Finalize
  std::vector<std::string> hosts;
};

std::string mpi_error_string(int rc) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, buf, &len) != MPI_SUCCESS) return fmt::format("MPI error {}", rc);
  return std::string(buf, static_cast<size_t>(len));
}

Error mpi_error(int rc, std::string_view what) {
  return make_error(EIO, "{}: {}", what, mpi_error_string(rc));
}

Result<Comm> Comm::dup() {
  Comm c;
  if (int rc = MPI_Comm_dup(MPI_COMM_WORLD, &c.comm_); rc != MPI_SUCCESS) {
    return mpi_error(rc, "MPI_Comm_dup");
  }
  MPI_Comm_set_errhandler(c.comm_, MPI_ERRORS_RETURN);
  return c;
}

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

}  // namespace ckptfs::flush::mpi
