// The safetensors dtype table. Sizes are in bits so sub-byte types (F4, F6_*) are exact.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>

namespace ckptfs::format {

enum class DType : uint8_t {
  BOOL,
  U8,
  I8,
  F8_E5M2,
  F8_E4M3,
  F8_E8M0,
  F8_E4M3FNUZ,
  F8_E5M2FNUZ,
  I16,
  U16,
  F16,
  BF16,
  I32,
  U32,
  F32,
  C64,
  F64,
  I64,
  U64,
  F4,
  F6_E2M3,
  F6_E3M2,
};

struct DTypeInfo {
  DType dtype;
  std::string_view name;
  uint32_t bits;
};

std::span<const DTypeInfo> all_dtypes();
std::optional<DType> parse_dtype(std::string_view name);
std::string_view dtype_name(DType d);
uint32_t dtype_bits(DType d);

// Byte size of `numel` elements of `d`; nullopt on overflow or when the bit count is
// not a whole number of bytes (the reference loader refuses such tensors).
std::optional<uint64_t> byte_size(DType d, uint64_t numel);

}  // namespace ckptfs::format
