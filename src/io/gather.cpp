// io/gather: executes extent-map segments: one preadv per shard span, casts converted in blocks,
// merged LoRA weights read with their factors.
#include "ckptfs/io/gather.hpp"

#include <limits.h>
#include <sys/uio.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include <fmt/core.h>

#include "ckptfs/format/cast.hpp"
#include "ckptfs/io/transpose.hpp"

namespace ckptfs::io {
namespace {

// Per-thread scratch so the hot path allocates nothing once warm.
struct Scratch {
  std::vector<uint32_t> order;
  std::vector<uint64_t> dst_off;
  std::vector<iovec> iov;
  std::vector<char> sink = std::vector<char>(kGatherMaxGap);
  std::vector<char> cast;    // source elements of a cast segment, at most kCastBlock bytes
  std::vector<char> remote;  // one span of a node-local shard, scattered into the iovecs
  MergeScratch merge;        // io::merge_elements' buffers
  std::vector<char> merged;  // a block's merged elements, before the bytes asked for are copied
};

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

Status preadv_all(int fd, iovec* iov, int cnt, uint64_t off, const GatherSource& src,
                  uint32_t shard) {
  while (cnt > 0) {
    ssize_t n = ::preadv(fd, iov, cnt, static_cast<off_t>(off));
    if (n < 0) {
      if (errno == EINTR) continue;
      int e = errno;
      return make_error(e, "{}: read at offset {} failed: {}", src.name_of(shard), off,
                        std::strerror(e));
    }
    if (n == 0) {
      return make_error(EIO, "{}: unexpected end of file at offset {} (file shrank?)",
                        src.name_of(shard), off);
    }
    off += static_cast<uint64_t>(n);
    auto left = static_cast<size_t>(n);
    while (cnt > 0 && left >= iov->iov_len) {
      left -= iov->iov_len;
      ++iov;
      --cnt;
    }
    if (cnt > 0 && left > 0) {
      iov->iov_base = static_cast<char*>(iov->iov_base) + left;
      iov->iov_len -= left;
    }
  }
  return {};
}

// Reads a span of `cnt` iovecs at `off` with one call of `read` into a scratch buffer, then
// scatters it.
template <class Read>
Status read_scattered(iovec* iov, int cnt, uint64_t off, const Read& read) {
  uint64_t total = 0;
  for (int i = 0; i < cnt; ++i) total += iov[i].iov_len;
  auto& buf = scratch().remote;
  if (buf.size() < total) buf.resize(total);
  CKPTFS_CHECK(read(off, buf.data(), static_cast<size_t>(total)));
  const char* p = buf.data();
  for (int i = 0; i < cnt; ++i) {
    std::memcpy(iov[i].iov_base, p, iov[i].iov_len);
    p += iov[i].iov_len;
  }
  return {};
}

// preadv_all for any shard: a shard on a node-local target (fd -1) is read in one request to
// its owner through src.remote, and a staged shard of a file being written through
// src.staged, each then scattered into the iovecs.
Status read_span(const GatherSource& src, uint32_t shard, iovec* iov, int cnt, uint64_t off) {
  const int fd = src.fds[shard];
  if (fd >= 0) return preadv_all(fd, iov, cnt, off, src, shard);
  const layout::ShardFile* sf =
      src.ckpt && shard < src.ckpt->shards.size() ? &src.ckpt->shards[shard] : nullptr;
  if (sf && !sf->remote() && src.staged) {
    return read_scattered(
        iov, cnt, off, [&](uint64_t o, char* d, size_t n) { return src.staged(shard, o, d, n); });
  }
  if (!sf || !sf->remote()) return make_error(EIO, "{}: not open", src.name_of(shard));
  if (!src.remote) {
    return make_error(EIO,
                      "{}: stored on the node-local target of MPI rank {} ({}); only the head of "
                      "its `mpirun ckptfs mount -o target=...` job can read it",
                      src.name_of(shard), sf->owner, sf->remote_path);
  }
  return read_scattered(iov, cnt, off, [&](uint64_t o, char* d, size_t n) -> Status {
    if (auto st = src.remote->read(sf->owner, sf->remote_path, sf->stamp.size, o, d, n); !st) {
      return std::move(st).error().context(src.name_of(shard));
    }
    return {};
  });
}

// Reads the source elements of cast segment `g` block by block (kCastBlock bytes at most)
// and converts them into dst. Whole output elements convert in place; a partial first or
// last one converts into an 8-byte temporary and the bytes asked for are copied.
Status gather_cast(const GatherSource& src, const layout::Segment& g, char* dst,
                   std::vector<char>& buf) {
  const uint64_t isz = format::dtype_bits(g.from) / 8;
  const uint64_t osz = format::dtype_bits(g.to) / 8;
  const uint64_t total = g.elems();
  const uint64_t per_block = std::max<uint64_t>(1, kCastBlock / isz);
  if (buf.size() < std::min(total, per_block) * isz) buf.resize(std::min(total, per_block) * isz);
  uint64_t skip = g.skip;  // output bytes still to drop (first element only)
  uint64_t left = g.len;   // output bytes still to produce
  for (uint64_t e = 0; e < total; e += per_block) {
    const uint64_t n = std::min(per_block, total - e);
    iovec iov{buf.data(), static_cast<size_t>(n * isz)};
    CKPTFS_CHECK(read_span(src, g.shard, &iov, 1, g.src + e * isz));
    const char* in = buf.data();
    uint64_t k = 0;  // elements of this block done
    if (skip > 0) {
      char tmp[8];
      format::convert(g.from, g.to, in, tmp, 1);
      const uint64_t c = std::min(osz - skip, left);
      std::memcpy(dst, tmp + skip, c);
      dst += c;
      left -= c;
      skip = 0;
      k = 1;
    }
    const uint64_t whole = std::min(n - k, left / osz);
    format::convert(g.from, g.to, in + k * isz, dst, static_cast<size_t>(whole));
    dst += whole * osz;
    left -= whole * osz;
    k += whole;
    if (k < n && left > 0) {  // the partial last element
      char tmp[8];
      format::convert(g.from, g.to, in + k * isz, tmp, 1);
      std::memcpy(dst, tmp, left);
      dst += left;
      left = 0;
    }
  }
  return {};
}

// Reads the factors of merged tensor `tensor` (src.ckpt->tensors) through their output's plan
// (plain runs of the rank shards) and widens them to F32. Called before gather() touches its
// scratch: it gathers itself.
Result<std::shared_ptr<const LoraFactors>> read_factors(const GatherSource& src, uint32_t tensor) {
  const auto& ck = *src.ckpt;
  const layout::Tensor& w = ck.tensors[tensor];
  const layout::Tensor& A = ck.tensors[w.merge->a];
  const layout::Tensor& B = ck.tensors[w.merge->b];
  auto f = std::make_shared<LoraFactors>();
  f->r = A.shape[0];
  f->cols = w.shape[1];
  f->delta = B.dtype;
  f->scale = w.merge->scale;
  std::vector<layout::Segment> segs;
  std::vector<char> bytes;
  for (const layout::Tensor* t : {&A, &B}) {
    layout::map_range(ck, t->output, t->out_offset, t->nbytes, segs);
    bytes.resize(t->nbytes);
    GatherSource in = src;
    in.header = ck.outputs[t->output].header;
    CKPTFS_CHECK(gather(in, segs, bytes.data()));
    auto& out = t == &A ? f->a : f->b;
    out.resize(t->numel);
    format::convert(t->dtype, format::DType::F32, bytes.data(), out.data(), t->numel);
  }
  return std::shared_ptr<const LoraFactors>(std::move(f));
}

// The factors of every merged tensor that segs merges, in `held` (by tensor), from src.factors
// or read.
Status hold_factors(const GatherSource& src, std::span<const layout::Segment> segs,
                    std::vector<std::pair<uint32_t, std::shared_ptr<const LoraFactors>>>& held) {
  for (const auto& g : segs) {
    if (!g.is_merge()) continue;
    const uint32_t t = g.merge - 1;
    if (!src.ckpt || t >= src.ckpt->tensors.size() || !src.ckpt->tensors[t].merge) {
      return make_error(EIO, "{}: a merged weight's plan without its checkpoint",
                        src.name_of(g.shard));
    }
    if (std::any_of(held.begin(), held.end(), [&](const auto& h) { return h.first == t; })) {
      continue;
    }
    std::shared_ptr<const LoraFactors> f = src.factors ? src.factors->find(t) : nullptr;
    if (!f) {
      auto r = read_factors(src, t);
      if (!r) {
        return std::move(r).error().context(
            fmt::format("the LoRA factors of {}", src.ckpt->tensors[t].name));
      }
      f = std::move(r).value();
      if (src.factors) src.factors->add(t, f);
    }
    held.emplace_back(t, std::move(f));
  }
  return {};
}

// Reads the base elements of merge segment `g` block by block (kCastBlock source bytes at most),
// merges them with factors `f`, and copies the bytes asked for (skip, len) into dst.
Status gather_merge(const GatherSource& src, const layout::Segment& g, const LoraFactors& f,
                    char* dst, Scratch& s) {
  const uint64_t isz = format::dtype_bits(g.from) / 8;
  const uint64_t osz = format::dtype_bits(g.to) / 8;
  const uint64_t total = g.elems();
  const uint64_t per_block = std::max<uint64_t>(1, kCastBlock / isz);
  const uint64_t first = std::min(total, per_block);
  if (s.cast.size() < first * isz) s.cast.resize(first * isz);
  if (s.merged.size() < first * osz) s.merged.resize(first * osz);
  uint64_t skip = g.skip;
  uint64_t left = g.len;
  for (uint64_t e = 0; e < total && left > 0; e += per_block) {
    const uint64_t n = std::min(per_block, total - e);
    iovec iov{s.cast.data(), static_cast<size_t>(n * isz)};
    CKPTFS_CHECK(read_span(src, g.shard, &iov, 1, g.src + e * isz));
    merge_elements(f, g.from, g.to, g.elem + e, s.cast.data(), n, s.merged.data(), s.merge);
    const uint64_t c = std::min(n * osz - skip, left);
    std::memcpy(dst, s.merged.data() + skip, c);
    dst += c;
    left -= c;
    skip = 0;
  }
  return {};
}

// Copies the elements of strided segment `g` out of `buf`, which holds the shard's bytes
// [base, to), from element (skip + done) / esize on (it starts at or after `base`) while they
// lie in the buffer. Returns the output bytes written so far (`done` on entry).
uint64_t pick(const layout::Segment& g, const char* buf, uint64_t base, uint64_t to, char* dst,
              uint64_t done) {
  const uint64_t es = g.esize;
  for (uint64_t e = (g.skip + done) / es; done < g.len; ++e) {
    const uint64_t at = g.src + e * g.stride;
    if (at + es > to) break;
    const uint64_t skip = e == 0 ? g.skip : 0;
    const uint64_t n = std::min(es - skip, g.len - done);
    std::memcpy(dst + done, buf + (at - base) + skip, n);
    done += n;
  }
  return done;
}

// How many strided segments from segs[i] on are the next columns of one matrix: whole columns
// (no skip, every element) of the same shard, stride and length, each one element after the last.
size_t column_group(std::span<const layout::Segment> segs, size_t i) {
  const auto& g = segs[i];
  if (g.skip != 0 || g.len % g.esize != 0) return 1;
  size_t k = 1;
  while (i + k < segs.size()) {
    const auto& h = segs[i + k];
    if (!h.is_strided() || h.shard != g.shard || h.stride != g.stride || h.esize != g.esize ||
        h.skip != 0 || h.len != g.len || h.src != g.src + k * g.esize) {
      break;
    }
    ++k;
  }
  return k;
}

// Reads strided segments segs[i, i + k): k whole columns of one matrix (column_group), or one
// segment (k == 1) that may start or end inside an element. Their span, when it fits
// kStridedWindow and the source has StridedWindows, is read whole into a window, extended to the
// end of its last row, so the next columns (of this read and of the next reads of the file, by
// any thread) are copied from memory: a transposed tensor is read from its shard about once.
// Otherwise the span is read in kCastBlock pieces, each giving the elements it holds.
Status gather_strided(const GatherSource& src, std::span<const layout::Segment> segs, size_t i,
                      size_t k, char* dst, Scratch& s) {
  const auto& g = segs[i];
  const uint64_t es = g.esize;
  const uint64_t span = g.src_len() + (k - 1) * es;
  const layout::FileStamp* stamp =
      src.ckpt && g.shard < src.ckpt->shards.size() ? &src.ckpt->shards[g.shard].stamp : nullptr;
  if (src.windows && stamp && span <= kStridedWindow) {
    uint64_t base = 0;
    auto win = src.windows->find(*stamp, g.src, span, base);
    if (!win) {
      // From the start of the first row (the kernel's readahead hands a file's reads to several
      // threads: a later column may come first) to the end of the last, within the file.
      const uint64_t back = span + g.stride <= kStridedWindow ? std::min(g.src, g.stride - es) : 0;
      base = g.src - back;
      const uint64_t want = std::min(kStridedWindow, back + span - k * es + g.stride);
      const uint64_t have = stamp->size - std::min(stamp->size, base);
      const uint64_t len = std::max(back + span, std::min(want, have));
      auto w = src.windows->take(len);
      iovec iov{w->bytes.get(), static_cast<size_t>(len)};
      CKPTFS_CHECK(read_span(src, g.shard, &iov, 1, base));
      w->size = len;
      win = w;
      src.windows->add(*stamp, base, std::move(w));
    }
    const char* in = win->bytes.get() + (g.src - base);
    if (k > 1 || (g.skip == 0 && g.len % es == 0)) {
      transpose(in, g.stride, g.len / es, k, es, dst);
      return {};
    }
    pick(g, in, g.src, g.src + span, dst, 0);
    return {};
  }
  for (size_t j = 0; j < k; ++j) {  // piece by piece, one segment at a time
    const auto& h = segs[i + j];
    const uint64_t hspan = h.src_len();
    std::vector<char>& buf = s.cast;
    char* out = dst + j * g.len;
    uint64_t done = 0;
    while (done < h.len) {
      // A block starts at an element and holds whole elements: at least one, so each turn
      // gives some.
      const uint64_t at = h.src + (h.skip + done) / es * h.stride;
      const uint64_t n = std::min<uint64_t>(std::max<uint64_t>(kCastBlock, es), h.src + hspan - at);
      if (buf.size() < n) buf.resize(n);
      iovec iov{buf.data(), static_cast<size_t>(n)};
      CKPTFS_CHECK(read_span(src, h.shard, &iov, 1, at));
      done = pick(h, buf.data(), at, at + n, out, done);
    }
  }
  return {};
}

}  // namespace

std::shared_ptr<const StridedWindows::Window> StridedWindows::find(const layout::FileStamp& stamp,
                                                                   uint64_t off, uint64_t len,
                                                                   uint64_t& base) const {
  std::lock_guard lk(mu_);
  for (auto& e : entries_) {
    if (e.stamp == stamp && off >= e.off && off + len <= e.off + e.window->size) {
      e.used = ++tick_;
      base = e.off;
      return e.window;
    }
  }
  return nullptr;
}

std::shared_ptr<StridedWindows::Window> StridedWindows::take(uint64_t size) {
  {
    std::lock_guard lk(mu_);
    if (spare_ && spare_.use_count() == 1 && spare_->capacity >= size) {
      // Nobody else holds it: no reader copies from it any more, so it may be written.
      auto w = std::const_pointer_cast<Window>(std::move(spare_));
      spare_.reset();
      return w;
    }
  }
  auto w = std::make_shared<Window>();
  w->bytes = std::make_unique_for_overwrite<char[]>(size);
  w->capacity = size;
  return w;
}

void StridedWindows::add(const layout::FileStamp& stamp, uint64_t off,
                         std::shared_ptr<const Window> w) {
  std::lock_guard lk(mu_);
  if (entries_.size() >= kStridedWindows) {
    auto lru = std::min_element(entries_.begin(), entries_.end(),
                                [](const Entry& a, const Entry& b) { return a.used < b.used; });
    spare_ = std::move(lru->window);
    entries_.erase(lru);
  }
  entries_.push_back(Entry{stamp, off, std::move(w), ++tick_});
}

std::string GatherSource::name_of(uint32_t shard) const {
  if (ckpt && shard < ckpt->shards.size()) return ckpt->dir + "/" + ckpt->shards[shard].name;
  return std::string(file);
}

Status gather(const GatherSource& src, std::span<const layout::Segment> segs, char* dst) {
  // Merged LoRA weights' factors first: reading them gathers, which reuses the scratch.
  std::vector<std::pair<uint32_t, std::shared_ptr<const LoraFactors>>> held;
  CKPTFS_CHECK(hold_factors(src, segs, held));
  auto& s = scratch();
  s.order.clear();
  s.dst_off.resize(segs.size());
  uint64_t pos = 0;
  for (uint32_t i = 0; i < segs.size(); ++i) {
    s.dst_off[i] = pos;
    const auto& g = segs[i];
    if (g.is_memory()) {
      std::memcpy(dst + pos, src.header.data() + g.src, g.len);
    } else if (g.is_strided()) {
      const size_t k = column_group(segs, i);
      CKPTFS_CHECK(gather_strided(src, segs, i, k, dst + pos, s));
      for (size_t j = 1; j < k; ++j) {
        pos += segs[i].len;
        s.dst_off[++i] = pos;
      }
    } else if (g.is_merge()) {
      const auto& f = std::find_if(held.begin(), held.end(), [&](const auto& h) {
                        return h.first == g.merge - 1;
                      })->second;
      CKPTFS_CHECK(gather_merge(src, g, *f, dst + pos, s));
    } else if (g.is_cast()) {
      CKPTFS_CHECK(gather_cast(src, g, dst + pos, s.cast));
    } else {
      s.order.push_back(i);
    }
    pos += g.len;
  }
  std::sort(s.order.begin(), s.order.end(), [&](uint32_t a, uint32_t b) {
    return segs[a].shard != segs[b].shard ? segs[a].shard < segs[b].shard
                                          : segs[a].src < segs[b].src;
  });
  size_t i = 0;
  while (i < s.order.size()) {
    const uint32_t shard = segs[s.order[i]].shard;
    const uint64_t start = segs[s.order[i]].src;
    uint64_t end = start;
    s.iov.clear();
    while (i < s.order.size() && segs[s.order[i]].shard == shard && s.iov.size() + 2 <= IOV_MAX) {
      const auto& g = segs[s.order[i]];
      // Two tensors may share stored bytes (verl's tied embedding and lm_head are one storage):
      // a segment starting before the span's end starts a span of its own.
      if (g.src < end) break;
      if (g.src > end) {
        if (g.src - end > kGatherMaxGap) break;
        s.iov.push_back(iovec{s.sink.data(), static_cast<size_t>(g.src - end)});
      }
      s.iov.push_back(iovec{dst + s.dst_off[s.order[i]], static_cast<size_t>(g.len)});
      end = g.src + g.len;
      ++i;
    }
    CKPTFS_CHECK(read_span(src, shard, s.iov.data(), static_cast<int>(s.iov.size()), start));
  }
  return {};
}

}  // namespace ckptfs::io
