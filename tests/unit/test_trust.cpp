// The trust model without a kernel: the kernel's permission rules as fs/access applies them,
// and fs::Filesystem making those checks for names the kernel cannot see (hidden shard files,
// the shards behind a consolidated file), for callers other than root. Files are given to other
// uids with chown (the tests run as root, as the daemon does).
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>

#include "ckptfs/format/names.hpp"
#include "ckptfs/format/record.hpp"
#include "ckptfs/fs/access.hpp"
#include "ckptfs/fs/filesystem.hpp"
#include "ckptfs/source/scanner.hpp"
#include "ckptfs/util/log_limit.hpp"
#include "ckptfs/write/budget.hpp"
#include "fixture.hpp"

using namespace ckptfs;
using format::DType;
using test::ChunkSpec;
using test::ShardSpec;
namespace stdfs = std::filesystem;

namespace {

constexpr uid_t kA = 64001, kB = 64002, kC = 64003;
constexpr gid_t kTeam = 64100;

fs::Caller user(uid_t uid, gid_t gid = 0, std::vector<gid_t> groups = {}) {
  return fs::Caller{uid, gid ? gid : uid, std::move(groups)};
}

fs::Perm perm(uid_t uid, gid_t gid, mode_t mode) { return fs::Perm{uid, gid, mode}; }

// A 2-rank checkpoint of one tensor in `dir`, its shards owned by `uid` with `mode`.
void write_ckpt(const std::string& dir, uid_t uid, mode_t mode) {
  stdfs::create_directories(dir);
  for (int r = 0; r < 2; ++r) {
    ChunkSpec c{"w", DType::F32, {uint64_t(r) * 2, 0}, {2, 2}, std::nullopt, std::string(16, 'a')};
    const auto path = dir + "/" + format::shard_file_name(r + 1, 1, 1);
    test::write_file(path,
                     test::make_shard_bytes(ShardSpec{format::shard_file_name(r + 1, 1, 1), {c}}));
    EXPECT_EQ(::chown(path.c_str(), uid, uid), 0);
    EXPECT_EQ(::chmod(path.c_str(), mode), 0);
  }
}

void set_dir(const std::string& dir, uid_t uid, gid_t gid, mode_t mode) {
  stdfs::create_directories(dir);
  ASSERT_EQ(::chown(dir.c_str(), uid, gid), 0);
  ASSERT_EQ(::chmod(dir.c_str(), mode), 0);
}

struct stat lstat_of(const std::string& p) {
  struct stat st {};
  EXPECT_EQ(::lstat(p.c_str(), &st), 0) << p;
  return st;
}

struct Src {
  test::TempDir dir;
  std::unique_ptr<fs::Filesystem> f;
  Src() { ::chmod(dir.path().c_str(), 0755); }
  void start(fs::Options o = {}) {
    o.settle = std::chrono::milliseconds(0);
    o.revalidate = std::chrono::milliseconds(0);
    if (o.protected_regular < 0) o.protected_regular = 0;
    f = std::move(fs::Filesystem::create(dir.path(), o)).value();
  }
  std::string path(const std::string& rel) const { return dir.path() + "/" + rel; }
  fs::Ino walk(const std::vector<std::string>& names) {
    fs::Ino ino = fs::kRootIno;
    for (const auto& n : names) {
      auto e = f->lookup(ino, n);
      EXPECT_TRUE(e.ok()) << n << ": " << e.error().message;
      if (!e) return 0;
      ino = e->ino;
    }
    return ino;
  }
};

}  // namespace

// --- the rules --------------------------------------------------------------------------------

TEST(Access, GenericPermissionClasses) {
  const auto f = perm(kA, kTeam, S_IFREG | 0640);
  EXPECT_TRUE(fs::may(f, user(kA), R_OK | W_OK));
  EXPECT_TRUE(fs::may(f, user(kB, kTeam), R_OK));
  EXPECT_FALSE(fs::may(f, user(kB, kTeam), W_OK));
  EXPECT_TRUE(fs::may(f, user(kB, kB, {kTeam}), R_OK));  // a supplementary group
  EXPECT_FALSE(fs::may(f, user(kC), R_OK));
  // The owner class is decided by ownership alone, even when it grants less than others get.
  EXPECT_FALSE(fs::may(perm(kA, kTeam, S_IFREG | 0044), user(kA), R_OK));
  // Root: everything but executing a file nobody may execute.
  EXPECT_TRUE(fs::may(perm(kA, kA, S_IFREG | 0), user(0), R_OK | W_OK));
  EXPECT_FALSE(fs::may(perm(kA, kA, S_IFREG | 0644), user(0), X_OK));
  EXPECT_TRUE(fs::may(perm(kA, kA, S_IFDIR | 0), user(0), X_OK));
}

TEST(Access, MayDeleteHonoursTheStickyBit) {
  const auto sticky = perm(0, 0, S_IFDIR | 01777);
  const auto a_file = perm(kA, kA, S_IFREG | 0600);
  EXPECT_TRUE(fs::may_delete(sticky, a_file, user(kA), "x").ok());
  auto b = fs::may_delete(sticky, a_file, user(kB), "x");
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.error().code, EPERM);
  EXPECT_TRUE(fs::may_delete(perm(kB, kB, S_IFDIR | 01777), a_file, user(kB), "x").ok());
  EXPECT_TRUE(fs::may_delete(sticky, a_file, user(0), "x").ok());
  // Not sticky: write and search permission on the directory is all it takes.
  EXPECT_TRUE(fs::may_delete(perm(0, 0, S_IFDIR | 0777), a_file, user(kB), "x").ok());
  auto ro = fs::may_delete(perm(0, kTeam, S_IFDIR | 0755), a_file, user(kB, kTeam), "x");
  ASSERT_FALSE(ro.ok());
  EXPECT_EQ(ro.error().code, EACCES);
}

TEST(Access, OpeningAnExistingFileWithOCreat) {
  const auto dir = perm(0, kTeam, S_IFDIR | 02775);
  const auto a_private = perm(kA, kTeam, S_IFREG | 0600);
  EXPECT_EQ(
      fs::may_open_existing(dir, a_private, O_RDWR | O_CREAT, user(kB, kTeam), 0, "s").error().code,
      EACCES);
  EXPECT_TRUE(
      fs::may_open_existing(dir, a_private, O_RDWR | O_CREAT, user(kA, kTeam), 0, "s").ok());
  // Read-only with O_TRUNC still needs write permission.
  const auto readable = perm(kA, kTeam, S_IFREG | 0644);
  EXPECT_TRUE(fs::may_open_existing(dir, readable, O_RDONLY | O_CREAT, user(kB), 0, "s").ok());
  EXPECT_FALSE(
      fs::may_open_existing(dir, readable, O_RDONLY | O_CREAT | O_TRUNC, user(kB), 0, "s").ok());
  // protected_regular: in a sticky world-writable directory, someone else's file is refused,
  // root included; with 2, group-writable sticky directories too.
  const auto tmp = perm(0, 0, S_IFDIR | 01777);
  const auto open = perm(kA, kA, S_IFREG | 0666);
  EXPECT_TRUE(fs::may_open_existing(tmp, open, O_RDWR | O_CREAT, user(kB), 0, "s").ok());
  EXPECT_EQ(fs::may_open_existing(tmp, open, O_RDWR | O_CREAT, user(kB), 1, "s").error().code,
            EACCES);
  EXPECT_EQ(fs::may_open_existing(tmp, open, O_RDWR | O_CREAT, user(0), 1, "s").error().code,
            EACCES);
  EXPECT_TRUE(fs::may_open_existing(tmp, open, O_RDWR | O_CREAT, user(kA), 1, "s").ok());
  const auto team_tmp = perm(0, kTeam, S_IFDIR | 01770);
  EXPECT_TRUE(fs::may_open_existing(team_tmp, open, O_RDWR, user(kB, kTeam), 1, "s").ok());
  EXPECT_FALSE(fs::may_open_existing(team_tmp, open, O_RDWR, user(kB, kTeam), 2, "s").ok());
}

TEST(Access, ShownPermOfNoInputsIsNobodys) {
  auto p = fs::shown_perm({}, kA, kA);
  EXPECT_EQ(p.mode & 0777, 0u);
  auto q = fs::shown_perm({perm(kA, kTeam, 0640), perm(kA, kTeam, 0644)}, 0, 0);
  EXPECT_EQ(q.uid, kA);
  EXPECT_EQ(q.mode & 0777, 0440u);
}

TEST(LogLimiter, BurstThenHeldBackThenCounted) {
  LogLimiter lim(2, std::chrono::seconds(60), 3);
  const auto t0 = LogLimiter::Clock::time_point{};
  EXPECT_TRUE(lim.allow("a", t0).log);
  EXPECT_TRUE(lim.allow("a", t0).log);
  for (int i = 0; i < 5; ++i) EXPECT_FALSE(lim.allow("a", t0).log);
  auto v = lim.allow("a", t0 + std::chrono::seconds(61));
  EXPECT_TRUE(v.log);
  EXPECT_EQ(v.suppressed, 5u);
  // Keys are bounded: the oldest goes first.
  for (const char* k : {"b", "c", "d", "e"}) EXPECT_TRUE(lim.allow(k, t0).log);
  EXPECT_TRUE(lim.allow("a", t0).log);  // forgotten, so new again
}

TEST(MemoryBudget, ChargesHoldAndGiveBack) {
  write::MemoryBudget b(100);
  {
    write::Charge c(&b);
    EXPECT_TRUE(c.hold(60));
    write::Charge d(&b);
    EXPECT_FALSE(d.hold(50));
    EXPECT_TRUE(d.hold(40));
    EXPECT_EQ(b.used(), 100u);
    EXPECT_TRUE(c.hold(10));  // shrinking is never refused
    EXPECT_EQ(b.used(), 50u);
  }
  EXPECT_EQ(b.used(), 0u);
}

// --- the daemon's checks on hidden and virtual names -----------------------------------------

TEST(Trust, CreateOnAHiddenShardNameOpensItAsTheFileItIs) {
  Src s;
  set_dir(s.path("team"), 0, kTeam, 02775);
  write_ckpt(s.path("team"), kA, 0600);
  s.start();
  const auto shard = format::shard_file_name(1, 1, 1);
  const fs::Ino team = s.walk({"team"});
  ASSERT_EQ(s.f->lookup(team, shard).error().code, ENOENT);  // hidden
  // B may not open A's 0600 shard; nothing about it changes.
  auto b = s.f->create(team, shard, 0600, O_CREAT | O_RDWR, user(kB, kTeam));
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.error().code, EACCES);
  EXPECT_EQ(lstat_of(s.path("team/" + shard)).st_uid, kA);
  // O_EXCL: it exists.
  EXPECT_EQ(s.f->create(team, shard, 0600, O_CREAT | O_EXCL | O_RDWR, user(kA, kTeam)).error().code,
            EEXIST);
  // Its owner opens it (DCP rewriting a shard in place): still A's, not truncated without
  // O_TRUNC.
  const auto size = lstat_of(s.path("team/" + shard)).st_size;
  auto a = s.f->create(team, shard, 0600, O_CREAT | O_RDWR, user(kA, kTeam));
  ASSERT_TRUE(a.ok()) << a.error().message;
  EXPECT_EQ(lstat_of(s.path("team/" + shard)).st_uid, kA);
  EXPECT_EQ(lstat_of(s.path("team/" + shard)).st_size, size);
  ASSERT_TRUE(s.f->flush(a->open.fh).ok());
  s.f->release(a->open.fh);
  // A directory or a symlink under a hidden name is never opened.
  stdfs::create_symlink("/etc/passwd", s.path("team/shard-00009-model-00001-of-00001.safetensors"));
  EXPECT_EQ(s.f->create(team, "shard-00009-model-00001-of-00001.safetensors", 0600,
                        O_CREAT | O_RDWR, user(kA, kTeam))
                .error()
                .code,
            ELOOP);
}

TEST(Trust, CreateOverAShownConsolidatedFileChecksTheModeShown) {
  Src s;
  set_dir(s.path("d"), kA, kA, 0777);
  write_ckpt(s.path("d"), kA, 0644);
  s.start();
  const fs::Ino d = s.walk({"d"});
  const std::string name = format::model_file_name(1, 1);
  // Shown read-only: only root may write it anew (and only with O_TRUNC).
  EXPECT_EQ(s.f->create(d, name, 0644, O_CREAT | O_WRONLY | O_TRUNC, user(kA)).error().code,
            EACCES);
  auto r = s.f->create(d, name, 0644, O_CREAT | O_RDONLY, user(kB));
  ASSERT_TRUE(r.ok()) << r.error().message;  // opened for reading, as open() would
  s.f->release(r->open.fh);
  s.f->forget(r->entry.ino, 1);
  EXPECT_EQ(s.f->create(d, name, 0644, O_CREAT | O_EXCL | O_WRONLY, user(0)).error().code, EEXIST);
}

TEST(Trust, StickyBitHoldsForHiddenAndVirtualNames) {
  Src s;
  set_dir(s.path("sticky"), 0, 0, 01777);
  write_ckpt(s.path("sticky"), kA, 0644);
  test::write_file(s.path("sticky/evil.bin"), "evil");
  ASSERT_EQ(::chown(s.path("sticky/evil.bin").c_str(), kB, kB), 0);
  s.start();
  const fs::Ino st = s.walk({"sticky"});
  const auto shard = format::shard_file_name(1, 1, 1);
  // Over a hidden shard of A's: EPERM, as the kernel answers for a visible one.
  auto r = s.f->rename(st, "evil.bin", st, shard, 0, user(kB));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, EPERM);
  // Over the consolidated file A's shards make, and unlinking it.
  const std::string model = format::model_file_name(1, 1);
  EXPECT_EQ(s.f->rename(st, "evil.bin", st, model, 0, user(kB)).error().code, EPERM);
  EXPECT_EQ(s.f->unlink(st, model, user(kB)).error().code, EPERM);
  EXPECT_TRUE(stdfs::exists(s.path("sticky/" + shard)));
  EXPECT_TRUE(stdfs::exists(s.path("sticky/evil.bin")));
  // A may remove its own; B its own file.
  EXPECT_TRUE(s.f->unlink(st, "evil.bin", user(kB)).ok());
  EXPECT_TRUE(s.f->unlink(st, model, user(kA)).ok());
  EXPECT_FALSE(stdfs::exists(s.path("sticky/" + shard)));
}

TEST(Trust, StickyBitWithShardsOfSeveralOwners) {
  Src s;
  set_dir(s.path("sticky"), 0, 0, 01777);
  write_ckpt(s.path("sticky"), kA, 0644);
  ASSERT_EQ(::chown(s.path("sticky/" + format::shard_file_name(2, 1, 1)).c_str(), kB, kB), 0);
  s.start();
  const fs::Ino st = s.walk({"sticky"});
  // A owns one shard, B the other: neither alone may remove the file they make.
  EXPECT_EQ(s.f->unlink(st, format::model_file_name(1, 1), user(kA)).error().code, EPERM);
  EXPECT_EQ(s.f->unlink(st, format::model_file_name(1, 1), user(kB)).error().code, EPERM);
  EXPECT_TRUE(s.f->unlink(st, format::model_file_name(1, 1), user(0)).ok());
}

TEST(Trust, RmdirRemovesHiddenEntriesOnlyWhenTheCallerCould) {
  Src s;
  set_dir(s.path("open"), 0, 0, 0777);
  // C's directory, where A left a broken checkpoint (one shard of two): the view shows nothing.
  set_dir(s.path("open/cdir"), kC, kC, 0777);
  write_ckpt(s.path("open/cdir"), kA, 0644);
  stdfs::remove(s.path("open/cdir/" + format::shard_file_name(1, 1, 1)));  // a gap: refused
  // A's sticky directory, holding A's broken checkpoint: C may remove the directory from
  // "open" but could not empty it.
  set_dir(s.path("open/adir"), kA, kA, 01777);
  write_ckpt(s.path("open/adir"), kA, 0644);
  stdfs::remove(s.path("open/adir/" + format::shard_file_name(1, 1, 1)));
  s.start(fs::Options{});
  const fs::Ino open = s.walk({"open"});
  s.walk({"open", "adir"});
  s.walk({"open", "cdir"});
  auto r = s.f->rmdir(open, "adir", user(kC));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, ENOTEMPTY);
  EXPECT_TRUE(stdfs::exists(s.path("open/adir/" + format::shard_file_name(2, 1, 1))));
  // In a directory the caller may empty, the hidden leftovers go with it.
  auto ok = s.f->rmdir(open, "cdir", user(kC));
  EXPECT_TRUE(ok.ok()) << ok.error().message;
  EXPECT_FALSE(stdfs::exists(s.path("open/cdir")));
  EXPECT_TRUE(s.f->rmdir(open, "adir", user(kA)).ok());
}

TEST(Trust, StatusIsTheMountOwnersAlone) {
  Src s;
  s.start();
  auto dir = s.f->lookup(fs::kRootIno, ".ckptfs");
  ASSERT_TRUE(dir.ok());
  auto file = s.f->lookup(dir->ino, "status.json");
  ASSERT_TRUE(file.ok());
  EXPECT_EQ(file->attr.st_mode & 0777, 0400u);
  EXPECT_EQ(s.f->open(file->ino, O_RDONLY, user(kC)).error().code, EACCES);
  auto o = s.f->open(file->ino, O_RDONLY, user(0));
  ASSERT_TRUE(o.ok());
  s.f->release(o->fh);
}

// --- records: only the daemon's, and they carry the writer's owner and mode ------------------

TEST(Trust, RecordsCarryTheWritersOwnerAndMode) {
  format::Record r;
  r.name = "model.safetensors";
  r.size = 8 + 2;
  r.header = std::string("\x02\0\0\0\0\0\0\0{}", 10);
  r.has_owner = true;
  r.uid = kA;
  r.gid = kTeam;
  r.mode = 0640;
  format::RecordShard sh;
  sh.name = format::shard_file_name(1, 1, 1);
  sh.size = 10;
  r.shards.push_back(sh);
  auto back = format::parse_record(format::serialize_record(r), "rec");
  ASSERT_TRUE(back.ok()) << back.error().message;
  EXPECT_TRUE(back->has_owner);
  EXPECT_EQ(back->uid, kA);
  EXPECT_EQ(back->gid, kTeam);
  EXPECT_EQ(back->mode, 0640u);
  // All three or none; permission bits only.
  auto text = format::serialize_record(r);
  auto half = text;
  half.replace(half.find("\"file_gid\""), 10, "\"file_gix\"");
  EXPECT_FALSE(format::parse_record(half, "rec").ok());
  auto big = text;
  big.replace(big.find("\"file_mode\":416"), 15, "\"file_mode\":9999");
  EXPECT_FALSE(format::parse_record(big, "rec").ok());
}

TEST(Trust, RecordsAnyoneElseCouldWriteAreNotRead) {
  test::TempDir d;
  const std::string ck = d.path() + "/ck";
  write_ckpt(ck, 0, 0644);
  // A record for the shards as they are: read when .ckptfs is the daemon's.
  format::Record r;
  r.name = "model.safetensors";
  std::string h = R"({"w":{"dtype":"F32","shape":[4,2],"data_offsets":[0,32]}})";
  r.header = std::string(8, '\0') + h;
  r.header[0] = static_cast<char>(h.size());
  r.size = r.header.size() + 32;
  for (uint32_t i = 1; i <= 2; ++i) {
    format::RecordShard sh;
    sh.name = format::shard_file_name(i, 1, 1);
    sh.size = static_cast<uint64_t>(lstat_of(ck + "/" + sh.name).st_size);
    r.shards.push_back(sh);
  }
  test::write_file(ck + "/.ckptfs/model.safetensors.commit", format::serialize_record(r));
  ::chmod((ck + "/.ckptfs").c_str(), 0700);
  auto load = [&] {
    auto c = source::load_checkpoint_path(ck);
    EXPECT_TRUE(c.ok());
    return *c;
  };
  auto trusted = load();
  ASSERT_TRUE(trusted->valid());
  EXPECT_EQ(trusted->outputs.at(0).name, "model.safetensors");
  // Owned by another user: not read, and a note says why.
  ASSERT_EQ(::chown((ck + "/.ckptfs").c_str(), kC, kC), 0);
  auto other = load();
  EXPECT_EQ(other->outputs.at(0).name, format::model_file_name(1, 1));
  ASSERT_EQ(other->notes.size(), 1u);
  EXPECT_NE(other->notes[0].find("not read"), std::string::npos) << other->notes[0];
  // The daemon's directory, but a record others may write.
  ASSERT_EQ(::chown((ck + "/.ckptfs").c_str(), 0, 0), 0);
  ::chmod((ck + "/.ckptfs/model.safetensors.commit").c_str(), 0666);
  EXPECT_EQ(load()->outputs.at(0).name, format::model_file_name(1, 1));
  ::chmod((ck + "/.ckptfs/model.safetensors.commit").c_str(), 0644);
  ::chmod((ck + "/.ckptfs").c_str(), 0777);
  EXPECT_EQ(load()->outputs.at(0).name, format::model_file_name(1, 1));
}
