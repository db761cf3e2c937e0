// engine/consolidate: `ckptfs consolidate`'s engine: staged, fsynced model files from shards.
#include "ckptfs/engine/consolidate.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "ckptfs/format/distcp.hpp"
#include "ckptfs/format/names.hpp"
#include "ckptfs/format/verl.hpp"
#include "ckptfs/io/gather.hpp"
#include "ckptfs/layout/extent_map.hpp"
#include "ckptfs/source/scanner.hpp"
#include "ckptfs/source/shards.hpp"
#include "ckptfs/util/copy.hpp"
#include "ckptfs/util/fd.hpp"

namespace ckptfs::engine {
namespace {

namespace stdfs = std::filesystem;

constexpr uint64_t kCopyRangeMin = 256 << 10;  // average run length that uses copy_file_range
constexpr uint64_t kGatherBlock = 512 << 10;   // bytes gathered and written at a time

using format::is_model_output_name;

bool stopped(const std::atomic<bool>* stop) { return stop && stop->load(); }

struct Job {
  uint32_t file;
  uint64_t off;
  uint64_t len;
};

// Writes the model files of one checkpoint: a pool of workers, each taking the next window
// of the next file, producing its bytes and handing them to the kernel.
class Copier {
 public:
  Copier(const layout::Checkpoint& ck, std::string src, unsigned threads, uint64_t window,
         const std::atomic<bool>* stop)
      : ck_(ck), src_(std::move(src)), threads_(threads), window_(window), stop_(stop) {}

  Status open_shards() {
    CKPTFS_TRY(UniqueFd dir, open_file(src_, O_RDONLY | O_DIRECTORY));
    CKPTFS_TRY(fds_, source::open_shards(ck_, dir.get(), src_, "consolidate"));
    for (const auto& fd : fds_) raw_.push_back(fd.get());
    return {};
  }

  Status write_outputs(const std::string& dir, const ProgressFn& progress) {
    outs_.clear();
    for (const auto& f : ck_.outputs) {
      if (!f.folder.empty() && ::mkdir((dir + "/" + f.folder).c_str(), 0755) != 0 &&
          errno != EEXIST) {
        int e = errno;
        return make_error(e, "{}/{}: cannot create: {}", dir, f.folder, std::strerror(e));
      }
      CKPTFS_TRY(UniqueFd fd, open_file(dir + "/" + f.path(), O_WRONLY | O_CREAT | O_TRUNC, 0644));
      if (::ftruncate(fd.get(), static_cast<off_t>(f.size)) != 0) {
        int e = errno;
        return make_error(e, "{}/{}: cannot size to {} bytes: {}", dir, f.path(), f.size,
                          std::strerror(e));
      }
      outs_.push_back(std::move(fd));
      total_ += f.size;
    }
    for (uint32_t i = 0; i < ck_.outputs.size(); ++i) {
      for (uint64_t off = 0; off < ck_.outputs[i].size; off += window_) {
        jobs_.push_back(Job{i, off, std::min(window_, ck_.outputs[i].size - off)});
      }
    }
    std::vector<std::thread> workers;
    for (unsigned t = 0; t < threads_; ++t) workers.emplace_back([this] { work(); });
    if (progress) progress(Progress{0, total_});
    {
      std::unique_lock lock(mu_);
      while (finished_ < threads_) {
        cv_.wait_for(lock, std::chrono::milliseconds(250));
        if (finished_ == threads_) break;
        if (progress) {
          lock.unlock();
          progress(Progress{done_.load(), total_});
          lock.lock();
        }
      }
    }
    for (auto& w : workers) w.join();
    if (!first_error_.ok()) return first_error_;
    if (stopped(stop_) || failed_.load()) return make_error(EINTR, "interrupted");
    if (progress) progress(Progress{done_.load(), total_});
    for (size_t i = 0; i < outs_.size(); ++i) {
      if (::fsync(outs_[i].get()) != 0) {
        int e = errno;
        return make_error(e, "{}: fsync failed: {}", ck_.outputs[i].name, std::strerror(e));
      }
    }
    return {};
  }

  uint64_t total() const { return total_; }

 private:
  bool should_stop() const { return failed_.load() || stopped(stop_); }

  void work() {
    std::vector<layout::Segment> segs;
    std::vector<char> buf;  // the window, allocated at the first gathered job
    std::vector<char> copybuf;
    while (!should_stop()) {
      size_t j = next_.fetch_add(1);
      if (j >= jobs_.size()) break;
      auto st = run_job(jobs_[j], segs, buf, copybuf);
      if (!st) {
        std::lock_guard lock(mu_);
        if (first_error_.ok()) first_error_ = std::move(st);
        failed_.store(true);
        break;
      }
      done_.fetch_add(jobs_[j].len);
    }
    {
      std::lock_guard lock(mu_);
      ++finished_;
    }
    cv_.notify_all();
  }

  Status run_job(const Job& job, std::vector<layout::Segment>& segs, std::vector<char>& buf,
                 std::vector<char>& copybuf) {
    const auto& f = ck_.outputs[job.file];
    layout::map_range(ck_, job.file, job.off, job.len, segs);
    size_t shard_segs = 0;
    bool cast = false;
    for (const auto& s : segs) {
      shard_segs += s.is_memory() ? 0 : 1;
      cast = cast || s.is_transformed();
    }
    const int out = outs_[job.file].get();
    if (!cast && (shard_segs == 0 || job.len / shard_segs >= kCopyRangeMin)) {
      // Long runs: copy_file_range, in the kernel (and shared extents where the file
      // system can). Cast and strided segments are made by io::gather, below.
      // One kernel copy at a time: it needs no CPU from other threads, and several at once
      // interleave their reads and writebacks on the disk (row-sharded, 1 GiB: 0.74x cp cold
      // with 2 concurrent copies, 0.83x with one; docs/benchmarks.md). Gather jobs of other
      // threads still overlap it.
      std::lock_guard copying(copy_mu_);
      uint64_t pos = job.off;
      for (const auto& s : segs) {
        if (s.is_memory()) {
          CKPTFS_CHECK(pwrite_all(out, f.header.data() + s.src, s.len, pos, f.name));
        } else {
          CKPTFS_CHECK(copy_all(raw_[s.shard], s.src, out, pos, s.len,
                                src_ + "/" + ck_.shards[s.shard].name, copybuf));
        }
        pos += s.len;
      }
    } else {
      // Short runs: block by block, one preadv per shard span into the buffer (io::gather,
      // where every segment kind is handled), then one buffered pwrite while the block is
      // still in the CPU cache (a whole window's buffer is not: the pwrite's copy then
      // cost twice the gather's).
      const uint64_t block = std::min(kGatherBlock, window_);
      if (buf.size() < block) buf.resize(block);
      io::GatherSource gs{&ck_, raw_, f.header, {}};
      gs.windows = &windows_;
      for (uint64_t off = job.off, end = job.off + job.len; off < end; off += block) {
        const uint64_t n = std::min(block, end - off);
        layout::map_range(ck_, job.file, off, n, segs);
        CKPTFS_CHECK(io::gather(gs, segs, buf.data()));
        CKPTFS_CHECK(pwrite_all(out, buf.data(), n, off, f.name));
      }
    }
    // Start the writeback of this window now, without waiting for it: the disk writes while
    // the next windows are read, and the fsync at the end only waits for the last ones. The
    // block queue holds the writers back when the disk is the bottleneck, which bounds the
    // dirty pages. Advisory: where it is not supported, the fsync does all the work.
    (void)::sync_file_range(out, static_cast<off_t>(job.off), static_cast<off_t>(job.len),
                            SYNC_FILE_RANGE_WRITE);
    return {};
  }

  const layout::Checkpoint& ck_;
  std::string src_;
  unsigned threads_;
  uint64_t window_;
  const std::atomic<bool>* stop_;
  std::vector<UniqueFd> fds_;
  std::vector<int> raw_;
  io::StridedWindows windows_;  // transposed tensors' matrices, shared by the copy threads
  std::vector<UniqueFd> outs_;
  std::vector<Job> jobs_;
  std::atomic<size_t> next_{0};
  std::atomic<uint64_t> done_{0};
  std::atomic<bool> failed_{false};  // a worker failed: the others stop
  uint64_t total_ = 0;
  std::mutex mu_;       // guards first_error_ and finished_
  std::mutex copy_mu_;  // held by the one thread running a copy_file_range job (guards no data)
  std::condition_variable cv_;
  Status first_error_;
  unsigned finished_ = 0;  // workers returned
};

// Regular files of the checkpoint besides the shards (and a DCP or verl checkpoint's own files):
// SRC's own files, then the content of .hf_metadata/ (the mapping files excluded) and of verl's
// huggingface/, each unless an earlier one already has that name.
std::vector<std::pair<std::string, std::string>> side_files(
    const std::string& src, const std::function<void(std::string_view)>& warn) {
  std::vector<std::pair<std::string, std::string>> out;  // (source path, name)
  std::set<std::string> seen;
  std::error_code ec;
  for (const auto& e : stdfs::directory_iterator(src, ec)) {
    auto name = e.path().filename().string();
    // NeMo's consolidate.sh makes what this writes; its own export leaves it out (the view too).
    // A DCP checkpoint's .metadata and .distcp files are its shards.
    if (format::looks_like_shard_name(name) || is_model_output_name(name) ||
        format::is_distcp_file_name(name) || format::is_verl_file_name(name) ||
        name == format::kNemoConsolidateScript) {
      continue;
    }
    if (e.is_symlink(ec)) {
      if (warn) warn(fmt::format("not copying symlink {}", e.path().string()));
      continue;
    }
    if (!e.is_regular_file(ec)) continue;
    out.emplace_back(e.path().string(), name);
    seen.insert(name);
  }
  for (std::string_view lifted : format::kLiftedDirs) {
    std::string meta = src + "/" + std::string(lifted);
    if (stdfs::is_symlink(meta, ec)) continue;
    for (const auto& e : stdfs::directory_iterator(meta, ec)) {
      auto name = e.path().filename().string();
      if (!e.is_regular_file(ec) || e.is_symlink(ec)) continue;
      if (name == format::kFqnMappingFileName || name == format::kFqnDtypeMappingFileName ||
          seen.count(name) || is_model_output_name(name)) {
        continue;
      }
      out.emplace_back(e.path().string(), name);
      seen.insert(name);
    }
  }
  std::sort(out.begin(), out.end(), [](auto& a, auto& b) { return a.second < b.second; });
  return out;
}

Status copy_file(const std::string& from, const std::string& to) {
  CKPTFS_TRY(UniqueFd in, open_regular_at(AT_FDCWD, from, from));  // a FIFO never blocks
  struct stat st {};
  if (::fstat(in.get(), &st) != 0) return make_error(errno, "{}: stat failed", from);
  CKPTFS_TRY(UniqueFd out, open_file(to, O_WRONLY | O_CREAT | O_TRUNC, st.st_mode & 0777));
  std::vector<char> buf(1 << 20);
  CKPTFS_CHECK(copy_all(in.get(), 0, out.get(), 0, static_cast<uint64_t>(st.st_size), from, buf));
  if (::fsync(out.get()) != 0) return make_error(errno, "{}: fsync failed", to);
  return {};
}

Status write_text(const std::string& path, std::string_view text) {
  CKPTFS_TRY(UniqueFd out, open_file(path, O_WRONLY | O_CREAT | O_TRUNC, 0644));
  CKPTFS_CHECK(pwrite_all(out.get(), text.data(), text.size(), 0, path));
  if (::fsync(out.get()) != 0) return make_error(errno, "{}: fsync failed", path);
  return {};
}

// Removes staging directories of earlier runs whose process no longer exists.
void remove_stale_staging(const std::string& dir, std::string_view marker) {
  std::error_code ec;
  for (const auto& e : stdfs::directory_iterator(dir, ec)) {
    auto name = e.path().filename().string();
    auto at = name.find(marker);
    if (name.empty() || name[0] != '.' || at == std::string::npos) continue;
    auto pid = std::atol(name.c_str() + at + marker.size());
    if (pid <= 0 || (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH)) {
      stdfs::remove_all(e.path(), ec);
    }
  }
}

void fsync_dir(const std::string& dir) {
  auto fd = open_file(dir, O_RDONLY | O_DIRECTORY);
  if (fd) ::fsync(fd->get());
}

std::string strip_slashes(std::string p) {
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  return p;
}

// Removes the staging directory unless it was handed over (renamed to DST).
class StagingGuard {
 public:
  explicit StagingGuard(std::string path) : path_(std::move(path)) {}
  ~StagingGuard() {
    if (path_.empty()) return;
    std::error_code ignore;
    stdfs::remove_all(path_, ignore);
  }
  StagingGuard(const StagingGuard&) = delete;
  StagingGuard& operator=(const StagingGuard&) = delete;
  void release() { path_.clear(); }

 private:
  std::string path_;
};

}  // namespace

unsigned default_threads() { return std::clamp(std::thread::hardware_concurrency(), 2u, 8u); }

Result<ConsolidateStats> consolidate(const ConsolidateOptions& opts, const std::atomic<bool>* stop,
                                     const ProgressFn& progress) {
  const std::string src = strip_slashes(opts.src);
  const std::string dst = strip_slashes(opts.dst);
  const unsigned threads = opts.threads ? opts.threads : default_threads();
  const uint64_t window = opts.window ? opts.window : kDefaultWindow;

  std::shared_ptr<const layout::Checkpoint> loaded = opts.checkpoint;
  if (!loaded) {
    CKPTFS_TRY(loaded, source::load_checkpoint_path(src, opts.build));
  }
  const auto& ck = *loaded;
  if (!ck.valid()) {
    std::string msg = fmt::format("{} is not a complete, valid checkpoint:", src);
    for (const auto& p : ck.problems) msg += "\n  " + p.to_string();
    return Error{EINVAL, std::move(msg)};
  }

  std::error_code ec;
  const bool dst_exists = stdfs::exists(dst, ec);
  if (dst_exists && !stdfs::is_directory(dst, ec)) {
    return make_error(ENOTDIR, "{} exists and is not a directory", dst);
  }
  std::vector<std::string> stale;
  if (dst_exists) {
    for (const auto& e : stdfs::directory_iterator(dst, ec)) {
      auto name = e.path().filename().string();
      if (is_model_output_name(name)) stale.push_back(name);
    }
    // A LoRA adapter consolidated there before: replaced only with --force, as model files are.
    const std::string adapter =
        std::string(format::kLoraAdapterDir) + "/" + std::string(format::kAdapterModelName);
    if (ck.adapter && stdfs::exists(dst + "/" + adapter, ec) && !opts.force) {
      return make_error(EEXIST, "{} already holds {} (use --force to replace)", dst, adapter);
    }
    if (!stale.empty() && !opts.force) {
      return make_error(EEXIST, "{} already holds {} (use --force to replace)", dst, stale.front());
    }
  }
  // Stage everything in a hidden directory on the destination file system.
  const std::string parent = stdfs::path(dst).parent_path().string().empty()
                                 ? "."
                                 : stdfs::path(dst).parent_path().string();
  const std::string dst_name = stdfs::path(dst).filename().string();
  if (dst_exists) {
    remove_stale_staging(dst, ".ckptfs-partial-");
  } else {
    remove_stale_staging(parent, "." + dst_name + ".ckptfs-partial-");
  }
  const std::string staging =
      dst_exists ? fmt::format("{}/.ckptfs-partial-{}", dst, ::getpid())
                 : fmt::format("{}/.{}.ckptfs-partial-{}", parent, dst_name, ::getpid());
  stdfs::create_directories(staging, ec);
  if (ec) return make_error(ec.value(), "cannot create {}: {}", staging, ec.message());
  StagingGuard guard(staging);
  auto interrupted = [] { return make_error(EINTR, "interrupted"); };
  if (stopped(stop)) return interrupted();

  auto t0 = std::chrono::steady_clock::now();
  Copier c(ck, src, threads, window, stop);
  CKPTFS_CHECK(c.open_shards());
  CKPTFS_CHECK(c.write_outputs(staging, progress));
  auto sides = side_files(src, opts.on_warning);
  for (const auto& [from, name] : sides) {
    if (stopped(stop)) return interrupted();
    CKPTFS_CHECK(copy_file(from, staging + "/" + name));
  }
  // A mapped checkpoint sized by --hf-config (no config.json of its own): the output gets it,
  // as the mount shows it, so from_pretrained(DST) works.
  if (!ck.config_json.empty() && std::none_of(sides.begin(), sides.end(), [](const auto& s) {
        return s.second == "config.json";
      })) {
    CKPTFS_CHECK(write_text(staging + "/config.json", ck.config_json));
  }
  // A LoRA checkpoint: adapter_config.json beside the adapter (write_outputs made its folder).
  if (ck.adapter) {
    CKPTFS_CHECK(
        write_text(staging + "/" + ck.adapter->dir + "/" + std::string(format::kAdapterConfigName),
                   ck.adapter->config_json));
    fsync_dir(staging + "/" + ck.adapter->dir);
  }
  // No index without a model file in the directory (a LoRA adapter alone).
  if (!ck.index_json.empty()) {
    CKPTFS_CHECK(write_text(staging + "/" + std::string(format::kIndexFileName), ck.index_json));
  }
  fsync_dir(staging);
  if (stopped(stop)) return interrupted();

  if (!dst_exists) {
    if (::rename(staging.c_str(), dst.c_str()) != 0) {
      int e = errno;
      return make_error(e, "cannot rename {} to {}: {}", staging, dst, std::strerror(e));
    }
    guard.release();
  } else {
    // Data files first, the index last, so a reader never finds an index whose files are
    // missing. Then drop stale outputs of an earlier, different consolidation.
    std::vector<std::string> order;
    for (const auto& [from, name] : sides) order.push_back(name);
    if (ck.adapter) {  // the adapter's files into their folder, made when missing
      const std::string folder = dst + "/" + ck.adapter->dir;
      if (::mkdir(folder.c_str(), 0755) != 0 && errno != EEXIST) {
        int e = errno;
        return make_error(e, "cannot create {}: {}", folder, std::strerror(e));
      }
      order.push_back(ck.adapter->dir + "/" + std::string(format::kAdapterConfigName));
    }
    for (const auto& f : ck.outputs) order.push_back(f.path());
    if (!ck.index_json.empty()) order.emplace_back(format::kIndexFileName);
    for (const auto& name : order) {
      if (::rename((staging + "/" + name).c_str(), (dst + "/" + name).c_str()) != 0) {
        int e = errno;
        return make_error(e, "cannot move {} into {}: {}", name, dst, std::strerror(e));
      }
    }
    for (const auto& name : stale) {
      if (!ck.find_output(name) && name != format::kIndexFileName) {
        stdfs::remove(dst + "/" + name, ec);
      }
    }
  }
  if (ck.adapter) fsync_dir(dst + "/" + ck.adapter->dir);
  fsync_dir(dst);
  ConsolidateStats stats;
  stats.tensors = ck.tensors.size();
  stats.files = ck.outputs.size();
  stats.side_files = sides.size();
  stats.bytes = c.total();
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return stats;
}

}  // namespace ckptfs::engine
