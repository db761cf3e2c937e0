#!/usr/bin/env python3
"""What the third red team's hostile native inputs cost (issue 32), for one or two ckptfs
binaries side by side (figures in docs/benchmarks.md; the machine is noisy: compare within one
run).

  inspect rows  `ckptfs inspect DIR` of each hostile input: wall time and peak RSS (ru_maxrss)
    chunks60k   a DCP .metadata of 60,000 chunks of one tensor over 512 files (8 MB)
    members65k  300 chunks that all point at one torch.save archive of 65,536 members (7 MB)
    dupbomb     a 240 MiB .metadata of one list appended to itself (DUP, APPEND) 120 Mi times
    verl-links  a verl checkpoint whose --verl-links ranks are hard links of one rank file of
                4096 tensors (torch.save of DTensors, as verl's checkpoint manager saves them)
    megatron    Megatron-Core GPT torch_dist under the built-in map, config of 2^24 query groups
                (one row each, a 128 MiB store)
  fds           the daemon's peak descriptors over its own while it lists a .metadata naming
                25,000 .distcp files (sampled every 2 ms)
  stall         12 readers list one checkpoint whose build reads 4 x 60 MB shard headers
                (more readers than FUSE workers: -o threads=4); meanwhile another checkpoint is
                listed and read: its time, against the slow build's
  read          the per-read stamp check: a 1 GiB consolidated view read through the daemon
                (-o prefetch=off, the mount's page cache dropped, SRC on tmpfs: the daemon's
                fastest case, where a check costs most), binaries alternating, GB/s medians

Usage (as root, with the venv of tools/setup.sh):
       $VENV/bin/python tools/bench_trust.py [--bin build/src/ckptfs] [--baseline BIN]
           [--dir /dev/shm/ckptfs-bench-trust] [--verl-links 512] [--rounds 5]
           [--only inspect,fds,stall,read]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# --- inputs ----------------------------------------------------------------------------------

_TORCH_CASES = r'''
import io, json, os, pickle, sys, tempfile, zipfile
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

out, links = sys.argv[1], int(sys.argv[2])

def metadata(tensors):
    sdm, sd = {}, {}
    for key, (size, chunks) in tensors.items():
        cs = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s, *_ in chunks]
        sdm[key] = TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32),
                                         size=torch.Size(size), chunks=cs)
        for o, _, f, off, n in chunks:
            sd[MetadataIndex(fqn=key, offset=torch.Size(o))] = _StorageInfo(relative_path=f, offset=off, length=n)
    return pickle.dumps(Metadata(state_dict_metadata=sdm, planner_data={k: (k,) for k in tensors},
                                 storage_data=sd))

def archive(t):
    b = io.BytesIO()
    torch.save(t, b)
    return b.getvalue()

# chunks60k
d = os.path.join(out, "chunks60k"); os.makedirs(d)
n, length = 60_000, 1500
for f in range(512):
    with open(os.path.join(d, f"__{f}_0.distcp"), "wb") as fh:
        fh.truncate((n // 512 + 1) * length)
with open(os.path.join(d, ".metadata"), "wb") as fh:
    fh.write(metadata({"w": ([2 * n, 3], [([2 * i, 0], [2, 3], f"__{i % 512}_0.distcp", (i // 512) * length, length)
                                          for i in range(n)])}))
# members65k
d = os.path.join(out, "members65k"); os.makedirs(d)
one = zipfile.ZipFile(io.BytesIO(archive(torch.zeros(2, 3))))
z = io.BytesIO()
with zipfile.ZipFile(z, "w", zipfile.ZIP_STORED) as w:
    for info in one.infolist():
        w.writestr(info.filename, one.read(info.filename))
    for i in range(65_536 - len(one.infolist())):
        w.writestr(f"archive/x/{i}", b"")
open(os.path.join(d, "__0_0.distcp"), "wb").write(z.getvalue())
open(os.path.join(d, ".metadata"), "wb").write(metadata({"w": ([600, 3], [
    ([2 * i, 0], [2, 3], "__0_0.distcp", 0, len(z.getvalue())) for i in range(300)])}))
# files25k
d = os.path.join(out, "fds", "files25k"); os.makedirs(d)
blob = archive(torch.arange(4, dtype=torch.float32).reshape(1, 4))
for i in range(25_000):
    open(os.path.join(d, f"__{i}_0.distcp"), "wb").write(blob)
open(os.path.join(d, ".metadata"), "wb").write(metadata({"w": ([25_000, 4], [
    ([i, 0], [1, 4], f"__{i}_0.distcp", 0, len(blob)) for i in range(25_000)])}))

# verl-links: one rank file of 4096 tensors, hard-linked as every rank of a world of `links`
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
d = os.path.join(out, "verl-links"); os.makedirs(d)
g = torch.Generator().manual_seed(0)
first = os.path.join(d, f"model_world_size_{links}_rank_0.pt")
torch.save({f"model.layers.{i // 8}.t{i % 8}.weight": distribute_tensor(torch.randn(64, generator=g), mesh, [Shard(0)])
            for i in range(4096)}, first)
for r in range(1, links):
    os.link(first, os.path.join(d, f"model_world_size_{links}_rank_{r}.pt"))
json.dump({"FSDP_version": 2, "world_size": links}, open(os.path.join(d, "fsdp_config.json"), "w"))

# megatron: the built-in map megatron-gpt over a config of 2^24 query groups
groups = 1 << 24
d = os.path.join(out, "megatron")
u8 = torch.uint8
sd = {
    "embedding.word_embeddings.weight": torch.zeros(1, 1, dtype=u8),
    "decoder.layers.self_attention.linear_qkv.layer_norm_weight": torch.zeros(2, 1, dtype=u8),
    "decoder.layers.self_attention.linear_qkv.weight":
        torch.arange(3 * groups, dtype=torch.int64).to(u8).repeat(2).reshape(2, 3 * groups, 1),
    "decoder.layers.self_attention.linear_proj.weight": torch.zeros(2, 1, groups, dtype=u8),
    "decoder.layers.mlp.linear_fc1.layer_norm_weight": torch.zeros(2, 1, dtype=u8),
    "decoder.layers.mlp.linear_fc1.weight": torch.zeros(2, 2, 1, dtype=u8),
    "decoder.layers.mlp.linear_fc2.weight": torch.zeros(2, 1, 1, dtype=u8),
    "decoder.final_layernorm.weight": torch.zeros(1, dtype=u8),
    "output_layer.weight": torch.zeros(1, 1, dtype=u8),
}
dcp.save(sd, checkpoint_id=d)
json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1}, open(os.path.join(d, "metadata.json"), "w"))
json.dump({"hidden_size": 1, "num_attention_heads": groups, "num_key_value_heads": groups, "head_dim": 1,
           "intermediate_size": 1, "vocab_size": 1, "num_hidden_layers": 2, "tie_word_embeddings": False},
          open(os.path.join(d, "config.json"), "w"))
dist.destroy_process_group()
'''


def make_inputs(work: str, links: int) -> None:
    if os.path.exists(os.path.join(work, "done")):
        return
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-c", _TORCH_CASES, work, str(links)], env=env,
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"making the inputs failed:\n{r.stderr[-3000:]}")
    # dupbomb: PROTO 4, [], then DUP APPEND pairs (the list appended to itself), STOP: 240 MiB
    # whose every 2 bytes add a reference to the list.
    d = os.path.join(work, "dupbomb")
    os.makedirs(d)
    with open(os.path.join(d, ".metadata"), "wb") as f:
        f.write(b"\x80\x04]")
        chunk = b"2a" * (8 << 20)
        for _ in range(15):
            f.write(chunk)
        f.write(b".")
    open(os.path.join(d, "__0_0.distcp"), "wb").write(b"\0" * 64)
    # stall: 4 shards of 600,000 one-element tensors each (about 60 MB of header), and a small one
    for name, shards, tensors in (("slow", 4, 600_000), ("quick", 2, 4)):
        d = os.path.join(work, "stall", name)
        os.makedirs(d)
        for r in range(shards):
            header, info = {}, {}
            for t in range(tensors):
                header[f"layer.{t}.w"] = {"dtype": "F32", "shape": [1], "data_offsets": [4 * t, 4 * t + 4]}
                info[f"layer.{t}.w"] = {"saved_offsets": [r], "shape": [shards]}
            header["__metadata__"] = {"format": "pt", "DCP_SHARDING_INFO": json.dumps(info), "DCP_VERSION": "1.0"}
            h = json.dumps(header, separators=(",", ":")).encode()
            h += b" " * (-len(h) % 8)
            with open(os.path.join(d, f"shard-{r + 1:05d}-model-00001-of-00001.safetensors"), "wb") as f:
                f.write(len(h).to_bytes(8, "little") + h + bytes(4 * tensors))
    # read: a 1 GiB row-sharded view over 8 rank shards of 8 tensors
    d = os.path.join(work, "read", "ck")
    os.makedirs(d)
    rows_per, cols = 2048, 8192  # 4 bf16 tensors of 8 x 2048 rows by 8192: 32 MiB per rank each
    for r in range(8):
        header, info, off = {}, {}, 0
        for t in range(4):
            n = rows_per * cols * 2
            header[f"w{t}"] = {"dtype": "BF16", "shape": [rows_per, cols], "data_offsets": [off, off + n]}
            info[f"w{t}"] = {"saved_offsets": [r * rows_per, 0], "shape": [8 * rows_per, cols]}
            off += n
        header["__metadata__"] = {"format": "pt", "DCP_SHARDING_INFO": json.dumps(info), "DCP_VERSION": "1.0"}
        h = json.dumps(header, separators=(",", ":")).encode()
        h += b" " * (-len(h) % 8)
        with open(os.path.join(d, f"shard-{r + 1:05d}-model-00001-of-00001.safetensors"), "wb") as f:
            f.write(len(h).to_bytes(8, "little") + h)
            block = os.urandom(1 << 20)
            for _ in range(off >> 20):
                f.write(block)
    open(os.path.join(work, "done"), "w").write("1")


# --- measures --------------------------------------------------------------------------------


def run_inspect(binary: str, d: str, timeout: float) -> tuple[float, float, str]:
    """Wall seconds and peak RSS (MB, /usr/bin/time's) of `ckptfs inspect d`, and its verdict."""
    t0 = time.monotonic()
    try:
        r = subprocess.run(["/usr/bin/time", "-f", "%M", binary, "inspect", d], capture_output=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return timeout, float("nan"), "timeout"
    dt = time.monotonic() - t0
    lines = r.stderr.decode(errors="replace").strip().splitlines()
    try:
        rss = int(lines[-1]) / 1024
    except (ValueError, IndexError):
        rss = float("nan")
    text = r.stdout.decode(errors="replace") + "\n".join(lines[:-1])
    if r.returncode < 0 or "Command terminated by signal" in text:
        verdict = "killed"
    elif "bad_alloc" in text or "internal error" in text:
        verdict = "crashed"
    elif "problem" in text.lower() or "refused" in text.lower() or "not shown" in text.lower():
        verdict = "refused"
    else:
        verdict = "served"
    return dt, rss, verdict


class Daemon:
    def __init__(self, binary: str, src: str, mnt: str, opts: list[str]):
        os.makedirs(mnt, exist_ok=True)
        self.mnt = mnt
        self.proc = subprocess.Popen([binary, "mount", src, mnt, "-f", "-o", ",".join(["settle=0", *opts])],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 20
        while not os.path.ismount(mnt):
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("mount failed")
            time.sleep(0.02)

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def close(self) -> None:
        for _ in range(50):
            if subprocess.run(["fusermount3", "-u", self.mnt], capture_output=True).returncode == 0:
                break
            time.sleep(0.2)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            subprocess.run(["fusermount3", "-u", "-z", self.mnt], capture_output=True)
            self.proc.kill()
            self.proc.wait()


def fds_row(binary: str, work: str) -> int:
    d = Daemon(binary, os.path.join(work, "fds"), os.path.join(work, "mnt"), [])
    try:
        base, peak, stop = d.fds(), [0], threading.Event()

        def sample():
            while not stop.is_set():
                try:
                    peak[0] = max(peak[0], d.fds())
                except OSError:
                    pass
                time.sleep(0.002)

        t = threading.Thread(target=sample)
        t.start()
        try:
            subprocess.run(["ls", os.path.join(d.mnt, "files25k")], capture_output=True, timeout=600)
        finally:
            stop.set()
            t.join()
        return peak[0] - base
    finally:
        d.close()


def stall_row(binary: str, work: str) -> tuple[float, float]:
    """Seconds until another directory was listed and read, and until the slow one answered."""
    d = Daemon(binary, os.path.join(work, "stall"), os.path.join(work, "mnt"), ["threads=4"])
    try:
        done: list[float] = []
        t0 = time.monotonic()

        def reader():
            # A listing: each reader's OPENDIR reaches the daemon (a lookup of one name would
            # be sent once, the others waiting in the kernel).
            try:
                os.listdir(os.path.join(d.mnt, "slow"))
            except OSError:
                pass
            done.append(time.monotonic() - t0)

        readers = [threading.Thread(target=reader, daemon=True) for _ in range(12)]
        for r in readers:
            r.start()
        time.sleep(0.5)
        os.listdir(os.path.join(d.mnt, "quick"))
        with open(os.path.join(d.mnt, "quick", "model-00001-of-00001.safetensors"), "rb") as f:
            f.read()
        quick = time.monotonic() - t0
        for r in readers:
            r.join(timeout=600)
        return quick, min(done) if done else float("nan")
    finally:
        d.close()


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def read_rate(binary: str, work: str) -> float:
    d = Daemon(binary, os.path.join(work, "read"), os.path.join(work, "mnt"), ["prefetch=off"])
    try:
        path = os.path.join(d.mnt, "ck", "model-00001-of-00001.safetensors")
        os.stat(path)
        drop_caches()
        fd = os.open(path, os.O_RDONLY)
        buf = bytearray(4 << 20)
        n, t0 = 0, time.monotonic()
        try:
            while True:
                k = os.readv(fd, [buf])
                if k == 0:
                    break
                n += k
        finally:
            os.close(fd)
        return n / (time.monotonic() - t0) / 1e9
    finally:
        d.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "src", "ckptfs"))
    ap.add_argument("--baseline", default=None, help="a ckptfs binary from before, run side by side")
    ap.add_argument("--dir", default="/dev/shm/ckptfs-bench-trust")
    ap.add_argument("--verl-links", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5, help="rounds of the read row")
    ap.add_argument("--timeout", type=float, default=300, help="per inspect run")
    ap.add_argument("--only", default="inspect,fds,stall,read")
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_trust.py: run as root (mounts, drop_caches)", file=sys.stderr)
        return 2
    only = set(a.only.split(","))
    bins = {"new": a.bin}
    if a.baseline:
        bins = {"before": a.baseline, "new": a.bin}
    make_inputs(a.dir, a.verl_links)
    print(f"# bench_trust.py --verl-links {a.verl_links} --rounds {a.rounds}; binaries: "
          + ", ".join(f"{k}={v}" for k, v in bins.items()))
    if "inspect" in only:
        print("\n| input | " + " | ".join(f"{k}: s, peak MB, verdict" for k in bins) + " |")
        print("|---|" + "---|" * len(bins))
        for case in ("chunks60k", "members65k", "dupbomb", "verl-links", "megatron"):
            cells = []
            for b in bins.values():
                dt, rss, verdict = run_inspect(b, os.path.join(a.dir, case), a.timeout)
                cells.append(f"{dt:.2f} s, {rss:.0f} MB, {verdict}")
            print(f"| {case} | " + " | ".join(cells) + " |", flush=True)
    if "fds" in only:
        print("\n| descriptors held over the daemon's own while listing 25,000 files | "
              + " | ".join(f"{k}: {fds_row(b, a.dir)}" for k, b in bins.items()) + " |", flush=True)
    if "stall" in only:
        for k, b in bins.items():
            quick, slow = stall_row(b, a.dir)
            print(f"| stall, {k} | other directory listed and read after {quick:.2f} s | slow "
                  f"build answered after {slow:.2f} s |", flush=True)
    if "read" in only:
        rates: dict[str, list[float]] = {k: [] for k in bins}
        for _ in range(a.rounds):
            for k, b in bins.items():
                rates[k].append(read_rate(b, a.dir))
        print("\n| daemon read, 1 GiB view, tmpfs SRC, prefetch=off | " + " | ".join(
            f"{k}: {statistics.median(v):.2f} GB/s (of {', '.join(f'{x:.2f}' for x in v)})"
            for k, v in rates.items()) + " |")
        if a.baseline:
            print(f"ratio new/before: {statistics.median(rates['new']) / statistics.median(rates['before']):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
