// Result<T>: a value or an Error carrying an errno and a human message.
//
// g++ 12 in C++20 mode has no std::expected, so this is the small stand-in the
// whole code base uses. Errors build their message only on the failure path.
#pragma once

#include <cerrno>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>

#include <fmt/core.h>

namespace ckptfs {

struct Error {
  int code = EIO;  // errno value reported to the kernel or used as exit reason
  std::string message;

  // Prefix the message with more context ("file x: " + message).
  [[nodiscard]] Error context(std::string_view prefix) && {
    message = fmt::format("{}: {}", prefix, message);
    return std::move(*this);
  }
};

template <typename... Args>
[[nodiscard]] Error make_error(int code, fmt::format_string<Args...> f, Args&&... args) {
  return Error{code, fmt::format(f, std::forward<Args>(args)...)};
}

template <typename T>
class [[nodiscard]] Result {
 public:
  using value_type = T;

  Result(T value) : v_(std::in_place_index<0>, std::move(value)) {}      // NOLINT
  Result(Error error) : v_(std::in_place_index<1>, std::move(error)) {}  // NOLINT

  [[nodiscard]] bool ok() const noexcept { return v_.index() == 0; }
  explicit operator bool() const noexcept { return ok(); }

  T& value() & { return std::get<0>(v_); }
  const T& value() const& { return std::get<0>(v_); }
  T&& value() && { return std::get<0>(std::move(v_)); }

  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

  const Error& error() const& { return std::get<1>(v_); }
  Error&& error() && { return std::get<1>(std::move(v_)); }

 private:
  std::variant<T, Error> v_;
};

template <>
class [[nodiscard]] Result<void> {
 public:
  Result() = default;
  Result(Error error) : err_(std::move(error)), ok_(false) {}  // NOLINT

  [[nodiscard]] bool ok() const noexcept { return ok_; }
  explicit operator bool() const noexcept { return ok_; }
  const Error& error() const& { return err_; }
  Error&& error() && { return std::move(err_); }

 private:
  Error err_;
  bool ok_ = true;
};

using Status = Result<void>;

}  // namespace ckptfs

// Propagate an error: `CKPTFS_TRY(auto x, f());` binds x to the value.
#define CKPTFS_CONCAT_INNER(a, b) a##b
#define CKPTFS_CONCAT(a, b) CKPTFS_CONCAT_INNER(a, b)
#define CKPTFS_TRY_IMPL(tmp, decl, expr)        \
  auto tmp = (expr);                            \
  if (!tmp.ok()) return std::move(tmp).error(); \
  decl = std::move(tmp).value()
#define CKPTFS_TRY(decl, expr) CKPTFS_TRY_IMPL(CKPTFS_CONCAT(ckptfs_try_, __LINE__), decl, expr)
// For Result<void> / Status.
#define CKPTFS_CHECK(expr)                                              \
  do {                                                                  \
    auto ckptfs_check_r = (expr);                                       \
    if (!ckptfs_check_r.ok()) return std::move(ckptfs_check_r).error(); \
  } while (0)
