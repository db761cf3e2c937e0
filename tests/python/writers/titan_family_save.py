#!/usr/bin/env python3
"""torchtitan 0.3.0's other model families, saved by its own checkpointer (beside titan_map_save.py).

    python titan_family_save.py OUT_DIR [--ranks 2] [--seed 0] [--models deepseek-v3,kimi-k2.7,...]

For each model (all in one run: one transformers import, one mp.spawn of the ranks), in
OUT_DIR/M/:
  hf/                  (where the model starts from an HF model) config.json and model.safetensors
                       of a tiny transformers model, every floating tensor drawn from N(0, 1) (so no
                       two norms are alike and a swapped tensor shows); original.safetensors its
                       state dict: what from_pretrained of a correct view must give back;
  checkpoint/step-1/   torchtitan's CheckpointManager.save(1, last_step=True), model only (dcp.save
                       with its FileSystemWriter, FSDP2 over the gloo ranks: torchtitan's
                       apply_fsdp_to_decoder), with config.json beside it for the models in
                       CONFIG_IN_STEP (the others need `-o hf_config=`);
  config.json          the HF config.json the view needs (a copy of hf/config.json, or written);
  to_hf.safetensors    the adapter's own to_hf of the full, gathered model state dict;
  stored.safetensors   that state dict, cast to export_dtype as the checkpointer saves it
                       (torchtitan's names: what DCP holds).

The models:
  deepseek-v3  bf16; DeepseekV3ForCausalLM -> DeepSeekV3StateDictAdapter.from_hf; MLA with
               q_lora_rank 16 (wq_a, q_norm, wq_b), layer 0 dense, layer 1 MoE with 4 grouped
               experts (split over the ranks on the expert axis), 2 shared experts and the
               router's correction bias (expert_bias_E <-> e_score_correction_bias), and one
               multi-token-prediction layer (mtp_layers.0, random: HF's model has none; to_hf
               names it model.layers.2);
  kimi-k2.7    fp32; random torchtitan weights (the vision tower's from_hf needs the hub's
               checkpoint names, which transformers' own save does not write): KimiK25Model with
               the DeepSeek V3 text tower (q_lora_rank 0: wq) and a 2-layer MoonViT; config.json
               is a Kimi_K25Config of the same sizes;
  qwen3.5      fp32; Qwen3_5ForConditionalGeneration -> Qwen35StateDictAdapter.from_hf: layer 0
               GatedDeltaNet, layer 1 gated full attention, dense FFN, a 2-block vision tower;
  qwen3.5-moe  fp32; Qwen3_5MoeForConditionalGeneration: from_hf for all but the routed experts,
               which transformers 5.23 saves per expert (mlp.experts.{E}.gate_proj.weight) and
               torchtitan 0.3.0's from_hf does not read (it expects a fused, transposed
               gate_up_proj): the writer stacks them into w1_EFD/w3_EFD/w2_EDF itself (no
               transpose: HF's per-expert gate_proj is [F, D] as w1_EFD[e]); no config.json in
               the step directory;
  gpt-oss      fp32; random torchtitan weights (GptOssModel, 4 experts): its map refuses it, and
               to_hf (which drops the experts in 0.3.0) is the reference for the other renames.
The last stdout line is a JSON list of every file under OUT_DIR (relative paths).
GPUs are hidden from the ranks; nothing is monkeypatched.
"""
import argparse
import json
import os
import shutil
import sys

from ranks import TIMEOUT, files_under, spawn

VOCAB, DIM, LAYERS = 160, 64, 2
EXPERTS, MOE_FFN, FFN = 4, 24, 96

# name: (dtype, config.json in the step directory)
MODELS = {
    "deepseek-v3": ("bfloat16", True),
    "kimi-k2.7": ("float32", True),
    "qwen3.5": ("float32", True),
    "qwen3.5-moe": ("float32", False),
    "gpt-oss": ("float32", True),
}
FROM_HF = ("deepseek-v3", "qwen3.5", "qwen3.5-moe")


# --- HF configs ---------------------------------------------------------------------------------

def deepseek_text(q_lora_rank):
    return dict(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=FFN, moe_intermediate_size=MOE_FFN,
                num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2,
                n_routed_experts=EXPERTS, kv_lora_rank=32, q_lora_rank=q_lora_rank, qk_rope_head_dim=8,
                v_head_dim=16, qk_nope_head_dim=16, n_group=1, topk_group=1, num_experts_per_tok=2,
                first_k_dense_replace=1, max_position_embeddings=64, tie_word_embeddings=False,
                rope_interleave=True)


QWEN_TEXT = dict(vocab_size=VOCAB, hidden_size=DIM, num_hidden_layers=LAYERS, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
                 linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                 layer_types=["linear_attention", "full_attention"], max_position_embeddings=64,
                 tie_word_embeddings=False,
                 rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.5,
                                  "mrope_section": [2, 1, 1], "mrope_interleaved": True})
QWEN_VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, in_channels=3, patch_size=4,
                   spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=DIM, num_position_embeddings=16)


def hf_config(name):
    import transformers

    dtype = MODELS[name][0]
    if name == "deepseek-v3":
        return transformers.DeepseekV3Config(**deepseek_text(16), dtype=dtype)
    if name == "kimi-k2.7":
        return transformers.Kimi_K25Config(
            text_config=dict(deepseek_text(None), model_type="deepseek_v3"),
            vision_config=dict(patch_size=4, pos_emb_height=4, pos_emb_width=4, num_attention_heads=2,
                               num_hidden_layers=2, hidden_size=32, intermediate_size=48),
            projection_hidden_size=32, tie_word_embeddings=False, dtype=dtype)
    if name == "qwen3.5":
        return transformers.Qwen3_5Config(text_config=dict(QWEN_TEXT, intermediate_size=FFN),
                                          vision_config=QWEN_VISION, tie_word_embeddings=False, dtype=dtype)
    if name == "qwen3.5-moe":
        return transformers.Qwen3_5MoeConfig(
            text_config=dict(QWEN_TEXT, moe_intermediate_size=MOE_FFN, shared_expert_intermediate_size=40,
                             num_experts=EXPERTS, num_experts_per_tok=2),
            vision_config=QWEN_VISION, tie_word_embeddings=False, dtype=dtype)
    # torchtitan's gpt-oss attention builder fixes 64 heads of 64 (8 kv heads) whatever the dim
    return transformers.GptOssConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=48, num_hidden_layers=LAYERS,
                                     num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                                     num_local_experts=EXPERTS, num_experts_per_tok=2, max_position_embeddings=64,
                                     tie_word_embeddings=False, dtype=dtype)


def auto_class(name):
    import transformers

    if name in ("kimi-k2.7", "qwen3.5", "qwen3.5-moe"):
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


def save_hf(name, out, seed):
    """The HF model (for the FROM_HF models) and the config.json every model's view needs."""
    import torch
    from safetensors.torch import save_file

    cfg = hf_config(name)
    cfg.save_pretrained(out)  # OUT_DIR/M/config.json
    if name not in FROM_HF:
        return
    torch.manual_seed(seed)
    model = auto_class(name).from_config(cfg, dtype=getattr(torch, MODELS[name][0]))
    with torch.no_grad():
        for t in model.state_dict().values():  # buffers too (DeepSeek's e_score_correction_bias)
            if t.is_floating_point():
                t.normal_()
    model.save_pretrained(os.path.join(out, "hf"))
    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()},
              os.path.join(out, "original.safetensors"))


# --- torchtitan models ----------------------------------------------------------------------------

def titan_model(name):
    """torchtitan's model config (its own builders) and state dict adapter class for `name`."""
    from functools import partial

    import torch.nn as nn
    from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RMSNorm

    init = {"weight": partial(nn.init.normal_, std=0.02)}

    def lm(cls, layers, **kw):
        return cls.Config(vocab_size=VOCAB, dim=DIM,
                          tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=init),
                          norm=RMSNorm.Config(normalized_shape=DIM, param_init={"weight": nn.init.ones_}),
                          lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=init),
                          layers=layers, **kw)

    if name in ("deepseek-v3", "kimi-k2.7"):
        from torchtitan.models.deepseek_v3 import _build_dsv3_layers

        layers = _build_dsv3_layers(
            n_layers=LAYERS, n_dense_layers=1, dim=DIM, n_heads=4, q_lora_rank=16 if name == "deepseek-v3" else 0,
            kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, mscale=0.7,
            dense_hidden_dim=FFN, moe_hidden_dim=MOE_FFN, num_experts=EXPERTS, num_shared_experts=2, router_top_k=2,
            router_score_func="sigmoid", attn_backend="flex", moe_comm_backend="standard",
            non_blocking_capacity_factor=None, rope=ComplexRoPE.Config(dim=8, max_seq_len=64, theta=10000.0))
        if name == "deepseek-v3":  # with one multi-token-prediction layer (a copy of the last layer's kind)
            from torchtitan.models.deepseek_v3 import DeepSeekV3Model, DeepSeekV3StateDictAdapter, _build_mtp_layers

            mtp = _build_mtp_layers(layers[-1], dim=DIM, num_mtp_layers=1)
            return lm(DeepSeekV3Model, layers, mtp_layers=mtp), DeepSeekV3StateDictAdapter
        from torchtitan.models.kimi_k2_7 import KimiK25Model, KimiK25StateDictAdapter, _vision_encoder_config

        vision = _vision_encoder_config(dim=32, ffn_dim=48, num_layers=2, num_heads=2, patch_size=4,
                                        init_pos_emb_height=4, init_pos_emb_width=4, text_hidden_size=DIM)
        return lm(KimiK25Model, layers, vision_encoder=vision), KimiK25StateDictAdapter
    if name.startswith("qwen3.5"):
        import torchtitan.models.qwen3_5 as q
        from torchtitan.models.qwen3_5 import Qwen35Model, Qwen35StateDictAdapter
        from torchtitan.models.qwen3_5.rope import MRoPE

        common = dict(rope=MRoPE.Config(dim=8, max_seq_len=64, theta=1e7, mrope_section=[2, 1, 1]),
                      attn_backend="flex", n_layers=LAYERS, dim=DIM, n_heads=4, n_kv_heads=2, head_dim=16,
                      rotary_dim=8, n_key_heads=2, n_value_heads=4, key_head_dim=16, value_head_dim=8,
                      full_attention_interval=2)
        if name == "qwen3.5":
            layers = q._build_qwen35_layers(hidden_dim=FFN, **common)
        else:
            layers = q._build_qwen35_moe_layers(moe_hidden_dim=MOE_FFN, num_experts=EXPERTS, top_k=2,
                                                shared_expert_hidden_dim=40, **common)
        v = QWEN_VISION
        vision = q._qwen35_vision_encoder_config(
            dim=v["hidden_size"], ffn_dim=v["intermediate_size"], num_layers=v["depth"], num_heads=v["num_heads"],
            patch_size=v["patch_size"], temporal_patch_size=v["temporal_patch_size"],
            spatial_merge_size=v["spatial_merge_size"], out_hidden_size=DIM,
            num_position_embeddings=v["num_position_embeddings"])
        cfg = Qwen35Model.Config(vocab_size=VOCAB, dim=DIM, norm=q._offset_norm(DIM),
                                 tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM,
                                                                 param_init=init),
                                 lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=init),
                                 layers=layers, vision_encoder=vision)
        return cfg, Qwen35StateDictAdapter
    from torchtitan.models.gpt_oss import GptOssModel, GptOssStateDictAdapter, _build_gptoss_layers

    layers = _build_gptoss_layers(fuse_qkv=True, dim=DIM, n_layers=LAYERS, hidden_dim=48, num_experts=EXPERTS,
                                  top_k=2, load_balance_coeff=1e-3, attn_backend="flex", moe_comm_backend="standard",
                                  rope=CosSinRoPE.Config(dim=64, max_seq_len=64, theta=150000.0))
    return lm(GptOssModel, layers), GptOssStateDictAdapter


def titan_state(name, cfg, Adapter, out, seed):
    """The torchtitan state dict the model starts from: from_hf of the HF checkpoint, or random."""
    import torch
    from safetensors.torch import load_file

    if name not in FROM_HF:
        torch.manual_seed(seed + 1)
        model = cfg.build()
        with torch.no_grad():
            model.init_weights(buffer_device=torch.device("cpu"))
            for t in model.state_dict().values():
                if t.is_floating_point():
                    t.normal_()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    hf = load_file(os.path.join(out, "hf", "model.safetensors"))
    sd = Adapter(cfg, None).from_hf(dict(hf))
    if name == "qwen3.5-moe":  # the routed experts, as transformers 5.23 saves them: one tensor per expert
        import re

        for layer in sorted({int(m.group(1)) for k in hf
                             if (m := re.match(r"model\.language_model\.layers\.(\d+)\.mlp\.experts\.\d+\.", k))}):
            p = f"model.language_model.layers.{layer}.mlp.experts"
            t = f"layers.{layer}.moe.routed_experts.inner_experts"
            for tt, hn in (("w1_EFD", "gate_proj"), ("w3_EFD", "up_proj"), ("w2_EDF", "down_proj")):
                sd[f"{t}.{tt}"] = torch.stack([hf[f"{p}.{e}.{hn}.weight"] for e in range(EXPERTS)])
    return sd


def save_titan(name, rank, world, out, seed, step=1):
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    dtype_name, config_in_step = MODELS[name]
    dtype = getattr(torch, dtype_name)
    cfg, Adapter = titan_model(name)
    titan_sd = titan_state(name, cfg, Adapter, out, seed)

    torch.manual_seed(seed + 2)  # every rank alike
    model = cfg.build()
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
        for p in model.parameters():  # the parameters only (buffers keep their dtype)
            p.data = p.data.to(dtype)
    missing, unexpected = model.load_state_dict(titan_sd, strict=False)
    # expert_bias_E: a load-balancing buffer HF's Qwen checkpoint does not hold; DeepSeek's MTP
    # layer: HF's DeepseekV3ForCausalLM has none, so it keeps random values.
    assert not unexpected and all(k.endswith("moe.expert_bias_E") or k.startswith("mtp_layers.") for k in missing), \
        (name, missing, unexpected)
    with torch.no_grad():
        sd = model.state_dict()
        for k in missing:
            if k.startswith("mtp_layers.") and sd[k].is_floating_point():
                sd[k].normal_()
    sd = model.state_dict()
    # Buffers keep torchtitan's dtype (DeepSeek's expert_bias_E stays fp32 in a bf16 model): values compared.
    params = {k for k, _ in model.named_parameters()}
    bad = [k for k, v in titan_sd.items()
           if (k in params and sd[k].dtype != v.dtype) or not torch.equal(sd[k].to(v.dtype), v)]
    assert not bad, f"{name}: the model does not hold its starting tensors: {bad}"

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    apply_fsdp_to_decoder(model, mesh, param_dtype=dtype, reduce_dtype=torch.float32, pp_enabled=False)
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3})],
        implementation="for-loop").build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=1).build(optimizers=optimizers, training_steps=step)
    ckpt = CheckpointManager.Config(enable=True, last_save_model_only=True, last_save_in_hf=False,
                                    export_dtype=dtype_name, keep_latest_k=0,
                                    initial_load_model_only=False).build(
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=lr_schedulers,
        states={}, sd_adapter=Adapter(cfg, None), base_folder=out)
    assert ckpt.save(step, last_step=True)
    ckpt.close()

    # What the checkpointer saved: a model-only save casts every floating tensor to export_dtype
    # (DeepSeek's fp32 expert_bias_E buffer included).
    full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    full = {k: v.to(dtype) if v.is_floating_point() else v for k, v in full.items()}
    if rank == 0:
        save_file({k: v.detach().clone().contiguous() for k, v in full.items()},
                  os.path.join(out, "stored.safetensors"))
        to_hf = Adapter(cfg, None).to_hf(dict(full))
        save_file({k: v.detach().clone().contiguous() for k, v in to_hf.items()},
                  os.path.join(out, "to_hf.safetensors"))
        if config_in_step:
            shutil.copy(os.path.join(out, "config.json"), os.path.join(out, "checkpoint", f"step-{step}", "config.json"))
    dist.barrier()


def worker(rank, world, scratch, out_dir, names, seed):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{scratch}/rdzv", rank=rank, world_size=world,
                            timeout=TIMEOUT)
    try:
        for name in names:
            save_titan(name, rank, world, os.path.join(out_dir, name), seed)
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
    spawn(worker, a.ranks, "titan-family-", lambda scratch: (a.ranks, scratch, out_dir, names, a.seed))
    print(json.dumps(files_under(out_dir)))


if __name__ == "__main__":
    sys.exit(main())
