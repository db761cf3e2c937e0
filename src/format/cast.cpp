// Element conversions written branch-free on bit patterns, so the loops in convert()
// vectorize (this file is built with -O3; see src/meson.build). The subnormal cases use one
// float addition or subtraction, exact or correctly rounded in the default rounding mode
// (to nearest even, no flush-to-zero), which the daemon never changes.
#include "ckptfs/format/cast.hpp"

#include "ckptfs/format/cast_bits.hpp"

#include <bit>
#include <cstring>

namespace ckptfs::format {
namespace {

// The two BF16 conversions live in format/cast_bits.hpp.
inline uint16_t f32_to_bf16_i(uint32_t x) { return bits::f32_to_bf16(x); }

inline uint16_t f32_to_f16_i(uint32_t x) {
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t a = x & 0x7fffffffu;
  // Normal result: rebias the exponent (-112 << 23) and round the 13 dropped bits to even.
  const uint32_t norm = (a - 0x38000000u + 0xfffu + ((a >> 13) & 1u)) >> 13;
  // Subnormal result (|x| < 2^-14): adding 0.5f aligns the value to 2^-24 steps and rounds.
  const uint32_t sub = std::bit_cast<uint32_t>(std::bit_cast<float>(a) + 0.5f) - 0x3f000000u;
  uint32_t r = a < 0x38800000u ? sub : norm;
  r = a >= 0x47800000u ? 0x7c00u : r;                          // >= 2^16: Inf (norm gives
                                                               // Inf from 65520 up)
  r = a > 0x7f800000u ? (0x7e00u | ((a >> 13) & 0x3ffu)) : r;  // NaN: quiet, payload kept
  return static_cast<uint16_t>(r | sign);
}

inline uint32_t f16_to_f32_i(uint16_t h) {
  const uint32_t sign = (static_cast<uint32_t>(h) & 0x8000u) << 16;
  const uint32_t em = static_cast<uint32_t>(h) & 0x7fffu;
  const uint32_t o = (em << 13) + 0x38000000u;  // rebias the exponent (+112 << 23)
  // Zero and subnormals: renormalize exactly by subtracting 2^-14.
  const uint32_t sub = std::bit_cast<uint32_t>(std::bit_cast<float>(o + 0x800000u) -
                                               std::bit_cast<float>(0x38800000u));
  uint32_t r = em < 0x400u ? sub : o;
  r = em >= 0x7c00u ? ((o + 0x38000000u) | (em > 0x7c00u ? 0x400000u : 0u)) : r;
  return r | sign;
}

inline uint32_t bf16_to_f32_i(uint16_t h) { return bits::bf16_to_f32(h); }

inline uint16_t f16_to_bf16_i(uint16_t h) {
  const uint32_t f = f16_to_f32_i(h);
  return (h & 0x7fffu) > 0x7c00u ? static_cast<uint16_t>(0x7fc0u) : f32_to_bf16_i(f);
}

inline uint64_t f32_to_f64_i(uint32_t f) {
  return std::bit_cast<uint64_t>(static_cast<double>(std::bit_cast<float>(f)));
}

inline uint32_t f64_to_f32_i(uint64_t d) {
  return std::bit_cast<uint32_t>(static_cast<float>(std::bit_cast<double>(d)));
}

// `f` must be a lambda (a distinct type per conversion), not a function pointer: a pointer
// type shared by two conversions is not inlined, and the loop then does not vectorize.
template <typename In, typename Out, typename F>
void loop(const void* src, void* dst, size_t n, F f) {
  const auto* s = static_cast<const unsigned char*>(src);
  auto* d = static_cast<unsigned char*>(dst);
  for (size_t i = 0; i < n; ++i) {
    In x;
    std::memcpy(&x, s + i * sizeof(In), sizeof(In));
    const Out y = f(x);
    std::memcpy(d + i * sizeof(Out), &y, sizeof(Out));
  }
}

constexpr uint32_t pair(DType a, DType b) {
  return (static_cast<uint32_t>(a) << 8) | static_cast<uint32_t>(b);
}

}  // namespace

bool castable(DType d) {
  return d == DType::F16 || d == DType::BF16 || d == DType::F32 || d == DType::F64;
}

uint16_t f32_to_bf16(uint32_t f) { return f32_to_bf16_i(f); }
uint16_t f32_to_f16(uint32_t f) { return f32_to_f16_i(f); }
uint32_t bf16_to_f32(uint16_t h) { return bf16_to_f32_i(h); }
uint32_t f16_to_f32(uint16_t h) { return f16_to_f32_i(h); }
uint16_t f16_to_bf16(uint16_t h) { return f16_to_bf16_i(h); }
uint16_t bf16_to_f16(uint16_t h) { return f32_to_f16_i(bf16_to_f32_i(h)); }
uint64_t f32_to_f64(uint32_t f) { return f32_to_f64_i(f); }
uint32_t f64_to_f32(uint64_t d) { return f64_to_f32_i(d); }

void convert(DType from, DType to, const void* src, void* dst, size_t n) {
  using D = DType;
  switch (pair(from, to)) {
    case pair(D::F32, D::BF16):
      return loop<uint32_t, uint16_t>(src, dst, n, [](uint32_t x) { return f32_to_bf16_i(x); });
    case pair(D::F32, D::F16):
      return loop<uint32_t, uint16_t>(src, dst, n, [](uint32_t x) { return f32_to_f16_i(x); });
    case pair(D::F32, D::F64):
      return loop<uint32_t, uint64_t>(src, dst, n, [](uint32_t x) { return f32_to_f64_i(x); });
    case pair(D::BF16, D::F32):
      return loop<uint16_t, uint32_t>(src, dst, n, [](uint16_t x) { return bf16_to_f32_i(x); });
    case pair(D::BF16, D::F16):
      return loop<uint16_t, uint16_t>(src, dst, n,
                                      [](uint16_t h) { return f32_to_f16_i(bf16_to_f32_i(h)); });
    case pair(D::BF16, D::F64):
      return loop<uint16_t, uint64_t>(src, dst, n,
                                      [](uint16_t h) { return f32_to_f64_i(bf16_to_f32_i(h)); });
    case pair(D::F16, D::F32):
      return loop<uint16_t, uint32_t>(src, dst, n, [](uint16_t x) { return f16_to_f32_i(x); });
    case pair(D::F16, D::BF16):
      return loop<uint16_t, uint16_t>(src, dst, n, [](uint16_t x) { return f16_to_bf16_i(x); });
    case pair(D::F16, D::F64):
      return loop<uint16_t, uint64_t>(src, dst, n,
                                      [](uint16_t h) { return f32_to_f64_i(f16_to_f32_i(h)); });
    case pair(D::F64, D::F32):
      return loop<uint64_t, uint32_t>(src, dst, n, [](uint64_t x) { return f64_to_f32_i(x); });
    case pair(D::F64, D::BF16):
      return loop<uint64_t, uint16_t>(src, dst, n,
                                      [](uint64_t d) { return f32_to_bf16_i(f64_to_f32_i(d)); });
    case pair(D::F64, D::F16):
      return loop<uint64_t, uint16_t>(src, dst, n,
                                      [](uint64_t d) { return f32_to_f16_i(f64_to_f32_i(d)); });
    default:
      // Same dtype (or a pair the callers never build): a copy.
      if (from == to) std::memcpy(dst, src, n * (dtype_bits(from) / 8));
      return;
  }
}

}  // namespace ckptfs::format
