// libFuzzer target: the native-format parsers (the restricted unpickler, DCP's .metadata and
// tensor pickles, verl's DTensor state dicts and fsdp_config.json, the zip locator with the
// whole-archive caps and a DCP chunk's) on arbitrary bytes.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "ckptfs/format/distcp.hpp"
#include "ckptfs/format/verl.hpp"
#include "ckptfs/format/zip.hpp"
#include "ckptfs/source/distcp.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ckptfs;
  std::string_view bytes(reinterpret_cast<const char*>(data), size);
  (void)format::parse_distcp_metadata(std::string(bytes), "fuzz.metadata");
  (void)format::parse_torch_tensor_pickle(std::string(bytes), "fuzz data.pkl");
  (void)format::parse_rank_state_dict(bytes, "fuzz rank data.pkl");
  (void)format::parse_verl_config(bytes, "fuzz fsdp_config.json");
  (void)format::parse_verl_rank_name(bytes);
  auto read = [&](uint64_t off, std::span<char> out) -> Status {
    if (off > size || out.size() > size - off) return make_error(EIO, "past the end");
    std::memcpy(out.data(), data + off, out.size());
    return {};
  };
  // A DCP chunk's archive is read with small caps (one tensor's archive): they must refuse,
  // never misread, what the whole-state-dict caps accept.
  auto chunk = format::zip::members(
      size, read, "fuzz chunk",
      format::zip::Limits{source::kMaxChunkArchiveMembers, source::kMaxChunkDirectoryBytes});
  auto m = format::zip::members(size, read, "fuzz.zip");
  if (chunk.ok() && (!m.ok() || m->size() != chunk->size())) __builtin_trap();
  if (m.ok()) {
    // Every member located lies inside the archive, and none overlap.
    for (const auto& x : *m) {
      if (x.offset > size || x.size > size - x.offset) __builtin_trap();
    }
    auto a = format::zip::torch_archive(*m, "fuzz.zip");
    if (a.ok()) {
      (void)format::parse_torch_tensor_pickle(
          std::string(bytes.substr(a->pickle.offset, a->pickle.size)), "fuzz data.pkl");
      (void)format::parse_rank_state_dict(bytes.substr(a->pickle.offset, a->pickle.size),
                                          "fuzz rank data.pkl");
    }
  }
  return 0;
}
