// io/transpose: the copy of k columns of a row-major matrix into k contiguous runs (a
// transposed tensor's bytes, gathered from a window of its shard).
#pragma once

#include <cstdint>

namespace ckptfs::io {

// Column j (j < k) of the n rows at `in` (row i at in + i * stride, element j at j * es within
// it) is written to out + j * n * es, its n elements contiguous. Elements of 2 and 4 bytes go
// through 8x8 and 4x4 register tiles where the CPU has SSE2; 1- and 8-byte elements and the
// edges one element at a time. `in` and `out` may be unaligned; they must not overlap.
void transpose(const char* in, uint64_t stride, uint64_t n, uint64_t k, uint64_t es, char* out);

}  // namespace ckptfs::io
