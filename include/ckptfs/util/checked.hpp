// Overflow-safe arithmetic for sizes and offsets read from untrusted headers.
#pragma once

#include <cstdint>
#include <optional>
#include <span>

namespace ckptfs {

[[nodiscard]] inline std::optional<uint64_t> checked_add(uint64_t a, uint64_t b) {
  uint64_t r;
  if (__builtin_add_overflow(a, b, &r)) return std::nullopt;
  return r;
}

[[nodiscard]] inline std::optional<uint64_t> checked_mul(uint64_t a, uint64_t b) {
  uint64_t r;
  if (__builtin_mul_overflow(a, b, &r)) return std::nullopt;
  return r;
}

// Product of all dimensions; nullopt on overflow. The empty shape (0-d) is 1.
[[nodiscard]] inline std::optional<uint64_t> checked_numel(std::span<const uint64_t> shape) {
  uint64_t n = 1;
  for (uint64_t d : shape) {
    if (__builtin_mul_overflow(n, d, &n)) return std::nullopt;
  }
  return n;
}

}  // namespace ckptfs
