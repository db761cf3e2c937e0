// util/copy: the one whole-range copy between two descriptors, in the kernel where it can be
// (util/fd's copy_range), else through a caller's buffer.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "ckptfs/util/result.hpp"

namespace ckptfs {

// Copies `len` bytes at `in_off` of `in` to `out_off` of `out`: copy_file_range while the
// kernel takes it, then pread/pwrite through `buf` (its size, at least 1 byte, is the block;
// resized to 1 MiB when empty). A premature end of `in` is an error (EIO) naming `what`, as is
// any other failure.
Status copy_all(int in, uint64_t in_off, int out, uint64_t out_off, uint64_t len,
                std::string_view what, std::vector<char>& buf);

}  // namespace ckptfs
