// The NCCL collective: ncclBroadcast of device memory on one stream, batched in groups.
// Compiled only when meson finds NCCL (and CUDA); nccl_stub.cpp otherwise.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstring>

#include "ckptfs/load/backend.hpp"
#include "ckptfs/load/collective.hpp"
#include "cuda_error.hpp"

namespace ckptfs::load {
namespace {

Error nccl_error(ncclResult_t r, std::string_view what) {
  return make_error(EIO, "{}: {}", what, ncclGetErrorString(r));
}
class NcclCollective final : public Collective {
 public:
  NcclCollective(unsigned rank, unsigned size, int device)
      : rank_(rank), size_(size), dev_(device) {}
  ~NcclCollective() override {
    if (comm_) ncclCommDestroy(comm_);
    if (flag_) cudaFree(flag_);
    if (pair_) cudaFree(pair_);
    if (stream_) cudaStreamDestroy(stream_);
  }
  NcclCollective(const NcclCollective&) = delete;
  NcclCollective& operator=(const NcclCollective&) = delete;

  Status init(const NcclId& id) {
    if (auto e = cudaSetDevice(dev_); e != cudaSuccess) return cuda_error(e, "cudaSetDevice");
    if (auto e = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking); e != cudaSuccess) {
      return cuda_error(e, "cudaStreamCreate");
    }
    if (auto e = cudaMalloc(&flag_, sizeof(int)); e != cudaSuccess)
      return cuda_error(e, "cudaMalloc");
    ncclUniqueId uid;
    static_assert(sizeof(uid.internal) == sizeof(NcclId));
    std::memcpy(uid.internal, id.data(), id.size());
    if (auto r = ncclCommInitRank(&comm_, static_cast<int>(size_), uid, static_cast<int>(rank_));
        r != ncclSuccess) {
      return nccl_error(r, "ncclCommInitRank");
    }
    return {};
  }

  [[nodiscard]] unsigned rank() const override { return rank_; }
  [[nodiscard]] unsigned size() const override { return size_; }

  Result<bool> all_ok(bool ok) override {
    int host = ok ? 1 : 0;
    if (auto e = cudaMemcpyAsync(flag_, &host, sizeof host, cudaMemcpyHostToDevice, stream_);
        e != cudaSuccess) {
      return cuda_error(e, "cudaMemcpyAsync");
    }
    if (auto r = ncclAllReduce(flag_, flag_, 1, ncclInt32, ncclMin, comm_, stream_);
        r != ncclSuccess) {
      return nccl_error(r, "ncclAllReduce");
    }
    if (auto e = cudaMemcpyAsync(&host, flag_, sizeof host, cudaMemcpyDeviceToHost, stream_);
        e != cudaSuccess) {
      return cuda_error(e, "cudaMemcpyAsync");
    }
    if (auto e = cudaStreamSynchronize(stream_); e != cudaSuccess) {
      return cuda_error(e, "cudaStreamSynchronize");
    }
    return host == 1;
  }
  Result<bool> all_same(uint64_t value) override {
    // One all-reduce (max) of {v, ~v}: max(v) == ~max(~v) == min(v) iff all are equal.
    uint64_t host[2] = {value, ~value};
    if (auto e = cudaMemcpyAsync(pair_, host, sizeof host, cudaMemcpyHostToDevice, stream_);
        e != cudaSuccess) {
      return cuda_error(e, "cudaMemcpyAsync");
    }
    if (auto r = ncclAllReduce(pair_, pair_, 2, ncclUint64, ncclMax, comm_, stream_);
        r != ncclSuccess) {
      return nccl_error(r, "ncclAllReduce");
    }
    if (auto e = cudaMemcpyAsync(host, pair_, sizeof host, cudaMemcpyDeviceToHost, stream_);
        e != cudaSuccess) {
      return cuda_error(e, "cudaMemcpyAsync");
    }
    if (auto e = cudaStreamSynchronize(stream_); e != cudaSuccess) {
      return cuda_error(e, "cudaStreamSynchronize");
    }
    return host[0] == ~host[1];
  }
  Status begin_group() override {
    if (auto r = ncclGroupStart(); r != ncclSuccess) return nccl_error(r, "ncclGroupStart");
    return {};
  }
  Status end_group() override {
    if (auto r = ncclGroupEnd(); r != ncclSuccess) return nccl_error(r, "ncclGroupEnd");
    if (auto e = cudaStreamSynchronize(stream_); e != cudaSuccess) {
      return cuda_error(e, "cudaStreamSynchronize");
    }
    return {};
  }
  Status broadcast(void* buf, uint64_t bytes, unsigned root) override {
    if (auto r = ncclBroadcast(buf, buf, bytes, ncclUint8, static_cast<int>(root), comm_, stream_);
        r != ncclSuccess) {
      return nccl_error(r, "ncclBroadcast");
    }
    return {};
  }

 private:
  unsigned rank_;
  unsigned size_;
  int dev_;
  cudaStream_t stream_ = nullptr;
  void* flag_ = nullptr;  // one int of device memory for all_ok
  void* pair_ = nullptr;  // two uint64 of device memory for all_same
  ncclComm_t comm_ = nullptr;
};

}  // namespace

bool built_with_nccl() { return true; }

Result<NcclId> nccl_unique_id() {
  ncclUniqueId uid;
  if (auto r = ncclGetUniqueId(&uid); r != ncclSuccess) return nccl_error(r, "ncclGetUniqueId");
  NcclId id{};
  std::memcpy(id.data(), uid.internal, id.size());
  return id;
}

Result<std::unique_ptr<Collective>> make_nccl_collective(const NcclId& id, unsigned rank,
                                                         unsigned ranks, int device) {
  if (ranks == 0 || rank >= ranks) {
    return make_error(EINVAL, "NCCL: rank {} of {} ranks", rank, ranks);
  }
  auto c = std::make_unique<NcclCollective>(rank, ranks, device);
  CKPTFS_CHECK(c->init(id));
  return std::unique_ptr<Collective>(std::move(c));
}

}  // namespace ckptfs::load
