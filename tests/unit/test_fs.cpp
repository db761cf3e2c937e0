// Filesystem semantics, driven directly (no kernel mount): what directories show, inode
// stability, reads through plans, live revalidation and version consistency.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <filesystem>
#include <future>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include <nlohmann/json.hpp>

#include "../../src/fs/dir_views.hpp"
#include "ckptfs/flush/flusher.hpp"
#include "ckptfs/format/names.hpp"
#include "ckptfs/fs/filesystem.hpp"
#include "ckptfs/fs/writers.hpp"
#include "ckptfs/util/fd.hpp"
#include "fixture.hpp"
#include "notice_recorder.hpp"

using namespace ckptfs;
using format::DType;
using test::ChunkSpec;
using test::ShardSpec;

namespace {

namespace stdfs = std::filesystem;

using Recorder = test::NoticeRecorder;

// Writes a 2-rank, row-sharded checkpoint of one F32 tensor "w" [4, 2] with `fill` bytes.
void write_ckpt(const std::string& dir, char fill, bool atomic = false) {
  for (int r = 0; r < 2; ++r) {
    ChunkSpec c{"w",    DType::F32,   {uint64_t(r) * 2, 0},
                {2, 2}, std::nullopt, std::string(16, static_cast<char>(fill + r))};
    auto bytes = test::make_shard_bytes(ShardSpec{format::shard_file_name(r + 1, 1, 1), {c}});
    auto path = dir + "/" + format::shard_file_name(r + 1, 1, 1);
    if (atomic) {
      test::write_file(path + ".tmp", bytes);
      stdfs::rename(path + ".tmp", path);
    } else {
      test::write_file(path, bytes);
    }
  }
}

std::vector<std::string> names(fs::Filesystem& f, fs::Ino dir) {
  auto dh = f.opendir(dir);
  EXPECT_TRUE(dh.ok()) << dh.error().message;
  std::vector<std::string> out;
  if (!dh) return out;
  EXPECT_TRUE(f.readdir(*dh, 0, [&](const fs::DirEntryOut& e, uint64_t) {
                 if (e.name != "." && e.name != "..") out.push_back(e.name);
                 return true;
               }).ok());
  f.releasedir(*dh);
  return out;
}

std::string read_all(fs::Filesystem& f, fs::Ino ino) {
  auto o = f.open(ino, O_RDONLY);
  EXPECT_TRUE(o.ok()) << o.error().message;
  if (!o) return {};
  auto r = f.reader(o->fh);
  std::string out(r->size(), '\0');
  auto n = r->read(0, out.size(), out.data());
  EXPECT_TRUE(n.ok()) << n.error().message;
  f.release(o->fh);
  return out;
}

struct Fs {
  test::TempDir dir;
  std::unique_ptr<fs::Filesystem> f;
  Recorder rec;
  explicit Fs(fs::Options o = {}) {
    o.settle = std::chrono::milliseconds(0);
    o.revalidate = std::chrono::milliseconds(0);
    stdfs::create_directories(dir.path() + "/run/step_1/model");
    write_ckpt(dir.path() + "/run/step_1/model", 'a');
    test::write_file(dir.path() + "/run/step_1/model/.hf_metadata/config.json", "{\"x\":1}");
    test::write_file(dir.path() + "/run/step_1/model/.hf_metadata/fqn_to_file_index_mapping.json",
                     "{\"w\":1}");
    test::write_file(dir.path() + "/run/notes.txt", "hello");
    auto r = fs::Filesystem::create(dir.path(), o);
    EXPECT_TRUE(r.ok());
    f = std::move(r).value();
    f->set_notifier(&rec);
  }
  fs::Ino walk(const std::vector<std::string>& path) {
    fs::Ino ino = fs::kRootIno;
    for (const auto& p : path) {
      auto e = f->lookup(ino, p);
      EXPECT_TRUE(e.ok()) << p << ": " << e.error().message;
      if (!e) return 0;
      ino = e->ino;
    }
    return ino;
  }
};

}  // namespace

TEST(Fs, CheckpointDirectoryShowsConsolidatedView) {
  Fs t;
  fs::Ino model = t.walk({"run", "step_1", "model"});
  auto listing = names(*t.f, model);
  EXPECT_EQ(listing, (std::vector<std::string>{"config.json", "model-00001-of-00001.safetensors",
                                               "model.safetensors.index.json"}));
  // Shards, the mapping file and .hf_metadata are hidden; lookups agree with the listing.
  EXPECT_EQ(t.f->lookup(model, format::shard_file_name(1, 1, 1)).error().code, ENOENT);
  EXPECT_EQ(t.f->lookup(model, ".hf_metadata").error().code, ENOENT);
  EXPECT_EQ(t.f->lookup(model, "fqn_to_file_index_mapping.json").error().code, ENOENT);
  EXPECT_EQ(t.f->lookup(model, ".shards").error().code, ENOENT);
  fs::Ino cfg = t.walk({"run", "step_1", "model", "config.json"});
  EXPECT_EQ(read_all(*t.f, cfg), "{\"x\":1}");
  // A plain directory is mirrored.
  fs::Ino run = t.walk({"run"});
  EXPECT_EQ(names(*t.f, run), (std::vector<std::string>{"notes.txt", "step_1"}));
}

TEST(Fs, ConsolidatedBytesAndAttributes) {
  Fs t;
  fs::Ino file = t.walk({"run", "step_1", "model", "model-00001-of-00001.safetensors"});
  auto attr = t.f->getattr(file);
  ASSERT_TRUE(attr.ok());
  std::string bytes = read_all(*t.f, file);
  EXPECT_EQ(static_cast<uint64_t>(attr->st_size), bytes.size());
  EXPECT_EQ(attr->st_mode, S_IFREG | 0444);    // the shards are 0644: read bits only
  EXPECT_NE(attr->st_ino & (1ull << 63), 0u);  // synthesized: never a backing number
  // The number readdir gives is the one stat gives.
  fs::Ino model = t.walk({"run", "step_1", "model"});
  auto dh = t.f->opendir(model);
  ASSERT_TRUE(dh.ok());
  uint64_t listed = 0;
  ASSERT_TRUE(t.f->readdir(*dh, 0,
                           [&](const fs::DirEntryOut& e, uint64_t) {
                             if (e.name == "model-00001-of-00001.safetensors") listed = e.ino;
                             return true;
                           })
                  .ok());
  t.f->releasedir(*dh);
  EXPECT_EQ(listed, attr->st_ino);
  auto h = format::parse_file_bytes(bytes, "view");
  ASSERT_TRUE(h.ok()) << h.error().message;
  ASSERT_EQ(h->tensors.size(), 1u);
  EXPECT_EQ(h->tensors[0].shape, (std::vector<uint64_t>{4, 2}));
  EXPECT_EQ(bytes.substr(h->data_start()), std::string(16, 'a') + std::string(16, 'b'));
  EXPECT_EQ(*h->find_metadata("format"), "pt");
  // The plan of a sub-range points into the shards with at most one run per chunk.
  auto o = t.f->open(file, O_RDONLY);
  ASSERT_TRUE(o.ok());
  EXPECT_TRUE(o->keep_cache);
  fs::ReadPlan plan;
  ASSERT_TRUE(t.f->read(o->fh, h->data_start() + 8, 16, plan).ok());
  ASSERT_EQ(plan.segs.size(), 2u);
  EXPECT_EQ(plan.size, 16u);
  t.f->release(o->fh);
  fs::Ino idx = t.walk({"run", "step_1", "model", "model.safetensors.index.json"});
  EXPECT_NE(read_all(*t.f, idx).find("\"w\": \"model-00001-of-00001.safetensors\""),
            std::string::npos);
}

TEST(Fs, InodesAreStableAndForgettable) {
  Fs t;
  fs::Ino a = t.walk({"run", "notes.txt"});
  fs::Ino b = t.walk({"run", "notes.txt"});
  EXPECT_EQ(a, b);
  const auto shown = t.f->getattr(a)->st_ino;
  struct stat backing {};
  ASSERT_EQ(::stat((t.dir.path() + "/run/notes.txt").c_str(), &backing), 0);
  EXPECT_EQ(shown, backing.st_ino);  // the backing number, on the source's own device
  fs::Ino v1 = t.walk({"run", "step_1", "model", "model-00001-of-00001.safetensors"});
  fs::Ino v2 = t.walk({"run", "step_1", "model", "model-00001-of-00001.safetensors"});
  EXPECT_EQ(v1, v2);
  const auto before = t.f->counts();
  t.f->forget(a, 2);
  const auto after = t.f->counts();
  EXPECT_EQ(after.nodes, before.nodes - 1);
  EXPECT_EQ(after.keys, before.keys - 1);  // the number is retired with the node
  EXPECT_EQ(t.f->getattr(a).error().code, ESTALE);
  fs::Ino again = t.walk({"run", "notes.txt"});
  EXPECT_NE(again, a);                            // node ids are never reused...
  EXPECT_EQ(t.f->getattr(again)->st_ino, shown);  // ...but st_ino is stable
}

TEST(Fs, ForgottenDirectoriesDropTheirViews) {
  Fs t;
  fs::Ino step = t.walk({"run", "step_1"});
  fs::Ino model = t.walk({"run", "step_1", "model"});
  ASSERT_EQ(names(*t.f, model).size(), 3u);
  const auto before = t.f->counts();
  t.f->forget(model, 1);
  t.f->forget(step, 2);  // looked up by both walks
  const auto after = t.f->counts();
  EXPECT_LT(after.dirs, before.dirs);
  EXPECT_EQ(after.keys, before.keys - 2);
  EXPECT_GT(before.header_bytes, 0u);
  EXPECT_EQ(after.header_bytes, 0u);  // its shards' headers went with it
  // Looked up again, the view is rebuilt (from the header cache) and still complete.
  EXPECT_EQ(names(*t.f, t.walk({"run", "step_1", "model"})).size(), 3u);
}

TEST(Fs, RewrittenShardMakesANewVersionAndOpenFilesKeepTheOld) {
  Fs t;
  fs::Ino model = t.walk({"run", "step_1", "model"});
  fs::Ino v1 = t.walk({"run", "step_1", "model", "model-00001-of-00001.safetensors"});
  auto o = t.f->open(v1, O_RDONLY);
  ASSERT_TRUE(o.ok());
  auto reader = t.f->reader(o->fh);
  std::string before(reader->size(), '\0');
  ASSERT_TRUE(reader->read(0, before.size(), before.data()).ok());

  write_ckpt(t.dir.path() + "/run/step_1/model", 'x', /*atomic=*/true);
  t.rec.entries.clear();
  fs::Ino v2 = t.walk({"run", "step_1", "model", "model-00001-of-00001.safetensors"});
  EXPECT_NE(v1, v2);
  EXPECT_TRUE(t.rec.entries.count({model, "model-00001-of-00001.safetensors"}));
  EXPECT_TRUE(t.rec.inodes.count(model));
  std::string after = read_all(*t.f, v2);
  EXPECT_NE(before, after);
  EXPECT_NE(after.find(std::string(16, 'x')), std::string::npos);
  // The old handle still reads the old version, byte for byte.
  std::string again(reader->size(), '\0');
  ASSERT_TRUE(reader->read(0, again.size(), again.data()).ok());
  EXPECT_EQ(again, before);
  t.f->release(o->fh);
}

TEST(Fs, OpeningAStaleVersionIsEstale) {
  Fs t;
  fs::Ino v1 = t.walk({"run", "step_1", "model", "model-00001-of-00001.safetensors"});
  write_ckpt(t.dir.path() + "/run/step_1/model", 'y', /*atomic=*/true);
  auto o = t.f->open(v1, O_RDONLY);
  ASSERT_FALSE(o.ok());
  EXPECT_EQ(o.error().code, ESTALE);
}

TEST(Fs, BrokenCheckpointIsNeverShownAsComplete) {
  Fs t;
  auto model = t.dir.path() + "/run/step_1/model";
  stdfs::remove(model + "/" + format::shard_file_name(2, 1, 1));
  // A missing tail rank is invisible from shard metadata alone, but the mapping file lists
  // every tensor, so drop a middle chunk instead: write rank 3 so rank 2 is a gap.
  ChunkSpec c{"w", DType::F32, {4, 0}, {2, 2}, std::nullopt, std::string(16, 'c')};
  test::write_file(model + "/" + format::shard_file_name(3, 1, 1),
                   test::make_shard_bytes(ShardSpec{format::shard_file_name(3, 1, 1), {c}}));
  fs::Ino dir = t.walk({"run", "step_1", "model"});
  EXPECT_EQ(names(*t.f, dir), (std::vector<std::string>{"config.json"}));
  EXPECT_EQ(t.f->lookup(dir, "model-00001-of-00001.safetensors").error().code, ENOENT);
  EXPECT_EQ(t.f->lookup(dir, "model.safetensors.index.json").error().code, ENOENT);
  // The rest of the tree still works.
  EXPECT_EQ(read_all(*t.f, t.walk({"run", "notes.txt"})), "hello");
}

TEST(Fs, TruncatedShardHidesTheCheckpointUntilComplete) {
  Fs t;
  auto path = t.dir.path() + "/run/step_1/model/" + format::shard_file_name(2, 1, 1);
  auto full = stdfs::file_size(path);
  stdfs::resize_file(path, full - 5);
  fs::Ino dir = t.walk({"run", "step_1", "model"});
  EXPECT_EQ(t.f->lookup(dir, "model-00001-of-00001.safetensors").error().code, ENOENT);
  write_ckpt(t.dir.path() + "/run/step_1/model", 'a');
  EXPECT_TRUE(t.f->lookup(dir, "model-00001-of-00001.safetensors").ok());
}

namespace {

// A filesystem over `root`, which holds the checkpoint directory "ck", revalidating on every
// access and showing a checkpoint once quiet for `settle`; with the inode of "ck".
// `clock`: the time it reads (null: the system's).
std::pair<std::unique_ptr<fs::Filesystem>, fs::Ino> settle_fs(
    const std::string& root, std::chrono::milliseconds settle,
    std::shared_ptr<const fs::Clock> clock = nullptr) {
  fs::Options o;
  o.settle = settle;
  o.revalidate = std::chrono::milliseconds(0);
  o.clock = std::move(clock);
  auto f = fs::Filesystem::create(root, o);
  EXPECT_TRUE(f.ok());
  if (!f) return {};
  auto ck = (*f)->lookup(fs::kRootIno, "ck");
  EXPECT_TRUE(ck.ok());
  return {std::move(f).value(), ck ? ck->ino : 0};
}

}  // namespace

namespace {

constexpr const char* kModel = "model-00001-of-00001.safetensors";

// Sets a file's mtime to now (a change with the same bytes, seen by no inotify close).
void touch(const std::string& path) {
  ASSERT_EQ(::utimensat(AT_FDCWD, path.c_str(), nullptr, 0), 0);
}

bool listed(fs::Filesystem& f, fs::Ino dir, const std::string& name) {
  auto l = names(f, dir);
  return std::find(l.begin(), l.end(), name) != l.end();
}

// Polls a listing until `name` shows (true) or `secs` pass (false).
bool shows_within(fs::Filesystem& f, fs::Ino dir, const std::string& name, int secs) {
  for (int i = 0; i < secs * 100; ++i) {
    if (listed(f, dir, name)) return true;
    ::usleep(10000);
  }
  return false;
}

}  // namespace

TEST(Fs, ACheckpointCompleteAtFirstSightShowsAtOnce) {
  // The train -> mount -> load flow: the shards were written a moment ago, then the daemon
  // started. Complete and unchanged since the daemon first looked: no settle wait (an hour here).
  test::TempDir d;
  write_ckpt(d.path() + "/ck", 'a');
  auto [f, ck] = settle_fs(d.path(), std::chrono::hours(1));
  ASSERT_TRUE(f && ck);
  EXPECT_TRUE(f->lookup(ck, kModel).ok());
  EXPECT_EQ(names(*f, ck), (std::vector<std::string>{kModel, "model.safetensors.index.json"}));
}

TEST(Fs, AShardChangedWithoutACloseSettlesAndSaysSo) {
  test::TempDir d;
  write_ckpt(d.path() + "/ck", 'a');
  auto [f, ck] = settle_fs(d.path(), std::chrono::hours(1));
  ASSERT_TRUE(f && ck);
  ASSERT_TRUE(f->lookup(ck, kModel).ok());
  // A change no writer's close accounts for (another node's write, a touch): settle applies.
  touch(d.path() + "/ck/" + format::shard_file_name(2, 1, 1));
  auto l = names(*f, ck);
  EXPECT_EQ(l, (std::vector<std::string>{".ckptfs-pending"}));
  auto p = f->lookup(ck, ".ckptfs-pending");
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->attr.st_mode, S_IFREG | 0444);
  std::string why = read_all(*f, p->ino);
  EXPECT_NE(why.find("changed less than 3600 s ago"), std::string::npos) << why;
  EXPECT_EQ(f->open(p->ino, O_WRONLY).error().code, EACCES);
}

TEST(Fs, ALookupWaitsForTheSettleTimeInsteadOfAnsweringEnoent) {
  test::TempDir d;
  write_ckpt(d.path() + "/ck", 'a');
  // The settle time passes on a manual clock: the lookup's wait moves it, nothing sleeps.
  auto clock = std::make_shared<fs::ManualClock>();
  auto [f, ck] = settle_fs(d.path(), std::chrono::milliseconds(300), clock);
  ASSERT_TRUE(f && ck);
  ASSERT_TRUE(f->lookup(ck, kModel).ok());
  touch(d.path() + "/ck/" + format::shard_file_name(1, 1, 1));
  ASSERT_TRUE(listed(*f, ck, ".ckptfs-pending"));
  const auto t0 = clock->now();
  auto e = f->lookup(ck, kModel);
  const auto waited = clock->now() - t0;
  EXPECT_TRUE(e.ok()) << e.error().message;
  EXPECT_GE(waited, std::chrono::milliseconds(100)) << "answered before the checkpoint settled";
  EXPECT_FALSE(listed(*f, ck, ".ckptfs-pending"));
}

TEST(Fs, AShardClosedByItsWriterShowsAtOnce) {
  // Shards written while the daemon watches: each is complete when its writer closes it, and
  // the checkpoint shows then, not a settle time (an hour here) later.
  test::TempDir d;
  stdfs::create_directories(d.path() + "/ck");
  auto [f, ck] = settle_fs(d.path(), std::chrono::hours(1));
  ASSERT_TRUE(f && ck);
  EXPECT_TRUE(names(*f, ck).empty());  // first look: nothing yet
  write_ckpt(d.path() + "/ck", 'a');
  EXPECT_TRUE(shows_within(*f, ck, kModel, 10)) << "not shown after every writer closed";

  // A writer that still has a shard open after changing it holds the checkpoint back.
  const std::string shard = d.path() + "/ck/" + format::shard_file_name(2, 1, 1);
  auto bytes = read_small_file(shard, 1 << 20);
  ASSERT_TRUE(bytes.ok());
  struct stat closed_at {};
  ASSERT_EQ(::stat(shard.c_str(), &closed_at), 0);
  UniqueFd fd(::open(shard.c_str(), O_WRONLY));
  ASSERT_TRUE(fd.valid());
  ASSERT_EQ(::pwrite(fd.get(), bytes->data(), bytes->size(), 0),
            static_cast<ssize_t>(bytes->size()));
  // The mtime set back to the last close's: only the watcher's record that a writer has the
  // shard open (its modify event) holds the checkpoint back, not a later mtime than the close.
  const struct timespec back[2] = {closed_at.st_atim, closed_at.st_mtim};
  ASSERT_EQ(::futimens(fd.get(), back), 0);
  ::usleep(100000);  // the watcher's thread has seen the write
  EXPECT_FALSE(listed(*f, ck, kModel)) << "shown while a writer had a shard open";
  EXPECT_TRUE(listed(*f, ck, ".ckptfs-pending"));
  fd.reset();
  EXPECT_TRUE(shows_within(*f, ck, kModel, 10)) << "not shown after the writer closed";
}

TEST(Fs, AnIncompleteCheckpointWhoseShardsAreClosedIsNotPending) {
  // A rank died: its shard is missing. The others are closed and quiet, so nothing is pending
  // and nothing consolidated shows.
  test::TempDir d;
  stdfs::create_directories(d.path() + "/ck");
  auto [f, ck] = settle_fs(d.path(), std::chrono::hours(1));
  ASSERT_TRUE(f && ck);
  EXPECT_TRUE(names(*f, ck).empty());
  ChunkSpec c{"w", DType::F32, {2, 0}, {2, 2}, std::nullopt, std::string(16, 'x')};
  test::write_file(d.path() + "/ck/" + format::shard_file_name(2, 1, 1),
                   test::make_shard_bytes(ShardSpec{format::shard_file_name(2, 1, 1), {c}}));
  bool quiet = false;
  for (int i = 0; i < 500 && !quiet; ++i, ::usleep(10000)) quiet = names(*f, ck).empty();
  EXPECT_TRUE(quiet) << "still pending after the writer closed";
  EXPECT_EQ(f->lookup(ck, kModel).error().code, ENOENT);
}

TEST(Fs, ShardsFolderShowsHiddenFiles) {
  fs::Options o;
  o.show_shards = true;
  Fs t(o);
  fs::Ino shards = t.walk({"run", "step_1", "model", ".shards"});
  EXPECT_EQ(names(*t.f, shards), (std::vector<std::string>{format::shard_file_name(1, 1, 1),
                                                           format::shard_file_name(2, 1, 1)}));
  fs::Ino s1 = t.walk({"run", "step_1", "model", ".shards", format::shard_file_name(1, 1, 1)});
  std::string got = read_all(*t.f, s1);
  auto want = read_small_file(
      t.dir.path() + "/run/step_1/model/" + format::shard_file_name(1, 1, 1), 1 << 20);
  ASSERT_TRUE(want.ok());
  EXPECT_EQ(got, *want);
  EXPECT_EQ(t.f->lookup(shards, "config.json").error().code, ENOENT);
}

TEST(Fs, ReadOnlyViewRefusesEveryChangeWithErofs) {
  fs::Options o;
  o.read_only = true;
  Fs t(o);
  fs::Ino run = t.walk({"run"});
  fs::Ino notes = t.walk({"run", "notes.txt"});
  EXPECT_EQ(t.f->open(notes, O_WRONLY).error().code, EROFS);
  EXPECT_EQ(t.f->open(notes, O_RDWR).error().code, EROFS);
  EXPECT_EQ(t.f->open(notes, O_RDONLY | O_TRUNC).error().code, EROFS);
  EXPECT_EQ(t.f->unlink(run, "notes.txt").error().code, EROFS);
  EXPECT_EQ(t.f->create(run, "new.txt", 0644, O_WRONLY).error().code, EROFS);
  EXPECT_EQ(t.f->mkdir(run, "d", 0755).error().code, EROFS);
  EXPECT_EQ(t.f->rename(run, "notes.txt", run, "n2.txt", 0).error().code, EROFS);
  fs::SetAttr a;
  a.mode = 0600;
  EXPECT_EQ(t.f->setattr(notes, a).error().code, EROFS);
  EXPECT_TRUE(stdfs::exists(t.dir.path() + "/run/notes.txt"));
  EXPECT_FALSE(stdfs::exists(t.dir.path() + "/run/new.txt"));
}

TEST(Fs, ReplacedPassthroughFileIsStale) {
  Fs t;
  fs::Ino notes = t.walk({"run", "notes.txt"});
  test::write_file(t.dir.path() + "/run/notes.txt.new", "other");
  stdfs::rename(t.dir.path() + "/run/notes.txt.new", t.dir.path() + "/run/notes.txt");
  EXPECT_EQ(t.f->getattr(notes).error().code, ESTALE);
  fs::Ino fresh = t.walk({"run", "notes.txt"});
  EXPECT_NE(fresh, notes);
  EXPECT_EQ(read_all(*t.f, fresh), "other");
}

// FUSE passthrough (Options::backing): the kernel refuses one inode open backed and cached at
// once, so the daemon decides per inode.
TEST(Fs, PlainFilesOpenBackedAndAWriterMeetsETXTBSY) {
  fs::Options o;
  o.backing = true;
  o.backing_grace = std::chrono::milliseconds(0);
  Fs t(o);
  fs::Ino notes = t.walk({"run", "notes.txt"});
  auto a = t.f->open(notes, O_RDONLY);
  ASSERT_TRUE(a.ok()) << a.error().message;
  ASSERT_GE(a->backing_fd, 0);
  EXPECT_FALSE(a->keep_cache);  // the kernel refuses keep_cache beside passthrough
  char buf[8] = {};
  ASSERT_EQ(::pread(a->backing_fd, buf, sizeof buf, 0), 5);  // the file in SRC itself
  EXPECT_EQ(std::string(buf, 5), "hello");
  auto b = t.f->open(notes, O_RDONLY);
  ASSERT_TRUE(b.ok());
  EXPECT_GE(b->backing_fd, 0);
  auto w = t.f->open(notes, O_WRONLY);
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.error().code, ETXTBSY);
  EXPECT_NE(w.error().message.find("run/notes.txt"), std::string::npos) << w.error().message;
  EXPECT_TRUE(t.f->release(a->fh));
  EXPECT_TRUE(t.f->release(b->fh));
  // Every backed reader released: the write opens, and readers now share its page cache.
  auto w2 = t.f->open(notes, O_WRONLY);
  ASSERT_TRUE(w2.ok()) << w2.error().message;
  auto c = t.f->open(notes, O_RDONLY);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->backing_fd, -1);
  EXPECT_FALSE(t.f->release(c->fh));
  EXPECT_FALSE(t.f->release(w2->fh));
  auto d = t.f->open(notes, O_RDONLY);
  ASSERT_TRUE(d.ok());
  EXPECT_GE(d->backing_fd, 0);
  // The kernel could not back it: cached after all, and a writer is no longer refused.
  t.f->backing_refused(d->fh);
  auto w3 = t.f->open(notes, O_WRONLY);
  ASSERT_TRUE(w3.ok()) << w3.error().message;
  EXPECT_FALSE(t.f->release(d->fh));
  EXPECT_FALSE(t.f->release(w3->fh));
}

TEST(Fs, AWriterWaitsForTheReleaseOfABackedReaderThatClosed) {
  fs::Options o;
  o.backing = true;
  o.backing_grace = std::chrono::seconds(30);
  Fs t(o);
  fs::Ino notes = t.walk({"run", "notes.txt"});
  auto a = t.f->open(notes, O_RDONLY);
  ASSERT_TRUE(a.ok());
  ASSERT_GE(a->backing_fd, 0);
  // The kernel sends RELEASE after close(2) returned: a write open arriving first waits.
  std::thread release([&] { t.f->release(a->fh); });
  auto w = t.f->open(notes, O_WRONLY);
  release.join();
  ASSERT_TRUE(w.ok()) << w.error().message;
  t.f->release(w->fh);
}

TEST(Fs, SyntheticFilesAndDefaultMountsAreNeverBacked) {
  {
    Fs t;  // backing off (a read-write mount's default)
    auto a = t.f->open(t.walk({"run", "notes.txt"}), O_RDONLY);
    ASSERT_TRUE(a.ok());
    EXPECT_EQ(a->backing_fd, -1);
    t.f->release(a->fh);
  }
  fs::Options o;
  o.backing = true;
  Fs t(o);
  auto v =
      t.f->open(t.walk({"run", "step_1", "model", "model-00001-of-00001.safetensors"}), O_RDONLY);
  ASSERT_TRUE(v.ok()) << v.error().message;
  EXPECT_EQ(v->backing_fd, -1);  // synthesized: no file holds these bytes at these offsets
  EXPECT_TRUE(v->keep_cache);
  EXPECT_FALSE(t.f->release(v->fh));
}

TEST(Fs, SymlinksArePassedThroughNotFollowed) {
  Fs t;
  stdfs::create_symlink("/etc/passwd", t.dir.path() + "/run/link");
  fs::Ino l = t.walk({"run", "link"});
  auto attr = t.f->getattr(l);
  ASSERT_TRUE(attr.ok());
  EXPECT_TRUE(S_ISLNK(attr->st_mode));
  EXPECT_EQ(*t.f->readlink(l), "/etc/passwd");
  EXPECT_FALSE(t.f->open(l, O_RDONLY).ok());
}

TEST(Fs, NamesThatCouldEscapeAreRefused) {
  Fs t;
  EXPECT_FALSE(t.f->lookup(fs::kRootIno, "..").ok());
  EXPECT_FALSE(t.f->lookup(fs::kRootIno, "a/b").ok());
  EXPECT_FALSE(t.f->lookup(fs::kRootIno, "").ok());
}

TEST(Fs, ShardFdsAreBoundedByTheFdLimit) {
  struct rlimit saved {};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &saved), 0);
  struct rlimit low = saved;
  low.rlim_cur = 17;  // the reserve is a quarter of the limit but at least 16: one shard fd
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &low), 0);
  Fs t;  // two-shard checkpoint
  ::setrlimit(RLIMIT_NOFILE, &saved);
  fs::Ino file = t.walk({"run", "step_1", "model", "model-00001-of-00001.safetensors"});
  auto o = t.f->open(file, O_RDONLY);
  ASSERT_FALSE(o.ok());
  EXPECT_EQ(o.error().code, ENFILE);  // the daemon's limit, not the reader's
}

TEST(Fs, TheFdReserveScalesWithASmallLimit) {
  struct rlimit saved {};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &saved), 0);
  struct rlimit low = saved;
  low.rlim_cur = 64;  // a fixed reserve of 256 left no shard fd at all here
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &low), 0);
  Fs t;
  ::setrlimit(RLIMIT_NOFILE, &saved);
  fs::Ino file = t.walk({"run", "step_1", "model", "model-00001-of-00001.safetensors"});
  auto o = t.f->open(file, O_RDONLY);
  ASSERT_TRUE(o.ok()) << o.error().message;
  t.f->release(o->fh);
}

// --- hostile sources ----------------------------------------------------------------------

TEST(Fs, ConsolidatedFilesAreNoMoreReadableThanTheirShards) {
  Fs t;
  const auto dir = t.dir.path() + "/run/step_1/model/";
  ::chmod((dir + format::shard_file_name(1, 1, 1)).c_str(), 0600);
  ::chown((dir + format::shard_file_name(1, 1, 1)).c_str(), 1000, 1000);
  ::chown((dir + format::shard_file_name(2, 1, 1)).c_str(), 1000, 1000);
  fs::Ino file = t.walk({"run", "step_1", "model", "model-00001-of-00001.safetensors"});
  fs::Ino idx = t.walk({"run", "step_1", "model", "model.safetensors.index.json"});
  auto attr = t.f->getattr(file);
  ASSERT_TRUE(attr.ok());
  EXPECT_EQ(attr->st_mode, S_IFREG | 0400);
  EXPECT_EQ(attr->st_uid, 1000u);
  EXPECT_EQ(t.f->getattr(idx)->st_mode, S_IFREG | 0400);
  // errno of an open by `who` (0 when it opens).
  auto open_as = [&](fs::Ino ino, fs::Caller who) {
    auto o = t.f->open(ino, O_RDONLY, who);
    if (!o) return o.error().code;
    t.f->release(o->fh);
    return 0;
  };
  // The owner of every shard reads; anyone else, even in the group, is refused.
  EXPECT_EQ(open_as(file, {1000, 1000, {}}), 0);
  EXPECT_EQ(open_as(file, {1001, 1000, {}}), EACCES);
  EXPECT_EQ(open_as(idx, {1001, 1000, {}}), EACCES);
  EXPECT_EQ(open_as(file, {65534, 65534, {1000}}), EACCES);
  EXPECT_EQ(open_as(file, {0, 0, {}}), 0);
  // Shards of two owners, each readable by its owner only: nobody but root reads the whole.
  ::chown((dir + format::shard_file_name(2, 1, 1)).c_str(), 1001, 1000);
  ::chmod((dir + format::shard_file_name(2, 1, 1)).c_str(), 0600);
  file = t.walk({"run", "step_1", "model", "model-00001-of-00001.safetensors"});
  attr = t.f->getattr(file);
  ASSERT_TRUE(attr.ok());
  EXPECT_EQ(attr->st_mode & 0777, 0u);
  EXPECT_EQ(open_as(file, {1000, 1000, {}}), EACCES);
  EXPECT_EQ(open_as(file, {1001, 1000, {}}), EACCES);
  EXPECT_EQ(open_as(file, {0, 0, {}}), 0);
  // Group-readable shards of one group: a member reads through a supplementary group.
  ::chmod((dir + format::shard_file_name(1, 1, 1)).c_str(), 0640);
  ::chmod((dir + format::shard_file_name(2, 1, 1)).c_str(), 0640);
  file = t.walk({"run", "step_1", "model", "model-00001-of-00001.safetensors"});
  EXPECT_EQ(t.f->getattr(file)->st_mode & 0777, 0040u);
  EXPECT_EQ(open_as(file, {2000, 2000, {7, 1000}}), 0);
  EXPECT_EQ(open_as(file, {2000, 2000, {7}}), EACCES);
}

TEST(Fs, AStrayShardLikeNameDoesNotMakeACheckpoint) {
  Fs t;
  const auto dir = t.dir.path() + "/hf";
  test::write_file(dir + "/model.safetensors", "not parsed by the view");
  test::write_file(dir + "/config.json", "{}");
  stdfs::create_symlink("nowhere", dir + "/" + format::shard_file_name(1, 1, 1));
  stdfs::create_directory(dir + "/" + format::shard_file_name(2, 1, 1));
  test::write_file(dir + "/shard-x.safetensors", "x");
  fs::Ino hf = t.walk({"hf"});
  EXPECT_EQ(names(*t.f, hf),
            (std::vector<std::string>{"config.json", "model.safetensors",
                                      format::shard_file_name(1, 1, 1),
                                      format::shard_file_name(2, 1, 1), "shard-x.safetensors"}));
  EXPECT_EQ(read_all(*t.f, t.walk({"hf", "model.safetensors"})), "not parsed by the view");
  // In a real checkpoint directory, a symlink named like a shard makes it invalid (a rank
  // that is not a regular file cannot be served), and it stays hidden.
  stdfs::create_symlink("nowhere",
                        t.dir.path() + "/run/step_1/model/" + format::shard_file_name(3, 1, 1));
  fs::Ino model = t.walk({"run", "step_1", "model"});
  EXPECT_EQ(names(*t.f, model), (std::vector<std::string>{"config.json"}));
}

TEST(Fs, ARealShardsFolderIsListedOnceAndStaysReachable) {
  fs::Options o;
  o.show_shards = true;
  Fs t(o);
  test::write_file(t.dir.path() + "/run/step_1/model/.shards/mine.txt", "mine");
  fs::Ino model = t.walk({"run", "step_1", "model"});
  auto listing = names(*t.f, model);
  EXPECT_EQ(std::count(listing.begin(), listing.end(), ".shards"), 1);
  fs::Ino mine = t.walk({"run", "step_1", "model", ".shards", ".shards", "mine.txt"});
  EXPECT_EQ(read_all(*t.f, mine), "mine");
}

TEST(Fs, TimesBefore1970AreShownAsTheyAre) {
  Fs t;
  const auto path = t.dir.path() + "/run/old.txt";
  test::write_file(path, "old");
  struct timespec times[2] = {{-100000, 250}, {-100000, 250}};
  ASSERT_EQ(::utimensat(AT_FDCWD, path.c_str(), times, 0), 0);
  auto attr = t.f->getattr(t.walk({"run", "old.txt"}));
  ASSERT_TRUE(attr.ok());
  EXPECT_EQ(attr->st_mtim.tv_sec, -100000);
  EXPECT_EQ(attr->st_mtim.tv_nsec, 250);
  // A checkpoint whose shards are all older than 1970 keeps their time too.
  const auto dir = t.dir.path() + "/run/step_1/model/";
  for (const auto& input : {format::shard_file_name(1, 1, 1), format::shard_file_name(2, 1, 1),
                            std::string(".hf_metadata/fqn_to_file_index_mapping.json")}) {
    ASSERT_EQ(::utimensat(AT_FDCWD, (dir + input).c_str(), times, 0), 0);
  }
  ASSERT_EQ(::utimensat(AT_FDCWD, dir.c_str(), times, 0), 0);
  auto file = t.f->getattr(t.walk({"run", "step_1", "model", "model-00001-of-00001.safetensors"}));
  ASSERT_TRUE(file.ok());
  EXPECT_LT(file->st_mtim.tv_sec, 0);
  EXPECT_GE(file->st_mtim.tv_nsec, 0);
}

TEST(Fs, AShardStampedInTheFutureSettlesByObservation) {
  test::TempDir d;
  write_ckpt(d.path() + "/ck", 'a');
  auto clock = std::make_shared<fs::ManualClock>();
  auto [f, ck] = settle_fs(d.path(), std::chrono::milliseconds(200), clock);
  ASSERT_TRUE(f && ck);
  ASSERT_TRUE(f->lookup(ck, "model-00001-of-00001.safetensors").ok());
  struct timespec future[2] = {{::time(nullptr) + 7200, 0}, {::time(nullptr) + 7200, 0}};
  ASSERT_EQ(::utimensat(AT_FDCWD, (d.path() + "/ck/" + format::shard_file_name(1, 1, 1)).c_str(),
                        future, 0),
            0);
  // Not shown at once (it may still be being written)...
  EXPECT_FALSE(listed(*f, ck, "model-00001-of-00001.safetensors"));
  // ...nor just before the settle time has passed while watched...
  clock->advance(std::chrono::milliseconds(150));
  EXPECT_FALSE(listed(*f, ck, "model-00001-of-00001.safetensors"));
  // ...but once nothing changed for `settle` while watched, not two hours later.
  clock->advance(std::chrono::milliseconds(50));
  EXPECT_TRUE(listed(*f, ck, "model-00001-of-00001.safetensors"));
}

namespace {

// A close watch the test drives: closed() says what the test set, and the test calls on_close
// as inotify's thread would.
struct FakeWatch final : fs::CloseWatch {
  struct Shared {
    fs::CloseWatch::OnClose on_close;
    std::set<std::string> closed;
    int watched = 0;
  };
  explicit FakeWatch(std::shared_ptr<Shared> s) : s(std::move(s)) {}
  bool watch(int, uint64_t, uint64_t) override {
    ++s->watched;
    return true;
  }
  bool closed(uint64_t, uint64_t, const std::string& name, int64_t) const override {
    return s->closed.count(name) > 0;
  }
  std::shared_ptr<Shared> s;
};

}  // namespace

TEST(Fs, TheCloseWatchDecidesWhenAShardIsClosed) {
  // The close watch passed in through Options: a checkpoint whose shards changed shows once the
  // watch says every shard's writer closed it, not a settle time (an hour here) later, and a
  // close it reports makes the directory look again at once (revalidation is an hour too).
  test::TempDir d;
  stdfs::create_directories(d.path() + "/ck");
  auto watch = std::make_shared<FakeWatch::Shared>();
  fs::Options o;
  o.settle = std::chrono::hours(1);
  o.revalidate = std::chrono::hours(1);
  o.close_watch = [watch](fs::CloseWatch::OnClose on_close) {
    watch->on_close = std::move(on_close);
    return std::make_unique<FakeWatch>(watch);
  };
  auto made = fs::Filesystem::create(d.path(), o);
  ASSERT_TRUE(made.ok());
  auto& f = **made;
  auto ck = f.lookup(fs::kRootIno, "ck");
  ASSERT_TRUE(ck.ok());
  EXPECT_TRUE(names(f, ck->ino).empty());
  EXPECT_EQ(watch->watched, 2);  // the root and ck, each at its first check
  ASSERT_TRUE(watch->on_close);
  write_ckpt(d.path() + "/ck", 'a');
  const auto dev = static_cast<uint64_t>(ck->attr.st_dev);
  struct stat st {};
  ASSERT_EQ(::stat((d.path() + "/ck").c_str(), &st), 0);
  // A close of one shard only: pending.
  watch->closed = {format::shard_file_name(1, 1, 1)};
  watch->on_close(dev, static_cast<uint64_t>(st.st_ino));
  EXPECT_FALSE(listed(f, ck->ino, kModel));
  EXPECT_TRUE(listed(f, ck->ino, ".ckptfs-pending"));
  // Both closed: shown.
  watch->closed.insert(format::shard_file_name(2, 1, 1));
  watch->on_close(dev, static_cast<uint64_t>(st.st_ino));
  EXPECT_TRUE(listed(f, ck->ino, kModel));
}

TEST(Fs, AnUnknownHandleIsEbadf) {
  Fs t;
  constexpr uint64_t kNone = 0x12345;
  fs::ReadPlan plan;
  const auto add = [](const fs::DirEntryOut&, uint64_t) { return true; };
  EXPECT_EQ(t.f->read(kNone, 0, 10, plan).error().code, EBADF);
  EXPECT_EQ(t.f->write(kNone, 0, "x").error().code, EBADF);
  EXPECT_EQ(t.f->flush(kNone).error().code, EBADF);
  EXPECT_EQ(t.f->fsync(kNone, false).error().code, EBADF);
  EXPECT_EQ(t.f->getattr_handle(kNone).error().code, EBADF);
  EXPECT_EQ(t.f->readdir(kNone, 0, add).error().code, EBADF);
  EXPECT_EQ(t.f->reader(kNone), nullptr);
  t.f->release(kNone);  // nothing to release
  t.f->releasedir(kNone);
  // A directory handle is no file handle, and a released one is no handle at all.
  auto dh = t.f->opendir(fs::kRootIno);
  ASSERT_TRUE(dh.ok());
  EXPECT_EQ(t.f->read(*dh, 0, 10, plan).error().code, EBADF);
  EXPECT_TRUE(t.f->readdir(*dh, 0, add).ok());
  t.f->releasedir(*dh);
  EXPECT_EQ(t.f->readdir(*dh, 0, add).error().code, EBADF);
  fs::Ino notes = t.walk({"run", "notes.txt"});
  auto o = t.f->open(notes, O_RDONLY);
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(t.f->readdir(o->fh, 0, add).error().code, EBADF);
  t.f->release(o->fh);
  EXPECT_EQ(t.f->read(o->fh, 0, 10, plan).error().code, EBADF);
}

TEST(Fs, ASpliceOfAShrunkenShardIsAnError) {
  Fs t;
  fs::Ino file = t.walk({"run", "step_1", "model", "model-00001-of-00001.safetensors"});
  auto o = t.f->open(file, O_RDONLY);
  ASSERT_TRUE(o.ok());
  auto size = t.f->reader(o->fh)->size();
  fs::ReadPlan plan;
  ASSERT_TRUE(t.f->read(o->fh, 0, size, plan).ok());
  EXPECT_TRUE(fs::check_extents(plan).ok());
  // Only plans of shard bytes as they lie are spliced.
  ASSERT_TRUE(fs::splice_ready(plan).ok());
  EXPECT_TRUE(*fs::splice_ready(plan));
  // A segment that converts or picks at a stride exists only once gathered.
  fs::ReadPlan strided = plan;
  for (auto& s : strided.segs) {
    if (!s.is_memory()) {
      s.stride = 4;
      s.esize = 2;
      break;
    }
  }
  ASSERT_TRUE(strided.has_transformed());
  EXPECT_FALSE(*fs::splice_ready(strided));
  // More than 16 segments: copied (fuse_reply_data's vector stays small).
  fs::ReadPlan many = plan;
  while (many.segs.size() <= 16) many.segs.push_back(many.segs.back());
  EXPECT_FALSE(*fs::splice_ready(many));
  // A node-local shard (no fd here): its owner reads it.
  fs::ReadPlan remote = plan;
  const std::vector<int> none(plan.src.fds.size(), -1);
  remote.src.fds = none;
  EXPECT_FALSE(*fs::splice_ready(remote));
  const auto shard = t.dir.path() + "/run/step_1/model/" + format::shard_file_name(2, 1, 1);
  stdfs::resize_file(shard, stdfs::file_size(shard) - 4);
  auto st = fs::check_extents(plan);
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.error().code, EIO);
  EXPECT_NE(st.error().message.find(format::shard_file_name(2, 1, 1)), std::string::npos);
  // The adapter's one question before splicing asks the same.
  auto ready = fs::splice_ready(plan);
  ASSERT_FALSE(ready.ok());
  EXPECT_EQ(ready.error().code, EIO);
  t.f->release(o->fh);
}

TEST(Fs, AFifoShardNeverBlocks) {
  Fs t;
  const auto dir = t.dir.path() + "/run/step_1/model/";
  // Swapped in after the view was built: the open refuses it instead of waiting for a writer.
  fs::Ino file = t.walk({"run", "step_1", "model", "model-00001-of-00001.safetensors"});
  stdfs::remove(dir + format::shard_file_name(2, 1, 1));
  ASSERT_EQ(::mkfifo((dir + format::shard_file_name(2, 1, 1)).c_str(), 0644), 0);
  ::alarm(10);  // a regression blocks in open(2): fail loudly instead of hanging
  auto o = t.f->open(file, O_RDONLY);
  EXPECT_FALSE(o.ok());
  // And the rebuilt view reads no FIFO either: the checkpoint is invalid, not hung.
  fs::Ino model = t.walk({"run", "step_1", "model"});
  EXPECT_EQ(names(*t.f, model), (std::vector<std::string>{"config.json"}));
  ::alarm(0);
}

TEST(Fs, OnlyTheModelsNamesAndTheListingReadHeaders) {
  Fs t;
  // The checkpoint directory's attributes and its other names come from a listing alone: a
  // slow or hostile header must not stall every path through the directory.
  fs::Ino model = t.walk({"run", "step_1", "model"});
  ASSERT_TRUE(t.f->getattr(model).ok());
  EXPECT_EQ(t.f->lookup(model, format::shard_file_name(1, 1, 1)).error().code, ENOENT);
  EXPECT_EQ(t.f->counts().header_bytes, 0u);
  // config.json needs the model too (issue 33: it is hidden where the tensors keep a trainer's
  // own names no map serves, so from_pretrained cannot build random weights): headers are read.
  EXPECT_EQ(read_all(*t.f, t.walk({"run", "step_1", "model", "config.json"})), "{\"x\":1}");
  const auto after_config = t.f->counts().header_bytes;
  EXPECT_GT(after_config, 0u);
  // A consolidated name needs the model: the headers were read once and are cached.
  ASSERT_TRUE(t.f->lookup(model, "model-00001-of-00001.safetensors").ok());
  EXPECT_EQ(t.f->counts().header_bytes, after_config);
}

TEST(Fs, HandlesTheKernelNeverReleasedAreFreedWithTheFilesystem) {
  // RELEASE is asynchronous: a signal or an unmount can end the daemon with handles open.
  // The Filesystem owns them: its end closes every descriptor they hold (counted here, in any
  // build) and frees their memory (the ASan+UBSan run of this suite, detect_leaks=1).
  auto open_fds = [] {
    size_t n = 0;
    for ([[maybe_unused]] const auto& e : stdfs::directory_iterator("/proc/self/fd")) ++n;
    return n;
  };
  const size_t before = open_fds();
  {
    Fs t;
    auto o =
        t.f->open(t.walk({"run", "step_1", "model", "model-00001-of-00001.safetensors"}), O_RDONLY);
    ASSERT_TRUE(o.ok());
    auto dh = t.f->opendir(t.walk({"run"}));
    ASSERT_TRUE(dh.ok());
    EXPECT_GT(t.f->reader(o->fh)->size(), 0u);
    EXPECT_GE(open_fds(), before + 2);  // the shard's descriptor and the directory's, at least
  }
  EXPECT_EQ(open_fds(), before);
}

TEST(Fs, AListingTellsTheKernelToDropNamesGoneFromTheSource) {
  // Steps deleted in SRC behind the kernel's back stay in its cache, and with them their nodes
  // and views in the daemon, until something tells it: the parent's next listing does.
  Fs t;
  fs::Ino run = t.walk({"run"});
  t.walk({"run", "step_1", "model", "model-00001-of-00001.safetensors"});
  t.walk({"run", "notes.txt"});
  stdfs::create_directories(t.dir.path() + "/run/step_2");
  t.walk({"run", "step_2"});
  t.rec.entries.clear();
  names(*t.f, run);
  EXPECT_TRUE(t.rec.entries.empty());  // nothing changed: nothing dropped
  stdfs::remove_all(t.dir.path() + "/run/step_1");
  // The new file is made while the old one exists, so it cannot be given the old inode number
  // (a file system reuses a freed one at once), which would make it the same file to a stat.
  test::write_file(t.dir.path() + "/run/notes.txt.new", "new");
  stdfs::remove(t.dir.path() + "/run/notes.txt");
  stdfs::rename(t.dir.path() + "/run/notes.txt.new", t.dir.path() + "/run/notes.txt");
  names(*t.f, run);
  EXPECT_EQ(t.rec.entries,
            (std::set<std::pair<fs::Ino, std::string>>{{run, "notes.txt"}, {run, "step_1"}}));
}

TEST(Fs, AFirstBuildDropsNoNameTheKernelJustLookedUp) {
  // The model is built inside the lookup of its first consolidated name; invalidating that
  // name afterwards would evict the new inode (and its page cache) once the file is closed.
  Fs t;
  fs::Ino model = t.walk({"run", "step_1", "model"});
  t.rec.entries.clear();
  t.walk({"run", "step_1", "model", "model-00001-of-00001.safetensors"});
  EXPECT_EQ(t.rec.entries.count({model, "model-00001-of-00001.safetensors"}), 0u);
  EXPECT_EQ(t.rec.entries.count({model, "model.safetensors.index.json"}), 0u);
}

TEST(Fs, ADirectoryBecomingACheckpointDropsTheNamesItNowHides) {
  Fs t;
  test::write_file(t.dir.path() + "/hf/model.safetensors", "a plain file for now");
  fs::Ino hf = t.walk({"hf"});
  t.walk({"hf", "model.safetensors"});
  t.rec.entries.clear();
  write_ckpt(t.dir.path() + "/hf", 'a');
  names(*t.f, hf);
  EXPECT_EQ(t.rec.entries.count({hf, "model.safetensors"}), 1u);
  EXPECT_EQ(t.f->lookup(hf, "model.safetensors").error().code, ENOENT);
}

TEST(Fs, ReaddirListsDotAndDotDotWithTheInodesStatShows) {
  Fs t;
  fs::Ino run = t.walk({"run"});
  fs::Ino model = t.walk({"run", "step_1", "model"});
  auto dh = t.f->opendir(model);
  ASSERT_TRUE(dh.ok());
  std::vector<fs::DirEntryOut> got;
  ASSERT_TRUE(t.f->readdir(*dh, 0,
                           [&](const fs::DirEntryOut& e, uint64_t) {
                             got.push_back(e);
                             return true;
                           })
                  .ok());
  t.f->releasedir(*dh);
  ASSERT_GE(got.size(), 2u);
  EXPECT_EQ(got[0].name, ".");
  EXPECT_EQ(got[0].ino, t.f->getattr(model)->st_ino);
  EXPECT_EQ(got[0].type, static_cast<mode_t>(S_IFDIR));
  EXPECT_EQ(got[1].name, "..");
  EXPECT_EQ(got[1].ino, t.f->getattr(t.walk({"run", "step_1"}))->st_ino);
  // The root's ".." is itself.
  auto rh = t.f->opendir(fs::kRootIno);
  ASSERT_TRUE(rh.ok());
  std::vector<fs::DirEntryOut> root;
  ASSERT_TRUE(t.f->readdir(*rh, 0,
                           [&](const fs::DirEntryOut& e, uint64_t) {
                             root.push_back(e);
                             return true;
                           })
                  .ok());
  t.f->releasedir(*rh);
  ASSERT_GE(root.size(), 2u);
  EXPECT_EQ(root[1].name, "..");
  EXPECT_EQ(root[1].ino, root[0].ino);
  EXPECT_EQ(root[0].ino, t.f->getattr(fs::kRootIno)->st_ino);
  (void)run;
}

TEST(Fs, NemoConsolidateScriptIsHiddenInACheckpointDirectory) {
  Fs t;
  test::write_file(t.dir.path() + "/run/step_1/model/consolidate.sh", "#!/bin/sh\n");
  test::write_file(t.dir.path() + "/run/consolidate.sh", "#!/bin/sh\n");
  t.f->invalidate_all();
  fs::Ino model = t.walk({"run", "step_1", "model"});
  auto listing = names(*t.f, model);
  EXPECT_EQ(std::count(listing.begin(), listing.end(), "consolidate.sh"), 0);
  EXPECT_EQ(t.f->lookup(model, "consolidate.sh").error().code, ENOENT);
  // Outside a checkpoint directory it is an ordinary file.
  fs::Ino run = t.walk({"run"});
  auto outside = names(*t.f, run);
  EXPECT_EQ(std::count(outside.begin(), outside.end(), "consolidate.sh"), 1);
}

TEST(Fs, StatusFileAtTheRootOnly) {
  Fs t;
  // Never listed, at the root or below; found by name at the root only.
  EXPECT_EQ(names(*t.f, fs::kRootIno), (std::vector<std::string>{"run"}));
  fs::Ino run = t.walk({"run"});
  EXPECT_EQ(t.f->lookup(run, ".ckptfs").error().code, ENOENT);
  auto dir = t.f->lookup(fs::kRootIno, ".ckptfs");
  ASSERT_TRUE(dir.ok()) << dir.error().message;
  EXPECT_TRUE(S_ISDIR(dir->attr.st_mode));
  EXPECT_EQ(dir->attr.st_mode & 07777, 0555u);
  EXPECT_EQ(names(*t.f, dir->ino), (std::vector<std::string>{"status.json"}));
  EXPECT_EQ(t.f->lookup(dir->ino, "other").error().code, ENOENT);
  auto file = t.f->lookup(dir->ino, "status.json");
  ASSERT_TRUE(file.ok());
  EXPECT_TRUE(S_ISREG(file->attr.st_mode));
  // The mount's owner's alone: it names what the daemon serves, private directories too.
  EXPECT_EQ(file->attr.st_mode & 07777, 0400u);
  EXPECT_EQ(file->attr.st_uid, ::geteuid());
  fs::Caller other{::geteuid() + 1000, 12345, {}};
  EXPECT_EQ(t.f->open(file->ino, O_RDONLY, other).error().code, EACCES);
  // Read-only, and nothing is made in the directory.
  EXPECT_EQ(t.f->open(file->ino, O_WRONLY).error().code, EACCES);
  EXPECT_EQ(t.f->create(dir->ino, "x", 0644, O_WRONLY).error().code, EPERM);
  EXPECT_EQ(t.f->mkdir(fs::kRootIno, ".ckptfs", 0755).error().code, EPERM);
  fs::SetAttr chmod;
  chmod.mode = 0644;
  EXPECT_EQ(t.f->setattr(file->ino, chmod).error().code, EPERM);
  auto o = t.f->open(file->ino, O_RDONLY);
  ASSERT_TRUE(o.ok());
  EXPECT_TRUE(o->direct_io);
  t.f->release(o->fh);

  // Its content: a checkpoint serving, then one refused with its reason; reads counted.
  fs::Ino model = t.walk({"run", "step_1", "model"});
  names(*t.f, model);
  std::string before = read_all(*t.f, file->ino);
  auto j = nlohmann::json::parse(before);
  EXPECT_EQ(j["source"], t.dir.path());
  ASSERT_EQ(j["checkpoints"]["list"].size(), 1u);
  EXPECT_EQ(j["checkpoints"]["list"][0]["state"], "serving");
  EXPECT_EQ(j["checkpoints"]["list"][0]["path"], t.dir.path() + "/run/step_1/model");
  EXPECT_EQ(j["checkpoints"]["serving"], 1);
  const uint64_t bytes = j["reads"]["bytes"];
  // Counted in Filesystem::read (the adapter's path), as much as the file holds.
  auto notes = t.f->open(t.walk({"run", "notes.txt"}), O_RDONLY);
  ASSERT_TRUE(notes.ok());
  fs::ReadPlan plan;
  ASSERT_TRUE(t.f->read(notes->fh, 0, 4096, plan).ok());
  ASSERT_TRUE(t.f->read(notes->fh, 4096, 4096, plan).ok());
  t.f->release(notes->fh);
  j = nlohmann::json::parse(read_all(*t.f, file->ino));
  EXPECT_EQ(j["reads"]["bytes"].get<uint64_t>(), bytes + 5);
  EXPECT_EQ(j["reads"]["requests"].get<uint64_t>(), 2u);

  auto m = t.dir.path() + "/run/step_1/model";
  test::write_file(m + "/" + format::shard_file_name(1, 1, 1), "not a shard at all");
  names(*t.f, model);
  j = nlohmann::json::parse(read_all(*t.f, file->ino));
  ASSERT_EQ(j["checkpoints"]["list"].size(), 1u);
  EXPECT_EQ(j["checkpoints"]["list"][0]["state"], "refused") << j.dump();
  EXPECT_FALSE(j["checkpoints"]["list"][0]["problems"].empty());
  EXPECT_EQ(j["checkpoints"]["refused_total"], 1);
  t.f->note_error(EIO);
  j = nlohmann::json::parse(read_all(*t.f, file->ino));
  EXPECT_EQ(j["errors"]["total"], 1);
  EXPECT_EQ(j["errors"]["by_errno"]["EIO"], 1);
}

// --- the writer's view (fs/writers.hpp) ---------------------------------------------------------

TEST(WriterViews, WhoWroteWhereAndForHowLong) {
  using C = fs::WriterViews::Clock;
  C::time_point now{};
  fs::WriterViews w(
      std::chrono::seconds(10), [&] { return now; }, [](pid_t tid) { return tid; });
  const fs::WriterViews::DirId run{1, 10, 5}, step{1, 11, 5}, sharded{1, 12, 5}, other{1, 13, 5};
  EXPECT_FALSE(w.sees_written(sharded, step, 100));
  w.note(sharded, step, 100);  // rank 0 writes its shard in step/sharded
  EXPECT_TRUE(w.sees_written(sharded, step, 100));
  EXPECT_FALSE(w.sees_written(sharded, step, 200));  // another process: the consolidated view
  EXPECT_TRUE(w.sees_written(step, run, 100));       // a child of step was written
  now += std::chrono::seconds(11);
  EXPECT_FALSE(w.sees_written(sharded, step, 100));  // a pause past the window
  // Writing in the parent (the consolidated output beside sharded/) keeps it going...
  w.note(step, run, 100);
  EXPECT_TRUE(w.sees_written(sharded, step, 100));
  // ...but a directory it never wrote in stays consolidated, sibling of a written one or not.
  w.note(other, run, 300);
  EXPECT_FALSE(w.sees_written(sharded, step, 300));
  EXPECT_FALSE(w.sees_written(other, run, 100));
  // A directory made since under a removed one's number is another directory.
  w.note(sharded, step, 100);
  EXPECT_FALSE(w.sees_written(fs::WriterViews::DirId{1, 12, 6}, step, 100));
  fs::WriterViews off(
      std::chrono::seconds(0), [&] { return now; }, [](pid_t tid) { return tid; });
  off.note(sharded, step, 100);
  EXPECT_FALSE(off.sees_written(sharded, step, 100));
}

// Two callers: this process, which writes, and another one.
const fs::Caller kWriter{0, 0, {}, ::getpid()}, kReader{0, 0, {}, 1};

// A filesystem over `dir` that shows what it stores at once (no settle, no revalidation
// pause), with a directory `out` that kWriter made.
struct OutFs {
  std::unique_ptr<fs::Filesystem> f;
  fs::Ino out = 0;
};
OutFs out_fs(const test::TempDir& dir) {
  fs::Options o;
  o.settle = std::chrono::milliseconds(0);
  o.revalidate = std::chrono::milliseconds(0);
  OutFs t{std::move(fs::Filesystem::create(dir.path(), o)).value(), 0};
  auto d = t.f->mkdir(fs::kRootIno, "out", 0755, kWriter);
  EXPECT_TRUE(d.ok());
  if (d) t.out = d->ino;
  return t;
}

TEST(Fs, AWriterListsTheShardsItWroteOthersSeeTheConsolidatedFiles) {
  test::TempDir dir;
  auto [f, out] = out_fs(dir);
  const fs::Caller &writer = kWriter, &reader = kReader;
  ChunkSpec c0{"w", DType::F32, {0, 0}, {2, 2}, std::nullopt, std::string(16, 'a')};
  ChunkSpec c1{"w", DType::F32, {2, 0}, {2, 2}, std::nullopt, std::string(16, 'b')};
  for (int r = 0; r < 2; ++r) {
    const auto name = format::shard_file_name(r + 1, 1, 1);
    auto cr = f->create(out, name, 0644, O_CREAT | O_WRONLY | O_EXCL, writer);
    ASSERT_TRUE(cr.ok()) << cr.error().message;
    auto bytes = test::make_shard_bytes(ShardSpec{name, {r ? c1 : c0}});
    ASSERT_TRUE(f->write(cr->open.fh, 0, bytes).ok());
    ASSERT_TRUE(f->flush(cr->open.fh, writer).ok());
    f->release(cr->open.fh);
  }
  auto list = [&](const fs::Caller& who) {
    auto dh = f->opendir(out, who);
    EXPECT_TRUE(dh.ok());
    std::vector<std::string> out;
    EXPECT_TRUE(f->readdir(*dh, 0, [&](const fs::DirEntryOut& e, uint64_t) {
                   if (e.name != "." && e.name != "..") out.push_back(e.name);
                   return true;
                 }).ok());
    f->releasedir(*dh);
    return out;
  };
  EXPECT_EQ(list(writer), (std::vector<std::string>{format::shard_file_name(1, 1, 1),
                                                    format::shard_file_name(2, 1, 1)}));
  EXPECT_EQ(list(reader), (std::vector<std::string>{"model-00001-of-00001.safetensors",
                                                    "model.safetensors.index.json"}));
  auto shard = f->lookup(out, format::shard_file_name(1, 1, 1), writer);
  ASSERT_TRUE(shard.ok());
  EXPECT_TRUE(shard->uncached);  // the kernel keeps it for nobody else
  EXPECT_EQ(f->lookup(out, format::shard_file_name(1, 1, 1), reader).error().code, ENOENT);
  // By name, the writer finds the consolidated file too (from_pretrained in the same process).
  EXPECT_TRUE(f->lookup(out, "model-00001-of-00001.safetensors", writer).ok());
}

// torch's consolidation into several files beside sharded/: every header first (each closed on
// its own, nothing after it), then each reopened to append its data. The first file closed
// complete is stored although another's header alone is a plain file there (it would keep it
// whole elsewhere), and that header then resolves for its writer only, which reopens it.
TEST(Fs, AConsolidatorReopensTheHeaderItWroteFirstAfterAnotherFileWasStored) {
  test::TempDir dir;
  auto [f, out] = out_fs(dir);
  const fs::Caller &writer = kWriter, &reader = kReader;
  ASSERT_TRUE(f->mkdir(out, "sharded", 0755, writer).ok());
  auto file = [](std::string_view tensor) {  // a consolidated file of one 4-byte F32 tensor
    std::vector<format::TensorEntry> entries(1);
    entries[0].name = std::string(tensor);
    entries[0].dtype = DType::F32;
    entries[0].shape = {1};
    entries[0].end = 4;
    return format::serialize_header(entries, {{"format", "pt"}});
  };
  const std::string k1 = format::model_file_name(1, 2), k2 = format::model_file_name(2, 2);
  const std::string h1 = file("a"), h2 = file("b");
  auto save = [&](fs::Ino ino, uint64_t off, const std::string& bytes) {
    auto op = f->open(ino, O_WRONLY, writer);
    ASSERT_TRUE(op.ok()) << op.error().message;
    ASSERT_TRUE(f->write(op->fh, off, bytes).ok());
    EXPECT_TRUE(f->flush(op->fh, writer).ok());
    f->release(op->fh);
  };
  std::map<std::string, fs::Ino> ino;
  for (const auto& [name, h] : {std::pair{k1, h1}, std::pair{k2, h2}}) {  // the headers
    auto cr = f->create(out, name, 0644, O_CREAT | O_WRONLY | O_EXCL, writer);
    ASSERT_TRUE(cr.ok()) << cr.error().message;
    ASSERT_TRUE(f->write(cr->open.fh, 0, h).ok());
    EXPECT_TRUE(f->flush(cr->open.fh, writer).ok());
    f->release(cr->open.fh);
    ino[name] = cr->entry.ino;
  }
  save(ino[k1], h1.size(), "1111");  // complete: stored, beside k2's header alone
  EXPECT_TRUE(std::filesystem::exists(dir.path() + "/out/" + format::shard_file_name(1, 1, 2)));
  EXPECT_EQ(f->lookup(out, k2, reader).error().code, ENOENT);  // hidden meanwhile
  auto mine = f->lookup(out, k2, writer);
  ASSERT_TRUE(mine.ok()) << mine.error().message;
  EXPECT_TRUE(mine->uncached);
  EXPECT_EQ(mine->attr.st_size, static_cast<off_t>(h2.size()));
  save(mine->ino, h2.size(), "2222");
  for (const auto& [name, want] : {std::pair{k1, h1 + "1111"}, std::pair{k2, h2 + "2222"}}) {
    auto e = f->lookup(out, name, reader);
    ASSERT_TRUE(e.ok()) << name << ": " << e.error().message;
    EXPECT_EQ(read_all(*f, e->ino), want) << name;
  }
  EXPECT_TRUE(std::filesystem::exists(dir.path() + "/out/" + format::shard_file_name(1, 2, 2)));

  // Saving again: each header over a name that stores a file (its close returned EINVAL
  // before). That close drops the first save's file, as a plain directory's O_TRUNC does: while
  // another file of the directory is stored, the name shows nothing to anyone else; once none
  // is, the directory is a plain one again and shows the header alone, as written. Never the
  // first save's file beside the second's.
  auto names_of = [&](const fs::Caller& who) {
    auto dh = f->opendir(out, who);
    EXPECT_TRUE(dh.ok());
    std::set<std::string> got;
    EXPECT_TRUE(f->readdir(*dh, 0, [&](const fs::DirEntryOut& e, uint64_t) {
                   got.insert(e.name);
                   return true;
                 }).ok());
    f->releasedir(*dh);
    return got;
  };
  for (const auto& [name, h] : {std::pair{k1, h1}, std::pair{k2, h2}}) {
    auto e = f->lookup(out, name, writer);
    ASSERT_TRUE(e.ok()) << e.error().message;
    auto op = f->open(e->ino, O_WRONLY | O_TRUNC, writer);
    ASSERT_TRUE(op.ok()) << op.error().message;
    ASSERT_TRUE(f->write(op->fh, 0, h).ok());
    auto closed = f->flush(op->fh, writer);
    EXPECT_TRUE(closed.ok()) << closed.error().message;
    f->release(op->fh);
    const auto k = format::parse_model_name(name)->k;
    EXPECT_FALSE(std::filesystem::exists(dir.path() + "/out/" + format::shard_file_name(1, k, 2)))
        << name << ": the first save's shard is kept";
    auto seen = f->lookup(out, name, reader);
    if (name == k1) {  // k2 of the first save is still stored
      EXPECT_FALSE(seen.ok()) << name;
      EXPECT_EQ(seen.ok() ? 0 : seen.error().code, ENOENT) << name;
      EXPECT_FALSE(names_of(reader).count(name)) << name;
    } else {  // nothing is: a plain directory of two headers
      ASSERT_TRUE(seen.ok()) << name << ": " << seen.error().message;
      EXPECT_EQ(read_all(*f, seen->ino), h) << name;
      EXPECT_TRUE(names_of(reader).count(name)) << name;
    }
  }
  auto again = f->lookup(out, k1, writer);
  ASSERT_TRUE(again.ok()) << again.error().message;
  EXPECT_FALSE(again->uncached);  // a plain directory's file, the same for everyone
  EXPECT_EQ(again->attr.st_size, static_cast<off_t>(h1.size()));
  save(again->ino, h1.size(), "3333");
  auto e1 = f->lookup(out, k1, reader);
  ASSERT_TRUE(e1.ok()) << e1.error().message;
  EXPECT_EQ(read_all(*f, e1->ino), h1 + "3333");
  EXPECT_EQ(f->lookup(out, k2, reader).error().code, ENOENT);  // the first save's is not shown
}

// --- issue 32: builds, lifted folders and rewrites under open files -------------------------

TEST(Fs, ABuildThatThrowsLeavesNothingPinned) {
  // A build that fails by an exception (here the test's seam; in the field a name the JSON
  // writer refused) must still end: the next listing and lookup build again instead of waiting
  // forever for a build nobody runs.
  std::atomic<int> builds{0};
  fs::Options o;
  o.on_build = [&](const std::string&) {
    if (builds.fetch_add(1) == 0) throw std::runtime_error("the first build fails");
  };
  Fs t(o);
  fs::Ino model = t.walk({"run", "step_1", "model"});
  EXPECT_THROW((void)t.f->lookup(model, "model-00001-of-00001.safetensors"), std::runtime_error);
  auto again = std::async(std::launch::async, [&] { return names(*t.f, model); });
  ASSERT_EQ(again.wait_for(std::chrono::seconds(20)), std::future_status::ready)
      << "a listing after a failed build hangs";
  EXPECT_EQ(again.get(),
            (std::vector<std::string>{"config.json", "model-00001-of-00001.safetensors",
                                      "model.safetensors.index.json"}));
  EXPECT_EQ(builds.load(), 2);
}

namespace {
// A latch the builder of one directory waits on (the test's seam: Options::on_build).
struct Gate {
  std::mutex mu;  // guards open, entered
  std::condition_variable cv;
  bool open = false;
  int entered = 0;
  void pass() {
    std::unique_lock lock(mu);
    ++entered;
    cv.notify_all();
    cv.wait(lock, [&] { return open; });
  }
  void release() {
    std::lock_guard lock(mu);
    open = true;
    cv.notify_all();
  }
  bool wait_entered(int n) {
    std::unique_lock lock(mu);
    return cv.wait_for(lock, std::chrono::seconds(20), [&] { return entered >= n; });
  }
};
// A flag set by a parked request's resume.
struct Done {
  std::mutex mu;  // guards n
  std::condition_variable cv;
  int n = 0;
  std::function<void()> fn() {
    return [this] {
      std::lock_guard lock(mu);
      ++n;
      cv.notify_all();
    };
  }
  bool wait(int want) {
    std::unique_lock lock(mu);
    return cv.wait_for(lock, std::chrono::seconds(20), [&] { return n >= want; });
  }
  int count() {
    std::lock_guard lock(mu);
    return n;
  }
};
}  // namespace

TEST(Fs, ABuildRunsOffTheCallersThreadAndStallsNoOtherDirectory) {
  Gate slow;
  fs::Options o;
  o.build_threads = 2;
  o.on_build = [&](const std::string& rel) {
    if (rel.ends_with("step_1/model")) slow.pass();
  };
  Fs t(o);
  stdfs::create_directories(t.dir.path() + "/run/step_2/model");
  write_ckpt(t.dir.path() + "/run/step_2/model", 'b');
  fs::Ino m1 = t.walk({"run", "step_1", "model"});
  fs::Ino m2 = t.walk({"run", "step_2", "model"});
  const std::string name = "model-00001-of-00001.safetensors";
  // Plain names and attributes never wait for a build.
  Done d1, d1b, d2;
  EXPECT_FALSE(t.f->when_ready(m1, name, d1.fn()));  // parked: step_1 builds on a builder
  ASSERT_TRUE(slow.wait_entered(1));
  EXPECT_FALSE(t.f->when_ready(m1, "", d1b.fn()));  // its listing too, behind the same build
  EXPECT_TRUE(t.f->when_ready(m1, "notes.txt", [] {}));
  EXPECT_TRUE(t.f->getattr(m1).ok());
  // Another directory's build runs meanwhile, and its request is answered.
  EXPECT_FALSE(t.f->when_ready(m2, name, d2.fn()));
  ASSERT_TRUE(d2.wait(1)) << "step_2's parked lookup waited for step_1's build";
  EXPECT_TRUE(t.f->when_ready(m2, name, [] {}));  // built: ready now
  EXPECT_TRUE(t.f->lookup(m2, name).ok());
  EXPECT_EQ(d1.count() + d1b.count(), 0);
  slow.release();
  ASSERT_TRUE(d1.wait(1));
  ASSERT_TRUE(d1b.wait(1));
  EXPECT_TRUE(t.f->when_ready(m1, name, [] {}));
  EXPECT_TRUE(t.f->lookup(m1, name).ok());
}

TEST(Fs, ALiftedFileIsReachedOnlyByWhoMaySearchItsFolder) {
  Fs t;
  const auto meta = t.dir.path() + "/run/step_1/model/.hf_metadata";
  fs::Ino model = t.walk({"run", "step_1", "model"});
  fs::Ino cfg = t.walk({"run", "step_1", "model", "config.json"});  // root: cached for all
  const fs::Caller user{1000, 1000, {}};
  auto listed_for = [&](const fs::Caller& who) {
    auto dh = t.f->opendir(model, who);
    EXPECT_TRUE(dh.ok());
    std::set<std::string> out;
    if (!dh) return out;
    (void)t.f->readdir(*dh, 0, [&](const fs::DirEntryOut& e, uint64_t) {
      out.insert(e.name);
      return true;
    });
    t.f->releasedir(*dh);
    return out;
  };
  auto open_errno = [&](const fs::Caller& who) {
    auto o = t.f->open(cfg, O_RDONLY, who);
    if (!o) return o.error().code;
    t.f->release(o->fh);
    return 0;
  };
  EXPECT_EQ(open_errno(user), 0);
  EXPECT_TRUE(listed_for(user).count("config.json"));
  // A folder only its owner (root) may enter: in SRC, uid 1000 reaches nothing in it.
  ASSERT_EQ(::chmod(meta.c_str(), 0700), 0);
  auto looked = t.f->lookup(model, "config.json", user);
  ASSERT_FALSE(looked.ok());
  EXPECT_EQ(looked.error().code, EACCES);
  EXPECT_FALSE(listed_for(user).count("config.json"));
  EXPECT_EQ(open_errno(user), EACCES);  // the entry root looked up, opened as uid 1000
  EXPECT_EQ(open_errno(fs::Caller{}), 0);
  EXPECT_TRUE(listed_for(fs::Caller{}).count("config.json"));
  // Searchable but not readable: the name cannot be listed, and it opens.
  ASSERT_EQ(::chmod(meta.c_str(), 0711), 0);
  EXPECT_FALSE(listed_for(user).count("config.json"));
  EXPECT_EQ(open_errno(user), 0);
}

TEST(Fs, AShardRewrittenInPlaceUnderAnOpenFileIsAnErrorNeverAMix) {
  Fs t;
  fs::Ino file = t.walk({"run", "step_1", "model", "model-00001-of-00001.safetensors"});
  auto o = t.f->open(file, O_RDONLY);
  ASSERT_TRUE(o.ok());
  auto reader = t.f->reader(o->fh);
  std::string v1(reader->size(), '\0');
  ASSERT_TRUE(reader->read(0, v1.size(), v1.data()).ok());
  // Shard 2 rewritten in place (same inode, same size), as torch rewrites a .distcp ("wb"). Its
  // mtime moves as the kernel moves it; pinned one second on so that the clock's granularity
  // cannot hide the rewrite from this test.
  const auto shard = t.dir.path() + "/run/step_1/model/" + format::shard_file_name(2, 1, 1);
  struct stat before {};
  ASSERT_EQ(::stat(shard.c_str(), &before), 0);
  write_ckpt(t.dir.path() + "/run/step_1/model", 'z');
  struct timespec times[2] = {before.st_atim, before.st_mtim};
  times[1].tv_sec += 1;
  ASSERT_EQ(::utimensat(AT_FDCWD, shard.c_str(), times, 0), 0);
  struct stat after {};
  ASSERT_EQ(::stat(shard.c_str(), &after), 0);
  ASSERT_EQ(after.st_ino, before.st_ino);
  ASSERT_EQ(after.st_size, before.st_size);
  std::string again(reader->size(), '\0');
  auto n = reader->read(0, again.size(), again.data());
  ASSERT_FALSE(n.ok()) << "read the rewritten shard's bytes under the old version's header";
  EXPECT_EQ(n.error().code, EIO);
  // It names the shard it found changed (both were rewritten; shard 2 surely moved its mtime).
  EXPECT_NE(n.error().message.find("-model-00001-of-00001.safetensors: changed under an open"),
            std::string::npos)
      << n.error().message;
  // The splice path's check, made before the kernel moves the bytes, says the same.
  fs::ReadPlan plan;
  ASSERT_TRUE(t.f->read(o->fh, 0, reader->size(), plan).ok());
  EXPECT_FALSE(fs::check_extents(plan).ok());
  t.f->release(o->fh);
  // The new version opens and reads.
  fs::Ino v2 = t.walk({"run", "step_1", "model", "model-00001-of-00001.safetensors"});
  EXPECT_NE(read_all(*t.f, v2).find(std::string(16, 'z' + 1)), std::string::npos);
}

// DirViews is a component: made from its Deps alone (no Filesystem), it hands out a directory's
// View, keeps it until told to check again, and tells its Notifier what changed.
TEST(DirViews, AComponentMadeFromItsDepsAlone) {
  test::TempDir src;
  stdfs::create_directories(src.path() + "/ck");
  stdfs::create_directories(src.path() + "/plain");
  write_ckpt(src.path() + "/ck", 'a');
  auto clock = std::make_shared<fs::ManualClock>();
  fs::Options o;
  o.clock = clock;
  o.settle = std::chrono::milliseconds(0);
  o.revalidate = std::chrono::hours(1);
  // No close watch: a writer's close would make the directory look again (its own test above).
  o.close_watch = [](fs::CloseWatch::OnClose) { return std::unique_ptr<fs::CloseWatch>(); };
  UniqueFd root(::open(src.path().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  ASSERT_GE(root.get(), 0);
  fs::NodeTable nodes;
  source::HeaderCache headers;
  auto flusher = flush::make_local_flusher();
  fs::WriteRegistry writes(clock);
  fs::StatusFile status(clock->realtime_ns());
  fs::DirViews views(fs::DirViews::Deps{o, src.path(), root.get(), clock, nodes, headers, *flusher,
                                        writes, status});
  Recorder rec;
  views.set_notifier(&rec);
  const fs::Ino ino = 7;
  struct stat dst {};
  ASSERT_EQ(::stat((src.path() + "/ck").c_str(), &dst), 0);
  // Need::Any reads no header: a placeholder that shows nothing consolidated.
  auto any = views.view_of("ck", dst, ino, fs::Need::Any);
  ASSERT_NE(any, nullptr);
  EXPECT_FALSE(any->complete);
  EXPECT_EQ(status.builds.load(), 0u);
  auto v = views.view_of("ck", dst, ino, fs::Need::Current);
  ASSERT_NE(v, nullptr);
  EXPECT_TRUE(v->complete);
  ASSERT_EQ(v->ckpt->outputs.size(), 1u);
  EXPECT_EQ(status.builds.load(), 1u);
  // Rewritten: the same View until it is told to check again.
  write_ckpt(src.path() + "/ck", 'b', /*atomic=*/true);
  EXPECT_EQ(views.view_of("ck", dst, ino, fs::Need::Current), v);
  rec.entries.clear();
  rec.inodes.clear();
  views.recheck(static_cast<uint64_t>(dst.st_dev), static_cast<uint64_t>(dst.st_ino));
  auto v2 = views.view_of("ck", dst, ino, fs::Need::Current);
  ASSERT_NE(v2, nullptr);
  EXPECT_NE(v2, v);
  EXPECT_GT(v2->generation, v->generation);
  EXPECT_EQ(status.builds.load(), 2u);
  // The kernel drops the directory's attributes and the names of the version it replaced.
  EXPECT_EQ(rec.inodes.count(ino), 1u);
  EXPECT_EQ(rec.entries.count({ino, "model-00001-of-00001.safetensors"}), 1u);
  // A plain directory has no view.
  struct stat pst {};
  ASSERT_EQ(::stat((src.path() + "/plain").c_str(), &pst), 0);
  EXPECT_EQ(views.view_of("plain", pst, 8, fs::Need::Current), nullptr);
}
