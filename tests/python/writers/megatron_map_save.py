#!/usr/bin/env python3
"""An HF LlamaForCausalLM converted to Megatron-Core's GPT layout, loaded into a real megatron-core
GPTModel and saved with megatron-core's own dist_checkpointing.save (torch_dist), tensor parallel
on 2 ranks (CPU, gloo): the native checkpoints the megatron-gpt model map is tested on.

    python megatron_map_save.py OUT_DIR REF_DIR CASE [CASE ...] [--tp 2] [--layers 3]

CASE is NAME:VOCAB:TIED:NAMES:DTYPE, e.g. `untied-te:200:0:te:float32`:
  * VOCAB: HF's vocab_size; Megatron's embedding and output layer hold it padded to a multiple
    of make_vocab_size_divisible_by (128) x TP, as Megatron-LM's _vocab_size_with_padding does;
    the padding rows are filled with random values (a map that served them would show);
  * TIED: 1 for tie_word_embeddings (share_embeddings_and_output_weights: no output_layer.weight
    is saved);
  * NAMES: `te` is megatron-core 0.16.1's naming for both the local and the Transformer Engine
    spec (the local spec's sharded_state_dict_keys_map saves input_layernorm / pre_mlp_layernorm as
    `self_attention.linear_qkv.layer_norm_weight` / `mlp.linear_fc1.layer_norm_weight`, the TE
    spec's fused names); `separate` is the same local spec with that keys map emptied, so the
    norms are saved under their module names `input_layernorm.weight`, `pre_mlp_layernorm.weight`
    (a spec without the map). Transformer Engine itself is not installed here (no CPU build).
  * DTYPE: float32 or bfloat16: the dtype saved (HF's original and the GPTModel are both cast
    from the same float32 weights, after the forward check below, which runs in float32).

Per case: REF_DIR/NAME/ holds the original HF model (save_pretrained: config.json,
model.safetensors), OUT_DIR/NAME/ the megatron checkpoint (.metadata, __R_0.distcp, metadata.json,
common.pt). Before saving, every rank runs the loaded GPTModel forward on a fixed prompt: the
logits must match the HF model's (the CUDA RNG tracker's fork is stubbed for its attention
dropout, p=0; a conversion that put Q, K, V or gate and up in the wrong rows
would not), and the largest difference is reported. The HF-to-Megatron conversion is written here
from Megatron-Core's layout (megatron/core/transformer/attention.py get_query_key_value_tensors,
mlp.py apply_swiglu_sharded_factory), per TP rank:
  linear_qkv.weight   rows of this rank's query groups, each group [q of its heads; k; v]
  linear_proj.weight  o_proj's columns of this rank
  linear_fc1.weight   [gate rows of this rank; up rows of this rank]
  linear_fc2.weight   down_proj's columns of this rank
  embedding / output  rows of the padded vocabulary of this rank
The last stdout line is JSON: {case: {"files": [...], "max_logit_diff": float}}.
"""
import argparse
import contextlib
import json
import math
import os
import shutil
import tempfile

from ranks import TIMEOUT, files_under, spawn

DIVISIBLE_BY = 128  # Megatron-LM's --make-vocab-size-divisible-by default
PROMPT = [[3, 17, 5, 99, 42, 7, 150, 1, 64, 12, 33, 8]]


def parse_case(s):
    name, vocab, tied, names, dtype = s.split(":")
    assert names in ("te", "separate") and dtype in ("float32", "bfloat16") and tied in ("0", "1"), s
    return {"name": name, "vocab": int(vocab), "tied": tied == "1", "names": names, "dtype": dtype}


def padded_vocab(vocab, tp):
    multiple = DIVISIBLE_BY * tp
    return int(math.ceil(vocab / multiple) * multiple)


def hf_model(case, layers):
    """The original: a tiny Llama (GQA, 4 heads in 2 query groups), every parameter random."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=case["vocab"], hidden_size=64, intermediate_size=96,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=case["tied"])
    torch.manual_seed(1234 + case["vocab"] + 7 * case["tied"])
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for _, p in model.named_parameters():  # norms too: all-ones norms could not tell two apart
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    return model


def to_megatron(sd, cfg, tp):
    """HF state dict -> Megatron-Core's full (unsharded) tensors per layer, and the padding."""
    import torch

    heads, groups = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = cfg.hidden_size // heads
    full = {}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        q = sd[p + "self_attn.q_proj.weight"].view(groups, heads // groups * hd, -1)
        k = sd[p + "self_attn.k_proj.weight"].view(groups, hd, -1)
        v = sd[p + "self_attn.v_proj.weight"].view(groups, hd, -1)
        full[(i, "qkv")] = torch.cat([q, k, v], dim=1).reshape(-1, cfg.hidden_size)
        full[(i, "proj")] = sd[p + "self_attn.o_proj.weight"]
        full[(i, "gate")] = sd[p + "mlp.gate_proj.weight"]
        full[(i, "up")] = sd[p + "mlp.up_proj.weight"]
        full[(i, "fc2")] = sd[p + "mlp.down_proj.weight"]
        full[(i, "ln1")] = sd[p + "input_layernorm.weight"]
        full[(i, "ln2")] = sd[p + "post_attention_layernorm.weight"]
    vp = padded_vocab(cfg.vocab_size, tp)
    g = torch.Generator().manual_seed(99)
    pad = lambda w: torch.cat([w, torch.randn(vp - w.shape[0], w.shape[1], generator=g).to(w.dtype)])  # noqa: E731
    full["emb"] = pad(sd["model.embed_tokens.weight"])
    full["out"] = pad(sd["lm_head.weight"])
    full["final"] = sd["model.norm.weight"]
    return full


def rank_state_dict(full, layers, tp, r, tied):
    """This TP rank's slice of every parameter, under GPTModel's own state_dict names."""
    rows = lambda t: t.chunk(tp, dim=0)[r]  # noqa: E731
    cols = lambda t: t.chunk(tp, dim=1)[r]  # noqa: E731
    import torch

    sd = {"embedding.word_embeddings.weight": rows(full["emb"]), "decoder.final_layernorm.weight": full["final"]}
    if not tied:
        sd["output_layer.weight"] = rows(full["out"])
    for i in range(layers):
        p = f"decoder.layers.{i}."
        sd[p + "self_attention.linear_qkv.weight"] = rows(full[(i, "qkv")])
        sd[p + "self_attention.linear_proj.weight"] = cols(full[(i, "proj")])
        sd[p + "mlp.linear_fc1.weight"] = torch.cat([rows(full[(i, "gate")]), rows(full[(i, "up")])])
        sd[p + "mlp.linear_fc2.weight"] = cols(full[(i, "fc2")])
        sd[p + "input_layernorm.weight"] = full[(i, "ln1")]
        sd[p + "pre_mlp_layernorm.weight"] = full[(i, "ln2")]
    return {k: v.clone().contiguous() for k, v in sd.items()}


def worker(rank, world, init_file, work, out_dir, cases, tp, layers):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=TIMEOUT)
    try:
        from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.transformer_config import TransformerConfig

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        # The forward check's attention dropout (p=0) forks the CUDA RNG tracker: no CUDA here.
        tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
        result = {}
        for case in cases:
            saved = torch.load(os.path.join(work, case["name"] + ".pt"), weights_only=False)
            hf_cfg, full, want_logits = saved["config"], saved["full"], saved["logits"]
            cfg = TransformerConfig(
                num_layers=layers, hidden_size=hf_cfg["hidden_size"],
                num_attention_heads=hf_cfg["num_attention_heads"],
                num_query_groups=hf_cfg["num_key_value_heads"], ffn_hidden_size=hf_cfg["intermediate_size"],
                normalization="RMSNorm", layernorm_epsilon=hf_cfg["rms_norm_eps"], gated_linear_unit=True,
                activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
                apply_rope_fusion=False, persist_layer_norm=False, use_cpu_initialization=True,
                params_dtype=torch.float32)
            spec = get_gpt_layer_local_spec(normalization="RMSNorm")
            if case["names"] == "separate":
                spec.submodules.sharded_state_dict_keys_map = {}
            model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=saved["padded_vocab"],
                             max_sequence_length=hf_cfg["max_position_embeddings"], position_embedding_type="rope",
                             rotary_base=int(hf_cfg["rope_theta"]), parallel_output=False,
                             share_embeddings_and_output_weights=case["tied"]).eval()
            missing, unexpected = model.load_state_dict(rank_state_dict(full, layers, tp, rank, case["tied"]),
                                                        strict=False)
            assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)

            ids = torch.tensor(PROMPT)
            pos = torch.arange(ids.shape[1]).unsqueeze(0)
            # Megatron's mask: True where masked (its default one is made on CUDA)
            mask = torch.triu(torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool), diagonal=1)[None, None]
            with torch.no_grad():
                logits = model(ids, pos, attention_mask=mask)[..., :hf_cfg["vocab_size"]].float()
            diff = (logits - want_logits).abs().max().item()
            model.to(getattr(torch, case["dtype"]))  # as HF's original: the fp32 weights cast

            out = os.path.join(out_dir, case["name"])
            os.makedirs(out, exist_ok=True)
            dist.barrier()
            dist_checkpointing.save(model.sharded_state_dict(prefix=""), out)
            dist.barrier()
            result[case["name"]] = diff
        if rank == 0:
            with open(os.path.join(work, "result.json"), "w") as f:
                json.dump(result, f)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("ref_dir")
    ap.add_argument("cases", nargs="+")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=3)
    a = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    cases = [parse_case(c) for c in a.cases]
    out_dir, ref_dir = os.path.abspath(a.out_dir), os.path.abspath(a.ref_dir)
    work = tempfile.mkdtemp(prefix="megatron-map-work-")  # the converted tensors, handed to the ranks
    try:
        for case in cases:
            model = hf_model(case, a.layers)
            with torch.no_grad():
                logits = model(torch.tensor(PROMPT)).logits
            sd = {k: v.detach() for k, v in model.state_dict().items()}
            model.to(getattr(torch, case["dtype"])).save_pretrained(os.path.join(ref_dir, case["name"]))
            if case["tied"]:
                assert sd["lm_head.weight"].data_ptr() == sd["model.embed_tokens.weight"].data_ptr()
            c = model.config
            torch.save({"config": {"hidden_size": c.hidden_size, "num_attention_heads": c.num_attention_heads,
                                   "num_key_value_heads": c.num_key_value_heads,
                                   "intermediate_size": c.intermediate_size, "rms_norm_eps": c.rms_norm_eps,
                                   "max_position_embeddings": c.max_position_embeddings,
                                   "rope_theta": c.rope_parameters["rope_theta"], "vocab_size": c.vocab_size},
                        "full": to_megatron(sd, c, a.tp), "logits": logits,
                        "padded_vocab": padded_vocab(c.vocab_size, a.tp)},
                       os.path.join(work, case["name"] + ".pt"))
        spawn(worker, a.tp, "megatron-map-save-",
              lambda scratch: (a.tp, os.path.join(scratch, "rdzv"), work, out_dir, cases, a.tp, a.layers))
        with open(os.path.join(work, "result.json")) as f:
            diff = json.load(f)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({c["name"]: {"files": files_under(os.path.join(out_dir, c["name"])),
                                  "max_logit_diff": diff[c["name"]]} for c in cases}))


if __name__ == "__main__":
    main()
