// fuse/notify: what the daemon tells the kernel unasked: entry and inode invalidations, sent
// from a thread of their own, and pages pushed into the page cache (prefetch).
#pragma once

#include <fuse_lowlevel.h>

#include <memory>

#include "ckptfs/fs/filesystem.hpp"
#include "ckptfs/fs/prefetch.hpp"

namespace ckptfs::fuse {

// Invalidations queued and sent on their own thread (joined when it is destroyed).
std::unique_ptr<fs::Notifier> make_notify_queue(fuse_session* se);
// fuse_lowlevel_notify_store for the prefetcher.
std::unique_ptr<fs::PagePusher> make_page_pusher(fuse_session* se);

}  // namespace ckptfs::fuse
