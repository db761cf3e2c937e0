// write/router: routes a written file's bytes into rank shards through layout's geometry.
#include "ckptfs/write/router.hpp"

#include <algorithm>

#include <fmt/format.h>

#include "ckptfs/io/gather.hpp"
#include "ckptfs/util/checked.hpp"
#include "ckptfs/util/fd.hpp"

namespace ckptfs::write {

Result<StreamRouter> StreamRouter::create(std::string header_bytes,
                                          std::shared_ptr<const format::Header> hp, const Plan& p,
                                          const layout::ShardSet& s, ShardSink& sink,
                                          std::string what) {
  if (!hp) return make_error(EINVAL, "{}: no header", what);
  const format::Header& h = *hp;
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
  r.parsed_ = std::move(hp);
  for (const auto& sh : s.shards) {
    r.shard_headers_.push_back(sh.header);
    r.shard_parsed_.push_back(sh.parsed);
  }
  r.no_fds_.assign(p.ranks, -1);
  if (h.tensors.empty()) return r;  // all header: nothing to route, no geometry

  // The plan's chunks, declared to the layout builder as they will sit in the shards, and this
  // header as the written output's: the geometry the committed file is read back with.
  layout::BuildInput in;
  in.dir = r.what_;
  for (uint32_t rank = 0; rank < p.ranks; ++rank) {
    layout::ShardInput si;
    si.name = fmt::format("{} (rank {})", r.what_, rank);
    in.shards.push_back(std::move(si));
  }
  layout::Declared decl;
  decl.format = "the write path's rank plan";
  decl.outputs = 1;
  for (uint32_t i = 0; i < h.tensors.size(); ++i) {
    const auto& t = h.tensors[i];
    const auto& tp = p.tensors[i];
    if (tp.name != t.name || s.chunk_offset[i].size() != tp.chunks.size()) {
      return make_error(EINVAL, "{}: tensor '{}': plan entry does not match the header", r.what_,
                        t.name);
    }
    for (size_t c = 0; c < tp.chunks.size(); ++c) {
      const auto& ch = tp.chunks[c];
      if (ch.rank >= p.ranks) {
        return make_error(EINVAL, "{}: tensor '{}': chunk on a rank out of range", r.what_, t.name);
      }
      decl.chunks.push_back(layout::DeclaredChunk{ch.rank, t.name, t.dtype, s.chunk_offset[i][c],
                                                  ch.offsets, ch.sizes, t.shape, 1});
    }
  }
  in.declared = std::move(decl);
  layout::OutputOverride o;
  o.k = 1;
  o.name = r.what_;
  o.header = r.header_;
  o.parsed = r.parsed_;
  o.record = r.what_;
  in.overrides.push_back(std::move(o));
  r.geo_ = layout::build_checkpoint(std::move(in));
  if (!r.geo_->valid()) {
    std::string msg = fmt::format("{}: the rank plan does not tile the file:", r.what_);
    for (const auto& pr : r.geo_->problems) msg += "\n  " + pr.to_string();
    return Error{EINVAL, std::move(msg)};
  }
  if (r.geo_->outputs.size() != 1 || r.geo_->outputs[0].size != r.file_size_) {
    return make_error(EINVAL, "{}: the rank plan does not describe the file", r.what_);  // a bug
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
      shard_headers_ = {};  // sent: the parse (shard_parsed_) is what stays
    }
  }
  return route_data(bytes);
}

Status StreamRouter::route_data(std::string_view bytes) {
  if (bytes.empty()) return {};
  if (!geo_) return fail(make_error(EIO, "{}: data bytes in a file of no tensors", what_));
  layout::map_range(*geo_, 0, pos_, bytes.size(), segs_);
  for (const auto& sg : segs_) {
    // The header is behind pos_ here, and written files are never cast: every segment is a
    // run of one rank's shard.
    if (sg.is_memory() || sg.is_transformed()) {
      return fail(make_error(EIO, "{}: byte {} maps to no shard", what_, pos_));  // a bug
    }
    auto st = sink_->pwrite(sg.shard, sg.src, bytes.substr(0, sg.len));
    if (!st) {
      Error e = std::move(st).error();
      if (e.code == kNeedsStaging) e.code = EIO;
      return fail(
          std::move(e).context(fmt::format("{}: {}: rank {}", what_, tensor_at(pos_), sg.shard)));
    }
    pos_ += sg.len;
    bytes.remove_prefix(sg.len);
  }
  return {};
}

std::string StreamRouter::tensor_at(uint64_t x) const {
  const auto& f = geo_->outputs[0];
  auto it = std::upper_bound(f.data_starts.begin(), f.data_starts.end(), x);
  if (it == f.data_starts.begin()) return "header";
  const auto& t =
      geo_->tensors[f.data_tensors[static_cast<size_t>(it - f.data_starts.begin()) - 1]];
  return fmt::format("tensor '{}'", t.name);
}

Result<size_t> StreamRouter::read(uint64_t off, size_t len, char* dst,
                                  const ShardRead& pread) const {
  if (off >= file_size_) return size_t{0};
  const uint64_t n = std::min<uint64_t>(len, file_size_ - off);
  if (!geo_) {  // a file of no tensors: all header
    std::copy_n(header_.data() + off, n, dst);
    return static_cast<size_t>(n);
  }
  // The same segments a committed file is read with, executed by the one executor: the shards
  // have no fds here, so io::gather reads them through `pread` (the transaction's).
  std::vector<layout::Segment> segs;
  layout::map_range(*geo_, 0, off, n, segs);
  io::GatherSource src{geo_.get(), no_fds_, header_, what_};
  src.staged = pread;
  CKPTFS_CHECK(io::gather(src, segs, dst));
  return static_cast<size_t>(n);
}

Status StreamRouter::copy_rest(int fd) {
  if (failed_) {
    return make_error(kNeedsStaging, "{}: stream routing already abandoned", what_);
  }
  if (pos_ < header_.size()) {
    return fail(make_error(EINVAL, "{}: the header has not arrived", what_));  // a bug
  }
  if (pos_ == file_size_) return {};
  if (!geo_) return fail(make_error(EIO, "{}: data bytes in a file of no tensors", what_));
  std::vector<layout::Segment> segs;  // not segs_: route_data below uses that
  layout::map_range(*geo_, 0, pos_, file_size_ - pos_, segs);
  std::string buf;  // only where the sink copies nothing itself
  for (const auto& sg : segs) {
    if (sg.is_memory() || sg.is_transformed()) {
      return fail(make_error(EIO, "{}: byte {} maps to no shard", what_, pos_));  // a bug
    }
    auto copied = sink_->copy_in(sg.shard, sg.src, fd, pos_, sg.len);
    if (!copied) {
      Error e = std::move(copied).error();
      if (e.code == kNeedsStaging) e.code = EIO;
      return fail(
          std::move(e).context(fmt::format("{}: {}: rank {}", what_, tensor_at(pos_), sg.shard)));
    }
    if (*copied) {
      pos_ += sg.len;
      continue;
    }
    for (uint64_t left = sg.len; left > 0;) {  // through user space
      if (buf.empty()) buf.resize(kCopyChunk);
      const size_t n = static_cast<size_t>(std::min<uint64_t>(left, buf.size()));
      CKPTFS_CHECK(pread_exact(fd, buf.data(), n, pos_, what_));
      CKPTFS_CHECK(route_data(std::string_view(buf.data(), n)));
      left -= n;
    }
  }
  return {};
}

Status route_file(int fd, uint64_t size, StreamRouter& r, std::string_view what) {
  // The header; all of a file of another size than the header describes, as write() takes it
  // (and refuses it).
  const bool whole = size == r.file_size();
  const uint64_t head = whole ? std::min<uint64_t>(size, r.header().size()) : size;
  std::string buf(static_cast<size_t>(std::min<uint64_t>(kCopyChunk, std::max<uint64_t>(head, 1))),
                  '\0');
  for (uint64_t x = 0; x < head; x += buf.size()) {
    const size_t len = static_cast<size_t>(std::min<uint64_t>(buf.size(), head - x));
    CKPTFS_CHECK(pread_exact(fd, buf.data(), len, x, what));
    CKPTFS_CHECK(r.write(x, std::string_view(buf.data(), len)));
  }
  return whole ? r.copy_rest(fd) : Status{};
}

}  // namespace ckptfs::write
