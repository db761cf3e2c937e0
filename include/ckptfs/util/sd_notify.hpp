// Tells the service manager about the daemon's state, as sd_notify(3) does: one datagram to
// the AF_UNIX socket named by $NOTIFY_SOCKET (a path, or "@name" for an abstract socket).
// The protocol is stable and documented, so no libsystemd is needed for a Type=notify unit.
#pragma once

#include <string_view>

namespace ckptfs {

// `state`: newline-separated assignments such as "READY=1\nSTATUS=serving". Does nothing and
// returns false without $NOTIFY_SOCKET (not run by systemd) or when the send fails.
bool sd_notify(std::string_view state);

}  // namespace ckptfs
