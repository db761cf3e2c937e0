// fs/handles: the open file and directory handles, with a checked lookup.
#include "handles.hpp"

#include <cerrno>
#include <mutex>

namespace ckptfs::fs {
namespace {

template <typename H>
uint64_t adopt(std::shared_mutex& mu, std::unordered_map<uint64_t, std::unique_ptr<H>>& m,
               std::unique_ptr<H> h) {
  const auto id = reinterpret_cast<uint64_t>(h.get());
  std::unique_lock lock(mu);
  m.emplace(id, std::move(h));
  return id;
}

template <typename H>
void drop(std::shared_mutex& mu, std::unordered_map<uint64_t, std::unique_ptr<H>>& m, uint64_t id) {
  std::unique_ptr<H> gone;  // destroyed after the lock is released
  std::unique_lock lock(mu);
  if (auto it = m.find(id); it != m.end()) {
    gone = std::move(it->second);
    m.erase(it);
  }
}

template <typename H>
Result<H*> find(std::shared_mutex& mu, const std::unordered_map<uint64_t, std::unique_ptr<H>>& m,
                uint64_t id, const char* what) {
  std::shared_lock lock(mu);
  auto it = m.find(id);
  if (it == m.end()) return make_error(EBADF, "no open {} handle {:#x}", what, id);
  return it->second.get();
}

}  // namespace

uint64_t Handles::add(std::unique_ptr<FileHandle> h) { return adopt(mu_, files_, std::move(h)); }
uint64_t Handles::add(std::unique_ptr<DirHandle> h) { return adopt(mu_, dirs_, std::move(h)); }

Result<FileHandle*> Handles::file(uint64_t fh) const { return find(mu_, files_, fh, "file"); }
Result<DirHandle*> Handles::dir(uint64_t dh) const { return find(mu_, dirs_, dh, "directory"); }

void Handles::drop_file(uint64_t fh) { drop(mu_, files_, fh); }
void Handles::drop_dir(uint64_t dh) { drop(mu_, dirs_, dh); }

void Handles::find_file(const std::function<bool(const FileHandle&)>& fn) const {
  std::shared_lock lock(mu_);
  for (const auto& [id, h] : files_) {
    if (fn(*h)) return;
  }
}

}  // namespace ckptfs::fs
