#!/usr/bin/env python3
"""Write-path benchmark of the ckptfs mount (figures in docs/benchmarks.md).

One in-memory model (TinyLlama-shaped, bf16, layer count picked from --size-gb; built on the
meta device and materialized with copies of one random block, not timed) is saved, in
interleaved rounds (the order rotates each round; the machine is noisy, so compare medians and
the ratios within one run):

  (m) ckptfs  model.save_pretrained(MNT/D) into a fresh `ckptfs mount SRC MNT -f -o ranks=N`;
              timed from the call to its return, and to the moment every weights file stats
              at its full size through the mount ("readable"); with write passthrough (the
              default as root on Linux 6.9+) the kernel writes the file into SRC itself and the
              daemon stores it at close as its one shard; with ranks > 1 it splits it after
              close, and "split done" is the time until the last split committed (the status
              file's writes.splits_pending at 0; "+sync" is timed after it)
  (r) requests  the same with -o write_passthrough=off: every byte through FUSE WRITE requests
  (a) native  the same save_pretrained into SRC directly (no FUSE, no daemon)
  (b) floor   the same daemon passing a plain file through: as many bytes as the weights file,
              in the same write() pattern as safetensors' 1 MiB buffered writer (O_EXCL temp
              file, ftruncate to the full size, the header plus small tensors coalesced up to
              1 MiB, each tensor >= 1 MiB in one write, rename while open, close), but starting
              with b'not-safetensors', so the daemon stores it whole: the floor of the write
              path (the kernel's passthrough write where it is on)
  (n) plain   the (b) writer into SRC directly: what (b) costs without FUSE

Each variant runs on its own fresh mount, so the daemon's peak RSS (VmHWM from
/proc/PID/status; the daemon runs with -f, so the Popen pid is the daemon) is (m)'s alone; it
is read right after the save returns (before any read-back) and again right before unmount;
the daemon's CPU seconds (user + system, /proc/PID/stat) over the write are reported too.
The daemon binary is copied once at the start (a rebuild of --bin mid-run cannot mix builds).
After every variant: sync (timed, reported as "+sync", the time until the bytes are on the
backing file system) and removal of the outputs, so disk use stays bounded. --pool-mb N
touches N MB of tmpfs and frees it again right before each variant, so that every variant
writes into the same pool of just-freed memory: on this VM a page freed long ago costs several
times one freed just now (the host takes back reported free pages), and without it which
variant follows which decides much of its time (docs/benchmarks.md, "On equal memory").

Correctness, once per run (a benchmark of a broken write path is worthless): in round 1 every
file of (m)'s directory is read back through the mount and hashed, and must equal (a)'s files
byte for byte; SRC/D must hold exactly N rank shards per weights file and no real
model*.safetensors (the file was intercepted, not stored whole).

Usage (as root; needs a built ckptfs and the venv of tools/setup.sh):
  bench_write.py [--size-gb 2.2] [--rounds 3] [--ranks 4] [--dir /tmp/ckptfs-bench-write]
                 [--bin build/src/ckptfs] [--variants mabn] [--mount-opt OPT ...]
                 [--max-shard-size SIZE] [--json OUT] [--keep] [--pool-mb N]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import bench_fresh_pages  # noqa: E402
from bench_load import HEADS, HIDDEN, INTER, KV_HEADS, VOCAB  # noqa: E402

BUF = 1 << 20                 # safetensors' BufWriter capacity
MAX_RW = 2_147_479_552        # the kernel's cap on one write()
MARK = b"not-safetensors"
VARIANTS = {
    "m": "save_pretrained through ckptfs",
    "r": "the same, write_passthrough=off (requests)",
    "a": "save_pretrained native (SRC directly)",
    "b": "plain file through the daemon (floor)",
    "n": "plain file native (SRC directly)",
}


def log(msg: str) -> None:
    print(f"[bench_write] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the model

def model_bytes(layers: int, vocab: int = VOCAB) -> int:
    """bf16 bytes of the TinyLlama-shaped model (untied head), as tools/bench_load.py counts."""
    head_dim = HIDDEN // HEADS
    per_layer = (2 * HIDDEN * HIDDEN + 2 * HIDDEN * KV_HEADS * head_dim  # q, o, k, v
                 + 3 * HIDDEN * INTER + 2 * HIDDEN)                       # mlp, 2 norms
    return 2 * (2 * vocab * HIDDEN + HIDDEN + layers * per_layer)


def shape_for(size_gb: float) -> tuple[int, int]:
    """(layers, vocab) for about size_gb: layers of the TinyLlama shape; below one layer's
    worth, one layer and a smaller vocabulary."""
    target = size_gb * 1e9
    if target >= model_bytes(1):
        per = model_bytes(1) - model_bytes(0)
        return max(1, round((target - model_bytes(0)) / per)), VOCAB
    rest = target - model_bytes(1, 0)
    return 1, max(256, int(rest / (4 * HIDDEN)) // 64 * 64)


def build_model(size_gb: float):
    """A LlamaForCausalLM of about size_gb bf16 bytes, built on meta, then materialized."""
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    layers, vocab = shape_for(size_gb)
    cfg = LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_attention_heads=HEADS,
                      num_key_value_heads=KV_HEADS, vocab_size=vocab, num_hidden_layers=layers,
                      tie_word_embeddings=False, max_position_embeddings=2048, dtype="bfloat16")
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model = model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(32 << 20, generator=g, dtype=torch.float32).to(torch.bfloat16)  # 64 MiB
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            flat = p.view(-1)
            off, start = 0, (i * 7919) % (pool.numel() // 2)
            while off < flat.numel():
                n = min(flat.numel() - off, pool.numel() - start)
                flat[off:off + n].copy_(pool[start:start + n])
                off, start = off + n, 0
    model.eval()
    return model, layers


# ----------------------------------------------------------------------------- the plain writer

def write_plan(path: str) -> list[int]:
    """The write() sizes safetensors' 1 MiB BufWriter issues for the file at path (Rust
    BufWriter: flush when the next piece does not fit; a piece >= capacity goes out directly;
    the kernel caps one write at MAX_RW)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        hdr = json.loads(f.read(n))
    hdr.pop("__metadata__", None)
    sizes = [e["data_offsets"][1] - e["data_offsets"][0]
             for e in sorted(hdr.values(), key=lambda e: e["data_offsets"][0])]
    plan, buffered = [], 8 + n
    for s in sizes:
        if buffered + s > BUF and buffered:
            plan.append(buffered)
            buffered = 0
        if s >= BUF:
            while s:
                plan.append(min(s, MAX_RW))
                s -= plan[-1]
        else:
            buffered += s
    if buffered:
        plan.append(buffered)
    assert sum(plan) == os.path.getsize(path), (sum(plan), os.path.getsize(path))
    return plan


def source_buffer(plan: list[int]) -> memoryview:
    """Random bytes to write from, large enough for the largest single write plus an offset."""
    need = max(plan) + 64
    block = os.urandom(BUF)
    buf = bytearray(block * (need // BUF + 1))[:need]
    buf[:len(MARK)] = MARK
    return memoryview(buf)


def write_plain(d: str, name: str, plan: list[int], src: memoryview) -> None:
    """save_file's syscall shape with non-safetensors bytes: temp file, ftruncate, writes,
    rename while open, close."""
    os.makedirs(d, exist_ok=True)
    tmp = os.path.join(d, ".tmpbench")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, sum(plan))
        for i, n in enumerate(plan):
            mv = src[:n] if i == 0 else src[64:64 + n]
            while mv:
                w = os.write(fd, mv)
                mv = mv[w:]
        os.rename(tmp, os.path.join(d, name))
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- the daemon

def unmount(mnt: str) -> None:
    subprocess.run(["fusermount3", "-u", mnt], check=False, stderr=subprocess.DEVNULL)


class Daemon:
    def __init__(self, binary: str, src: str, mnt: str, opts: list[str], logpath: str):
        os.makedirs(mnt, exist_ok=True)
        if os.path.ismount(mnt):
            unmount(mnt)
        self.mnt = mnt
        self.logf = open(logpath, "ab")
        self.proc = subprocess.Popen([binary, "mount", src, mnt, "-f", "-o", ",".join(opts)],
                                     stdout=self.logf, stderr=self.logf)
        deadline = time.time() + 20
        while not os.path.ismount(mnt):
            if self.proc.poll() is not None or time.time() > deadline:
                self.close()
                with open(logpath, "rb") as f:
                    tail = f.read()[-2000:].decode(errors="replace").strip()
                raise RuntimeError(f"mount failed; {logpath} ends with:\n{tail}")
            time.sleep(0.02)

    def hwm_mb(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        return float("nan")

    def cpu_s(self) -> float:
        """User + system CPU seconds the daemon (all its threads) has used so far."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        if self.proc.poll() is None:
            unmount(self.mnt)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.logf.close()


# ----------------------------------------------------------------------------- helpers

def wait_readable(expect: dict[str, int], timeout: float = 120.0) -> None:
    """Until every path stats at its expected size."""
    deadline = time.perf_counter() + timeout
    pending = dict(expect)
    while pending:
        for p, size in list(pending.items()):
            try:
                if os.stat(p).st_size == size:
                    del pending[p]
            except FileNotFoundError:
                pass
        if pending:
            if time.perf_counter() > deadline:
                raise RuntimeError(f"not readable after {timeout:.0f} s: {sorted(pending)}")
            time.sleep(0.005)


def hash_dir(d: str) -> dict[str, str]:
    """sha256 of every file in d; a read error is recorded in place of the digest (with the
    offset it struck at), not raised: the run goes on and reports it."""
    out = {}
    buf = bytearray(1 << 20)
    for name in sorted(os.listdir(d)):
        p = os.path.join(d, name)
        if not os.path.isfile(p):
            continue
        h, off = hashlib.sha256(), 0
        try:
            with open(p, "rb", buffering=0) as f:
                while n := f.readinto(buf):
                    h.update(memoryview(buf)[:n])
                    off += n
            out[name] = h.hexdigest()
        except OSError as e:
            out[name] = f"read error at offset {off}: {e}"
            log(f"{p}: read error at offset {off} of {os.path.getsize(p)}: {e}")
    return out


def wait_splits(mnt: str, timeout: float = 600.0) -> None:
    """Waits until the mount has no split after close queued or running."""
    deadline = time.monotonic() + timeout
    status = os.path.join(mnt, ".ckptfs", "status.json")
    while True:
        with open(status) as f:
            if json.load(f)["writes"].get("splits_pending", 0) == 0:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"splits after close still pending after {timeout:.0f} s")
        time.sleep(0.01)


def timed_sync() -> float:
    t0 = time.perf_counter()
    os.sync()
    return time.perf_counter() - t0


def remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.unlink(path)


def fs_type(path: str) -> str:
    best, typ = "", "?"
    real = os.path.realpath(path)
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            mp = parts[1]
            if (real == mp or real.startswith(mp.rstrip("/") + "/")) and len(mp) >= len(best):
                best, typ = mp, parts[2]
    return typ


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def check_intercepted(src_d: str, weights: list[str], ranks: int) -> list[str]:
    """Problems with SRC/D after (m): each weights file must be N rank shards, none stored whole."""
    problems = []
    names = os.listdir(src_d)
    for w in weights:
        if w in names:
            problems.append(f"{w} is stored whole in SRC (not intercepted)")
        m = re.fullmatch(r"model(?:-(\d{5})-of-(\d{5}))?\.safetensors", w)
        k, of = (m.group(1), m.group(2)) if m and m.group(1) else ("00001", "00001")
        shards = [n for n in names if re.fullmatch(rf"shard-\d{{5}}-model-{k}-of-{of}\.safetensors", n)]
        if len(shards) != ranks:
            problems.append(f"{w}: {len(shards)} rank shards in SRC, expected {ranks}")
    return problems


# ----------------------------------------------------------------------------- main

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=2.2, help="model size in GB (default 2.2)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=4, help="-o ranks=N of the mount (default 4)")
    ap.add_argument("--dir", default="/tmp/ckptfs-bench-write",
                    help="where SRC and MNT live (default /tmp/...; /dev/shm/... takes the disk out)")
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "src", "ckptfs"))
    ap.add_argument("--variants", default="mabn",
                    help="which of m, r, a, b, n to run (default mabn; m, r and b need a writable "
                         "mount)")
    ap.add_argument("--mount-opt", action="append", default=[], help="extra -o option (repeatable)")
    ap.add_argument("--max-shard-size", help="save_pretrained's max_shard_size (default: its own, 50GB)")
    ap.add_argument("--json", metavar="OUT", help="write the results as JSON here")
    ap.add_argument("--keep", action="store_true", help="keep --dir (daemon logs) afterwards")
    ap.add_argument("--pool-mb", type=int, default=0,
                    help="touch and free this many MB of tmpfs before each variant")
    args = ap.parse_args()
    sys.stdout.reconfigure(line_buffering=True)

    variants = [v for v in "mrabn" if v in args.variants]
    if not variants or set(args.variants) - set("mrabn"):
        ap.error("--variants takes letters from m, r, a, b, n")
    if args.rounds < 1 or args.ranks < 1 or args.size_gb <= 0:
        ap.error("--rounds, --ranks and --size-gb must be positive")
    if set(variants) & set("mrb") and not os.access(args.bin, os.X_OK):
        ap.error(f"--bin {args.bin} is not an executable")
    if os.geteuid() != 0:
        log("warning: not root; mounting may fail")

    size = model_bytes(*shape_for(args.size_gb))
    probe = args.dir
    while not os.path.exists(probe):
        probe = os.path.dirname(probe) or "."
    free = shutil.disk_usage(probe).free
    if free < 3 * size:
        print(f"refusing: {args.dir} has {free / 1e9:.2f} GB free, the benchmark needs at least "
              f"3x the model size ({3 * size / 1e9:.2f} GB). Free some space, pass a smaller "
              f"--size-gb, or another --dir.", file=sys.stderr)
        return 2
    tmpfs = fs_type(probe) == "tmpfs"
    need_ram = size * (2 if tmpfs else 1) + (1 << 30)
    if mem_available() < need_ram:
        print(f"refusing: {mem_available() / 1e9:.2f} GB of memory available, the model "
              f"{'and its tmpfs copy ' if tmpfs else ''}need about {need_ram / 1e9:.2f} GB.",
              file=sys.stderr)
        return 2

    os.makedirs(args.dir, exist_ok=True)
    src = os.path.join(args.dir, "src")
    mnt = os.path.join(args.dir, "mnt")
    if os.path.ismount(mnt):
        unmount(mnt)
    shutil.rmtree(src, ignore_errors=True)
    os.makedirs(src)
    opts = [f"ranks={args.ranks}", *args.mount_opt]
    binary, bin_sha = args.bin, None
    if set(variants) & set("mrb"):
        # One build for the whole run: a copy, so a rebuild of --bin meanwhile cannot mix builds.
        binary = os.path.join(args.dir, "ckptfs")
        shutil.copy2(args.bin, binary)
        with open(binary, "rb") as f:
            bin_sha = hashlib.file_digest(f, "sha256").hexdigest()
        log(f"daemon: copy of {args.bin} (sha256 {bin_sha[:12]}, mtime "
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(os.stat(args.bin).st_mtime))})")
    save_kw = {"max_shard_size": args.max_shard_size} if args.max_shard_size else {}

    load_start = os.getloadavg()
    t0 = time.perf_counter()
    model, layers = build_model(args.size_gb)
    log(f"model: {layers} layers, {size / 1e9:.2f} GB of bf16 tensors, built in {time.perf_counter() - t0:.1f} s "
        "(not timed)")

    # Untimed warm-up: one native save (pays one-time costs, gives the expected files and sizes).
    warm = os.path.join(src, "warmup")
    model.save_pretrained(warm, **save_kw)
    files = {n: os.path.getsize(os.path.join(warm, n)) for n in sorted(os.listdir(warm))}
    weights = [n for n in files if n.endswith(".safetensors")]
    wbytes = sum(files[w] for w in weights)
    plans = {w: write_plan(os.path.join(warm, w)) for w in weights}
    srcbuf = source_buffer([n for p in plans.values() for n in p])
    remove(warm)
    os.sync()
    log(f"files: {', '.join(f'{n} ({s} B)' for n, s in files.items())}; "
        f"plain writer: {sum(len(p) for p in plans.values())} write() calls")

    runs: dict[str, list[dict]] = {v: [] for v in variants}
    hashes: dict[str, dict[str, str]] = {}
    problems: list[str] = []

    def run_variant(v: str, rnd: int) -> dict:
        r: dict = {"round": rnd}
        d_name = f"{v}-r{rnd}"
        daemon = None
        if v in "mrb":
            vopts = opts + (["write_passthrough=off"] if v == "r" else [])
            daemon = Daemon(binary, src, mnt, vopts, os.path.join(args.dir, f"daemon-{d_name}.log"))
        base = mnt if daemon else src
        cpu0 = daemon.cpu_s() if daemon else 0.0
        out = os.path.join(base, d_name)
        try:
            if v in "mra":
                expect = {os.path.join(out, w): files[w] for w in weights}
                t0 = time.perf_counter()
                model.save_pretrained(out, **save_kw)
                t1 = time.perf_counter()
                wait_readable(expect)
                t2 = time.perf_counter()
            else:
                os.makedirs(out)
                expect = {os.path.join(out, w + ".plain"): files[w] for w in weights}
                t0 = time.perf_counter()
                for w in weights:
                    write_plain(out, w + ".plain", plans[w], srcbuf)
                t1 = time.perf_counter()
                wait_readable(expect)
                t2 = time.perf_counter()
            r["return_s"], r["readable_s"] = t1 - t0, t2 - t0
            if daemon:
                r["rss_write_mb"] = daemon.hwm_mb()
                r["daemon_cpu_s"] = daemon.cpu_s() - cpu0
                # With ranks > 1 a file the kernel wrote is split after close: the time until
                # the last split committed (status.json's writes.splits_pending reaches 0).
                wait_splits(mnt)
                r["split_s"] = time.perf_counter() - t0
                r["daemon_cpu_split_s"] = daemon.cpu_s() - cpu0
            if v in "mra" and rnd == 1:
                t3 = time.perf_counter()
                hashes[v] = hash_dir(out)
                log(f"({v}) read back and hashed {len(hashes[v])} files in {time.perf_counter() - t3:.1f} s")
            r["sync_s"] = timed_sync()
            if v in "mr":
                src_d = os.path.join(src, d_name)
                r["src_files"] = sorted(os.listdir(src_d))
                if rnd == 1:
                    problems.extend(check_intercepted(src_d, weights, args.ranks))
            if daemon:
                r["rss_unmount_mb"] = daemon.hwm_mb()
                try:
                    remove(out)  # through the mount: also removes the shards and .ckptfs
                except OSError as e:
                    r["remove_error"] = str(e)
        finally:
            if daemon:
                daemon.close()
        leftover = os.path.join(src, d_name)
        if os.path.exists(leftover):
            if daemon:
                r["leftover_in_src"] = sorted(os.listdir(leftover)) if os.path.isdir(leftover) else [d_name]
            remove(leftover)
        os.sync()
        return r

    try:
        for rnd in range(1, args.rounds + 1):
            k = (rnd - 1) % len(variants)
            for v in variants[k:] + variants[:k]:
                if args.pool_mb:
                    bench_fresh_pages.warm(args.pool_mb)
                r = run_variant(v, rnd)
                runs[v].append(r)
                extra = (f"  daemon: RSS {r['rss_write_mb']:.0f} MB, CPU {r['daemon_cpu_s']:.2f} s; "
                         f"split done {r['split_s']:.2f} s (daemon CPU {r['daemon_cpu_split_s']:.2f} s)"
                         if "rss_write_mb" in r else "")
                log(f"round {rnd} ({v}) {VARIANTS[v]}: return {r['return_s']:.2f} s, readable "
                    f"{r['readable_s']:.2f} s, +sync {r['sync_s']:.2f} s, "
                    f"{wbytes / r['return_s'] / 1e9:.2f} GB/s{extra}")
    finally:
        if os.path.ismount(mnt):
            unmount(mnt)

    # ---- correctness
    verified = None
    for v in "mr":
        if v not in hashes or "a" not in hashes:
            continue
        verified = (verified is not False) and hashes[v] == hashes["a"]
        for n in sorted(set(hashes[v]) | set(hashes["a"])):
            if hashes[v].get(n) != hashes["a"].get(n):
                problems.append(f"({v}) {n}: through the mount [{hashes[v].get(n, 'missing')}] "
                                f"!= native [{hashes['a'].get(n, 'missing')}]")
    for r in runs.get("m", []) + runs.get("r", []) + runs.get("b", []):
        if r.get("remove_error"):
            problems.append(f"round {r['round']}: removal through the mount failed: {r['remove_error']}")
        if r.get("leftover_in_src"):
            problems.append(f"round {r['round']}: removal through the mount left {r['leftover_in_src']} in SRC")

    # ---- summary
    med = {v: {k: statistics.median(r[k] for r in rs) for k in ("return_s", "readable_s", "sync_s")}
           for v, rs in runs.items()}
    gbps = {v: wbytes / m["return_s"] / 1e9 for v, m in med.items()}
    gbps_readable = {v: wbytes / m["readable_s"] / 1e9 for v, m in med.items()}
    gbps_synced = {v: wbytes / (m["return_s"] + m["sync_s"]) / 1e9 for v, m in med.items()}
    ratios = {}
    if "m" in gbps and "b" in gbps:
        ratios["m/b"] = gbps["m"] / gbps["b"]
        ratios["m/b readable"] = gbps_readable["m"] / gbps_readable["b"]
    if "m" in gbps and "a" in gbps:
        ratios["m/a"] = gbps["m"] / gbps["a"]
        ratios["m/a readable"] = gbps_readable["m"] / gbps_readable["a"]
        ratios["m/a with sync"] = gbps_synced["m"] / gbps_synced["a"]
    if "r" in gbps and "a" in gbps:
        ratios["r/a"] = gbps["r"] / gbps["a"]
    if "m" in gbps and "r" in gbps:
        ratios["m/r"] = gbps["m"] / gbps["r"]
    if "b" in gbps and "n" in gbps:
        ratios["b/n"] = gbps["b"] / gbps["n"]
    if "a" in gbps and "n" in gbps:
        ratios["a/n"] = gbps["a"] / gbps["n"]
    rss = {v: {"write_mb": max(r["rss_write_mb"] for r in runs[v]),
               "unmount_mb": max(r["rss_unmount_mb"] for r in runs[v])} for v in "mrb" if v in runs}

    print()
    print(f"{'measurement (median of ' + str(args.rounds) + ')':46s} {'s':>7s} {'GB/s':>7s} "
          f"{'readable s':>10s} {'+sync s':>8s}  note")
    for v in variants:
        m = med[v]
        note = ""
        if v == "m":
            notes = [f"m/b {ratios['m/b']:.2f}"] if "m/b" in ratios else []
            if "m/a" in ratios:
                notes.append(f"m/a {ratios['m/a']:.2f} (target >= 0.9; readable "
                             f"{ratios['m/a readable']:.2f}, with sync "
                             f"{ratios['m/a with sync']:.2f})")
            if "m/r" in ratios:
                notes.append(f"m/r {ratios['m/r']:.2f}")
            note = ", ".join(notes)
        elif v == "r" and "r/a" in ratios:
            note = f"r/a {ratios['r/a']:.2f}"
        elif v == "b" and "b/n" in ratios:
            note = f"b/n {ratios['b/n']:.2f}"
        elif v == "a" and "a/n" in ratios:
            note = f"a/n {ratios['a/n']:.2f}"
        print(f"({v}) {VARIANTS[v]:42s} {m['return_s']:7.2f} {gbps[v]:7.2f} {m['readable_s']:10.2f} "
              f"{m['sync_s']:8.2f}  {note}")
    cpu = {v: statistics.median(r["daemon_cpu_s"] for r in runs[v]) for v in "mrb" if v in runs}
    for v, x in rss.items():
        tgt = " (target <= 256 MB)" if v in "mr" else ""
        print(f"daemon peak RSS (VmHWM), ({v}): {x['write_mb']:.0f} MB after the write, "
              f"{x['unmount_mb']:.0f} MB at unmount{tgt}")
    for v, c in cpu.items():
        print(f"daemon CPU (user + system) during the write, ({v}): {c:.2f} s, {c / (wbytes / 1e9):.2f} s/GB")
    for v in "mr":
        if v in runs and runs[v] and "split_s" in runs[v][0]:
            sp = statistics.median(r["split_s"] for r in runs[v])
            spc = statistics.median(r["daemon_cpu_split_s"] for r in runs[v])
            ref = (f", {sp / med['a']['return_s']:.2f}x (a)'s return" if "a" in med else "")
            print(f"({v}) splits after close done: {sp:.2f} s after the call{ref}; daemon CPU to "
                  f"then {spc:.2f} s")
    if verified is not None:
        print(f"correctness: ({'/'.join(v for v in 'mr' if v in hashes)}) read back through the "
              f"mount == (a), {len(hashes['a'])} files sha256: "
              f"{'OK' if verified else 'MISMATCH'}")
    for p in problems:
        print(f"PROBLEM: {p}")
    machine = {"kernel": os.uname().release, "cpus": os.cpu_count(),
               "mem_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
               "python": platform.python_version(), "dir_fs": fs_type(args.dir),
               "bin_sha256": bin_sha, "loadavg_start": load_start, "loadavg_end": os.getloadavg()}
    try:
        import safetensors
        import torch
        import transformers
        machine.update(torch=torch.__version__, transformers=transformers.__version__,
                       safetensors=safetensors.__version__)
    except ImportError:
        pass
    print(f"\nmachine: {machine['kernel']}, {machine['cpus']} cpus, {machine['mem_gb']} GiB; dir: {args.dir} "
          f"({machine['dir_fs']}); {wbytes / 1e9:.3f} GB in {', '.join(weights)}; ranks={args.ranks}; "
          f"bin: {args.bin}; load average {load_start[0]:.1f} at the start, "
          f"{machine['loadavg_end'][0]:.1f} at the end")

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "machine": machine, "layers": layers, "files": files,
                       "weights_bytes": wbytes, "mount_opts": opts, "runs": runs, "median": med,
                       "gbps": gbps, "gbps_readable": gbps_readable, "gbps_with_sync": gbps_synced,
                       "ratios": ratios, "rss": rss, "daemon_cpu_s": cpu, "verified": verified, "hashes": hashes,
                       "problems": problems}, f, indent=2)
    if not args.keep:
        shutil.rmtree(args.dir, ignore_errors=True)
    return 1 if problems or verified is False else 0


if __name__ == "__main__":
    sys.exit(main())
