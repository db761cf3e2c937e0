// `ckptfs consolidate SRC DST`: materialize the consolidated checkpoint through the extent
// map. Bytes move with copy_file_range where runs are long and with one gathered read per
// shard per window where they are short; memory is bounded by threads x window.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>
#include <cstdlib>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "ckptfs/cli/args.hpp"
#include "ckptfs/format/names.hpp"
#include "ckptfs/fs/gather.hpp"
#include "ckptfs/layout/extent_map.hpp"
#include "ckptfs/source/scanner.hpp"
#include "ckptfs/util/fd.hpp"
#include "ckptfs/util/path.hpp"
#include "ckptfs/util/text.hpp"

namespace ckptfs::cli {
namespace {

namespace stdfs = std::filesystem;

constexpr std::string_view kUsage = R"(usage: ckptfs consolidate SRC DST [--threads N] [--force]

Writes the consolidated HuggingFace checkpoint of the rank shards in SRC to DST:
model-0000k-of-0000m.safetensors, model.safetensors.index.json, and the checkpoint's other
files (config.json, tokenizer files, .hf_metadata/ content except the mapping file).
Everything is written to a hidden staging directory first. When DST does not exist the
staging directory is renamed to DST at the end (atomic); when it exists, the files are moved
in one by one with the index last. A failure or a kill before that point never leaves a
model*.safetensors under its final name; staging left by a killed run is removed by the
next run. Side files that are symlinks are not copied (a warning says so).

options:
  --threads N  copy threads (default: min(4, cores))
  --force      replace model*.safetensors / index files already in DST
  -h, --help   this text
)";

constexpr uint64_t kWindow = 16ull << 20;      // bytes per job
constexpr uint64_t kCopyRangeMin = 256 << 10;  // average run length that uses copy_file_range
constexpr uint64_t kDirectAlign = 4096;        // O_DIRECT offset/length/buffer alignment

std::atomic<bool> g_stop{false};  // set by SIGINT/SIGTERM; polled by workers
extern "C" void on_signal(int) { g_stop.store(true); }

bool is_model_output_name(std::string_view n) {
  return n == format::kIndexFileName || format::parse_model_name(n).has_value();
}

// Copies `len` bytes between fds at explicit offsets, preferring copy_file_range.
Status copy_range(int in, uint64_t in_off, int out, uint64_t out_off, uint64_t len,
                  std::string_view what, std::vector<char>& buf) {
  bool use_cfr = true;
  while (len > 0) {
    if (use_cfr) {
      auto io = static_cast<loff_t>(in_off);
      auto oo = static_cast<loff_t>(out_off);
      ssize_t n = ::copy_file_range(in, &io, out, &oo, len, 0);
      if (n > 0) {
        in_off += static_cast<uint64_t>(n);
        out_off += static_cast<uint64_t>(n);
        len -= static_cast<uint64_t>(n);
        continue;
      }
      if (n == 0) return make_error(EIO, "{}: unexpected end of file at {}", what, in_off);
      if (errno == EINTR) continue;
      if (errno != EXDEV && errno != EINVAL && errno != ENOSYS && errno != EOPNOTSUPP) {
        int e = errno;
        return make_error(e, "{}: copy failed: {}", what, std::strerror(e));
      }
      use_cfr = false;
    }
    size_t n = static_cast<size_t>(std::min<uint64_t>(len, buf.size()));
    CKPTFS_CHECK(pread_exact(in, buf.data(), n, in_off, what));
    CKPTFS_CHECK(pwrite_all(out, buf.data(), n, out_off, "output"));
    in_off += n;
    out_off += n;
    len -= n;
  }
  return {};
}

// A page-aligned buffer (O_DIRECT needs aligned memory).
class AlignedBuffer {
 public:
  explicit AlignedBuffer(size_t n)
      : p_(static_cast<char*>(std::aligned_alloc(kDirectAlign, n))), n_(n) {
    if (!p_) throw std::bad_alloc();
  }
  ~AlignedBuffer() { std::free(p_); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  char* data() { return p_; }
  size_t size() const { return n_; }

 private:
  char* p_;
  size_t n_;
};

struct Job {
  uint32_t file;
  uint64_t off;
  uint64_t len;
};

class Consolidator {
 public:
  Consolidator(const layout::Checkpoint& ck, std::string src, unsigned threads)
      : ck_(ck), src_(std::move(src)), threads_(threads) {}

  Status open_shards() {
    fds_.reserve(ck_.shards.size());
    for (const auto& s : ck_.shards) {
      const std::string path = src_ + "/" + s.name;
      struct stat st {};
      CKPTFS_TRY(UniqueFd fd, open_regular_at(AT_FDCWD, path, path, &st));
      if (source::stamp_of(st) != s.stamp) {
        return make_error(ESTALE, "{}/{}: changed while consolidating", src_, s.name);
      }
      raw_.push_back(fd.get());
      fds_.push_back(std::move(fd));
    }
    return {};
  }

  Status write_outputs(const std::string& dir) {
    outs_.clear();
    for (const auto& f : ck_.outputs) {
      CKPTFS_TRY(UniqueFd fd, open_file(dir + "/" + f.name, O_WRONLY | O_CREAT | O_TRUNC, 0644));
      if (::ftruncate(fd.get(), static_cast<off_t>(f.size)) != 0) {
        int e = errno;
        return make_error(e, "{}/{}: cannot size to {} bytes: {}", dir, f.name, f.size,
                          std::strerror(e));
      }
      // A second descriptor with O_DIRECT for gathered windows: their bytes are already in
      // our buffer, so writing them around the page cache saves a copy and the writeback.
      // Not every file system has it (tmpfs does not): then the buffered fd is used.
      auto direct = open_file(dir + "/" + f.name, O_WRONLY | O_DIRECT);
      direct_.push_back(direct ? std::move(direct).value() : UniqueFd());
      outs_.push_back(std::move(fd));
      total_ += f.size;
    }
    for (uint32_t i = 0; i < ck_.outputs.size(); ++i) {
      for (uint64_t off = 0; off < ck_.outputs[i].size; off += kWindow) {
        jobs_.push_back(Job{i, off, std::min(kWindow, ck_.outputs[i].size - off)});
      }
    }
    std::thread progress;
    if (::isatty(STDERR_FILENO)) progress = std::thread([this] { report(); });
    std::vector<std::thread> workers;
    for (unsigned t = 0; t < threads_; ++t) workers.emplace_back([this] { work(); });
    for (auto& w : workers) w.join();
    {
      std::lock_guard lock(mu_);
      finished_ = true;
    }
    cv_.notify_all();
    if (progress.joinable()) progress.join();
    if (!first_error_.ok()) return first_error_;
    if (g_stop.load()) return make_error(EINTR, "interrupted");
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
  void work() {
    std::vector<layout::Segment> segs;
    AlignedBuffer buf(kWindow);
    std::vector<char> copybuf(1 << 20);
    while (!g_stop.load()) {
      size_t j = next_.fetch_add(1);
      if (j >= jobs_.size()) return;
      auto st = run_job(jobs_[j], segs, buf, copybuf);
      if (!st) {
        std::lock_guard lock(mu_);
        if (first_error_.ok()) first_error_ = std::move(st);
        g_stop.store(true);
        return;
      }
      done_.fetch_add(jobs_[j].len);
    }
  }

  Status run_job(const Job& job, std::vector<layout::Segment>& segs, AlignedBuffer& buf,
                 std::vector<char>& copybuf) {
    const auto& f = ck_.outputs[job.file];
    layout::map_range(ck_, job.file, job.off, job.len, segs);
    size_t shard_segs = 0;
    for (const auto& s : segs) shard_segs += s.is_memory() ? 0 : 1;
    const int out = outs_[job.file].get();
    if (shard_segs == 0 || job.len / shard_segs >= kCopyRangeMin) {
      uint64_t pos = job.off;
      for (const auto& s : segs) {
        if (s.is_memory()) {
          CKPTFS_CHECK(pwrite_all(out, f.header.data() + s.src, s.len, pos, f.name));
        } else {
          CKPTFS_CHECK(copy_range(raw_[s.shard], s.src, out, pos, s.len,
                                  src_ + "/" + ck_.shards[s.shard].name, copybuf));
        }
        pos += s.len;
      }
      return {};
    }
    fs::GatherSource gs{&ck_, raw_, f.header, {}};
    CKPTFS_CHECK(fs::gather(gs, segs, buf.data()));
    const int direct = direct_[job.file].get();
    if (direct >= 0 && job.off % kDirectAlign == 0 && job.len % kDirectAlign == 0) {
      auto st = pwrite_all(direct, buf.data(), job.len, job.off, f.name);
      if (st.ok() || st.error().code != EINVAL) return st;
    }
    return pwrite_all(out, buf.data(), job.len, job.off, f.name);
  }

  void report() {
    auto t0 = std::chrono::steady_clock::now();
    std::unique_lock lock(mu_);
    while (!finished_) {
      cv_.wait_for(lock, std::chrono::milliseconds(250));
      double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      uint64_t d = done_.load();
      double rate = secs > 0 ? d / secs : 0;
      double eta = rate > 0 ? (total_ - d) / rate : 0;
      int width = 30;
      int fill = total_ ? static_cast<int>(width * static_cast<double>(d) / total_) : width;
      fmt::print(stderr, "\r[{:<{}}] {:.1f}/{:.1f} GB  {:.0f} MB/s  ETA {:.0f}s   ",
                 std::string(fill, '#'), width, d / 1e9, total_ / 1e9, rate / 1e6, eta);
    }
    fmt::print(stderr, "\n");
  }

  const layout::Checkpoint& ck_;
  std::string src_;
  unsigned threads_;
  std::vector<UniqueFd> fds_;
  std::vector<int> raw_;
  std::vector<UniqueFd> outs_;
  std::vector<UniqueFd> direct_;  // O_DIRECT twins of outs_ (invalid where unsupported)
  std::vector<Job> jobs_;
  std::atomic<size_t> next_{0};
  std::atomic<uint64_t> done_{0};
  uint64_t total_ = 0;
  std::mutex mu_;  // guards first_error_ and finished_
  std::condition_variable cv_;
  Status first_error_;
  bool finished_ = false;
};

// Regular files of the checkpoint besides the shards: SRC's own files, then
// .hf_metadata/ content (the mapping file excluded) unless SRC already has that name.
std::vector<std::pair<std::string, std::string>> side_files(const std::string& src) {
  std::vector<std::pair<std::string, std::string>> out;  // (source path, name)
  std::set<std::string> seen;
  std::error_code ec;
  for (const auto& e : stdfs::directory_iterator(src, ec)) {
    auto name = e.path().filename().string();
    if (format::looks_like_shard_name(name) || is_model_output_name(name)) continue;
    if (e.is_symlink(ec)) {
      fmt::print(stderr, "ckptfs consolidate: warning: not copying symlink {}\n",
                 e.path().string());
      continue;
    }
    if (!e.is_regular_file(ec)) continue;
    out.emplace_back(e.path().string(), name);
    seen.insert(name);
  }
  std::string meta = src + "/" + std::string(format::kHfMetadataDir);
  for (const auto& e : stdfs::directory_iterator(meta, ec)) {
    auto name = e.path().filename().string();
    if (!e.is_regular_file(ec) || e.is_symlink(ec)) continue;
    if (name == format::kFqnMappingFileName || seen.count(name) || is_model_output_name(name)) {
      continue;
    }
    out.emplace_back(e.path().string(), name);
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
  CKPTFS_CHECK(copy_range(in.get(), 0, out.get(), 0, static_cast<uint64_t>(st.st_size), from, buf));
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

}  // namespace

int cmd_consolidate(std::span<char*> argv) {
  static constexpr OptSpec spec[] = {{"threads", 'j', true}, {"force", 0, false}};
  auto parsed = parse_command(argv, spec, {"consolidate", kUsage, "SRC and DST", 2});
  if (auto* rc = std::get_if<int>(&parsed)) return *rc;
  auto* args = &std::get<Args>(parsed);
  unsigned threads = std::max(1u, std::min(4u, std::thread::hardware_concurrency()));
  if (auto t = args->get("threads")) {
    auto v = parse_unsigned(*t, "--threads");
    if (!v || *v == 0 || *v > 256) {
      fmt::print(stderr, "ckptfs consolidate: --threads must be 1..256\n");
      return 2;
    }
    threads = *v;
  }
  std::string src = args->positional[0];
  std::string dst = args->positional[1];
  while (src.size() > 1 && src.back() == '/') src.pop_back();
  while (dst.size() > 1 && dst.back() == '/') dst.pop_back();

  auto loaded = source::load_checkpoint_path(src);
  if (!loaded) {
    fmt::print(stderr, "ckptfs consolidate: {}\n", printable(loaded.error().message));
    if (auto below = source::find_checkpoint_dirs(src); below && !below->dirs.empty()) {
      fmt::print(stderr, "checkpoints found below it:\n");
      for (const auto& d : below->dirs) fmt::print(stderr, "  {}\n", printable(d));
    }
    return 1;
  }
  const auto& ck = **loaded;
  if (!ck.valid()) {
    fmt::print(stderr, "ckptfs consolidate: {} is not a complete, valid checkpoint:\n",
               printable(src));
    for (const auto& p : ck.problems) fmt::print(stderr, "  {}\n", printable(p.to_string()));
    return 1;
  }

  std::error_code ec;
  const bool dst_exists = stdfs::exists(dst, ec);
  if (dst_exists && !stdfs::is_directory(dst, ec)) {
    fmt::print(stderr, "ckptfs consolidate: {} exists and is not a directory\n", dst);
    return 1;
  }
  std::vector<std::string> stale;
  if (dst_exists) {
    for (const auto& e : stdfs::directory_iterator(dst, ec)) {
      auto name = e.path().filename().string();
      if (is_model_output_name(name)) stale.push_back(name);
    }
    if (!stale.empty() && !args->has("force")) {
      fmt::print(stderr, "ckptfs consolidate: {} already holds {} (use --force to replace)\n", dst,
                 stale.front());
      return 1;
    }
  }
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
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
  if (ec) {
    fmt::print(stderr, "ckptfs consolidate: cannot create {}: {}\n", staging, ec.message());
    return 1;
  }
  if (g_stop.load()) {
    stdfs::remove_all(staging, ec);
    fmt::print(stderr, "ckptfs consolidate: interrupted\n");
    return 1;
  }

  auto fail = [&](const Error& e) {
    fmt::print(stderr, "ckptfs consolidate: {}\n", printable(e.message));
    std::error_code ignore;
    stdfs::remove_all(staging, ignore);
    return 1;
  };

  auto t0 = std::chrono::steady_clock::now();
  Consolidator c(ck, src, threads);
  if (auto st = c.open_shards(); !st) return fail(st.error());
  if (auto st = c.write_outputs(staging); !st) return fail(st.error());
  auto sides = side_files(src);
  for (const auto& [from, name] : sides) {
    if (g_stop.load()) return fail(make_error(EINTR, "interrupted"));
    if (auto st = copy_file(from, staging + "/" + name); !st) return fail(st.error());
  }
  if (auto st = write_text(staging + "/" + std::string(format::kIndexFileName), ck.index_json);
      !st) {
    return fail(st.error());
  }
  fsync_dir(staging);
  if (g_stop.load()) return fail(make_error(EINTR, "interrupted"));

  if (!dst_exists) {
    if (::rename(staging.c_str(), dst.c_str()) != 0) {
      return fail(
          make_error(errno, "cannot rename {} to {}: {}", staging, dst, std::strerror(errno)));
    }
  } else {
    // Data files first, the index last, so a reader never finds an index whose files are
    // missing. Then drop stale outputs of an earlier, different consolidation.
    std::vector<std::string> order;
    for (const auto& [from, name] : sides) order.push_back(name);
    for (const auto& f : ck.outputs) order.push_back(f.name);
    order.emplace_back(format::kIndexFileName);
    for (const auto& name : order) {
      if (::rename((staging + "/" + name).c_str(), (dst + "/" + name).c_str()) != 0) {
        return fail(
            make_error(errno, "cannot move {} into {}: {}", name, dst, std::strerror(errno)));
      }
    }
    for (const auto& name : stale) {
      if (!ck.find_output(name) && name != format::kIndexFileName) {
        stdfs::remove(dst + "/" + name, ec);
      }
    }
    stdfs::remove_all(staging, ec);
  }
  fsync_dir(dst);
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (::isatty(STDERR_FILENO)) {
    fmt::print(stderr, "consolidated {} tensors into {} files ({:.2f} GB) in {:.2f}s\n",
               ck.tensors.size(), ck.outputs.size(), c.total() / 1e9, secs);
  }
  return 0;
}

}  // namespace ckptfs::cli
