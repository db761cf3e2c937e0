#include "ckptfs/write/router.hpp"

#include <algorithm>

#include <fmt/format.h>

#include "ckptfs/util/checked.hpp"

namespace ckptfs::write {

Result<StreamRouter> StreamRouter::create(std::string header_bytes, const format::Header& h,
                                          const Plan& p, const ShardSet& s, ShardSink& sink,
                                          std::string what) {
  if (header_bytes.size() != h.data_start()) {
    return make_error(EINVAL, "{}: {} header bytes given for a header of {}", what,
                      header_bytes.size(), h.data_start());
  }
  if (p.tensors.size() != h.tensors.size() || s.shards.size() != p.ranks ||
      s.chunk_offset.size() != h.tensors.size()) {
    return make_error(EINVAL, "{}: plan or shard set does not belong to this header", what);
  }
  StreamRouter r;
  r.what_ = std::move(what);
  r.header_ = std::move(header_bytes);
  r.sink_ = &sink;
  r.file_size_ = h.file_size();
  for (const auto& sh : s.shards) r.shard_headers_.push_back(sh.header);
  for (uint32_t i = 0; i < h.tensors.size(); ++i) {
    const auto& t = h.tensors[i];
    const auto& tp = p.tensors[i];
    r.names_.push_back(t.name);
    auto bad = [&](std::string_view why) {
      return make_error(EINVAL, "{}: tensor '{}': {}", r.what_, t.name, why);
    };
    if (tp.name != t.name || s.chunk_offset[i].size() != tp.chunks.size()) {
      return bad("plan entry does not match the header");
    }
    if (t.nbytes() == 0) continue;  // nothing to route; its (empty) chunk is in the header
    Route route;
    route.begin = h.data_start() + t.begin;
    route.end = h.data_start() + t.end;
    route.tensor = i;
    route.first_piece = static_cast<uint32_t>(r.pieces_.size());
    const bool whole = tp.split_dim == TensorPlan::kWhole;
    const size_t d = whole ? 0 : tp.split_dim;
    if (!whole && d >= t.shape.size()) return bad("split dim out of range");
    // rows: product of the dims before d; each row holds shape[d] units of `unit` bytes.
    auto rows = whole ? std::optional<uint64_t>(1) : checked_numel(std::span(t.shape).first(d));
    if (!rows || *rows == 0 || t.nbytes() % *rows != 0) return bad("rows do not divide the data");
    route.row_bytes = t.nbytes() / *rows;
    uint64_t col = 0;
    for (size_t c = 0; c < tp.chunks.size(); ++c) {
      const auto& ch = tp.chunks[c];
      if (ch.rank >= p.ranks) return bad("chunk on a rank out of range");
      if (ch.offsets.size() != t.shape.size() || ch.sizes.size() != t.shape.size()) {
        return bad("chunk rank (dims) differs from the tensor's");
      }
      for (size_t k = 0; k < t.shape.size(); ++k) {
        if (k != d && (ch.offsets[k] != 0 || ch.sizes[k] != t.shape[k])) {
          return bad(fmt::format("chunk {} does not span dim {}", c, k));
        }
      }
      if (ch.nbytes % *rows != 0) return bad(fmt::format("chunk {} rows are not whole", c));
      Piece pc;
      pc.col = col;
      pc.len = ch.nbytes / *rows;
      pc.rank = ch.rank;
      pc.shard_offset = s.chunk_offset[i][c];
      // The chunk must start where the previous one ended, in bytes of the row.
      if (!t.shape.empty()) {
        auto unit_elems = checked_numel(std::span(t.shape).subspan(d + 1));
        auto start_bits = unit_elems ? checked_mul(ch.offsets[d], *unit_elems) : std::nullopt;
        if (start_bits) start_bits = checked_mul(*start_bits, format::dtype_bits(t.dtype));
        if (!start_bits || *start_bits % 8 != 0 || *start_bits / 8 != col) {
          return bad(fmt::format("chunk {} does not start where chunk {} ends", c, c - 1));
        }
      }
      if (pc.len == 0) return bad(fmt::format("chunk {} is empty", c));
      col += pc.len;
      r.pieces_.push_back(pc);
    }
    if (col != route.row_bytes) return bad("chunks do not cover the tensor");
    route.pieces = static_cast<uint32_t>(r.pieces_.size() - route.first_piece);
    r.routes_.push_back(route);
  }
  return r;
}

Status StreamRouter::fail(Error e) {
  failed_ = true;
  return e;
}

Status StreamRouter::write(uint64_t file_offset, std::string_view bytes) {
  if (failed_) {
    return make_error(kNeedsStaging, "{}: stream routing already abandoned", what_);
  }
  if (file_offset != pos_) {
    return fail(make_error(kNeedsStaging, "{}: write at offset {} but the next byte is {} ({})",
                           what_, file_offset, pos_,
                           file_offset < pos_ ? "backwards or a rewrite" : "a hole"));
  }
  if (bytes.size() > file_size_ - pos_) {
    return fail(make_error(kNeedsStaging,
                           "{}: write of {} bytes at {} runs past the {} bytes the header "
                           "describes",
                           what_, bytes.size(), pos_, file_size_));
  }
  if (pos_ < header_.size()) {
    const size_t n = std::min<uint64_t>(bytes.size(), header_.size() - pos_);
    if (bytes.substr(0, n) != std::string_view(header_).substr(pos_, n)) {
      return fail(make_error(kNeedsStaging,
                             "{}: header bytes in [{}, {}) differ from the header "
                             "the file was detected with",
                             what_, pos_, pos_ + n));
    }
    pos_ += n;
    bytes.remove_prefix(n);
    if (pos_ == header_.size()) {
      for (uint32_t r = 0; r < shard_headers_.size(); ++r) {
        auto st = sink_->pwrite(r, 0, shard_headers_[r]);
        if (!st) {
          Error e = std::move(st).error();
          if (e.code == kNeedsStaging) e.code = EIO;
          return fail(std::move(e).context(fmt::format("{}: shard header of rank {}", what_, r)));
        }
      }
    }
  }
  return route_data(bytes);
}

StreamRouter::Hit StreamRouter::locate(const Route& rt, uint64_t x) const {
  const uint64_t p = x - rt.begin;
  const uint64_t row = p / rt.row_bytes;
  const uint64_t col = p % rt.row_bytes;
  // The last piece whose first byte is at or before `col`.
  const Piece* first = pieces_.data() + rt.first_piece;
  const Piece* pc = std::upper_bound(first, first + rt.pieces, col,
                                     [](uint64_t c, const Piece& y) { return c < y.col; }) -
                    1;
  return Hit{pc->rank, pc->shard_offset + row * pc->len + (col - pc->col), pc->col + pc->len - col};
}

Status StreamRouter::route_data(std::string_view bytes) {
  while (!bytes.empty()) {
    while (routes_[cursor_].end <= pos_) ++cursor_;  // in range: pos_ < file_size_
    const Route& rt = routes_[cursor_];
    const Hit h = locate(rt, pos_);
    const uint64_t n = std::min<uint64_t>(bytes.size(), h.run);
    auto st = sink_->pwrite(h.rank, h.shard_offset, bytes.substr(0, n));
    if (!st) {
      Error e = std::move(st).error();
      if (e.code == kNeedsStaging) e.code = EIO;
      return fail(std::move(e).context(
          fmt::format("{}: tensor '{}': rank {}", what_, names_[rt.tensor], h.rank)));
    }
    pos_ += n;
    bytes.remove_prefix(n);
  }
  return {};
}

Result<size_t> StreamRouter::read(uint64_t off, size_t len, char* dst,
                                  const ShardRead& pread) const {
  if (off >= file_size_) return size_t{0};
  const uint64_t end = off + std::min<uint64_t>(len, file_size_ - off);
  uint64_t x = off;
  while (x < end) {
    char* out = dst + (x - off);
    if (x < header_.size()) {
      const uint64_t n = std::min<uint64_t>(end, header_.size()) - x;
      std::copy_n(header_.data() + x, n, out);
      x += n;
      continue;
    }
    // The route holding x: the last one starting at or before it (the data tiles the file).
    auto it = std::upper_bound(routes_.begin(), routes_.end(), x,
                               [](uint64_t v, const Route& r) { return v < r.begin; });
    if (it == routes_.begin() || (it - 1)->end <= x) {
      return make_error(EIO, "{}: byte {} belongs to no tensor", what_, x);
    }
    const Hit h = locate(*(it - 1), x);
    const uint64_t n = std::min<uint64_t>(end - x, h.run);
    CKPTFS_CHECK(pread(h.rank, h.shard_offset, out, static_cast<size_t>(n)));
    x += n;
  }
  return static_cast<size_t>(end - off);
}

}  // namespace ckptfs::write
