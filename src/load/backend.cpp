// load/backend: host memory for the loader: aligned buffers and the CPU backend.
#include "ckptfs/load/backend.hpp"

#include <sys/mman.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

namespace ckptfs::load {
namespace {

constexpr size_t kPage = 4096;

constexpr size_t kHuge = 2ull << 20;

// Page-aligned host memory; from 4 MiB up, 2 MiB-aligned and (with `huge`) advised for
// transparent huge pages, so a loaded tensor costs 512x fewer page faults on first touch.
Result<Buffer> aligned_host(size_t bytes, bool huge) {
  const size_t align = bytes >= 2 * kHuge ? kHuge : kPage;
  const size_t n = ((bytes ? bytes : 1) + align - 1) / align * align;
  void* p = std::aligned_alloc(align, n);
  if (!p) return make_error(ENOMEM, "cannot allocate {} bytes of host memory", bytes);
  if (huge && align == kHuge) (void)::madvise(p, n, MADV_HUGEPAGE);  // advisory
  return Buffer(p, bytes, [](void* q) { std::free(q); });
}

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(bool huge) : huge_(huge) {}
  [[nodiscard]] std::string name() const override { return "cpu"; }
  [[nodiscard]] bool on_device() const override { return false; }
  Result<Buffer> alloc_staging(size_t bytes) override { return aligned_host(bytes, huge_); }
  Result<Buffer> alloc_dest(size_t bytes) override { return aligned_host(bytes, huge_); }
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

 private:
  const bool huge_;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(bool huge_pages) {
  return std::make_unique<CpuBackend>(huge_pages);
}

bool huge_pages_pay(const char* force, const std::string& balloon_driver_dir) {
  if (force && (std::strcmp(force, "1") == 0 || std::strcmp(force, "0") == 0)) {
    return force[0] == '1';
  }
  // Each bound device has a directory virtioN holding `features`: one '0'/'1' per bit.
  std::error_code ec;
  for (std::filesystem::directory_iterator it(balloon_driver_dir, ec), end; !ec && it != end;
       it.increment(ec)) {
    if (!it->path().filename().string().starts_with("virtio")) continue;
    std::ifstream f(it->path() / "features");
    std::string bits;
    if (f >> bits && bits.size() > 5 && bits[5] == '1') return false;  // F_REPORTING
  }
  return true;  // no balloon driver, or none reports free pages
}

bool huge_pages_pay_here() {
  static const bool pay = huge_pages_pay(std::getenv("CKPTFS_LOAD_HUGEPAGES"),
                                         "/sys/bus/virtio/drivers/virtio_balloon");
  return pay;
}

Result<std::unique_ptr<Backend>> make_backend(std::string_view device, bool huge_pages) {
  if (device == "cpu") return make_cpu_backend(huge_pages);
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
