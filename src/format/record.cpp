// format/record: the write path's commit records, parsed and serialized.
#include "ckptfs/format/record.hpp"

#include <nlohmann/json.hpp>

#include "ckptfs/format/names.hpp"
#include "ckptfs/util/path.hpp"
#include "json_strict.hpp"

namespace ckptfs::format {

std::string record_file_name(std::string_view file_name) {
  return std::string(file_name) + std::string(kRecordSuffix);
}

std::vector<std::string> stored_names(std::string_view file_name, uint32_t k, uint32_t m,
                                      uint32_t ranks) {
  std::vector<std::string> names;
  names.reserve(size_t{ranks} + 1);
  for (uint32_t r = 1; r <= ranks; ++r) names.push_back(shard_file_name(r, k, m));
  names.push_back(std::string(kStateDirName) + "/" + record_file_name(file_name));
  return names;
}

std::optional<std::string_view> parse_record_name(std::string_view name) {
  if (name.starts_with(kStateDirName) && name.size() > kStateDirName.size() &&
      name[kStateDirName.size()] == '/') {
    name.remove_prefix(kStateDirName.size() + 1);
  }
  if (!name.ends_with(kRecordSuffix) || name.size() == kRecordSuffix.size()) return std::nullopt;
  name.remove_suffix(kRecordSuffix.size());
  return name;
}

namespace {

// The owner, path and header of a node-local shard (version 2); `s` has its name and size.
Status parse_remote_shard(const nlohmann::json& e, RecordShard& s, std::string_view what) {
  auto bad = [&](std::string_view why) {
    return make_error(EINVAL, "{}: commit record: shard '{}': {}", what, s.name, why);
  };
  auto ow = e.find("owner");
  auto pa = e.find("path");
  auto hj = e.find("header_json");
  if (ow == e.end() || !ow->is_number_unsigned() || pa == e.end() || !pa->is_string() ||
      hj == e.end() || !hj->is_string()) {
    return bad("needs an owner, a path and its header_json (version 2)");
  }
  if (ow->get<uint64_t>() >= kMaxRecordOwner) return bad("owner rank out of range");
  s.owner = static_cast<int32_t>(ow->get<uint64_t>());
  s.path = pa->get<std::string>();
  // Relative, plain components only, and the shard's own name last: a record can never make
  // a rank open anything but a shard file below its target.
  if (s.path.size() > 4096) return bad("path longer than 4096 bytes");
  if (s.path.empty() || !is_safe_rel(s.path)) {
    return bad(fmt::format("path '{}' is not plain", s.path));
  }
  if (split_rel(s.path).name != s.name) {
    return bad(fmt::format("path '{}' does not end in its name", s.path));
  }
  const auto& json = hj->get_ref<const std::string&>();
  if (json.size() > kMaxHeaderSize) return bad("header larger than the safetensors limit");
  auto h = parse_header_json(json, s.size, fmt::format("{}: shard {}", what, s.name));
  if (!h) return std::move(h).error();
  s.parsed = std::make_shared<const Header>(std::move(h).value());
  s.header = with_length_prefix(json);
  return {};
}

}  // namespace

std::string serialize_record(const Record& r) {
  nlohmann::json j;
  j["ckptfs_record"] = r.remote() ? kRecordVersionRemote : kRecordVersion;
  j["name"] = r.name;
  j["k"] = r.k;
  j["m"] = r.m;
  j["size"] = r.size;
  // The 8-byte length is implied; the JSON bytes are valid UTF-8 (the parser checked), so a
  // JSON string holds them exactly.
  j["header_json"] = r.header.size() >= kHeaderLenBytes ? r.header.substr(kHeaderLenBytes) : "";
  j["tx"] = r.tx;
  if (r.has_owner) {
    j["file_uid"] = r.uid;
    j["file_gid"] = r.gid;
    j["file_mode"] = r.mode & 07777;
  }
  auto shards = nlohmann::json::array();
  for (const auto& s : r.shards) {
    nlohmann::json e = {{"name", s.name}, {"size", s.size}};
    if (s.remote()) {
      e["owner"] = s.owner;
      e["path"] = s.path;
      e["header_json"] = s.header.size() >= kHeaderLenBytes ? s.header.substr(kHeaderLenBytes) : "";
    }
    shards.push_back(std::move(e));
  }
  j["shards"] = std::move(shards);
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::strict) + "\n";
}

Result<Record> parse_record(std::string_view text, std::string_view what) {
  CKPTFS_TRY(nlohmann::json j, detail::parse_json_strict(text, what, "commit record"));
  auto bad = [&](std::string_view why) {
    return make_error(EINVAL, "{}: commit record: {}", what, why);
  };
  if (!j.is_object()) return bad("not a JSON object");
  auto get_u64 = [&](const char* key, uint64_t& out) -> bool {
    auto it = j.find(key);
    if (it == j.end() || !it->is_number_unsigned()) return false;
    out = it->get<uint64_t>();
    return true;
  };
  auto get_str = [&](const char* key, std::string& out) -> bool {
    auto it = j.find(key);
    if (it == j.end() || !it->is_string()) return false;
    out = it->get<std::string>();
    return true;
  };
  uint64_t version = 0, k = 0, m = 0;
  Record r;
  std::string json;
  if (!get_u64("ckptfs_record", version) ||
      (version != kRecordVersion && version != kRecordVersionRemote)) {
    return bad("unknown version (not 1 or 2)");
  }
  const bool remote = version == kRecordVersionRemote;
  if (!get_str("name", r.name) || !get_u64("k", k) || !get_u64("m", m) ||
      !get_u64("size", r.size) || !get_str("header_json", json) || !get_str("tx", r.tx)) {
    return bad("missing or mistyped field (name, k, m, size, header_json, tx)");
  }
  auto mn = parse_model_name(r.name);
  if (!mn || mn->k != k || mn->m != m) return bad("name does not match k and m");
  r.k = static_cast<uint32_t>(k);
  r.m = static_cast<uint32_t>(m);
  if (!r.tx.empty() && !is_valid_component(r.tx)) return bad("tx is not a plain name");
  if (j.contains("file_uid") || j.contains("file_gid") || j.contains("file_mode")) {
    uint64_t uid = 0, gid = 0, mode = 0;
    if (!get_u64("file_uid", uid) || !get_u64("file_gid", gid) || !get_u64("file_mode", mode) ||
        uid > UINT32_MAX - 1 || gid > UINT32_MAX - 1 || mode > 07777) {
      return bad("file_uid, file_gid and file_mode go together, as ids and permission bits");
    }
    r.has_owner = true;
    r.uid = static_cast<uint32_t>(uid);
    r.gid = static_cast<uint32_t>(gid);
    r.mode = static_cast<uint32_t>(mode);
  }
  if (json.size() > kMaxHeaderSize) return bad("header larger than the safetensors limit");
  CKPTFS_TRY(r.parsed, parse_header_json(json, r.size, what));
  r.header = with_length_prefix(json);
  auto sh = j.find("shards");
  if (sh == j.end() || !sh->is_array() || sh->empty()) return bad("no shard list");
  for (const auto& e : *sh) {
    if (!e.is_object()) return bad("shard entry is not an object");
    auto nm = e.find("name");
    auto sz = e.find("size");
    if (nm == e.end() || !nm->is_string() || sz == e.end() || !sz->is_number_unsigned()) {
      return bad("shard entry needs a name and a size");
    }
    if (r.shards.size() >= kMaxRecordOwner) return bad("more shards than ranks can own");
    RecordShard s;
    s.name = nm->get<std::string>();
    s.size = sz->get<uint64_t>();
    auto p = parse_shard_name(s.name);
    if (!p || p->k != r.k || p->m != r.m || !is_valid_component(s.name)) {
      return bad(fmt::format("shard '{}' is not a shard of file {} of {}", s.name, r.k, r.m));
    }
    if (remote) {
      CKPTFS_CHECK(parse_remote_shard(e, s, what));
    } else if (e.contains("owner") || e.contains("path") || e.contains("header_json")) {
      return bad(fmt::format("shard '{}': owner, path or header in a version 1 record", s.name));
    }
    r.shards.push_back(std::move(s));
  }
  return r;
}

}  // namespace ckptfs::format
