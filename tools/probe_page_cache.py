#!/usr/bin/env python3
"""What the kernel's page cache does for a file: folio orders, faults and CPU of a read (issue 23).

For each PATH (a view through a ckptfs mount, a plain file through it, a native ext4 file),
one pass of MODE, reported per pass:
  read   read(2) into one 4 MiB buffer to the end;
  touch  mmap, then one byte per 4 KiB (numpy a[::4096].sum());
  copy   mmap, then every byte copied into an anonymous buffer touched beforehand.
Figures: GB/s (noisy on a shared machine), minor faults and user+sys CPU (getrusage; the
steady ones), and with --orders, the folios the pass inserted into the page cache by order,
from the `filemap:mm_filemap_add_to_page_cache` tracepoint filtered to the file's device
(and inode, unless the device is a FUSE mount: its inode numbers differ from the kernel's).

  probe_page_cache.py [--mode read|touch|copy] [--passes N] [--orders] [--drop] PATH...

--drop evicts each file's pages first (posix_fadvise DONTNEED: the whole page cache is not
dropped; a FUSE file's pages go too). Run as root (tracefs). A pass is one process-local
loop: the first pass of a cold file fills the cache, the later ones are warm.
"""
from __future__ import annotations

import argparse
import collections
import mmap
import os
import re
import resource
import time

import numpy as np

TRACE = "/sys/kernel/tracing"
EVENT = "events/filemap/mm_filemap_add_to_page_cache"


def _w(rel: str, text: str) -> None:
    with open(os.path.join(TRACE, rel), "w") as f:
        f.write(text)


def trace_start(path: str, fuse: bool) -> None:
    if not os.path.exists(os.path.join(TRACE, "trace")):
        os.system(f"mount -t tracefs nodev {TRACE} 2>/dev/null")
    st = os.stat(path)
    dev = (os.major(st.st_dev) << 20) | os.minor(st.st_dev)
    flt = f"s_dev == {dev}" + ("" if fuse else f" && i_ino == {st.st_ino}")
    _w("tracing_on", "0")
    _w("trace", "")
    _w("buffer_size_kb", "65536")
    _w(EVENT + "/filter", flt)
    _w(EVENT + "/enable", "1")
    _w("tracing_on", "1")


def trace_stop() -> dict[int, int]:
    _w("tracing_on", "0")
    orders: collections.Counter[int] = collections.Counter()
    with open(os.path.join(TRACE, "trace")) as f:
        for line in f:
            m = re.search(r"mm_filemap_add_to_page_cache: .*order=(\d+)", line)
            if m:
                orders[int(m.group(1))] += 1
    _w(EVENT + "/enable", "0")
    _w(EVENT + "/filter", "0")
    return dict(sorted(orders.items()))


def is_fuse(path: str) -> bool:
    st_dev = os.stat(path).st_dev
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            major, minor = (int(x) for x in parts[2].split(":"))
            if os.makedev(major, minor) == st_dev:
                return parts[parts.index("-") + 1].startswith("fuse")
    return False


def one_pass(path: str, mode: str, buf: memoryview, out) -> tuple[float, int, float]:
    size = os.path.getsize(path)
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        if mode == "read":
            while os.readv(fd, [buf]) > 0:
                pass
        else:
            with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as mm:
                a = np.frombuffer(mm, dtype=np.uint8)
                if mode == "touch":
                    int(a[::4096].sum())
                else:
                    np.copyto(out[:size], a)
                del a
    finally:
        os.close(fd)
    dt = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return size / dt / 1e9, r1.ru_minflt - r0.ru_minflt, cpu * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--mode", default="touch", choices=("read", "touch", "copy"))
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--orders", action="store_true", help="trace the folio orders of pass 1")
    ap.add_argument("--drop", action="store_true", help="evict each file's pages first")
    a = ap.parse_args()
    buf = memoryview(bytearray(4 << 20))
    out = None
    if a.mode == "copy":
        out = np.ones(max(os.path.getsize(p) for p in a.paths), dtype=np.uint8)
    print(f"| file | pass | GB/s | minor faults | CPU ms |{' folios by order (pass 1) |' if a.orders else ''}")
    print(f"|---|---|---|---|---|{'---|' if a.orders else ''}")
    for p in a.paths:
        if a.drop:
            fd = os.open(p, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        for i in range(a.passes):
            if a.orders and i == 0:
                trace_start(p, is_fuse(p))
            gbs, faults, cpu = one_pass(p, a.mode, buf, out)
            extra = f" {trace_stop()} |" if a.orders and i == 0 else (" |" if a.orders else "")
            print(f"| {p} | {i + 1} | {gbs:.2f} | {faults} | {cpu:.0f} |{extra}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
