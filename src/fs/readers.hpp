// fs/readers: what a read of one open file reads (a buffer, a plain file, a View's shards, or a
// file being written), as the FileReader a handle and the prefetcher keep alive.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "ckptfs/fs/filesystem.hpp"
#include "ckptfs/util/fd.hpp"
#include "ckptfs/write/file.hpp"
#include "dir_views.hpp"

namespace ckptfs::fs {

// Bytes in memory (an index, the pending note, the status file), kept alive by `owner`.
class MemoryReader final : public FileReader {
 public:
  MemoryReader(std::shared_ptr<const void> owner, std::string_view bytes)
      : owner_(std::move(owner)), bytes_(bytes) {}
  uint64_t size() const override { return bytes_.size(); }
  void plan(uint64_t off, uint64_t len, ReadPlan& out) const override;

 private:
  std::shared_ptr<const void> owner_;
  std::string_view bytes_;
};

// A plain file of SRC, read like the file.
class PassthroughReader final : public FileReader {
 public:
  PassthroughReader(UniqueFd fd, uint64_t size, std::string name)
      : fd_(std::move(fd)), raw_(fd_.get()), size_(size), name_(std::move(name)) {}
  uint64_t size() const override { return size_; }
  [[nodiscard]] int fd() const { return raw_; }
  void plan(uint64_t off, uint64_t len, ReadPlan& out) const override;

 private:
  UniqueFd fd_;
  int raw_;
  uint64_t size_;
  std::string name_;
};

// A consolidated file of one View, read from the shard fds opened for it.
class OutputReader final : public FileReader {
 public:
  OutputReader(std::shared_ptr<const View> view, std::shared_ptr<const ShardFds> fds,
               uint32_t output)
      : view_(std::move(view)), fds_(std::move(fds)), output_(output) {}
  uint64_t size() const override { return view_->ckpt->outputs[output_].size; }
  void plan(uint64_t off, uint64_t len, ReadPlan& out) const override;

 private:
  std::shared_ptr<const View> view_;
  std::shared_ptr<const ShardFds> fds_;
  uint32_t output_;
};

// Reads of a file that is being written: whatever the WriteFile holds now.
class WriteFileReader final : public FileReader {
 public:
  explicit WriteFileReader(std::shared_ptr<write::WriteFile> wf) : wf_(std::move(wf)) {}
  uint64_t size() const override;
  void plan(uint64_t off, uint64_t len, ReadPlan& out) const override;
  Result<size_t> read_direct(uint64_t off, size_t len, char* dst) const override;

 private:
  std::shared_ptr<write::WriteFile> wf_;
};

}  // namespace ckptfs::fs
