// Reading a torch DCP checkpoint directory (.metadata, *.distcp) into declared chunks.
#include "ckptfs/source/distcp.hpp"

#include <sys/stat.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <map>

#include <fmt/format.h>

#include "ckptfs/format/distcp.hpp"
#include "ckptfs/format/megatron_args.hpp"
#include "ckptfs/format/transformer_config.hpp"
#include "ckptfs/format/zip.hpp"
#include "ckptfs/util/checked.hpp"
#include "ckptfs/util/fd.hpp"
#include "ckptfs/util/path.hpp"

namespace ckptfs::source {
namespace {

using format::DistcpChunk;
using format::DistcpTensor;

// Top-level state-dict keys that hold training state, not model weights.
constexpr std::array<std::string_view, 14> kTrainingState = {
    "optimizer",     "optim",      "optimizers",  "optimizer_state", "lr_scheduler",
    "lr_schedulers", "scheduler",  "dataloader",  "train_state",     "rng",
    "rng_state",     "rng_states", "extra_state", "trainer_state"};

std::string_view top_key(const DistcpTensor& t) {
  if (!t.path.empty()) return t.path.front();
  return std::string_view(t.key).substr(0, t.key.find('.'));
}

std::string dims(const std::vector<uint64_t>& v) { return fmt::format("[{}]", fmt::join(v, ", ")); }

// A chunk's archive, located: where its tensor's bytes are in the file.
Result<uint64_t> locate_chunk(int fd, const std::string& file, uint64_t file_size,
                              const DistcpTensor& t, const DistcpChunk& c) {
  const std::string what = fmt::format("{} (chunk of '{}' at {})", file, t.key, dims(c.offsets));
  if (c.offset > file_size || c.length > file_size - c.offset) {
    return make_error(EINVAL, "{}: .metadata places it at bytes [{}, {}) of a file of {} bytes",
                      what, c.offset, c.offset + c.length, file_size);
  }
  // torch puts everything but the tensor's bytes near the archive's start (data.pkl, the
  // local headers before the data) and its end (the last members, the central directory, the
  // end records): two windows read once each serve the zip and pickle reads, not a pread per
  // record. Whatever falls outside them is read directly.
  constexpr uint64_t kWindow = 4096;
  struct Window {
    uint64_t at = 0;
    std::string bytes;
    bool loaded = false;
  };
  Window head{0, {}, false};
  Window tail{c.length - std::min(c.length, kWindow), {}, false};
  auto read = [&](uint64_t off, std::span<char> out) -> Status {
    if (off > c.length || out.size() > c.length - off) {
      return make_error(EINVAL, "{}: a read past the chunk", what);
    }
    for (Window* w : {&head, &tail}) {
      const uint64_t len = std::min(c.length - w->at, kWindow);
      if (off < w->at || off + out.size() > w->at + len) continue;
      if (!w->loaded) {
        w->bytes.resize(len);
        CKPTFS_CHECK(pread_exact(fd, w->bytes.data(), len, c.offset + w->at, what));
        w->loaded = true;
      }
      std::memcpy(out.data(), w->bytes.data() + (off - w->at), out.size());
      return {};
    }
    return pread_exact(fd, out.data(), out.size(), c.offset + off, what);
  };
  // One tensor's archive: a handful of members, a small directory (the caps of a whole
  // state dict's archive would let each of a file's chunks cost a parse of 65,536 members).
  const format::zip::Limits limits{kMaxChunkArchiveMembers, kMaxChunkDirectoryBytes};
  CKPTFS_TRY(auto members, format::zip::members(c.length, read, what, limits));
  CKPTFS_TRY(auto archive, format::zip::torch_archive(std::move(members), what));
  if (archive.pickle.size > kMaxTensorPickleBytes) {
    return make_error(EINVAL, "{}: data.pkl of {} bytes (at most {})", what, archive.pickle.size,
                      kMaxTensorPickleBytes);
  }
  std::string pkl(archive.pickle.size, '\0');
  CKPTFS_CHECK(read(archive.pickle.offset, std::span<char>(pkl.data(), pkl.size())));
  CKPTFS_TRY(auto rec, format::parse_torch_tensor_pickle(std::move(pkl), what + " data.pkl"));
  if (rec.dtype != t.dtype) {
    return make_error(EINVAL, "{}: holds {} where .metadata says {}", what,
                      format::dtype_name(rec.dtype), format::dtype_name(t.dtype));
  }
  if (rec.size != c.sizes) {
    return make_error(EINVAL, "{}: holds a tensor of size {} where .metadata says {}", what,
                      dims(rec.size), dims(c.sizes));
  }
  CKPTFS_TRY(uint64_t at, format::tensor_offset_in_archive(archive, rec, what));
  return c.offset + at;  // in range of the chunk (zip::members checked the member)
}

// The model config a checkpoint carries, for a map's hf_config template, in the order read:
// Megatron-LM's args in common.pt, else (a common.pt with none: megatron-core's own saves,
// Megatron-Bridge's) Megatron-Bridge's run_config.yaml. The first found is read; one that
// cannot be read is said (naming it) where a map would have used it, never served from.
struct NativeConfigFile {
  std::string_view name;
  std::string_view about;
  uint64_t cap;
  Result<nlohmann::json> (*parse)(std::string_view bytes, std::string_view what);
};
constexpr NativeConfigFile kNativeConfigFiles[] = {
    {format::kMegatronCommonName, "Megatron-LM's args", format::kMaxMegatronCommonBytes,
     format::read_megatron_args},
    {format::kBridgeRunConfigName, "Megatron-Bridge's model config", format::kMaxRunConfigBytes,
     format::read_bridge_run_config},
};

void read_native_config(int dirfd, layout::BuildInput& in, const std::string& pre) {
  in.native_what = pre + std::string(kNativeConfigFiles[0].name);
  for (const auto& f : kNativeConfigFiles) {
    const std::string name(f.name);
    struct stat st {};
    auto fd = open_regular_at(dirfd, name, name, &st);
    if (!fd && fd.error().code == ENOENT) continue;
    in.native_what = fmt::format("{}{} ({})", pre, name, f.about);
    if (!fd) {
      in.native_problem = fd.error().message;
      return;
    }
    auto bytes = read_whole(*fd, st, pre + name, f.cap);
    if (!bytes) {
      in.native_problem = bytes.error().message;
      return;
    }
    auto config = f.parse(*bytes, pre + name);
    if (config) {
      in.native_config = config->dump();
      return;
    }
    if (config.error().code != ENOENT) {  // ENOENT: no config in it; the next file is read
      in.native_problem = config.error().message;
      return;
    }
  }
}

}  // namespace

namespace {

// Whether the DCP files among `entries` whose names start with `prefix` make a checkpoint.
bool distcp_files_under(const std::vector<DirEntry>& entries, std::string_view prefix) {
  bool metadata = false, data = false;
  for (const auto& e : entries) {
    if (!e.name.starts_with(prefix)) continue;
    const std::string_view name = std::string_view(e.name).substr(prefix.size());
    if (name.find('/') != std::string_view::npos) continue;
    if (name == format::kDistcpMetadataName) metadata = S_ISREG(e.st.st_mode);
    if (format::is_distcp_file_name(name) && name != format::kDistcpMetadataName) data = true;
  }
  return metadata && data;
}

}  // namespace

bool is_distcp_entry(const DirEntry& e) {
  return format::is_distcp_file_name(split_rel(e.name).name);
}

bool is_distcp_dir(const std::vector<DirEntry>& entries) {
  return distcp_files_under(entries, "") && !has_shards(entries);
}

bool is_accelerate_dir(const std::vector<DirEntry>& entries) {
  const std::string prefix = std::string(kAccelerateModelDir) + "/";
  return !is_distcp_dir(entries) && distcp_files_under(entries, prefix) && !has_shards(entries);
}

void read_distcp_input(int dirfd, layout::BuildInput& in, std::string_view prefix) {
  const std::string pre(prefix);
  const std::string meta_name(format::kDistcpMetadataName);
  auto problem = [&](const std::string& file, std::string tensor, std::string msg) {
    in.problems.push_back({file.empty() ? file : pre + file, std::move(tensor), std::move(msg)});
  };
  in.declared.emplace();
  in.declared->format = "torch DCP (.metadata, *.distcp)";
  if (!pre.empty()) {
    in.declared->format = fmt::format("torch DCP (.metadata, *.distcp) in accelerate's {}", pre);
  }
  // Megatron-Core's torch_dist says so in metadata.json (its common.pt is never read).
  if (auto mj = read_small_file_beneath(dirfd, format::kMegatronMetadataName, 64 << 10);
      mj.ok() && format::is_megatron_torch_dist(*mj)) {
    in.declared->format = "Megatron-Core torch_dist (.metadata, *.distcp, metadata.json)";
    read_native_config(dirfd, in, pre);
  }
  struct stat mst {};
  std::string text;
  {
    auto mfd = open_regular_at(dirfd, meta_name, meta_name, &mst);
    if (!mfd) return problem(meta_name, "", mfd.error().message);
    auto t = read_whole(*mfd, mst, meta_name, format::kMaxDistcpMetadataBytes);
    if (!t) return problem(meta_name, "", t.error().message);
    text = std::move(t).value();
  }  // closed: one descriptor at a time
  const int64_t meta_mtime = stamp_of(mst).mtime_ns;
  auto md = format::parse_distcp_metadata(std::move(text), meta_name);
  if (!md) return problem(meta_name, "", md.error().message);

  // Which tensors are the model's, and their served names.
  const bool wrapped = std::any_of(md->tensors.begin(), md->tensors.end(), [](const auto& t) {
    return t.path.size() >= 2 && t.path.front() == "model" && t.key.starts_with("model.");
  });
  std::map<std::string, size_t> skipped;  // top-level key -> tensors left out
  std::vector<std::pair<const DistcpTensor*, std::string>> served;
  for (const auto& t : md->tensors) {
    const std::string_view top = top_key(t);
    const bool model =
        wrapped
            ? (t.path.size() >= 2 && top == "model" && t.key.starts_with("model."))
            : std::find(kTrainingState.begin(), kTrainingState.end(), top) == kTrainingState.end();
    if (!model) {
      skipped[std::string(top)]++;
      continue;
    }
    std::string name = wrapped ? t.key.substr(6) : t.key;
    // The key was checked whole; what is served is below "model." ("model.__metadata__").
    if (auto ok = format::check_tensor_name(name, "served below 'model'"); !ok.ok()) {
      problem(meta_name, t.key, ok.error().message);
      continue;
    }
    served.emplace_back(&t, std::move(name));
  }
  for (const auto& [top, n] : skipped) {
    in.left_out.push_back(fmt::format(
        "{}{}: {} tensor(s) under '{}' are training state, not served", pre, meta_name, n, top));
  }
  if (!md->bytes_items.empty()) {
    in.left_out.push_back(fmt::format("{}{}: {} non-tensor item(s) not served (e.g. '{}')", pre,
                                      meta_name, md->bytes_items.size(), md->bytes_items.front()));
  }

  // Each served tensor's output file, in .metadata's order.
  OutputPacker packer;
  std::vector<uint32_t> out_file(served.size(), 0);
  for (size_t i = 0; i < served.size(); ++i) {
    const auto& [t, name] = served[i];
    auto nbytes = checked_numel(t->size);
    auto bytes = nbytes ? format::byte_size(t->dtype, *nbytes) : std::nullopt;
    if (!bytes) {
      problem(meta_name, name, fmt::format("size {} overflows", dims(t->size)));
      continue;
    }
    out_file[i] = packer.place(*bytes);
    if (t->chunks.empty()) problem(meta_name, name, "has no chunks");
  }

  // The files .metadata names (at most kMaxDistcpFiles: format checked it), in order of first
  // mention, each with its storage entries and the served chunks stored in it. They are then
  // read one at a time (open, stat, every chunk located, closed), so a .metadata naming many
  // files never holds more than one descriptor: another user's open never meets EMFILE.
  struct FileWork {
    std::string name;
    std::vector<const format::DistcpStorage*> storage;
    std::vector<std::pair<uint32_t, uint32_t>> chunks;  // (served index, chunk index)
  };
  std::vector<FileWork> work;
  std::map<std::string_view, size_t> work_of;  // name -> index in work (views into md)
  auto work_for = [&](const std::string& name) -> FileWork& {
    auto [it, added] = work_of.emplace(name, work.size());
    if (added) work.push_back(FileWork{name, {}, {}});
    return work[it->second];
  };
  for (const auto& place : md->storage) work_for(place.file).storage.push_back(&place);
  for (size_t i = 0; i < served.size(); ++i) {
    const auto& [t, name] = served[i];
    for (size_t c = 0; c < t->chunks.size(); ++c) {
      const DistcpChunk& ch = t->chunks[c];
      if (ch.transformed) {
        problem(ch.file, name,
                fmt::format("the chunk at {} is stored with transform_descriptors (compression "
                            "or another storage extension), which is not served",
                            dims(ch.offsets)));
        continue;
      }
      work_for(ch.file).chunks.emplace_back(static_cast<uint32_t>(i), static_cast<uint32_t>(c));
    }
  }

  // Where each served chunk's tensor bytes are in its file, once located.
  std::vector<std::vector<std::optional<std::pair<uint32_t, uint64_t>>>> located(served.size());
  for (size_t i = 0; i < served.size(); ++i) located[i].resize(served[i].first->chunks.size());
  for (const FileWork& f : work) {
    const std::string& name = f.name;
    const std::string first_key = f.storage.empty() ? "" : f.storage.front()->key;
    if (!is_valid_component(name)) {
      problem(meta_name, first_key,
              fmt::format("names the file '{}', not a file of this directory", name));
      continue;
    }
    // Only DCP's own data files: a .metadata must not make the view serve (or its reads
    // touch) any other file it can name, such as a neighbour's torch.save file.
    if (!format::is_distcp_file_name(name) || name == format::kDistcpMetadataName) {
      problem(meta_name, first_key,
              fmt::format("names the file '{}', which is not a DCP data file (*{})", name,
                          format::kDistcpSuffix));
      continue;
    }
    struct stat st {};
    auto fd = open_regular_at(dirfd, name, name, &st);
    if (!fd) {
      problem(name, first_key, fmt::format("named by .metadata: {}", fd.error().message));
      continue;
    }
    layout::ShardInput si;
    si.name = pre + name;
    si.stamp = stamp_of(st);
    si.access = layout::Access{st.st_uid, st.st_gid, static_cast<uint32_t>(st.st_mode & 07777)};
    si.atime_ns = static_cast<int64_t>(st.st_atim.tv_sec) * 1'000'000'000 + st.st_atim.tv_nsec;
    const auto idx = static_cast<uint32_t>(in.shards.size());
    const uint64_t size = static_cast<uint64_t>(st.st_size);
    const int64_t mtime = si.stamp.mtime_ns;
    in.shards.push_back(std::move(si));
    bool ok = true;
    // .metadata is DCP's commit point, written last (.metadata.tmp, then a rename); torch
    // rewrites .distcp files in place. A data file changed after it belongs to a later save,
    // running or killed: served with this .metadata it would mix two versions.
    if (mtime > meta_mtime) {
      problem(name, "",
              fmt::format("written after .metadata ({:.3f} s later; DCP writes .metadata last): a "
                          "save in progress or cut short, which would mix two versions; if this "
                          "is a copy that did not keep file times, `touch .metadata`",
                          static_cast<double>(mtime - meta_mtime) / 1e9));
      ok = false;
    }
    // Every storage entry, served or not, in a file long enough: a save cut short or a file
    // lost is never shown as complete.
    for (const auto* place : f.storage) {
      if (place->offset > size || place->length > size - place->offset) {
        problem(name, place->key,
                fmt::format(".metadata places it at bytes [{}, {}) of a file of {} bytes",
                            place->offset, place->offset + place->length, size));
        ok = false;
      }
    }
    if (!ok) continue;
    for (const auto& [i, c] : f.chunks) {
      const auto& [t, served_name] = served[i];
      auto at = locate_chunk(fd->get(), name, size, *t, t->chunks[c]);
      if (!at) {
        problem(name, served_name, at.error().message);
        continue;
      }
      located[i][c] = std::pair{idx, *at};
    }
  }  // each file's descriptor is closed at the end of its turn
  if (!in.problems.empty()) return;

  for (size_t i = 0; i < served.size(); ++i) {
    const auto& [t, name] = served[i];
    for (size_t c = 0; c < t->chunks.size(); ++c) {
      const DistcpChunk& ch = t->chunks[c];
      layout::DeclaredChunk d;
      d.shard = located[i][c]->first;
      d.tensor = name;
      d.dtype = t->dtype;
      d.file_offset = located[i][c]->second;
      d.offsets = ch.offsets;
      d.sizes = ch.sizes;
      d.full_shape = t->size;
      d.k = out_file[i];
      in.declared->chunks.push_back(std::move(d));
    }
  }
  in.declared->outputs = packer.outputs();
  if (served.empty()) problem(meta_name, "", "no model tensors");
}

}  // namespace ckptfs::source
