// fs/handles: the open file and directory handles, owned here, with a checked lookup (an
// unknown handle is EBADF, never a wild pointer).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <shared_mutex>
#include <unordered_map>
#include <vector>

#include "ckptfs/fs/filesystem.hpp"
#include "ckptfs/util/result.hpp"
#include "ckptfs/write/file.hpp"

namespace ckptfs::fs {

struct DirHandle {
  std::vector<DirEntryOut> entries;
};

struct FileHandle {
  std::shared_ptr<const FileReader> reader;
  std::shared_ptr<write::WriteFile> wf;  // open for writing (or a file being written)
  Ino ino = 0;
  bool writable = false;
  enum class Io : uint8_t { None, Cached, Backed } io = Io::None;  // counted in IoModes as
};

// Handles are owned here: the kernel releases them asynchronously, and one a signal or an
// unmount overtakes is freed when the Filesystem goes rather than leaked. A handle's number is
// its address; a lookup returns the handle itself, valid until its release (the kernel sends no
// other request on a handle once it sent its release).
class Handles {
 public:
  uint64_t add(std::unique_ptr<FileHandle> h);
  uint64_t add(std::unique_ptr<DirHandle> h);
  // EBADF for a number that is no open handle of that kind.
  [[nodiscard]] Result<FileHandle*> file(uint64_t fh) const;
  [[nodiscard]] Result<DirHandle*> dir(uint64_t dh) const;
  // Releases a handle (nothing for an unknown number).
  void drop_file(uint64_t fh);
  void drop_dir(uint64_t dh);
  // Calls `fn` on open file handles, under the lock, until it returns true: `fn` takes no
  // lock of the filesystem.
  void find_file(const std::function<bool(const FileHandle&)>& fn) const;

 private:
  mutable std::shared_mutex mu_;  // guards files_ and dirs_; a leaf
  std::unordered_map<uint64_t, std::unique_ptr<FileHandle>> files_;
  std::unordered_map<uint64_t, std::unique_ptr<DirHandle>> dirs_;
};

}  // namespace ckptfs::fs
