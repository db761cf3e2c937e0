#!/usr/bin/env python3
"""Native DCP and verl checkpoints through the mount against the safetensors rank-shard form of
the same state dict (issue 20; figures in docs/benchmarks.md).

Two state dicts, each saved three times by torch itself into DIR/src:
  dcp-<kind>/  dcp.save with the default FileSystemWriter (.metadata + __0_0.distcp)
  st-<kind>/   dcp.save with HuggingFaceStorageWriter(save_distributed=True) (rank shards
               with DCP_SHARDING_INFO, the form ckptfs served before)
  verl-<kind>/ what verl's FSDP checkpoint manager writes: torch.save of the state dict as
               DTensors (Shard(0) on a 1-rank gloo mesh) in model_world_size_1_rank_0.pt, and
               fsdp_config.json
where <kind> is
  many: --tensors small f32 tensors (1 KiB each): the cost of parsing .metadata and locating
        every chunk's archive, against parsing one safetensors header;
  big:  64 bf16 tensors of --size-mb MB in all: read throughput.
Each round mounts SRC afresh (settle=0) and times, for each directory: the first listing (the
daemon builds the checkpoint), the first 4 KiB read of the consolidated file, and (big) two
whole reads of the consolidated file, the second warm; a direct read of the source files
gives the page-cache limit. Medians of --rounds; compare within one run (the machine is noisy).

Usage (as root, with the venv of tools/setup.sh):
  bench_native.py [--tensors 10000] [--size-mb 512] [--rounds 3] [--bin build/src/ckptfs]
                  [--dir /tmp/ckptfs-bench-native]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def save(src: str, tensors: int, size_mb: int) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(0)
    many = {f"model.layers.{i // 8}.t{i % 8}": torch.randn(256, generator=g) for i in range(tensors)}
    rows = max(1, (size_mb << 20) // 64 // (4096 * 2))
    big = {f"model.layers.{i}.w": torch.randn(rows, 4096, generator=g).to(torch.bfloat16) for i in range(64)}
    for kind, sd in (("many", many), ("big", big)):
        dcp.save(sd, checkpoint_id=os.path.join(src, f"dcp-{kind}"), no_dist=True)
        dcp.save(sd, storage_writer=dcp.HuggingFaceStorageWriter(os.path.join(src, f"st-{kind}"),
                                                                 save_distributed=True), no_dist=True)
        save_verl(os.path.join(src, f"verl-{kind}"), sd)


def save_verl(d: str, sd: dict) -> None:
    """verl's layout for a world of 1: torch.save({key: DTensor}) and fsdp_config.json."""
    import json
    import tempfile

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    os.makedirs(d)
    if not dist.is_initialized():
        rdzv = tempfile.mktemp(prefix="bench-native-rdzv-")
        dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
    torch.save({k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in sd.items()},
               os.path.join(d, "model_world_size_1_rank_0.pt"))
    with open(os.path.join(d, "fsdp_config.json"), "w") as f:
        json.dump({"FSDP_version": 2, "world_size": 1}, f)


def read_all(path: str) -> float:
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(8 << 20):
            pass
    return time.perf_counter() - t0


def consolidated(d: str) -> list[str]:
    return sorted(os.path.join(d, n) for n in os.listdir(d) if n.startswith("model-") and n.endswith(".safetensors"))


def one_round(binary: str, src: str, mnt: str, log: str) -> dict:
    os.makedirs(mnt, exist_ok=True)
    proc = subprocess.Popen([binary, "mount", src, mnt, "-f", "-o", "settle=0"], stdout=open(log, "a"),
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while not os.path.ismount(mnt):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mount failed; see {log}")
            time.sleep(0.02)
        out = {}
        for form in ("dcp", "verl", "st"):
            for kind in ("many", "big"):
                d = os.path.join(mnt, f"{form}-{kind}")
                t0 = time.perf_counter()
                names = os.listdir(d)
                out[f"{form}-{kind} list"] = time.perf_counter() - t0
                files = consolidated(d)
                assert files, f"{d}: nothing consolidated: {names}"
                t0 = time.perf_counter()
                with open(files[0], "rb", buffering=0) as f:
                    f.read(4096)
                out[f"{form}-{kind} first read"] = time.perf_counter() - t0
                if kind == "big":
                    size = sum(os.path.getsize(p) for p in files)
                    cold = sum(read_all(p) for p in files)
                    warm = sum(read_all(p) for p in files)
                    out[f"{form}-{kind} read GB/s (first)"] = size / cold / 1e9
                    out[f"{form}-{kind} read GB/s (warm)"] = size / warm / 1e9
        for form in ("dcp", "verl", "st"):
            d = os.path.join(src, f"{form}-big")
            files = [os.path.join(d, n) for n in os.listdir(d) if not n.endswith(".json")]
            size = sum(os.path.getsize(p) for p in files)
            out[f"{form}-big direct read GB/s (warm)"] = size / sum(read_all(p) for p in files) / 1e9
        return out
    finally:
        subprocess.run(["fusermount3", "-u", mnt], capture_output=True)
        proc.wait(timeout=30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=10000)
    ap.add_argument("--size-mb", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "src", "ckptfs"))
    ap.add_argument("--dir", default="/tmp/ckptfs-bench-native")
    a = ap.parse_args()
    src = os.path.join(a.dir, "src")
    if os.path.exists(a.dir):
        shutil.rmtree(a.dir)
    os.makedirs(src)
    t0 = time.perf_counter()
    save(src, a.tensors, a.size_mb)
    meta = os.path.getsize(os.path.join(src, "dcp-many", ".metadata"))
    print(f"saved in {time.perf_counter() - t0:.1f} s; dcp-many/.metadata is {meta} bytes", flush=True)
    rounds = [one_round(a.bin, src, os.path.join(a.dir, "mnt"), os.path.join(a.dir, "mount.log"))
              for _ in range(a.rounds)]
    for key in rounds[0]:
        vals = [r[key] for r in rounds]
        unit = "" if "GB/s" in key else " s"
        print(f"{key:40s} median {statistics.median(vals):.4f}{unit}  (all: {', '.join(f'{v:.4f}' for v in vals)})")
    shutil.rmtree(a.dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
