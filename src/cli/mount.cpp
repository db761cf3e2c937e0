// `ckptfs mount SRC MNT` and the mount.fuse3 form `ckptfs SRC MNT -o opts`.
#include <sys/stat.h>

#include <limits.h>
#include <stdlib.h>

#include <algorithm>
#include <cstdlib>
#include <sstream>
#include <thread>

#include <fmt/core.h>
#include <spdlog/spdlog.h>

#include "ckptfs/cli/args.hpp"
#include "ckptfs/flush/mpi.hpp"
#include "ckptfs/fuse/adapter.hpp"
#include "ckptfs/source/maps.hpp"

namespace ckptfs::cli {
namespace {

constexpr std::string_view kUsage =
    R"(usage: ckptfs mount SRC MNT [-o opt,...] [-f] [--threads N] [--log-level L]
       ckptfs SRC MNT [-o opt,...]        (as mount.fuse3 / fstab call it)

Presents every directory of rank shards under SRC as a consolidated HuggingFace checkpoint
at MNT, synthesized on read; nothing is copied. The mount is writable: a consolidated
safetensors file written into it (save_pretrained, a Trainer's output_dir) is stored in SRC as
DCP rank shards and reads back byte for byte; everything else is written through. Returns once the mount is ready (the daemon
keeps serving in the background) unless -f is given. Unmount with 'fusermount3 -u MNT'.

options:
  -f, --foreground       stay in the foreground, log to stderr
  --threads N            FUSE worker threads (default: one per core, at least 8, at most 64)
  --log-level L          trace, debug, info, warn, error (default info)
  --log-file PATH        where a daemonized mount logs (default: syslog)
  -o opt[,opt...]        ckptfs options below, or FUSE/mount options (allow_other, ro, ...)
  -h, --help             this text

ckptfs -o options:
  ro                     read-only view: every change is refused (EROFS)
  ranks=N                rank shards per consolidated file written (default 1: one target,
                         nothing gained from more files; set it to the ranks that will load it)
  split=even|tp          how tensors are cut: evenly on dim 0 (default), or by the model's
                         base_model_tp_plan in config.json (colwise: dim 0, rowwise: dim 1)
  dtype=auto|stored|bf16|fp16|fp32
                         dtype of the tensors served: auto (default) casts to NeMo's
                         .hf_metadata/fqn_to_dtype_mapping.json where present, stored serves
                         the shards' dtypes, bf16/fp16/fp32 cast every F16/BF16/F32/F64 tensor
                         (F8, integer and bool tensors stay as stored)
  map=NAME|PATH|none      the model map serving native trainer checkpoints under HF names
                         and layouts (docs/maps.md): a built-in's name, a .json map, or none;
                         default: the built-in whose detect clause fits each checkpoint
  hf_config=PATH         config.json for mapped checkpoints without their own (the view
                         shows it as their config.json)
  lora=split|merged      a LoRA checkpoint (verl's lora_train_meta.json): the base model and
                         lora_adapter/ (split, default), or the merged model W + scale*(B@A),
                         computed on read, as PEFT's merge_and_unload() gives it (merged)
  show_shards            list the hidden shard files under <checkpoint>/.shards/
  prefetch=on|off        push consolidated files into the page cache ahead of readers
                         (default: on below 8 cores with 2 GiB available, else off)
  prefetch_threads=N     threads pushing (default: half the cores, 2 to 8)
  passthrough=on|off     the kernel reads plain files (not synthesized ones) straight from
                         SRC, no request to the daemon (FUSE passthrough, Linux 6.9+, root);
                         a write open of a file open for reading that way fails (ETXTBSY)
                         (default: on for a read-only mount, off otherwise)
  write_passthrough=on|off  files opened for writing are written by the kernel into SRC,
                         at page-cache speed; a consolidated file is stored at close as one
                         shard and split into rank shards after it (FUSE passthrough, Linux
                         6.9+, root; default on, under mpirun too)
  split_threads=N        files split into rank shards at once after their close
                         (default: one per 4 cores, 1 to 4)
  splice=on|off          zero-copy replies with spliced fd buffers (default off)
  read_ahead_kb=N        the mount's kernel read-ahead (default 8192; 0 keeps the kernel's)
  max_read=N             the largest read request in bytes (default and most: 1 MiB)
  write_mem_mb=N         memory all files being written may hold in the daemon (headers
                         being sniffed or split; default 256); past it a file is staged to disk
                         and split at close
  writer_view=SECONDS    a process that wrote through the mount in a checkpoint directory,
                         its parent or a child sees it as written (its shard files) for this
                         long after its last write, so a consolidating writer reads back what
                         it wrote (default 600; 0: never)
  settle=SECONDS         quiet time before a changed checkpoint is shown (default 1)
  revalidate=SECONDS     how long a directory's view is trusted before re-checking (default 1)
  build_threads=N        threads building checkpoint views (reading shard headers and native
                         files); lookups and listings wait for a build parked, never holding
                         a FUSE worker, so one slow directory stalls no other (default 4, 1..64)
  attr_timeout=SECONDS, entry_timeout=SECONDS   kernel cache timeouts (default 1)
  threads=N, log_level=L, log_file=PATH          as the flags above
  no_auto_unmount        do not unmount automatically if the daemon dies

parallel flush (mpirun -np N ckptfs mount SRC MNT ..., one process per node):
  mpi=auto|on|off        MPI mode: on when started by mpirun (auto, the default); off: the
                         local flusher even under mpirun. In MPI mode -f is implied (never
                         daemonized after MPI_Init), rank 0 serves MNT and ranks 1..N-1 write
                         the shards they own; ranks default to N, shard i+1 owned by rank i % N
  target=PATH            node-local targets: rank r (the head too) stores the shards it owns
                         under PATH (%r: the rank; made if missing), and SRC holds only the
                         commit records; the head reads the other ranks' shards over MPI.
                         Default: shared mode, every shard in SRC (one file system for all)
  rank_src=PATH          shared mode: SRC as rank r sees it (%r: the rank; default SRC), a
                         shared directory (Lustre, NFS) mounted at another path on its node
  mpi_timeout=SECONDS    longest wait for a rank's acknowledgement or for send credit before
                         the write fails with EIO (default 60)
  mpi_inflight_mb=N      bound on bytes sent to ranks and not yet delivered (default 256)
)";

Result<double> parse_seconds(std::string_view v, std::string_view what) {
  char* end = nullptr;
  std::string s(v);
  double d = std::strtod(s.c_str(), &end);
  if (s.empty() || *end != '\0' || d < 0 || d > 86400) {
    return make_error(EINVAL, "{}: '{}' is not a number of seconds", what, v);
  }
  return d;
}

Result<bool> parse_onoff(std::string_view v, std::string_view what) {
  if (v == "on" || v == "1" || v == "yes" || v == "true") return true;
  if (v == "off" || v == "0" || v == "no" || v == "false") return false;
  return make_error(EINVAL, "{}: expected on or off, got '{}'", what, v);
}

std::chrono::milliseconds ms(double secs) {
  return std::chrono::milliseconds(static_cast<int64_t>(secs * 1000));
}

// The parallel-flush options (only meaningful in MPI mode).
struct MpiCli {
  std::optional<bool> mode;  // -o mpi=on|off; unset: on when started by mpirun
  flush::mpi::MpiOptions opts;
};

// -o map= and -o hf_config=: read together once every option is parsed.
struct MapCli {
  std::string map, hf_config;
};

// Applies one -o option; unknown ones are passed to libfuse, which refuses what it can't use.
Status apply_option(fuse::MountOptions& o, MpiCli& m, MapCli& maps, const std::string& opt) {
  auto eq = opt.find('=');
  std::string key = opt.substr(0, eq);
  std::string val = eq == std::string::npos ? "" : opt.substr(eq + 1);
  if (key == "map" || key == "hf_config") {
    if (val.empty()) return make_error(EINVAL, "{}: empty value", key);
    (key == "map" ? maps.map : maps.hf_config) = val;
  } else if (key == "mpi") {
    if (val != "auto") {
      CKPTFS_TRY(m.mode, parse_onoff(val, "mpi"));
    }
  } else if (key == "target" || key == "rank_src") {
    if (val.empty()) return make_error(EINVAL, "{}: empty path", key);
    CKPTFS_CHECK(flush::mpi::expand_target(val, 0));
    (key == "target" ? m.opts.target : m.opts.rank_src) = val;
  } else if (key == "mpi_timeout") {
    CKPTFS_TRY(double s, parse_seconds(val, "mpi_timeout"));
    if (s <= 0) return make_error(EINVAL, "mpi_timeout: must be more than 0");
    m.opts.timeout = ms(s);
  } else if (key == "mpi_inflight_mb") {
    CKPTFS_TRY(unsigned n, parse_unsigned(val, "mpi_inflight_mb"));
    if (n < 1 || n > 65536) return make_error(EINVAL, "mpi_inflight_mb: must be 1..65536");
    m.opts.inflight_bytes = uint64_t{n} << 20;
  } else if (key == "mpi_fault") {  // hidden: R:MB, rank R's writes fail after MB MiB (tests)
    auto colon = val.find(':');
    if (colon == std::string::npos) return make_error(EINVAL, "mpi_fault: expected RANK:MB");
    CKPTFS_TRY(unsigned r, parse_unsigned(val.substr(0, colon), "mpi_fault rank"));
    CKPTFS_TRY(unsigned mb, parse_unsigned(val.substr(colon + 1), "mpi_fault MB"));
    m.opts.fault_rank = static_cast<int>(r);
    m.opts.fault_after_bytes = uint64_t{mb} << 20;
  } else if (key == "target_rate_mb") {  // hidden: caps each rank's writes (benchmark)
    CKPTFS_TRY(unsigned n, parse_unsigned(val, "target_rate_mb"));
    m.opts.target_rate_mb = n;
  } else if (key == "split_delay_ms") {  // hidden: each split after close waits first (tests)
    CKPTFS_TRY(unsigned n, parse_unsigned(val, "split_delay_ms"));
    if (n > 60'000) return make_error(EINVAL, "split_delay_ms: must be 0..60000");
    o.fs.split_gate = [d = std::chrono::milliseconds(n)] { std::this_thread::sleep_for(d); };
  } else if (key == "split_threads") {
    CKPTFS_TRY(unsigned n, parse_unsigned(val, "split_threads"));
    if (n < 1 || n > 64) return make_error(EINVAL, "split_threads: must be 1..64");
    o.fs.split_threads = n;
  } else if (key == "show_shards") {
    o.fs.show_shards = true;
  } else if (key == "prefetch") {
    CKPTFS_TRY(o.prefetch, parse_onoff(val, "prefetch"));
  } else if (key == "prefetch_threads") {
    CKPTFS_TRY(unsigned n, parse_unsigned(val, "prefetch_threads"));
    if (n < 1 || n > 64) return make_error(EINVAL, "prefetch_threads: must be 1..64, got {}", n);
    o.prefetch_threads = n;
  } else if (key == "passthrough") {
    CKPTFS_TRY(o.passthrough, parse_onoff(val, "passthrough"));
  } else if (key == "write_passthrough") {
    CKPTFS_TRY(o.write_passthrough, parse_onoff(val, "write_passthrough"));
  } else if (key == "splice") {
    CKPTFS_TRY(o.splice, parse_onoff(val, "splice"));
  } else if (key == "read_ahead_kb") {
    CKPTFS_TRY(o.read_ahead_kb, parse_unsigned(val, "read_ahead_kb"));
  } else if (key == "max_read") {
    CKPTFS_TRY(unsigned n, parse_unsigned(val, "max_read"));
    if (n < 4096) return make_error(EINVAL, "max_read: must be at least 4096, got {}", n);
    o.max_read = n;
    o.fuse_opts.push_back(opt);  // the kernel's mount option too
  } else if (key == "write_mem_mb") {
    CKPTFS_TRY(unsigned n, parse_unsigned(val, "write_mem_mb"));
    if (n < 1 || n > 1u << 20) return make_error(EINVAL, "write_mem_mb: must be 1..1048576");
    o.fs.write_memory = uint64_t{n} << 20;
  } else if (key == "writer_view") {
    CKPTFS_TRY(double sec, parse_seconds(val, "writer_view"));
    o.fs.writer_view = ms(sec);
  } else if (key == "settle") {
    CKPTFS_TRY(double s, parse_seconds(val, "settle"));
    o.fs.settle = ms(s);
  } else if (key == "revalidate") {
    CKPTFS_TRY(double s, parse_seconds(val, "revalidate"));
    o.fs.revalidate = ms(s);
  } else if (key == "attr_timeout") {
    CKPTFS_TRY(o.attr_timeout, parse_seconds(val, "attr_timeout"));
  } else if (key == "entry_timeout") {
    CKPTFS_TRY(o.entry_timeout, parse_seconds(val, "entry_timeout"));
  } else if (key == "threads") {
    CKPTFS_TRY(o.threads, parse_unsigned(val, "threads"));
  } else if (key == "build_threads") {
    CKPTFS_TRY(unsigned n, parse_unsigned(val, "build_threads"));
    if (n < 1 || n > 64) return make_error(EINVAL, "build_threads: must be 1..64, got {}", n);
    o.fs.build_threads = n;
  } else if (key == "log_level") {
    o.log_level = val;
  } else if (key == "log_file") {
    o.log_file = val;
  } else if (key == "no_auto_unmount") {
    o.auto_unmount = false;
  } else if (key == "auto_unmount") {
    o.auto_unmount = true;
  } else if (key == "rw") {
    o.fs.read_only = false;  // the default; mount(8) adds it
  } else if (key == "ro") {
    o.fs.read_only = true;  // refused here (EROFS) and by the kernel; /proc/mounts says ro
    o.fuse_opts.push_back("ro");
  } else if (key == "ranks") {
    CKPTFS_TRY(unsigned r, parse_unsigned(val, "ranks"));
    if (r < 1 || r > write::kMaxRanks) {
      return make_error(EINVAL, "ranks: must be 1..{}, got {}", write::kMaxRanks, r);
    }
    o.fs.ranks = r;
  } else if (key == "dtype") {
    CKPTFS_CHECK(layout::set_dtype_policy(o.fs.build, val));
  } else if (key == "lora") {
    if (val != "split" && val != "merged") {
      return make_error(EINVAL, "lora: expected split or merged, got '{}'", val);
    }
    o.fs.build.lora_merged = val == "merged";
  } else if (key == "split") {
    if (val == "even") {
      o.fs.split = write::PlanOptions::EvenDim0;
    } else if (val == "tp") {
      o.fs.split = write::PlanOptions::TpPlan;
    } else {
      return make_error(EINVAL, "split: expected even or tp, got '{}'", val);
    }
  } else if (key == "_netdev" || key == "nofail" || key == "noauto" || key == "user" ||
             key == "users" || key == "defaults" || key.starts_with("x-")) {
    // fstab-only options that mount.fuse3 may pass along.
  } else {
    o.fuse_opts.push_back(opt);
  }
  return {};
}

// Checks SRC and MNT, hides a mount point inside the source, mounts and serves.
int check_and_mount(fuse::MountOptions& o) {
  struct stat st {};
  if (::stat(o.source.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    fmt::print(stderr, "ckptfs mount: {}: not a directory\n", o.source);
    return 1;
  }
  if (::stat(o.mountpoint.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    fmt::print(stderr, "ckptfs mount: {}: mount point is not a directory\n", o.mountpoint);
    return 1;
  }
  // A mount point inside the source is hidden from the view (it is the view itself).
  char src_real[PATH_MAX], mnt_real[PATH_MAX];
  if (::realpath(o.source.c_str(), src_real) && ::realpath(o.mountpoint.c_str(), mnt_real)) {
    std::string s = src_real, m = mnt_real;
    if (s != "/" && m.size() > s.size() && m.starts_with(s) && m[s.size()] == '/') {
      o.fs.hide_rel = m.substr(s.size() + 1);
    } else if (s == "/" && m != "/") {
      o.fs.hide_rel = m.substr(1);
    }
  }
  return fuse::run_mount(o);
}

#if CKPTFS_HAVE_MPI
// `mpirun -np N ckptfs mount SRC MNT`: rank 0 mounts with the MPI flusher (in the foreground:
// never fork after MPI_Init), the other ranks serve its shard writes until it shuts them down
// at unmount. MPI_Init and MPI_Finalize belong to `rt`; the flusher (and with it the
// communicator) is gone before `rt` finalizes.
int mount_mpi(fuse::MountOptions& o, flush::mpi::MpiOptions mo) {
  auto rt = flush::mpi::Runtime::init();
  if (!rt) {
    fmt::print(stderr, "ckptfs mount: {}\n", rt.error().message);
    return 1;
  }
  mo.source = o.source;
  if ((*rt)->rank() != 0) return flush::mpi::serve_rank(**rt, mo);
  int rc = 1;
  {
    auto fl = flush::mpi::make_mpi_flusher(**rt, mo);
    if (!fl) {
      fmt::print(stderr, "ckptfs mount: {}\n", fl.error().message);
      return 1;
    }
    spdlog::info("mpi: head of {} rank(s) on {} (thread level {}); {} MiB in flight at most",
                 (*rt)->size(), (*rt)->host(0), (*rt)->thread_level(), mo.inflight_bytes >> 20);
    o.foreground = true;
    // With write passthrough (the default, as without mpirun) the kernel writes each file into
    // the head's SRC, close() stores it as its own one shard there, and the split after close
    // sends it to the ranks that own its shards; with write_passthrough=off each file streams
    // to its owners as it is written (WRITE requests).
    spdlog::info("mpi: {}", o.write_passthrough.value_or(true)
                                ? "a file goes to its owners after its close, in the background"
                                : "each file streams to its owners as it is written");
    o.fs.flusher = *fl;
    rc = check_and_mount(o);
    o.fs.flusher.reset();
    if (!(*fl)->shutdown()) (*rt)->abort_at_exit(rc != 0 ? rc : 1);
  }
  return rc;
}
#endif

}  // namespace

int cmd_mount(std::span<char*> argv, bool helper_form) {
  static constexpr OptSpec spec[] = {{"foreground", 'f', false}, {"threads", 0, true},
                                     {"log-level", 0, true},     {"log-file", 0, true},
                                     {"options", 'o', true},     {"debug", 'd', false}};
  auto parsed = parse_command(argv, spec,
                              {helper_form ? "(mount helper)" : "mount", kUsage, "SRC and MNT", 2});
  if (auto* rc = std::get_if<int>(&parsed)) return *rc;
  auto* args = &std::get<Args>(parsed);
  fuse::MountOptions o;
  o.fs.build.dtype_policy = layout::BuildOptions::DtypePolicy::Mapping;  // dtype=auto
  o.fs.build_threads = 4;
  MpiCli mpi;
  MapCli maps;
  o.source = args->positional[0];
  o.mountpoint = args->positional[1];
  while (o.source.size() > 1 && o.source.back() == '/') o.source.pop_back();
  o.foreground = args->has("foreground") || args->has("debug");
  if (auto t = args->get("threads")) {
    auto v = parse_unsigned(*t, "--threads");
    if (!v || *v == 0 || *v > 1024) {
      fmt::print(stderr, "ckptfs mount: --threads must be 1..1024\n");
      return 2;
    }
    o.threads = *v;
  }
  if (auto l = args->get("log-level")) o.log_level = *l;
  if (auto l = args->get("log-file")) o.log_file = *l;
  for (const auto& group : args->all("options")) {
    std::stringstream ss(group);
    std::string opt;
    while (std::getline(ss, opt, ',')) {
      if (opt.empty()) continue;
      if (auto st = apply_option(o, mpi, maps, opt); !st) {
        fmt::print(stderr, "ckptfs mount: {}\n", st.error().message);
        return 2;
      }
    }
  }
  if (auto st = source::set_map_options(o.fs.build, maps.map, maps.hf_config); !st) {
    fmt::print(stderr, "ckptfs mount: {}\n", st.error().message);
    return 2;
  }
  auto level = spdlog::level::from_str(o.log_level);
  if (level == spdlog::level::off && o.log_level != "off") {
    fmt::print(stderr, "ckptfs mount: unknown log level '{}'\n", o.log_level);
    return 2;
  }
  spdlog::set_level(args->has("debug") ? spdlog::level::debug : level);
  const bool under_mpirun = std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr;
  if (mpi.mode.value_or(under_mpirun)) {
#if CKPTFS_HAVE_MPI
    return mount_mpi(o, mpi.opts);
#else
    fmt::print(stderr, "ckptfs mount: MPI mode, but this ckptfs was built without OpenMPI\n");
    return 2;
#endif
  }
  if (!mpi.opts.target.empty() || !mpi.opts.rank_src.empty()) {
    fmt::print(stderr,
               "ckptfs mount: target= and rank_src= are for MPI mode (mpirun, or -o mpi=on)\n");
    return 2;
  }
  return check_and_mount(o);
}

}  // namespace ckptfs::cli
