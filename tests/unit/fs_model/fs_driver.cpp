// fs_model/fs_driver: the Driver that calls fs::Filesystem directly (no kernel), on a ManualClock.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>

#include <fmt/format.h>

#include "drivers.hpp"

namespace ckptfs::fsmodel {

namespace {

Answer answer(const Status& st, const std::string& what) {
  if (st.ok()) return {};
  return {st.error().code, what + ": " + st.error().message};
}

template <typename T>
Answer answer(const Result<T>& r, const std::string& what) {
  if (r.ok()) return {};
  return {r.error().code, what + ": " + r.error().message};
}

}  // namespace

Result<uint32_t> FsDriver::start(uint32_t ranks) {
  clock_ = std::make_shared<fs::ManualClock>();
  fs::Options o;
  o.clock = clock_;
  o.revalidate = std::chrono::milliseconds(1000);
  o.settle = std::chrono::milliseconds(1000);
  o.ranks = ranks;
  // semantics.md: the writer's view shows a process that wrote in a checkpoint directory its
  // shard files; the model is what everyone else sees, so it is off here.
  o.writer_view = std::chrono::milliseconds(0);
  if (kernel_writes_) {
    o.backing_writes = true;
    o.backing_grace = std::chrono::milliseconds(0);
  }
  CKPTFS_TRY(f_, fs::Filesystem::create(tmp_.path(), o));
  return ranks;
}

Result<fs::Ino> FsDriver::dir_ino(const std::string& dname) {
  if (dname.empty()) return fs::kRootIno;
  CKPTFS_TRY(auto e, f_->lookup(fs::kRootIno, dname));
  return e.ino;
}

// A directory's lookup failing before the op is asked: its errno, named.
#define FS_DIR_OR(var, dname)                                 \
  auto var##_r = dir_ino(dname);                              \
  if (!var##_r) return answer(var##_r, "lookup of " + dname); \
  const fs::Ino var = *var##_r

Answer FsDriver::create(const std::string& dir, const std::string& name, int flags, int handle) {
  FS_DIR_OR(ino, dir);
  auto c = f_->create(ino, name, 0644, flags);
  if (!c) return answer(c, "create " + name);
  fh_[handle] = c->open.fh;
  if (kernel_writes_ && c->open.backing_fd >= 0) backing_[handle] = c->open.backing_fd;
  return {};
}

Answer FsDriver::write(int handle, uint64_t off, std::string_view bytes, size_t& wrote) {
  if (auto b = backing_.find(handle); b != backing_.end()) {  // the kernel writes it
    const ssize_t n = ::pwrite(b->second, bytes.data(), bytes.size(), static_cast<off_t>(off));
    if (n < 0) return {errno, fmt::format("write #{} at {} (the kernel's)", handle, off)};
    wrote = static_cast<size_t>(n);
    if (kernel_written_) ++*kernel_written_;
    return {};
  }
  auto r = f_->write(fh_.at(handle), off, bytes);
  if (!r) return answer(r, fmt::format("write #{} at {}", handle, off));
  wrote = *r;
  return {};
}

Answer FsDriver::flush(int handle) {
  return answer(f_->flush(fh_.at(handle)), fmt::format("flush #{}", handle));
}

Answer FsDriver::close(int handle) {
  const uint64_t fh = fh_.at(handle);
  fh_.erase(handle);
  backing_.erase(handle);  // the Filesystem's descriptor: the release below lets it go
  auto st = f_->flush(fh);
  f_->release(fh);
  return answer(st, fmt::format("close #{}", handle));
}

Answer FsDriver::fsync(int handle, bool datasync) {
  return answer(f_->fsync(fh_.at(handle), datasync), fmt::format("fsync #{}", handle));
}

Answer FsDriver::rename(const std::string& dir, const std::string& name, const std::string& to_dir,
                        const std::string& to_name, unsigned flags) {
  FS_DIR_OR(sino, dir);
  FS_DIR_OR(tino, to_dir);
  return answer(f_->rename(sino, name, tino, to_name, flags), "rename");
}

Answer FsDriver::unlink(const std::string& dir, const std::string& name) {
  FS_DIR_OR(ino, dir);
  return answer(f_->unlink(ino, name), "unlink");
}

Answer FsDriver::mkdir(const std::string& name) {
  return answer(f_->mkdir(fs::kRootIno, name, 0755), "mkdir");
}

Answer FsDriver::rmdir(const std::string& name) {
  return answer(f_->rmdir(fs::kRootIno, name), "rmdir");
}

Answer FsDriver::list(const std::string& dir, std::vector<std::string>& names) {
  FS_DIR_OR(dino, dir);
  auto dh = f_->opendir(dino);
  if (!dh) return answer(dh, "opendir");
  auto st = f_->readdir(*dh, 0, [&](const fs::DirEntryOut& e, uint64_t) {
    if (e.name != "." && e.name != "..") names.push_back(e.name);
    return true;
  });
  f_->releasedir(*dh);
  return answer(st, "readdir");
}

FileStat FsDriver::stat(const std::string& dir, const std::string& name) {
  FileStat out;
  auto dino = dir_ino(dir);
  if (!dino) return {answer(dino, "lookup of " + dir)};
  auto l = f_->lookup(*dino, name);
  if (!l) return {answer(l, "lookup")};
  auto st = f_->getattr(l->ino);
  if (!st) return {answer(st, "getattr")};
  out.is_dir = S_ISDIR(st->st_mode);
  out.is_reg = S_ISREG(st->st_mode);
  out.size = static_cast<uint64_t>(st->st_size);
  return out;
}

// Each part through Filesystem::read and the plan it returns.
Answer FsDriver::read_fh(uint64_t fh, const ReadParts& parts, std::string& out) {
  out.clear();
  for (auto [off, len] : parts) {
    fs::ReadPlan plan;
    auto st = f_->read(fh, off, len, plan);
    if (!st) return answer(st, fmt::format("read at {}", off));
    std::string buf(len + plan.size, '\0');
    auto n = fs::execute(plan, buf.data());
    if (!n) return answer(n, fmt::format("read at {}", off));
    buf.resize(std::min<uint64_t>(*n, len));
    out += buf;
  }
  return {};
}

Answer FsDriver::read_name(const std::string& dir, const std::string& name, const ReadParts& parts,
                           std::string& out) {
  FS_DIR_OR(dino, dir);
  auto l = f_->lookup(dino, name);
  if (!l) return answer(l, "lookup");
  auto o = f_->open(l->ino, O_RDONLY);
  if (!o) return answer(o, "open");
  Answer a = read_fh(o->fh, parts, out);
  f_->release(o->fh);
  return a;
}

Answer FsDriver::read_handle(int handle, const ReadParts& parts, std::string& out) {
  if (auto b = backing_.find(handle); b != backing_.end()) {  // the kernel reads it too
    out.clear();
    for (auto [off, len] : parts) {
      std::string buf(len, '\0');
      const ssize_t n = ::pread(b->second, buf.data(), len, static_cast<off_t>(off));
      if (n < 0) return {errno, fmt::format("read #{} at {} (the kernel's)", handle, off)};
      out.append(buf.data(), static_cast<size_t>(n));
    }
    return {};
  }
  return read_fh(fh_.at(handle), parts, out);
}

}  // namespace ckptfs::fsmodel
