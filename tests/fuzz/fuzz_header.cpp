// libFuzzer target: the safetensors header parser on arbitrary file bytes.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "ckptfs/format/safetensors.hpp"

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
  return 0;
}
