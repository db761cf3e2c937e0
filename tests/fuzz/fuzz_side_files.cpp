// libFuzzer target: the other parsers of untrusted JSON, on the same bytes: NeMo's
// fqn_to_file_index_mapping.json and fqn_to_dtype_mapping.json, model.safetensors.index.json, the
// DCP_SHARDING_INFO string a shard's __metadata__ carries, the write path's commit records
// (.ckptfs/*.commit) and the base_model_tp_plan of a config.json. None may crash, hang or recurse
// without bound (100,000-deep nesting once overflowed the stack); what parses must hold its
// invariants.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "ckptfs/format/dcp.hpp"
#include "ckptfs/format/index.hpp"
#include "ckptfs/format/record.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  if (auto m = ckptfs::format::parse_fqn_mapping(text, "fuzz-mapping.json"); m.ok()) {
    for (const auto& [name, file] : *m) {
      if (file < 1 || file > 99999) __builtin_trap();
    }
  }
  if (auto dm = ckptfs::format::parse_dtype_mapping(text, "fuzz-dtypes.json"); dm.ok()) {
    // Every value is a dtype of the table, named as it was written.
    for (const auto& [name, d] : *dm) {
      if (ckptfs::format::parse_dtype(ckptfs::format::dtype_name(d)) != d) __builtin_trap();
    }
  }
  if (auto idx = ckptfs::format::parse_index(text, "fuzz-index.json"); idx.ok()) {
    // What parses serializes again without throwing.
    (void)ckptfs::format::serialize_index(*idx);
  }
  if (auto info = ckptfs::format::parse_sharding_info(text, "fuzz.safetensors"); info.ok()) {
    // Rank mismatches between offsets and shapes are the layout's to refuse (fuzz_checkpoint);
    // here what parses must round-trip.
    auto again = ckptfs::format::parse_sharding_info(ckptfs::format::serialize_sharding_info(*info),
                                                     "fuzz.safetensors");
    if (!again.ok() || again->size() != info->size()) __builtin_trap();
  }
  if (auto rec = ckptfs::format::parse_record(text, "fuzz.commit"); rec.ok()) {
    // A record that parses names only shards of its own file, and round-trips exactly.
    // A node-local shard's path stays below its target (relative, no "." or ".."
    // component) and ends in the shard's name; its owner is a rank number.
    for (const auto& sh : rec->shards) {
      if (sh.name.find('/') != std::string::npos) __builtin_trap();
      if (sh.remote() != rec->remote()) __builtin_trap();
      if (!sh.remote()) continue;
      if (sh.owner >= static_cast<int32_t>(ckptfs::format::kMaxRecordOwner) || !sh.parsed ||
          sh.path.empty() || sh.path.front() == '/' || !sh.path.ends_with(sh.name) ||
          ("/" + sh.path + "/").find("/../") != std::string::npos ||
          ("/" + sh.path + "/").find("/./") != std::string::npos) {
        __builtin_trap();
      }
    }
    auto again = ckptfs::format::parse_record(ckptfs::format::serialize_record(*rec), "again");
    if (!again.ok() || again->header != rec->header || again->shards.size() != rec->shards.size()) {
      __builtin_trap();
    }
    for (size_t i = 0; i < rec->shards.size(); ++i) {
      const auto &a = rec->shards[i], &b = again->shards[i];
      if (a.owner != b.owner || a.path != b.path || a.header != b.header) __builtin_trap();
    }
  }
  (void)ckptfs::format::parse_tp_plan(text, "fuzz-config.json");
  return 0;
}
