// format/names: the file names ckptfs recognizes (rank shards, model files, verl ranks) and makes.
#include "ckptfs/format/names.hpp"

#include <fmt/core.h>

#include "ckptfs/util/text.hpp"

namespace ckptfs::format {
namespace {

// Consumes a run of 1..9 digits from the front of `s`.
std::optional<uint32_t> take_number(std::string_view& s) {
  size_t i = 0;
  uint32_t v = 0;
  while (i < s.size() && i < 10 && s[i] >= '0' && s[i] <= '9') {
    v = v * 10 + static_cast<uint32_t>(s[i] - '0');
    ++i;
  }
  if (i == 0 || i > 9) return std::nullopt;
  s.remove_prefix(i);
  return v;
}

bool take(std::string_view& s, std::string_view lit) {
  if (!s.starts_with(lit)) return false;
  s.remove_prefix(lit.size());
  return true;
}

// Parses "{k}-of-{m}.safetensors" to the end of `s`.
std::optional<std::pair<uint32_t, uint32_t>> take_k_of_m(std::string_view s) {
  auto k = take_number(s);
  if (!k || !take(s, "-of-")) return std::nullopt;
  auto m = take_number(s);
  if (!m || s != kSafetensorsSuffix) return std::nullopt;
  if (*k < 1 || *m < 1 || *k > *m) return std::nullopt;
  return std::pair{*k, *m};
}

std::string pad5(uint32_t v) { return fmt::format("{:05d}", v); }

}  // namespace

std::optional<ShardName> parse_shard_name(std::string_view s) {
  if (!take(s, "shard-")) return std::nullopt;
  auto r = take_number(s);
  if (!r || !take(s, "-model-")) return std::nullopt;
  auto km = take_k_of_m(s);
  if (!km) return std::nullopt;
  return ShardName{*r, km->first, km->second};
}

std::optional<ModelName> parse_model_name(std::string_view s) {
  if (s == kSingleFileName) return ModelName{1, 1, true};
  if (!take(s, "model-")) return std::nullopt;
  auto km = take_k_of_m(s);
  if (!km) return std::nullopt;
  return ModelName{km->first, km->second, false};
}

bool is_safetensors_name(std::string_view name) {
  return name.size() > kSafetensorsSuffix.size() && name.ends_with(kSafetensorsSuffix);
}

bool looks_like_shard_name(std::string_view name) {
  return name.starts_with("shard-") && is_safetensors_name(name);
}

Status check_tensor_name(std::string_view name, std::string_view what) {
  if (name.empty()) return make_error(EINVAL, "{}: a tensor with an empty name", what);
  if (!is_valid_utf8(name)) {
    return make_error(EINVAL, "{}: tensor '{}': its name is not valid UTF-8", what,
                      printable(name.substr(0, 200)));
  }
  if (name == kReservedTensorName) {
    return make_error(EINVAL, "{}: a tensor named '{}', the safetensors header's own field", what,
                      kReservedTensorName);
  }
  return {};
}

std::string model_file_name(uint32_t k, uint32_t m) {
  return fmt::format("model-{}-of-{}{}", pad5(k), pad5(m), kSafetensorsSuffix);
}

std::string shard_file_name(uint32_t shard, uint32_t k, uint32_t m) {
  return fmt::format("shard-{}-model-{}-of-{}{}", pad5(shard), pad5(k), pad5(m),
                     kSafetensorsSuffix);
}

std::optional<VerlRankName> parse_verl_rank_name(std::string_view name) {
  constexpr std::string_view kWorld = "_world_size_", kPt = ".pt";
  if (!name.ends_with(kPt)) return std::nullopt;
  name.remove_suffix(kPt.size());
  const size_t w = name.find(kWorld);
  if (w == std::string_view::npos || w == 0) return std::nullopt;
  std::string_view rest = name.substr(w + kWorld.size());
  auto plain = [](std::string_view s) { return !(s.size() > 1 && s[0] == '0'); };
  if (!plain(rest)) return std::nullopt;
  auto world = take_number(rest);
  if (!world || !take(rest, "_rank_") || !plain(rest)) return std::nullopt;
  auto rank = take_number(rest);
  if (!rank || !rest.empty() || *world == 0 || *world > kMaxVerlWorld || *rank >= *world) {
    return std::nullopt;
  }
  return VerlRankName{std::string(name.substr(0, w)), *world, *rank};
}

std::string verl_rank_name(std::string_view kind, uint32_t world, uint32_t rank) {
  return fmt::format("{}_world_size_{}_rank_{}.pt", kind, world, rank);
}

}  // namespace ckptfs::format
