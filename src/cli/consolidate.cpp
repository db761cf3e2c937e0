// `ckptfs consolidate SRC DST`: parses the command line, owns the stop flag (SIGINT and
// SIGTERM set it) and the progress bar, and runs engine::consolidate.
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <string>
#include <thread>

#include <fmt/format.h>

#include "ckptfs/cli/args.hpp"
#include "ckptfs/cli/progress.hpp"
#include "ckptfs/engine/consolidate.hpp"
#include "ckptfs/source/maps.hpp"
#include "ckptfs/source/scanner.hpp"
#include "ckptfs/util/fd.hpp"
#include "ckptfs/util/text.hpp"

namespace ckptfs::cli {
namespace {

constexpr std::string_view kUsage =
    R"(usage: ckptfs consolidate SRC DST [--threads N] [--force] [--dtype D] [--map M]
                                    [--hf-config PATH]

Writes the consolidated HuggingFace checkpoint of the rank shards in SRC to DST:
model-0000k-of-0000m.safetensors, model.safetensors.index.json, and the checkpoint's other
files (config.json, tokenizer files, .hf_metadata/ content except the mapping files; NeMo's
consolidate.sh is left out). The bytes are those the mount serves with the same --dtype.
Everything is written to a hidden staging directory first. When DST does not exist the
staging directory is renamed to DST at the end (atomic); when it exists, the files are moved
in one by one with the index last. A failure or a kill before that point never leaves a
model*.safetensors under its final name; staging left by a killed run is removed by the
next run. Side files that are symlinks are not copied (a warning says so).

options:
  --threads N  copy threads (default: {})
  --force      replace model*.safetensors / index files already in DST
  --dtype D    auto (default: the dtypes of NeMo's .hf_metadata/fqn_to_dtype_mapping.json
               where present, else as stored), stored, bf16, fp16 or fp32 (every floating
               tensor cast, rounding as torch's .to() does)
  --map M      model map (docs/maps.md): a built-in's name, a .json map, or none; default:
               the built-in whose detect clause fits
  --hf-config PATH
               config.json for a mapped checkpoint without its own (written to DST)
  -h, --help   this text
)";

// Turns SIGINT and SIGTERM into `flag` for as long as it lives: the signals are blocked in
// this thread (and so in every thread started after it) and read from a signalfd by a
// watcher thread, so no handler and no global state is involved.
class StopOnSignal {
 public:
  StopOnSignal() {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    ::pthread_sigmask(SIG_BLOCK, &set, &old_);
    sig_.reset(::signalfd(-1, &set, SFD_CLOEXEC));
    wake_.reset(::eventfd(0, EFD_CLOEXEC));
    if (sig_.valid() && wake_.valid()) watcher_ = std::thread([this] { watch(); });
  }
  ~StopOnSignal() {
    if (watcher_.joinable()) {
      uint64_t one = 1;
      (void)!::write(wake_.get(), &one, sizeof one);
      watcher_.join();
    }
    ::pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  StopOnSignal(const StopOnSignal&) = delete;
  StopOnSignal& operator=(const StopOnSignal&) = delete;

  const std::atomic<bool>* flag() const { return &flag_; }

 private:
  void watch() {
    pollfd p[2] = {{sig_.get(), POLLIN, 0}, {wake_.get(), POLLIN, 0}};
    while (true) {
      if (::poll(p, 2, -1) < 0) continue;
      if (p[1].revents) return;
      if (p[0].revents) {
        signalfd_siginfo si{};
        if (::read(sig_.get(), &si, sizeof si) == static_cast<ssize_t>(sizeof si)) {
          flag_.store(true);
        }
      }
    }
  }

  std::atomic<bool> flag_{false};
  sigset_t old_{};
  UniqueFd sig_;
  UniqueFd wake_;
  std::thread watcher_;
};

}  // namespace

int cmd_consolidate(std::span<char*> argv) {
  static constexpr OptSpec spec[] = {{"threads", 'j', true},
                                     {"force", 0, false},
                                     {"dtype", 0, true},
                                     {"map", 0, true},
                                     {"hf-config", 0, true}};
  const std::string usage = fmt::format(kUsage, engine::default_threads());
  auto parsed = parse_command(argv, spec, {"consolidate", usage, "SRC and DST", 2});
  if (auto* rc = std::get_if<int>(&parsed)) return *rc;
  auto* args = &std::get<Args>(parsed);
  engine::ConsolidateOptions opts;
  if (auto t = args->get("threads")) {
    auto v = parse_unsigned(*t, "--threads");
    if (!v || *v == 0 || *v > 256) {
      fmt::print(stderr, "ckptfs consolidate: --threads must be 1..256\n");
      return 2;
    }
    opts.threads = *v;
  }
  opts.src = args->positional[0];
  opts.dst = args->positional[1];
  opts.force = args->has("force");
  if (auto st = layout::set_dtype_policy(opts.build, args->get("dtype").value_or("auto")); !st) {
    fmt::print(stderr, "ckptfs consolidate: {}\n", st.error().message);
    return 2;
  }
  if (auto st = source::set_map_options(opts.build, args->get("map").value_or(""),
                                        args->get("hf-config").value_or(""));
      !st) {
    fmt::print(stderr, "ckptfs consolidate: {}\n", st.error().message);
    return 2;
  }
  opts.on_warning = [](std::string_view w) {
    fmt::print(stderr, "ckptfs consolidate: warning: {}\n", printable(w));
  };

  // Loaded here rather than in the engine to print what is wrong, one problem a line.
  auto loaded = source::load_checkpoint_path(opts.src, opts.build);
  if (!loaded) {
    fmt::print(stderr, "ckptfs consolidate: {}\n", printable(loaded.error().message));
    if (auto below = source::find_checkpoint_dirs(opts.src); below && !below->dirs.empty()) {
      fmt::print(stderr, "checkpoints found below it:\n");
      for (const auto& d : below->dirs) fmt::print(stderr, "  {}\n", printable(d));
    }
    return 1;
  }
  if (!(*loaded)->valid()) {
    fmt::print(stderr, "ckptfs consolidate: {} is not a complete, valid checkpoint:\n",
               printable(opts.src));
    for (const auto& p : (*loaded)->problems) {
      fmt::print(stderr, "  {}\n", printable(p.to_string()));
    }
    return 1;
  }
  opts.checkpoint = *loaded;

  StopOnSignal stop;
  ProgressBar bar("consolidate");
  const bool tty = bar.enabled();
  engine::ProgressFn progress;
  if (tty) progress = [&bar](const engine::Progress& p) { bar.update(p.done, p.total); };
  auto r = engine::consolidate(opts, stop.flag(), progress);
  bar.end();
  if (!r) {
    fmt::print(stderr, "ckptfs consolidate: {}\n", printable(r.error().message));
    return 1;
  }
  if (tty) {
    fmt::print(stderr, "consolidated {} tensors into {} files ({:.2f} GB) in {:.2f}s\n", r->tensors,
               r->files, r->bytes / 1e9, r->seconds);
  }
  return 0;
}

}  // namespace ckptfs::cli
