// util/sd_notify: systemd's readiness notification (sd_notify) without libsystemd.
#include "ckptfs/util/sd_notify.hpp"

#include <sys/socket.h>
#include <sys/un.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "ckptfs/util/fd.hpp"

namespace ckptfs {

bool sd_notify(std::string_view state) {
  const char* env = std::getenv("NOTIFY_SOCKET");
  if (env == nullptr) return false;
  std::string_view path = env;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() < 2 || path.size() >= sizeof(addr.sun_path) ||
      (path[0] != '/' && path[0] != '@')) {
    return false;
  }
  std::memcpy(addr.sun_path, path.data(), path.size());
  if (path[0] == '@') addr.sun_path[0] = '\0';  // abstract namespace
  const auto len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + path.size());
  UniqueFd fd(::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return false;
  return ::sendto(fd.get(), state.data(), state.size(), MSG_NOSIGNAL,
                  reinterpret_cast<const sockaddr*>(&addr),
                  len) == static_cast<ssize_t>(state.size());
}

}  // namespace ckptfs
