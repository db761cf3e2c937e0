#!/usr/bin/env python3
"""Consolidating writers into the mount against a plain directory (issue 19; figures in
docs/benchmarks.md).

--writer torch (the default): torch DCP's HuggingFaceStorageWriter(save_distributed=True,
enable_consolidation=True) saves a state dict of --size-mb MB (bf16, 64 tensors, row-sharded over
--ranks processes on gloo): rank shards into OUT/sharded/, then rank 0 lists them, reads them
back and writes OUT/model-*.safetensors and the index.
--writer torch-mapping: the same with an fqn_to_index_mapping of 4 files (torch writes every
file's header first, then reopens each to append its data).
--writer nemo: NeMo AutoModel 0.7.0's Checkpointer (save_consolidated=True) saves an FSDP2 bf16
Llama of about --size-mb MB: rank shards into OUT/model/, then OUT/model/consolidated/ (the
writer of tests/python/writers/nemo_consolidated_save.py, larger). Rounds alternate the plain directory and a fresh mount
(-o ranks=R) of another directory on the same file system; the machine is noisy, so compare
medians within one run. Reported: wall time of the whole save (spawn excluded); the time until
it is stored (the save, then the unmount, which waits for what the daemon does after close:
a split into rank shards, or the check that a consolidated file reads as its sharded/ view and
its store as links of those shards); the bytes the save left on the backing file system (du of
the plain directory and of SRC, each inode once); and, once, that the consolidated files read
back through the mount equal the plain save's. --bin2 adds a second binary, in the same rounds.
--again saves twice into each OUT and times the second save (over the first one's files: torch
writes each header over a name that stores a file, then reopens it to append). --warm-mb N
touches N MB of memory once before the rounds (on a freshly booted VM a page's first touch
costs several times a later one: tools/bench_fresh_pages.py). Each round's outputs are
deleted after it, so every round starts with the same memory free. --plain-keeps (with
--again) adds a second plain directory whose first save is moved aside (kept, not deleted)
before the timed save: its new files need fresh pages, as the mount's do, where the plain
second save reuses the pages its own O_TRUNCs free (a control for the cost of fresh memory).
--pool-mb N touches N MB of tmpfs and frees it again before each kind's saves, so that every
kind starts on the same pool of just-freed memory (on a VM whose free memory the host takes
back, a page freed long ago costs several times one freed just now: without it, which kind
follows which decides much of its time).

Usage (as root, with the venv of tools/setup.sh):
  bench_writers.py [--writer torch|torch-mapping|nemo] [--size-mb 512] [--ranks 2] [--rounds 3] [--mount-ranks 1]
                   [--again [--plain-keeps]] [--warm-mb N] [--pool-mb N]
                   [--bin build/src/ckptfs] [--bin2 OTHER] [--dir /tmp/ckptfs-bench-writers]
"""

from __future__ import annotations

import argparse
import filecmp
import functools
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import bench_fresh_pages  # noqa: E402


def torch_save(rank, world, out, mb, init_file, files=1):
    """The save to time: prepares, then returns it (run between two barriers). `files` above 1
    gives the writer an fqn_to_index_mapping of that many files (tensors in order, evenly)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DeviceMesh, Shard, distribute_tensor

    mesh = DeviceMesh("cpu", list(range(world)))
    rows = max(world, (mb << 20) // 64 // (4096 * 2))
    g = torch.Generator().manual_seed(0)
    full = {f"model.layers.{i}.w": torch.randn(rows, 4096, generator=g).to(torch.bfloat16)
            for i in range(64)}
    sd = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
    mapping = ({k: 1 + i * files // len(full) for i, k in enumerate(full)} if files > 1 else None)
    return lambda: dcp.save(sd, storage_writer=dcp.HuggingFaceStorageWriter(
        out, fqn_to_index_mapping=mapping, save_distributed=True, enable_consolidation=True))


def nemo_save(rank, world, out, mb, init_file):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    from nemo_automodel.components.checkpoint.config import CheckpointingConfig
    sys.path.insert(0, os.path.join(ROOT, "tests", "python", "writers"))
    from nemo_consolidated_save import tiny_tokenizer

    h, inter = 2048, 5632
    layers = max(1, round((mb << 20) / (2 * (4 * h * h + 3 * h * inter))))
    cfg = LlamaConfig(vocab_size=128, hidden_size=h, intermediate_size=inter,
                      num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=16,
                      max_position_embeddings=64, tie_word_embeddings=False, dtype="bfloat16",
                      architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    model = LlamaForCausalLM(cfg)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    for block in [*model.model.layers, model]:  # FSDP2 as NeMo's recipes apply it
        fully_shard(block, mesh=mesh)
    ckpt = CheckpointingConfig(checkpoint_dir=out, model_save_format="safetensors",
                               save_consolidated=True, model_repo_id="ckptfs/bench-llama",
                               model_cache_dir=os.path.join(os.path.dirname(init_file), "hf"),
                               consolidation_timeout_minutes=10).build(dp_rank=rank, tp_rank=0,
                                                                       pp_rank=0)
    tok = tiny_tokenizer()
    return lambda: ckpt.save_model(model, out, tokenizer=tok)


WRITERS = {"torch": torch_save, "torch-mapping": functools.partial(torch_save, files=4),
           "nemo": nemo_save}


def worker(rank, world, init_file, out, mb, result, writer):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    try:
        run = WRITERS[writer](rank, world, out, mb, init_file)
        dist.barrier()
        t0 = time.perf_counter()
        run()
        dist.barrier()
        if rank == 0:
            with open(result, "w") as f:
                f.write(str(time.perf_counter() - t0))
    finally:
        dist.destroy_process_group()


def save(out: str, mb: int, ranks: int, writer: str = "torch") -> float:
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as scratch:
        result = os.path.join(scratch, "t")
        os.makedirs(out, exist_ok=True)
        mp.spawn(worker, args=(ranks, os.path.join(scratch, "init"), out, mb, result, writer),
                 nprocs=ranks)
        with open(result) as f:
            return float(f.read())


def du(path: str) -> int:
    return int(subprocess.run(["du", "-sb", path], capture_output=True, text=True,
                              check=True).stdout.split()[0])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--writer", choices=sorted(WRITERS), default="torch")
    ap.add_argument("--size-mb", type=int, default=512)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mount-ranks", type=int, default=1)
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "src", "ckptfs"))
    ap.add_argument("--bin2", default=None)
    ap.add_argument("--dir", default="/tmp/ckptfs-bench-writers")
    ap.add_argument("--again", action="store_true")
    ap.add_argument("--warm-mb", type=int, default=0)
    ap.add_argument("--plain-keeps", action="store_true")
    ap.add_argument("--pool-mb", type=int, default=0)
    a = ap.parse_args()

    def timed(out: str, keep: bool = False) -> float:
        if a.again:
            save(out, a.size_mb, a.ranks, a.writer)
            if keep:  # the first save stays, under another name: the second makes new files
                os.rename(out, out + ".kept")
        return save(out, a.size_mb, a.ranks, a.writer)
    if a.warm_mb:
        # On a freshly booted VM a page's first touch costs several times a later one
        # (tools/bench_fresh_pages.py): touched once here, the memory the saves use is alike
        # for every round and every kind.
        bench_fresh_pages.warm(a.warm_mb)
    shutil.rmtree(a.dir, ignore_errors=True)
    plain, src, mnt = (os.path.join(a.dir, n) for n in ("plain", "src", "mnt"))
    for d in (plain, src, mnt):
        os.makedirs(d)
    bins = {"mount": a.bin}
    if a.bin2:
        bins["mount2"] = a.bin2
    kinds = ["plain", *(["plain-keeps"] if a.again and a.plain_keeps else []), *bins]
    times = {k: [] for k in kinds}
    stored = {k: [] for k in kinds}
    sizes = {}
    for rnd in range(a.rounds):
        done = []  # the round's outputs, deleted at its end
        for kind in (kinds if rnd % 2 == 0 else kinds[::-1]):
            if a.pool_mb:
                bench_fresh_pages.warm(a.pool_mb)
            if kind.startswith("plain"):
                out = os.path.join(plain, f"r{rnd}" + kind[5:])
                times[kind].append(timed(out, keep=kind == "plain-keeps"))
                stored[kind].append(times[kind][-1])
                sizes[kind] = du(out)
                if kind == "plain-keeps":
                    done.append(out + ".kept")
                done.append(out)
            else:
                proc = subprocess.Popen([bins[kind], "mount", src, mnt, "-f", "-o",
                                         f"settle=0,ranks={a.mount_ranks}"], stderr=subprocess.DEVNULL)
                while not os.path.ismount(mnt):
                    time.sleep(0.02)
                name = f"r{rnd}-{kind}"
                try:
                    out = os.path.join(mnt, name)
                    times[kind].append(timed(out))
                    t0 = time.perf_counter()
                    if rnd == 0:
                        # The consolidated output, read back through the mount.
                        sub = os.path.join("model", "consolidated") if a.writer == "nemo" else ""
                        ref = os.path.join(plain, "r0", sub)
                        for n in os.listdir(ref):
                            if n != "sharded":
                                assert filecmp.cmp(os.path.join(out, sub, n), os.path.join(ref, n),
                                                   shallow=False), n
                        t0 = time.perf_counter()
                finally:
                    while subprocess.run(["fusermount3", "-u", mnt], capture_output=True).returncode:
                        time.sleep(0.05)  # the writer's processes are still going
                    proc.wait(timeout=600)
                stored[kind].append(times[kind][-1] + time.perf_counter() - t0)
                sizes[kind] = du(os.path.join(src, name))
                done.append(os.path.join(src, name))
            print(f"[bench_writers] round {rnd + 1} {kind}: {times[kind][-1]:.2f} s", flush=True)
        # Every round starts with the same free memory (on tmpfs the outputs are memory), and
        # no save runs on the pages another kind's outputs freed just before it: what a save
        # finds free shapes its time on a VM whose free memory the host takes back
        # (docs/benchmarks.md, "A second consolidating save").
        for d in done:
            shutil.rmtree(d)
    print(f"\n{a.writer}: {a.size_mb} MB bf16 state dict, {a.ranks} ranks, consolidation on "
          f"(mount -o ranks={a.mount_ranks}){', the second save into each OUT' if a.again else ''}; "
          f"median of {a.rounds}")
    print("| where | save (s) | until stored (s) | bytes on disk |")
    print("|---|---|---|---|")
    for k in kinds:
        what = k if k.startswith("plain") else f"{k} ({bins[k]})"
        print(f"| {what} | {statistics.median(times[k]):.2f} | {statistics.median(stored[k]):.2f} "
              f"| {sizes[k] / 1e6:.0f} MB |")
    shutil.rmtree(a.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
