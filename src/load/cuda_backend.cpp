// The CUDA backend: pinned staging buffers, cudaMemcpyAsync on a few streams, one event per
// ring slot. Compiled only when meson finds CUDA (CKPTFS_HAVE_CUDA); cuda_stub.cpp otherwise.
#include <cuda_runtime_api.h>

#include <vector>

#include "ckptfs/load/backend.hpp"
#include "cuda_error.hpp"

namespace ckptfs::load {
namespace {

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device) : dev_(device) {}
  ~CudaBackend() override { release(); }
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  [[nodiscard]] std::string name() const override { return "cuda:" + std::to_string(dev_); }
  [[nodiscard]] bool on_device() const override { return true; }

  Result<Buffer> alloc_staging(size_t bytes) override {
    CKPTFS_CUDA(cudaSetDevice(dev_), "cudaSetDevice");
    void* p = nullptr;
    CKPTFS_CUDA(cudaHostAlloc(&p, bytes ? bytes : 1, cudaHostAllocPortable), "cudaHostAlloc");
    return Buffer(p, bytes, [](void* q) { cudaFreeHost(q); });
  }
  Result<Buffer> alloc_dest(size_t bytes) override {
    CKPTFS_CUDA(cudaSetDevice(dev_), "cudaSetDevice");
    void* p = nullptr;
    CKPTFS_CUDA(cudaMalloc(&p, bytes ? bytes : 1), "cudaMalloc");
    const int dev = dev_;
    return Buffer(p, bytes, [dev](void* q) {
      cudaSetDevice(dev);
      cudaFree(q);
    });
  }
  Status bind_thread() override {
    CKPTFS_CUDA(cudaSetDevice(dev_), "cudaSetDevice");
    return {};
  }
  Status prepare(unsigned slots, unsigned streams) override {
    release();
    CKPTFS_CUDA(cudaSetDevice(dev_), "cudaSetDevice");
    for (unsigned i = 0; i < std::max(1u, streams); ++i) {
      cudaStream_t s{};
      CKPTFS_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
      streams_.push_back(s);
    }
    for (unsigned i = 0; i < slots; ++i) {
      cudaEvent_t e{};
      CKPTFS_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
      events_.push_back(e);
    }
    return {};
  }
  Status copy(unsigned stream, unsigned slot, void* dst, const void* src, size_t len) override {
    cudaStream_t s = streams_[stream % streams_.size()];
    CKPTFS_CUDA(cudaMemcpyAsync(dst, src, len, cudaMemcpyDefault, s), "cudaMemcpyAsync");
    CKPTFS_CUDA(cudaEventRecord(events_[slot], s), "cudaEventRecord");
    return {};
  }
  Status wait_slot(unsigned slot) override {
    CKPTFS_CUDA(cudaEventSynchronize(events_[slot]), "cudaEventSynchronize");
    return {};
  }
  Status finish() override {
    for (auto s : streams_) CKPTFS_CUDA(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    return {};
  }
  Status to_host(void* host, const void* dst, size_t len) override {
    CKPTFS_CUDA(cudaSetDevice(dev_), "cudaSetDevice");
    CKPTFS_CUDA(cudaMemcpy(host, dst, len, cudaMemcpyDefault), "cudaMemcpy");
    return {};
  }

 private:
  void release() {
    if (streams_.empty() && events_.empty()) return;
    cudaSetDevice(dev_);
    for (auto s : streams_) {
      cudaStreamSynchronize(s);
      cudaStreamDestroy(s);
    }
    for (auto e : events_) cudaEventDestroy(e);
    streams_.clear();
    events_.clear();
  }

  int dev_;
  std::vector<cudaStream_t> streams_;
  std::vector<cudaEvent_t> events_;  // one per ring slot
};

}  // namespace

bool built_with_cuda() { return true; }

Result<std::unique_ptr<Backend>> make_cuda_backend(int device) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    return make_error(ENODEV, "cuda:{}: no usable CUDA device: {} ({})", device,
                      cudaGetErrorString(e), cudaGetErrorName(e));
  }
  if (device < 0 || device >= n) {
    return make_error(ENODEV, "cuda:{}: no such CUDA device ({} present)", device, n);
  }
  return std::unique_ptr<Backend>(std::make_unique<CudaBackend>(device));
}

}  // namespace ckptfs::load
