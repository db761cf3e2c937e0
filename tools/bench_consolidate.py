#!/usr/bin/env python3
"""`ckptfs consolidate` against `cp -r` of the same shard bytes on the same disk (figures in
docs/benchmarks.md).

For each layout (row-sharded, and column-sharded with 8 ranks, BF16, 1 KiB runs) and each
cache state it times, side by side in one run, alternating the two commands:
  cp        cp -r of the shard directory, then sync
  ckptfs    ckptfs consolidate of the same shards (it fsyncs its outputs), then sync
Each command is timed from its start until a `sync` after it returns, so both pay for
their bytes reaching the disk. Before each timed command the previous output is removed
and a `sync` settles it (untimed).

Cache states:
  cold   the page cache is dropped before each command (needs root)
  warm   the shards are in the page cache, as when training just wrote them: they are
         re-read before each command (and checked resident with mincore where it can)

It reports each command's median time, the speed ratio cp_time / ckptfs_time (target
>= 0.8), the ratio of each round (the machine is noisy: rounds are side by side), and each
command's peak RSS (from /usr/bin/time), which must stay bounded whatever the size.

Usage: sudo tools/bench_consolidate.py [--dir /var/tmp/ckptfs-bench-cons] [--size-mb 2048]
           [--repeat 3] [--threads N] [--cache cold,warm] [--layouts row,col]
           [--bin2 OTHER_CKPTFS]   (a second binary timed in the same rounds, e.g. a baseline)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_read import ROOT, drop_caches, ensure_data  # noqa: E402


def timed(cmd: list[str]) -> tuple[float, float]:
    """Runs cmd, then sync; returns (seconds, peak RSS in MB of cmd). /usr/bin/time measures
    the RSS: a child forked straight from this (large) Python process would count its pages."""
    t0 = time.perf_counter()
    r = subprocess.run(["/usr/bin/time", "-f", "%M", *cmd], capture_output=True, text=True)
    os.sync()
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"{cmd} failed: {r.stderr}")
    return dt, int(r.stderr.strip().splitlines()[-1]) / 1024


def warm_up(d: str) -> None:
    """Reads every file of d so its pages are in the page cache."""
    buf = bytearray(8 << 20)
    for name in sorted(os.listdir(d)):
        p = os.path.join(d, name)
        if not os.path.isfile(p):
            continue
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def prepare(src: str, out: str, cache: str) -> None:
    shutil.rmtree(out, ignore_errors=True)
    os.sync()
    if cache == "cold":
        drop_caches()
    else:
        warm_up(src)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/var/tmp/ckptfs-bench-cons")
    ap.add_argument("--size-mb", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="--threads for consolidate (0: its default)")
    ap.add_argument("--cache", default="cold,warm")
    ap.add_argument("--layouts", default="row,col")
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "src", "ckptfs"))
    ap.add_argument("--bin2", default=None, help="a second ckptfs binary timed in the same rounds")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()

    src = ensure_data(args.dir, args.size_mb)
    out = os.path.join(args.dir, "out")
    bins = [("ckptfs", args.bin)] + ([("ckptfs2", args.bin2)] if args.bin2 else [])
    thr = ["--threads", str(args.threads)] if args.threads else []
    results = []
    for cache in args.cache.split(","):
        for layout in args.layouts.split(","):
            shard_dir = os.path.join(src, layout)
            times: dict[str, list[float]] = {"cp": []}
            rss: dict[str, list[float]] = {"cp": []}
            for name, _ in bins:
                times[name], rss[name] = [], []
            for _ in range(args.repeat):
                prepare(shard_dir, out, cache)
                dt, m = timed(["cp", "-r", shard_dir, out])
                times["cp"].append(dt)
                rss["cp"].append(m)
                for name, b in bins:
                    prepare(shard_dir, out, cache)
                    dt, m = timed([b, "consolidate", shard_dir, out, *thr])
                    times[name].append(dt)
                    rss[name].append(m)
            results.append((cache, layout, times, rss))
            rounds = ", ".join(f"{c / k:.2f}" for c, k in zip(times["cp"], times["ckptfs"]))
            line = (f"{cache:5s} {layout:4s} cp {statistics.median(times['cp']):6.2f} s"
                    f"  ckptfs {statistics.median(times['ckptfs']):6.2f} s"
                    f"  ratio {statistics.median(times['cp']) / statistics.median(times['ckptfs']):5.2f}x"
                    f" (rounds: {rounds})")
            if args.bin2:
                r2 = ", ".join(f"{c / k:.2f}" for c, k in zip(times["cp"], times["ckptfs2"]))
                line += (f"  ckptfs2 {statistics.median(times['ckptfs2']):6.2f} s"
                         f" ratio {statistics.median(times['cp']) / statistics.median(times['ckptfs2']):5.2f}x"
                         f" (rounds: {r2})")
            line += f"  RSS MB cp {max(rss['cp']):.1f} ckptfs {max(rss['ckptfs']):.1f}"
            print(line, flush=True)
    shutil.rmtree(out, ignore_errors=True)
    if not args.keep:
        shutil.rmtree(args.dir, ignore_errors=True)
    print(f"\n{args.size_mb} MB of tensor data per layout in {args.dir}; medians of {args.repeat}; "
          f"ratio = cp time / ckptfs time (higher is better for ckptfs)")
    print("| cache | layout | cp s | ckptfs s | ratio (cp / ckptfs) | rounds | cp RSS MB | ckptfs RSS MB |")
    print("|---|---|---|---|---|---|---|---|")
    for cache, layout, times, rss in results:
        cp_t, ck_t = statistics.median(times["cp"]), statistics.median(times["ckptfs"])
        rounds = ", ".join(f"{c / k:.2f}" for c, k in zip(times["cp"], times["ckptfs"]))
        print(f"| {cache} | {layout} | {cp_t:.2f} | {ck_t:.2f} | {cp_t / ck_t:.2f}x | {rounds} | "
              f"{max(rss['cp']):.1f} | {max(rss['ckptfs']):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
