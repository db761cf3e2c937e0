#!/usr/bin/env python3
"""Costs a hostile (or just large) source can impose, for one or two ckptfs binaries side by
side (figures in docs/benchmarks.md; the machine is noisy, so compare within one run).

  inspect N      `ckptfs inspect` of a 2-rank checkpoint of N tiny tensors (N = 5k, 20k, 100k):
                 parsing and the model build must be linear in N
  ls 8x10k       first `ls` through a fresh mount of an 8-rank step of 10,000 tensors
  rewrite RSS    daemon VmRSS after each of K rewrites (write + rename) of a shard whose header
                 carries a 50 MB metadata string, the view read after each
  churn RSS      daemon VmRSS growth over S steps created, listed, read and deleted
  record N       first `ls` through a fresh mount of a step of N one-chunk rank shards, with
                 and without a commit record naming them all (issue 18: matching a record to
                 its shards must be linear)
  write headers  daemon VmRSS while 8 writers hold an unfinished 90 MB header open each
                 (issue 18: the write path's memory is bounded, -o write_mem_mb)
  log flood      log lines about one refused checkpoint of N empty shard files, listed 3 times

Usage: sudo tools/bench_hostile.py [--bin build/src/ckptfs] [--baseline BIN] [--dir DIR]
                                   [--skip-100k] [--rewrites 6] [--steps 500]
                                   [--only inspect,ls,rewrite,churn,record,writemem,logflood]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
from bench_read import Daemon  # noqa: E402


def write_shard(path: str, rank: int, ranks: int, names: list[str], junk: int = 0) -> None:
    """One rank's shard: every tensor is F32 [1] here, [ranks] in full (row-sharded)."""
    entries, info, pos = {}, {}, 0
    for n in names:
        entries[n] = {"dtype": "F32", "shape": [1], "data_offsets": [pos, pos + 4]}
        info[n] = {"saved_offsets": [rank], "shape": [ranks]}
        pos += 4
    meta = {"DCP_SHARDING_INFO": json.dumps(info), "format": "pt"}
    if junk:
        meta["junk"] = "j" * junk
    text = json.dumps({"__metadata__": meta, **entries}, separators=(",", ":")).encode()
    text += b" " * ((8 - (8 + len(text)) % 8) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + bytes(pos))
    os.replace(tmp, path)


def write_ckpt(d: str, ranks: int, tensors: int, junk: int = 0) -> None:
    os.makedirs(d, exist_ok=True)
    names = [f"model.layers.{i // 16}.mlp.experts.{i % 16}.w" for i in range(tensors)]
    for r in range(ranks):
        write_shard(os.path.join(d, f"shard-{r + 1:05d}-model-00001-of-00001.safetensors"), r,
                    ranks, names, junk if r == 0 else 0)


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def timed(cmd: list[str], timeout: float) -> float | None:
    t0 = time.perf_counter()
    try:
        subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    return time.perf_counter() - t0


def fmt_s(v: float | None, limit: float) -> str:
    return f"> {limit:.0f} s (stopped)" if v is None else f"{v:.2f} s"


def bench_inspect(binary: str, root: str, sizes: list[int], timeout: float) -> dict:
    out = {}
    for n in sizes:
        d = os.path.join(root, f"inspect-{n}")
        if not os.path.isdir(d):
            write_ckpt(d, 2, n)
        out[n] = timed([binary, "inspect", d], timeout)
    return out


def bench_ls(binary: str, root: str, timeout: float) -> float | None:
    src = os.path.join(root, "ls-src")
    if not os.path.isdir(src):
        write_ckpt(os.path.join(src, "step"), 8, 10_000)
    dm = Daemon(binary, src, os.path.join(root, "mnt"), ["settle=0"])
    try:
        return timed(["ls", "-l", os.path.join(dm.mnt, "step")], timeout)
    finally:
        dm.close()


def read_view(mnt_dir: str) -> None:
    for n in os.listdir(mnt_dir):
        if n.startswith("model"):
            with open(os.path.join(mnt_dir, n), "rb") as f:
                f.read()


def wait_for_version(mnt_dir: str, old_ino: int | None, timeout: float = 60) -> int:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            ino = os.stat(os.path.join(mnt_dir, "model-00001-of-00001.safetensors")).st_ino
            if ino != old_ino:
                return ino
        except OSError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{mnt_dir}: no new version")


def bench_rewrites(binary: str, root: str, rewrites: int) -> list[float]:
    src = os.path.join(root, "rewrite-src")
    shutil.rmtree(src, ignore_errors=True)
    d = os.path.join(src, "step")
    write_ckpt(d, 2, 8, junk=50_000_000)
    dm = Daemon(binary, src, os.path.join(root, "mnt"), ["settle=0", "revalidate=0"])
    out = []
    try:
        ino = None
        for i in range(rewrites):
            if i:
                write_ckpt(d, 2, 8, junk=50_000_000 + i)  # new stamps, same size class
            ino = wait_for_version(os.path.join(dm.mnt, "step"), ino)
            read_view(os.path.join(dm.mnt, "step"))
            out.append(rss_mb(dm.proc.pid))
    finally:
        dm.close()
    return out


def bench_churn(binary: str, root: str, steps: int) -> tuple[float, float]:
    src = os.path.join(root, "churn-src")
    shutil.rmtree(src, ignore_errors=True)
    os.makedirs(src)
    dm = Daemon(binary, src, os.path.join(root, "mnt"), ["settle=0", "revalidate=0"])
    try:
        def one(i: int) -> None:
            d = os.path.join(src, f"step_{i}")
            write_ckpt(d, 2, 64)
            read_view(os.path.join(dm.mnt, f"step_{i}"))
            shutil.rmtree(d)
            os.listdir(dm.mnt)
        for i in range(50):  # warm-up: allocator pools, thread stacks
            one(i)
        before = rss_mb(dm.proc.pid)
        for i in range(50, 50 + steps):
            one(i)
        time.sleep(1.5)  # let the kernel's entry timeouts pass and forget the dead steps
        os.listdir(dm.mnt)
        return before, rss_mb(dm.proc.pid)
    finally:
        dm.close()


def bench_record(binary: str, root: str, n: int, timeout: float) -> tuple[float | None, float | None]:
    """First `ls` of a step of n one-chunk shards, without then with a record naming them."""
    src = os.path.join(root, f"record-src-{n}")
    d = os.path.join(src, "step")
    if not os.path.isdir(d):
        os.makedirs(d)
        sizes = []
        for r in range(n):
            path = os.path.join(d, f"shard-{r + 1:05d}-model-00001-of-00001.safetensors")
            write_shard(path, r, n, ["w"])
            sizes.append(os.path.getsize(path))
        h = json.dumps({"w": {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]}}).encode()
        rec = {"ckptfs_record": 1, "name": "model.safetensors", "k": 1, "m": 1,
               "size": 8 + len(h) + 4 * n, "header_json": h.decode(), "tx": "",
               "shards": [{"name": f"shard-{r + 1:05d}-model-00001-of-00001.safetensors",
                           "size": sizes[r]} for r in range(n)]}
        os.makedirs(os.path.join(d, ".ckptfs.off"), mode=0o700)
        with open(os.path.join(d, ".ckptfs.off", "model.safetensors.commit"), "w") as f:
            json.dump(rec, f)
    out = []
    for with_record in (False, True):
        on, off = os.path.join(d, ".ckptfs"), os.path.join(d, ".ckptfs.off")
        if with_record:
            os.rename(off, on)
        dm = Daemon(binary, src, os.path.join(root, "mnt"), ["settle=0"])
        try:
            out.append(timed(["ls", "-l", os.path.join(dm.mnt, "step")], timeout))
        finally:
            dm.close()
            if with_record:
                os.rename(on, off)
    return out[0], out[1]


def bench_write_headers(binary: str, root: str, files: int = 8, mb: int = 90) -> tuple[float, float]:
    """Daemon VmRSS before and while `files` writers each hold an unfinished `mb` MB header."""
    src = os.path.join(root, "writemem-src")
    shutil.rmtree(src, ignore_errors=True)
    os.makedirs(os.path.join(src, "d"))
    dm = Daemon(binary, src, os.path.join(root, "mnt"), ["settle=0"])
    fds = []
    try:
        before = rss_mb(dm.proc.pid)
        body = b'{"t":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"__metadata__":{"x":"'
        body += b"x" * (mb * 1_000_000 - len(body) - 4) + b'"}}'
        for i in range(files):
            fd = os.open(os.path.join(dm.mnt, "d", f".tmp{i}"), os.O_RDWR | os.O_CREAT, 0o644)
            os.write(fd, struct.pack("<Q", len(body)))
            view = memoryview(body)[:-100]  # all but the end: the header never completes
            for off in range(0, len(view), 1 << 20):
                os.write(fd, view[off:off + (1 << 20)])
            fds.append(fd)
        return before, rss_mb(dm.proc.pid)
    finally:
        for fd in fds:
            os.close(fd)
        dm.close()


def bench_log_flood(binary: str, root: str, n: int) -> int:
    """Log lines naming one refused checkpoint of n empty shard files, listed 3 times."""
    src = os.path.join(root, f"flood-src-{n}")
    d = os.path.join(src, "flood")
    if not os.path.isdir(d):
        os.makedirs(d)
        for r in range(n):
            open(os.path.join(d, f"shard-{r + 1:05d}-model-00001-of-00001.safetensors"), "w").close()
    mnt = os.path.join(root, "mnt")
    os.makedirs(mnt, exist_ok=True)
    log = os.path.join(root, "flood.log")
    with open(log, "w") as lf:
        proc = subprocess.Popen([binary, "mount", src, mnt, "-f", "-o", "settle=0"], stderr=lf)
        try:
            deadline = time.time() + 20
            while not os.path.ismount(mnt) and time.time() < deadline:
                time.sleep(0.02)
            for _ in range(3):
                os.listdir(os.path.join(mnt, "flood"))
                time.sleep(1.1)
        finally:
            subprocess.run(["fusermount3", "-u", mnt], check=False)
            proc.wait(timeout=30)
    with open(log) as f:
        return sum(1 for line in f if "/flood" in line)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "src", "ckptfs"))
    ap.add_argument("--baseline", help="a second binary measured the same way (e.g. an older build)")
    ap.add_argument("--dir", default="/dev/shm/ckptfs-bench-hostile")
    ap.add_argument("--skip-100k", action="store_true")
    ap.add_argument("--rewrites", type=int, default=6)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--timeout", type=float, default=300, help="per measurement, seconds")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--only", default="inspect,ls,rewrite,churn,record,writemem,logflood")
    ap.add_argument("--record-shards", type=int, default=50_000)
    a = ap.parse_args()
    only = set(a.only.split(","))
    if os.geteuid() != 0:
        print("bench_hostile: needs root (FUSE mounts)", file=sys.stderr)
        return 2
    bins = {"current": a.bin}
    if a.baseline:
        bins["baseline"] = a.baseline
    sizes = [5_000, 20_000] + ([] if a.skip_100k else [100_000])
    os.makedirs(a.dir, exist_ok=True)
    res: dict[str, dict] = {k: {} for k in bins}
    try:
        for name, b in bins.items():
            print(f"[{name}] {b}", flush=True)
            r = res[name]
            if "inspect" in only:
                r["inspect"] = bench_inspect(b, a.dir, sizes, a.timeout)
                print(f"  inspect: {r['inspect']}", flush=True)
            if "ls" in only:
                r["ls"] = bench_ls(b, a.dir, a.timeout)
                print(f"  ls 8x10k: {r['ls']}", flush=True)
            if "rewrite" in only:
                r["rewrite"] = bench_rewrites(b, a.dir, a.rewrites)
                print(f"  rewrite RSS MB: {r['rewrite']}", flush=True)
            if "churn" in only:
                r["churn"] = bench_churn(b, a.dir, a.steps)
                print(f"  churn RSS MB: {r['churn']}", flush=True)
            if "record" in only:
                r["record"] = bench_record(b, a.dir, a.record_shards, a.timeout)
                print(f"  record: {r['record']}", flush=True)
            if "writemem" in only:
                r["writemem"] = bench_write_headers(b, a.dir)
                print(f"  write headers RSS MB: {r['writemem']}", flush=True)
            if "logflood" in only:
                r["logflood"] = bench_log_flood(b, a.dir, a.record_shards)
                print(f"  log flood: {r['logflood']} lines", flush=True)
    finally:
        if not a.keep:
            shutil.rmtree(a.dir, ignore_errors=True)

    print("\n| measurement | " + " | ".join(bins) + " |")
    print("|---|" + "---|" * len(bins))
    if "inspect" in only:
        for n in sizes:
            print(f"| `inspect`, 2 ranks × {n:,} tensors | " +
                  " | ".join(fmt_s(res[k]["inspect"][n], a.timeout) for k in bins) + " |")
    if "ls" in only:
        print("| first `ls -l` through a fresh mount, 8 ranks × 10,000 tensors | " +
              " | ".join(fmt_s(res[k]["ls"], a.timeout) for k in bins) + " |")
    if "rewrite" in only:
        print(f"| daemon RSS over {a.rewrites} rewrites of a shard with a 50 MB header: "
              "after the first, highest, after the last | " +
              " | ".join(f"{r[0]:.0f}, {max(r):.0f}, {r[-1]:.0f} MB"
                         for r in (res[k]["rewrite"] for k in bins)) + " |")
    if "churn" in only:
        print(f"| daemon RSS growth over {a.steps} steps created, read and deleted | " +
              " | ".join(f"{(res[k]['churn'][1] - res[k]['churn'][0]) * 1024 / a.steps:.1f} KB/step "
                         f"({res[k]['churn'][0]:.0f} → {res[k]['churn'][1]:.0f} MB)" for k in bins) +
              " |")
    if "record" in only:
        n = a.record_shards
        print(f"| first `ls -l`, {n:,} one-chunk shards: without, with a record naming them | " +
              " | ".join(f"{fmt_s(res[k]['record'][0], a.timeout)}, {fmt_s(res[k]['record'][1], a.timeout)}"
                         for k in bins) + " |")
    if "writemem" in only:
        print("| daemon RSS while 8 writers hold an unfinished 90 MB header each: before, while | " +
              " | ".join(f"{res[k]['writemem'][0]:.0f} → {res[k]['writemem'][1]:.0f} MB" for k in bins) +
              " |")
    if "logflood" in only:
        print(f"| log lines about one refused checkpoint of {a.record_shards:,} empty shards, listed "
              "3 times | " + " | ".join(str(res[k]["logflood"]) for k in bins) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
