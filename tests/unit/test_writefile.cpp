// The write path without a kernel: fs::Filesystem driven as the FUSE adapter drives it
// (create, write, rename, flush, release), on real files in a temporary source directory,
// with the local flusher. What is checked is what lands in SRC and what reads back.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <random>

#include <fmt/format.h>

#include "ckptfs/flush/flusher.hpp"
#include "ckptfs/flush/store.hpp"
#include "ckptfs/format/names.hpp"
#include "ckptfs/format/record.hpp"
#include "ckptfs/fs/filesystem.hpp"
#include "ckptfs/source/scanner.hpp"
#include "ckptfs/util/fd.hpp"
#include "fixture.hpp"

using namespace ckptfs;
namespace stdfs = std::filesystem;

namespace {

using test::consolidated;

struct Src {
  test::TempDir dir;
  std::unique_ptr<fs::Filesystem> f;
  explicit Src(uint32_t ranks = 3, uint64_t write_memory = 256ull << 20) {
    fs::Options o;
    o.write_memory = write_memory;
    o.settle = std::chrono::milliseconds(60'000);  // written files must not wait for it
    o.revalidate = std::chrono::milliseconds(0);
    o.ranks = ranks;
    stdfs::create_directories(dir.path() + "/ckpt");
    f = std::move(fs::Filesystem::create(dir.path(), o)).value();
  }
  std::string path(const std::string& rel) const { return dir.path() + "/" + rel; }
  fs::Ino lookup(fs::Ino parent, const std::string& name) {
    auto e = f->lookup(parent, name);
    EXPECT_TRUE(e.ok()) << name << ": " << (e ? "" : e.error().message);
    return e ? e->ino : 0;
  }
  fs::Ino ckpt() { return lookup(fs::kRootIno, "ckpt"); }

  // Creates `name` in ckpt/ and sizes it (as safetensors does before any data).
  Result<fs::CreateOut> start(const std::string& name, uint64_t size, mode_t mode, int flags) {
    CKPTFS_TRY(auto c, f->create(ckpt(), name, mode, flags));
    fs::SetAttr a;
    a.size = size;
    CKPTFS_CHECK(f->setattr(c.entry.ino, a, c.open.fh));
    return c;
  }

  // As save_pretrained: .tmp name, ftruncate, sequential writes of `chunk`, rename while
  // open, close. Returns the status of the close (FLUSH).
  Status save(const std::string& bytes, const std::string& final_name, size_t chunk = 1 << 20,
              bool in_order = true) {
    fs::Ino d = ckpt();
    auto c = f->create(d, ".tmpabc123", 0600, O_RDWR | O_CREAT | O_EXCL);
    if (!c) return std::move(c).error();
    fs::SetAttr a;
    a.size = bytes.size();
    if (auto r = f->setattr(c->entry.ino, a, c->open.fh); !r) return std::move(r).error();
    std::vector<uint64_t> offs;
    for (uint64_t o = 0; o < bytes.size(); o += chunk) offs.push_back(o);
    if (!in_order) std::reverse(offs.begin(), offs.end());
    for (uint64_t o : offs) {
      auto n = std::min<uint64_t>(chunk, bytes.size() - o);
      if (auto r = f->write(c->open.fh, o, std::string_view(bytes).substr(o, n)); !r) {
        f->release(c->open.fh);
        return std::move(r).error();
      }
    }
    if (auto r = f->rename(d, ".tmpabc123", d, final_name, 0); !r) return std::move(r).error();
    auto st = f->flush(c->open.fh);
    f->release(c->open.fh);
    return st;
  }

  // A plain file written and closed under `name` in directory `d`; the status of its close.
  Status put(fs::Ino d, const std::string& name, std::string_view bytes) {
    CKPTFS_TRY(auto c, f->create(d, name, 0644, O_RDWR | O_CREAT | O_EXCL));
    auto w = f->write(c.open.fh, 0, bytes);
    auto st = w ? f->flush(c.open.fh) : Status(std::move(w).error());
    f->release(c.open.fh);
    return st;
  }

  std::string read(fs::Ino ino) {
    auto o = f->open(ino, O_RDONLY);
    EXPECT_TRUE(o.ok()) << o.error().message;
    if (!o) return {};
    std::string out;
    auto r = f->reader(o->fh);
    out.resize(r->size());
    auto n = r->read(0, out.size(), out.data());
    EXPECT_TRUE(n.ok()) << n.error().message;
    f->release(o->fh);
    return out;
  }

  std::vector<std::string> src_names(const std::string& rel = "ckpt") const {
    std::vector<std::string> out;
    for (const auto& e : stdfs::directory_iterator(path(rel))) out.push_back(e.path().filename());
    std::sort(out.begin(), out.end());
    return out;
  }
};

// Compares file contents without printing them.
::testing::AssertionResult same(const std::string& got, const std::string& want) {
  if (got == want) return ::testing::AssertionSuccess();
  size_t i = 0;
  while (i < got.size() && i < want.size() && got[i] == want[i]) ++i;
  return ::testing::AssertionFailure()
         << "got " << got.size() << " bytes, want " << want.size() << "; first difference at " << i;
}

bool has_prefix(const std::vector<std::string>& v, std::string_view p) {
  return std::any_of(v.begin(), v.end(), [&](const std::string& s) { return s.starts_with(p); });
}

}  // namespace

TEST(WriteFile, SavedFileIsStoredAsRankShardsAndReadsBackExactly) {
  Src s(3);
  const std::string bytes = consolidated(1);
  ASSERT_TRUE(s.save(bytes, "model.safetensors", 4096).ok());
  auto names = s.src_names();
  EXPECT_EQ(names, (std::vector<std::string>{".ckptfs", format::shard_file_name(1, 1, 1),
                                             format::shard_file_name(2, 1, 1),
                                             format::shard_file_name(3, 1, 1)}));
  // The record is the only thing left in the state directory.
  EXPECT_EQ(s.src_names("ckpt/.ckptfs"),
            (std::vector<std::string>{"model.safetensors" + std::string(format::kRecordSuffix)}));
  // Visible at once (settle is a minute), under the written name, byte for byte.
  fs::Ino file = s.lookup(s.ckpt(), "model.safetensors");
  EXPECT_TRUE(same(s.read(file), bytes));
  EXPECT_EQ(s.f->getattr(file)->st_size, static_cast<off_t>(bytes.size()));
  {
    auto o = s.f->open(file, O_RDONLY);  // fstat goes through the handle
    ASSERT_TRUE(o.ok());
    auto st = s.f->getattr_handle(o->fh);
    ASSERT_TRUE(st.ok()) << st.error().message;
    EXPECT_EQ(st->st_size, static_cast<off_t>(bytes.size()));
    s.f->release(o->fh);
  }
  EXPECT_EQ(s.f->lookup(s.ckpt(), ".ckptfs").error().code, ENOENT);
  EXPECT_EQ(s.f->lookup(s.ckpt(), format::kIndexFileName).error().code, ENOENT);
  // The shards are a checkpoint by themselves: the CLI's loader sees the same file.
  auto ck = source::load_checkpoint_path(s.path("ckpt"));
  ASSERT_TRUE(ck.ok());
  ASSERT_TRUE((*ck)->valid()) << (*ck)->problems[0].to_string();
  ASSERT_EQ((*ck)->outputs.size(), 1u);
  EXPECT_EQ((*ck)->outputs[0].name, "model.safetensors");
  EXPECT_EQ((*ck)->outputs[0].header, bytes.substr(0, (*ck)->outputs[0].header.size()));
}

TEST(WriteFile, OutOfOrderWritesAreStagedAndSplitAtClose) {
  Src s(2);
  const std::string bytes = consolidated(2);
  ASSERT_TRUE(s.save(bytes, "model.safetensors", 4096, /*in_order=*/false).ok());
  EXPECT_TRUE(has_prefix(s.src_names(), "shard-00002-model-00001-of-00001"));
  EXPECT_FALSE(stdfs::exists(s.path("ckpt/model.safetensors")));
  EXPECT_TRUE(same(s.read(s.lookup(s.ckpt(), "model.safetensors")), bytes));
}

TEST(WriteFile, OtherNamesAndOtherContentAreStoredAsWritten) {
  Src s;
  const std::string bytes = consolidated(3);
  // A consolidated file closed under a name that is not a model file's: stored whole.
  ASSERT_TRUE(s.save(bytes, "adapter_model.safetensors").ok());
  EXPECT_TRUE(same(*read_small_file(s.path("ckpt/adapter_model.safetensors"), 1 << 24), bytes));
  // Not safetensors at all, but under a model name: stored whole too.
  std::string fake = bytes;
  fake[8] = '[';
  ASSERT_TRUE(s.save(fake, "model.safetensors").ok());
  EXPECT_TRUE(same(*read_small_file(s.path("ckpt/model.safetensors"), 1 << 24), fake));
  EXPECT_FALSE(has_prefix(s.src_names(), "shard-"));
  EXPECT_TRUE(same(s.read(s.lookup(s.ckpt(), "model.safetensors")), fake));
}

TEST(WriteFile, FileCutShortUnderAModelNameNeverReadsComplete) {
  Src s;
  const std::string bytes = consolidated(4);
  auto c = s.start("model.safetensors", bytes.size(), 0644, O_WRONLY | O_CREAT | O_TRUNC);
  ASSERT_TRUE(c.ok());
  const size_t half = bytes.size() / 2;
  ASSERT_TRUE(s.f->write(c->open.fh, 0, std::string_view(bytes).substr(0, half)).ok());
  // A reader meanwhile sees what was written so far, and zeros after.
  std::string mid(bytes.size(), 'x');
  auto r = s.f->reader(c->open.fh)->read(0, mid.size(), mid.data());
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(mid.substr(0, half), bytes.substr(0, half));
  EXPECT_EQ(mid.substr(half), std::string(bytes.size() - half, '\0'));
  // Kept as the bytes received, which is not what the writer made (it sized the file for
  // all of them): close() says so.
  auto closed = s.f->flush(c->open.fh);
  s.f->release(c->open.fh);
  ASSERT_FALSE(closed.ok());
  EXPECT_EQ(closed.error().code, EIO);
  EXPECT_TRUE(
      same(*read_small_file(s.path("ckpt/model.safetensors"), 1 << 24), bytes.substr(0, half)));
  EXPECT_FALSE(has_prefix(s.src_names(), "shard-"));
}

TEST(WriteFile, ReplacingAFileKeepsTheOldOneUntilTheNewOneCommits) {
  Src s(2);
  const std::string v1 = consolidated(5), v2 = consolidated(6, 40);
  ASSERT_TRUE(s.save(v1, "model.safetensors").ok());
  fs::Ino d = s.ckpt();
  auto c = s.f->create(d, ".tmpnew", 0600, O_RDWR | O_CREAT | O_EXCL);
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE(s.f->write(c->open.fh, 0, std::string_view(v2).substr(0, v2.size() / 2)).ok());
  ASSERT_TRUE(s.f->rename(d, ".tmpnew", d, "model.safetensors", 0).ok());
  // Another reader, by name, still gets the committed version.
  EXPECT_TRUE(same(s.read(s.lookup(d, "model.safetensors")), v1));
  ASSERT_TRUE(
      s.f->write(c->open.fh, v2.size() / 2, std::string_view(v2).substr(v2.size() / 2)).ok());
  ASSERT_TRUE(s.f->flush(c->open.fh).ok());
  s.f->release(c->open.fh);
  EXPECT_TRUE(same(s.read(s.lookup(d, "model.safetensors")), v2));
  EXPECT_EQ(s.src_names("ckpt/.ckptfs").size(), 1u);  // one record, no staging left
}

TEST(WriteFile, WriterKilledMidFileLeavesTheOldVersionAndItsStagingIsCleanedUp) {
  Src s(2);
  const std::string v1 = consolidated(7);
  ASSERT_TRUE(s.save(v1, "model.safetensors").ok());
  const std::string v2 = consolidated(8);
  pid_t pid = ::fork();
  if (pid == 0) {
    // The writer's daemon-side state dies with it: no finalize, no destructor.
    fs::Ino d = s.ckpt();
    auto c = s.f->create(d, ".tmpdead", 0600, O_RDWR | O_CREAT | O_EXCL);
    if (!c || !s.f->write(c->open.fh, 0, std::string_view(v2).substr(0, v2.size() / 2))) _exit(1);
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  auto staging = s.src_names("ckpt/.ckptfs");
  EXPECT_TRUE(has_prefix(staging, "tx-")) << "the dead writer's staging should be there";
  // The view still shows the old version, exactly, and the next check drops the staging.
  EXPECT_TRUE(same(s.read(s.lookup(s.ckpt(), "model.safetensors")), v1));
  EXPECT_FALSE(has_prefix(s.src_names("ckpt/.ckptfs"), "tx-"));
  EXPECT_FALSE(stdfs::exists(s.path("ckpt/.tmpdead"))) << "its empty placeholder stays";
}

TEST(WriteFile, AScratchCopyLeftByADeadDaemonIsRemovedOneInUseIsKept) {
  // write/dedup copies a stored shard into .ckptfs/unshare-<pid>-<n> and renames it into
  // place; a daemon killed midway leaves the copy, unlocked. One still locked is being made.
  Src s(2);
  const std::string v1 = consolidated(13);
  ASSERT_TRUE(s.save(v1, "model.safetensors").ok());
  const std::string dead = "ckpt/.ckptfs/unshare-1-0", live = "ckpt/.ckptfs/unshare-2-0",
                    own = fmt::format("ckpt/.ckptfs/unshare-{}-7", ::getpid());
  for (const auto& p : {dead, live, own}) test::write_file(s.path(p), std::string(4096, 'x'));
  UniqueFd held(::open(s.path(live).c_str(), O_RDONLY | O_CLOEXEC));
  ASSERT_GE(held.get(), 0);
  ASSERT_EQ(::flock(held.get(), LOCK_EX), 0);
  EXPECT_TRUE(same(s.read(s.lookup(s.ckpt(), "model.safetensors")), v1));
  EXPECT_FALSE(stdfs::exists(s.path(dead))) << "nobody holds it: its daemon died";
  EXPECT_TRUE(stdfs::exists(s.path(live))) << "locked: a daemon is copying it";
  EXPECT_TRUE(stdfs::exists(s.path(own))) << "this daemon's own";
  EXPECT_TRUE(stdfs::exists(s.path("ckpt/.ckptfs/model.safetensors.commit")));
}

TEST(WriteFile, CommitInterruptedBeforeRollForwardIsCompletedOnNextLook) {
  // A daemon that died right after the commit point: the record names staging that still
  // holds the new shards, and the old shards are still in place.
  Src s(2);
  const std::string v1 = consolidated(9), v2 = consolidated(10);
  ASSERT_TRUE(s.save(v1, "model.safetensors").ok());
  test::TempDir other;
  {
    Src t(2);
    ASSERT_TRUE(t.save(v2, "model.safetensors").ok());
    stdfs::create_directories(s.path("ckpt/.ckptfs/tx-dead"));
    for (uint32_t r = 1; r <= 2; ++r) {
      stdfs::copy_file(t.path("ckpt/" + format::shard_file_name(r, 1, 1)),
                       s.path(fmt::format("ckpt/.ckptfs/tx-dead/rank-{:05d}", r)));
    }
    auto text = *read_small_file(t.path("ckpt/.ckptfs/model.safetensors.commit"), 1 << 24);
    auto rec = *format::parse_record(text, "record");
    rec.tx = "tx-dead";
    test::write_file(s.path("ckpt/.ckptfs/model.safetensors.commit"),
                     format::serialize_record(rec));
  }
  // A reader of SRC alone (the CLI, a read-only mount) refuses the half-done state.
  auto ck = source::load_checkpoint_path(s.path("ckpt"));
  ASSERT_TRUE(ck.ok());
  EXPECT_FALSE((*ck)->valid());
  // The read-write view finishes it and shows the new version.
  EXPECT_TRUE(same(s.read(s.lookup(s.ckpt(), "model.safetensors")), v2));
  EXPECT_FALSE(stdfs::exists(s.path("ckpt/.ckptfs/tx-dead")));
}

TEST(WriteFile, ShardWriteErrorsReachTheWriter) {
  // A real write failure: RLIMIT_FSIZE makes the kernel refuse bytes past the limit (EFBIG),
  // as ENOSPC would. The error reaches write() or close(), and the older file is untouched.
  Src s(1);
  const std::string v1 = consolidated(11, 16);
  ASSERT_TRUE(s.save(v1, "model.safetensors").ok());
  const std::string big = consolidated(12, 512);
  pid_t pid = ::fork();
  if (pid == 0) {
    ::signal(SIGXFSZ, SIG_IGN);
    struct rlimit rl {
      64 * 1024, 64 * 1024
    };
    ::setrlimit(RLIMIT_FSIZE, &rl);
    Status st = s.save(big, "model.safetensors", 16 * 1024);
    _exit(!st.ok() && st.error().code == EFBIG ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << "the EFBIG did not reach the writer";
  EXPECT_TRUE(same(s.read(s.lookup(s.ckpt(), "model.safetensors")), v1));
}

TEST(WriteFile, NamesAndDirectoryOperations) {
  Src s(2);
  const std::string bytes = consolidated(13);
  ASSERT_TRUE(s.save(bytes, "model.safetensors").ok());
  fs::Ino d = s.ckpt();
  // The state directory's name is reserved.
  EXPECT_EQ(s.f->mkdir(d, ".ckptfs", 0755).error().code, EPERM);
  EXPECT_EQ(s.f->create(fs::kRootIno, ".ckptfs", 0644, O_WRONLY).error().code, EPERM);
  // A consolidated file is not renamed in place, nor replaced by a no-replace rename.
  EXPECT_EQ(s.f->rename(d, "model.safetensors", d, "x.safetensors", 0).error().code, EXDEV);
  auto c = s.f->create(d, "notes.txt", 0644, O_WRONLY | O_CREAT);
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE(s.f->write(c->open.fh, 0, "hello").ok());
  ASSERT_TRUE(s.f->flush(c->open.fh).ok());
  s.f->release(c->open.fh);
  EXPECT_EQ(s.f->rename(d, "notes.txt", d, "model.safetensors", RENAME_NOREPLACE).error().code,
            EEXIST);
  EXPECT_EQ(s.read(s.lookup(d, "notes.txt")), "hello");
  // Unlinking the consolidated file removes its shards and record.
  ASSERT_TRUE(s.f->unlink(d, "model.safetensors").ok());
  EXPECT_FALSE(has_prefix(s.src_names(), "shard-"));
  EXPECT_TRUE(s.src_names("ckpt/.ckptfs").empty());
  // rmdir of a directory the view shows empty takes the hidden state with it.
  ASSERT_TRUE(s.f->unlink(d, "notes.txt").ok());
  ASSERT_TRUE(stdfs::exists(s.path("ckpt/.ckptfs")));
  ASSERT_TRUE(s.f->rmdir(fs::kRootIno, "ckpt").ok());
  EXPECT_FALSE(stdfs::exists(s.path("ckpt")));
}

TEST(WriteFile, RenameAfterCloseWhileStillOpenForReadingIsStoredAtTheRename) {
  // RELEASE comes after close() returns, and a reader may hold the file: a rename onto a
  // model name with no writer left must store the file then, not wait for a close that
  // already happened.
  Src s(2);
  const std::string v1 = consolidated(21), v2 = consolidated(22);
  ASSERT_TRUE(s.save(v1, "model.safetensors").ok());
  fs::Ino d = s.ckpt();
  auto c = s.f->create(d, "staged.bin", 0644, O_WRONLY | O_CREAT | O_EXCL);
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE(s.f->write(c->open.fh, 0, v2).ok());
  ASSERT_TRUE(s.f->flush(c->open.fh).ok());  // close(): stored whole under its own name
  auto reader = s.f->open(c->entry.ino, O_RDONLY);
  ASSERT_TRUE(reader.ok());
  s.f->release(c->open.fh);
  ASSERT_TRUE(s.f->rename(d, "staged.bin", d, "model.safetensors", 0).ok());
  EXPECT_FALSE(stdfs::exists(s.path("ckpt/model.safetensors"))) << "not split at the rename";
  EXPECT_TRUE(same(s.read(s.lookup(d, "model.safetensors")), v2));
  s.f->release(reader->fh);
}

TEST(WriteFile, RmdirNeverTakesACheckpointThatIsStillSettling) {
  // Shards that appeared a moment ago by other means (settle is a minute here): the view
  // lists nothing yet, but they are not leftovers.
  Src s;
  stdfs::create_directories(s.path("ckpt/step"));
  for (uint32_t r = 0; r < 2; ++r) {
    test::ChunkSpec c{"w",    format::DType::F32, {uint64_t(r) * 2, 0},
                      {2, 2}, std::nullopt,       std::string(16, 'x')};
    test::write_file(
        s.path("ckpt/step/" + format::shard_file_name(r + 1, 1, 1)),
        test::make_shard_bytes(test::ShardSpec{format::shard_file_name(r + 1, 1, 1), {c}}));
  }
  fs::Ino d = s.ckpt();
  fs::Ino step = s.lookup(d, "step");
  auto dh = s.f->opendir(step);
  ASSERT_TRUE(dh.ok());
  s.f->releasedir(*dh);
  EXPECT_EQ(s.f->rmdir(d, "step").error().code, ENOTEMPTY);
  EXPECT_TRUE(stdfs::exists(s.path("ckpt/step/" + format::shard_file_name(2, 1, 1))));
}

TEST(WriteFile, AStateDirectoryNotMadeByTheDaemonIsNeverUsed) {
  // Someone else's .ckptfs could hold swapped shards or planted records: files are then
  // stored whole, and nothing in it is recovered.
  Src s(2);
  stdfs::create_directories(s.path("ckpt/.ckptfs/tx-planted"));
  test::write_file(s.path("ckpt/.ckptfs/tx-planted/rank-00001"), "x");
  ASSERT_EQ(::chown(s.path("ckpt/.ckptfs").c_str(), 65534, 65534), 0);
  const std::string bytes = consolidated(23);
  ASSERT_TRUE(s.save(bytes, "model.safetensors").ok());
  EXPECT_TRUE(same(*read_small_file(s.path("ckpt/model.safetensors"), 1 << 24), bytes));
  EXPECT_FALSE(has_prefix(s.src_names(), "shard-"));
  EXPECT_TRUE(stdfs::exists(s.path("ckpt/.ckptfs/tx-planted/rank-00001")));
}

TEST(WriteFile, RewritingAConsolidatedFileWithOTruncAndFtruncate) {
  // open(O_TRUNC) of the shown file, ftruncate to the final size through that handle, write,
  // close: a new version, with the old one's owner and mode.
  Src s(2);
  const std::string v1 = consolidated(31), v2 = consolidated(32, 40);
  ASSERT_TRUE(s.save(v1, "model.safetensors").ok());
  ASSERT_EQ(::chmod(s.path("ckpt/" + format::shard_file_name(1, 1, 1)).c_str(), 0640), 0);
  ASSERT_EQ(::chmod(s.path("ckpt/" + format::shard_file_name(2, 1, 1)).c_str(), 0640), 0);
  s.f->invalidate_all();
  fs::Ino file = s.lookup(s.ckpt(), "model.safetensors");
  auto o = s.f->open(file, O_WRONLY | O_TRUNC);
  ASSERT_TRUE(o.ok()) << o.error().message;
  fs::SetAttr a;
  a.size = v2.size();
  auto st = s.f->setattr(file, a, o->fh);
  ASSERT_TRUE(st.ok()) << st.error().message;
  EXPECT_EQ(st->st_size, static_cast<off_t>(v2.size()));
  ASSERT_TRUE(s.f->write(o->fh, 0, v2).ok());
  ASSERT_TRUE(s.f->flush(o->fh).ok());
  s.f->release(o->fh);
  EXPECT_TRUE(same(s.read(s.lookup(s.ckpt(), "model.safetensors")), v2));
  struct stat sh {};
  ASSERT_EQ(::stat(s.path("ckpt/" + format::shard_file_name(1, 1, 1)).c_str(), &sh), 0);
  EXPECT_EQ(sh.st_mode & 07777, 0640u);
}

TEST(WriteFile, AFailedCopyBackToStagingFailsTheFileForGood) {
  // The staged shards lose their bytes under the writer (a real fault: truncated behind its
  // back), then an out-of-order write makes it copy what it routed back into one file. That
  // copy fails; the file must stay failed: a later write and the close report the error, and
  // nothing is committed (no shard holding zeros where the lost bytes were).
  Src s(2);
  const std::string bytes = consolidated(21);
  fs::Ino d = s.ckpt();
  auto c = s.start(".tmpabc123", bytes.size(), 0600, O_RDWR | O_CREAT | O_EXCL);
  ASSERT_TRUE(c.ok());
  const size_t half = bytes.size() / 2;
  ASSERT_TRUE(s.f->write(c->open.fh, 0, std::string_view(bytes).substr(0, half)).ok());
  size_t truncated = 0;
  for (const auto& tx : stdfs::directory_iterator(s.path("ckpt/.ckptfs"))) {
    if (!tx.is_directory()) continue;
    for (const auto& f : stdfs::directory_iterator(tx.path())) {
      if (f.path().filename().string().starts_with("rank-")) {
        stdfs::resize_file(f.path(), 0);
        ++truncated;
      }
    }
  }
  ASSERT_GT(truncated, 0u) << "no staged shard found";
  const uint64_t last = bytes.size() - 4096;
  auto w = s.f->write(c->open.fh, last, std::string_view(bytes).substr(last));
  ASSERT_FALSE(w.ok()) << "the copy back from truncated staging did not fail";
  EXPECT_FALSE(s.f->write(c->open.fh, half, std::string_view(bytes).substr(half, 4096)).ok())
      << "a write after the failure was accepted";
  ASSERT_TRUE(s.f->rename(d, ".tmpabc123", d, "model.safetensors", 0).ok());
  EXPECT_FALSE(s.f->flush(c->open.fh).ok()) << "the close did not report the failure";
  s.f->release(c->open.fh);
  EXPECT_FALSE(has_prefix(s.src_names(), "shard-")) << "a failed file was committed";
  // What a failed write leaves, as on a plain file system: the file, holding nothing that
  // could pass for the model (not the full size in zeros).
  EXPECT_EQ(stdfs::file_size(s.path("ckpt/model.safetensors")), 0u);
}

namespace {

// What the OpenMPI flusher's node-local mode reads with, minus MPI: one ShardStore per "rank"
// directory; the view's Flusher hands it out.
class StoreReader final : public io::ShardReader {
 public:
  std::vector<std::unique_ptr<flush::ShardStore>> stores;
  Status read(int32_t owner, std::string_view path, uint64_t size, uint64_t off, char* dst,
              size_t n) const override {
    if (owner < 0 || static_cast<size_t>(owner) >= stores.size()) {
      return make_error(EIO, "no rank {}", owner);
    }
    return stores[static_cast<size_t>(owner)]->read_path(path, size, off, dst, n);
  }
};

class ReaderFlusher final : public flush::Flusher {
 public:
  explicit ReaderFlusher(std::shared_ptr<const io::ShardReader> r) : r_(std::move(r)) {}
  uint32_t default_ranks() const override { return 1; }
  Result<std::unique_ptr<flush::Transaction>> begin(const flush::Target& t,
                                                    const layout::ShardSet& set,
                                                    std::string what) override {
    return local_->begin(t, set, std::move(what));
  }
  Result<std::unique_ptr<flush::Transaction>> begin_kernel_write(const flush::Target& t,
                                                                 std::string what) override {
    return local_->begin_kernel_write(t, std::move(what));
  }
  bool recover(const flush::Target& t) override { return local_->recover(t); }
  Status remove(const flush::Target& t, uint32_t k, uint32_t m) override {
    return local_->remove(t, k, m);
  }
  std::shared_ptr<const io::ShardReader> reader() const override { return r_; }

 private:
  std::unique_ptr<flush::Flusher> local_ = flush::make_local_flusher();
  std::shared_ptr<const io::ShardReader> r_;
};

}  // namespace

TEST(WriteFile, NodeLocalRecordReadsThroughTheShardReaderAndNeverAsZeros) {
  // A file written as 3 shards, then moved as the node-local mode stores it: shard i on
  // "rank" i % 2 under T<r>/ckpt/.ckptfs/nl-test-1/, and a version 2 record in SRC naming
  // each shard's owner, path and header. SRC keeps no shard file.
  Src s(3);
  const std::string v1 = consolidated(30);
  ASSERT_TRUE(s.save(v1, "model.safetensors").ok());
  const std::string rec_path = s.path("ckpt/.ckptfs/model.safetensors.commit");
  auto rec = *format::parse_record(*read_small_file(rec_path, 1 << 24), "record");
  for (uint32_t i = 0; i < rec.shards.size(); ++i) {
    auto& sh = rec.shards[i];
    const std::string bytes = *read_small_file(s.path("ckpt/" + sh.name), 1 << 24);
    uint64_t n = 0;
    for (int b = 7; b >= 0; --b) n = (n << 8) | static_cast<unsigned char>(bytes[b]);
    auto h = format::parse_header_json(bytes.substr(8, n), bytes.size(), "x");
    ASSERT_TRUE(h.ok());
    sh.owner = static_cast<int32_t>(i % 2);
    sh.path = "ckpt/.ckptfs/nl-test-1/" + sh.name;
    sh.header = bytes.substr(0, h->data_start());
    test::write_file(s.path(fmt::format("T{}/{}", sh.owner, sh.path)), bytes);
    stdfs::remove(s.path("ckpt/" + sh.name));
  }
  test::write_file(rec_path, format::serialize_record(rec));
  auto reader = std::make_shared<StoreReader>();
  for (int r = 0; r < 2; ++r) {
    reader->stores.push_back(
        std::move(flush::ShardStore::open(s.path(fmt::format("T{}", r)))).value());
  }
  auto view = [&](std::shared_ptr<flush::Flusher> fl) {
    fs::Options o;
    o.revalidate = std::chrono::milliseconds(0);
    o.flusher = std::move(fl);
    return std::move(fs::Filesystem::create(s.dir.path(), o)).value();
  };
  // The inspect path (no reader): the checkpoint builds from the record alone.
  auto ck = source::load_checkpoint_path(s.path("ckpt"));
  ASSERT_TRUE(ck.ok()) << ck.error().message;
  ASSERT_TRUE((*ck)->valid()) << (*ck)->problems.front().to_string();
  EXPECT_EQ((*ck)->shards[1].owner, 1);
  {  // With the reader: exact.
    auto f = view(std::make_shared<ReaderFlusher>(reader));
    auto d = f->lookup(fs::kRootIno, "ckpt");
    ASSERT_TRUE(d.ok());
    auto e = f->lookup(d->ino, "model.safetensors");
    ASSERT_TRUE(e.ok()) << e.error().message;
    auto o = f->open(e->ino, O_RDONLY);
    ASSERT_TRUE(o.ok());
    std::string got(v1.size(), '\0');
    auto n = f->reader(o->fh)->read(0, got.size(), got.data());
    ASSERT_TRUE(n.ok()) << n.error().message;
    EXPECT_TRUE(same(got, v1));
    // A shard changed on its target under the record: an error naming it, never other bytes.
    const std::string p1 = s.path("T1/" + rec.shards[1].path);
    ASSERT_EQ(::truncate(p1.c_str(), 100), 0);
    auto bad = f->reader(o->fh)->read(0, got.size(), got.data());
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.error().message.find(rec.shards[1].name), std::string::npos)
        << bad.error().message;
    f->release(o->fh);
  }
  {  // No reader (a plain mount of SRC): listed, but a read is EIO naming the owner.
    auto f = view(std::make_shared<ReaderFlusher>(nullptr));
    auto d = f->lookup(fs::kRootIno, "ckpt");
    auto e = f->lookup(d->ino, "model.safetensors");
    ASSERT_TRUE(e.ok());
    auto o = f->open(e->ino, O_RDONLY);
    ASSERT_TRUE(o.ok());
    std::string got(v1.size(), '\0');
    auto n = f->reader(o->fh)->read(0, got.size(), got.data());
    ASSERT_FALSE(n.ok());
    EXPECT_EQ(n.error().code, EIO);
    EXPECT_NE(n.error().message.find("node-local target of MPI rank 0"), std::string::npos)
        << n.error().message;
    f->release(o->fh);
  }
}

// --- what close() returned 0 for reads back (issue 18) ----------------------------------------

TEST(WriteFile, PlainBytesOverACommittedNameAreRefusedAtCloseAndTheOldOneStays) {
  Src s(2);
  const std::string v1 = consolidated(40);
  ASSERT_TRUE(s.save(v1, "model.safetensors").ok());
  const fs::Ino d = s.ckpt();
  // Rewritten in place (O_TRUNC) with bytes that are no safetensors file: a writer killed
  // mid-save looks the same, so the stored version stays, and close() says so.
  auto o = s.f->open(s.lookup(d, "model.safetensors"), O_WRONLY | O_TRUNC);
  ASSERT_TRUE(o.ok()) << o.error().message;
  ASSERT_TRUE(s.f->write(o->fh, 0, "not a safetensors file").ok());
  auto st = s.f->flush(o->fh);
  s.f->release(o->fh);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.error().code, EINVAL);
  EXPECT_NE(st.error().message.find("model.safetensors"), std::string::npos) << st.error().message;
  EXPECT_TRUE(same(s.read(s.lookup(d, "model.safetensors")), v1));
  // Renamed over it, a closed plain file replaces it (an explicit, atomic replacement).
  ASSERT_TRUE(s.put(d, "plain.bin", "plain bytes").ok());
  ASSERT_TRUE(s.f->rename(d, "plain.bin", d, "model.safetensors", 0).ok());
  EXPECT_EQ(s.read(s.lookup(d, "model.safetensors")), "plain bytes");
  EXPECT_FALSE(has_prefix(s.src_names(), "shard-"));
}

TEST(WriteFile, AModelNameAmongOtherFilesShardsHoldsOnlyAConsolidatedFile) {
  Src s(2);
  const std::string v1 = consolidated(41);
  ASSERT_TRUE(s.save(v1, "model-00001-of-00002.safetensors").ok());
  // Would be hidden by file 1's shards: refused at close, file 1 untouched.
  auto st = s.save("plain, not safetensors", "model-00002-of-00002.safetensors");
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.error().code, EINVAL);
  const fs::Ino d = s.ckpt();
  EXPECT_TRUE(same(s.read(s.lookup(d, "model-00001-of-00002.safetensors")), v1));
  // A closed plain file renamed there: refused before anything moves.
  ASSERT_TRUE(s.put(d, "x.bin", "x").ok());
  EXPECT_EQ(s.f->rename(d, "x.bin", d, "model-00002-of-00002.safetensors", 0).error().code, EINVAL);
  EXPECT_TRUE(stdfs::exists(s.path("ckpt/x.bin")));
  // A consolidated file that fits the checkpoint is welcome there; one repeating file 1's
  // tensors, or of another file count, is not (both would stop showing).
  auto dup = s.save(consolidated(42), "model-00002-of-00002.safetensors");
  ASSERT_FALSE(dup.ok());
  EXPECT_EQ(dup.error().code, EINVAL);
  EXPECT_NE(dup.error().message.find("z.weight"), std::string::npos) << dup.error().message;
  EXPECT_FALSE(s.save(consolidated(43, 8, "other."), "model-00001-of-00003.safetensors").ok());
  EXPECT_TRUE(s.save(consolidated(44, 8, "two."), "model-00002-of-00002.safetensors").ok());
  EXPECT_TRUE(same(s.read(s.lookup(d, "model-00001-of-00002.safetensors")), v1));
  EXPECT_TRUE(
      same(s.read(s.lookup(d, "model-00002-of-00002.safetensors")), consolidated(44, 8, "two.")));
}

TEST(WriteFile, ALinkMadeInSrcWhileWritingGetsTheBytes) {
  Src s(2);
  const std::string bytes = consolidated(43);
  const fs::Ino d = s.ckpt();
  auto c = s.f->create(d, ".tmplink", 0600, O_RDWR | O_CREAT | O_EXCL);
  ASSERT_TRUE(c.ok());
  fs::SetAttr a;
  a.size = bytes.size();
  ASSERT_TRUE(s.f->setattr(c->entry.ino, a, c->open.fh).ok());
  const size_t half = bytes.size() / 2;
  ASSERT_TRUE(s.f->write(c->open.fh, 0, std::string_view(bytes).substr(0, half)).ok());
  ASSERT_EQ(::link(s.path("ckpt/.tmplink").c_str(), s.path("kept.bin").c_str()), 0);
  ASSERT_TRUE(s.f->write(c->open.fh, half, std::string_view(bytes).substr(half)).ok());
  ASSERT_TRUE(s.f->rename(d, ".tmplink", d, "model.safetensors", 0).ok());
  ASSERT_TRUE(s.f->flush(c->open.fh).ok());
  s.f->release(c->open.fh);
  EXPECT_TRUE(has_prefix(s.src_names(), "shard-"));  // stored as shards, and also...
  EXPECT_TRUE(same(*read_small_file(s.path("kept.bin"), 1 << 24), bytes));  // ...kept there
  EXPECT_TRUE(same(s.read(s.lookup(d, "model.safetensors")), bytes));
}

TEST(WriteFile, PastTheMemoryBudgetFilesAreHeldOnDiskAndStillSplit) {
  // 8 KiB for every file's header: a 64 KiB first write cannot be held, so the file goes to
  // disk at once; at close its header (a few KiB) fits, and it is split.
  Src s(2, 8 << 10);
  const std::string bytes = consolidated(44);
  ASSERT_TRUE(s.save(bytes, "model.safetensors", 64 << 10).ok());
  EXPECT_TRUE(has_prefix(s.src_names(), "shard-00002-model-00001-of-00001"));
  EXPECT_TRUE(same(s.read(s.lookup(s.ckpt(), "model.safetensors")), bytes));
  // With 1 KiB even the split cannot be held: stored whole, and (no shard of another file
  // there) shown whole, byte for byte.
  Src t(2, 1 << 10);
  ASSERT_TRUE(t.save(bytes, "model.safetensors", 64 << 10).ok());
  EXPECT_FALSE(has_prefix(t.src_names(), "shard-"));
  EXPECT_TRUE(same(t.read(t.lookup(t.ckpt(), "model.safetensors")), bytes));
}

TEST(WriteFile, AWrittenFileKeepsTheModeAndTimesItsWriterGives) {
  // cp -a: times and mode set through the handle before close; tar and rsync: by name after.
  Src s(2);
  const std::string bytes = consolidated(45);
  const fs::Ino d = s.ckpt();
  auto c = s.f->create(d, "model.safetensors", 0600, O_RDWR | O_CREAT | O_EXCL);
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE(s.f->write(c->open.fh, 0, bytes).ok());
  fs::SetAttr a;
  a.mode = 0664;
  a.atime = timespec{1'600'000'000, 0};
  a.mtime = timespec{1'600'000'000, 123};
  ASSERT_TRUE(s.f->setattr(c->entry.ino, a, c->open.fh).ok());
  ASSERT_TRUE(s.f->flush(c->open.fh).ok());
  s.f->release(c->open.fh);
  auto shown = s.f->getattr(s.lookup(d, "model.safetensors"));
  ASSERT_TRUE(shown.ok());
  EXPECT_EQ(shown->st_mode & 07777, 0664u);  // write bits too: it is the file written
  EXPECT_EQ(shown->st_mtim.tv_sec, 1'600'000'000);
  EXPECT_EQ(shown->st_mtim.tv_nsec, 123);
  // By name, after the close: they stick and read back (a new version of the view).
  fs::SetAttr b;
  b.mode = 0640;
  b.mtime = timespec{1'700'000'000, 0};
  auto set = s.f->setattr(s.lookup(d, "model.safetensors"), b);
  ASSERT_TRUE(set.ok()) << set.error().message;
  EXPECT_EQ(set->st_mode & 07777, 0640u);
  auto again = s.f->getattr(s.lookup(d, "model.safetensors"));
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->st_mode & 07777, 0640u);
  EXPECT_EQ(again->st_mtim.tv_sec, 1'700'000'000);
  EXPECT_TRUE(same(s.read(s.lookup(d, "model.safetensors")), bytes));
  // The size of a consolidated file is its bytes': truncate stays refused.
  fs::SetAttr t;
  t.size = 10;
  EXPECT_EQ(s.f->setattr(s.lookup(d, "model.safetensors"), t).error().code, EPERM);
}

// The times a writer sets before close stick when the daemon still held the bytes (a file under
// 8 bytes) or routed them (safetensors under a name that is no model name, kept whole at close):
// moving them into the file at close is no change of it (cp -a sets times, then closes).
TEST(WriteFile, TimesSetBeforeCloseSurviveTheBytesMovingIntoTheFile) {
  Src s;
  const struct timespec old { 1'600'000'000, 123 };
  for (const auto& [name, bytes] : std::vector<std::pair<std::string, std::string>>{
           {"small.txt", "abc"}, {"adapter_model.safetensors", consolidated(7, 8)}}) {
    auto c = s.f->create(s.ckpt(), name, 0644, O_RDWR | O_CREAT | O_EXCL);
    ASSERT_TRUE(c.ok()) << c.error().message;
    ASSERT_TRUE(s.f->write(c->open.fh, 0, bytes).ok());
    fs::SetAttr a;
    a.atime = old;
    a.mtime = old;
    ASSERT_TRUE(s.f->setattr(c->entry.ino, a, c->open.fh).ok());
    ASSERT_TRUE(s.f->flush(c->open.fh).ok());
    s.f->release(c->open.fh);
    struct stat st {};
    ASSERT_EQ(::stat(s.path("ckpt/" + name).c_str(), &st), 0) << name;
    EXPECT_EQ(st.st_size, static_cast<off_t>(bytes.size())) << name;
    EXPECT_EQ(st.st_mtim.tv_sec, old.tv_sec) << name << ": the close moved its mtime";
    EXPECT_EQ(st.st_mtim.tv_nsec, old.tv_nsec) << name;
  }
}
