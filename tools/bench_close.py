#!/usr/bin/env python3
"""The commit at close of a many-tensor file written through the mount (issue 34; figures in
docs/benchmarks.md, "The commit flow, side by side").

A consolidated safetensors file of --tensors small F32 tensors (a [4] each: the header is the
file) is written into a fresh mount's checkpoint directory that already holds file 1 of 2 as
rank shards, as file 2 of 2, in 1 MiB writes, then closed. close() is where the daemon plans the
file's rank shards, checks the directory's checkpoint with it (write/store_checks) and commits:
the part of a save that grows with the tensor count, not the bytes. Timed: the writes, and the
close alone. Rounds alternate the binaries (--bin, --bin2), each on its own fresh mount, so both
see the same machine; compare medians and their ratio.

Correctness, every round: SRC holds exactly --ranks rank shards of the file and no real
model-00002-of-00002.safetensors, and the file reads back through the mount byte for byte.

Usage (as root; needs built ckptfs binaries):
  bench_close.py [--tensors 100000] [--ranks 4] [--rounds 5] [--bin NEW] [--bin2 OLD]
                 [--dir /dev/shm/ckptfs-bench-close]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
from bench_write import Daemon  # noqa: E402


def safetensors_bytes(names: list[str], fill: int) -> bytes:
    """A consolidated file: each name an F32 [4] tensor, packed in order."""
    header = {n: {"dtype": "F32", "shape": [4], "data_offsets": [16 * i, 16 * i + 16]}
              for i, n in enumerate(names)}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    data = bytes([fill]) * (16 * len(names))
    return struct.pack("<Q", len(text)) + text + data


def write_file(path: str, blob: bytes) -> tuple[float, float]:
    """Writes `blob` in 1 MiB pieces; returns (seconds writing, seconds in close)."""
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    view = memoryview(blob)
    for off in range(0, len(blob), 1 << 20):
        os.write(fd, view[off:off + (1 << 20)])
    t1 = time.perf_counter()
    os.close(fd)
    return t1 - t0, time.perf_counter() - t1


def one_round(binary: str, base: str, ranks: int, first: bytes, second: bytes) -> dict:
    src, mnt = os.path.join(base, "src"), os.path.join(base, "mnt")
    shutil.rmtree(src, ignore_errors=True)
    os.makedirs(os.path.join(src, "ck"))
    d = Daemon(binary, src, mnt, [f"ranks={ranks}"], os.path.join(base, "daemon.log"))
    try:
        # File 1 of 2, stored as rank shards through the mount (untimed): the directory the
        # timed file must fit.
        write_file(os.path.join(mnt, "ck", "model-00001-of-00002.safetensors"), first)
        w, c = write_file(os.path.join(mnt, "ck", "model-00002-of-00002.safetensors"), second)
        shards = sorted(n for n in os.listdir(os.path.join(src, "ck"))
                        if n.startswith("shard-") and n.endswith("model-00002-of-00002.safetensors"))
        if len(shards) != ranks or os.path.exists(
                os.path.join(src, "ck", "model-00002-of-00002.safetensors")):
            raise RuntimeError(f"{binary}: file 2 not stored as {ranks} rank shards: {shards}")
        with open(os.path.join(mnt, "ck", "model-00002-of-00002.safetensors"), "rb") as f:
            if f.read() != second:
                raise RuntimeError(f"{binary}: file 2 reads back different bytes")
        return {"write_s": w, "close_s": c}
    finally:
        d.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, default=100_000)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--bin", default=os.path.join(ROOT, "build-release", "src", "ckptfs"))
    ap.add_argument("--bin2", default=None, help="a second binary timed in the same rounds")
    ap.add_argument("--dir", default="/dev/shm/ckptfs-bench-close")
    a = ap.parse_args()
    bins = {"bin": os.path.abspath(a.bin)}
    if a.bin2:
        bins["bin2"] = os.path.abspath(a.bin2)
    os.makedirs(a.dir, exist_ok=True)
    for k, b in list(bins.items()):  # a copy: a rebuild mid-run cannot mix builds
        shutil.copy2(b, os.path.join(a.dir, k))
        bins[k] = os.path.join(a.dir, k)
    names = [f"model.layers.{i // 8}.block.p{i % 8}.weight" for i in range(a.tensors)]
    first = safetensors_bytes(["model.embed_tokens.weight"], 1)
    second = safetensors_bytes(names, 2)
    print(f"file 2: {a.tensors} tensors, {len(second) / 1e6:.1f} MB "
          f"(header {(len(second) - 16 * a.tensors) / 1e6:.1f} MB), -o ranks={a.ranks}")
    res: dict[str, list[dict]] = {k: [] for k in bins}
    for r in range(a.rounds):
        order = list(bins) if r % 2 == 0 else list(reversed(bins))
        for k in order:
            res[k].append(one_round(bins[k], a.dir, a.ranks, first, second))
            print(f"round {r + 1} {k}: write {res[k][-1]['write_s']:.3f} s, "
                  f"close {res[k][-1]['close_s']:.3f} s", flush=True)
    med = {k: {m: statistics.median(x[m] for x in v) for m in ("write_s", "close_s")}
           for k, v in res.items()}
    for k, m in med.items():
        print(f"{k} ({a.bin if k == 'bin' else a.bin2}): median write {m['write_s']:.3f} s, "
              f"close {m['close_s']:.3f} s")
    if "bin2" in med:
        print(f"close, bin / bin2: {med['bin']['close_s'] / med['bin2']['close_s']:.2f}")
    shutil.rmtree(a.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
