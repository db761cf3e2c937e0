#!/usr/bin/env python3
"""Cast-view read benchmark (figures in docs/benchmarks.md, "Cast views").

One F32 checkpoint (row-sharded over 8 ranks, NeMo style) is mounted twice at once from the
same source: `dtype=stored` (F32 served, the uncast view) and `dtype=bf16` (BF16 served,
cast on read). Each round drops the page cache and reads each view's consolidated file in
4 MiB reads, by 1 reader and by --readers readers splitting the file, alternating the views
(the machine is noisy: compare the ratios within a round). Reported per view: GB/s of bytes
served and of shard bytes consumed, and the daemon's peak RSS (VmHWM).

Usage: sudo tools/bench_cast.py [--dir /dev/shm/ckptfs-bench-cast] [--size-mb 512]
                                [--repeat 3] [--readers 2] [--bin build/src/ckptfs]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
from shardgen import TensorSpec, write_checkpoint  # noqa: E402

MODEL = "model-00001-of-00001.safetensors"
CHUNK = 4 << 20


def drop_caches():
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def read_range(path, lo, hi):
    fd = os.open(path, os.O_RDONLY)
    try:
        off = lo
        while off < hi:
            b = os.pread(fd, min(CHUNK, hi - off), off)
            if not b:
                break
            off += len(b)
    finally:
        os.close(fd)


def timed_read(path, readers):
    size = os.stat(path).st_size
    step = -(-size // readers)
    ts = [threading.Thread(target=read_range, args=(path, i * step, min(size, (i + 1) * step)))
          for i in range(readers)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return size, time.perf_counter() - t0


def vmhwm(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) // 1024
    return -1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/dev/shm/ckptfs-bench-cast")
    ap.add_argument("--size-mb", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--readers", type=int, default=2)
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "src", "ckptfs"))
    a = ap.parse_args()
    shutil.rmtree(a.dir, ignore_errors=True)
    src = os.path.join(a.dir, "src", "ckpt")
    rows = 4096
    cols = a.size_mb * (1 << 20) // 4 // rows // 8
    rng = np.random.default_rng(0)
    specs = [TensorSpec(f"layer{i}.weight", "F32", (rows, cols), (8, 1),
                        array=rng.standard_normal((rows, cols), dtype=np.float32)) for i in range(8)]
    write_checkpoint(src, specs, world=8, nemo=True)
    views = {}
    for opt in ("stored", "bf16"):
        mnt = os.path.join(a.dir, f"mnt-{opt}")
        os.makedirs(mnt, exist_ok=True)
        p = subprocess.Popen([a.bin, "mount", os.path.join(a.dir, "src"), mnt, "-f", "-o",
                              f"settle=0,dtype={opt}"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.STDOUT)
        deadline = time.time() + 20
        while not os.path.exists(os.path.join(mnt, "ckpt", MODEL)):
            if time.time() > deadline or p.poll() is not None:
                sys.exit(f"mount {opt} did not come up")
            time.sleep(0.05)
        views[opt] = (p, os.path.join(mnt, "ckpt", MODEL), mnt)
    shard_bytes = sum(os.path.getsize(os.path.join(src, n)) for n in os.listdir(src)
                      if n.startswith("shard-"))
    res = {(v, r): [] for v in views for r in (1, a.readers)}
    try:
        for _ in range(a.repeat):
            for r in (1, a.readers):
                for v, (_, path, _) in views.items():
                    drop_caches()
                    n, dt = timed_read(path, r)
                    res[(v, r)].append((n, dt))
    finally:
        rss = {v: vmhwm(p.pid) for v, (p, _, _) in views.items()}
        for v, (p, _, mnt) in views.items():
            subprocess.run(["fusermount3", "-u", mnt], check=False)
            p.wait(timeout=20)
    print(f"checkpoint: {shard_bytes / 1e6:.0f} MB of F32 shards, 8 ranks, row-sharded; "
          f"{a.repeat} rounds, cold page cache, {CHUNK >> 20} MiB reads")
    for r in (1, a.readers):
        base = None
        for v in views:
            n = res[(v, r)][0][0]
            med = statistics.median(dt for _, dt in res[(v, r)])
            out, inp = n / med / 1e9, shard_bytes / med / 1e9
            base = base or med
            print(f"  {r} reader(s)  dtype={v:6s}  {med:6.3f} s  served {out:5.2f} GB/s  "
                  f"shards consumed {inp:5.2f} GB/s  time vs stored {med / base:4.2f}x")
    for v in views:
        print(f"  daemon peak RSS dtype={v}: {rss[v]} MiB")
    shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
