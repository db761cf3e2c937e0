// fs/readers: the FileReaders of open files, and the executor of their read plans (execute).
#include "readers.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "ckptfs/layout/extent_map.hpp"

namespace ckptfs::fs {

void MemoryReader::plan(uint64_t off, uint64_t len, ReadPlan& out) const {
  out.segs.clear();
  out.direct = nullptr;
  out.src = io::GatherSource{nullptr, {}, bytes_, "index"};
  out.size = 0;
  if (off >= bytes_.size()) return;
  uint64_t n = std::min<uint64_t>(len, bytes_.size() - off);
  out.segs.push_back(layout::Segment{layout::Segment::kMemory, off, n});
  out.size = n;
}

void PassthroughReader::plan(uint64_t off, uint64_t len, ReadPlan& out) const {
  out.segs.clear();
  out.direct = nullptr;
  out.src = io::GatherSource{nullptr, std::span<const int>(&raw_, 1), {}, name_};
  // The file may have grown or shrunk since open: read what is there, like a plain file.
  out.size = len;
  out.segs.push_back(layout::Segment{0, off, len});
}

void OutputReader::plan(uint64_t off, uint64_t len, ReadPlan& out) const {
  const auto& ck = *view_->ckpt;
  layout::map_range(ck, output_, off, len, out.segs);
  out.direct = nullptr;
  out.src = io::GatherSource{&ck, fds_->raw, ck.outputs[output_].header, {}, fds_->remote.get()};
  out.src.windows = &fds_->windows;
  out.src.factors = &fds_->factors;
  out.size = 0;
  for (const auto& s : out.segs) out.size += s.len;
}

uint64_t WriteFileReader::size() const {
  auto st = wf_->stat();
  return st ? static_cast<uint64_t>(st->st_size) : 0;
}

void WriteFileReader::plan(uint64_t off, uint64_t len, ReadPlan& out) const {
  out.segs.clear();
  out.src = io::GatherSource{};
  out.direct = this;
  out.direct_off = off;
  out.size = len;
}

Result<size_t> WriteFileReader::read_direct(uint64_t off, size_t len, char* dst) const {
  return wf_->read(off, len, dst);
}

Result<size_t> execute(const ReadPlan& p, char* dst) {
  if (p.direct) return p.direct->read_direct(p.direct_off, static_cast<size_t>(p.size), dst);
  if (p.passthrough()) {
    const auto& seg = p.segs[0];
    return pread_upto(p.src.fds[0], dst, static_cast<size_t>(seg.len), seg.src, p.src.file);
  }
  CKPTFS_CHECK(gather(p.src, p.segs, dst));
  // After the bytes are in: a shard rewritten while they were read shows a new stamp now.
  CKPTFS_CHECK(check_extents(p));
  return static_cast<size_t>(p.size);
}

Result<bool> splice_ready(const ReadPlan& p) {
  if (p.direct != nullptr || p.has_transformed() || p.has_remote()) return false;
  if (!p.passthrough() && p.segs.size() > 16) return false;
  CKPTFS_CHECK(check_extents(p));
  return true;
}

Status check_extents(const ReadPlan& p) {
  if (p.src.ckpt == nullptr) return {};  // a plain file reads like the file: short at its end
  const auto& shards = p.src.ckpt->shards;
  // Segments per request are few (the splice path takes at most 16; a 1 MiB read of a
  // consolidated file, a few shards): a pass per shard is fine.
  for (size_t i = 0; i < p.segs.size(); ++i) {
    const auto& g = p.segs[i];
    if (g.is_memory() || g.shard >= p.src.fds.size() || p.src.fds[g.shard] < 0) {
      continue;  // remote, or staged: their owner checks
    }
    bool seen = false;
    for (size_t j = 0; j < i && !seen; ++j)
      seen = !p.segs[j].is_memory() && p.segs[j].shard == g.shard;
    if (seen) continue;
    struct stat st {};
    if (::fstat(p.src.fds[g.shard], &st) != 0) {
      return make_error(errno, "{}: stat failed: {}", p.src.name_of(g.shard), std::strerror(errno));
    }
    // The file the view was built from, unchanged: a shard rewritten in place (torch writes
    // .distcp files with "wb") would otherwise give a read that mixes two versions.
    if (g.shard < shards.size()) {
      const layout::FileStamp& was = shards[g.shard].stamp;
      const int64_t mtime =
          static_cast<int64_t>(st.st_mtim.tv_sec) * 1'000'000'000 + st.st_mtim.tv_nsec;
      if (static_cast<uint64_t>(st.st_size) != was.size || mtime != was.mtime_ns) {
        return make_error(EIO,
                          "{}: changed under an open file (now {} bytes, mtime {} ns; it was {} "
                          "bytes, mtime {} ns): a read now could mix two versions; open the "
                          "file again for the new version",
                          p.src.name_of(g.shard), st.st_size, mtime, was.size, was.mtime_ns);
      }
      continue;
    }
    uint64_t end = 0;
    for (const auto& h : p.segs) {
      if (!h.is_memory() && h.shard == g.shard) end = std::max(end, h.src + h.src_len());
    }
    if (static_cast<uint64_t>(st.st_size) < end) {
      return make_error(EIO, "{}: shrank to {} bytes under an open file that reads up to {}",
                        p.src.name_of(g.shard), st.st_size, end);
    }
  }
  return {};
}

Result<size_t> FileReader::read_direct(uint64_t, size_t, char*) const {
  return make_error(EIO, "this file has no direct reads");
}

Result<size_t> FileReader::read(uint64_t off, size_t len, char* dst) const {
  ReadPlan p;
  plan(off, len, p);
  return execute(p, dst);
}

}  // namespace ckptfs::fs
