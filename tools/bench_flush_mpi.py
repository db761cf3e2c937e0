#!/usr/bin/env python3
"""Parallel-flush benchmark (issue 10; figures in docs/benchmarks.md, "Parallel flush").

One large consolidated safetensors file (--size-mb, a few big f32 tensors; built once in
memory, not timed) is written into a fresh mount in 1 MiB write() calls, the way safetensors'
buffered writer sends it, and timed from open() to the return of close() (the close commits:
every rank's shard is written, fsynced and acknowledged, the record renamed into place).
Bandwidth = file size / that time.

  scaling   `mpirun -np N ckptfs mount SRC MNT -o target_rate_mb=R` for each N in --ranks:
            every rank's shard writes (the head's own too) pass a token bucket of R MB/s
            (a rate-limited target: the hidden mount option, see src/flush/mpi_wire.cpp), so
            one rank's storage is the bottleneck the issue describes; the file splits into N
            shards, one per rank. Target: bandwidth(N) >= 0.7 * N * bandwidth(1).
  overhead  uncapped storage: `ckptfs mount -f -o ranks=N` (the local flusher: no mpirun) with
            and without an fsync before close (the MPI flusher always commits durably), against
            `mpirun -np N ckptfs mount` for each N.
  node-local  the same with `-o target=DIR/t%r` (variants nl-capped, nl): every rank stores
            its shards under its own target and SRC gets only the record.
  read-back every variant then reads the file back through the mount (8 MiB reads), timed:
            with node-local targets the head fetches ranks 1..N-1's bytes over MPI (ReadPath).
  write path  every mount variant uses the mount's default, write passthrough where the kernel
            offers it (issue 35): close() returns once the file is its own one shard in SRC,
            and the split after close sends it to the owners. A `-req` suffix (mpi-req,
            nl-req, local-req, mpi-capped-req, ...) adds -o write_passthrough=off: every byte
            as WRITE requests, streamed to the owners, close() after their acknowledgements.
            Both times are reported: "close" (the writer's wait) and "stored" (until
            status.json's writes.splits_pending is 0: every rank's shard committed; polled
            every 10 ms). `plain` writes the same file into a directory of --dir (no mount),
            `plain-fsync` with an fsync before close: the page cache's and the disk's speed.

Rounds interleave the variants (the machine is noisy); medians are reported. Round 1 checks
the result once per variant: the file reads back through the mount byte-exact (hash) and SRC
holds N shards. SRC lives under --dir (default /dev/shm: tmpfs, so the disk does not blur the
caps; pass a disk path to include it).

Usage (as root, with a build that has OpenMPI):
  bench_flush_mpi.py [--size-mb 512] [--ranks 1,2,4] [--rate-mb 40] [--rounds 3]
                     [--variants mpi-capped,nl-capped,local,local-fsync,mpi,nl,mpi-req,nl-req,
                                 plain,plain-fsync]
                     [--dir /dev/shm/ckptfs-bench-mpi] [--bin build/src/ckptfs] [--json OUT]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--mca", "rtc_hwloc_vmhole", "none",
          "--mca", "btl", "self,tcp",
          "--mca", "btl_tcp_if_include", "lo"]
CHUNK = 1 << 20


def make_file(size_mb: int) -> bytes:
    """A consolidated safetensors file of about size_mb MiB: 8 f32 tensors [rows, 4096]."""
    tensors = 8
    rows = max(1, size_mb * (1 << 20) // (tensors * 4096 * 4))
    nbytes = rows * 4096 * 4
    hdr = {"__metadata__": {"format": "pt"}}
    for i in range(tensors):
        hdr[f"layers.{i}.weight"] = {"dtype": "F32", "shape": [rows, 4096],
                                     "data_offsets": [i * nbytes, (i + 1) * nbytes]}
    j = json.dumps(hdr, separators=(",", ":")).encode()
    j += b" " * (-len(j) % 8)
    block = os.urandom(1 << 20)
    data = (block * (tensors * nbytes // len(block) + 1))[:tensors * nbytes]
    return struct.pack("<Q", len(j)) + j + data


def wait_mount(mnt: str, proc: subprocess.Popen, log: str, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not os.path.ismount(mnt):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"mount failed: {open(log).read()[-3000:]}")
        time.sleep(0.05)


def unmount(mnt: str, proc: subprocess.Popen):
    for _ in range(100):
        if subprocess.run(["fusermount3", "-u", mnt], capture_output=True).returncode == 0:
            break
        time.sleep(0.1)
    proc.wait(timeout=60)


def write_file(path: str, blob: bytes, fsync: bool) -> float:
    """Writes `blob` to `path` in CHUNK write() calls (an fsync before close if asked); returns
    the seconds from open() to the return of close()."""
    view = memoryview(blob)
    t0 = time.monotonic()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for off in range(0, len(blob), CHUNK):
        piece = view[off:off + CHUNK]
        while piece:
            piece = piece[os.write(fd, piece):]
    if fsync:
        os.fsync(fd)
    os.close(fd)
    return time.monotonic() - t0


def run_one(args, variant: str, n: int, blob: bytes, check: bool) -> tuple[float, float, float]:
    base = os.path.join(args.dir, f"{variant}-{n}")
    shutil.rmtree(base, ignore_errors=True)
    if variant.startswith("plain"):
        return run_plain(base, variant, blob)
    src, mnt = os.path.join(base, "src"), os.path.join(base, "mnt")
    os.makedirs(src)
    os.makedirs(mnt)
    log = base + ".log"
    opts = ["settle=0"]
    if variant.endswith("-req"):
        opts.append("write_passthrough=off")
        variant = variant[:-len("-req")]
    if variant.startswith("nl"):
        opts.append(f"target={base}/t%r")
    if variant.startswith("local"):
        cmd = [args.bin, "mount", src, mnt, "-f", "-o", ",".join(opts + [f"ranks={n}"])]
    else:
        if variant.endswith("-capped"):
            opts.append(f"target_rate_mb={args.rate_mb}")
        cmd = MPIRUN + ["-np", str(n), args.bin, "mount", src, mnt, "-o", ",".join(opts)]
    with open(log, "w") as lf:
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT)
    try:
        wait_mount(mnt, proc, log)
        os.mkdir(os.path.join(mnt, "d"))
        path = os.path.join(mnt, "d", "model.safetensors")
        t0 = time.monotonic()
        took = write_file(path, blob, fsync=variant == "local-fsync")
        status = os.path.join(mnt, ".ckptfs", "status.json")
        while json.load(open(status))["writes"]["splits_pending"] != 0:
            if time.monotonic() - t0 > 600:
                raise RuntimeError(f"{variant} N={n}: the split after close never finished")
            time.sleep(0.01)
        stored = time.monotonic() - t0
        if variant.startswith("nl"):
            shards = [f for r in range(n) for _, _, fs in os.walk(f"{base}/t{r}") for f in fs
                      if f.startswith("shard-")]
            assert not [x for x in os.listdir(os.path.join(src, "d")) if x.startswith("shard-")]
        else:
            shards = [x for x in os.listdir(os.path.join(src, "d")) if x.startswith("shard-")]
        assert len(shards) == n, (variant, n, shards)
        # The name can take a moment to show after the close (the view rescans the
        # directory; seen once in ~10 local ranks=4 runs, a read-path matter): wait for it.
        deadline = time.monotonic() + 10
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        h = hashlib.sha256() if check else None
        t1 = time.monotonic()
        with open(path, "rb", buffering=0) as f:
            while b := f.read(8 << 20):
                if h:
                    h.update(b)
        read_took = time.monotonic() - t1
        if h:
            assert h.digest() == hashlib.sha256(blob).digest(), f"{variant} N={n}: read-back differs"
        return took, stored, read_took
    finally:
        unmount(mnt, proc)
        shutil.rmtree(base, ignore_errors=True)


def run_plain(base: str, variant: str, blob: bytes):
    """The same file written into a plain directory (no mount): close, and read back."""
    os.makedirs(base)
    path = os.path.join(base, "model.safetensors")
    try:
        took = write_file(path, blob, fsync=variant == "plain-fsync")
        t1 = time.monotonic()
        with open(path, "rb", buffering=0) as f:
            while f.read(8 << 20):
                pass
        return took, took, time.monotonic() - t1
    finally:
        shutil.rmtree(base, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mb", type=int, default=512)
    p.add_argument("--ranks", default="1,2,4")
    p.add_argument("--rate-mb", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default="/dev/shm/ckptfs-bench-mpi")
    p.add_argument("--bin", default=os.path.join(ROOT, "build", "src", "ckptfs"))
    p.add_argument("--variants", default="mpi-capped,nl-capped,local,local-fsync,mpi,nl")
    p.add_argument("--json")
    a = p.parse_args()
    ranks = [int(x) for x in a.ranks.split(",")]
    variants = a.variants.split(",")
    os.makedirs(a.dir, exist_ok=True)
    blob = make_file(a.size_mb)
    size = len(blob)
    print(f"file: {size / 1e6:.0f} MB; {os.cpu_count()} cores; rate cap {a.rate_mb} MB/s per rank "
          f"(mpi-capped); SRC under {a.dir}", flush=True)
    times: dict[tuple[str, int], list[float]] = {}
    stored: dict[tuple[str, int], list[float]] = {}
    reads: dict[tuple[str, int], list[float]] = {}
    for r in range(a.rounds):
        order = [(v, n) for v in variants for n in ranks]
        order = order[r % len(order):] + order[:r % len(order)]
        for v, n in order:
            t, st, rt = run_one(a, v, n, blob, check=(r == 0))
            times.setdefault((v, n), []).append(t)
            stored.setdefault((v, n), []).append(st)
            reads.setdefault((v, n), []).append(rt)
            print(f"round {r + 1} {v:14s} N={n}: close {t:6.2f} s  {size / t / 1e6:7.1f} MB/s  "
                  f"stored {st:6.2f} s  {size / st / 1e6:7.1f} MB/s  "
                  f"read-back {size / rt / 1e6:7.1f} MB/s", flush=True)
    print("\nstored medians (MB/s; until every shard is committed):")
    print(f"{'variant':14s} " + " ".join(f"{'N=' + str(n):>9s}" for n in ranks))
    for v in variants:
        print(f"{v:14s} " + " ".join(
            f"{size / statistics.median(stored[(v, n)]) / 1e6:9.1f}" for n in ranks))
    print("\nclose medians (MB/s; the writer's wait):")
    print(f"{'variant':14s} " + " ".join(f"{'N=' + str(n):>9s}" for n in ranks))
    out = {}
    for v in variants:
        row = []
        for n in ranks:
            bw = size / statistics.median(times[(v, n)]) / 1e6
            rb = size / statistics.median(reads[(v, n)]) / 1e6
            sb = size / statistics.median(stored[(v, n)]) / 1e6
            out[f"{v}/{n}"] = {"mb_s": bw, "times": times[(v, n)], "stored_mb_s": sb,
                               "stored_times": stored[(v, n)], "read_mb_s": rb,
                               "read_times": reads[(v, n)]}
            row.append(f"{bw:9.1f}")
        print(f"{v:14s} " + " ".join(row))
    print("\nread-back medians (MB/s):")
    for v in variants:
        print(f"{v:14s} " + " ".join(f"{out[f'{v}/{n}']['read_mb_s']:9.1f}" for n in ranks))
    for capped in ("mpi-capped", "nl-capped", "mpi-capped-req", "nl-capped-req"):
        if capped not in variants or 1 not in ranks:
            continue
        one = out[f"{capped}/1"]["stored_mb_s"]
        for n in ranks:
            x = out[f"{capped}/{n}"]["stored_mb_s"]
            print(f"{capped} scaling N={n}: {x / one:.2f}x the N=1 figure "
                  f"(target >= {0.7 * n:.1f}x)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"size": size, "rate_mb": a.rate_mb, "results": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
