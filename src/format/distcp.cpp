// torch DCP's `.metadata` and torch.save's tensor pickle, read into plain structs.
#include "ckptfs/format/distcp.hpp"

#include <algorithm>
#include <array>
#include <map>
#include <numeric>
#include <unordered_set>

#include <fmt/format.h>

#include "ckptfs/format/names.hpp"
#include "ckptfs/util/checked.hpp"
#include "json_strict.hpp"

namespace ckptfs::format {
namespace {

using pickle::GlobalName;
using pickle::Kind;
using pickle::Ref;
using pickle::Walk;

constexpr std::string_view kMeta = "torch.distributed.checkpoint.metadata";

struct TorchDtype {
  std::string_view attr;     // torch.<attr>
  std::string_view storage;  // torch.<storage> (legacy typed storage), empty if none
  DType dtype;
};

// The dtypes a safetensors file can hold, by torch's names for them.
constexpr std::array kTorchDtypes = {
    TorchDtype{"float32", "FloatStorage", DType::F32},
    TorchDtype{"float64", "DoubleStorage", DType::F64},
    TorchDtype{"float16", "HalfStorage", DType::F16},
    TorchDtype{"bfloat16", "BFloat16Storage", DType::BF16},
    TorchDtype{"int64", "LongStorage", DType::I64},
    TorchDtype{"int32", "IntStorage", DType::I32},
    TorchDtype{"int16", "ShortStorage", DType::I16},
    TorchDtype{"int8", "CharStorage", DType::I8},
    TorchDtype{"uint8", "ByteStorage", DType::U8},
    TorchDtype{"bool", "BoolStorage", DType::BOOL},
    TorchDtype{"complex64", "ComplexFloatStorage", DType::C64},
    TorchDtype{"uint16", "", DType::U16},
    TorchDtype{"uint32", "", DType::U32},
    TorchDtype{"uint64", "", DType::U64},
    TorchDtype{"float8_e4m3fn", "", DType::F8_E4M3},
    TorchDtype{"float8_e5m2", "", DType::F8_E5M2},
    TorchDtype{"float8_e4m3fnuz", "", DType::F8_E4M3FNUZ},
    TorchDtype{"float8_e5m2fnuz", "", DType::F8_E5M2FNUZ},
    TorchDtype{"float8_e8m0fnu", "", DType::F8_E8M0},
};

std::vector<GlobalName> dtype_globals(bool storages) {
  std::vector<GlobalName> out;
  for (const auto& d : kTorchDtypes) {
    out.push_back({"torch", d.attr});
    if (storages && !d.storage.empty()) out.push_back({"torch", d.storage});
  }
  return out;
}

const std::vector<GlobalName>& metadata_globals() {
  static const std::vector<GlobalName> g = [] {
    std::vector<GlobalName> v = {
        {kMeta, "Metadata"},
        {kMeta, "TensorStorageMetadata"},
        {kMeta, "TensorProperties"},
        {kMeta, "ChunkStorageMetadata"},
        {kMeta, "BytesStorageMetadata"},
        {kMeta, "MetadataIndex"},
        {kMeta, "StorageMeta"},
        {kMeta, "_MEM_FORMAT_ENCODING"},
        {"torch.distributed.checkpoint.filesystem", "_StorageInfo"},
        // Megatron-Core's torch_dist keeps every rank's save plan in the metadata
        // (Metadata.all_local_plans): records only, never read.
        {"torch.distributed.checkpoint.planner", "SavePlan"},
        {"torch.distributed.checkpoint.planner", "WriteItem"},
        {"torch.distributed.checkpoint.planner", "WriteItemType"},
        {"torch.distributed.checkpoint.planner", "TensorWriteData"},
        {"torch", "Size"},
        {"torch.serialization", "_get_layout"},
        {"pathlib", "PosixPath"},
        {"collections", "OrderedDict"},
    };
    auto d = dtype_globals(false);
    v.insert(v.end(), d.begin(), d.end());
    return v;
  }();
  return g;
}

const std::vector<GlobalName>& tensor_globals() {
  static const std::vector<GlobalName> g = [] {
    std::vector<GlobalName> v = {
        {"torch._utils", "_rebuild_tensor_v2"},
        {"torch._utils", "_rebuild_tensor_v3"},
        {"torch.storage", "UntypedStorage"},
        {"collections", "OrderedDict"},
        {"torch", "Size"},
    };
    auto d = dtype_globals(true);
    v.insert(v.end(), d.begin(), d.end());
    return v;
  }();
  return g;
}

std::string dims(const std::vector<uint64_t>& v) { return fmt::format("[{}]", fmt::join(v, ", ")); }

// A dataclass's field from its state dict; missing is an error naming the class and field.
Result<Ref> need(const Walk& w, std::span<const Ref> state, std::string_view field,
                 std::string_view where) {
  auto r = w.field(state, field);
  if (!r) return make_error(EINVAL, "{}: no '{}'", where, field);
  return *r;
}

// TensorProperties pickles its state as a tuple: (dtype, layout, requires_grad, memory_format,
// pin_memory, ...); older versions as a dict with a 'dtype' field.
Result<DType> properties_dtype(const Walk& w, Ref props, std::string_view where) {
  CKPTFS_TRY(const pickle::Value* v, w.call(props, kMeta, "TensorProperties", where));
  if (!v->has_state) return make_error(EINVAL, "{}: TensorProperties has no state", where);
  const pickle::Value& s = w.at(v->state);
  Ref dt;
  if (s.kind == Kind::Tuple && !s.items.empty()) {
    dt = s.items[0];
  } else {
    CKPTFS_TRY(auto pairs, w.pairs(v->state, where));
    CKPTFS_TRY(dt, need(w, pairs, "dtype", where));
  }
  const pickle::Value& g = w.at(dt);
  if (g.kind == Kind::Global) {
    // Every dtype global was checked against the allow-list when it was read.
    for (const auto& d : kTorchDtypes) {
      if (w.is_global(dt, "torch", d.attr)) return d.dtype;
    }
  }
  return w.fail(where, "a torch dtype a safetensors file can hold", dt);
}

// DCP writes each item's bytes once: two storage entries whose ranges overlap in one file
// (every chunk pointing at one archive, so each costs a parse of all of it) are refused,
// naming both. Sorted per file, then one pass: O(n log n).
Status check_storage_overlaps(const std::vector<DistcpStorage>& storage, std::string_view what) {
  std::vector<uint32_t> order(storage.size());
  std::iota(order.begin(), order.end(), 0u);
  std::sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
    const auto& x = storage[a];
    const auto& y = storage[b];
    if (const int c = x.file.compare(y.file); c != 0) return c < 0;
    return x.offset < y.offset;
  });
  const DistcpStorage* last = nullptr;  // the entry reaching furthest so far in this file
  for (uint32_t i : order) {
    const DistcpStorage& s = storage[i];
    if (s.length == 0) continue;  // an empty range overlaps nothing
    if (last != nullptr && last->file == s.file &&
        s.offset < last->offset + last->length) {  // no overflow: checked when read
      return make_error(EINVAL,
                        "{}: storage of '{}' at bytes [{}, {}) and of '{}' at [{}, {}) of {} "
                        "overlap (DCP writes each item's bytes once)",
                        what, last->key, last->offset, last->offset + last->length, s.key, s.offset,
                        s.offset + s.length, s.file);
    }
    if (last == nullptr || last->file != s.file ||
        s.offset + s.length > last->offset + last->length) {
      last = &s;
    }
  }
  return {};
}

}  // namespace

bool is_distcp_file_name(std::string_view name) {
  return name == kDistcpMetadataName ||
         (name.size() > kDistcpSuffix.size() && name.ends_with(kDistcpSuffix));
}

bool is_megatron_torch_dist(std::string_view metadata_json) {
  auto j = detail::parse_json_strict(metadata_json, kMegatronMetadataName, "Megatron metadata");
  if (!j.ok() || !j->is_object()) return false;
  auto it = j->find("sharded_backend");
  return it != j->end() && it->is_string() && it->get<std::string>() == "torch_dist";
}

std::span<const pickle::GlobalName> distcp_metadata_globals() { return metadata_globals(); }
std::span<const pickle::GlobalName> torch_tensor_globals() { return tensor_globals(); }

std::optional<DType> torch_dtype(std::string_view name) {
  for (const auto& d : kTorchDtypes) {
    if (d.attr == name) return d.dtype;
  }
  return std::nullopt;
}

std::optional<DType> torch_storage_dtype(std::string_view storage_class) {
  for (const auto& d : kTorchDtypes) {
    if (!d.storage.empty() && d.storage == storage_class) return d.dtype;
  }
  return std::nullopt;
}

Result<DistcpMetadata> parse_distcp_metadata(std::string&& bytes, std::string_view what) {
  if (bytes.size() > kMaxDistcpMetadataBytes) {
    return make_error(EFBIG, "{}: {} bytes is over the {}-byte limit for DCP metadata", what,
                      bytes.size(), kMaxDistcpMetadataBytes);
  }
  CKPTFS_TRY(pickle::Pickle p, pickle::parse(std::move(bytes), metadata_globals(), what));
  const Walk w(p, what);
  CKPTFS_TRY(auto top, w.object_state(p.root(), kMeta, "Metadata", "the pickle"));
  CKPTFS_TRY(Ref sdm_ref, need(w, top, "state_dict_metadata", "Metadata"));
  CKPTFS_TRY(auto sdm, w.pairs(sdm_ref, "Metadata.state_dict_metadata"));

  DistcpMetadata out;
  std::map<std::string, size_t, std::less<>> by_key;  // key -> index in out.tensors
  for (size_t k = 0; k + 1 < sdm.size(); k += 2) {
    CKPTFS_TRY(std::string_view key, w.text(sdm[k], "a state_dict_metadata key"));
    // Every key, served or not: one may be served under its own name, and all are listed.
    CKPTFS_CHECK(check_tensor_name(key, what));
    const std::string where = fmt::format("state_dict_metadata['{}']", key);
    const Ref item = sdm[k + 1];
    if (w.call(item, kMeta, "BytesStorageMetadata", where).ok()) {
      out.bytes_items.emplace_back(key);
      continue;
    }
    CKPTFS_TRY(auto st, w.object_state(item, kMeta, "TensorStorageMetadata", where));
    DistcpTensor t;
    t.key = std::string(key);
    CKPTFS_TRY(Ref props, need(w, st, "properties", where));
    CKPTFS_TRY(t.dtype, properties_dtype(w, props, where + ".properties"));
    CKPTFS_TRY(Ref size_ref, need(w, st, "size", where));
    CKPTFS_TRY(t.size, w.dims(size_ref, where + ".size"));
    CKPTFS_TRY(Ref chunks_ref, need(w, st, "chunks", where));
    CKPTFS_TRY(auto chunks, w.sequence(chunks_ref, where + ".chunks"));
    for (Ref c : chunks) {
      CKPTFS_TRY(auto cs, w.object_state(c, kMeta, "ChunkStorageMetadata", where + ".chunks"));
      DistcpChunk ch;
      CKPTFS_TRY(Ref o, need(w, cs, "offsets", where + ".chunks"));
      CKPTFS_TRY(ch.offsets, w.dims(o, where + ".chunks.offsets"));
      CKPTFS_TRY(Ref s, need(w, cs, "sizes", where + ".chunks"));
      CKPTFS_TRY(ch.sizes, w.dims(s, where + ".chunks.sizes"));
      if (ch.offsets.size() != t.size.size() || ch.sizes.size() != t.size.size()) {
        return make_error(EINVAL,
                          "{}: tensor '{}': a chunk at {} of size {} in a tensor of size {}", what,
                          key, dims(ch.offsets), dims(ch.sizes), dims(t.size));
      }
      t.chunks.push_back(std::move(ch));
    }
    if (!by_key.emplace(t.key, out.tensors.size()).second) {
      return make_error(EINVAL, "{}: tensor '{}' is listed twice", what, key);
    }
    out.tensors.push_back(std::move(t));
  }

  // planner_data: the key's path in the nested state dict (None in Megatron's).
  if (auto pd = w.field(top, "planner_data"); pd && w.at(*pd).kind != Kind::None) {
    CKPTFS_TRY(auto pairs, w.pairs(*pd, "Metadata.planner_data"));
    for (size_t k = 0; k + 1 < pairs.size(); k += 2) {
      CKPTFS_TRY(std::string_view key, w.text(pairs[k], "a planner_data key"));
      auto it = by_key.find(key);
      if (it == by_key.end()) continue;
      CKPTFS_TRY(auto parts, w.sequence(pairs[k + 1], fmt::format("planner_data['{}']", key)));
      auto& path = out.tensors[it->second].path;
      for (Ref part : parts) {
        const pickle::Value& v = w.at(part);
        if (v.kind == Kind::Str) {
          // Its first part names what is left out (inspect, the log): valid UTF-8 too.
          CKPTFS_TRY(std::string_view s, w.text(part, fmt::format("planner_data['{}']", key)));
          path.emplace_back(s);
        } else if (v.kind == Kind::Int) {
          path.push_back(fmt::format("{}", v.i));  // a list index in the nested dict
        } else {
          return w.fail(fmt::format("planner_data['{}']", key), "a str or int", part);
        }
      }
    }
  }

  // storage_data: where each chunk's archive is.
  CKPTFS_TRY(Ref sd_ref, need(w, top, "storage_data", "Metadata"));
  CKPTFS_TRY(auto sd, w.pairs(sd_ref, "Metadata.storage_data"));
  std::vector<std::vector<bool>> placed(out.tensors.size());
  for (size_t t = 0; t < out.tensors.size(); ++t)
    placed[t].assign(out.tensors[t].chunks.size(), false);
  // Each tensor's chunks sorted by offsets, for the storage entries to find theirs: one
  // binary search each, not a walk of the tensor's chunks (60,000 chunks made that 1.8e9
  // comparisons). Two chunks at the same offsets are refused here.
  std::vector<std::vector<uint32_t>> by_offsets(out.tensors.size());
  for (size_t t = 0; t < out.tensors.size(); ++t) {
    const auto& chunks = out.tensors[t].chunks;
    auto& order = by_offsets[t];
    order.resize(chunks.size());
    std::iota(order.begin(), order.end(), 0u);
    std::sort(order.begin(), order.end(),
              [&](uint32_t a, uint32_t b) { return chunks[a].offsets < chunks[b].offsets; });
    for (size_t i = 1; i < order.size(); ++i) {
      if (chunks[order[i]].offsets == chunks[order[i - 1]].offsets) {
        return make_error(EINVAL, "{}: tensor '{}': lists the chunk at {} twice", what,
                          out.tensors[t].key, dims(chunks[order[i]].offsets));
      }
    }
  }
  std::unordered_set<std::string_view> files;  // distinct relative_paths (slices of the pickle)
  for (size_t k = 0; k + 1 < sd.size(); k += 2) {
    CKPTFS_TRY(auto idx, w.object_state(sd[k], kMeta, "MetadataIndex", "a storage_data key"));
    CKPTFS_TRY(Ref fqn_ref, need(w, idx, "fqn", "MetadataIndex"));
    CKPTFS_TRY(std::string_view fqn, w.text(fqn_ref, "MetadataIndex.fqn"));
    const std::string where = fmt::format("storage_data['{}']", fqn);
    CKPTFS_TRY(auto info, w.object_state(sd[k + 1], "torch.distributed.checkpoint.filesystem",
                                         "_StorageInfo", where));
    DistcpStorage place;
    place.key = std::string(fqn);
    CKPTFS_TRY(Ref rp, need(w, info, "relative_path", where));
    CKPTFS_TRY(std::string_view file, w.text(rp, where + ".relative_path"));
    place.file = std::string(file);
    if (files.insert(file).second && files.size() > kMaxDistcpFiles) {
      return make_error(EINVAL, "{}: names more than {} files (kMaxDistcpFiles)", what,
                        kMaxDistcpFiles);
    }
    CKPTFS_TRY(Ref o, need(w, info, "offset", where));
    CKPTFS_TRY(place.offset, w.non_negative(o, where + ".offset"));
    CKPTFS_TRY(Ref l, need(w, info, "length", where));
    CKPTFS_TRY(place.length, w.non_negative(l, where + ".length"));
    if (!checked_add(place.offset, place.length)) {
      return make_error(EINVAL, "{}: '{}': offset {} + length {} overflows", what, fqn,
                        place.offset, place.length);
    }
    out.storage.push_back(place);
    auto it = by_key.find(fqn);
    if (it == by_key.end()) continue;  // a bytes item's storage
    CKPTFS_TRY(Ref off_ref, need(w, idx, "offset", where));
    CKPTFS_TRY(auto offsets, w.dims(off_ref, where + ".offset"));
    DistcpTensor& t = out.tensors[it->second];
    const auto& order = by_offsets[it->second];
    auto at = std::lower_bound(
        order.begin(), order.end(), offsets,
        [&](uint32_t c, const std::vector<uint64_t>& o) { return t.chunks[c].offsets < o; });
    if (at == order.end() || t.chunks[*at].offsets != offsets) {
      return make_error(EINVAL, "{}: tensor '{}': storage for a chunk at {} that it does not list",
                        what, fqn, dims(offsets));
    }
    const size_t c = *at;
    if (placed[it->second][c]) {
      return make_error(EINVAL, "{}: tensor '{}': two storages for the chunk at {}", what, fqn,
                        dims(offsets));
    }
    DistcpChunk& ch = t.chunks[c];
    if (auto td = w.field(info, "transform_descriptors"); td && w.at(*td).kind != Kind::None) {
      const pickle::Value& tv = w.at(*td);
      ch.transformed = !((tv.kind == Kind::Tuple || tv.kind == Kind::List) && tv.items.empty());
    }
    ch.file = place.file;
    ch.offset = place.offset;
    ch.length = place.length;
    placed[it->second][c] = true;
  }
  for (size_t t = 0; t < out.tensors.size(); ++t) {
    for (size_t c = 0; c < placed[t].size(); ++c) {
      if (!placed[t][c]) {
        return make_error(EINVAL, "{}: tensor '{}': the chunk at {} has no storage entry", what,
                          out.tensors[t].key, dims(out.tensors[t].chunks[c].offsets));
      }
    }
  }
  CKPTFS_CHECK(check_storage_overlaps(out.storage, what));
  return out;
}

bool TorchTensorRecord::contiguous() const {
  if (stride.size() != size.size()) return false;
  uint64_t expect = 1;
  for (size_t d = size.size(); d-- > 0;) {
    if (size[d] != 1 && stride[d] != expect) return false;
    auto next = checked_mul(expect, size[d]);
    if (!next) return false;
    expect = *next;
  }
  return true;
}

Result<TorchTensorRecord> read_rebuild_tensor(const pickle::Pickle& p, Ref ref,
                                              std::string_view what) {
  const Walk w(p, what);
  const pickle::Value& root = w.at(ref);
  const bool v3 =
      root.kind == Kind::Call && w.is_global(root.func, "torch._utils", "_rebuild_tensor_v3");
  if (!v3) CKPTFS_CHECK(w.call(ref, "torch._utils", "_rebuild_tensor_v2", "the tensor"));
  CKPTFS_TRY(auto args, w.sequence(root.args, "_rebuild_tensor arguments"));
  if (args.size() < (v3 ? 7u : 4u)) {
    return make_error(EINVAL, "{}: _rebuild_tensor with {} arguments", what, args.size());
  }
  const pickle::Value& pid = w.at(args[0]);
  if (pid.kind != Kind::PersistentId)
    return w.fail("the tensor's storage", "a persistent id", args[0]);
  CKPTFS_TRY(auto id, w.sequence(pid.args, "the storage id"));
  if (id.size() != 5) {
    return make_error(EINVAL, "{}: a storage id of {} fields (5 expected)", what, id.size());
  }
  CKPTFS_TRY(std::string_view tag, w.text(id[0], "the storage id's tag"));
  if (tag != "storage") return make_error(EINVAL, "{}: a persistent id tagged '{}'", what, tag);
  TorchTensorRecord r;
  CKPTFS_TRY(std::string_view key, w.text(id[2], "the storage key"));
  r.storage_key = std::string(key);
  CKPTFS_TRY(r.storage_numel, w.non_negative(id[4], "the storage size"));
  CKPTFS_TRY(r.storage_offset, w.non_negative(args[1], "the storage offset"));
  CKPTFS_TRY(r.size, w.dims(args[2], "the tensor size"));
  CKPTFS_TRY(r.stride, w.dims(args[3], "the tensor stride"));
  const pickle::Value& st = w.at(id[1]);
  if (v3) {
    // _rebuild_tensor_v3(..., dtype): the storage is untyped, counted in bytes.
    if (!w.is_global(id[1], "torch.storage", "UntypedStorage")) {
      return w.fail("the storage class", "torch.storage.UntypedStorage", id[1]);
    }
    const pickle::Value& dt = w.at(args[6]);
    auto d =
        dt.kind == Kind::Global && p.text(dt) == "torch" ? torch_dtype(p.name(dt)) : std::nullopt;
    if (!d) return w.fail("the tensor dtype", "a torch dtype a safetensors file can hold", args[6]);
    r.dtype = *d;
    const uint32_t bits = dtype_bits(r.dtype);
    if (bits % 8 != 0 || r.storage_numel % (bits / 8) != 0) {
      return make_error(EINVAL, "{}: an untyped storage of {} bytes for {} elements", what,
                        r.storage_numel, dtype_name(r.dtype));
    }
    r.storage_numel /= bits / 8;
  } else {
    auto d = st.kind == Kind::Global && p.text(st) == "torch" ? torch_storage_dtype(p.name(st))
                                                              : std::nullopt;
    if (!d) return w.fail("the storage class", "a torch storage class", id[1]);
    r.dtype = *d;
  }
  if (r.size.size() != r.stride.size()) {
    return make_error(EINVAL, "{}: size {} and stride {} differ in rank", what, dims(r.size),
                      dims(r.stride));
  }
  return r;
}

Result<uint64_t> tensor_offset_in_archive(const zip::TorchArchive& a, const TorchTensorRecord& rec,
                                          std::string_view what) {
  if (!rec.contiguous()) {
    return make_error(EINVAL, "{}: a non-contiguous layout (stride {} for size {}) is not served",
                      what, dims(rec.stride), dims(rec.size));
  }
  const zip::Member* storage = a.storage(rec.storage_key);
  if (storage == nullptr) {
    return make_error(EINVAL, "{}: its storage '{}' is not in the archive", what, rec.storage_key);
  }
  const uint64_t item = dtype_bits(rec.dtype) / 8;
  auto numel = checked_numel(rec.size);
  auto storage_bytes = checked_mul(rec.storage_numel, item);
  auto end = numel ? checked_add(rec.storage_offset, *numel) : std::nullopt;
  if (!storage_bytes || *storage_bytes != storage->size || !end || *end > rec.storage_numel) {
    return make_error(EINVAL,
                      "{}: storage '{}' of {} bytes does not hold {} elements of {} at element {}",
                      what, rec.storage_key, storage->size, numel.value_or(0),
                      dtype_name(rec.dtype), rec.storage_offset);
  }
  // storage_offset * item <= storage bytes, which fit in the archive.
  return storage->offset + rec.storage_offset * item;
}

Result<TorchTensorRecord> parse_torch_tensor_pickle(std::string&& bytes, std::string_view what) {
  CKPTFS_TRY(pickle::Pickle p, pickle::parse(std::move(bytes), tensor_globals(), what));
  return read_rebuild_tensor(p, p.root(), what);
}

}  // namespace ckptfs::format
