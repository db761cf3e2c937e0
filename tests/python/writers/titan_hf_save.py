#!/usr/bin/env python3
"""Save a tiny FSDP2-sharded torchtitan Llama3 as HF safetensors with torchtitan's own checkpointer.

    PYTHONPATH=/tmp/fw/site python titan_hf_save.py OUT_DIR [--ranks 2] [--seed 0] [--mapping] [--step 1]
                                                            [--native]

Entry point: torchtitan.components.checkpointer.dcp.CheckpointManager.save(step, last_step=True),
the call the Trainer makes after its last step. With Config(enable=True, last_save_model_only=True,
last_save_in_hf=True) it goes _save -> _save_last_step -> dcp_save(to_hf=True), which runs
Llama3StateDictAdapter.to_hf on the (DTensor) model state dict and then:
  * no fqn_to_index_mapping (default): HuggingFaceStorageWriter(path=step-N, save_distributed=True,
    enable_consolidation=True): every rank writes step-N/sharded/shard-0000R-model-00001-of-00001
    .safetensors, and the writer's finish() (coordinator rank only) writes step-N/model-00001-of-00001
    .safetensors and step-N/model.safetensors.index.json;
  * --mapping: the adapter is given an hf_assets_path holding a model.safetensors.index.json (written
    here, 2 files: layer 0 + embeddings in file 1, the rest in file 2), so it has a fqn_to_index_mapping;
    the writer then saves shards to step-N/sharded/ without consolidating, and dcp_save calls
    torch's consolidate_safetensors_files_on_every_rank(step-N/sharded -> step-N).
The fused-QKV state-dict hook hands q/k/v over as replicated DTensors, so DCP writes each of those whole,
once, in one rank's shard (saved_offsets all 0); every other tensor is split on dim 0 across ranks.
--native: torchtitan's own checkpoint instead (the default, last_save_in_hf=False, model and
training state): dcp.save with its FileSystemWriter into step-N/ (.metadata, __R_0.distcp), the
model's keys at the top level (tok_embeddings.weight, layers.N.attention..., norm.weight,
lm_head.weight) beside optimizer, lr_scheduler and train_state; rank 0 then writes
OUT_DIR/reference.safetensors = the full model state dict under those same (torchtitan) names.
Layout: OUT_DIR/checkpoint/step-N/... (torchtitan's default checkpoint.folder under base_folder=OUT_DIR).
Rank 0 also writes OUT_DIR/reference.safetensors = adapter.to_hf(full unsharded model state dict).
The last stdout line is a JSON list of every file under OUT_DIR (relative paths).

Needs (beyond the ckptfs venv: torch 2.15, safetensors 0.8), installed with
`python -m pip install --no-deps --target /tmp/fw/site PKG==VER`:
  torchtitan==0.3.0, tyro==1.0.16, docstring_parser==0.18.0, spmd_types==0.2.3  (imported on this path)
  einops==0.8.2, torch_checkpointing==0.1.1  (torchtitan requirements, installed too; not imported here)
No CUDA-only call is reached (nothing is monkeypatched); GPUs are hidden from the ranks anyway.
"""
import argparse
import json
import os
import sys

from ranks import TIMEOUT, files_under, spawn

DIM, HEADS, KV_HEADS, LAYERS, FFN, VOCAB = 64, 4, 2, 2, 128, 128


def tiny_llama3_config():
    """A tiny Llama3Model.Config, built like torchtitan's own _debugmodel flavour."""
    from functools import partial

    import torch.nn as nn
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers

    return Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM,
                                        param_init={"weight": partial(nn.init.normal_, std=1.0)}),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init={"weight": nn.init.ones_}),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB,
                              param_init={"weight": partial(nn.init.trunc_normal_, std=DIM ** -0.5)}),
        layers=_build_llama3_layers(
            n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, hidden_dim=FFN, fuse_qkv=True,
            rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=64, theta=500000, scaling="llama"),
            attn_backend="flex"),  # "sdpa" is refused by torchtitan 0.3.0
    )


def write_hf_assets(path):
    """An HF index (as a downloaded HF checkpoint has) that gives the adapter a 2-file mapping."""
    layer = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
             "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
             "input_layernorm.weight", "post_attention_layernorm.weight")
    names = ["model.embed_tokens.weight"] + [f"model.layers.{i}.{k}" for i in range(LAYERS) for k in layer]
    names += ["model.norm.weight", "lm_head.weight"]
    first = 1 + len(layer)  # embeddings + layer 0 -> file 1, the rest -> file 2
    weight_map = {n: f"model-0000{1 if i < first else 2}-of-00002.safetensors" for i, n in enumerate(names)}
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def worker(rank, world, scratch, out_dir, seed, mapping, step, native=False):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{scratch}/rdzv", rank=rank, world_size=world,
                            timeout=TIMEOUT)
    try:
        from safetensors.torch import save_file
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor
        from torchtitan.components.checkpointer import CheckpointManager
        from torchtitan.components.optimizer import OptimizersContainer
        from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
        from torchtitan.components.optimizer.optimizer import ParamGroupConfig
        from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
        from torchtitan.models.llama3 import Llama3StateDictAdapter

        # Build and initialise the full model on CPU with a fixed seed (same weights on every rank,
        # whatever --ranks), then shard it with torchtitan's own FSDP2 wrapping (fully_shard per block).
        cfg = tiny_llama3_config()
        torch.manual_seed(seed)
        model = cfg.build()
        with torch.no_grad():
            model.init_weights(buffer_device=torch.device("cpu"))
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
        apply_fsdp_to_decoder(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32, pp_enabled=False)

        hf_assets = None
        if mapping:
            hf_assets = os.path.join(scratch, "hf_assets")
            if rank == 0:
                write_hf_assets(hf_assets)
            dist.barrier()
        adapter = Llama3StateDictAdapter(cfg, hf_assets)

        # The pieces trainer.py hands its checkpointer (optimizer/scheduler are not saved: model-only).
        optimizers = OptimizersContainer.Config(
            param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3})],
            implementation="for-loop").build(model_parts=[model])
        lr_schedulers = LRSchedulersContainer.Config(warmup_steps=1).build(optimizers=optimizers,
                                                                           training_steps=step)
        # keep_latest_k=0: no purge thread; initial_load_model_only=False: silences a no-load warning.
        ckpt = CheckpointManager.Config(enable=True, last_save_model_only=not native,
                                        last_save_in_hf=not native, export_dtype="float32",
                                        keep_latest_k=0, initial_load_model_only=False).build(
            dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=lr_schedulers,
            states={}, sd_adapter=adapter, base_folder=out_dir)
        assert ckpt.save(step, last_step=True)
        ckpt.close()

        # Reference: the HF view of the full (unsharded) state dict, through the same adapter.
        # (model.state_dict() as torchtitan's ModelWrapper takes it; full_tensor() is a collective. DCP's
        # get_model_state_dict cannot be used: it trips over the fused-QKV state-dict hooks.)
        full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
        if rank == 0:
            ref = full if native else Llama3StateDictAdapter(cfg, None).to_hf(full)
            save_file({k: v.contiguous() for k, v in ref.items()}, os.path.join(out_dir, "reference.safetensors"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step", type=int, default=1, help="training step: output goes to checkpoint/step-N")
    ap.add_argument("--mapping", action="store_true", help="give the adapter a 2-file fqn_to_index_mapping")
    ap.add_argument("--native", action="store_true", help="torchtitan's own DCP checkpoint, not HF")
    a = ap.parse_args()
    out_dir = os.path.abspath(a.out_dir)
    os.makedirs(out_dir, exist_ok=True)

    # scratch: the rendezvous file and hf_assets, kept out of OUT_DIR
    spawn(worker, a.ranks, "titan-save-", lambda scratch: (a.ranks, scratch, out_dir, a.seed, a.mapping, a.step, a.native))
    print(json.dumps(files_under(out_dir)))


if __name__ == "__main__":
    sys.exit(main())
