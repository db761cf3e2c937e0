// fs/io_modes: per inode, whether opens are backed (FUSE passthrough) or cached.
#include "io_modes.hpp"

#include <cerrno>

namespace ckptfs::fs {

bool IoModes::open_read(Ino ino, bool could_back) {
  std::lock_guard lock(mu_);
  Counts& c = open_[ino];
  if (could_back && c.cached == 0) {
    ++c.backed;
    ++total_backed_;
    return true;
  }
  ++c.cached;
  return false;
}

Status IoModes::open_cached(Ino ino, std::string_view rel) {
  std::unique_lock lock(mu_);
  const bool free = cv_.wait_for(lock, grace_, [&] {
    auto it = open_.find(ino);
    return it == open_.end() || it->second.backed == 0;
  });
  Counts& c = open_[ino];
  if (!free) {
    return make_error(ETXTBSY,
                      "{}: open for reading from its backing file (FUSE passthrough); it can be "
                      "written once those readers close it",
                      rel);
  }
  ++c.cached;
  return {};
}

bool IoModes::open_write(Ino ino) {
  std::lock_guard lock(mu_);
  Counts& c = open_[ino];
  if (c.cached > 0) {
    ++c.cached;
    return false;
  }
  // Beside backed readers too: the kernel opens each backed open's own file, with that open's
  // flags, from the path the backing id names (fs/fuse/passthrough.c), so a writer joins them.
  ++c.backed;
  ++total_backed_;
  ++backed_writes_;
  return true;
}

void IoModes::demote(Ino ino) {
  std::lock_guard lock(mu_);
  Counts& c = open_[ino];
  if (c.backed > 0) --c.backed;
  ++c.cached;
}

void IoModes::release(Ino ino, bool backed) {
  {
    std::lock_guard lock(mu_);
    auto it = open_.find(ino);
    if (it == open_.end()) return;
    uint32_t& n = backed ? it->second.backed : it->second.cached;
    if (n > 0) --n;
    if (it->second.backed == 0 && it->second.cached == 0) open_.erase(it);
  }
  if (backed) cv_.notify_all();
}

bool IoModes::has_backed(Ino ino) const {
  std::lock_guard lock(mu_);
  auto it = open_.find(ino);
  return it != open_.end() && it->second.backed > 0;
}

uint64_t IoModes::backed_opens() const {
  std::lock_guard lock(mu_);
  return total_backed_;
}

uint64_t IoModes::backed_writes() const {
  std::lock_guard lock(mu_);
  return backed_writes_;
}

}  // namespace ckptfs::fs
