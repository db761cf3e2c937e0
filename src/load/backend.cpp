// load/backend: host memory for the loader: aligned buffers and the CPU backend.
#include "ckptfs/load/backend.hpp"

#include <sys/mman.h>

#include <cstdlib>
#include <cstring>

namespace ckptfs::load {
namespace {

constexpr size_t kPage = 4096;

constexpr size_t kHuge = 2ull << 20;

// Page-aligned host memory; from 4 MiB up, 2 MiB-aligned and advised for transparent huge
// pages, so a loaded tensor costs 512x fewer page faults on first touch.
Result<Buffer> aligned_host(size_t bytes) {
  const size_t align = bytes >= 2 * kHuge ? kHuge : kPage;
  const size_t n = ((bytes ? bytes : 1) + align - 1) / align * align;
  void* p = std::aligned_alloc(align, n);
  if (!p) return make_error(ENOMEM, "cannot allocate {} bytes of host memory", bytes);
  if (align == kHuge) (void)::madvise(p, n, MADV_HUGEPAGE);  // advisory
  return Buffer(p, bytes, [](void* q) { std::free(q); });
}

class CpuBackend final : public Backend {
 public:
  [[nodiscard]] std::string name() const override { return "cpu"; }
  [[nodiscard]] bool on_device() const override { return false; }
  Result<Buffer> alloc_staging(size_t bytes) override { return aligned_host(bytes); }
  Result<Buffer> alloc_dest(size_t bytes) override { return aligned_host(bytes); }
  Status bind_thread() override { return {}; }
  Status prepare(unsigned, unsigned) override { return {}; }
  Status copy(unsigned, unsigned, void* dst, const void* src, size_t len) override {
    std::memcpy(dst, src, len);
    return {};
  }
  Status wait_slot(unsigned) override { return {}; }
  Status finish() override { return {}; }
  Status to_host(void* host, const void* dst, size_t len) override {
    std::memcpy(host, dst, len);
    return {};
  }
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

Result<std::unique_ptr<Backend>> make_backend(std::string_view device) {
  if (device == "cpu") return make_cpu_backend();
  if (device == "cuda") return make_cuda_backend(0);
  if (device.starts_with("cuda:")) {
    auto rest = device.substr(5);
    int n = 0;
    if (rest.empty() || rest.size() > 4) {
      return make_error(EINVAL, "device '{}': expected cpu or cuda:N", device);
    }
    for (char c : rest) {
      if (c < '0' || c > '9')
        return make_error(EINVAL, "device '{}': expected cpu or cuda:N", device);
      n = n * 10 + (c - '0');
    }
    return make_cuda_backend(n);
  }
  return make_error(EINVAL, "device '{}': expected cpu or cuda:N", device);
}

}  // namespace ckptfs::load
