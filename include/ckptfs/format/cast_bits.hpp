// format/cast_bits: the BF16 element conversions' bit arithmetic, inline, for the loops that
// convert (format/cast.cpp) and the merge that widens and rounds in the same pass (io/merge.cpp).
#pragma once

#include <cstdint>

namespace ckptfs::format::bits {

// F32 to BF16, rounded to nearest even; every NaN becomes 0xffff (branch-free, so loops vectorize).
inline uint16_t f32_to_bf16(uint32_t x) {
  const uint32_t r = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((x & 0x7fffffffu) > 0x7f800000u ? 0xffffu : r);
}

// BF16 to F32, exact.
inline uint32_t bf16_to_f32(uint16_t h) { return static_cast<uint32_t>(h) << 16; }

}  // namespace ckptfs::format::bits
