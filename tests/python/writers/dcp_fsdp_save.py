#!/usr/bin/env python3
"""Save a tiny FSDP2-sharded HF Llama with torch DCP's default writer (dcp.save, FileSystemWriter),
as KempnerForge, torchtitan and accelerate's SHARDED_STATE_DICT do (CPU, gloo).

    python dcp_fsdp_save.py OUT_DIR [--ranks 2] [--dtype float32|bfloat16] [--wrap] [--tied]
                            [--accelerate]

The model is trained one AdamW step, then each rank calls dcp.save with
  get_model_state_dict(model)                                    (default), or
  {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)}  (--wrap),
which writes OUT_DIR/__R_0.distcp per rank and OUT_DIR/.metadata last. With --accelerate the save
is accelerate's own (accelerate.utils.save_fsdp_model and save_fsdp_optimizer with an FSDP2
SHARDED_STATE_DICT plugin, what Accelerator.save_state and Trainer's FSDP checkpoints call):
OUT_DIR/pytorch_model_fsdp_0/ (dcp.save of {"model": ...}) and OUT_DIR/optimizer_0/, as in
Trainer's checkpoint-N/ (accelerate's PartialState is made over the gloo group already there). Rank 0 also writes
OUT_DIR/config.json (save_pretrained of the config) and OUT_DIR/../reference-<name>.safetensors: the
full, unsharded model state dict (from get_model_state_dict(full_state_dict=True)).
The sizes split unevenly over 3 ranks (vocab 130, intermediate 100: FSDP2's torch.chunk rows).
The last stdout line is a JSON list of the files under OUT_DIR (relative paths).
"""
import argparse
import json
import os

from ranks import TIMEOUT, files_under, spawn


def worker(rank, world, init_file, out_dir, dtype, wrap, tied, accel=False):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=TIMEOUT)
    try:
        from safetensors.torch import save_file
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from transformers import LlamaConfig, LlamaForCausalLM

        torch_dtype = getattr(torch, dtype)
        cfg = LlamaConfig(vocab_size=130, hidden_size=64, intermediate_size=100, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                          tie_word_embeddings=tied, dtype=dtype, architectures=["LlamaForCausalLM"])
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).to(torch_dtype)
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()

        if accel:
            from accelerate import PartialState
            from accelerate.utils import FullyShardedDataParallelPlugin, save_fsdp_model, save_fsdp_optimizer

            # accelerate's state over the process group already made (its env is torchrun's).
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                              MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
            acc = PartialState(cpu=True)
            plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
            save_fsdp_model(plugin, acc, model, out_dir)
            save_fsdp_optimizer(plugin, acc, opt, model, out_dir)
        else:
            msd = get_model_state_dict(model)
            sd = {"model": msd, "optimizer": get_optimizer_state_dict(model, opt)} if wrap else msd
            dcp.save(sd, checkpoint_id=out_dir)

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            cfg.save_pretrained(out_dir)
            name = os.path.basename(out_dir.rstrip("/"))
            ref = os.path.join(os.path.dirname(out_dir.rstrip("/")), f"reference-{name}.safetensors")
            save_file({k: v.clone().contiguous() for k, v in full.items()}, ref)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--wrap", action="store_true", help='save {"model": ..., "optimizer": ...}')
    ap.add_argument("--tied", action="store_true", help="tie the embedding and the LM head")
    ap.add_argument("--accelerate", action="store_true", help="accelerate's save_fsdp_model/optimizer")
    a = ap.parse_args()
    out_dir = os.path.abspath(a.out_dir)
    os.makedirs(out_dir, exist_ok=True)
    spawn(worker, a.ranks, "dcp-save-",
          lambda scratch: (a.ranks, os.path.join(scratch, "rdzv"), out_dir, a.dtype, a.wrap, a.tied,
                           a.accelerate))
    print(json.dumps(files_under(out_dir)))


if __name__ == "__main__":
    main()
