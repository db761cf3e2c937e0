// The loader's checksum: a fast 64-bit hash of a tensor's bytes that does not depend on the
// order the pipeline reads them in, nor on the chunk size.
//
// checksum(bytes) = sum over i of XXH64(block_i, seed = i)  (mod 2^64)
// where block_i is the i-th kChecksumBlock bytes (the last one may be shorter). XXH64 is the
// xxHash 64-bit algorithm (implemented here from its specification). A tensor of 0 bytes has
// checksum 0. Each block is hashed by the thread that read it, so the sum is formed in any
// order; the loader cuts chunks at multiples of kChecksumBlock.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace ckptfs::load {

inline constexpr uint64_t kChecksumBlock = 1ull << 20;

// XXH64 of `len` bytes.
uint64_t xxh64(const void* data, size_t len, uint64_t seed);

// Contribution of the bytes [off, off + len) of a tensor, `off` a multiple of kChecksumBlock:
// the sum of the hashes of the blocks they hold (only whole blocks, or the tensor's last one).
uint64_t checksum_part(const char* data, uint64_t off, uint64_t len);

// The checksum of a whole buffer (the reference; equal to summing checksum_part over any cut).
inline uint64_t checksum(const char* data, uint64_t len) { return checksum_part(data, 0, len); }

}  // namespace ckptfs::load
