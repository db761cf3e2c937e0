// test_write_path: fs::WritePath as a component, made from its Deps alone (no Filesystem): a
// file opened, written and closed under a model name is stored as rank shards and the kernel
// told; a rename onto a model name of a directory of other files' shards is refused for a file
// the view would hide and stores one that fits, and one whose store fails is undone, the file it
// replaced put back; its splits after close (fs::Resplits).
#include <gtest/gtest.h>

#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <mutex>
#include <optional>
#include <set>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "../../src/fs/dir_views.hpp"
#include "../../src/fs/write_path.hpp"
#include "ckptfs/flush/flusher.hpp"
#include "ckptfs/format/names.hpp"
#include "ckptfs/util/fd.hpp"
#include "fixture.hpp"
#include "notice_recorder.hpp"

using namespace ckptfs;
namespace stdfs = std::filesystem;

namespace {

using Recorder = test::NoticeRecorder;

struct Parts {
  test::TempDir src;
  std::shared_ptr<fs::ManualClock> clock = std::make_shared<fs::ManualClock>();
  fs::Options o;
  UniqueFd root;
  fs::NodeTable nodes;
  source::HeaderCache headers;
  std::unique_ptr<flush::Flusher> flusher = flush::make_local_flusher();
  Recorder rec;
  std::unique_ptr<fs::WritePath> wp;

  explicit Parts(uint64_t write_memory = 256ull << 20) {
    o.clock = clock;
    o.ranks = 2;
    o.write_memory = write_memory;
    stdfs::create_directories(src.path() + "/ck");
    stdfs::create_directories(src.path() + "/other");
    root.reset(::open(src.path().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    struct stat st {};
    ::fstat(root.get(), &st);
    fs::Node r;
    r.ino = fs::kRootIno;
    r.key = fs::real_key(st);
    r.kind = fs::Kind::Dir;
    r.nlookup = 1;
    nodes.set_root(std::move(r));
    wp = std::make_unique<fs::WritePath>(
        fs::WritePath::Deps{o, src.path(), root.get(), clock, *flusher, nodes, headers});
    wp->set_notifier(&rec);
  }
  // Directory `rel`, open, as the write path takes it.
  std::pair<UniqueFd, fs::WriteDir> dir(const std::string& rel) {
    UniqueFd fd(::openat(root.get(), rel.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    struct stat st {};
    ::fstat(fd.get(), &st);
    fs::WriteDir d{fd.get(),
                   static_cast<uint64_t>(st.st_dev),
                   static_cast<uint64_t>(st.st_ino),
                   rel,
                   st.st_uid,
                   st.st_gid};
    return {std::move(fd), d};
  }
  // The node the kernel holds for file `rel`, looked up as `name` in directory inode `parent`.
  fs::Ino node_of(const std::string& rel, fs::Ino parent, const std::string& name) {
    struct stat st {};
    EXPECT_EQ(::fstatat(root.get(), rel.c_str(), &st, 0), 0);
    fs::Node proto;
    proto.kind = fs::Kind::File;
    proto.rel = rel;
    proto.dev = static_cast<uint64_t>(st.st_dev);
    proto.bino = static_cast<uint64_t>(st.st_ino);
    return nodes.remember(fs::real_key(st), proto, parent, name).ino;
  }
  std::set<std::string> listing(const std::string& rel) const {
    std::set<std::string> out;
    for (const auto& e : stdfs::directory_iterator(src.path() + "/" + rel)) {
      out.insert(e.path().filename().string());
    }
    return out;
  }
};

TEST(WritePath, AComponentMadeFromItsDepsAlone) {
  Parts p;
  auto [ck_fd, ck] = p.dir("ck");
  const fs::Ino ck_ino = 5;
  const std::string first = "model-00001-of-00002.safetensors";
  const std::string second = "model-00002-of-00002.safetensors";

  // Written and closed under a model name: stored as rank shards, its name gone from SRC.
  UniqueFd f(::openat(ck.fd, first.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
  ASSERT_GE(f.get(), 0);
  const fs::Ino ino = p.node_of("ck/" + first, ck_ino, first);
  auto wf = p.wp->start(std::move(f), ck, first, true);
  ASSERT_TRUE(wf.ok()) << wf.error().message;
  (*wf)->writers.fetch_add(1);  // a handle holds it, as adopt_writer's does
  const std::string bytes = test::consolidated(1, 96, "a.");
  ASSERT_TRUE((*wf)->write(0, bytes).ok());
  struct stat fst {};
  ASSERT_EQ(::fstatat(ck.fd, first.c_str(), &fst, 0), 0);
  EXPECT_TRUE(p.wp->registry().being_written(static_cast<uint64_t>(fst.st_dev),
                                             static_cast<uint64_t>(fst.st_ino)));
  EXPECT_TRUE(p.wp->open_in({ck.dev, ck.ino}));
  ASSERT_TRUE(p.wp->close(ino, **wf).ok());
  EXPECT_EQ((*wf)->state(), write::WriteFile::State::Committed);
  (*wf)->writers.fetch_sub(1);
  (*wf).reset();  // its handle released
  EXPECT_FALSE(p.wp->open_in({ck.dev, ck.ino}));
  const auto after = p.listing("ck");
  EXPECT_EQ(after.count(first), 0u) << "committed: the shards are the file now";
  EXPECT_EQ(std::count_if(after.begin(), after.end(),
                          [](const std::string& n) { return format::looks_like_shard_name(n); }),
            2)
      << fmt::format("{}", fmt::join(after, " "));
  // The kernel's entry held the file as it was being written: dropped, and the node retired.
  EXPECT_EQ(p.rec.entries.count({ck_ino, first}), 1u);
  auto node = p.nodes.get(ino);
  ASSERT_TRUE(node.has_value());
  EXPECT_TRUE(node->retired);

  // Onto the second model name, among the first file's shards: bytes that are no safetensors
  // file would be hidden there, and are refused before anything moves.
  auto [other_fd, other] = p.dir("other");
  test::write_file(p.src.path() + "/other/notes.bin", std::string(100, 'x'));
  struct stat nst {};
  ASSERT_EQ(::fstatat(other.fd, "notes.bin", &nst, 0), 0);
  auto refused = p.wp->may_rename_onto(other, "notes.bin", nst, ck, second);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.error().code, EINVAL);
  EXPECT_NE(refused.error().message.find("would be hidden"), std::string::npos)
      << refused.error().message;
  // A consolidated file that fits passes, and once moved is stored as shards at once.
  test::write_file(p.src.path() + "/other/b.safetensors", test::consolidated(2, 40, "b."));
  struct stat bst {};
  ASSERT_EQ(::fstatat(other.fd, "b.safetensors", &bst, 0), 0);
  auto ok = p.wp->may_rename_onto(other, "b.safetensors", bst, ck, second);
  ASSERT_TRUE(ok.ok()) << ok.error().message;
  ASSERT_EQ(::renameat(other.fd, "b.safetensors", ck.fd, second.c_str()), 0);
  std::optional<fs::WritePath::Replaced> none;
  auto stored = p.wp->store_renamed(other, 6, "b.safetensors", ck, ck_ino, second, none);
  ASSERT_TRUE(stored.ok()) << stored.error().message;
  const auto both = p.listing("ck");
  EXPECT_EQ(both.count(second), 0u) << "stored at the rename: the name is its shards";
  EXPECT_EQ(std::count_if(both.begin(), both.end(),
                          [](const std::string& n) { return format::looks_like_shard_name(n); }),
            4);
  EXPECT_EQ(p.rec.entries.count({ck_ino, second}), 1u);
  EXPECT_EQ(p.wp->open_files(), 0u);
  EXPECT_FALSE(p.wp->open_in({ck.dev, ck.ino}));
}

// The bytes of file `path`.
std::string contents(const std::string& path) {
  std::string out;
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  char buf[4096];
  for (ssize_t n; fd.get() >= 0 && (n = ::read(fd.get(), buf, sizeof buf)) > 0;) {
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

// The scratch files left in directory `rel`'s state directory.
size_t scratch_files(const Parts& p, const std::string& rel) {
  const std::string state = p.src.path() + "/" + rel + "/" + std::string(format::kStateDirName);
  if (!stdfs::exists(state)) return 0;
  size_t n = 0;
  for (const auto& e : stdfs::directory_iterator(state)) {
    n += e.path().filename().string().starts_with(format::kScratchPrefix) ? 1 : 0;
  }
  return n;
}

// A rename onto a model name whose store then fails (here the write memory is too small for
// any file's header and shard plan: ENOMEM, as when other files hold it) is undone and changes
// no name: the file it replaced, a file closed under that name, is put back, not lost (the
// write fuzz's seed 3306847844 read the version stored before it). One that is stored lets
// the replaced file go, and its node is retired.
TEST(WritePath, ARenameWhoseStoreFailsPutsBackTheFileItReplaced) {
  for (const bool fails : {true, false}) {
    SCOPED_TRACE(fails ? "the store fails" : "the store succeeds");
    Parts p(fails ? 64 : 256ull << 20);
    auto [ck_fd, ck] = p.dir("ck");
    auto [other_fd, other] = p.dir("other");
    const fs::Ino ck_ino = 5, other_ino = 6;
    // The first file's rank shards, stored by a write path with the memory to split it.
    fs::Options big = p.o;
    big.write_memory = 256ull << 20;
    fs::WritePath setup(fs::WritePath::Deps{big, p.src.path(), p.root.get(), p.clock, *p.flusher,
                                            p.nodes, p.headers});
    const std::string first = "model-00001-of-00002.safetensors";
    test::write_file(p.src.path() + "/other/a.safetensors", test::consolidated(1, 96, "a."));
    ASSERT_EQ(::renameat(other.fd, "a.safetensors", ck.fd, first.c_str()), 0);
    std::optional<fs::WritePath::Replaced> none;
    ASSERT_TRUE(
        setup.store_renamed(other, other_ino, "a.safetensors", ck, ck_ino, first, none).ok());
    ASSERT_FALSE(stdfs::exists(p.src.path() + "/ck/" + first)) << "stored as rank shards";
    // The second name holds a file closed there that is no safetensors file (kept whole, as a
    // hostile file kept for its writer is): what the rename replaces.
    const std::string name = "model-00002-of-00002.safetensors";
    const std::string was = "closed under the name, read back as it is";
    test::write_file(p.src.path() + "/ck/" + name, was);
    const fs::Ino victim = p.node_of("ck/" + name, ck_ino, name);
    const std::string moved = test::consolidated(2, 40, "b.");
    test::write_file(p.src.path() + "/other/b.safetensors", moved);

    auto kept = p.wp->keep_replaced(ck, ck_ino, name);
    ASSERT_TRUE(kept.ok()) << kept.error().message;
    ASSERT_TRUE(kept->has_value());
    EXPECT_EQ(scratch_files(p, "ck"), 1u) << "kept as a link in ck/.ckptfs";
    ASSERT_EQ(::renameat(other.fd, "b.safetensors", ck.fd, name.c_str()), 0);
    p.nodes.renamed(other_ino, "b.safetensors", "other/b.safetensors", ck_ino, name, "ck/" + name,
                    false);
    auto stored = p.wp->store_renamed(other, other_ino, "b.safetensors", ck, ck_ino, name, *kept);
    kept->reset();  // the rename's end
    EXPECT_EQ(scratch_files(p, "ck"), 0u);
    auto node = p.nodes.get(victim);
    ASSERT_TRUE(node.has_value());
    if (fails) {
      ASSERT_FALSE(stored.ok());
      EXPECT_EQ(stored.error().code, ENOMEM) << stored.error().message;
      EXPECT_EQ(contents(p.src.path() + "/ck/" + name), was) << "the replaced file is back";
      EXPECT_EQ(contents(p.src.path() + "/other/b.safetensors"), moved) << "and the file too";
      EXPECT_FALSE(node->retired);
      EXPECT_EQ(node->rel, "ck/" + name);
      auto kid = p.nodes.child(ck_ino, name);
      ASSERT_TRUE(kid.has_value());
      EXPECT_EQ(kid->ino, victim);
    } else {
      ASSERT_TRUE(stored.ok()) << stored.error().message;
      EXPECT_FALSE(stdfs::exists(p.src.path() + "/other/b.safetensors"));
      EXPECT_FALSE(stdfs::exists(p.src.path() + "/ck/" + name)) << "stored as rank shards";
      const auto files = p.listing("ck");
      EXPECT_EQ(
          std::count_if(files.begin(), files.end(),
                        [](const std::string& n) { return format::looks_like_shard_name(n); }),
          4);
      EXPECT_TRUE(node->retired) << "its last link went with the rename";
    }
  }
}

}  // namespace

// fs::Resplits, the splits after close: with two workers, the splits of two files run at
// once; two splits of one file never do, and run in the order queued; unmount (the
// destructor) runs what is queued. No sleeps: the jobs hold at a gate until released.
namespace {

struct Gate {
  std::mutex mu;  // guards running, peak, order, open
  std::condition_variable cv;
  int running = 0, peak = 0;
  std::vector<uint64_t> order;  // each job's inode, as it starts
  bool open = false;
  // Waits until `pred` holds (true), or fails after 10 s (false): a hang is a failure.
  template <class P>
  bool wait(P pred) {
    std::unique_lock lock(mu);
    return cv.wait_for(lock, std::chrono::seconds(10), pred);
  }
  void release() {
    {
      std::lock_guard lock(mu);
      open = true;
    }
    cv.notify_all();
  }
  void run(write::ResplitJob& j) {
    std::unique_lock lock(mu);
    order.push_back(static_cast<uint64_t>(j.ino));
    peak = std::max(peak, ++running);
    cv.notify_all();
    cv.wait(lock, [&] { return open; });
    --running;
    cv.notify_all();
  }
};

// Opens the gate when it goes: a failed assertion never leaves a job waiting forever (the
// Resplits declared before it would wait for that job).
struct Releaser {
  Gate& g;
  ~Releaser() { g.release(); }
};

write::ResplitJob job_of(uint64_t ino) {
  write::ResplitJob j;
  j.dev = 1;
  j.ino = static_cast<ino_t>(ino);
  return j;
}

}  // namespace

TEST(Resplits, TwoFilesAtOnceOneFileInTurn) {
  Gate g;
  {
    fs::Resplits r([&](write::ResplitJob& j) { g.run(j); }, 2);
    Releaser releaser{g};
    EXPECT_EQ(r.workers(), 2u);
    r.post(job_of(7));
    r.post(job_of(7));  // the same file again: waits for the first
    r.post(job_of(8));
    // Both workers busy: file 7's first split and file 8's, not 7's second.
    ASSERT_TRUE(g.wait([&] { return g.running == 2; })) << g.running;
    EXPECT_EQ(r.pending(), 3u);
    EXPECT_EQ(r.running(), 2u);
    {
      std::lock_guard lock(g.mu);
      EXPECT_EQ(g.order, (std::vector<uint64_t>{7, 8}));
    }
    g.release();
    r.drain();
    EXPECT_EQ(r.pending(), 0u);
  }
  EXPECT_EQ(g.order, (std::vector<uint64_t>{7, 8, 7}));
  EXPECT_EQ(g.peak, 2);
}

TEST(Resplits, OneWorkerRunsOneAtATimeAndUnmountRunsWhatIsQueued) {
  Gate g;
  {
    fs::Resplits r([&](write::ResplitJob& j) { g.run(j); }, 1);
    Releaser releaser{g};  // released, and at once destroyed: the destructor waits for all three
    for (uint64_t i = 1; i <= 3; ++i) r.post(job_of(i));
    ASSERT_TRUE(g.wait([&] { return g.running == 1; }));
  }
  EXPECT_EQ(g.order, (std::vector<uint64_t>{1, 2, 3}));
  EXPECT_EQ(g.peak, 1);
  EXPECT_GE(fs::Resplits::default_workers(), 1u);
  EXPECT_LE(fs::Resplits::default_workers(), 4u);
}
