// fs_model/mount_driver: the Driver that makes POSIX syscalls on a real ckptfs mount (through
// the kernel's FUSE client), with SRC changed directly and real time passing.
#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "drivers.hpp"

namespace ckptfs::fsmodel {

namespace {

// The answer of a syscall that returned `rc`: errno is read before `what` (a callable making
// the message) runs, so the message's allocations cannot change it.
template <typename What>
Answer sys(int rc, What&& what) {
  if (rc == 0) return {};
  const int e = errno;
  return {e, fmt::format("{}: {}", what(), std::strerror(e))};
}

// Reads each part with pread (looping over short reads until the end of the file).
Answer pread_parts(int fd, const ReadParts& parts, std::string& out) {
  out.clear();
  for (auto [off, len] : parts) {
    std::string buf(len, '\0');
    size_t got = 0;
    while (got < len) {
      const ssize_t n = ::pread(fd, buf.data() + got, len - got, static_cast<off_t>(off + got));
      if (n < 0) return sys(-1, [&] { return fmt::format("pread at {}", off + got); });
      if (n == 0) break;
      got += static_cast<size_t>(n);
    }
    out.append(buf, 0, got);
  }
  return {};
}

}  // namespace

MountDriver::~MountDriver() {
  for (auto& [id, fd] : fd_) ::close(fd);
}

std::string MountDriver::path(const std::string& dir, const std::string& name) const {
  return mnt_ + (dir.empty() ? "" : "/" + dir) + (name.empty() ? "" : "/" + name);
}

Result<uint32_t> MountDriver::start(uint32_t /*ranks*/) {
  // The rank count is the mount's (-o ranks=N); the sequence's own draw is ignored (it only
  // picks how files are split, never what the model expects).
  if (auto a = empty_tree(); a.err) return make_error(a.err, "emptying {}: {}", mnt_, a.msg);
  return ranks_;
}

// The tree a sequence starts from is empty: what an earlier sequence left is removed through
// the mount (files, then their directories, whose rmdir takes the view's hidden .ckptfs too).
// The kernel sends RELEASE only after close() returned, so an rmdir right after a sequence's
// last close may still see its writer (ENOTEMPTY): retried for a while. What SRC still holds
// then (nothing, normally) is removed there directly, and time passes.
Answer MountDriver::empty_tree() {
  for (int attempt = 0;; ++attempt) {
    std::vector<std::string> top;
    if (auto a = list("", top); a.err) return a;
    if (top.empty()) break;
    for (const auto& n : top) {
      struct stat st {};
      if (::lstat(path("", n).c_str(), &st) != 0) continue;
      if (S_ISDIR(st.st_mode)) {
        std::vector<std::string> inner;
        list(n, inner);
        for (const auto& i : inner) {
          if (::unlink(path(n, i).c_str()) != 0) ::rmdir(path(n, i).c_str());
        }
        ::rmdir(path("", n).c_str());
      } else {
        ::unlink(path("", n).c_str());
      }
    }
    if (attempt == 100) return {ENOTEMPTY, "the mount's root does not empty"};
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  bool left = false;
  for (const auto& e : std::filesystem::directory_iterator(src_)) {
    std::filesystem::remove_all(e.path());
    left = true;
  }
  if (left) pass_time();
  return {};
}

void MountDriver::pass_time() { std::this_thread::sleep_for(wait_); }

Answer MountDriver::create(const std::string& dir, const std::string& name, int flags, int handle) {
  const int fd = ::open(path(dir, name).c_str(), flags | O_CLOEXEC, 0644);
  if (fd < 0) return sys(-1, [&] { return std::string("open " + path(dir, name)); });
  fd_[handle] = fd;
  return {};
}

Answer MountDriver::write(int handle, uint64_t off, std::string_view bytes, size_t& wrote) {
  const ssize_t n = ::pwrite(fd_.at(handle), bytes.data(), bytes.size(), static_cast<off_t>(off));
  if (n < 0) return sys(-1, [&] { return fmt::format("pwrite #{} at {}", handle, off); });
  wrote = static_cast<size_t>(n);
  return {};
}

Answer MountDriver::flush(int handle) {
  const int dup = ::dup(fd_.at(handle));
  if (dup < 0) return sys(-1, [&] { return std::string("dup"); });
  return sys(::close(dup), [&] { return fmt::format("close of a dup of #{}", handle); });
}

Answer MountDriver::close(int handle) {
  const int fd = fd_.at(handle);
  fd_.erase(handle);
  return sys(::close(fd), [&] { return fmt::format("close #{}", handle); });
}

Answer MountDriver::fsync(int handle, bool datasync) {
  const int fd = fd_.at(handle);
  return sys(datasync ? ::fdatasync(fd) : ::fsync(fd),
             [&] { return fmt::format("fsync #{}", handle); });
}

Answer MountDriver::rename(const std::string& dir, const std::string& name,
                           const std::string& to_dir, const std::string& to_name, unsigned flags) {
  const int rc = ::renameat2(AT_FDCWD, path(dir, name).c_str(), AT_FDCWD,
                             path(to_dir, to_name).c_str(), flags);
  Answer a = sys(rc, [] { return std::string("renameat2"); });
  if (a.err == ENOTEMPTY && wait_releases()) {  // a directory over one a release still pins
    const int again = ::renameat2(AT_FDCWD, path(dir, name).c_str(), AT_FDCWD,
                                  path(to_dir, to_name).c_str(), flags);
    a = sys(again, [] { return std::string("renameat2 (again)"); });
  }
  return a;
}

Answer MountDriver::unlink(const std::string& dir, const std::string& name) {
  return sys(::unlink(path(dir, name).c_str()), [&] { return std::string("unlink"); });
}

Answer MountDriver::mkdir(const std::string& name) {
  return sys(::mkdir(path("", name).c_str(), 0755), [&] { return std::string("mkdir"); });
}

Answer MountDriver::rmdir(const std::string& name) {
  Answer a = sys(::rmdir(path("", name).c_str()), [&] { return std::string("rmdir"); });
  if (a.err == ENOTEMPTY && wait_releases()) {
    a = sys(::rmdir(path("", name).c_str()), [&] { return std::string("rmdir (again)"); });
  }
  return a;
}

bool MountDriver::wait_releases() {
  bool waited = false;
  for (int i = 0; i < 100; ++i) {
    std::ifstream in(mnt_ + "/.ckptfs/status.json");
    const auto j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    int64_t open = -1;  // unreadable, or no such figure: wait
    if (j.is_object() && j.contains("writes") && j.at("writes").is_object()) {
      open = j.at("writes").value("open_files", int64_t{-1});
    }
    if (open >= 0 && open <= static_cast<int64_t>(fd_.size())) return waited;
    waited = true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return waited;
}

Answer MountDriver::list(const std::string& dir, std::vector<std::string>& names) {
  DIR* d = ::opendir(path(dir).c_str());
  if (d == nullptr) return sys(-1, [&] { return std::string("opendir " + path(dir)); });
  errno = 0;
  while (const dirent* e = ::readdir(d)) {
    const std::string n = e->d_name;
    if (n != "." && n != "..") names.push_back(n);
  }
  Answer a = errno ? sys(-1, [&] { return "readdir " + path(dir); }) : Answer{};
  ::closedir(d);
  return a;
}

FileStat MountDriver::stat(const std::string& dir, const std::string& name) {
  struct stat st {};
  FileStat out;
  if (::stat(path(dir, name).c_str(), &st) != 0)
    return {sys(-1, [] { return std::string("stat"); })};
  out.is_dir = S_ISDIR(st.st_mode);
  out.is_reg = S_ISREG(st.st_mode);
  out.size = static_cast<uint64_t>(st.st_size);
  return out;
}

Answer MountDriver::read_name(const std::string& dir, const std::string& name,
                              const ReadParts& parts, std::string& out) {
  const int fd = ::open(path(dir, name).c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return sys(-1, [&] { return std::string("open " + path(dir, name)); });
  Answer a = pread_parts(fd, parts, out);
  ::close(fd);
  return a;
}

Answer MountDriver::read_handle(int handle, const ReadParts& parts, std::string& out) {
  return pread_parts(fd_.at(handle), parts, out);
}

}  // namespace ckptfs::fsmodel
