// fs_model/drivers: the two Drivers: fs::Filesystem called directly on a ManualClock, and POSIX
// syscalls on a real ckptfs mount.
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <string>

#include "ckptfs/fs/filesystem.hpp"
#include "ckptfs/fs/seams.hpp"
#include "fixture.hpp"
#include "harness.hpp"

namespace ckptfs::fsmodel {

// fs::Filesystem as the FUSE adapter drives it, on a fresh TempDir as SRC and a ManualClock
// (time passes: the clock moves past settle and revalidate). Reads go through Filesystem::read
// and the read plan it returns.
class FsDriver : public Driver {
 public:
  // kernel_writes: write passthrough (Options::backing_writes), as the adapter runs on Linux
  // 6.9 and later as root: a file open for writing is handed to the kernel, which writes it
  // into its backing file itself, so a write here is a pwrite on the descriptor the open handed
  // out and no write() reaches the Filesystem; close() stores the file as its own one shard and
  // the split into rank shards runs after it, on the split threads, while the sequence goes on.
  // `kernel_written` (if given) counts the writes made so.
  explicit FsDriver(bool kernel_writes = false, uint64_t* kernel_written = nullptr)
      : kernel_writes_(kernel_writes), kernel_written_(kernel_written) {}
  Result<uint32_t> start(uint32_t ranks) override;
  [[nodiscard]] const std::string& src() const override { return tmp_.path(); }
  [[nodiscard]] bool through_kernel() const override { return false; }

  Answer create(const std::string& dir, const std::string& name, int flags, int handle) override;
  Answer write(int handle, uint64_t off, std::string_view bytes, size_t& wrote) override;
  Answer flush(int handle) override;
  Answer close(int handle) override;
  Answer fsync(int handle, bool datasync) override;
  Answer rename(const std::string& dir, const std::string& name, const std::string& to_dir,
                const std::string& to_name, unsigned flags) override;
  Answer unlink(const std::string& dir, const std::string& name) override;
  Answer mkdir(const std::string& name) override;
  Answer rmdir(const std::string& name) override;
  Answer list(const std::string& dir, std::vector<std::string>& names) override;
  FileStat stat(const std::string& dir, const std::string& name) override;
  Answer read_name(const std::string& dir, const std::string& name, const ReadParts& parts,
                   std::string& out) override;
  Answer read_handle(int handle, const ReadParts& parts, std::string& out) override;
  void pass_time() override { clock_->advance(std::chrono::milliseconds(1100)); }

 private:
  Result<fs::Ino> dir_ino(const std::string& dname);
  Answer read_fh(uint64_t fh, const ReadParts& parts, std::string& out);

  test::TempDir tmp_;
  std::shared_ptr<fs::ManualClock> clock_;
  std::unique_ptr<fs::Filesystem> f_;
  std::map<int, uint64_t> fh_;  // the model's handle id -> the Filesystem's file handle
  bool kernel_writes_ = false;
  uint64_t* kernel_written_ = nullptr;
  std::map<int, int> backing_;  // a handle the kernel writes -> its backing descriptor
};

// A real ckptfs mount at `mnt` serving `src`, driven with POSIX syscalls (open with
// O_CREAT|O_EXCL|O_TRUNC, pwrite, dup+close, close, fsync/fdatasync, renameat2, unlink, mkdir,
// rmdir, readdir, stat, open+pread); errors are errno. The mount's options are its own: `ranks`
// is what it was mounted with (-o ranks=N), and `wait` must outlast its settle, revalidate and
// the kernel's entry and attribute timeouts. start() empties the tree through the mount.
class MountDriver : public Driver {
 public:
  MountDriver(std::string mnt, std::string src, uint32_t ranks, std::chrono::milliseconds wait)
      : mnt_(std::move(mnt)), src_(std::move(src)), ranks_(ranks), wait_(wait) {}
  ~MountDriver() override;
  MountDriver(const MountDriver&) = delete;
  MountDriver& operator=(const MountDriver&) = delete;

  Result<uint32_t> start(uint32_t ranks) override;
  [[nodiscard]] const std::string& src() const override { return src_; }
  [[nodiscard]] bool through_kernel() const override { return true; }

  Answer create(const std::string& dir, const std::string& name, int flags, int handle) override;
  Answer write(int handle, uint64_t off, std::string_view bytes, size_t& wrote) override;
  Answer flush(int handle) override;
  Answer close(int handle) override;
  Answer fsync(int handle, bool datasync) override;
  Answer rename(const std::string& dir, const std::string& name, const std::string& to_dir,
                const std::string& to_name, unsigned flags) override;
  Answer unlink(const std::string& dir, const std::string& name) override;
  Answer mkdir(const std::string& name) override;
  Answer rmdir(const std::string& name) override;
  Answer list(const std::string& dir, std::vector<std::string>& names) override;
  FileStat stat(const std::string& dir, const std::string& name) override;
  Answer read_name(const std::string& dir, const std::string& name, const ReadParts& parts,
                   std::string& out) override;
  Answer read_handle(int handle, const ReadParts& parts, std::string& out) override;
  void pass_time() override;

 private:
  [[nodiscard]] std::string path(const std::string& dir, const std::string& name = "") const;
  Answer empty_tree();
  // The kernel sends RELEASE after close() returned: until the daemon has it, a file closed
  // (or read by name while it was written) still counts as open for writing, and an rmdir or
  // a directory renamed over that dir answers ENOTEMPTY. Waits (2 s at most) until the
  // daemon's open files (.ckptfs/status.json) are no more than this driver's writers; whether
  // it had to wait.
  bool wait_releases();

  const std::string mnt_, src_;
  const uint32_t ranks_;
  const std::chrono::milliseconds wait_;
  std::map<int, int> fd_;  // the model's handle id -> the writer's descriptor
};

}  // namespace ckptfs::fsmodel
