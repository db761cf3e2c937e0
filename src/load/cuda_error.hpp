// load/cuda_error: the one translation of a CUDA runtime error into a ckptfs Error, for the CUDA
// backend and the NCCL collective (both compiled only where meson finds CUDA).
#pragma once

#include <cuda_runtime_api.h>

#include <string_view>

#include "ckptfs/util/result.hpp"

namespace ckptfs::load {

// ENOMEM for an allocation that failed (the caller may retry smaller), EIO otherwise; the
// message names the call, CUDA's text and the error's name.
inline Error cuda_error(cudaError_t e, std::string_view what) {
  return make_error(e == cudaErrorMemoryAllocation ? ENOMEM : EIO, "{}: {} ({})", what,
                    cudaGetErrorString(e), cudaGetErrorName(e));
}

}  // namespace ckptfs::load

#define CKPTFS_CUDA(call, what)                                                               \
  do {                                                                                        \
    cudaError_t ckptfs_cuda_e = (call);                                                       \
    if (ckptfs_cuda_e != cudaSuccess) return ::ckptfs::load::cuda_error(ckptfs_cuda_e, what); \
  } while (0)
