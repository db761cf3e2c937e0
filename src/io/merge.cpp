// io/merge: merged LoRA weights: the per-view factor cache and W + scale * (B @ A) on a run.
#include "ckptfs/io/merge.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "ckptfs/format/cast.hpp"
#include "ckptfs/format/cast_bits.hpp"

namespace ckptfs::io {

std::shared_ptr<const LoraFactors> FactorCache::find(uint32_t tensor) const {
  std::lock_guard lk(mu_);
  for (auto& e : entries_) {
    if (e.tensor == tensor) {
      e.used = ++tick_;
      return e.factors;
    }
  }
  return nullptr;
}

void FactorCache::add(uint32_t tensor, std::shared_ptr<const LoraFactors> f) {
  std::lock_guard lk(mu_);
  for (auto& e : entries_) {
    if (e.tensor == tensor) return;  // another thread read them first
  }
  if (entries_.size() >= kFactorsKept) {
    entries_.erase(
        std::min_element(entries_.begin(), entries_.end(),
                         [](const Entry& a, const Entry& b) { return a.used < b.used; }));
  }
  entries_.push_back(Entry{tensor, std::move(f), ++tick_});
}

namespace {

// acc[j] = fma(b[k], a[k * cols + j], acc[j]) for k = 0..r-1 in order, from acc = 0: the sum an F32
// GEMM of inner size r makes (torch's MKL sgemm on x86-64, measured bit for bit for r up to 128;
// beyond, MKL sums blocks of k separately). One rounding per step, as the FMA instruction does.
template <class Fma>
inline void product_row(const float* b, const float* a, uint64_t r, uint64_t cols, uint64_t m,
                        float* acc, Fma fma) {
  std::fill(acc, acc + m, 0.0f);
  for (uint64_t k = 0; k < r; ++k) {
    const float bk = b[k];
    const float* arow = a + k * cols;
    for (uint64_t j = 0; j < m; ++j) acc[j] = fma(bk, arow[j], acc[j]);
  }
}

#if defined(__x86_64__)
// With the FMA instruction, 32 or 8 columns at a time, each column's sum in one register lane (the
// same steps, in the same order, as product_row).
__attribute__((target("avx2,fma"))) void product_row_fma(const float* b, const float* a, uint64_t r,
                                                         uint64_t cols, uint64_t m, float* acc) {
  uint64_t j = 0;
  // 32 columns at a time: four independent chains, so the FMA unit is not waiting on one.
  for (; j + 32 <= m; j += 32) {
    __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
    for (uint64_t k = 0; k < r; ++k) {
      const __m256 bk = _mm256_set1_ps(b[k]);
      const float* ak = a + k * cols + j;
      c0 = _mm256_fmadd_ps(bk, _mm256_loadu_ps(ak), c0);
      c1 = _mm256_fmadd_ps(bk, _mm256_loadu_ps(ak + 8), c1);
      c2 = _mm256_fmadd_ps(bk, _mm256_loadu_ps(ak + 16), c2);
      c3 = _mm256_fmadd_ps(bk, _mm256_loadu_ps(ak + 24), c3);
    }
    _mm256_storeu_ps(acc + j, c0);
    _mm256_storeu_ps(acc + j + 8, c1);
    _mm256_storeu_ps(acc + j + 16, c2);
    _mm256_storeu_ps(acc + j + 24, c3);
  }
  for (; j + 8 <= m; j += 8) {
    __m256 c = _mm256_setzero_ps();
    for (uint64_t k = 0; k < r; ++k) {
      c = _mm256_fmadd_ps(_mm256_set1_ps(b[k]), _mm256_loadu_ps(a + k * cols + j), c);
    }
    _mm256_storeu_ps(acc + j, c);
  }
  for (; j < m; ++j) {
    float c = 0.0f;
    for (uint64_t k = 0; k < r; ++k) c = __builtin_fmaf(b[k], a[k * cols + j], c);
    acc[j] = c;
  }
}
#endif

// Elsewhere: libm's fmaf, the same single rounding.
void product_row_soft(const float* b, const float* a, uint64_t r, uint64_t cols, uint64_t m,
                      float* acc) {
  product_row(b, a, r, cols, m, acc, [](float x, float y, float z) { return std::fma(x, y, z); });
}

// Rounds F32 values to `d` and back (round to nearest even), in place: what `.to(d)` then a
// widening gives. F32 leaves them as they are.
void round_through(format::DType d, float* v, uint64_t n, std::vector<char>& tmp) {
  if (d == format::DType::F32) return;
  const uint64_t sz = format::dtype_bits(d) / 8;
  if (tmp.size() < n * sz) tmp.resize(n * sz);
  format::convert(format::DType::F32, d, v, tmp.data(), n);
  format::convert(d, format::DType::F32, tmp.data(), v, n);
}

// BF16 W served as BF16, in one pass: out = bf16(W + delta) with delta = scale * acc, rounded
// through BF16 first when lora_B is BF16 (kRound). The same operations, in the same order, as the
// general path below (whose format::convert uses these conversions), so the same bits.
template <bool kRound>
void merge_bf16(const float* acc, float scale, const char* w, char* out, uint64_t m) {
  using format::bits::bf16_to_f32;
  using format::bits::f32_to_bf16;
  for (uint64_t j = 0; j < m; ++j) {
    float d = acc[j] * scale;
    if constexpr (kRound) {
      d = std::bit_cast<float>(bf16_to_f32(f32_to_bf16(std::bit_cast<uint32_t>(d))));
    }
    uint16_t wv = 0;
    std::memcpy(&wv, w + 2 * j, 2);
    const float sum = std::bit_cast<float>(bf16_to_f32(wv)) + d;
    const uint16_t o = f32_to_bf16(std::bit_cast<uint32_t>(sum));
    std::memcpy(out + 2 * j, &o, 2);
  }
}

}  // namespace

void merge_elements(const LoraFactors& f, format::DType from, format::DType to, uint64_t elem,
                    const char* w, uint64_t n, char* out, MergeScratch& scratch) {
  const uint64_t isz = format::dtype_bits(from) / 8;
  const uint64_t osz = format::dtype_bits(to) / 8;
  if (scratch.f32.size() < 2 * f.cols) scratch.f32.resize(2 * f.cols);
  float* acc = scratch.f32.data();
  float* base = scratch.f32.data() + f.cols;
  std::vector<char>& tmp = scratch.round;
  uint64_t done = 0;
  while (done < n) {  // row by row: a run of columns of one row of W
    const uint64_t e = elem + done;
    const uint64_t row = e / f.cols;
    const uint64_t col = e % f.cols;
    const uint64_t m = std::min(f.cols - col, n - done);
    // (B @ A)[row, col..col+m) in F32, as get_delta_weight's matmul sums it.
#if defined(__x86_64__)
    static const bool fma_cpu = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const auto product = fma_cpu ? product_row_fma : product_row_soft;
#else
    const auto product = product_row_soft;
#endif
    product(f.b.data() + row * f.r, f.a.data() + col, f.r, f.cols, m, acc);
    if (from == format::DType::BF16 && to == format::DType::BF16 &&
        (f.delta == format::DType::BF16 || f.delta == format::DType::F32)) {
      char* dst = out + done * osz;
      if (f.delta == format::DType::BF16) {
        merge_bf16<true>(acc, f.scale, w + done * isz, dst, m);
      } else {
        merge_bf16<false>(acc, f.scale, w + done * isz, dst, m);
      }
      done += m;
      continue;
    }
    for (uint64_t j = 0; j < m; ++j) acc[j] *= f.scale;
    round_through(f.delta, acc, m, tmp);  // get_delta_weight's .to(lora_B's dtype)
    format::convert(from, format::DType::F32, w + done * isz, base, m);
    for (uint64_t j = 0; j < m; ++j) base[j] += acc[j];  // weight.data += delta, in F32
    char* dst = out + done * osz;
    if (to == from) {
      format::convert(format::DType::F32, from, base, dst, m);
    } else {  // rounded to W's dtype first, as the merged model holds it, then cast
      round_through(from, base, m, tmp);
      format::convert(format::DType::F32, to, base, dst, m);
    }
    done += m;
  }
}

}  // namespace ckptfs::io
