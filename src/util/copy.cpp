// util/copy: the one whole-range copy between two descriptors (kernel first, then a buffer).
#include "ckptfs/util/copy.hpp"

#include <algorithm>

#include "ckptfs/util/fd.hpp"

namespace ckptfs {

Status copy_all(int in, uint64_t in_off, int out, uint64_t out_off, uint64_t len,
                std::string_view what, std::vector<char>& buf) {
  CKPTFS_TRY(const bool in_kernel, copy_range(in, in_off, out, out_off, len, what));
  if (in_kernel) return {};
  if (buf.empty()) buf.resize(1 << 20);
  for (uint64_t done = 0; done < len;) {
    const auto n = static_cast<size_t>(std::min<uint64_t>(buf.size(), len - done));
    CKPTFS_CHECK(pread_exact(in, buf.data(), n, in_off + done, what));
    CKPTFS_CHECK(pwrite_all(out, buf.data(), n, out_off + done, what));
    done += n;
  }
  return {};
}

}  // namespace ckptfs
