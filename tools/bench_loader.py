#!/usr/bin/env python3
"""Loader benchmark (issue 12): `ckptfs load` against the other ways to get a checkpoint's
bytes into memory, on one checkpoint, warm and cold, in one run.

The checkpoint is synthetic (tests/python/shardgen.py): a Llama-shaped model (hidden 2048,
intermediate 5632, vocab 32000, bf16; layers from --size) as rank shards of --world ranks,
--layout row (FSDP: dim 0 split) or col (TP-style: the o/down projections split by columns,
so the loader gathers strided runs). `ckptfs consolidate` then writes its consolidated copy,
which also serves as the native copy (its files are what save_pretrained would hold).

Variants (each run in this process or a child, all delivering every tensor into memory):
  load shards        `ckptfs load SHARDS --bench --json` (its own timer: the load alone)
  load consolidated  the same on the consolidated copy
  binding shards     ckptfs_load.load_state_dict(SHARDS) in this process (torch tensors)
  safetensors        safetensors.torch.load_file(f, device="cpu") for every file of the copy,
                     each tensor then clone()d (load_file maps the file: without the clone no
                     byte need be read); and device="cuda:0" when torch sees a GPU
  safetensors mount  the same through `ckptfs mount` of the shards (-o ro,settle=0)
  preadv T           the limit: os.preadv of 16 MiB chunks of the consolidated files into a
                     reused 16 MiB buffer per thread (no page faults: the issue's figure), or
                     into fresh memory of the whole size (first-touch faults included, as a
                     loader pays), T Python threads (they release the GIL in preadv)
Cold: `sync; echo 3 > /proc/sys/vm/drop_caches` before the run (skipped where refused).
Warm: an untimed run of the same variant first. Each cell is the median of --repeat timed
runs. GB/s = tensor bytes / seconds (preadv: file bytes). Prints a markdown table.

  python tools/bench_loader.py --dir /var/tmp/ckptfs-bench-loader --size 1.5 [--threads 2]
  python tools/bench_loader.py --size 2 --huge-pages-ab 5   # huge pages advised or not
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "python"))
sys.path.insert(0, str(ROOT / "python"))

CHUNK = 16 << 20


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def make_checkpoint(d: pathlib.Path, size_gb: float, world: int, layout: str, bin_: str):
    from shardgen import llama_like, write_checkpoint
    per_layer = (3 * 2048 * 2048 + 3 * 2048 * 5632) * 2  # q, o, k+v (half each); gate, up, down
    emb = 2 * 32000 * 2048 * 2
    layers = max(1, round((size_gb * 1e9 - emb) / per_layer))
    src = d / "src" / "ck"
    if not (src / "done").exists():
        shutil.rmtree(d, ignore_errors=True)
        specs = llama_like(layers=layers, hidden=2048, inter=5632, vocab=32000, dtype="BF16",
                           files=4, layout=layout, world=world)
        t = time.time()
        write_checkpoint(str(src), specs, world=world, files=4, seed=1)
        subprocess.run([bin_, "consolidate", str(src), str(d / "cons")], check=True)
        (src / "done").write_text("")
        print(f"# generated {layers} layers in {time.time() - t:.0f}s", file=sys.stderr)
    return src, d / "cons"


def total_tensor_bytes(cons: pathlib.Path) -> int:
    from shardgen import read_safetensors  # noqa: F401  (header only below)
    import struct
    n = 0
    for f in sorted(cons.glob("model*.safetensors")):
        with open(f, "rb") as h:
            (hl,) = struct.unpack("<Q", h.read(8))
            n += f.stat().st_size - 8 - hl
    return n


def cli_load(bin_, path, *args, env=None):
    r = subprocess.run([bin_, "load", str(path), "--bench", "--json", *map(str, args)],
                       capture_output=True, text=True, check=True, env=env)
    j = json.loads(r.stdout)
    return j["seconds"], j


def huge_pages_ab(bin_, src, threads, pairs, nbytes, gap):
    """`ckptfs load SHARDS` (warm) in fresh processes, alternating $CKPTFS_LOAD_HUGEPAGES=1 (huge
    pages advised for the destinations) and =0, after one untimed run; `auto` is the
    library's rule here (docs/loader.md). `gap` seconds of sleep before each run: under a
    balloon that reports free pages, memory the previous run freed is handed back to the
    host after about 2 s, so back-to-back runs (gap 0) reuse memory a later load would not
    find. Prints each run and the medians."""
    cli_load(bin_, src, "--threads", threads)
    runs = {"1": [], "0": [], "auto": []}
    for i in range(pairs):
        for force in (("1", "0", "auto") if i % 2 == 0 else ("auto", "0", "1")):
            env = dict(os.environ)
            env.pop("CKPTFS_LOAD_HUGEPAGES", None)
            if force != "auto":
                env["CKPTFS_LOAD_HUGEPAGES"] = force
            time.sleep(gap)
            secs = cli_load(bin_, src, "--threads", threads, env=env)[0]
            runs[force].append(secs)
            print(f"# pair {i}: CKPTFS_LOAD_HUGEPAGES={force}: {secs:.3f} s", file=sys.stderr)
    med = {k: sorted(v)[len(v) // 2] for k, v in runs.items()}
    print(f"\nckptfs load of {nbytes / 1e9:.2f} GB of rank shards (warm, {threads} threads), each "
          f"run a fresh process after {gap:g} s idle, {pairs} alternating rounds. Command: python "
          f"tools/bench_loader.py {' '.join(sys.argv[1:])}\n")
    print("| huge pages | median s | GB/s | runs (s) |")
    print("|---|---|---|---|")
    for k, label in (("1", "advised (=1)"), ("0", "not advised (=0)"), ("auto", "the rule here")):
        print(f"| {label} | {med[k]:.2f} | {nbytes / med[k] / 1e9:.2f} | "
              + ", ".join(f"{t:.2f}" for t in runs[k]) + " |")
    print(f"\nadvised / not advised: {med['1'] / med['0']:.2f}")


def timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t, None


def preadv_limit(files, threads, fresh=False):
    jobs = []
    for f in files:
        size = f.stat().st_size
        jobs += [(f, off, min(CHUNK, size - off)) for off in range(0, size, CHUNK)]
    fds = {f: os.open(f, os.O_RDONLY) for f in files}
    import torch
    bufs = [bytearray(CHUNK) for _ in range(threads)]
    if fresh:  # one destination for all, allocated (untouched) like a loader's
        total = sum(n for _, _, n in jobs)
        dest = memoryview(torch.empty(total, dtype=torch.uint8).numpy())
        starts, pos = [], 0
        for _, _, n in jobs:
            starts.append(pos)
            pos += n

    def work(i):
        buf = memoryview(bufs[i])
        for j in range(i, len(jobs), threads):
            f, off, n = jobs[j]
            if fresh:
                buf = dest[starts[j]:]
            got = 0
            while got < n:
                k = os.preadv(fds[f], [buf[got:n]], off + got)
                if k <= 0:
                    raise OSError(f"short read of {f}")
                got += k

    try:
        t = time.perf_counter()
        with cf.ThreadPoolExecutor(threads) as ex:
            list(ex.map(work, range(threads)))
        return time.perf_counter() - t
    finally:
        for fd in fds.values():
            os.close(fd)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/var/tmp/ckptfs-bench-loader",
                    help="work dir, kept for reuse (removed and regenerated when incomplete)")
    ap.add_argument("--size", type=float, default=1.5, help="GB of tensors (default 1.5)")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--layout", choices=("row", "col"), default="row")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--modes", default="warm,cold")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per cell; the median is "
                    "reported (default %(default)s)")
    ap.add_argument("--bin", default=os.environ.get("CKPTFS_BIN", str(ROOT / "build/src/ckptfs")))
    ap.add_argument("--no-mount", action="store_true")
    ap.add_argument("--huge-pages-ab", type=int, metavar="ROUNDS", default=0,
                    help="only compare `ckptfs load` with huge pages advised and not, in fresh "
                    "processes, alternating, ROUNDS rounds")
    ap.add_argument("--gap", type=float, default=10.0, help="with --huge-pages-ab: seconds "
                    "idle before each run (default %(default)s)")
    a = ap.parse_args()
    os.environ.setdefault("CKPTFS_LOAD_LIB", str(pathlib.Path(a.bin).parent / "libckptfs_load.so"))
    import torch
    import safetensors.torch
    import ckptfs_load

    d = pathlib.Path(a.dir)
    src, cons = make_checkpoint(d, a.size, a.world, a.layout, a.bin)
    files = sorted(cons.glob("model*.safetensors"))
    nbytes = total_tensor_bytes(cons)
    file_bytes = sum(f.stat().st_size for f in files)
    T = a.threads
    if a.huge_pages_ab:
        huge_pages_ab(a.bin, src, T, a.huge_pages_ab, nbytes, a.gap)
        return

    def st_load(dirpath, device="cpu"):
        def run():
            for f in sorted(pathlib.Path(dirpath).glob("model*.safetensors")):
                sd = safetensors.torch.load_file(str(f), device=device)
                # On the CPU load_file maps the file: clone() makes the bytes land in memory
                # of their own, as every other variant's do.
                sd = {k: v.clone() for k, v in sd.items()} if device == "cpu" else sd
                del sd
            if device != "cpu":
                torch.cuda.synchronize()
        return lambda: timed(run)

    variants = [
        (f"ckptfs load, rank shards ({a.layout}, world {a.world}), {T} threads",
         lambda: cli_load(a.bin, src, "--threads", T), nbytes),
        (f"ckptfs load, consolidated copy, {T} threads",
         lambda: cli_load(a.bin, cons, "--threads", T), nbytes),
        ("ckptfs load, rank shards, 1 thread", lambda: cli_load(a.bin, src, "--threads", 1), nbytes),
        (f"ckptfs load, rank shards, {T} threads, --stage (ring + memcpy, the GPU pipeline)",
         lambda: cli_load(a.bin, src, "--threads", T, "--stage"), nbytes),
        (f"ckptfs load, rank shards, {T} threads, --direct",
         lambda: cli_load(a.bin, src, "--threads", T, "--direct"), nbytes),
        (f"ckptfs_load.load_state_dict (Python binding), rank shards, {T} threads",
         lambda: timed(lambda: ckptfs_load.load_state_dict(src, threads=T)), nbytes),
        ("safetensors load_file(device=cpu), native copy", st_load(cons), nbytes),
    ]
    if torch.cuda.is_available():
        variants.append(("safetensors load_file(device=cuda:0), native copy",
                         st_load(cons, "cuda:0"), nbytes))
        variants.append((f"ckptfs load --device cuda:0, rank shards, {T} threads",
                         lambda: cli_load(a.bin, src, "--threads", T, "--device", "cuda:0"), nbytes))
    mnt = d / "mnt"
    mounted = False
    if not a.no_mount and os.path.exists("/dev/fuse") and os.geteuid() == 0:
        mnt.mkdir(exist_ok=True)
        subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True)
        subprocess.run([a.bin, "mount", str(d / "src"), str(mnt), "-o", "ro,settle=0"], check=True)
        mounted = True
        for _ in range(100):
            if list((mnt / "ck").glob("model*.safetensors")):
                break
            time.sleep(0.1)
        variants.append(("safetensors load_file(device=cpu) through a ckptfs mount",
                         st_load(mnt / "ck"), nbytes))
    for t in sorted({1, 2, 4, T}):
        variants.append((f"limit: preadv 16 MiB chunks into a reused buffer, {t} threads",
                         (lambda t=t: (preadv_limit(files, t), None)), file_bytes))
    for t in sorted({1, T}):
        variants.append((f"limit: preadv 16 MiB chunks into fresh memory, {t} threads",
                         (lambda t=t: (preadv_limit(files, t, True), None)), file_bytes))

    modes = a.modes.split(",")
    rows = []
    try:
        for name, fn, size in variants:
            res = {}
            for mode in modes:
                times = []
                for _ in range(a.repeat):
                    if mode == "cold":
                        if not drop_caches():
                            break
                    elif not times:
                        fn()  # untimed: the page cache warm
                    times.append(fn()[0])
                if not times:
                    res[mode] = None
                    continue
                secs = sorted(times)[len(times) // 2]
                res[mode] = (secs, size / secs / 1e9)
            rows.append((name, res))
            print(f"# {name}: " + ", ".join(
                f"{m} {r[1]:.2f} GB/s" if r else f"{m} n/a" for m, r in res.items()),
                file=sys.stderr)
    finally:
        if mounted:
            subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True)

    print(f"\nCheckpoint: {nbytes / 1e9:.2f} GB of tensors, {a.layout}-sharded over {a.world} "
          f"ranks, bf16; {len(files)} consolidated files. Machine: {os.cpu_count()} cores, "
          f"CPU destination, median of {a.repeat} runs. "
          f"Command: python tools/bench_loader.py {' '.join(sys.argv[1:])}\n")
    head = "| variant | " + " | ".join(f"{m} GB/s | {m} s" for m in modes) + " |"
    print(head)
    print("|" + "---|" * (1 + 2 * len(modes)))
    for name, res in rows:
        cells = []
        for m in modes:
            r = res.get(m)
            cells += [f"{r[1]:.2f}", f"{r[0]:.2f}"] if r else ["n/a", "n/a"]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
