// Built instead of cuda_backend.cpp when meson did not find CUDA.
#include "ckptfs/load/backend.hpp"

namespace ckptfs::load {

bool built_with_cuda() { return false; }

Result<std::unique_ptr<Backend>> make_cuda_backend(int device) {
  return make_error(ENOTSUP, "cuda:{}: this ckptfs was built without CUDA", device);
}

}  // namespace ckptfs::load
