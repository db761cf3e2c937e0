#!/usr/bin/env python3
"""`ckptfs consolidate` against `cp` of the same shard bytes on the same disk (figures in
docs/benchmarks.md).

For each layout (row-sharded, and column-sharded with 8 ranks, BF16, 1 KiB runs) it times,
side by side and with the page cache dropped before each run:
  cp        cp -r of the shard directory, then sync
  ckptfs    ckptfs consolidate of the same shards (it fsyncs its outputs), then sync
and reports the speed ratio cp_time / ckptfs_time (target >= 0.8) and each command's peak
RSS (from wait4), which must stay bounded whatever the checkpoint size.

Usage: sudo tools/bench_consolidate.py [--dir /var/tmp/ckptfs-bench-cons] [--size-mb 2048]
                                      [--repeat 2] [--threads 4]
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/var/tmp/ckptfs-bench-cons")
    ap.add_argument("--size-mb", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "src", "ckptfs"))
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()

    src = ensure_data(args.dir, args.size_mb)
    out = os.path.join(args.dir, "out")
    print(f"{'layout':8s} {'cp s':>8s} {'ckptfs s':>9s} {'speed ratio':>12s} {'cp RSS MB':>10s} {'ckptfs RSS MB':>14s}")
    for layout in ("row", "col"):
        cps, cks, cp_rss, ck_rss = [], [], [], []
        for _ in range(args.repeat):
            shutil.rmtree(out, ignore_errors=True)
            drop_caches()
            dt, rss = timed(["cp", "-r", os.path.join(src, layout), out])
            cps.append(dt)
            cp_rss.append(rss)
            shutil.rmtree(out, ignore_errors=True)
            drop_caches()
            dt, rss = timed([args.bin, "consolidate", os.path.join(src, layout), out,
                             "--threads", str(args.threads)])
            cks.append(dt)
            ck_rss.append(rss)
        cp_t, ck_t = statistics.median(cps), statistics.median(cks)
        print(f"{layout:8s} {cp_t:8.2f} {ck_t:9.2f} {cp_t / ck_t:11.2f}x {max(cp_rss):10.1f} {max(ck_rss):14.1f}",
              flush=True)
    shutil.rmtree(out, ignore_errors=True)
    if not args.keep:
        shutil.rmtree(args.dir, ignore_errors=True)
    print(f"\n{args.size_mb} MB of tensor data per layout in {args.dir}; median of {args.repeat}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
