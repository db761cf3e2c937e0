// io/merge: a merged LoRA weight's arithmetic (layout::Segment::is_merge): its factors widened
// to F32 and kept per view, and W + scale * (B @ A) for a run of W's elements, rounded as PEFT's
// merge_and_unload() rounds on CPU (layout/lora.hpp). No I/O: io/gather reads the bytes.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "ckptfs/format/dtype.hpp"

namespace ckptfs::io {

// One LoRA layer's factors, as the merge uses them.
struct LoraFactors {
  std::vector<float> a;  // lora_A [r, cols], row-major, widened to F32 (exactly)
  std::vector<float> b;  // lora_B [rows, r], row-major, widened to F32 (exactly)
  uint64_t r = 0, cols = 0;
  format::DType delta = format::DType::F32;  // lora_B's dtype: the delta is rounded to it
  float scale = 0;
};

// How many layers' factors one FactorCache keeps (the least recently used is let go): a read
// of a view touches the one or two weights it spans, and the kernel's readahead keeps them in
// file order, so each layer's factors are read about once. At most this many layers' A and B
// in F32 are held per view (2 * r * (rows + cols) * 4 bytes each: 1 MiB for r = 16 and a
// 4096 x 4096 weight).
inline constexpr size_t kFactorsKept = 8;

// The factors of the merged weights of one Checkpoint, shared by the threads reading its view
// (internally locked). Keyed by the merged tensor's index in Checkpoint::tensors.
class FactorCache {
 public:
  [[nodiscard]] std::shared_ptr<const LoraFactors> find(uint32_t tensor) const;
  void add(uint32_t tensor, std::shared_ptr<const LoraFactors> f);

 private:
  struct Entry {
    uint32_t tensor = 0;
    std::shared_ptr<const LoraFactors> factors;
    uint64_t used = 0;
  };
  mutable std::mutex mu_;  // guards entries_ and tick_ (factors are immutable once added)
  mutable std::vector<Entry> entries_;
  mutable uint64_t tick_ = 0;
};

// A merging thread's buffers, reused between calls (io::gather keeps one per thread).
struct MergeScratch {
  std::vector<float> f32;   // a row's delta and base elements
  std::vector<char> round;  // F32 values rounded through a narrower dtype
};

// Merges `n` elements of W starting at element `elem` (row-major in W [rows, cols]): `w` holds
// them as `from`, `out` receives them as `to` (the served dtype; a cast after the merge when it
// differs). Both dtypes are F16, BF16 or F32 (to may be F64).
void merge_elements(const LoraFactors& f, format::DType from, format::DType to, uint64_t elem,
                    const char* w, uint64_t n, char* out, MergeScratch& scratch);

}  // namespace ckptfs::io
