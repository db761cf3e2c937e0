// fuse/session: the FUSE session's lifetime and the stop signals that end its loop.
#include "session.hpp"

#include <pthread.h>
#include <signal.h>

#include <atomic>

namespace ckptfs::fuse {
namespace {

// The stop signals (SIGTERM, SIGINT, SIGHUP). libfuse's own handler only sets the session's
// exit flag, and the loop's thread notices it when its wait is interrupted: a signal the
// kernel delivers to another thread of the daemon (the close watcher, the notify queue, a
// prefetch worker, all blocked in waits of their own) interrupts nothing there, and the
// daemon went on serving until the next request came. This handler sets the flag and passes
// the signal on to the loop's thread. Both calls are async-signal-safe (libfuse's handler
// makes the first; pthread_kill is on POSIX's list).
std::atomic<fuse_session*> g_stop_session{nullptr};  // the session a stop signal ends
pthread_t g_loop_thread;  // the thread running the loop; written before the handler is set

void on_stop_signal(int sig) {
  if (fuse_session* se = g_stop_session.load()) fuse_session_exit(se);
  if (!pthread_equal(pthread_self(), g_loop_thread)) pthread_kill(g_loop_thread, sig);
}

constexpr int kStopSignals[] = {SIGTERM, SIGINT, SIGHUP};

}  // namespace

Session::~Session() {
  if (!se_) return;
  if (signals_) {
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    for (int sig : kStopSignals) ::sigaction(sig, &dfl, nullptr);
    g_stop_session.store(nullptr);
    fuse_remove_signal_handlers(se_);
  }
  if (mounted_) fuse_session_unmount(se_);
  fuse_session_destroy(se_);
}

bool Session::create(fuse_args* args, const fuse_lowlevel_ops& ops, void* userdata) {
  se_ = fuse_session_new(args, &ops, sizeof(ops), userdata);
  return se_ != nullptr;
}

bool Session::mount(const std::string& mnt) {
  mounted_ = fuse_session_mount(se_, mnt.c_str()) == 0;
  return mounted_;
}

bool Session::signals() {
  signals_ = fuse_set_signal_handlers(se_) == 0;
  if (!signals_) return false;
  g_loop_thread = pthread_self();
  g_stop_session.store(se_);
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0;  // no SA_RESTART: the loop's wait must return
  for (int sig : kStopSignals) {
    if (::sigaction(sig, &sa, nullptr) != 0) return false;
  }
  return true;
}

}  // namespace ckptfs::fuse
