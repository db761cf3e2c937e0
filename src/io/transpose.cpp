// io/transpose: the copy of k columns of a row-major matrix into k contiguous runs, tiled in
// SIMD registers for 2- and 4-byte elements (bf16/fp16, fp32: a transposed expert matrix).
#include "ckptfs/io/transpose.hpp"

#include <algorithm>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace ckptfs::io {

namespace {

// Rows per pass: a pass reads kRows rows of the columns it copies (kRows cache lines per 16
// bytes of columns, which stay in L1) and writes kRows elements of each column.
constexpr uint64_t kRows = 64;

template <typename T>
void one_by_one(const char* in, uint64_t stride, uint64_t i0, uint64_t i1, uint64_t j0, uint64_t j1,
                uint64_t n, char* out) {
  for (uint64_t j = j0; j < j1; ++j) {
    char* o = out + j * n * sizeof(T);
    const char* p = in + j * sizeof(T);
    for (uint64_t i = i0; i < i1; ++i) {
      T v;
      std::memcpy(&v, p + i * stride, sizeof(T));
      std::memcpy(o + i * sizeof(T), &v, sizeof(T));
    }
  }
}

template <typename T>
void scalar(const char* in, uint64_t stride, uint64_t n, uint64_t k, char* out) {
  for (uint64_t i0 = 0; i0 < n; i0 += kRows) {
    one_by_one<T>(in, stride, i0, std::min(n, i0 + kRows), 0, k, n, out);
  }
}

#if defined(__SSE2__)
inline __m128i load(const char* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline void store(char* p, __m128i v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), v); }

// The 8x8 block of 16-bit elements at `in` (rows `stride` apart) into 8 rows of `out`
// (`ostride` apart).
inline void tile16(const char* in, uint64_t stride, char* out, uint64_t ostride) {
  const __m128i r0 = load(in), r1 = load(in + stride), r2 = load(in + 2 * stride),
                r3 = load(in + 3 * stride), r4 = load(in + 4 * stride), r5 = load(in + 5 * stride),
                r6 = load(in + 6 * stride), r7 = load(in + 7 * stride);
  const __m128i a0 = _mm_unpacklo_epi16(r0, r1), a1 = _mm_unpackhi_epi16(r0, r1);
  const __m128i a2 = _mm_unpacklo_epi16(r2, r3), a3 = _mm_unpackhi_epi16(r2, r3);
  const __m128i a4 = _mm_unpacklo_epi16(r4, r5), a5 = _mm_unpackhi_epi16(r4, r5);
  const __m128i a6 = _mm_unpacklo_epi16(r6, r7), a7 = _mm_unpackhi_epi16(r6, r7);
  const __m128i b0 = _mm_unpacklo_epi32(a0, a2), b1 = _mm_unpackhi_epi32(a0, a2);
  const __m128i b2 = _mm_unpacklo_epi32(a1, a3), b3 = _mm_unpackhi_epi32(a1, a3);
  const __m128i b4 = _mm_unpacklo_epi32(a4, a6), b5 = _mm_unpackhi_epi32(a4, a6);
  const __m128i b6 = _mm_unpacklo_epi32(a5, a7), b7 = _mm_unpackhi_epi32(a5, a7);
  store(out, _mm_unpacklo_epi64(b0, b4));
  store(out + ostride, _mm_unpackhi_epi64(b0, b4));
  store(out + 2 * ostride, _mm_unpacklo_epi64(b1, b5));
  store(out + 3 * ostride, _mm_unpackhi_epi64(b1, b5));
  store(out + 4 * ostride, _mm_unpacklo_epi64(b2, b6));
  store(out + 5 * ostride, _mm_unpackhi_epi64(b2, b6));
  store(out + 6 * ostride, _mm_unpacklo_epi64(b3, b7));
  store(out + 7 * ostride, _mm_unpackhi_epi64(b3, b7));
}

// The 4x4 block of 32-bit elements, likewise.
inline void tile32(const char* in, uint64_t stride, char* out, uint64_t ostride) {
  const __m128i r0 = load(in), r1 = load(in + stride), r2 = load(in + 2 * stride),
                r3 = load(in + 3 * stride);
  const __m128i a0 = _mm_unpacklo_epi32(r0, r1), a1 = _mm_unpackhi_epi32(r0, r1);
  const __m128i a2 = _mm_unpacklo_epi32(r2, r3), a3 = _mm_unpackhi_epi32(r2, r3);
  store(out, _mm_unpacklo_epi64(a0, a2));
  store(out + ostride, _mm_unpackhi_epi64(a0, a2));
  store(out + 2 * ostride, _mm_unpacklo_epi64(a1, a3));
  store(out + 3 * ostride, _mm_unpackhi_epi64(a1, a3));
}

// T elements in B x B tiles; what is left of the rows and columns one element at a time.
template <typename T, uint64_t B, void (*Tile)(const char*, uint64_t, char*, uint64_t)>
void tiled(const char* in, uint64_t stride, uint64_t n, uint64_t k, char* out) {
  const uint64_t es = sizeof(T), on = n * es;
  const uint64_t nb = n / B * B, kb = k / B * B;
  for (uint64_t i0 = 0; i0 < nb; i0 += kRows) {
    const uint64_t i1 = std::min(nb, i0 + kRows);
    for (uint64_t j = 0; j < kb; j += B) {
      for (uint64_t i = i0; i < i1; i += B)
        Tile(in + i * stride + j * es, stride, out + j * on + i * es, on);
    }
  }
  one_by_one<T>(in, stride, nb, n, 0, kb, n, out);  // the last rows of the tiled columns
  one_by_one<T>(in, stride, 0, n, kb, k, n, out);   // the last columns, whole
}
#endif

}  // namespace

void transpose(const char* in, uint64_t stride, uint64_t n, uint64_t k, uint64_t es, char* out) {
  switch (es) {
    case 1:
      return scalar<uint8_t>(in, stride, n, k, out);
    case 2:
#if defined(__SSE2__)
      return tiled<uint16_t, 8, tile16>(in, stride, n, k, out);
#else
      return scalar<uint16_t>(in, stride, n, k, out);
#endif
    case 4:
#if defined(__SSE2__)
      return tiled<uint32_t, 4, tile32>(in, stride, n, k, out);
#else
      return scalar<uint32_t>(in, stride, n, k, out);
#endif
    case 8:
      return scalar<uint64_t>(in, stride, n, k, out);
    default:
      for (uint64_t j = 0; j < k; ++j) {
        for (uint64_t i = 0; i < n; ++i) {
          std::memcpy(out + (j * n + i) * es, in + i * stride + j * es, es);
        }
      }
  }
}

}  // namespace ckptfs::io
