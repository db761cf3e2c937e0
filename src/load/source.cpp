// load/source: what the loader reads: a checkpoint's tensors and the segments behind each.
#include "ckptfs/load/source.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>

#include <fmt/format.h>

#include "ckptfs/format/index.hpp"
#include "ckptfs/format/names.hpp"
#include "ckptfs/format/safetensors.hpp"
#include "ckptfs/io/gather.hpp"
#include "ckptfs/source/maps.hpp"
#include "ckptfs/source/scanner.hpp"
#include "ckptfs/source/shards.hpp"

namespace ckptfs::load {
namespace {

std::string strip_slashes(std::string p) {
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  return p;
}

}  // namespace

ReadScratch::~ReadScratch() { std::free(bounce); }

Source::~Source() = default;

int64_t Source::find(std::string_view name) const {
  auto it = by_name_.find(std::string(name));
  return it == by_name_.end() ? -1 : static_cast<int64_t>(it->second);
}

uint64_t Source::total_bytes() const {
  uint64_t n = 0;
  for (const auto& t : tensors_) n += t.nbytes;
  return n;
}

std::string Source::file_name(uint32_t file) const {
  if (kind_ == Kind::RankShards) return dir_ + "/" + ck_->shards[file].name;
  return dir_ + "/" + names_[file];
}

Result<std::unique_ptr<Source>> Source::open(const std::string& dir_in, const SourceOptions& opts) {
  std::unique_ptr<Source> s(new Source());
  s->dir_ = strip_slashes(dir_in);
  s->direct_ = opts.direct;
  const std::string& dir = s->dir_;
  CKPTFS_TRY(UniqueFd dfd, open_file(dir, O_RDONLY | O_DIRECTORY));
  CKPTFS_TRY(auto entries, source::list_checkpoint_dir(dfd.get()));

  std::vector<std::string> files;   // every file read, in order
  std::vector<UniqueFd> shard_fds;  // rank shards: opened (and stamp-checked) by source
  if (source::is_checkpoint_dir(dfd.get(), entries)) {
    layout::BuildOptions bo;
    CKPTFS_CHECK(layout::set_dtype_policy(bo, opts.dtype));
    CKPTFS_CHECK(source::set_map_options(bo, opts.map, opts.hf_config));
    // Built, stamp-checked and read through the one directory descriptor opened above: a path
    // swapped meanwhile changes nothing of what is loaded.
    source::HeaderCache cache;
    s->ck_ = source::load_checkpoint(dfd.get(), entries, dir, cache, bo);
    const auto& ck = *s->ck_;
    if (!ck.valid()) {
      std::string msg = fmt::format("{} is not a complete, valid checkpoint:", dir);
      for (const auto& p : ck.problems) msg += "\n  " + p.to_string();
      return Error{EINVAL, std::move(msg)};
    }
    CKPTFS_TRY(shard_fds, source::open_shards(ck, dfd.get(), dir, "load"));
    s->kind_ = Kind::RankShards;
    // The model files of the directory, as the view shows them: a LoRA checkpoint's base model,
    // not its adapter (in a folder of its own, for PEFT).
    if (ck.adapter && ck.index_json.empty()) {
      return make_error(EINVAL,
                        "{}: the rank files hold a LoRA adapter only (verl's save_lora_only), no "
                        "model weights to load; PEFT loads the adapter from {}/",
                        dir, ck.adapter->dir);
    }
    for (const auto& f : ck.outputs) {
      if (!f.folder.empty()) continue;
      for (uint32_t t : f.tensors) {
        const auto& T = ck.tensors[t];
        s->by_name_.emplace(T.name, static_cast<uint32_t>(s->tensors_.size()));
        s->tensors_.push_back(TensorInfo{T.name, T.dtype, T.shape, T.nbytes});
        s->places_.push_back(Place{t, 0});  // file: the tensor's index in the checkpoint
      }
    }
    for (const auto& sh : ck.shards) files.push_back(dir + "/" + sh.name);
  } else {
    s->kind_ = Kind::Consolidated;
    std::map<uint32_t, std::string> numbered;  // k -> name
    std::optional<std::string> single;
    uint32_t m = 0;
    bool has_index = false;
    for (const auto& e : entries) {
      if (e.name == format::kIndexFileName) has_index = true;
      auto mn = format::parse_model_name(e.name);
      if (!mn || !S_ISREG(e.st.st_mode)) continue;
      if (mn->single) {
        single = e.name;
      } else {
        if (m != 0 && mn->m != m) {
          return make_error(EINVAL, "{}: model files of different counts ({} and {})", dir, m,
                            mn->m);
        }
        m = mn->m;
        if (!numbered.emplace(mn->k, e.name).second) {
          return make_error(EINVAL, "{}: two model files numbered {}", dir, mn->k);
        }
      }
    }
    if (!single && numbered.empty()) {
      return make_error(ENOENT,
                        "{}: no rank shard files (shard-R-model-K-of-M.safetensors) and no "
                        "consolidated model.safetensors or model-K-of-M.safetensors",
                        dir);
    }
    if (single && !numbered.empty() && !has_index) {
      return make_error(EINVAL, "{}: both model.safetensors and model-K-of-M files", dir);
    }
    if (has_index) {
      // The index names the files (a set written by ckptfs consolidate has no file for a
      // number that holds no tensor).
      const std::string ipath = dir + "/" + std::string(format::kIndexFileName);
      CKPTFS_TRY(auto text, read_small_file(ipath, format::kMaxSideFileSize));
      CKPTFS_TRY(auto index, format::parse_index(text, ipath));
      std::set<std::string> used;
      for (const auto& [name, file] : index.weight_map) {
        s->index_[name] = file;
        used.insert(file);
      }
      for (const auto& f : used) {
        const bool known =
            (single && f == *single) || std::any_of(numbered.begin(), numbered.end(),
                                                    [&](const auto& kv) { return kv.second == f; });
        if (!known)
          return make_error(ENOENT, "{}: {} names {}, which is missing", dir,
                            format::kIndexFileName, f);
        s->names_.push_back(f);
      }
      s->has_index_ = true;
    } else if (single) {
      s->names_.push_back(*single);
    } else {
      for (uint32_t k = 1; k <= m; ++k) {
        auto it = numbered.find(k);
        if (it == numbered.end()) {
          return make_error(EINVAL, "{}: {} is missing", dir, format::model_file_name(k, m));
        }
        s->names_.push_back(it->second);
      }
    }
    for (const auto& n : s->names_) files.push_back(dir + "/" + n);
  }

  for (size_t i = 0; i < files.size(); ++i) {
    const std::string& path = files[i];
    struct stat st {};
    UniqueFd fd;
    if (s->kind_ == Kind::RankShards) {
      fd = std::move(shard_fds[i]);
    } else {
      CKPTFS_TRY(fd, open_regular_at(AT_FDCWD, path, path, &st));
    }
    s->raw_.push_back(fd.get());
    s->fds_.push_back(std::move(fd));
    UniqueFd direct;
    if (opts.direct) {
      // The file just opened and checked (a rank shard: by source::open_shard, its stamp and
      // its resolution beneath the checkpoint), opened again: never its path a second time.
      Result<UniqueFd> d = reopen(s->fds_.back().get(), O_RDONLY | O_DIRECT, path);
      if (d) {
        direct = std::move(*d);
      } else if (d.error().code == EINVAL) {  // a file system without O_DIRECT (tmpfs)
        s->direct_fallback_.store(true);
      } else {
        return d.error();
      }
    }
    s->direct_fds_.push_back(std::move(direct));
    if (s->kind_ == Kind::Consolidated) {
      const uint32_t file = static_cast<uint32_t>(s->fds_.size() - 1);
      const std::string& name = s->names_[file];
      CKPTFS_TRY(auto hdr, format::read_header(s->fds_.back().get(),
                                               static_cast<uint64_t>(st.st_size), path));
      for (const auto& e : hdr.tensors) {
        if (s->has_index_) {
          auto it = s->index_.find(e.name);
          if (it == s->index_.end() || it->second != name) {
            return make_error(EINVAL, "{}: tensor '{}' is not mapped to this file by {}", path,
                              e.name, format::kIndexFileName);
          }
        }
        if (!s->by_name_.emplace(e.name, static_cast<uint32_t>(s->tensors_.size())).second) {
          return make_error(EINVAL, "{}: tensor '{}' is also in another model file", path, e.name);
        }
        s->tensors_.push_back(TensorInfo{e.name, e.dtype, e.shape, e.nbytes()});
        s->places_.push_back(Place{file, hdr.data_start() + e.begin});
      }
    }
  }
  if (s->has_index_) {
    for (const auto& [name, file] : s->index_) {
      if (s->find(name) < 0) {
        return make_error(EINVAL, "{}/{}: tensor '{}' is mapped to {}, which does not hold it", dir,
                          format::kIndexFileName, name, file);
      }
    }
  }
  return s;
}

Status Source::read_direct(uint32_t file, uint64_t src, uint64_t len, char* dst,
                           ReadScratch& s) const {
  if (!s.bounce) {
    s.bounce = static_cast<char*>(std::aligned_alloc(kDirectAlign, kBounceBytes));
    if (!s.bounce) return make_error(ENOMEM, "cannot allocate a direct I/O buffer");
  }
  const int fd = direct_fds_[file].get();
  while (len > 0) {
    const uint64_t start = src & ~(kDirectAlign - 1);
    const uint64_t lead = src - start;
    const uint64_t want =
        std::min<uint64_t>(kBounceBytes, (lead + len + kDirectAlign - 1) & ~(kDirectAlign - 1));
    ssize_t n = ::pread(fd, s.bounce, want, static_cast<off_t>(start));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EINVAL) {  // the file system refuses this O_DIRECT read
      direct_fallback_.store(true);
      return pread_exact(raw_[file], dst, len, src, file_name(file));
    }
    if (n < 0) return errno_error(file_name(file));
    if (static_cast<uint64_t>(n) <= lead) {
      return make_error(EIO, "{}: unexpected end of file at offset {} (file shrank?)",
                        file_name(file), src);
    }
    const uint64_t got = std::min<uint64_t>(static_cast<uint64_t>(n) - lead, len);
    std::memcpy(dst, s.bounce + lead, got);
    dst += got;
    src += got;
    len -= got;
  }
  return {};
}

Status Source::read(uint32_t t, uint64_t off, uint64_t len, char* dst, ReadScratch& s) const {
  if (len == 0) return {};
  if (kind_ == Kind::Consolidated) {
    const auto& p = places_[t];
    bytes_read_.fetch_add(len, std::memory_order_relaxed);
    if (direct_ && direct_fds_[p.file].valid() && len >= kDirectMinRun) {
      return read_direct(p.file, p.offset + off, len, dst, s);
    }
    return pread_exact(raw_[p.file], dst, len, p.offset + off, file_name(p.file));
  }
  const auto& ck = *ck_;
  const auto& T = ck.tensors[places_[t].file];
  const auto& out = ck.outputs[T.output];
  layout::map_range(ck, T.output, T.out_offset + off, len, s.segs);
  uint64_t src_bytes = 0;
  for (const auto& g : s.segs) src_bytes += g.is_memory() ? 0 : g.src_len();
  bytes_read_.fetch_add(src_bytes, std::memory_order_relaxed);
  io::GatherSource gs{&ck, raw_, out.header, {}};
  gs.windows = &windows_;
  if (!direct_) return io::gather(gs, s.segs, dst);
  // Direct: long plain runs through O_DIRECT, the rest (short strided runs, casts) buffered
  // with gather, a consecutive span of segments at a time.
  const std::span<const layout::Segment> segs(s.segs);
  size_t i = 0;
  uint64_t pos = 0;
  while (i < segs.size()) {
    const auto& g = segs[i];
    if (!g.is_memory() && !g.is_transformed() && g.len >= kDirectMinRun &&
        direct_fds_[g.shard].valid()) {
      CKPTFS_CHECK(read_direct(g.shard, g.src, g.len, dst + pos, s));
      pos += g.len;
      ++i;
      continue;
    }
    size_t j = i;
    uint64_t n = 0;
    while (j < segs.size() &&
           !(!segs[j].is_memory() && !segs[j].is_transformed() && segs[j].len >= kDirectMinRun &&
             direct_fds_[segs[j].shard].valid())) {
      n += segs[j].len;
      ++j;
    }
    CKPTFS_CHECK(io::gather(gs, segs.subspan(i, j - i), dst + pos));
    pos += n;
    i = j;
  }
  return {};
}

}  // namespace ckptfs::load
