// Where loaded bytes go: host memory (the CPU backend, what CI tests) or one CUDA device.
//
// The pipeline (loader.hpp) reads into staging buffers from alloc_staging() (pinned host
// memory with CUDA, page-aligned host memory otherwise), then hands each filled buffer to
// copy(): cudaMemcpyAsync on one of a few streams followed by an event on the buffer's slot
// (CUDA), or a memcpy (CPU). A slot is reused only after wait_slot() (cudaEventSynchronize).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "ckptfs/util/result.hpp"

namespace ckptfs::load {

// One allocation and how to free it. Move-only.
class Buffer {
 public:
  Buffer() noexcept = default;
  Buffer(void* p, size_t n, std::function<void(void*)> free) noexcept
      : p_(p), n_(n), free_(std::move(free)) {}
  Buffer(Buffer&& o) noexcept
      : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)), free_(std::move(o.free_)) {}
  Buffer& operator=(Buffer&& o) noexcept {
    if (this != &o) {
      reset();
      p_ = std::exchange(o.p_, nullptr);
      n_ = std::exchange(o.n_, 0);
      free_ = std::move(o.free_);
    }
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { reset(); }

  [[nodiscard]] char* data() const noexcept { return static_cast<char*>(p_); }
  [[nodiscard]] size_t size() const noexcept { return n_; }
  void reset() noexcept {
    if (p_ && free_) free_(p_);
    p_ = nullptr;
    n_ = 0;
  }

 private:
  void* p_ = nullptr;
  size_t n_ = 0;
  std::function<void(void*)> free_;
};

class Backend {
 public:
  virtual ~Backend() = default;
  [[nodiscard]] virtual std::string name() const = 0;  // "cpu", "cuda:0"
  [[nodiscard]] virtual bool on_device() const = 0;
  virtual Result<Buffer> alloc_staging(size_t bytes) = 0;
  // Destination memory the library owns ("allocate for me"): device memory with CUDA.
  virtual Result<Buffer> alloc_dest(size_t bytes) = 0;
  // Called once by every pipeline thread before anything else (cudaSetDevice).
  virtual Status bind_thread() = 0;
  // Creates `n` slots (one event each) for the staging buffers; called once per load.
  virtual Status prepare(unsigned slots, unsigned streams) = 0;
  // Copies len bytes from staging buffer `slot` (at src) to dst, asynchronously on stream
  // `stream % streams`; the slot's event is recorded after it.
  virtual Status copy(unsigned stream, unsigned slot, void* dst, const void* src, size_t len) = 0;
  // Waits until the last copy out of `slot` is done.
  virtual Status wait_slot(unsigned slot) = 0;
  // Waits until every copy issued is done.
  virtual Status finish() = 0;
  // Copies `len` bytes of destination memory back to the host (tests, checksums of what
  // landed on the device).
  virtual Status to_host(void* host, const void* dst, size_t len) = 0;
};

// Host memory destination: memcpy from the staging buffer. Host buffers of 4 MiB and more are
// 2 MiB-aligned; with `huge_pages` they are also advised MADV_HUGEPAGE (see huge_pages_pay).
std::unique_ptr<Backend> make_cpu_backend(bool huge_pages = true);

// Whether fresh host memory should be advised MADV_HUGEPAGE: yes, unless a virtio balloon
// device under `balloon_driver_dir` (/sys/bus/virtio/drivers/virtio_balloon) reports free
// pages (feature bit 5). There the guest hands freed 2 MiB blocks back to the host, so a
// fresh huge page costs the host's faults too: a 2 GB load into a fresh process took
// several times longer with the advice (docs/loader.md). `force` ("1" or "0", the value of
// $CKPTFS_LOAD_HUGEPAGES; null or anything else: unset) wins.
bool huge_pages_pay(const char* force, const std::string& balloon_driver_dir);
// The same for this machine and environment, decided once.
bool huge_pages_pay_here();

// CUDA device `device`. ENOTSUP when the library was built without CUDA; ENODEV when there
// is no such device (the message says what the CUDA runtime answered).
Result<std::unique_ptr<Backend>> make_cuda_backend(int device);

// Whether this build has the CUDA backend / the NCCL collective.
bool built_with_cuda();
bool built_with_nccl();

// "cpu" or "cuda:N" (or "cuda" = "cuda:0") -> a backend; `huge_pages` as for make_cpu_backend
// (a CUDA backend's staging is pinned memory, which it does not affect).
Result<std::unique_ptr<Backend>> make_backend(std::string_view device, bool huge_pages);

}  // namespace ckptfs::load
