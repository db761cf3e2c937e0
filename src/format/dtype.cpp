// format/dtype: safetensors dtype names, widths and byte sizes.
#include "ckptfs/format/dtype.hpp"

#include <array>

#include "ckptfs/util/checked.hpp"

namespace ckptfs::format {
namespace {

constexpr std::array kDTypes = {
    DTypeInfo{DType::BOOL, "BOOL", 8},
    DTypeInfo{DType::U8, "U8", 8},
    DTypeInfo{DType::I8, "I8", 8},
    DTypeInfo{DType::F8_E5M2, "F8_E5M2", 8},
    DTypeInfo{DType::F8_E4M3, "F8_E4M3", 8},
    DTypeInfo{DType::F8_E8M0, "F8_E8M0", 8},
    DTypeInfo{DType::F8_E4M3FNUZ, "F8_E4M3FNUZ", 8},
    DTypeInfo{DType::F8_E5M2FNUZ, "F8_E5M2FNUZ", 8},
    DTypeInfo{DType::I16, "I16", 16},
    DTypeInfo{DType::U16, "U16", 16},
    DTypeInfo{DType::F16, "F16", 16},
    DTypeInfo{DType::BF16, "BF16", 16},
    DTypeInfo{DType::I32, "I32", 32},
    DTypeInfo{DType::U32, "U32", 32},
    DTypeInfo{DType::F32, "F32", 32},
    DTypeInfo{DType::C64, "C64", 64},
    DTypeInfo{DType::F64, "F64", 64},
    DTypeInfo{DType::I64, "I64", 64},
    DTypeInfo{DType::U64, "U64", 64},
    DTypeInfo{DType::F4, "F4", 4},
    DTypeInfo{DType::F6_E2M3, "F6_E2M3", 6},
    DTypeInfo{DType::F6_E3M2, "F6_E3M2", 6},
};

}  // namespace

std::span<const DTypeInfo> all_dtypes() { return kDTypes; }

std::optional<DType> parse_dtype(std::string_view name) {
  for (const auto& d : kDTypes) {
    if (d.name == name) return d.dtype;
  }
  return std::nullopt;
}

std::string_view dtype_name(DType d) { return kDTypes[static_cast<size_t>(d)].name; }
uint32_t dtype_bits(DType d) { return kDTypes[static_cast<size_t>(d)].bits; }

std::optional<uint64_t> byte_size(DType d, uint64_t numel) {
  auto bits = checked_mul(numel, dtype_bits(d));
  if (!bits || *bits % 8 != 0) return std::nullopt;
  return *bits / 8;
}

}  // namespace ckptfs::format
