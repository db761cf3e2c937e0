#!/usr/bin/env bash
# The GPU node's measurements (issue 24) in one call: the loader's CUDA path checked and timed,
# and the read path's 16-core defaults, on the device machine (one H100, 16 cores, no network).
#
# On this machine, first:   tools/gpu_node.sh pack      (builds release, fills .gpu/, ~5 MB)
# Then, through the device tool (carry .gpu, one call, timeout 600):
#   tools/gpu_node.sh run [quick|full]
# Without a GPU (here), `tools/gpu_node.sh run dry` runs the same steps small, on the CPU, and
# the GPU-only ones report themselves skipped: it checks the plumbing, not the figures (here:
# PYTHON=~/.cache/ckptfs/venv/bin/python; on the node its python3 holds torch).
#
# What `run` does, each step's output under $OUT (or .gpu/out), the summary printed last:
#   1. the node: nvidia-smi, cores, memory, torch's view of the GPU
#   2. correctness: tests/python/test_load.py (its GPU tests run where torch sees a GPU), and
#      compute-sanitizer (memcheck) on `ckptfs load --device cuda:0` of a small checkpoint
#   3. fault cases on the GPU: a destination too small, more memory than the card has, a
#      file truncated during the load (each: a clean error, then the GPU still loads)
#   4. speed: tools/bench_loader.py (ckptfs load to cuda:0 and cpu, the binding,
#      safetensors native and through the mount, preadv limit), warm and cold, threads 1..16
#   5. the 16-core read path: tools/bench_read.py (4 x 1 GiB, 1 and 4 readers, prefetch
#      default/on/off) and tools/bench_load.py --size 8 (mount vs native vs consolidate)
# Sizes: quick (2 GB loader, 1 GiB reads, 2 GB load: meant to fit one 10-minute call, not yet
# timed on the node), full (8 GB loader and load: may outrun one call's 600 s).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PACK=$ROOT/.gpu

pack() {
  set -e
  # A release build without OpenMPI (the node has none: the flusher is not measured there);
  # CUDA and NCCL are the node's own (its libcudart and libnccl, found at run time).
  [[ -f build-gpu/build.ninja ]] ||
    meson setup build-gpu -Dbuildtype=release -Dtests=disabled -Dmpi=disabled -Dcuda=enabled >/dev/null
  ninja -C build-gpu src/ckptfs src/libckptfs_load.so >/dev/null
  rm -rf "$PACK" && mkdir -p "$PACK/bin" "$PACK/lib"
  cp build-gpu/src/ckptfs "$PACK/bin/"
  cp build-gpu/src/libckptfs_load.so "$PACK/lib/"
  cp "$(command -v fusermount3)" "$PACK/bin/"
  for lib in libfuse3.so.3 libspdlog.so.1.10 libfmt.so.9; do
    cp -L "$(ldconfig -p | awk -v l="$lib" '$1 == l {print $NF; exit}')" "$PACK/lib/$lib"
  done
  du -sh "$PACK"
  echo "carry: .gpu   command: tools/gpu_node.sh run quick"
}

run() {
  local size=${1:-quick}
  local out=${OUT:-$PACK/out}
  mkdir -p "$out"
  local py=${PYTHON:-python3}
  # libcudart.so.13 and libnccl.so.2: the CUDA toolkit's, else those of torch's pip packages.
  local cudalibs
  cudalibs=$("$py" -c 'import glob, os, site
dirs = ["/usr/local/cuda/lib64"]
for sp in site.getsitepackages():
    dirs += glob.glob(os.path.join(sp, "nvidia", "*", "lib"))
print(":".join(d for d in dirs if os.path.isdir(d)))' 2>/dev/null)
  export LD_LIBRARY_PATH="$PACK/lib:$cudalibs:${LD_LIBRARY_PATH:-}" PATH="$PACK/bin:$PATH"
  export CKPTFS_BIN=$PACK/bin/ckptfs CKPTFS_LOAD_LIB=$PACK/lib/libckptfs_load.so
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONDONTWRITEBYTECODE=1
  local gb=2 read_mb=1024 load_gb=2 threads="1,4,16"
  [[ $size == full ]] && gb=8 && load_gb=8
  [[ $size == dry ]] && gb=0.2 && read_mb=128 && load_gb=0.2 && threads="1,2"
  local summary=$out/summary.txt
  : >"$summary"
  note() { echo "$*" | tee -a "$summary"; }
  step() { printf '\n=== %s\n' "$*"; }

  step "1 the node"
  { nvidia-smi 2>&1 | head -n 15; nproc; free -g; "$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")'; } >"$out/node.txt" 2>&1
  ldd "$CKPTFS_BIN" "$CKPTFS_LOAD_LIB" | grep -E "not found|cudart|nccl" >>"$out/node.txt"
  cat "$out/node.txt"
  local gpu
  gpu=$("$py" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)
  note "node: $(nproc) cores, gpu=$gpu, size=$size"

  step "2 correctness: test_load.py, compute-sanitizer"
  local dir=/tmp/ckptfs-gpu
  rm -rf "$dir" && mkdir -p "$dir"
  "$py" -m pytest tests/python/test_load.py -q -p no:cacheprovider >"$out/test_load.txt" 2>&1
  note "test_load.py: $(tail -n 1 "$out/test_load.txt")"
  "$py" tests/python/shardgen.py --help >/dev/null 2>&1 || true
  "$py" - "$dir/small" <<'EOF' >"$out/gen_small.txt" 2>&1
import sys, torch
from safetensors.torch import save_file
g = torch.Generator().manual_seed(0)
import os; os.makedirs(sys.argv[1], exist_ok=True)
save_file({f"w{i}": torch.randn(256, 1024, generator=g).to(torch.bfloat16) for i in range(16)},
          os.path.join(sys.argv[1], "model.safetensors"))
EOF
  if ((gpu)) && command -v compute-sanitizer >/dev/null; then
    compute-sanitizer --tool memcheck "$CKPTFS_BIN" load "$dir/small" --device cuda:0 >"$out/sanitizer.txt" 2>&1
    note "compute-sanitizer memcheck: $(grep -E 'ERROR SUMMARY' "$out/sanitizer.txt" || tail -n 1 "$out/sanitizer.txt")"
  else
    note "compute-sanitizer: skipped (no GPU or no compute-sanitizer)"
  fi

  step "3 fault cases on the GPU"
  if ((gpu)); then
    "$py" - "$dir/small" <<'EOF' >"$out/faults.txt" 2>&1
import os, sys, shutil, subprocess, threading, torch
sys.path.insert(0, "python")
import ckptfs_load
d, binary = sys.argv[1], os.environ["CKPTFS_BIN"]
def usable():
    sd = ckptfs_load.load_state_dict(d, device="cuda:0")  # the GPU is still usable after it
    print(f"  then a load: {len(sd)} tensors on {next(iter(sd.values())).device}")
def case(name, f):
    try:
        f(); print(f"{name}: NO ERROR (wrong)")
    except Exception as e:  # noqa: BLE001
        print(f"{name}: error: {type(e).__name__}: {str(e)[:200]}")
    usable()
def too_small():  # a destination smaller than the tensor
    t = torch.empty(16, dtype=torch.bfloat16, device="cuda:0")
    with ckptfs_load.Checkpoint(d) as ck:
        ck.load([("w0", t.data_ptr(), t.numel() * 2)], device="cuda:0")
def alloc_failure():  # the pinned ring asks for far more than the host has
    r = subprocess.run([binary, "load", d, "--device", "cuda:0", "--chunk-mb", "65536", "--ring", "64"],
                       capture_output=True, text=True, timeout=120)
    if r.returncode == 0: return
    raise RuntimeError(f"exit {r.returncode}: {r.stderr.strip()[:200]}")
def truncated():  # the file cut in half while the load runs
    cut = d + "-trunc"
    shutil.copytree(d, cut, dirs_exist_ok=True)
    p = os.path.join(cut, "model.safetensors")
    threading.Timer(0.001, lambda: os.truncate(p, os.path.getsize(p) // 2)).start()
    for _ in range(50):
        ckptfs_load.load_state_dict(cut, device="cuda:0")
for n, f in (("destination too small", too_small), ("allocation failure", alloc_failure),
             ("truncated during the load", truncated)):
    case(n, f)
EOF
    note "faults: $(grep -c 'error:' "$out/faults.txt") of 3 refused cleanly (details in faults.txt)"
  else
    note "faults: skipped (no GPU)"
  fi

  step "4 loader speed (bench_loader.py, ${gb} GB)"
  IFS=, read -ra tlist <<<"$threads"
  for t in "${tlist[@]}"; do
    "$py" tools/bench_loader.py --dir "$dir/loader" --size "$gb" --threads "$t" --modes warm,cold \
      --repeat 3 --bin "$CKPTFS_BIN" >"$out/loader_t$t.txt" 2>&1
    note "bench_loader threads=$t: $(grep -cE '^\|' "$out/loader_t$t.txt") table rows (loader_t$t.txt)"
  done

  step "5 the read path (bench_read.py ${read_mb} MiB x4; bench_load.py ${load_gb} GB)"
  for pf in default on off; do
    local opt=()
    [[ $pf != default ]] && opt=(--mount-opt "prefetch=$pf")
    "$py" tools/bench_read.py --dir /dev/shm/ckptfs-gpu-read --size-mb "$read_mb" --repeat 3 \
      --parallel 4 --bin "$CKPTFS_BIN" "${opt[@]}" >"$out/read_prefetch_$pf.txt" 2>&1
    note "bench_read prefetch=$pf: exit $? (read_prefetch_$pf.txt)"
  done
  "$py" tools/bench_load.py --size "$load_gb" --storage tmpfs --modes warm,cold --bin "$CKPTFS_BIN" \
    >"$out/load.txt" 2>&1
  note "bench_load: exit $? (load.txt)"
  rm -rf "$dir" /dev/shm/ckptfs-gpu-read
  step "summary"
  cat "$summary"
}

case "${1:-}" in
  pack) pack ;;
  run) shift; run "$@" ;;
  *) sed -n 2,22p "$0"; exit 2 ;;
esac
