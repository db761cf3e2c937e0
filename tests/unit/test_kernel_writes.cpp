// The write path with write passthrough (Options::backing_writes), driven as the FUSE adapter
// drives it: the kernel writes a file into its backing file itself, so these tests write the
// bytes with pwrite on the descriptor the open handed out, as the kernel would, and no write()
// reaches the daemon. What is checked is what lands in SRC, what reads back, and what the
// close of each descriptor answers.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <mutex>

#include <filesystem>
#include <fstream>
#include <iterator>

#include "ckptfs/format/names.hpp"
#include "ckptfs/fs/filesystem.hpp"
#include "ckptfs/source/scanner.hpp"
#include "ckptfs/util/fd.hpp"
#include "ckptfs/write/dedup.hpp"
#include "ckptfs/write/file.hpp"
#include "ckptfs/write/resplit.hpp"
#include "fixture.hpp"

using namespace ckptfs;
namespace stdfs = std::filesystem;

namespace {

struct Mount {
  test::TempDir dir;
  std::unique_ptr<fs::Filesystem> f;
  uint32_t ranks = 2;
  explicit Mount(bool backing_reads = false, uint32_t ranks = 2) : ranks(ranks) {
    stdfs::create_directories(dir.path() + "/ckpt");
    restart(backing_reads);
  }
  // A new daemon on the same SRC (the old one's state goes with it).
  fs::Options opts;  // restart()'s base: what a test sets beyond the defaults below
  void restart(bool backing_reads = false) {
    fs::Options o = opts;
    o.backing = backing_reads;
    o.backing_writes = true;
    o.backing_grace = std::chrono::milliseconds(0);
    o.settle = std::chrono::milliseconds(60'000);  // written files must not wait for it
    o.revalidate = std::chrono::milliseconds(0);
    o.ranks = ranks;
    f.reset();
    f = std::move(fs::Filesystem::create(dir.path(), o)).value();
  }
  std::string path(const std::string& rel) const { return dir.path() + "/" + rel; }
  fs::Ino lookup(fs::Ino parent, const std::string& name) {
    auto e = f->lookup(parent, name);
    EXPECT_TRUE(e.ok()) << name << ": " << (e ? "" : e.error().message);
    return e ? e->ino : 0;
  }
  fs::Ino ckpt() { return lookup(fs::kRootIno, "ckpt"); }
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
  std::vector<std::string> src_names() const {
    std::vector<std::string> out;
    for (const auto& e : stdfs::directory_iterator(path("ckpt"))) {
      out.push_back(e.path().filename());
    }
    std::sort(out.begin(), out.end());
    return out;
  }
};

// What the kernel does with a backed open's write: the bytes go to the backing file.
void kernel_write(int backing_fd, std::string_view bytes, uint64_t off = 0) {
  ASSERT_EQ(::pwrite(backing_fd, bytes.data(), bytes.size(), static_cast<off_t>(off)),
            static_cast<ssize_t>(bytes.size()));
}

}  // namespace

TEST(KernelWrites, ASavedFileIsWrittenByTheKernelAndSplitAtClose) {
  Mount m;
  const std::string bytes = test::consolidated(3);
  const fs::Ino d = m.ckpt();
  auto c = m.f->create(d, ".tmpQwErTy", 0644, O_RDWR | O_CREAT | O_EXCL);
  ASSERT_TRUE(c.ok()) << c.error().message;
  ASSERT_GE(c->open.backing_fd, 0);  // the kernel is handed the file to write
  kernel_write(c->open.backing_fd, bytes.substr(0, 1000));
  // A reader meanwhile is served from the same file (the kernel backs one inode by one file),
  // and sees what was written so far.
  auto r = m.f->open(c->entry.ino, O_RDONLY);
  ASSERT_TRUE(r.ok()) << r.error().message;
  ASSERT_GE(r->backing_fd, 0);
  char got[16] = {};
  ASSERT_EQ(::pread(r->backing_fd, got, sizeof got, 0), static_cast<ssize_t>(sizeof got));
  EXPECT_EQ(std::string_view(got, sizeof got), bytes.substr(0, sizeof got));
  EXPECT_EQ(m.f->getattr(c->entry.ino)->st_size, 1000);
  kernel_write(c->open.backing_fd, bytes.substr(1000), 1000);
  ASSERT_TRUE(m.f->rename(d, ".tmpQwErTy", d, "model.safetensors", 0).ok());
  auto st = m.f->flush(c->open.fh);
  ASSERT_TRUE(st.ok()) << st.error().message;
  EXPECT_TRUE(m.f->release(c->open.fh));  // a backed open: its backing file may be let go
  EXPECT_TRUE(m.f->release(r->fh));
  // Stored at close as its own one shard, and split into the two after it.
  EXPECT_EQ(m.read(m.lookup(d, "model.safetensors")), bytes);
  m.f->drain_splits();
  EXPECT_EQ(m.f->pending_splits(), 0u);
  EXPECT_EQ(m.src_names(), (std::vector<std::string>{".ckptfs", format::shard_file_name(1, 1, 1),
                                                     format::shard_file_name(2, 1, 1)}));
  EXPECT_EQ(m.read(m.lookup(d, "model.safetensors")), bytes);
}

TEST(KernelWrites, AWriteAfterAnotherDescriptorsCloseStoredTheFileFailsItsClose) {
  Mount m;
  const std::string bytes = test::consolidated(4);
  const fs::Ino d = m.ckpt();
  auto c = m.f->create(d, "model.safetensors", 0644, O_RDWR | O_CREAT | O_EXCL);
  ASSERT_TRUE(c.ok()) << c.error().message;
  ASSERT_GE(c->open.backing_fd, 0);
  kernel_write(c->open.backing_fd, bytes);
  // close() of one descriptor of the open file (a dup'd one stays): stored as rank shards
  // (once its split after close has run).
  ASSERT_TRUE(m.f->flush(c->open.fh).ok());
  m.f->drain_splits();
  EXPECT_EQ(m.read(m.lookup(d, "model.safetensors")), bytes);
  // A close with nothing written since says nothing new.
  EXPECT_TRUE(m.f->flush(c->open.fh).ok());
  // The dup writes on: the kernel puts the bytes in the removed backing file. Its close()
  // must not report them stored.
  kernel_write(c->open.backing_fd, "XXXX", 200);
  auto st = m.f->flush(c->open.fh);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.error().code, EIO);
  EXPECT_NE(st.error().message.find("model.safetensors"), std::string::npos) << st.error().message;
  m.f->release(c->open.fh);
  EXPECT_EQ(m.read(m.lookup(d, "model.safetensors")), bytes);  // what close() reported
}

TEST(KernelWrites, OtherFilesAreKeptAsTheKernelWroteThem) {
  Mount m;
  const fs::Ino d = m.ckpt();
  auto c = m.f->create(d, "trainer_state.json", 0644, O_RDWR | O_CREAT | O_EXCL);
  ASSERT_TRUE(c.ok()) << c.error().message;
  ASSERT_GE(c->open.backing_fd, 0);
  kernel_write(c->open.backing_fd, "{\"step\": 10}");
  ASSERT_TRUE(m.f->flush(c->open.fh).ok());
  m.f->release(c->open.fh);
  EXPECT_EQ(m.src_names(), (std::vector<std::string>{"trainer_state.json"}));
  EXPECT_EQ(m.read(m.lookup(d, "trainer_state.json")), "{\"step\": 10}");
  // Opened again for writing (no O_TRUNC): backed again, and the kernel's bytes kept.
  const fs::Ino ino = m.lookup(d, "trainer_state.json");
  auto w = m.f->open(ino, O_WRONLY);
  ASSERT_TRUE(w.ok()) << w.error().message;
  ASSERT_GE(w->backing_fd, 0);
  kernel_write(w->backing_fd, "{\"step\": 20}");
  ASSERT_TRUE(m.f->flush(w->fh).ok());
  m.f->release(w->fh);
  EXPECT_EQ(m.read(ino), "{\"step\": 20}");
}

TEST(KernelWrites, AWriterOfAFileBackedForReadingJoinsItsReaders) {
  // Plain files read backed (passthrough, the read-write default with write passthrough): the
  // kernel opens each backed open's own file from the inode's backing id, with that open's
  // flags, so a writer is backed beside the readers at once and they read what it writes.
  Mount m(/*backing_reads=*/true);
  {
    auto c = m.f->create(m.ckpt(), "notes.txt", 0644, O_RDWR | O_CREAT | O_EXCL);
    ASSERT_TRUE(c.ok());
    kernel_write(c->open.backing_fd, "hello");
    ASSERT_TRUE(m.f->flush(c->open.fh).ok());
    m.f->release(c->open.fh);
  }
  const fs::Ino ino = m.lookup(m.ckpt(), "notes.txt");
  auto r = m.f->open(ino, O_RDONLY);
  ASSERT_TRUE(r.ok());
  ASSERT_GE(r->backing_fd, 0);
  auto w = m.f->open(ino, O_WRONLY | O_TRUNC);
  ASSERT_TRUE(w.ok()) << w.error().message;
  ASSERT_GE(w->backing_fd, 0);  // backed: no wait, no ETXTBSY
  kernel_write(w->backing_fd, "HELLO again");
  // The reader's backing file is the same file in SRC.
  char buf[32] = {};
  ASSERT_EQ(::pread(r->backing_fd, buf, sizeof buf, 0), 11);
  EXPECT_EQ(std::string(buf, 11), "HELLO again");
  // A reader opened while it writes is backed too, and sees it through the write path.
  auto r2 = m.f->open(ino, O_RDONLY);
  ASSERT_TRUE(r2.ok());
  EXPECT_GE(r2->backing_fd, 0);
  ASSERT_TRUE(m.f->flush(w->fh).ok());
  m.f->release(w->fh);
  m.f->release(r->fh);
  m.f->release(r2->fh);
  EXPECT_EQ(m.read(ino), "HELLO again");
  std::ifstream in(m.path("ckpt/notes.txt"));
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), "HELLO again");
}

TEST(KernelWrites, AKernelThatRefusesTheBackingFileGetsRequestsFromThenOn) {
  Mount m;
  const std::string bytes = test::consolidated(5);
  const fs::Ino d = m.ckpt();
  auto c = m.f->create(d, "model.safetensors", 0644, O_RDWR | O_CREAT | O_EXCL);
  ASSERT_TRUE(c.ok());
  ASSERT_GE(c->open.backing_fd, 0);
  m.f->backing_refused(c->open.fh);  // Linux before 6.9: the ioctl failed
  // This file's bytes now come as WRITE requests, into its backing file; still split at close.
  for (size_t o = 0; o < bytes.size(); o += 4096) {
    ASSERT_TRUE(m.f->write(c->open.fh, o, std::string_view(bytes).substr(o, 4096)).ok());
  }
  ASSERT_TRUE(m.f->flush(c->open.fh).ok());
  EXPECT_FALSE(m.f->release(c->open.fh));
  EXPECT_EQ(m.read(m.lookup(d, "model.safetensors")), bytes);
  m.f->drain_splits();
  EXPECT_EQ(m.src_names().size(), 3u);  // .ckptfs and two shards
  // The next file is not offered to the kernel at all.
  auto c2 = m.f->create(d, "b.txt", 0644, O_RDWR | O_CREAT | O_EXCL);
  ASSERT_TRUE(c2.ok());
  EXPECT_EQ(c2->open.backing_fd, -1);
  m.f->release(c2->open.fh);
}

TEST(KernelWrites, AFileCutShortUnderAModelNameIsCutAtItsFirstHole) {
  // save_file sizes the file first (ftruncate), then writes: a writer that dies midway leaves
  // a file of the full size whose end was never written. It must never read as complete.
  Mount m;
  const std::string bytes = test::consolidated(6);
  const fs::Ino d = m.ckpt();
  auto c = m.f->create(d, "model.safetensors", 0644, O_RDWR | O_CREAT | O_EXCL);
  ASSERT_TRUE(c.ok());
  ASSERT_GE(c->open.backing_fd, 0);
  fs::SetAttr a;
  a.size = bytes.size();
  ASSERT_TRUE(m.f->setattr(c->entry.ino, a, c->open.fh).ok());  // ftruncate goes to the daemon
  const size_t half = (bytes.size() / 2) & ~size_t{4095};       // whole blocks: a real hole after
  kernel_write(c->open.backing_fd, bytes.substr(0, half));
  auto st = m.f->flush(c->open.fh);  // the kernel's close of a killed writer
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.error().code, EIO);
  EXPECT_NE(st.error().message.find("nothing written from byte"), std::string::npos)
      << st.error().message;
  m.f->release(c->open.fh);
  // Not split (the empty state directory is what guarded it while open).
  EXPECT_EQ(m.src_names(), (std::vector<std::string>{".ckptfs", "model.safetensors"}));
  EXPECT_EQ(stdfs::file_size(m.path("ckpt/model.safetensors")), half);
  EXPECT_EQ(m.read(m.lookup(d, "model.safetensors")), bytes.substr(0, half));
}

TEST(KernelWrites, AFileUnderAModelNameNeverClosedBeforeTheDaemonDiedIsRemoved) {
  Mount m;
  const std::string bytes = test::consolidated(7);
  pid_t pid = ::fork();
  if (pid == 0) {
    // The daemon dies while the kernel writes the file: no close, no destructor.
    auto c = m.f->create(m.ckpt(), "model.safetensors", 0644, O_RDWR | O_CREAT | O_EXCL);
    if (!c || c->open.backing_fd < 0) _exit(1);
    const std::string_view part = std::string_view(bytes).substr(0, bytes.size() / 2);
    if (::pwrite(c->open.backing_fd, part.data(), part.size(), 0) < 0) _exit(2);
    // And a file under another name, which is kept as written.
    auto o = m.f->create(m.ckpt(), "notes.txt", 0644, O_RDWR | O_CREAT | O_EXCL);
    if (!o || ::pwrite(o->open.backing_fd, "abc", 3, 0) != 3) _exit(3);
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  EXPECT_TRUE(stdfs::exists(m.path("ckpt/model.safetensors")));
  // The next look at the directory (a remount's) removes the file that was never stored.
  m.restart();
  const fs::Ino d = m.ckpt();
  auto gone = m.f->lookup(d, "model.safetensors");
  ASSERT_FALSE(gone.ok());
  EXPECT_EQ(gone.error().code, ENOENT);
  EXPECT_EQ(m.src_names(), (std::vector<std::string>{".ckptfs", "notes.txt"}));
  EXPECT_TRUE(stdfs::is_empty(m.path("ckpt/.ckptfs")));
  EXPECT_EQ(m.read(m.lookup(d, "notes.txt")), "abc");
}

TEST(KernelWrites, WithOneRankTheFileIsItsShardAndNoByteIsCopied) {
  Mount m(/*backing_reads=*/false, /*ranks=*/1);
  const std::string bytes = test::consolidated(8);
  const fs::Ino d = m.ckpt();
  auto c = m.f->create(d, ".tmpOne", 0640, O_RDWR | O_CREAT | O_EXCL);
  ASSERT_TRUE(c.ok()) << c.error().message;
  ASSERT_GE(c->open.backing_fd, 0);
  kernel_write(c->open.backing_fd, bytes);
  struct stat written {};
  ASSERT_EQ(::fstat(c->open.backing_fd, &written), 0);
  ASSERT_TRUE(m.f->rename(d, ".tmpOne", d, "model.safetensors", 0).ok());
  auto st = m.f->flush(c->open.fh);
  ASSERT_TRUE(st.ok()) << st.error().message;
  m.f->release(c->open.fh);
  const std::string shard = format::shard_file_name(1, 1, 1);
  EXPECT_EQ(m.src_names(), (std::vector<std::string>{".ckptfs", shard}));
  // The shard is the file the kernel wrote: the same inode, its bytes as written.
  struct stat sh {};
  ASSERT_EQ(::stat(m.path("ckpt/" + shard).c_str(), &sh), 0);
  EXPECT_EQ(sh.st_ino, written.st_ino);
  EXPECT_EQ(sh.st_nlink, 1u);
  EXPECT_EQ(sh.st_mode & 07777, 0640u);
  EXPECT_EQ(*read_small_file(m.path("ckpt/" + shard), 1 << 24), bytes);
  EXPECT_EQ(m.read(m.lookup(d, "model.safetensors")), bytes);
  // And a reader of SRC alone (the CLI, torch's HF reader) takes it as whole tensors.
  auto ck = source::load_checkpoint_path(m.path("ckpt"));
  ASSERT_TRUE(ck.ok());
  ASSERT_TRUE((*ck)->valid()) << (*ck)->problems[0].to_string();
  EXPECT_EQ((*ck)->outputs.size(), 1u);
}

namespace {

// One file written by the kernel into ckpt/model.safetensors and closed, driven on the write
// layer itself so that each step of its split after close runs when the test says.
struct AfterClose {
  test::TempDir dir;
  std::unique_ptr<flush::Flusher> flusher = flush::make_local_flusher();
  UniqueFd d;
  int fd = -1;  // the kernel's: the file as the writer writes it
  std::shared_ptr<write::WriteFile> wf;
  const std::string bytes = test::consolidated(11);
  AfterClose() {
    stdfs::create_directories(dir.path() + "/ckpt");
    d = std::move(open_at(AT_FDCWD, dir.path() + "/ckpt", O_RDONLY | O_DIRECTORY)).value();
    auto f = open_at(d.get(), "model.safetensors", O_RDWR | O_CREAT | O_EXCL, 0644);
    fd = f->get();
    write::PlanOptions plan;
    plan.ranks = 2;
    plan.split_after_close = true;
    wf = std::move(write::WriteFile::open(std::move(f).value(), d.get(), dir.path() + "/ckpt",
                                          /*fresh=*/true, *flusher, plan, "model.safetensors"))
             .value();
    EXPECT_TRUE(wf->kernel_writes());
    kernel_write(fd, bytes);
  }
  write::Place place() const {
    return {d.get(), "model.safetensors", dir.path() + "/ckpt", "ckpt"};
  }
  // Closes the file (stored as its one shard) and stages its split, not committed yet.
  void close_and_stage(std::optional<write::ResplitJob>& job,
                       std::optional<write::StagedResplit>& staged) {
    ASSERT_TRUE(wf->finalize(place()).ok());
    job = wf->take_resplit();
    ASSERT_TRUE(job.has_value());
    auto s = write::stage_resplit(*job, *flusher);
    ASSERT_TRUE(s.ok()) << s.error().message;
    staged = std::move(s).value();
  }
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& e : stdfs::directory_iterator(dir.path() + "/ckpt")) {
      out.push_back(e.path().filename());
    }
    std::sort(out.begin(), out.end());
    return out;
  }
  // What a new mount of SRC serves under the name.
  std::string served() {
    fs::Options o;
    o.settle = std::chrono::milliseconds(60'000);
    o.revalidate = std::chrono::milliseconds(0);
    auto f = std::move(fs::Filesystem::create(dir.path(), o)).value();
    auto c = f->lookup(fs::kRootIno, "ckpt");
    auto e = c ? f->lookup(c->ino, "model.safetensors") : Result<fs::EntryOut>(c.error());
    if (!e) return "(" + e.error().message + ")";
    auto h = f->open(e->ino, O_RDONLY);
    if (!h) return "(" + h.error().message + ")";
    auto r = f->reader(h->fh);
    std::string out(r->size(), '\0');
    auto n = r->read(0, out.size(), out.data());
    f->release(h->fh);
    return n ? out : "(" + n.error().message + ")";
  }
  bool staging_left() const {
    for (const auto& e : stdfs::directory_iterator(dir.path() + "/ckpt/.ckptfs")) {
      if (e.path().filename().string().starts_with("tx-")) return true;
    }
    return false;
  }
};

const std::string kOne = format::shard_file_name(1, 1, 1);
const std::string kTwo = format::shard_file_name(2, 1, 1);

}  // namespace

TEST(SplitAfterClose, CloseStoresTheFileAsItsOneShardAndTheSplitMakesTheRanksLater) {
  AfterClose a;
  ASSERT_TRUE(a.wf->finalize(a.place()).ok());
  EXPECT_EQ(a.wf->state(), write::WriteFile::State::Committed);
  // Stored at close: the file itself under its one shard's name, no byte copied.
  EXPECT_EQ(a.names(), (std::vector<std::string>{".ckptfs", kOne}));
  EXPECT_EQ(a.served(), a.bytes);
  auto job = a.wf->take_resplit();
  ASSERT_TRUE(job.has_value());
  EXPECT_FALSE(a.wf->take_resplit().has_value());  // taken once
  auto staged = write::stage_resplit(*job, *a.flusher);
  ASSERT_TRUE(staged.ok()) << staged.error().message;
  // Staged, not committed: a reader still gets the one shard.
  EXPECT_TRUE(a.staging_left());
  EXPECT_EQ(a.served(), a.bytes);
  auto names = write::commit_resplit(*job, std::move(*staged));
  ASSERT_TRUE(names.ok()) << names.error().message;
  EXPECT_EQ(names->size(), 3u);  // two shards and the record
  EXPECT_EQ(a.names(), (std::vector<std::string>{".ckptfs", kOne, kTwo}));
  EXPECT_FALSE(a.staging_left());
  EXPECT_EQ(a.served(), a.bytes);
  std::string got(a.bytes.size(), '\0');
  ASSERT_EQ(*a.wf->read(0, got.size(), got.data()), got.size());  // an open reader's view
  EXPECT_EQ(got, a.bytes);
}

TEST(SplitAfterClose, ANewSaveUnderTheNameBeforeTheSplitCommitsDropsTheSplit) {
  AfterClose a;
  std::optional<write::ResplitJob> job;
  std::optional<write::StagedResplit> staged;
  ASSERT_NO_FATAL_FAILURE(a.close_and_stage(job, staged));
  // Meanwhile a newer version is stored under the name (as its one shard).
  const std::string newer = test::consolidated(12);
  ASSERT_EQ(::unlinkat(a.d.get(), kOne.c_str(), 0), 0);
  test::write_file(a.dir.path() + "/ckpt/" + kOne, newer);
  auto names = write::commit_resplit(*job, std::move(*staged));
  ASSERT_TRUE(names.ok()) << names.error().message;
  EXPECT_TRUE(names->empty());
  EXPECT_FALSE(a.staging_left());
  EXPECT_EQ(a.names(), (std::vector<std::string>{".ckptfs", kOne}));
  EXPECT_EQ(*read_small_file(a.dir.path() + "/ckpt/" + kOne, 1 << 24), newer);
}

TEST(SplitAfterClose, AWriteThroughADupAfterCloseLeavesTheOneShardAsItIs) {
  AfterClose a;
  std::optional<write::ResplitJob> job;
  std::optional<write::StagedResplit> staged;
  ASSERT_NO_FATAL_FAILURE(a.close_and_stage(job, staged));
  kernel_write(a.fd, "XXXX", 200);  // into the stored shard, in place
  auto names = write::commit_resplit(*job, std::move(*staged));
  ASSERT_TRUE(names.ok()) << names.error().message;
  EXPECT_TRUE(names->empty());  // the split copied bytes the shard no longer holds
  EXPECT_EQ(a.names(), (std::vector<std::string>{".ckptfs", kOne}));
  EXPECT_FALSE(a.staging_left());
  // And that descriptor's close says so.
  auto st = a.wf->finalize(a.place());
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.error().code, EIO);
}

TEST(SplitAfterClose, ADaemonKilledDuringTheSplitLeavesTheOneShard) {
  AfterClose a;
  ASSERT_TRUE(a.wf->finalize(a.place()).ok());
  auto job = a.wf->take_resplit();
  ASSERT_TRUE(job.has_value());
  pid_t pid = ::fork();
  if (pid == 0) {  // the daemon stages the split and dies before its commit
    auto staged = write::stage_resplit(*job, *a.flusher);
    _exit(staged.ok() ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  EXPECT_TRUE(a.staging_left());
  // The next mount serves the one shard and removes the dead staging.
  EXPECT_EQ(a.served(), a.bytes);
  EXPECT_FALSE(a.staging_left());
  EXPECT_EQ(a.names(), (std::vector<std::string>{".ckptfs", kOne}));
}

TEST(SplitAfterClose, TheMountRunsTheSplitAndUnmountWaitsForIt) {
  Mount m(/*backing_reads=*/false, /*ranks=*/3);
  // The splits wait at the gate until the test opens it.
  std::mutex mu;
  std::condition_variable cv;
  bool open = false;
  m.opts.split_gate = [&] {
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return open; });
  };
  m.restart();
  std::vector<std::string> bytes;
  for (int i = 0; i < 3; ++i)
    bytes.push_back(test::consolidated(13 + i, 600, fmt::format("f{}.", i)));
  const fs::Ino d = m.ckpt();
  for (int i = 0; i < 3; ++i) {
    const std::string name = fmt::format("model-{:05d}-of-00003.safetensors", i + 1);
    auto c = m.f->create(d, name, 0644, O_RDWR | O_CREAT | O_EXCL);
    ASSERT_TRUE(c.ok()) << c.error().message;
    kernel_write(c->open.backing_fd, bytes[i]);
    auto st = m.f->flush(c->open.fh);
    ASSERT_TRUE(st.ok()) << st.error().message;
    m.f->release(c->open.fh);
    // Whatever the split has done by now, the name reads as closed.
    EXPECT_EQ(m.read(m.lookup(d, name)), bytes[i]);
  }
  // Closed, stored as one shard each, and the three splits pending.
  EXPECT_EQ(m.f->pending_splits(), 3u);
  EXPECT_NE(m.f->status_json().find("\"splits_pending\": 3"), std::string::npos)
      << m.f->status_json();
  EXPECT_EQ(m.src_names().size(), 1u + 3u);
  {
    std::lock_guard lock(mu);
    open = true;
  }
  cv.notify_all();
  m.f.reset();  // unmount: waits for the splits
  auto names = m.src_names();
  EXPECT_EQ(names.size(), 1u + 9u);
  for (uint32_t k = 1; k <= 3; ++k) {
    for (uint32_t r = 1; r <= 3; ++r) {
      EXPECT_TRUE(std::count(names.begin(), names.end(), format::shard_file_name(r, k, 3)))
          << r << " of " << k;
    }
  }
  m.restart();
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(m.read(m.lookup(m.ckpt(), fmt::format("model-{:05d}-of-00003.safetensors", i + 1))),
              bytes[i]);
  }
}

// Which directory a closed file may be stored as links of (write/dedup): torch's sharded/
// below it (a directory, never a symlink), else, for a directory named consolidated, the one
// above (NeMo's); nothing for any other name, or for SRC's root.
TEST(StoreOnce, TheOriginIsShardedBelowOrTheDirectoryAboveConsolidated) {
  test::TempDir t;
  namespace fsys = std::filesystem;
  fsys::create_directories(t.path() + "/out/sharded");
  fsys::create_directories(t.path() + "/model/consolidated");
  fsys::create_directories(t.path() + "/link");
  fsys::create_directory_symlink(t.path() + "/out/sharded", t.path() + "/link/sharded");
  auto at = [&](const std::string& rel) {
    auto fd = open_at(AT_FDCWD, t.path() + "/" + rel, O_RDONLY | O_DIRECTORY);
    EXPECT_TRUE(fd) << rel;
    return write::origin_of(fd->get(), rel);
  };
  EXPECT_EQ(at("out"), write::Origin::Below);
  EXPECT_EQ(at("model/consolidated"), write::Origin::Above);
  EXPECT_EQ(at("link"), write::Origin::None);   // a symlink named sharded is not followed
  EXPECT_EQ(at("model"), write::Origin::None);  // neither layout
  auto root = open_at(AT_FDCWD, t.path() + "/model", O_RDONLY | O_DIRECTORY);
  ASSERT_TRUE(root);
  EXPECT_EQ(write::origin_of(root->get(), ""), write::Origin::None);  // SRC's root: no parent
  EXPECT_EQ(write::origin_of(root->get(), "a/notconsolidated"), write::Origin::None);
  EXPECT_EQ(write::origin_of(root->get(), "consolidated"), write::Origin::Above);
}

// A shard that another directory stores a file as links of (torch's OUT/ of OUT/sharded/),
// about to be written again: opened in place it gives the stored file a copy first
// (unshare_stored); truncated, its own name gets a new empty file instead and nothing is copied
// (detach_truncated). Either way the stored file keeps its bytes. Nothing is done where the
// other name is another file, or the other directory holds no state of this daemon's.
TEST(StoreOnce, ATruncatedShardGetsANewFileTheStoredOneKeepsItsBytes) {
  test::TempDir t;
  namespace fsys = std::filesystem;
  const std::string shard = format::shard_file_name(1, 1, 1);
  fsys::create_directories(t.path() + "/out/sharded");
  const std::string below = t.path() + "/out/sharded/" + shard, above = t.path() + "/out/" + shard;
  test::write_file(below, "stored bytes");
  ASSERT_EQ(::chmod(below.c_str(), 0640), 0);
  ASSERT_EQ(::link(below.c_str(), above.c_str()), 0);
  auto out = open_at(AT_FDCWD, t.path() + "/out", O_RDONLY | O_DIRECTORY);
  auto sharded = open_at(AT_FDCWD, t.path() + "/out/sharded", O_RDONLY | O_DIRECTORY);
  ASSERT_TRUE(out && sharded);
  struct stat st {};
  ASSERT_EQ(::stat(below.c_str(), &st), 0);
  // No state of this daemon's above: not its link.
  auto none = write::detach_truncated(out->get(), sharded->get(), shard, st, below);
  ASSERT_TRUE(none.ok()) << none.error().message;
  EXPECT_FALSE(*none);
  ASSERT_EQ(::mkdir((t.path() + "/out/" + std::string(format::kStateDirName)).c_str(), 0700), 0);
  // Another file under the name above: nothing to do either.
  struct stat other = st;
  other.st_ino += 1;
  auto not_it = write::detach_truncated(out->get(), sharded->get(), shard, other, below);
  ASSERT_TRUE(not_it.ok());
  EXPECT_FALSE(*not_it);
  auto done = write::detach_truncated(out->get(), sharded->get(), shard, st, below);
  ASSERT_TRUE(done.ok()) << done.error().message;
  EXPECT_TRUE(*done);
  struct stat a {
  }, b{};
  ASSERT_EQ(::stat(above.c_str(), &a), 0);
  ASSERT_EQ(::stat(below.c_str(), &b), 0);
  EXPECT_EQ(a.st_ino, st.st_ino);  // the stored file is the same inode, with its bytes
  EXPECT_EQ(a.st_nlink, 1U);
  std::ifstream in(above, std::ios::binary);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), "stored bytes");
  EXPECT_NE(b.st_ino, st.st_ino);  // the truncated name: a new empty file, its mode kept
  EXPECT_EQ(b.st_size, 0);
  EXPECT_EQ(b.st_mode & 07777, 0640U);
  EXPECT_EQ(fsys::directory_iterator(t.path() + "/out/" + std::string(format::kStateDirName)),
            fsys::directory_iterator());  // no temporary left
}
