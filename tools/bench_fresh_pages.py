#!/usr/bin/env python3
"""What a page of memory costs to fill on a VM, by where it comes from (issue 35).

On this project's VM (virtio-balloon with free page reporting) some free pages fill at a
fraction of the speed of others: 8 MB in about 22 ms against 3 ms, the time all inside the
copy, as a host-side fault on the guest's first touch of a page the host does not back would
look. A save that needs more new pages meets more of them: the mount's second consolidating
save keeps the first save's version until the new one is stored, where a plain directory's
reuses the pages its truncations free (docs/benchmarks.md, "Where the second save's time
goes"). This fills COUNT files of SIZE MB each (kept, so memory use climbs), in 8 MB writes as
torch's consolidator makes, deletes them, and fills them again; on a freshly booted VM the
first pass meets pages never touched, the second the same pages again. --warm (with no report)
fills and frees that memory once, as a benchmark's first step.

Usage: bench_fresh_pages.py [--size-mb 3072] [--count 3] [--dir /dev/shm] [--warm]
"""

from __future__ import annotations

import argparse
import os
import time


def fill(path: str, mb: int, block: bytes) -> tuple[float, float]:
    times = []
    with open(path, "wb") as f:
        for _ in range(mb // 8):
            t = time.perf_counter()
            f.write(block)
            times.append(time.perf_counter() - t)
    times.sort()
    return sum(times), times[len(times) // 2]


def warm(mb: int, directory: str = "/dev/shm") -> None:
    """Touches `mb` MB of memory (a tmpfs file) and frees it again."""
    path = os.path.join(directory, "ckptfs-warm")
    fill(path, mb, b"\1" * (8 << 20))
    os.unlink(path)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mb", type=int, default=3072)
    ap.add_argument("--count", type=int, default=3)
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--warm", action="store_true")
    a = ap.parse_args()
    if a.warm:
        warm(a.size_mb * a.count, a.dir)
        return 0
    block = os.urandom(1 << 20) * 8
    paths = [os.path.join(a.dir, f"ckptfs-fresh-pages-{i}") for i in range(a.count)]
    print(f"| pass, file ({a.size_mb} MB in 8 MB writes, kept) | total (s) | median write (ms) | GB/s |")
    print("|---|---|---|---|")
    for what in ("first", "second (after deleting them)"):
        for i, p in enumerate(paths):
            total, median = fill(p, a.size_mb, block)
            print(f"| {what}, file {i + 1} | {total:.2f} | {median * 1e3:.1f} | "
                  f"{a.size_mb / 1024 / total:.2f} |", flush=True)
        for p in paths:
            os.unlink(p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
