// test_fs_model: the reference-model test of the write path: seeded random op sequences checked
// after every step against an in-memory model of the tree, through fs::Filesystem directly
// (FsModel) and replayed through a real FUSE mount (FsModelMount).
//
// Like mountpoint-s3's reference tests (tests/reftests/). Each sequence creates files, writes
// pieces in any order, flushes, fsyncs, closes, renames, unlinks, makes and removes directories
// and changes SRC directly, and after EVERY step compares what the view shows with the model:
// the names each directory lists, each file's type and size, and each file's bytes read back (a
// file open for writing through the writer's handle and through a fresh open by name). Error
// codes of refused operations are checked too. The parts, in fs_model/:
//   model      the tree, the documented rules (docs/semantics.md) and what each op must answer;
//   generator  the next op from the model's state and the seed's rng (the op record);
//   harness    the Driver interface and the Runner (apply, judge, check);
//   drivers    FsDriver (fs::Filesystem on a ManualClock, reads through the read plan) and
//              MountDriver (syscalls on a mount made by tests/python/test_fs_model_mount.py).
//
// Replay: a failure prints the seed, the step and the operations that led there.
// CKPTFS_MODEL_SEED=S runs that one sequence; CKPTFS_MODEL_SEQS / CKPTFS_MODEL_OPS raise the
// number of sequences and their length (soak runs; the coverage minimums scale with the default).
// The mount variant runs only with CKPTFS_MODEL_MOUNT=<mount point> and CKPTFS_MODEL_SRC=<its
// source> (skipped otherwise); see FsModelMount below for its knobs.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <string>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "fs_model/drivers.hpp"
#include "fs_model/harness.hpp"

using namespace ckptfs;
using namespace ckptfs::fsmodel;

namespace {

constexpr uint64_t kSeedBase = 0x5eed0000u;

// Runs `seqs` sequences (seeds kSeedBase + first + i, or CKPTFS_MODEL_SEED's one) of `ops` steps
// on a fresh driver each; false after the first failure (reported). Prints the coverage.
bool run_sequences(const std::function<std::unique_ptr<Driver>()>& make, int seqs, int first,
                   int ops, Counters& cov) {
  const char* one = std::getenv("CKPTFS_MODEL_SEED");
  spdlog::set_level(spdlog::level::warn);  // a line per commit otherwise
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < seqs; ++i) {
    const uint64_t seed = one && *one ? std::strtoull(one, nullptr, 10)
                                      : kSeedBase + static_cast<uint64_t>(first + i);
    auto driver = make();
    Runner run(*driver, seed, ops, cov);
    if (auto e = run.go()) {
      ADD_FAILURE() << *e;
      return false;
    }
    if (one && *one) break;
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::string report;
  for (const auto& [k, v] : cov) report += fmt::format("  {:<58} {}\n", k, v);
  std::cout << fmt::format("{} sequences x {} ops in {:.1f} s; coverage:\n{}", seqs, ops, secs,
                           report);
  return true;
}

bool replay() {
  const char* one = std::getenv("CKPTFS_MODEL_SEED");
  return one && *one;
}

}  // namespace

TEST(FsModel, RandomSequencesMatchTheReferenceModel) {
  const int seqs = std::max(1, env_int("CKPTFS_MODEL_SEQS", 60));
  const int ops = std::max(1, env_int("CKPTFS_MODEL_OPS", 150));
  Counters cov;
  if (!run_sequences([] { return std::make_unique<FsDriver>(); }, seqs, 0, ops, cov)) return;
  if (replay()) return;  // a replay: no coverage minimums
  // Every state the generator is meant to reach, reached (scaled from the default 60 x 150;
  // about a third of what the default run reaches).
  const double scale = static_cast<double>(seqs) * ops / (60.0 * 150.0);
  const std::map<std::string, uint64_t> minimums = {
      {"SRC change observed", 126},
      {"SRC delete", 25},
      {"SRC write", 101},
      {"close incomplete (non-model name)", 112},
      {"close of a writer renamed over a stored file", 3},
      {"close of an orphan", 55},
      {"close of an orphan whose old name holds a stored file", 1},
      {"close stored whole", 128},
      {"commit routed", 37},
      {"commit staged", 20},
      {"create .ckptfs refused", 13},
      {"create EEXIST", 39},
      {"create O_TRUNC over a file", 105},
      {"create plain", 96},
      {"create tensors", 268},
      {"file being written hidden in a checkpoint directory", 378},
      {"flush of a file still open", 96},
      {"fsync", 118},
      {"mkdir", 43},
      {"mkdir .ckptfs refused", 11},
      {"mkdir EEXIST", 90},
      {"read of a file being written (open by name)", 9250},
      {"read of a file being written (writer's handle)", 9250},
      {"read of a stored file a writer renamed over", 162},
      {"read of a stored file after commit", 2141},
      {"rename", 39},
      {"rename ENOENT", 114},
      {"rename NOREPLACE EEXIST", 11},
      {"rename dir", 27},
      {"rename dir over a file ENOTDIR", 5},
      {"rename dir over a non-empty dir ENOTEMPTY", 14},
      {"rename dir over an empty dir", 3},
      {"rename dir over a view-empty dir holding .ckptfs", 1},
      {"rename of a missing name onto a checkpoint's model name ENOENT", 1},
      {"rename of a file being written off a model name", 8},
      {"rename of a file being written onto a model name", 17},
      {"rename of a file being written over a stored file", 3},
      {"rename of a stored file EXDEV", 9},
      {"rename over a file being written", 18},
      {"rename over an existing name", 53},
      {"rmdir", 23},
      {"rmdir ENOENT", 33},
      {"rmdir ENOTEMPTY", 49},
      {"rmdir of a file ENOTDIR", 8},
      {"rmdir of a view-empty dir with a file being written ENOTEMPTY", 1},
      {"split at the rename", 6},
      {"stored as shards (seen in SRC)", 64},
      {"unlink", 53},
      {"unlink ENOENT", 78},
      {"unlink of a directory EISDIR", 7},
      {"unlink of a file being written", 48},
      {"unlink of a stored file", 7},
      {"write in order", 467},
      {"write out of order", 368},
  };
  for (const auto& [k, min] : minimums) {
    const auto want = static_cast<uint64_t>(static_cast<double>(min) * std::min(scale, 1.0));
    EXPECT_GE(cov[k], want) << "the generator stopped reaching: " << k;
  }
}

// The same model with write passthrough: the kernel writes each file into its backing file (a
// pwrite on the descriptor the open handed out), close() stores it as its own one shard, and
// with ranks > 1 its split into rank shards runs after the close, on the split threads, while
// the sequence goes on: every check after every step (names, sizes, bytes by name and through
// the writer's handle) holds whether or not the split has run. Other seeds than the request
// path's (CKPTFS_MODEL_KW_SEQS, default 20).
TEST(FsModel, KernelWritesMatchTheReferenceModel) {
  const int seqs = std::max(1, env_int("CKPTFS_MODEL_KW_SEQS", 20));
  const int ops = std::max(1, env_int("CKPTFS_MODEL_OPS", 150));
  Counters cov;
  uint64_t kernel_written = 0;
  if (!run_sequences([&] { return std::make_unique<FsDriver>(true, &kernel_written); }, seqs, 1000,
                     ops, cov)) {
    return;
  }
  if (replay() || seqs * ops < 10 * 150) return;
  EXPECT_GE(kernel_written, cov["write in order"] + cov["write out of order"])
      << "writes that reached the Filesystem: every open for writing is handed to the kernel";
  for (const char* k :
       {"read of a stored file after commit", "read of a file being written (writer's handle)",
        "read of a file being written (open by name)", "stored as shards (seen in SRC)",
        "rename of a file being written onto a model name", "close stored whole"}) {
    EXPECT_GE(cov[k], 1u) << "the kernel-writes variant never reached: " << k;
  }
}

// The same sequences (the same seeds) replayed through a real mount by POSIX syscalls: run by
// tests/python/test_fs_model_mount.py, which mounts ckptfs on an empty SRC with
//   -o ranks=N,settle=S,revalidate=S,entry_timeout=0,attr_timeout=0,writer_view=0
// and sets CKPTFS_MODEL_MOUNT, CKPTFS_MODEL_SRC, CKPTFS_MODEL_RANKS (the mount's N: every
// sequence of one mount splits files into N ranks, whatever its seed draws) and
// CKPTFS_MODEL_WAIT_MS (what "time passes" sleeps: past settle, revalidate and the kernel's
// timeouts). CKPTFS_MODEL_MOUNT_SEQS (default 4; the pytest passes 3 per mount), CKPTFS_MODEL_FIRST
// (the first seed's index, default 0), CKPTFS_MODEL_OPS and CKPTFS_MODEL_SEED as above. The
// sequences run one after the other on the one mount, each from an empty tree.
TEST(FsModelMount, RandomSequencesMatchThroughFuse) {
  const char* mnt = std::getenv("CKPTFS_MODEL_MOUNT");
  const char* src = std::getenv("CKPTFS_MODEL_SRC");
  if (!mnt || !*mnt || !src || !*src) {
    GTEST_SKIP() << "needs a mount: CKPTFS_MODEL_MOUNT and CKPTFS_MODEL_SRC "
                    "(tests/python/test_fs_model_mount.py)";
  }
  const auto ranks = static_cast<uint32_t>(std::max(1, env_int("CKPTFS_MODEL_RANKS", 1)));
  const std::chrono::milliseconds wait(std::max(0, env_int("CKPTFS_MODEL_WAIT_MS", 250)));
  const int seqs = std::max(1, env_int("CKPTFS_MODEL_MOUNT_SEQS", 4));
  const int first = std::max(0, env_int("CKPTFS_MODEL_FIRST", 0));
  const int ops = std::max(1, env_int("CKPTFS_MODEL_OPS", 150));
  Counters cov;
  const std::string m = mnt, s = src;
  if (!run_sequences([&] { return std::make_unique<MountDriver>(m, s, ranks, wait); }, seqs, first,
                     ops, cov)) {
    return;
  }
  if (replay() || seqs * ops < 3 * 150) return;
  // Not the unit variant's minimums (a few sequences reach the rare states by chance or not),
  // but the paths every few sequences take: commits, reads of what was committed and of files
  // being written, files hidden while written, SRC changes seen.
  for (const char* k : {"commit routed", "read of a stored file after commit",
                        "read of a file being written (open by name)",
                        "file being written hidden in a checkpoint directory",
                        "SRC change observed", "rename", "close of an orphan"}) {
    EXPECT_GE(cov[k], 1u) << "the mount variant never reached: " << k;
  }
}
