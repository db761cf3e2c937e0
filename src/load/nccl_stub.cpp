// Built instead of nccl_collective.cpp when meson did not find NCCL.
#include "ckptfs/load/backend.hpp"
#include "ckptfs/load/collective.hpp"

namespace ckptfs::load {

bool built_with_nccl() { return false; }

Result<NcclId> nccl_unique_id() {
  return make_error(ENOTSUP, "this ckptfs was built without NCCL");
}

Result<std::unique_ptr<Collective>> make_nccl_collective(const NcclId&, unsigned, unsigned, int) {
  return make_error(ENOTSUP, "this ckptfs was built without NCCL");
}

}  // namespace ckptfs::load
