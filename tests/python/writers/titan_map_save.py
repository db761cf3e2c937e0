#!/usr/bin/env python3
"""HF models converted by torchtitan's own StateDictAdapter.from_hf and saved by its own checkpointer.

    python titan_map_save.py OUT_DIR [--ranks 2] [--seed 0] [--models llama3,qwen3,qwen3-moe]

For each model (all in one run: one transformers import, one mp.spawn of the ranks):
  1. here, in the parent: a tiny transformers model (LlamaForCausalLM, Qwen3ForCausalLM,
     Qwen3MoeForCausalLM) from a fixed config and seed, every parameter drawn from N(0, 1) (so
     no two norms are alike and a swapped tensor shows), saved with save_pretrained into
     OUT_DIR/M/hf/ (config.json, model.safetensors: the HF checkpoint torchtitan would start
     from), and its state dict (model.state_dict(), tied tensors cloned apart) into
     OUT_DIR/M/original.safetensors;
  2. in each of the ranks (CPU, gloo, FSDP2 over all of them): the torchtitan model of the same
     shape (torchtitan's own config builders), and the adapter's from_hf applied to
     hf/model.safetensors loaded into it (the fused-QKV load hook merges wq/wk/wv), then
     torchtitan's apply_fsdp_to_decoder and its CheckpointManager.save(1, last_step=True) into
     OUT_DIR/M/checkpoint/step-1 (dcp.save with its FileSystemWriter: .metadata, __R_0.distcp);
  3. rank 0 writes OUT_DIR/M/from_hf.safetensors (the adapter's from_hf output) and
     OUT_DIR/M/to_hf.safetensors (the adapter's to_hf of the full, gathered model state dict:
     what torchtitan itself exports), and, for the models in CONFIG_IN_STEP, copies
     hf/config.json into checkpoint/step-1/ (the others need `-o hf_config=`).

The models (sizes in MODELS):
  llama3     bf16, untied, GQA 4/2: Llama3StateDictAdapter (RoPE rows of wq/wk permuted);
             the full training state (model, optimizer, lr_scheduler, train_state), as a
             checkpoint taken to resume from;
  qwen3      fp32, tied, GQA 4/2, head_dim 32 != hidden/heads: Qwen3StateDictAdapter,
             model only (last_save_model_only); no config.json in the step directory;
  qwen3-moe  fp32, untied, 4 experts (grouped: w1_EFD/w3_EFD [E, F, D], w2_EDF [E, D, F],
             split over the 2 ranks on the expert axis), layer 0 MoE and layer 1 dense
             (HF's mlp_only_layers=[1]), the load-balancing buffer expert_bias_E stored;
             model only.
The last stdout line is a JSON list of every file under OUT_DIR (relative paths).
GPUs are hidden from the ranks; nothing is monkeypatched.
"""
import argparse
import json
import os
import shutil
import sys

from ranks import TIMEOUT, files_under, spawn

VOCAB, DIM, HEADS, KV_HEADS, LAYERS, FFN = 160, 64, 4, 2, 2, 96
QWEN_HEAD_DIM = 32  # != DIM // HEADS: the explicit head_dim path
MOE_EXPERTS, MOE_FFN, MOE_TOPK = 4, 32, 2

# name: (dtype, tied, model-only save, config.json in the step directory)
MODELS = {
    "llama3": ("bfloat16", False, False, True),
    "qwen3": ("float32", True, True, False),
    "qwen3-moe": ("float32", False, True, True),
}


def hf_config(name):
    import transformers

    dtype, tied, _, _ = MODELS[name]
    common = dict(vocab_size=VOCAB, hidden_size=DIM, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, intermediate_size=FFN, tie_word_embeddings=tied,
                  max_position_embeddings=64, dtype=dtype)
    if name == "llama3":
        return transformers.LlamaConfig(**common, rope_theta=500000.0, head_dim=DIM // HEADS)
    if name == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=QWEN_HEAD_DIM)
    return transformers.Qwen3MoeConfig(**common, head_dim=DIM // HEADS, num_experts=MOE_EXPERTS,
                                       num_experts_per_tok=MOE_TOPK, moe_intermediate_size=MOE_FFN,
                                       decoder_sparse_step=1, mlp_only_layers=[1])


def save_hf(name, out, seed):
    """Step 1: the HF model, its checkpoint and its state dict."""
    import torch
    import transformers
    from safetensors.torch import save_file

    cfg = hf_config(name)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, MODELS[name][0]))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    model.save_pretrained(os.path.join(out, "hf"))
    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()},
              os.path.join(out, "original.safetensors"))


def titan_model(name):
    """torchtitan's model config (its own builders) and state dict adapter class for `name`."""
    from functools import partial

    import torch.nn as nn
    from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RMSNorm

    init = {"weight": partial(nn.init.normal_, std=0.02)}
    dtype, tied, _, _ = MODELS[name]
    if name == "llama3":
        from torchtitan.models.llama3 import Llama3Model, Llama3StateDictAdapter, _build_llama3_layers

        layers = _build_llama3_layers(
            n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, hidden_dim=FFN, fuse_qkv=True,
            rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=64, theta=500000, scaling="llama"),
            attn_backend="flex")  # "sdpa" is refused by torchtitan 0.3.0
        cls, adapter = Llama3Model, Llama3StateDictAdapter
    else:
        from torchtitan.models.qwen3 import Qwen3Model, Qwen3StateDictAdapter, _build_qwen3_layers
        from torchtitan.models.qwen3 import _build_qwen3_moe_layers

        hd = QWEN_HEAD_DIM if name == "qwen3" else DIM // HEADS
        rope = CosSinRoPE.Config(dim=hd, max_seq_len=64, theta=1000000.0)
        dense = _build_qwen3_layers(n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=hd,
                                    hidden_dim=FFN, fuse_qkv=True, attn_backend="flex", rope=rope)
        if name == "qwen3":
            layers = dense
        else:  # layer 0 MoE, layer 1 dense (HF's mlp_only_layers=[1])
            moe = _build_qwen3_moe_layers(n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS,
                                          head_dim=hd, moe_hidden_dim=MOE_FFN, num_experts=MOE_EXPERTS,
                                          top_k=MOE_TOPK, fuse_qkv=True, attn_backend="flex",
                                          moe_comm_backend="standard", rope=rope)
            layers = [moe[0], dense[1]]
        cls, adapter = Qwen3Model, Qwen3StateDictAdapter
    cfg = cls.Config(
        dim=DIM, vocab_size=VOCAB, enable_weight_tying=tied,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=init),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init={"weight": nn.init.ones_}),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=init),
        layers=layers)
    return cfg, adapter


def save_titan(name, rank, world, scratch, out, step=1):
    """Steps 2 and 3 for one model, on one rank."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file, save_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    dtype_name, tied, model_only, config_in_step = MODELS[name]
    dtype = getattr(torch, dtype_name)
    cfg, Adapter = titan_model(name)
    titan_sd = Adapter(cfg, None).from_hf(load_file(os.path.join(out, "hf", "model.safetensors")))

    model = cfg.build()
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    with torch.no_grad():  # the parameters only (model.to would cast ComplexRoPE's complex cache too)
        for p in model.parameters():
            p.data = p.data.to(dtype)
    missing, unexpected = model.load_state_dict(titan_sd, strict=False)
    # expert_bias_E (a buffer torchtitan keeps for load balancing) is not in HF's checkpoint.
    assert not unexpected and all(k.endswith("moe.expert_bias_E") for k in missing), (missing, unexpected)
    sd = model.state_dict()
    bad = [k for k, v in titan_sd.items() if sd[k].dtype != v.dtype or not torch.equal(sd[k], v)]
    assert not bad, f"{name}: the model does not hold from_hf's tensors: {bad}"

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    apply_fsdp_to_decoder(model, mesh, param_dtype=dtype, reduce_dtype=torch.float32, pp_enabled=False)
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3})],
        implementation="for-loop").build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=1).build(optimizers=optimizers, training_steps=step)
    ckpt = CheckpointManager.Config(enable=True, last_save_model_only=model_only, last_save_in_hf=False,
                                    export_dtype=dtype_name, keep_latest_k=0,
                                    initial_load_model_only=False).build(
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=lr_schedulers,
        states={}, sd_adapter=Adapter(cfg, None), base_folder=out)
    assert ckpt.save(step, last_step=True)
    ckpt.close()

    full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    if rank == 0:
        save_file({k: v.detach().clone().contiguous() for k, v in titan_sd.items()},
                  os.path.join(out, "from_hf.safetensors"))
        to_hf = Adapter(cfg, None).to_hf(full)
        save_file({k: v.detach().clone().contiguous() for k, v in to_hf.items()},
                  os.path.join(out, "to_hf.safetensors"))
        if config_in_step:
            shutil.copy(os.path.join(out, "hf", "config.json"),
                        os.path.join(out, "checkpoint", f"step-{step}", "config.json"))
    dist.barrier()


def worker(rank, world, scratch, out_dir, names):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{scratch}/rdzv", rank=rank, world_size=world,
                            timeout=TIMEOUT)
    try:
        for name in names:
            save_titan(name, rank, world, scratch, os.path.join(out_dir, name))
    finally:
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--models", default=",".join(MODELS))
    a = ap.parse_args()
    out_dir = os.path.abspath(a.out_dir)
    names = a.models.split(",")
    for n in names:
        if n not in MODELS:
            ap.error(f"unknown model {n!r}; one of {list(MODELS)}")
        os.makedirs(os.path.join(out_dir, n), exist_ok=True)
        save_hf(n, os.path.join(out_dir, n), a.seed)
    spawn(worker, a.ranks, "titan-map-", lambda scratch: (a.ranks, scratch, out_dir, names))
    print(json.dumps(files_under(out_dir)))


if __name__ == "__main__":
    sys.exit(main())
