// Threads that are always joined. std::thread throws when the process or user thread limit is
// reached, and a std::thread still joinable when it is destroyed (an exception unwinding past a
// vector of them) ends the process: spawn() reports the failure instead, and the destructor
// joins whatever was started.
#pragma once

#include <new>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "ckptfs/util/result.hpp"

namespace ckptfs {

class JoinedThreads {
 public:
  JoinedThreads() = default;
  ~JoinedThreads() { join(); }
  JoinedThreads(const JoinedThreads&) = delete;
  JoinedThreads& operator=(const JoinedThreads&) = delete;

  // Starts `f` on a new thread; EAGAIN (or ENOMEM) when none can be started.
  template <typename F>
  Status spawn(F&& f) noexcept {
    try {
      threads_.emplace_back(std::forward<F>(f));
      return {};
    } catch (const std::system_error& e) {
      const int code = e.code().value() > 0 ? e.code().value() : EAGAIN;
      return make_error(code, "cannot start a thread: {}", e.what());
    } catch (const std::bad_alloc&) {
      return make_error(ENOMEM, "cannot start a thread: out of memory");
    }
  }
  void join() noexcept {
    for (auto& t : threads_) {
      if (t.joinable()) t.join();
    }
    threads_.clear();
  }
  [[nodiscard]] size_t size() const { return threads_.size(); }

 private:
  std::vector<std::thread> threads_;
};

}  // namespace ckptfs
