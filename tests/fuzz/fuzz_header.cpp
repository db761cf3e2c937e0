// libFuzzer target: the safetensors header parser on arbitrary file bytes.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "ckptfs/format/safetensors.hpp"
#include "ckptfs/write/sniff.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view bytes(reinterpret_cast<const char*>(data), size);
  auto h = ckptfs::format::parse_file_bytes(bytes, "fuzz.safetensors");
  if (h.ok()) {
    // Invariants the rest of ckptfs relies on.
    uint64_t pos = 0;
    for (const auto& t : h->tensors) {
      if (t.begin != pos || t.end < t.begin) __builtin_trap();
      pos = t.end;
    }
    if (h->file_size() != size) __builtin_trap();
  }
  // The write path's sniffer reads the same untrusted bytes, with the size known or not yet
  // (before the writer's ftruncate): whatever it calls consolidated must parse strictly.
  for (uint64_t known : {static_cast<uint64_t>(size), uint64_t{0}}) {
    auto s = ckptfs::write::sniff(bytes, known, "fuzz.safetensors");
    if (s.kind == ckptfs::write::Kind::Consolidated && !s.header) __builtin_trap();
  }
  return 0;
}
