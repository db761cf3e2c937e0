// The consolidate engine, driven directly: its files are byte for byte what the mount
// synthesizes, a stop leaves no final name, and a shard that changes underneath it is an
// error naming that shard.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "ckptfs/engine/consolidate.hpp"
#include "ckptfs/format/names.hpp"
#include "ckptfs/fs/filesystem.hpp"
#include "ckptfs/source/scanner.hpp"
#include "fixture.hpp"

using namespace ckptfs;
using format::DType;
using test::ChunkSpec;
using test::ShardSpec;

namespace {

namespace stdfs = std::filesystem;

constexpr uint32_t kRanks = 4;

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::vector<std::string> listing(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : stdfs::directory_iterator(dir)) out.push_back(e.path().filename());
  std::sort(out.begin(), out.end());
  return out;
}

// A 4-rank checkpoint of two files:
//  - model-00001-of-00002: "col", BF16 [256, 1024] split by columns (512-byte runs, so every
//    window is gathered), and a small whole tensor "bias" on rank 1;
//  - model-00002-of-00002: "row", F32 [1024, 1024] split by rows (1 MiB per rank, so a
//    1 MiB window is one long run and goes through copy_file_range).
// Plus config.json and .hf_metadata/tokenizer.json as side files.
void write_checkpoint(const std::string& dir, uint64_t seed = 1) {
  std::mt19937_64 rng(seed);
  for (uint32_t r = 0; r < kRanks; ++r) {
    ShardSpec one{format::shard_file_name(r + 1, 1, 2), {}};
    one.chunks.push_back(ChunkSpec{"model.col.weight",
                                   DType::BF16,
                                   {0, r * 256ull},
                                   {256, 256},
                                   std::nullopt,
                                   test::random_bytes(rng, 256 * 256 * 2)});
    if (r == 0) {
      one.chunks.push_back(ChunkSpec{
          "model.bias", DType::F32, {0}, {100}, std::nullopt, test::random_bytes(rng, 400)});
    }
    test::write_file(dir + "/" + one.file_name, test::make_shard_bytes(one));
    ShardSpec two{format::shard_file_name(r + 1, 2, 2), {}};
    two.chunks.push_back(ChunkSpec{"model.row.weight",
                                   DType::F32,
                                   {r * 256ull, 0},
                                   {256, 1024},
                                   std::nullopt,
                                   test::random_bytes(rng, 256 * 1024 * 4)});
    test::write_file(dir + "/" + two.file_name, test::make_shard_bytes(two));
  }
  test::write_file(dir + "/config.json", "{\"model_type\": \"test\"}\n");
  test::write_file(dir + "/.hf_metadata/tokenizer.json", "{\"tok\": 1}\n");
}

// Every file of the mount's view of `rel` (below `root`), read through fs::Filesystem.
std::map<std::string, std::string> view_of(const std::string& root, const std::string& rel) {
  fs::Options o;
  o.settle = std::chrono::milliseconds(0);
  o.revalidate = std::chrono::milliseconds(0);
  auto f = fs::Filesystem::create(root, o);
  EXPECT_TRUE(f.ok());
  std::map<std::string, std::string> out;
  if (!f) return out;
  auto dir = (*f)->lookup(fs::kRootIno, rel);
  EXPECT_TRUE(dir.ok()) << dir.error().message;
  if (!dir) return out;
  auto dh = (*f)->opendir(dir->ino);
  EXPECT_TRUE(dh.ok());
  std::vector<std::string> names;
  EXPECT_TRUE((*f)->readdir(*dh, 0,
                            [&](const fs::DirEntryOut& e, uint64_t) {
                              if (e.name != "." && e.name != "..") names.push_back(e.name);
                              return true;
                            })
                  .ok());
  (*f)->releasedir(*dh);
  for (const auto& n : names) {
    auto e = (*f)->lookup(dir->ino, n);
    EXPECT_TRUE(e.ok()) << n;
    if (!e) continue;
    auto o2 = (*f)->open(e->ino, O_RDONLY);
    EXPECT_TRUE(o2.ok()) << n;
    if (!o2) continue;
    auto r = (*f)->reader(o2->fh);
    std::string bytes(r->size(), '\0');
    auto got = r->read(0, bytes.size(), bytes.data());
    EXPECT_TRUE(got.ok()) << n;
    out[n] = bytes;
    (*f)->release(o2->fh);
  }
  return out;
}

struct Case {
  test::TempDir tmp;
  std::string src = tmp.path() + "/src/ckpt";
  std::string out = tmp.path() + "/out";
  std::string dst = out + "/dst";
  Case() {
    write_checkpoint(src);
    stdfs::create_directories(out);
  }
  engine::ConsolidateOptions options(unsigned threads = 2, uint64_t window = 0) const {
    engine::ConsolidateOptions o;
    o.src = src;
    o.dst = dst;
    o.threads = threads;
    o.window = window;
    return o;
  }
};

}  // namespace

TEST(Consolidate, FilesAreTheViewsBytes) {
  Case c;
  const auto view = view_of(c.tmp.path() + "/src", "ckpt");
  ASSERT_EQ(view.size(), 5u);  // 2 model files, the index, config.json, tokenizer.json
  // Windows of 64 KiB (many jobs, all gathered in file 1), of 1 MiB (file 2 by
  // copy_file_range), and the default; 1 and 3 threads.
  for (auto [threads, window] : {std::pair{1u, 64ull << 10}, std::pair{3u, 1ull << 20},
                                 std::pair{3u, 0ull}, std::pair{2u, 12345ull}}) {
    SCOPED_TRACE(testing::Message() << threads << " threads, window " << window);
    std::vector<engine::Progress> calls;
    auto r = engine::consolidate(c.options(threads, window), nullptr,
                                 [&](const engine::Progress& p) { calls.push_back(p); });
    ASSERT_TRUE(r.ok()) << r.error().message;
    EXPECT_EQ(listing(c.dst),
              (std::vector<std::string>{"config.json", "model-00001-of-00002.safetensors",
                                        "model-00002-of-00002.safetensors",
                                        "model.safetensors.index.json", "tokenizer.json"}));
    for (const auto& [name, bytes] : view) {
      EXPECT_TRUE(slurp(c.dst + "/" + name) == bytes) << name << " differs from the view";
    }
    EXPECT_EQ(r->files, 2u);
    EXPECT_EQ(r->tensors, 3u);
    EXPECT_EQ(r->side_files, 2u);
    EXPECT_EQ(r->bytes, view.at("model-00001-of-00002.safetensors").size() +
                            view.at("model-00002-of-00002.safetensors").size());
    ASSERT_GE(calls.size(), 2u);
    EXPECT_EQ(calls.front().done, 0u);
    EXPECT_EQ(calls.back().done, r->bytes);
    EXPECT_EQ(calls.back().total, r->bytes);
    EXPECT_EQ(listing(c.out), std::vector<std::string>{"dst"});  // no staging left
    stdfs::remove_all(c.dst);
  }
}

TEST(Consolidate, ExistingDestination) {
  Case c;
  stdfs::create_directories(c.dst);
  test::write_file(c.dst + "/model-00001-of-00003.safetensors", "old");
  test::write_file(c.dst + "/notes.txt", "mine");
  auto r = engine::consolidate(c.options());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, EEXIST);
  EXPECT_NE(r.error().message.find("model-00001-of-00003.safetensors"), std::string::npos);
  EXPECT_NE(r.error().message.find("--force"), std::string::npos);
  auto o = c.options();
  o.force = true;
  r = engine::consolidate(o);
  ASSERT_TRUE(r.ok()) << r.error().message;
  // The stale output of another layout is gone, the user's own file stays, no staging.
  EXPECT_EQ(listing(c.dst), (std::vector<std::string>{
                                "config.json", "model-00001-of-00002.safetensors",
                                "model-00002-of-00002.safetensors", "model.safetensors.index.json",
                                "notes.txt", "tokenizer.json"}));
  // A file where the directory should be.
  test::write_file(c.out + "/plain", "x");
  o.dst = c.out + "/plain";
  r = engine::consolidate(o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, ENOTDIR);
}

TEST(Consolidate, StopBeforeTheStartWritesNothing) {
  Case c;
  std::atomic<bool> stop{true};
  auto r = engine::consolidate(c.options(), &stop);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, EINTR);
  EXPECT_EQ(r.error().message, "interrupted");
  EXPECT_TRUE(listing(c.out).empty());
}

TEST(Consolidate, StopMidwayLeavesNoFinalName) {
  Case c;
  // New DST: nothing at all remains. Existing DST: its previous outputs are untouched.
  for (bool existing : {false, true}) {
    SCOPED_TRACE(existing ? "existing DST" : "new DST");
    if (existing) {
      stdfs::create_directories(c.dst);
      test::write_file(c.dst + "/model-00001-of-00002.safetensors", "previous");
      test::write_file(c.dst + "/model.safetensors.index.json", "{}");
    }
    std::atomic<bool> stop{false};
    // ~10,000 jobs of 512 bytes: the worker is far from done when the flag is set.
    auto o = c.options(1, 512);
    o.force = existing;
    // The first progress call comes once the workers run; the stop is set there.
    engine::Progress last;
    auto r = engine::consolidate(o, &stop, [&](const engine::Progress& p) {
      stop.store(true);
      last = p;
    });
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.error().code, EINTR);
    EXPECT_EQ(r.error().message, "interrupted");
    // The workers stopped: the copy never reported itself complete.
    EXPECT_GT(last.total, 0u);
    EXPECT_LT(last.done, last.total);
    if (existing) {
      EXPECT_EQ(listing(c.dst), (std::vector<std::string>{"model-00001-of-00002.safetensors",
                                                          "model.safetensors.index.json"}));
      EXPECT_EQ(slurp(c.dst + "/model-00001-of-00002.safetensors"), "previous");
    } else {
      EXPECT_TRUE(listing(c.out).empty());
    }
  }
}

TEST(Consolidate, TruncatedShardIsNamed) {
  Case c;
  const std::string victim = format::shard_file_name(3, 1, 2);
  const std::string path = c.src + "/" + victim;
  const auto size = stdfs::file_size(path);
  {
    // Truncated after the model was built (the CLI loads it first): the copy refuses it.
    auto loaded = source::load_checkpoint_path(c.src);
    ASSERT_TRUE(loaded.ok());
    ASSERT_TRUE((*loaded)->valid());
    ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(size / 2)), 0);
    auto o = c.options();
    o.checkpoint = *loaded;
    auto r = engine::consolidate(o);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.error().code, ESTALE);
    EXPECT_NE(r.error().message.find(victim), std::string::npos) << r.error().message;
    EXPECT_TRUE(listing(c.out).empty());
  }
  {
    // Truncated before: the model says which shard, and nothing is written.
    auto r = engine::consolidate(c.options());
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.error().code, EINVAL);
    EXPECT_NE(r.error().message.find("not a complete, valid checkpoint"), std::string::npos);
    EXPECT_NE(r.error().message.find(victim), std::string::npos) << r.error().message;
    EXPECT_TRUE(listing(c.out).empty());
  }
}

TEST(Consolidate, StaleStagingOfADeadRunIsRemoved) {
  Case c;
  // A pid that cannot be alive (above pid_max's largest value).
  const std::string dead = c.out + "/.dst.ckptfs-partial-999999999";
  test::write_file(dead + "/model-00001-of-00002.safetensors", "partial");
  auto r = engine::consolidate(c.options());
  ASSERT_TRUE(r.ok()) << r.error().message;
  EXPECT_EQ(listing(c.out), std::vector<std::string>{"dst"});
}
