// layout/extent_map: the one byte geometry: consolidated ranges to shard segments (map_range).
#include "ckptfs/layout/extent_map.hpp"

#include <algorithm>

namespace ckptfs::layout {
namespace {

inline void emit(std::vector<Segment>& out, uint32_t shard, uint64_t src, uint64_t len) {
  if (len == 0) return;
  if (!out.empty()) {
    auto& last = out.back();
    if (last.shard == shard && !last.is_transformed() && last.src + last.len == src) {
      last.len += len;
      return;
    }
  }
  out.push_back(Segment{shard, src, len});
}

inline bool whole_chunk(const Tensor& t) {
  return t.chunks.size() == 1 && t.chunks[0].sizes == t.shape;
}

// Describes the run of chunk `c` that holds full-tensor coordinates `x`: its first element
// in the consolidated tensor, its first element in the chunk, and its length in elements.
struct RunPos {
  uint64_t out_elem;
  uint64_t chunk_elem;
  uint64_t elems;
};

inline RunPos run_at(const Tensor& t, const Chunk& c, const uint64_t* x) {
  const size_t k = c.run_dim;
  uint64_t out = c.offsets[k] * t.strides[k];
  uint64_t in = 0;
  uint64_t cstride = c.sizes[k] * t.strides[k];  // chunk stride of dim k-1
  for (size_t d = k; d-- > 0;) {
    out += x[d] * t.strides[d];
    in += (x[d] - c.offsets[d]) * cstride;
    cstride *= c.sizes[d];
  }
  return RunPos{out, in, c.sizes[k] * t.strides[k]};
}

// Finds the chunk and run holding an element (a row-major index into the full tensor),
// without allocating for tensors of up to 16 dims.
class RunFinder {
 public:
  explicit RunFinder(const Tensor& t) : t_(t) {
    if (t.shape.size() > 16) big_.resize(t.shape.size());
  }
  // Null when no chunk holds it (never for a validated tensor).
  const Chunk* at(uint64_t elem, RunPos& rp) {
    uint64_t* coords = big_.empty() ? small_ : big_.data();
    for (size_t d = 0; d < t_.shape.size(); ++d) {
      coords[d] = elem / t_.strides[d];
      elem -= coords[d] * t_.strides[d];
    }
    const uint32_t ci = find_chunk(t_, coords);
    if (ci == UINT32_MAX) return nullptr;
    const Chunk& c = t_.chunks[ci];
    rp = run_at(t_, c, coords);
    return &c;
  }

 private:
  const Tensor& t_;
  uint64_t small_[16];
  std::vector<uint64_t> big_;
};

// A cast segment of `t` (merge 0), or a merge segment of tensor merge - 1 whose first element is
// `elem`, appended to the last one where it continues it.
inline void emit_cast(std::vector<Segment>& out, const Tensor& t, uint32_t shard, uint64_t src,
                      uint64_t len, uint8_t skip, uint32_t merge, uint64_t elem) {
  if (len == 0) return;
  if (!out.empty()) {
    auto& last = out.back();
    const uint64_t osz = format::dtype_bits(t.dtype) / 8;
    if (skip == 0 && last.shard == shard && !last.is_strided() && last.from == t.src_dtype &&
        last.to == t.dtype && (last.skip + last.len) % osz == 0 &&
        last.src + last.src_len() == src && last.merge == merge &&
        (merge == 0 || last.elem + last.elems() == elem)) {
      last.len += len;
      return;
    }
  }
  Segment g{shard, src, len};
  g.from = t.src_dtype;
  g.to = t.dtype;
  g.skip = skip;
  g.merge = merge;
  g.elem = merge == 0 ? 0 : elem;
  out.push_back(g);
}

// Maps bytes [a, b) of a cast tensor to runs of whole source elements: the elements that
// hold output bytes [a, b), the first `a % osz` bytes of the first one skipped. `merge`: 1 + the
// tensor's index when it is a merged LoRA weight (merge segments, which may have from == to).
void map_cast_tensor(const Tensor& t, uint64_t a, uint64_t b, std::vector<Segment>& out,
                     uint32_t merge = 0) {
  const uint64_t osz = format::dtype_bits(t.dtype) / 8;
  const uint64_t isz = format::dtype_bits(t.src_dtype) / 8;
  const uint64_t ea = a / osz;
  const uint64_t eb = (b + osz - 1) / osz;
  if (whole_chunk(t)) {
    const auto& c = t.chunks[0];
    emit_cast(out, t, c.shard, c.file_offset + ea * isz, b - a, static_cast<uint8_t>(a % osz),
              merge, ea);
    return;
  }
  RunFinder runs(t);
  uint64_t p = ea;
  while (p < eb) {
    RunPos rp{};
    const Chunk* c = runs.at(p, rp);
    if (!c) return;  // unreachable for a validated tensor
    const uint64_t delta = p - rp.out_elem;
    const uint64_t n = std::min(rp.elems - delta, eb - p);
    // Output bytes of elements [p, p + n), clipped to [a, b).
    const uint64_t lo = std::max(a, p * osz);
    const uint64_t hi = std::min(b, (p + n) * osz);
    emit_cast(out, t, c->shard, c->file_offset + (rp.chunk_elem + delta) * isz, hi - lo,
              static_cast<uint8_t>(lo - p * osz), merge, p);
    p += n;
  }
}

// Maps bytes [a, b) of tensor `t` (relative to its data start) to shard runs.
void map_tensor(const Tensor& t, uint64_t a, uint64_t b, std::vector<Segment>& out) {
  if (t.is_cast()) {
    map_cast_tensor(t, a, b, out);
    return;
  }
  if (whole_chunk(t)) {
    const auto& c = t.chunks[0];
    emit(out, c.shard, c.file_offset + a, b - a);
    return;
  }
  const uint64_t bits = format::dtype_bits(t.dtype);
  RunFinder runs(t);
  uint64_t p = a;
  while (p < b) {
    RunPos rp{};
    const Chunk* c = runs.at((p * 8) / bits, rp);
    if (!c) return;  // unreachable for a validated tensor
    const uint64_t run_start = rp.out_elem * bits / 8;
    const uint64_t run_bytes = rp.elems * bits / 8;
    const uint64_t delta = p - run_start;
    const uint64_t n = std::min(run_bytes - delta, b - p);
    emit(out, c->shard, c->file_offset + rp.chunk_elem * bits / 8 + delta, n);
    p += n;
  }
}

// Maps bytes [a, a + n) of the elements `first`, `first + stride`, ... of stored tensor `s`
// (`stride` a stride of one of its axes: a transposed matrix's column) to strided segments, one
// per chunk the column crosses. A cast tensor, or a stride of no axis, is mapped element by
// element (correct, and slow; no built-in map does either).
void map_strided(const Tensor& s, uint64_t first, uint64_t stride, uint64_t a, uint64_t n,
                 std::vector<Segment>& out) {
  const uint64_t esz = format::dtype_bits(s.dtype) / 8;
  const size_t rank = s.shape.size();
  size_t d = rank;
  for (size_t k = 0; k < rank; ++k) {
    if (s.strides[k] == stride && s.shape[k] > 1) d = k;
  }
  uint64_t j = a / esz;  // the element of the column the next byte is in
  uint64_t skip = a % esz;
  const uint64_t end = a + n;
  uint64_t pos = a;
  if (s.is_cast() || d == rank || rank > 16) {
    for (; pos < end; ++j, skip = 0) {
      const uint64_t e = (first + j * stride) * esz;
      const uint64_t m = std::min(esz - skip, end - pos);
      map_tensor(s, e + skip, e + skip + m, out);
      pos += m;
    }
    return;
  }
  uint64_t x[16];
  while (pos < end) {
    uint64_t elem = first + j * stride;
    for (size_t k = 0; k < rank; ++k) {
      x[k] = elem / s.strides[k];
      elem -= x[k] * s.strides[k];
    }
    const uint32_t ci = find_chunk(s, x);
    if (ci == UINT32_MAX) return;  // unreachable for a validated tensor
    const Chunk& c = s.chunks[ci];
    uint64_t local = 0;  // the element's index in the chunk, and the chunk's stride of axis d
    uint64_t cstride = 1;
    uint64_t dstride = 1;
    for (size_t k = rank; k-- > 0;) {
      if (k == d) dstride = cstride;
      local += (x[k] - c.offsets[k]) * cstride;
      cstride *= c.sizes[k];
    }
    const uint64_t left = c.offsets[d] + c.sizes[d] - x[d];  // elements of the column in it
    const uint64_t m = std::min(left * esz - skip, end - pos);
    const uint64_t at = c.file_offset + local * esz;
    if (skip + m > esz && dstride > 1) {  // several elements apart: picked at the chunk's stride
      Segment g{c.shard, at, m};
      g.skip = static_cast<uint8_t>(skip);
      g.esize = static_cast<uint8_t>(esz);
      g.stride = dstride * esz;
      out.push_back(g);
    } else {  // a part of one element, or axis d is the chunk's last: a plain run
      emit(out, c.shard, at + skip, m);
    }
    pos += m;
    j += (skip + m) / esz;
    skip = 0;
  }
}

// Maps bytes [a, b) of a tensor made by a model map: each block of its runs is a byte range of
// a stored tensor, mapped as that tensor's own bytes are (its chunks, its cast); a run of
// single elements at a stride (a transposed matrix's column) becomes strided segments.
void map_mapped_tensor(const Checkpoint& ck, const Tensor& t, uint64_t a, uint64_t b,
                       std::vector<Segment>& out) {
  const uint64_t esz = format::dtype_bits(t.dtype) / 8;  // maps refuse sub-byte dtypes
  const uint64_t first = a / esz;
  auto it = std::upper_bound(t.runs.begin(), t.runs.end(), first,
                             [](uint64_t e, const MapRun& r) { return e < r.out_elem; });
  size_t i = it == t.runs.begin() ? 0 : static_cast<size_t>(it - t.runs.begin()) - 1;
  uint64_t pos = a;
  while (pos < b && i < t.runs.size()) {
    const MapRun& r = t.runs[i];
    const uint64_t block = r.len * esz;
    const uint64_t rep = block * r.count;  // bytes of one repetition
    const uint64_t rel = pos - r.out_elem * esz;
    const uint64_t q = rel / rep;
    if (q >= r.reps) {
      ++i;
      continue;
    }
    const uint64_t in_rep = rel - q * rep;
    const uint64_t rep_src = r.src_elem + q * r.rep_stride;
    if (r.len == 1 && r.count > 1) {
      const uint64_t n = std::min(rep - in_rep, b - pos);
      map_strided(ck.stored[r.src], rep_src, r.stride, in_rep, n, out);
      pos += n;
      continue;
    }
    const uint64_t k = in_rep / block;
    const uint64_t within = in_rep - k * block;
    const uint64_t n = std::min(block - within, b - pos);
    const uint64_t src = (rep_src + k * r.stride) * esz + within;
    map_tensor(ck.stored[r.src], src, src + n, out);
    pos += n;
  }
}

}  // namespace

uint32_t find_chunk(const Tensor& t, const uint64_t* x) {
  const size_t r = t.shape.size();
  const auto& g = t.grid;
  if (!g.cell_chunk.empty()) {
    uint64_t cell = 0;
    for (size_t d = 0; d < r; ++d) {
      const auto& b = g.bounds[d];
      auto i = static_cast<uint64_t>(std::upper_bound(b.begin(), b.end(), x[d]) - b.begin()) - 1;
      cell = cell * (b.size() - 1) + i;
    }
    return g.cell_chunk[cell];
  }
  for (uint32_t ci = 0; ci < t.chunks.size(); ++ci) {
    const auto& c = t.chunks[ci];
    bool in = true;
    for (size_t d = 0; d < r && in; ++d) {
      in = x[d] >= c.offsets[d] && x[d] < c.offsets[d] + c.sizes[d];
    }
    if (in) return ci;
  }
  return UINT32_MAX;
}

void map_range(const Checkpoint& ckpt, uint32_t file, uint64_t off, uint64_t len,
               std::vector<Segment>& out) {
  out.clear();
  const auto& f = ckpt.outputs[file];
  if (off >= f.size) return;
  const uint64_t end = off + std::min(len, f.size - off);
  uint64_t pos = off;
  const uint64_t hsize = f.header.size();
  if (pos < hsize) {
    uint64_t n = std::min(end, hsize) - pos;
    out.push_back(Segment{Segment::kMemory, pos, n});
    pos += n;
  }
  if (pos >= end) return;
  // First non-empty tensor whose data ends after pos.
  auto it = std::upper_bound(f.data_starts.begin(), f.data_starts.end(), pos);
  size_t i = static_cast<size_t>(it - f.data_starts.begin());
  if (i > 0) --i;
  for (; i < f.data_tensors.size() && pos < end; ++i) {
    const Tensor& t = ckpt.tensors[f.data_tensors[i]];
    const uint64_t tend = std::min(end, t.out_offset + t.nbytes);
    if (tend <= pos) continue;
    if (t.mapped) {
      map_mapped_tensor(ckpt, t, pos - t.out_offset, tend - t.out_offset, out);
    } else if (t.merge) {
      map_cast_tensor(t, pos - t.out_offset, tend - t.out_offset, out, f.data_tensors[i] + 1);
    } else {
      map_tensor(t, pos - t.out_offset, tend - t.out_offset, out);
    }
    pos = tend;
  }
}

}  // namespace ckptfs::layout
