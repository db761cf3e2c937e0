// tests/support/notice_recorder: an fs::Notifier that records what the kernel would be told.
#pragma once

#include <set>
#include <string>
#include <utility>

#include "ckptfs/fs/filesystem.hpp"

namespace ckptfs::test {

class NoticeRecorder final : public fs::Notifier {
 public:
  void inval_entry(fs::Ino parent, const std::string& name) override {
    entries.emplace(parent, name);
  }
  void inval_inode(fs::Ino ino) override { inodes.insert(ino); }
  std::set<std::pair<fs::Ino, std::string>> entries;
  std::set<fs::Ino> inodes;
};

}  // namespace ckptfs::test
