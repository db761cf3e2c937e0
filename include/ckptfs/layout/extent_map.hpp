// The extent map: which bytes produce a byte range of a consolidated file.
//
// Forward (reads): consolidated (file, offset, length) -> ordered segments, each either
// header bytes from memory, a run of bytes in one shard file, (a tensor served in another
// dtype than stored) a run of elements in one shard file to convert, (a transposed tensor)
// elements picked at a stride, or (a merged LoRA weight) a run of elements to merge with their
// LoRA factors. Adjacent runs that are
// contiguous in the same shard are coalesced, so a row-sharded tensor is one run per chunk.
//
// The one byte geometry between chunks and consolidated files: reads of the mount, the write
// router (which sends each written byte where map_range will read it back from), consolidate and
// the loader all go through map_range.
#pragma once

#include <cstdint>
#include <vector>

#include "ckptfs/layout/checkpoint.hpp"

namespace ckptfs::layout {

struct Segment {
  static constexpr uint32_t kMemory = UINT32_MAX;
  uint32_t shard = kMemory;  // index into Checkpoint::shards, or kMemory for header bytes
  uint64_t src = 0;          // byte offset in the shard file, or in OutputFile::header
  uint64_t len = 0;          // bytes this segment produces
  // A cast segment (from != to): the elements of dtype `from` starting at `src` are
  // converted to `to`, and the `len` bytes produced start `skip` bytes into the first
  // converted element (a read need not start or end on an element boundary). Never spliced.
  format::DType from = format::DType::U8;
  format::DType to = format::DType::U8;
  uint8_t skip = 0;
  // A strided segment (stride != 0; a transposed tensor's column, layout::MapRun): elements of
  // `esize` bytes at `src`, `src + stride`, ...; the `len` bytes produced start `skip` bytes into
  // the first. Never cast, never spliced.
  uint8_t esize = 0;
  uint64_t stride = 0;
  // A merge segment (merge != 0; a merged LoRA weight, Tensor::merge): the whole elements of
  // dtype `from` at `src` are elements `elem`, `elem + 1`, ... of tensor `merge - 1`
  // (Checkpoint::tensors), each merged with its LoRA factors (io/merge.hpp) and given as `to`
  // (as a cast segment, `skip` and `len` say which bytes). Never spliced.
  uint32_t merge = 0;
  uint64_t elem = 0;

  [[nodiscard]] bool is_memory() const { return shard == kMemory; }
  [[nodiscard]] bool is_cast() const { return from != to; }
  [[nodiscard]] bool is_strided() const { return stride != 0; }
  [[nodiscard]] bool is_merge() const { return merge != 0; }
  // Its bytes are not a run of the shard as it lies: they exist only once gathered.
  [[nodiscard]] bool is_transformed() const { return is_cast() || is_strided() || is_merge(); }
  // Elements converted (cast and merge segments) or picked (strided ones), and the source bytes
  // they span (every shard segment).
  [[nodiscard]] uint64_t elems() const {
    const uint64_t osz = is_strided() ? esize : format::dtype_bits(to) / 8;
    return (skip + len + osz - 1) / osz;
  }
  [[nodiscard]] uint64_t src_len() const {
    if (is_strided()) return (elems() - 1) * stride + esize;
    return is_cast() || is_merge() ? elems() * (format::dtype_bits(from) / 8) : len;
  }
  bool operator==(const Segment&) const = default;
};

// Appends to `out` (cleared first) the segments producing [off, off + len) of output file
// `file`; the range is clamped to the file size. Allocation-free once `out` has capacity.
void map_range(const Checkpoint& ckpt, uint32_t file, uint64_t off, uint64_t len,
               std::vector<Segment>& out);

// Which chunk of `t` holds the element at coordinates `coords` (full tensor coordinates).
// Returns UINT32_MAX when none does (never for a validated tensor).
uint32_t find_chunk(const Tensor& t, const uint64_t* coords);

}  // namespace ckptfs::layout
