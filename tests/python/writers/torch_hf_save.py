#!/usr/bin/env python3
"""Save with torch DCP's HuggingFaceStorageWriter(save_distributed=True, enable_consolidation=True)
from 2 ranks (CPU, gloo): rank shards in OUT/sharded/, then rank 0's consolidation (in the
writer's finish()) lists OUT/sharded/*.safetensors, reads them back and writes
OUT/model-0000k-of-0000m.safetensors (header first, then reopened and appended) and the index.

    python torch_hf_save.py OUT [--mapping] [--ranks 2] [--seed 0]

--mapping gives the writer a 2-file fqn_to_index_mapping; --seed draws other weights. Rank 0 also writes
OUT/../reference-<name>.safetensors (the full tensors). The last stdout line is a JSON list of
the files under OUT (relative paths).
"""
import argparse
import json
import os

from ranks import TIMEOUT, files_under, spawn


def worker(rank, world, init_file, out, mapping, seed):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DeviceMesh, Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=TIMEOUT)
    try:
        mesh = DeviceMesh("cpu", list(range(world)))
        g = torch.Generator().manual_seed(seed)
        full = {"model.embed_tokens.weight": torch.randn(64, 16, generator=g),
                "model.layers.0.mlp.up_proj.weight": torch.randn(32, 16, generator=g),
                "model.layers.0.input_layernorm.weight": torch.randn(16, generator=g),
                "lm_head.weight": torch.randn(64, 16, generator=g).to(torch.bfloat16)}
        sd = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
        m = ({"model.embed_tokens.weight": 1, "model.layers.0.mlp.up_proj.weight": 1,
              "model.layers.0.input_layernorm.weight": 2, "lm_head.weight": 2} if mapping else None)
        w = dcp.HuggingFaceStorageWriter(out, fqn_to_index_mapping=m, save_distributed=True,
                                         enable_consolidation=True)
        dcp.save(sd, storage_writer=w)
        dist.barrier()
        if rank == 0:
            from safetensors.torch import save_file
            ref = os.path.join(os.path.dirname(out.rstrip("/")),
                               f"reference-{os.path.basename(out.rstrip('/'))}.safetensors")
            save_file(full, ref)
    finally:
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--mapping", action="store_true")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    spawn(worker, a.ranks, "torch-hf-save-", lambda scratch: (a.ranks, os.path.join(scratch, "init"), a.out, a.mapping, a.seed))
    print(json.dumps(files_under(a.out)))


if __name__ == "__main__":
    main()
