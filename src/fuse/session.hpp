// fuse/session: a FUSE session's lifetime (created, mounted, torn down in order) and the stop
// signals that end its loop.
#pragma once

#include <fuse_lowlevel.h>

#include <string>

namespace ckptfs::fuse {

// Owns a fuse_session: created, optionally mounted, and always torn down in order.
class Session {
 public:
  Session() = default;
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;
  ~Session();
  bool create(fuse_args* args, const fuse_lowlevel_ops& ops, void* userdata);
  bool mount(const std::string& mnt);
  // libfuse's handlers (SIGPIPE ignored among them), then the stop signals (SIGTERM, SIGINT,
  // SIGHUP) end the loop; called on the thread that will run the loop.
  bool signals();
  fuse_session* get() const { return se_; }

 private:
  fuse_session* se_ = nullptr;
  bool mounted_ = false;
  bool signals_ = false;
};

}  // namespace ckptfs::fuse
