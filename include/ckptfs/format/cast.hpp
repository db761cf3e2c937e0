// Floating-point dtype casts, bit for bit as torch's `.to(dtype)` on CPU does them.
//
// Castable dtypes: F16, BF16, F32, F64. F8_*, sub-byte floats, integers, BOOL and C64 are
// never cast. Every conversion rounds to nearest, ties to even, overflows to +-Inf, keeps
// subnormals, and treats NaN the way torch's vectorized CPU kernels do (torch 2.x, AVX2):
//  - to BF16 from F32 or F64: every NaN becomes 0xFFFF;
//  - to BF16 from F16: every NaN becomes 0x7FC0 (torch has no vector path for this pair);
//  - to F16: sign kept, quiet bit set, the top 10 payload bits kept (what F16C does);
//  - BF16 to F32: exact, NaN unchanged (a signalling NaN stays signalling);
//  - F16 to F32: exact, NaN quieted with its payload kept;
//  - F32 <-> F64: the hardware conversion (NaN quieted, payload kept or truncated);
//  - F64 to F16/BF16: through F32 (torch rounds twice: F64 -> F32 -> target).
// torch's scalar tail loops (the last n % 8 or n % 16 elements of some pairs) give other
// canonical NaNs (0x7FFFFFFF for F16 -> F32, 0x7FC0 for F64 -> BF16); the vector body is
// what is matched. docs/semantics.md lists this.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

#include "ckptfs/format/dtype.hpp"

namespace ckptfs::format {

// F16, BF16, F32 or F64.
bool castable(DType d);

// Converts `n` elements of `from` at `src` into `to` at `dst` (both unaligned-safe, not
// overlapping). Both dtypes must be castable; from == to copies.
void convert(DType from, DType to, const void* src, void* dst, size_t n);

// The element conversions (bit patterns in, bit patterns out), exposed for tests.
uint16_t f32_to_bf16(uint32_t f);
uint16_t f32_to_f16(uint32_t f);
uint32_t bf16_to_f32(uint16_t h);
uint32_t f16_to_f32(uint16_t h);
uint16_t f16_to_bf16(uint16_t h);
uint16_t bf16_to_f16(uint16_t h);
uint64_t f32_to_f64(uint32_t f);
uint32_t f64_to_f32(uint64_t d);

}  // namespace ckptfs::format
