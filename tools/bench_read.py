#!/usr/bin/env python3
"""Read-path benchmark of the ckptfs mount (figures in docs/benchmarks.md).

Measures, side by side in one run (the machine is noisy: compare ratios, not absolutes):
  native     cold buffered read of a plain file on the backing file system
  floor      the same plain file read cold through the ckptfs daemon (pass-through): FUSE cost
  view-row   cold read of a consolidated file whose tensors are row-sharded (8 ranks)
  view-col   cold read of a consolidated file whose tensors are column-sharded
             (8 ranks, BF16, 1 KiB runs)
  warm       re-read of view-row with the page cache warm, against a warm native read
  mmap       cold mmap copy-out of every tensor in file order (what safetensors loaders do),
             with the daemon's prefetch on and off, against a cold buffered read of the view
  rss        the daemon's peak RSS (VmHWM) over the whole run
  ls         `ls -l` of a 10,000-tensor, 1,000-shard checkpoint (first listing builds the model)

"Cold" drops the page cache (echo 3 > /proc/sys/vm/drop_caches) before each read, so with
--dir on tmpfs only the FUSE side is cold; on a disk-backed --dir both are.

  --warm-compare OTHER  only the warm re-read of view-row, alternating --bin and OTHER for
             --repeat rounds (fresh mount, one read to fill the page cache, 5 timed re-reads)
  --warm-like  only the warm re-read, compared like for like (see docs/benchmarks.md): each
             round mounts afresh, reads the view once, copies the plain file to a fresh native
             file (pages in the same state), then times 5 re-reads of each, interleaved, 4 MiB
             unbuffered reads; the first re-read and the steady ones are reported apart
  --parallel N  only N readers at once, each of its own view (hard links of view-row's
             shards), fresh mount per configuration: first read and re-read, aggregate GB/s,
             for each --config (mount options, e.g. --config prefetch=off --config splice=on)
  --warm-rows  only the three warm re-read rows of issue 23, for the row-sharded view, a
             native ext4 file of the same bytes (in the page cache; never tmpfs) and a plain
             copy of the same bytes served unchanged by the same daemon, alternating:
               read    read(2) of the whole file into one 4 MiB buffer
               load    safetensors.torch.load_file + materialise every tensor (--materialise:
                       touch one byte per 4 KiB, or copy into preallocated tensors)
               mmap    a shared read-only mmap, one byte touched per 4 KiB
             Per row and round: a fresh mount and a fresh native file; the view and the plain
             file are read once through the mount (the cold first read, timed), the native file
             is written, evicted and read once from disk (--native-fill read; or only written,
             --native-fill write), so each page cache has been filled once; then the first
             re-read of each, then --passes re-reads of each, interleaved (steady = their
             median). Per pass: GB/s, minor faults and user+sys CPU of this process
             (getrusage). Defaults for this mode: --size-mb 768, --bin build-release/src/ckptfs.

Usage: sudo tools/bench_read.py [--dir /dev/shm/ckptfs-bench] [--size-mb 1024] [--repeat 3]
                               [--bin build/src/ckptfs] [--splice] [--mount-opt OPT ...]
                               [--warm-compare OTHER_BIN] [--warm-like]
                               [--parallel N [--config OPTS ...]]
                               [--warm-rows [--rows read,load,mmap] [--passes 5]
                                [--native-dir /var/tmp] [--native-fill read|write]
                                [--materialise touch|copy]]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import shutil
import statistics
import struct
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_shard(path: str, tensors: list[tuple[str, str, list[int], list[int], bytes]]) -> None:
    """tensors: (name, dtype, chunk shape, saved_offsets, raw bytes)."""
    entries, info, pos = {}, {}, 0
    for name, dt, shape, offs, raw in tensors:
        entries[name] = {"dtype": dt, "shape": shape, "data_offsets": [pos, pos + len(raw)]}
        info[name] = {"saved_offsets": offs}
        pos += len(raw)
    meta = {"DCP_SHARDING_INFO": json.dumps(info), "DCP_VERSION": "1.0", "format": "pt"}
    text = json.dumps({"__metadata__": meta, **entries}, separators=(",", ":")).encode()
    text += b" " * ((8 - (8 + len(text)) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for t in tensors:
            f.write(t[4])


def block(n: int, seed: int) -> bytes:
    base = os.urandom(1 << 20) if seed else bytes(1 << 20)
    reps = -(-n // len(base))
    return (base * reps)[:n]


def make_data(root: str, size: int, ranks: int = 8) -> None:
    """row/ and col/ checkpoints of `size` tensor bytes each, and plain/file of the row view's size."""
    ntensors = 16
    per = size // ntensors
    cols = ranks * 512  # BF16: 512 columns x 2 bytes = 1 KiB runs per rank
    rows = per // (cols * 2)
    for layout in ("row", "col"):
        d = os.path.join(root, layout)
        os.makedirs(d, exist_ok=True)
        shards: dict[int, list] = {r: [] for r in range(ranks)}
        for t in range(ntensors):
            name = f"model.layers.{t}.mlp.up_proj.weight"
            for r in range(ranks):
                if layout == "row":
                    shape, offs = [rows // ranks, cols], [r * (rows // ranks), 0]
                else:
                    shape, offs = [rows, cols // ranks], [0, r * (cols // ranks)]
                raw = block(shape[0] * shape[1] * 2, r + 1)
                shards[r].append((name, "BF16", shape, offs, raw))
        for r, ts in shards.items():
            write_shard(os.path.join(d, f"shard-{r + 1:05d}-model-00001-of-00001.safetensors"), ts)
    plain = os.path.join(root, "plain")
    os.makedirs(plain, exist_ok=True)
    with open(os.path.join(plain, "file.bin"), "wb") as f:
        remaining = ntensors * rows * cols * 2 + 4096
        chunk = block(64 << 20, 7)
        while remaining > 0:
            f.write(chunk[:remaining])
            remaining -= len(chunk)


def ensure_data(root: str, size_mb: int) -> str:
    """Generates row/, col/ and plain/ under root/src once per size; returns root/src."""
    src = os.path.join(root, "src")
    stamp = os.path.join(src, f".size-{size_mb}")
    if not os.path.exists(stamp):
        shutil.rmtree(src, ignore_errors=True)
        os.makedirs(src)
        make_data(src, size_mb << 20)
        open(stamp, "w").close()
    return src


def make_many(root: str, shards: int = 1000, tensors: int = 10000) -> None:
    d = os.path.join(root, "many")
    if os.path.isdir(d):
        return
    os.makedirs(d)
    per_shard: dict[int, list] = {s: [] for s in range(shards)}
    for t in range(tensors):
        for j in range(4):
            s = (t * 4 + j) % shards
            per_shard[s].append((f"model.layers.{t // 8}.w{t % 8}.weight", "BF16", [4, 64], [j * 4, 0],
                                 bytes(4 * 64 * 2)))
    for s, ts in per_shard.items():
        write_shard(os.path.join(d, f"shard-{s + 1:05d}-model-00001-of-00001.safetensors"), ts)


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def read_seq(path: str, bs: int = 1 << 20) -> tuple[float, int]:
    buf = bytearray(bs)
    mv = memoryview(buf)
    fd = os.open(path, os.O_RDONLY)
    total = 0
    t0 = time.perf_counter()
    while True:
        n = os.readv(fd, [mv])
        if n <= 0:
            break
        total += n
    dt = time.perf_counter() - t0
    os.close(fd)
    return dt, total


_OUT = None  # destination buffer for mmap copy-outs, allocated and touched once


def read_mmap(path: str) -> tuple[float, int]:
    """Copies out every tensor in file order through a shared mmap, as safetensors loaders do
    (numpy does the copy, into a destination touched beforehand, so the figure is the cost of
    faulting the mapping, not of Python or of first-touching fresh memory)."""
    import numpy as np
    global _OUT
    size = os.path.getsize(path)
    if _OUT is None or len(_OUT) < size:
        _OUT = np.ones(size, dtype=np.uint8)
    fd = os.open(path, os.O_RDONLY)
    t0 = time.perf_counter()
    mm = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    (n,) = struct.unpack("<Q", mm[:8])
    hdr = json.loads(mm[8:8 + n])
    hdr.pop("__metadata__", None)
    start = 8 + n
    src = np.frombuffer(mm, dtype=np.uint8)
    total = 0
    for _, e in sorted(hdr.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        a, b = e["data_offsets"]
        np.copyto(_OUT[a:b], src[start + a:start + b])
        total += b - a
    dt = time.perf_counter() - t0
    del src
    mm.close()
    os.close(fd)
    return dt, total


class Daemon:
    def __init__(self, binary: str, src: str, mnt: str, opts: list[str]):
        os.makedirs(mnt, exist_ok=True)
        self.mnt = mnt
        self.proc = subprocess.Popen([binary, "mount", src, mnt, "-f", "-o", ",".join(opts)],
                                     stderr=subprocess.DEVNULL)
        deadline = time.time() + 20
        while not os.path.ismount(mnt):
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("mount failed")
            time.sleep(0.02)

    def hwm_mb(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        return 0.0

    def close(self) -> None:
        subprocess.run(["fusermount3", "-u", self.mnt], check=False)
        self.proc.wait(timeout=30)


def median_rate(fn, path: str, repeat: int, cold: bool = True) -> float:
    rates = []
    for _ in range(repeat):
        if cold:
            drop_caches()
        dt, n = fn(path)
        rates.append(n / dt / 1e9)
    return statistics.median(rates)


def warm_compare(bins: list[str], src: str, mnt: str, opts: list[str], rounds: int) -> None:
    """Warm re-reads of the row-sharded view, binaries alternating, each on a fresh mount."""
    for rnd in range(rounds):
        for b in bins:
            d = Daemon(b, src, mnt, opts + ["prefetch=off"])
            try:
                view_row = os.path.join(mnt, "row", "model-00001-of-00001.safetensors")
                read_seq(view_row)
                rates = []
                for _ in range(5):
                    dt, n = read_seq(view_row)
                    rates.append(n / dt / 1e9)
                print(f"round {rnd + 1}  {b}: warm re-reads GB/s " +
                      " ".join(f"{r:.2f}" for r in rates), flush=True)
            finally:
                d.close()


def read_unbuffered(path: str, bs: int = 4 << 20) -> tuple[float, int]:
    """Sequential unbuffered reads of `bs` bytes, each into a fresh bytes object."""
    total = 0
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while True:
            b = f.read(bs)
            if not b:
                break
            total += len(b)
    return time.perf_counter() - t0, total


def warm_like(binary: str, src: str, mnt: str, opts: list[str], rounds: int) -> None:
    """Warm re-reads of the view against a native file in the same page-cache state."""
    plain = os.path.join(src, "plain", "file.bin")
    fresh = os.path.join(os.path.dirname(src), "native-fresh.bin")
    view = os.path.join(mnt, "row", "model-00001-of-00001.safetensors")
    for rnd in range(rounds):
        d = Daemon(binary, src, mnt, opts)
        try:
            # Fills the mount's page cache: each page is inserted and touched once. The native
            # file's pages get the same state from being written once (cp): the next access of
            # either activates every page on the kernel's LRU (see docs/benchmarks.md).
            read_unbuffered(view)
            shutil.copyfile(plain, fresh)
            v, n = [], []
            for _ in range(5):
                dt, b = read_unbuffered(view)
                v.append(b / dt / 1e9)
                dt, b = read_unbuffered(fresh)
                n.append(b / dt / 1e9)
            sv, sn = statistics.median(v[1:]), statistics.median(n[1:])
            print(f"round {rnd + 1} [{','.join(opts)}]: first re-read view {v[0]:.2f} native "
                  f"{n[0]:.2f} GB/s = {v[0] / n[0]:.2f}x; steady (2-5) view {sv:.2f} native "
                  f"{sn:.2f} = {sv / sn:.2f}x; first view re-read / steady native = "
                  f"{v[0] / sn:.2f}x", flush=True)
        finally:
            d.close()
            os.unlink(fresh)


def _reader(path: str, bs: int, q) -> None:
    fd = os.open(path, os.O_RDONLY)
    buf = bytearray(bs)
    mv = memoryview(buf)
    total = 0
    q.get()  # start together
    while True:
        n = os.readv(fd, [mv])
        if n <= 0:
            break
        total += n
    os.close(fd)
    q.put(total)


def parallel(binary: str, src: str, mnt: str, base: list[str], configs: list[str], n: int,
             rounds: int) -> None:
    """n readers of n views at once; aggregate GB/s of the first read and of a re-read."""
    import multiprocessing as mp
    row = os.path.join(src, "row")
    for k in range(n):
        d = os.path.join(src, f"par{k}")
        if not os.path.isdir(d):
            os.makedirs(d)
            for name in os.listdir(row):
                os.link(os.path.join(row, name), os.path.join(d, name))
    ctx = mp.get_context("fork")

    def once(paths: list[str]) -> float:
        qs = [ctx.Queue() for _ in paths]
        ps = [ctx.Process(target=_reader, args=(p, 8 << 20, q)) for p, q in zip(paths, qs)]
        for p in ps:
            p.start()
        time.sleep(0.2)
        t0 = time.perf_counter()
        for q in qs:
            q.put(None)
        for p in ps:
            p.join()
        dt = time.perf_counter() - t0
        return sum(q.get() for q in qs) / dt / 1e9

    for rnd in range(rounds):
        native = [os.path.join(src, f"native{k}.bin") for k in range(n)]
        for p in native:
            if not os.path.exists(p):
                shutil.copyfile(os.path.join(src, "plain", "file.bin"), p)
        line = [f"native {once(native):.2f}"]
        for cfg in configs:
            opts = base + ([x for x in cfg.split(",") if x] if cfg else [])
            d = Daemon(binary, src, mnt, opts)
            try:
                views = [os.path.join(mnt, f"par{k}", "model-00001-of-00001.safetensors")
                         for k in range(n)]
                for v in views:
                    os.stat(v)
                first, again = once(views), once(views)
                line.append(f"[{cfg or 'default'}] {first:.2f} / {again:.2f}")
            finally:
                d.close()
        print(f"round {rnd + 1}, {n} readers, GB/s first / re-read: " + "  ".join(line), flush=True)


# ---- issue 23: the warm re-read rows (--warm-rows) ----

def _usage() -> tuple[int, int, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_minflt, r.ru_majflt, r.ru_utime + r.ru_stime


def _pass_read(path: str, state: dict) -> None:
    """read(2) of the whole file into one 4 MiB buffer."""
    buf = state.setdefault("buf", bytearray(4 << 20))
    mv = memoryview(buf)
    fd = os.open(path, os.O_RDONLY)
    try:
        while os.readv(fd, [mv]) > 0:
            pass
    finally:
        os.close(fd)


def _pass_mmap(path: str, state: dict) -> None:
    """A shared read-only mapping of the whole file, one byte touched per 4 KiB, unmapped."""
    import numpy as np
    fd = os.open(path, os.O_RDONLY)
    try:
        mm = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        a = np.frombuffer(mm, dtype=np.uint8)
        state["sink"] = int(a[::4096].sum())
        del a
        mm.close()
    finally:
        os.close(fd)


def _pass_load(path: str, state: dict) -> None:
    """safetensors.torch.load_file, then every tensor materialised: 'touch' reads one byte per
    4 KiB of it (load_file's tensors are views of its mmap, so this faults every page in),
    'copy' copies it into a tensor allocated and touched before (what load_state_dict does);
    the tensors are then released (munmap), all inside the timed pass."""
    import torch
    from safetensors.torch import load_file
    sd = load_file(path)
    if state["materialise"] == "copy":
        dst = state.setdefault("dst", {})
        for k, t in sd.items():
            if k not in dst:
                dst[k] = torch.ones_like(t)
            dst[k].copy_(t)
    else:
        s = 0
        for v in sd.values():
            s += int(v.reshape(-1).view(torch.uint8)[::4096].sum())
        state["sink"] = s
    del sd


_ROW_FN = {"read": _pass_read, "load": _pass_load, "mmap": _pass_mmap}
_ROW_NAME = {"read": "read(2), 4 MiB buffer", "load": "safetensors load_file + materialise",
             "mmap": "mmap, touch one byte per 4 KiB"}


def _measure(fn, path: str, state: dict) -> tuple[float, int, float, int]:
    """One pass: (GB/s of the file's size, minor faults, user+sys CPU ms, major faults) of this
    process."""
    size = os.path.getsize(path)
    f0, m0, c0 = _usage()
    t0 = time.perf_counter()
    fn(path, state)
    dt = time.perf_counter() - t0
    f1, m1, c1 = _usage()
    return size / dt / 1e9, f1 - f0, (c1 - c0) * 1e3, m1 - m0


def _wait_idle(pid: int, limit: float = 10.0) -> float:
    """Waits until the daemon has used no CPU for 0.4 s (a prefetch still pushing, say);
    returns the seconds waited."""
    t0 = time.perf_counter()
    last, quiet = _proc_cpu_ms(pid), 0
    while quiet < 2 and time.perf_counter() - t0 < limit:
        time.sleep(0.2)
        now = _proc_cpu_ms(pid)
        quiet = quiet + 1 if now == last else 0
        last = now
    return time.perf_counter() - t0


def _proc_cpu_ms(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1e3 / os.sysconf("SC_CLK_TCK")


def _write_copy(src: str, dst: str, bs: int = 4 << 20) -> None:
    """Writes dst from src in `bs` writes and fsyncs it (the writer's size sets the folio sizes
    ext4 gives the new pages: 4 MiB writes give 2 MiB folios, cp's 128 KiB ones 128 KiB)."""
    buf = bytearray(bs)
    mv = memoryview(buf)
    with open(src, "rb", buffering=0) as fi, open(dst, "wb", buffering=0) as fo:
        while True:
            n = fi.readinto(mv)
            if not n:
                break
            fo.write(mv[:n])
        os.fsync(fo.fileno())


def _resident_pages(path: str) -> int:
    out = subprocess.run(["fincore", "-n", "-b", "-o", "RES", path], capture_output=True,
                         text=True)
    return int(out.stdout.split()[0]) // 4096 if out.returncode == 0 and out.stdout.strip() else -1


def _disk_read_bytes() -> int:
    """Bytes this process has caused to be read from storage (/proc/self/io read_bytes)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


def _fs_type(path: str) -> str:
    return subprocess.run(["stat", "-f", "-c", "%T", path], capture_output=True, text=True,
                          check=True).stdout.strip()


def _med_range(xs: list[float], fmt: str = "{:.2f}") -> str:
    if not xs:
        return "—"
    m = statistics.median(xs)
    if len(xs) == 1 or min(xs) == max(xs):
        return fmt.format(m)
    return f"{fmt.format(m)} ({fmt.format(min(xs))}–{fmt.format(max(xs))})"


def warm_rows(binary: str, src: str, root: str, opts: list[str], rounds: int, passes: int,
              rows: list[str], native_dir: str, native_fill: str, materialise: str,
              tries: int = 3) -> None:
    """The issue 23 table: warm re-reads of the view, a native page-cache file and a plain file
    through the same daemon, per row, side by side (see the module docstring)."""
    fstype = _fs_type(native_dir)
    if fstype in ("tmpfs", "ramfs"):
        raise SystemExit(f"--native-dir {native_dir} is {fstype}: the native file must be on a "
                         "disk file system (its page cache is what is compared)")
    mnt = os.path.join(root, "mnt")
    view_rel = os.path.join("row", "model-00001-of-00001.safetensors")
    plain_rel = os.path.join("plain", "view-copy.bin")
    plain_src = os.path.join(src, plain_rel)
    native = os.path.join(native_dir, f"ckptfs-warm-native-{os.getpid()}.bin")
    if not os.path.exists(plain_src):
        # The view's bytes as an ordinary file in SRC, which the daemon serves unchanged.
        d = Daemon(binary, src, mnt, opts)
        try:
            _write_copy(os.path.join(mnt, view_rel), plain_src + ".tmp")
        finally:
            d.close()
        os.rename(plain_src + ".tmp", plain_src)
    size = os.path.getsize(plain_src)
    print(f"warm rows: {size} bytes ({size / 2**20:.0f} MiB); view {view_rel} (row-sharded, 8 ranks);"
          f" native {native} ({fstype}, filled by {native_fill}); plain {plain_rel} through the "
          f"daemon; mount -o {','.join(opts)}; {passes} steady passes; materialise={materialise}",
          flush=True)
    state = {"materialise": materialise}
    if "load" in rows:
        # Imports torch and safetensors, runs each once, and allocates the copy destinations
        # from the header, so that no timed pass pays for them.
        import torch
        from safetensors.torch import save_file
        scratch = os.path.join(root, "warm-up.safetensors")
        save_file({"x": torch.ones(4096, dtype=torch.bfloat16)}, scratch)
        _pass_load(scratch, dict(state))
        os.unlink(scratch)
        if materialise == "copy":
            dtypes = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
            with open(plain_src, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                hdr = json.loads(f.read(n))
            hdr.pop("__metadata__", None)
            state["dst"] = {k: torch.ones(e["shape"], dtype=dtypes[e["dtype"]]) for k, e in hdr.items()}
    scratch = os.path.join(root, "warm-up.bin")
    with open(scratch, "wb") as f:
        f.write(bytes(1 << 20))
    _pass_read(scratch, state)
    _pass_mmap(scratch, state)
    os.unlink(scratch)
    targets = ["view", "native", "plain"]
    # results[row][target] = {"first": [(gbs, flt, cpu) per round], "steady": [[...] per round]}
    results = {r: {t: {"first": [], "steady": []} for t in targets} for r in rows}
    cold: dict[str, list[float]] = {"view": [], "plain": [], "native": []}
    def one(rnd: int, row: str):
        """One round of one row; returns (per-target passes, cold GB/s, daemon CPU ms, seconds
        waited for the daemon to go idle, why the round was disturbed or None)."""
        fn = _ROW_FN[row]
        if os.path.exists(native):
            os.unlink(native)
        _write_copy(plain_src, native)
        cold_now = {}
        if native_fill == "read":
            fd = os.open(native, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
            left = _resident_pages(native)
            dt, n = read_seq(native, 4 << 20)
            cold_now["native"] = n / dt / 1e9
            if left > 0:
                print(f"  note: {left} pages of the native file stayed resident after "
                      "POSIX_FADV_DONTNEED", flush=True)
        d = Daemon(binary, src, mnt, opts)
        try:
            paths = {"view": os.path.join(mnt, view_rel), "native": native,
                     "plain": os.path.join(mnt, plain_rel)}
            os.stat(paths["view"]), os.stat(paths["plain"])
            # Fills the mount's page caches once (the cold read). Which file is filled first
            # alternates: re-reads of the file filled first cost more CPU, whichever it is (page
            # placement; measured 20-40% more for both read(2) and mmap).
            fill = ("view", "plain") if (rnd * len(rows) + rows.index(row)) % 2 == 0 else ("plain", "view")
            for t in fill:
                dt, n = read_seq(paths[t], 4 << 20)
                cold_now[t] = n / dt / 1e9
            waited = _wait_idle(d.proc.pid)
            pages = -(-size // 4096)
            missing = {t: pages - _resident_pages(paths[t]) for t in targets}
            cpu0, io0 = _proc_cpu_ms(d.proc.pid), _disk_read_bytes()
            res = {t: [] for t in targets}
            for p in range(passes + 1):  # pass 0 is the first re-read
                k = (rnd * len(rows) + p) % len(targets)
                for t in targets[k:] + targets[:k]:
                    res[t].append(_measure(fn, paths[t], state))
            daemon_ms = _proc_cpu_ms(d.proc.pid) - cpu0
            disk = _disk_read_bytes() - io0
            for t in ("view", "plain"):
                if subprocess.run(["cmp", "-s", paths[t], native]).returncode != 0:
                    raise SystemExit(f"{paths[t]} differs from {native}")
        finally:
            d.close()
        why = []
        if any(missing.values()):
            why.append("pages not resident before the re-reads: " +
                       ", ".join(f"{t} {m}" for t, m in missing.items() if m))
        if disk > 0:
            why.append(f"{disk >> 20} MiB read from disk during the re-reads")
        if daemon_ms > 50:
            why.append(f"the daemon used {daemon_ms:.0f} ms of CPU during the re-reads")
        return res, cold_now, daemon_ms, waited, "; ".join(why) or None

    disturbed = kept = 0
    for rnd in range(rounds):
        for row in rows:
            for attempt in range(tries):
                res, cold_now, daemon_ms, waited, why = one(rnd, row)
                if why is None:
                    break
                disturbed += 1
                kept += attempt + 1 == tries
                print(f"round {rnd + 1} {row}: disturbed ({why}; another process dropping the "
                      f"page cache?)" + ("; again" if attempt + 1 < tries else "; kept"), flush=True)
            for t, g in cold_now.items():
                cold[t].append(g)
            for t in targets:
                results[row][t]["first"].append(res[t][0])
                results[row][t]["steady"].append(res[t][1:])
            line = []
            for t in targets:
                g0, f0, c0, _ = res[t][0]
                gs = statistics.median(x[0] for x in res[t][1:])
                fs = statistics.median(x[1] for x in res[t][1:])
                cs = statistics.median(x[2] for x in res[t][1:])
                line.append(f"{t} {g0:.2f}/{gs:.2f} GB/s {f0}/{fs:.0f} flt {c0:.0f}/{cs:.0f} ms")
            v, n = res["view"], res["native"]
            majors = {t: sum(x[3] for x in res[t]) for t in targets if any(x[3] for x in res[t])}
            print(f"round {rnd + 1} {row:5s} first/steady: " + "; ".join(line) +
                  f"; view/native first {v[0][0] / n[0][0]:.2f}x steady "
                  f"{statistics.median(x[0] for x in v[1:]) / statistics.median(x[0] for x in n[1:]):.2f}x"
                  f"; daemon CPU over the re-reads {daemon_ms:.0f} ms"
                  + (f" (waited {waited:.1f} s for it to go idle first)" if waited > 1 else "")
                  + (f"; major faults {majors}" if majors else ""), flush=True)
    if os.path.exists(native):
        os.unlink(native)

    print("\ncold first read (4 MiB read(2)), GB/s: view through a fresh mount "
          f"{_med_range(cold['view'])}; plain file through it {_med_range(cold['plain'])}"
          + (f"; native from disk {_med_range(cold['native'])}" if cold["native"] else ""))
    print(f"\n| warm row | file | first re-read GB/s | steady GB/s | faults per pass | CPU ms per pass"
          f" (first / steady) | ×native first | ×native steady | CPU ×native (steady) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        rn = results[row]["native"]
        for t in targets:
            r = results[row][t]
            first_g = [x[0] for x in r["first"]]
            steady_g = [statistics.median(x[0] for x in s) for s in r["steady"]]
            flt = [x[1] for s in r["steady"] for x in s]
            cpu_first = [x[2] for x in r["first"]]
            cpu = [x[2] for s in r["steady"] for x in s]
            ratio_f = [a[0] / b[0] for a, b in zip(r["first"], rn["first"])]
            ratio_s = [statistics.median(x[0] for x in a) / statistics.median(x[0] for x in b)
                       for a, b in zip(r["steady"], rn["steady"])]
            ratio_c = [statistics.median(x[2] for x in a) / max(statistics.median(x[2] for x in b), 1e-9)
                       for a, b in zip(r["steady"], rn["steady"])]
            nat = t == "native"
            print(f"| {_ROW_NAME[row]} | {t} | {_med_range(first_g)} | {_med_range(steady_g)} | "
                  f"{statistics.median(flt):,.0f} | {statistics.median(cpu_first):.0f} / "
                  f"{_med_range(cpu, '{:.0f}')} | {'1' if nat else _med_range(ratio_f)} | "
                  f"{'1' if nat else _med_range(ratio_s)} | {'1' if nat else _med_range(ratio_c)} |")
    print(f"\nmachine: {os.uname().release}, {os.cpu_count()} cpus; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; {rounds} rounds"
          + (f"; {disturbed} disturbed attempt(s), each run again up to {tries} tries" if disturbed else "")
          + (f"; {kept} disturbed round(s) KEPT in the table" if kept else ""))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/dev/shm/ckptfs-bench")
    ap.add_argument("--size-mb", type=int, default=None, help="1024; 768 with --warm-rows")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--bin", default=None,
                    help="build/src/ckptfs; build-release/src/ckptfs with --warm-rows, if built")
    ap.add_argument("--splice", action="store_true", help="mount with -o splice=on")
    ap.add_argument("--mount-opt", action="append", default=[], help="extra -o option (repeatable)")
    ap.add_argument("--keep", action="store_true", help="keep the generated data")
    ap.add_argument("--warm-compare", metavar="OTHER_BIN",
                    help="only compare warm re-reads of --bin and OTHER_BIN, alternating")
    ap.add_argument("--warm-like", action="store_true",
                    help="only the like-for-like warm re-read comparison")
    ap.add_argument("--parallel", type=int, default=0, metavar="N",
                    help="only N parallel readers of N views")
    ap.add_argument("--config", action="append", default=None,
                    help="with --parallel: a comma-separated set of mount options (repeatable)")
    ap.add_argument("--warm-rows", action="store_true",
                    help="only the warm re-read rows of issue 23 (view, native ext4, plain)")
    ap.add_argument("--rows", default="read,load,mmap",
                    help="with --warm-rows: which rows, comma-separated (read, load, mmap)")
    ap.add_argument("--passes", type=int, default=5,
                    help="with --warm-rows: steady re-reads after the first re-read")
    ap.add_argument("--native-dir", default="/var/tmp",
                    help="with --warm-rows: where the native file goes (not tmpfs)")
    ap.add_argument("--native-fill", choices=("read", "write"), default="read",
                    help="with --warm-rows: the native file's pages come from a read from disk "
                         "(written, evicted, read once) or only from being written")
    ap.add_argument("--materialise", choices=("touch", "copy"), default="touch",
                    help="with --warm-rows: the load row touches or copies every tensor")
    args = ap.parse_args()
    release = os.path.join(ROOT, "build-release", "src", "ckptfs")
    if args.bin is None:
        args.bin = (release if args.warm_rows and os.path.exists(release)
                    else os.path.join(ROOT, "build", "src", "ckptfs"))
    if args.size_mb is None:
        args.size_mb = 768 if args.warm_rows else 1024

    if args.warm_rows:
        rows = [r for r in args.rows.split(",") if r]
        bad = [r for r in rows if r not in _ROW_FN]
        if bad:
            ap.error(f"--rows: unknown {bad}")
        src = ensure_data(args.dir, args.size_mb)
        base = ["settle=0", *args.mount_opt] + (["splice=on"] if args.splice else [])
        warm_rows(args.bin, src, args.dir, base, args.repeat, args.passes, rows, args.native_dir,
                  args.native_fill, args.materialise)
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)
        return 0

    if args.warm_like or args.parallel:
        src = ensure_data(args.dir, args.size_mb)
        base = ["settle=0", *args.mount_opt]
        if args.splice:
            base.append("splice=on")
        mnt = os.path.join(args.dir, "mnt")
        if args.warm_like:
            warm_like(args.bin, src, mnt, base, args.repeat)
        else:
            parallel(args.bin, src, mnt, base, args.config or [""], args.parallel, args.repeat)
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)
        return 0

    if args.warm_compare:
        src = ensure_data(args.dir, args.size_mb)
        base = ["settle=0", f"splice={'on' if args.splice else 'off'}", *args.mount_opt]
        warm_compare([args.warm_compare, args.bin], src, os.path.join(args.dir, "mnt"), base,
                     args.repeat)
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)
        return 0

    src = ensure_data(args.dir, args.size_mb)
    make_many(src)
    mnt = os.path.join(args.dir, "mnt")
    base = ["settle=0", f"splice={'on' if args.splice else 'off'}", *args.mount_opt]
    rows = []

    def row(name, value, unit, note=""):
        rows.append((name, value, unit, note))
        print(f"{name:58s} {value:8.3f} {unit:6s} {note}", flush=True)

    d = Daemon(args.bin, src, mnt, base + ["prefetch=off"])
    try:
        plain_native = os.path.join(src, "plain", "file.bin")
        plain_fuse = os.path.join(mnt, "plain", "file.bin")
        view_row = os.path.join(mnt, "row", "model-00001-of-00001.safetensors")
        view_col = os.path.join(mnt, "col", "model-00001-of-00001.safetensors")
        os.stat(view_row), os.stat(view_col)
        native = median_rate(read_seq, plain_native, args.repeat)
        floor = median_rate(read_seq, plain_fuse, args.repeat)
        vrow = median_rate(read_seq, view_row, args.repeat)
        vcol = median_rate(read_seq, view_col, args.repeat)
        row("cold read, native file (backing fs)", native, "GB/s")
        row("cold read, plain file through the daemon (FUSE floor)", floor, "GB/s",
            f"{floor / native:.2f}x native")
        row("cold read, view, row-sharded", vrow, "GB/s", f"{vrow / floor:.2f}x floor (target >= 0.9)")
        row("cold read, view, column-sharded 8 ranks BF16 1 KiB runs", vcol, "GB/s",
            f"{vcol / floor:.2f}x floor (target >= 0.75)")
        read_seq(view_row)
        warm_view = median_rate(read_seq, view_row, args.repeat, cold=False)
        read_seq(plain_native)
        warm_native = median_rate(read_seq, plain_native, args.repeat, cold=False)
        row("warm re-read, view (page cache)", warm_view, "GB/s",
            f"{warm_view / warm_native:.2f}x native warm {warm_native:.2f} GB/s (target >= 0.9)")
        mm_off = median_rate(read_mmap, view_row, args.repeat)
        row("cold mmap copy-out, view, prefetch off", mm_off, "GB/s", f"{mm_off / vrow:.2f}x cold buffered view")
        rss_a = d.hwm_mb()
    finally:
        d.close()

    d = Daemon(args.bin, src, mnt, base + ["prefetch=on"])
    try:
        os.stat(view_row)
        mm_on = median_rate(read_mmap, view_row, args.repeat)
        row("cold mmap copy-out, view, prefetch on (default)", mm_on, "GB/s",
            f"{mm_on / vrow:.2f}x cold buffered view (target >= 0.8)")
        vrow_pf = median_rate(read_seq, view_row, args.repeat)
        row("cold read, view, row-sharded, prefetch on", vrow_pf, "GB/s", f"{vrow_pf / floor:.2f}x floor")
        t0 = time.perf_counter()
        out = subprocess.run(["ls", "-l", os.path.join(mnt, "many")], capture_output=True, text=True, check=True)
        t_ls = time.perf_counter() - t0
        t0 = time.perf_counter()
        subprocess.run(["ls", "-l", os.path.join(mnt, "many")], capture_output=True, check=True)
        t_ls2 = time.perf_counter() - t0
        assert "model-00001-of-00001.safetensors" in out.stdout, out.stdout
        row("ls -l of a 10,000-tensor, 1,000-shard checkpoint (first)", t_ls, "s", "target < 1 s")
        row("ls -l of the same, again", t_ls2, "s")
        rss = max(rss_a, d.hwm_mb())
        row("daemon peak RSS (VmHWM) over the run", rss, "MB", "target <= 100 MB")
    finally:
        d.close()
    if not args.keep:
        shutil.rmtree(args.dir, ignore_errors=True)
    print("\nmachine:", os.uname().release, f"{os.cpu_count()} cpus;", "dir:", args.dir, f"{args.size_mb} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
