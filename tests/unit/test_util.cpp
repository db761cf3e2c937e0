// util/path and util/fd: confinement beneath a root with openat2 and with the component walk,
// and the regular-file checks. Every case runs through both resolvers and must give the same
// errno in each.
#include <fcntl.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cerrno>
#include <climits>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <ostream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "ckptfs/util/fd.hpp"
#include "ckptfs/util/path.hpp"
#include "fixture.hpp"

namespace ckptfs {
// gtest prints the resolver by name in failure messages.
void PrintTo(Resolve how, std::ostream* os) { *os << (how == Resolve::Auto ? "Auto" : "Walk"); }
}  // namespace ckptfs

using namespace ckptfs;

namespace {

template <typename T>
int err_of(const Result<T>& r) {
  return r.ok() ? 0 : r.error().code;
}

// Kills the test (SIGALRM) instead of letting a blocking open hang it.
class HangGuard {
 public:
  HangGuard() { ::alarm(5); }
  ~HangGuard() { ::alarm(0); }
  HangGuard(const HangGuard&) = delete;
  HangGuard& operator=(const HangGuard&) = delete;
};

// The source tree under test (in a mkdtemp directory):
//   a/b/c            regular file "hello"
//   a/b/link -> c    symlink as the final component (stays inside)
//   a/b/dead -> gone dangling symlink
//   evil -> /etc     symlink leaving the root
//   sib -> a         symlink staying inside
//   fifo             FIFO with no writer
//   sock             listening-less AF_UNIX socket
//   dir/             empty directory
class Tree {
 public:
  Tree() {
    const std::string& p = tmp_.path();
    test::write_file(p + "/a/b/c", "hello");
    mk(::symlink("c", (p + "/a/b/link").c_str()));
    mk(::symlink("gone", (p + "/a/b/dead").c_str()));
    mk(::symlink("/etc", (p + "/evil").c_str()));
    mk(::symlink("a", (p + "/sib").c_str()));
    mk(::mkfifo((p + "/fifo").c_str(), 0600));
    mk(::mkdir((p + "/dir").c_str(), 0700));
    make_socket(p + "/sock");
    root_.reset(::open(p.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
    mk(root_.valid() ? 0 : -1);
  }
  [[nodiscard]] int root() const { return root_.get(); }
  [[nodiscard]] const std::string& path() const { return tmp_.path(); }

 private:
  static void mk(int rc) {
    if (rc != 0)
      throw std::runtime_error(std::string("building the test tree: ") + strerror(errno));
  }
  static void make_socket(const std::string& path) {
    UniqueFd s(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    if (!s.valid() || path.size() >= sizeof addr.sun_path) mk(-1);
    std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
    mk(::bind(s.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof addr));
  }

  test::TempDir tmp_;
  UniqueFd root_;
};

std::string read_all(int fd) {
  std::string out(64, '\0');
  ssize_t n = ::pread(fd, out.data(), out.size(), 0);
  out.resize(n < 0 ? 0 : static_cast<size_t>(n));
  return out;
}

struct OpenCase {
  const char* rel;
  int flags;
  int want;  // 0: opens
};

// The same table for both resolvers: the errno is part of the contract.
const std::vector<OpenCase> kOpenCases = {
    {"a/b/c", O_RDONLY, 0},
    {"a/b/c", O_RDONLY | O_NOFOLLOW, 0},
    {"", O_RDONLY | O_DIRECTORY, 0},
    {"a", O_RDONLY | O_DIRECTORY, 0},
    {"a/b", O_PATH | O_DIRECTORY, 0},
    {"dir", O_RDONLY | O_DIRECTORY | O_NOFOLLOW, 0},
    {"fifo", O_PATH, 0},
    // Intermediate symlinks, leaving the root or not.
    {"evil/passwd", O_RDONLY, ELOOP},
    {"evil/passwd", O_RDONLY | O_NOFOLLOW, ELOOP},
    {"evil/passwd", O_PATH, ELOOP},
    {"sib/b/c", O_RDONLY, ELOOP},
    {"sib/b", O_PATH | O_DIRECTORY, ELOOP},
    // Final symlinks, whatever the flags.
    {"evil", O_RDONLY | O_DIRECTORY, ELOOP},
    {"evil", O_RDONLY | O_DIRECTORY | O_NOFOLLOW, ELOOP},
    {"sib", O_PATH | O_DIRECTORY, ELOOP},
    {"a/b/link", O_RDONLY, ELOOP},
    {"a/b/link", O_RDONLY | O_NOFOLLOW, ELOOP},
    {"a/b/link", O_PATH, ELOOP},
    {"a/b/link", O_PATH | O_NOFOLLOW, ELOOP},
    {"a/b/dead", O_RDONLY, ELOOP},
    {"a/b/dead", O_WRONLY | O_CREAT, ELOOP},
    {"a/b/dead", O_WRONLY | O_CREAT | O_EXCL, EEXIST},
    // Refused before any system call.
    {"a/../a", O_RDONLY | O_DIRECTORY, EINVAL},
    {"..", O_RDONLY | O_DIRECTORY, EINVAL},
    {"./a", O_RDONLY | O_DIRECTORY, EINVAL},
    {"/etc/passwd", O_RDONLY, EINVAL},
    {"a//b/c", O_RDONLY, EINVAL},
    {"a/b/c/", O_RDONLY, EINVAL},
    // Ordinary failures.
    {"a/b/c/x", O_RDONLY, ENOTDIR},
    {"a/b/c", O_RDONLY | O_DIRECTORY, ENOTDIR},
    {"a/nope/c", O_RDONLY, ENOENT},
    {"a/b/nope", O_RDONLY, ENOENT},
};

struct StatCase {
  const char* rel;
  int want;         // 0: stats
  mode_t type = 0;  // S_IFMT bits expected on success
};

const std::vector<StatCase> kStatCases = {
    {"", 0, S_IFDIR},         {"a/b/c", 0, S_IFREG},  {"a/b", 0, S_IFDIR},
    {"a/b/link", 0, S_IFLNK},  // the link's own stat
    {"a/b/dead", 0, S_IFLNK}, {"evil", 0, S_IFLNK},   {"sib", 0, S_IFLNK},
    {"fifo", 0, S_IFIFO},     {"evil/passwd", ELOOP}, {"sib/b/c", ELOOP},
    {"sib/b", ELOOP},         {"a/b/link/x", ELOOP},  {"a/b/c/x", ENOTDIR},
    {"a/nope/c", ENOENT},     {"a/../a", EINVAL},     {"/etc", EINVAL},
};

// The whole table through one resolver; the failures, one line each ("" when all pass).
std::string run_cases(const Tree& t, Resolve how) {
  std::string bad;
  for (const auto& c : kOpenCases) {
    auto r = open_beneath(t.root(), c.rel, c.flags, 0600, how);
    if (err_of(r) != c.want) {
      bad += fmt::format("open_beneath({:?}, {:#o}): errno {} ({}), want {}\n",
                         std::string_view(c.rel), c.flags, err_of(r),
                         r.ok() ? "ok" : r.error().message, c.want);
    }
  }
  for (const auto& c : kStatCases) {
    auto r = stat_beneath(t.root(), c.rel, how);
    if (err_of(r) != c.want || (r.ok() && (r->st_mode & S_IFMT) != c.type)) {
      bad += fmt::format("stat_beneath({:?}): errno {}, type {:#o}, want {} {:#o}\n",
                         std::string_view(c.rel), err_of(r), r.ok() ? r->st_mode & S_IFMT : 0,
                         c.want, c.type);
    }
  }
  // O_CREAT through the dangling link must not have created its target.
  struct stat st {};
  if (::fstatat(t.root(), "a/b/gone", &st, AT_SYMLINK_NOFOLLOW) == 0) bad += "a/b/gone created\n";
  return bad;
}

class Beneath : public ::testing::TestWithParam<Resolve> {
 protected:
  Tree tree;
};

TEST_P(Beneath, CaseTable) { EXPECT_EQ(run_cases(tree, GetParam()), ""); }

TEST_P(Beneath, OpensAndReads) {
  auto fd = open_beneath(tree.root(), "a/b/c", O_RDONLY, 0, GetParam());
  ASSERT_TRUE(fd.ok()) << fd.error().message;
  EXPECT_EQ(read_all(fd->get()), "hello");
  EXPECT_TRUE(::fcntl(fd->get(), F_GETFD) & FD_CLOEXEC);
}

TEST_P(Beneath, CreatesInsideTheRoot) {
  auto fd = open_beneath(tree.root(), "dir/new", O_WRONLY | O_CREAT | O_EXCL, 0600, GetParam());
  ASSERT_TRUE(fd.ok()) << fd.error().message;
  auto st = stat_beneath(tree.root(), "dir/new", GetParam());
  ASSERT_TRUE(st.ok());
  EXPECT_TRUE(S_ISREG(st->st_mode));
}

TEST_P(Beneath, SymlinkErrorNamesThePath) {
  auto fd = open_beneath(tree.root(), "evil/passwd", O_RDONLY, 0, GetParam());
  ASSERT_FALSE(fd.ok());
  EXPECT_NE(fd.error().message.find("evil/passwd"), std::string::npos) << fd.error().message;
  EXPECT_NE(fd.error().message.find("symbolic link"), std::string::npos) << fd.error().message;
}

TEST_P(Beneath, OpenRegularBeneath) {
  HangGuard guard;
  auto fd = open_regular_beneath(tree.root(), "a/b/c", GetParam());
  ASSERT_TRUE(fd.ok()) << fd.error().message;
  EXPECT_EQ(read_all(fd->get()), "hello");
  EXPECT_EQ(::fcntl(fd->get(), F_GETFL) & O_NONBLOCK, 0);
  EXPECT_EQ(err_of(open_regular_beneath(tree.root(), "fifo", GetParam())), EINVAL);
  EXPECT_EQ(err_of(open_regular_beneath(tree.root(), "sock", GetParam())), EINVAL);
  EXPECT_EQ(err_of(open_regular_beneath(tree.root(), "dir", GetParam())), EISDIR);
  EXPECT_EQ(err_of(open_regular_beneath(tree.root(), "", GetParam())), EISDIR);
  EXPECT_EQ(err_of(open_regular_beneath(tree.root(), "a/b/link", GetParam())), ELOOP);
  EXPECT_EQ(err_of(open_regular_beneath(tree.root(), "evil/passwd", GetParam())), ELOOP);
  EXPECT_EQ(err_of(open_regular_beneath(tree.root(), "a/../a/b/c", GetParam())), EINVAL);
  auto fifo = open_regular_beneath(tree.root(), "fifo", GetParam());
  ASSERT_FALSE(fifo.ok());
  EXPECT_NE(fifo.error().message.find("FIFO"), std::string::npos) << fifo.error().message;
}

INSTANTIATE_TEST_SUITE_P(Resolvers, Beneath, ::testing::Values(Resolve::Auto, Resolve::Walk),
                         [](const auto& info) {
                           return std::string(info.param == Resolve::Auto ? "Auto" : "Walk");
                         });

TEST(OpenRegularAt, RefusesAllButRegularFilesWithoutBlocking) {
  HangGuard guard;
  Tree t;
  UniqueFd dir(::open(t.path().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  ASSERT_TRUE(dir.valid());
  auto ok = open_regular_at(dir.get(), "a/b/c", "shard c");
  ASSERT_TRUE(ok.ok()) << ok.error().message;
  EXPECT_EQ(read_all(ok->get()), "hello");
  EXPECT_EQ(::fcntl(ok->get(), F_GETFL) & O_NONBLOCK, 0);

  auto fifo = open_regular_at(dir.get(), "fifo", "shard fifo");
  ASSERT_FALSE(fifo.ok());
  EXPECT_EQ(fifo.error().code, EINVAL);
  EXPECT_NE(fifo.error().message.find("shard fifo"), std::string::npos) << fifo.error().message;
  EXPECT_EQ(err_of(open_regular_at(dir.get(), "sock", "s")), EINVAL);
  EXPECT_EQ(err_of(open_regular_at(dir.get(), "dir", "d")), EISDIR);
  EXPECT_EQ(err_of(open_regular_at(dir.get(), "evil", "e")), ELOOP);
  EXPECT_EQ(err_of(open_regular_at(dir.get(), "a/b/link", "l")), ELOOP);
  EXPECT_EQ(err_of(open_regular_at(dir.get(), "nope", "n")), ENOENT);
  UniqueFd null(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  ASSERT_TRUE(null.valid());
  EXPECT_EQ(err_of(require_regular(std::move(null), "/dev/null")), EINVAL);
}

TEST(ReadSmallFile, RefusesAllButRegularFilesWithoutBlocking) {
  HangGuard guard;
  Tree t;
  auto ok = read_small_file(t.path() + "/a/b/c", 100);
  ASSERT_TRUE(ok.ok()) << ok.error().message;
  EXPECT_EQ(*ok, "hello");
  EXPECT_EQ(err_of(read_small_file(t.path() + "/a/b/c", 3)), EFBIG);
  EXPECT_EQ(err_of(read_small_file(t.path() + "/fifo", 100)), EINVAL);
  EXPECT_EQ(err_of(read_small_file(t.path() + "/sock", 100)), EINVAL);
  EXPECT_EQ(err_of(read_small_file(t.path() + "/dir", 100)), EISDIR);
  EXPECT_EQ(err_of(read_small_file("/dev/null", 100)), EINVAL);
  // By path, as before: symlinks are followed.
  EXPECT_EQ(err_of(read_small_file(t.path() + "/a/b/link", 100)), 0);
}

// The seccomp filter of tests/support/no_openat2.c: openat2 answers ENOSYS, the rest is allowed.
int install_no_openat2_filter() {
#if defined(__x86_64__)
  constexpr uint32_t kNative = AUDIT_ARCH_X86_64, kCompat = AUDIT_ARCH_I386;
#elif defined(__aarch64__)
  constexpr uint32_t kNative = AUDIT_ARCH_AARCH64, kCompat = AUDIT_ARCH_ARM;
#else
#error "add this architecture's AUDIT_ARCH values"
#endif
  constexpr uint32_t kOpenat2 = 437, kX32 = 0x40000000;
  sock_filter code[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, arch)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, kNative, 2, 0),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, kCompat, 1, 0),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, kOpenat2, 1, 0),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, kOpenat2 | kX32, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (ENOSYS & SECCOMP_RET_DATA)),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  sock_fprog prog{static_cast<unsigned short>(std::size(code)), code};
  if (::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return -1;
  return ::prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog);
}

bool raw_openat2_is_enosys() {
  long r = ::syscall(SYS_openat2, -1, nullptr, nullptr, 0);
  return r < 0 && errno == ENOSYS;
}

int wait_exit(pid_t pid) {
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// A process that probed openat2 as present and then lost it (a filter installed later) still
// confines: Auto sees ENOSYS and walks.
TEST(WithoutOpenat2, FilterInstalledAfterTheProbe) {
  Tree t;
  const bool had = openat2_supported();  // cache the probe before the fork
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    int code = 0;
    if (install_no_openat2_filter() != 0) ::_exit(100);
    if (!raw_openat2_is_enosys()) code |= 1;
    if (openat2_supported() != had) code |= 2;
    if (!run_cases(t, Resolve::Auto).empty()) code |= 4;
    if (err_of(open_beneath(t.root(), "evil/passwd", O_RDONLY)) != ELOOP) code |= 8;
    auto fd = open_beneath(t.root(), "a/b/c", O_RDONLY);
    if (!fd.ok() || read_all(fd->get()) != "hello") code |= 16;
    ::_exit(code);
  }
  EXPECT_EQ(wait_exit(pid), 0) << "1: openat2 not blocked, 2: probe changed, 4: case table, "
                                  "8: evil/passwd opened, 16: a/b/c not read";
}

// Run under no_openat2 by the test below: the probe itself sees ENOSYS.
TEST(WithoutOpenat2, ProbeUnderHelper) {
  if (std::getenv("CKPTFS_UNDER_NO_OPENAT2") == nullptr) {
    GTEST_SKIP() << "runs only under tests/support/no_openat2";
  }
  EXPECT_TRUE(raw_openat2_is_enosys());
  EXPECT_FALSE(openat2_supported());
}

// Re-runs this binary's Auto cases under the no_openat2 helper (real seccomp enforcement).
TEST(WithoutOpenat2, HelperRunsTheAutoCases) {
  const char* helper = std::getenv("CKPTFS_NO_OPENAT2");
  if (helper == nullptr || std::getenv("CKPTFS_UNDER_NO_OPENAT2") != nullptr) {
    GTEST_SKIP() << "CKPTFS_NO_OPENAT2 (the helper's path) is not set";
  }
  std::string self(PATH_MAX, '\0');
  ssize_t n = ::readlink("/proc/self/exe", self.data(), self.size());
  ASSERT_GT(n, 0);
  self.resize(static_cast<size_t>(n));
  std::string filter =
      "--gtest_filter=Resolvers/Beneath.*/Auto:WithoutOpenat2.ProbeUnderHelper:"
      "OpenRegularAt.*";
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::setenv("CKPTFS_UNDER_NO_OPENAT2", "1", 1);
    ::execl(helper, helper, self.c_str(), filter.c_str(), "--gtest_brief=1",
            static_cast<char*>(nullptr));
    ::_exit(127);
  }
  EXPECT_EQ(wait_exit(pid), 0) << helper << " " << self << " " << filter;
}

TEST(Helper, UsageWithoutArguments) {
  const char* helper = std::getenv("CKPTFS_NO_OPENAT2");
  if (helper == nullptr) GTEST_SKIP() << "CKPTFS_NO_OPENAT2 is not set";
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    int null = ::open("/dev/null", O_WRONLY);
    ::dup2(null, 2);
    ::execl(helper, helper, static_cast<char*>(nullptr));
    ::_exit(127);
  }
  EXPECT_EQ(wait_exit(pid), 2);
}

}  // namespace
