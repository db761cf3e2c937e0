#!/usr/bin/env python3
"""Megatron-LM-style checkpoints of every Megatron-Core family the built-in maps serve: an HF
model converted to Megatron-Core's layout, loaded into a real megatron-core GPTModel with its
tensor, pipeline or expert parallelism, and saved as Megatron-LM's save_checkpoint does: the state
dict of generate_state_dict (`args`, `checkpoint_version`, `iteration`, `model`) through
megatron-core's own dist_checkpointing.save (torch_dist), on 2 gloo ranks (CPU), into
OUT/NAME/iter_0000010/ with latest_checkpointed_iteration.txt beside it.

    python megatron_families_save.py OUT_DIR REF_DIR CASE [CASE ...]

CASE is NAME:FAMILY:TP:PP:EP:TIED:DTYPE[:FLAG,...], e.g. `qwen2:qwen2:2:1:1:0:bfloat16`. FAMILY is
llama, qwen2 (QKV bias), qwen3 (qk_layernorm), mixtral or qwen3_moe (router, SequentialMLP
experts), or deepseek_v3: multi-latent attention (q_lora_rank set, q/kv layernorms), MoE layers
with a sigmoid router, its expert bias (`moe_router_enable_expert_bias`) and a shared expert,
and dense first layers (`moe_layer_freq` a list: megatron-core then stores each layer under its
own number, not stacked). deepseek_v3 has 3 layers, the first dense; under PP 2, 4 layers, the
first two dense (equal stages). Its FLAGs: `nobias` (no expert bias: HF's
e_score_correction_bias stays its zeros), `groups` (group-limited routing, 2 groups of 2 experts,
1 chosen: megatron-core's moe_router_num_groups / moe_router_group_topk, HF's n_group /
topk_group).

megatron-core 0.16.1 builds MLA on CPU without Transformer Engine only with two patches, made in
the ranks: its local spec's DotProductAttention takes no `k_channels`/`v_channels` (MLA passes
them), so the layer spec's core attention is a small causal SDPA with MLA's softmax scale
(`MLACoreAttention`: no parameters, nothing saved); and multi_latent_attention.py sets HAVE_TE
when megatron.core.extensions.transformer_engine imports, which it does without TE too (TELinear
a MagicMock there, and `isinstance(linear_proj, TELinear)` raises): HAVE_TE is set False. Its
RotaryEmbedding asks torch.cuda.current_device() (use_cpu_initialization is not passed through),
which the ranks already answer with "cpu" for every family.

`args` is an argparse.Namespace holding the fields Megatron-LM's parse_args gives such a model
(megatron.training is not part of megatron-core, so its parser cannot run here; the fields and
the kinds of values are those measured with Megatron-LM core_v0.16.1's parse_args: ints, floats,
strs, bools, None, lists, torch dtypes, the AttnBackend enum and signal.SIGTERM). Megatron-LM
pads the vocabulary (padded_vocab_size, a multiple of 128 x TP) and with a Hugging Face tokenizer
keeps no vocab_size: the HF model here has the padded vocabulary, so the reference is exact.
The optimizer, scheduler and RNG state Megatron-LM also saves are left out (a model-only save).

Per case REF_DIR/NAME/ holds the original (save_pretrained) and REF_DIR/NAME/mbridge.safetensors
the HF tensors mbridge 0.15.1's export mapping (`Bridge._weight_to_hf_format`: its per-family
names, QKV and gate/up splits, vocabulary padding) makes of the tensors megatron-core saved,
read back with torch DCP: an independent conversion. (mbridge 0.15.1's DeepseekV3Bridge cannot
build its megatron config under megatron-core 0.16.1, which dropped the max_position_embeddings
it passes: the export reads only mtp_num_layers and num_layers of it, so those are given.)
Where PP is 1 every rank first runs the GPTModel forward on a fixed prompt: its logits must
match the HF model's (max_logit_diff).
The last stdout line is JSON: {case: {"files": [...], "max_logit_diff": float or null}}.
"""
import argparse
import contextlib
import json
import os
import shutil
import signal
import tempfile

from ranks import TIMEOUT, files_under, spawn

ITER = 10
DIVISIBLE_BY = 128
PROMPT = [[3, 17, 5, 99, 42, 7, 150, 1, 64, 12, 33, 8]]
LAYERS = 2


def parse_case(s):
    name, family, tp, pp, ep, tied, dtype, *flags = s.split(":")
    assert family in ("llama", "qwen2", "qwen3", "mixtral", "qwen3_moe", "deepseek_v3"), s
    flags = set(flags[0].split(",")) if flags else set()
    assert flags <= {"nobias", "groups", "yarn", "allmoe", "noqlora"} and (not flags or family == "deepseek_v3"), s
    return {"name": name, "family": family, "tp": int(tp), "pp": int(pp), "ep": int(ep),
            "tied": tied == "1", "dtype": dtype, "flags": flags}


def moe(case):
    return case["family"] in ("mixtral", "qwen3_moe")


def mla(case):
    return case["family"] == "deepseek_v3"


def layer_count(case):
    """(layers, leading dense layers): deepseek_v3 3 and 1, under PP 2 4 and 2, with the flag
    allmoe none dense (megatron-core then stacks the layers: moe_layer_freq 1); the others 2, 0."""
    if not mla(case):
        return LAYERS, 0
    layers, dense = (4, 2) if case["pp"] > 1 else (3, 1)
    return (layers, 0) if "allmoe" in case["flags"] else (layers, dense)


def hf_model(case, vocab):
    """The original: a tiny HF model of the family (4 heads in 2 query groups), every parameter
    random (norms too: all-ones norms could not tell two apart)."""
    import torch
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
                  tie_word_embeddings=case["tied"], rope_theta=1000000.0)
    f = case["family"]
    if f == "deepseek_v3":
        layers, dense = layer_count(case)
        groups = "groups" in case["flags"]
        common.update(num_hidden_layers=layers, num_key_value_heads=4)
        if "yarn" in case["flags"]:
            # YaRN as DeepSeek V2-Lite sets it (factor 40 there, mscale and mscale_all_dim 0.707);
            # original_max_position_embeddings is MLATransformerConfig's default, since
            # Megatron-LM has no argument for it
            common.pop("rope_theta")
            common["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 4096, "beta_fast": 32,
                                         "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}
        cfg = tf.DeepseekV3Config(intermediate_size=96, moe_intermediate_size=32, n_routed_experts=4,
                                  n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=dense,
                                  q_lora_rank=None if "noqlora" in case["flags"] else 32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                  v_head_dim=16, n_group=2 if groups else 1, topk_group=1, norm_topk_prob=True,
                                  routed_scaling_factor=2.5, num_nextn_predict_layers=0, **common)
    elif f == "llama":
        cfg = tf.LlamaConfig(intermediate_size=96, **common)
    elif f == "qwen2":
        cfg = tf.Qwen2Config(intermediate_size=96, **common)
    elif f == "qwen3":
        cfg = tf.Qwen3Config(intermediate_size=96, head_dim=16, **common)
    elif f == "mixtral":
        cfg = tf.MixtralConfig(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, **common)
    else:
        cfg = tf.Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                head_dim=16, norm_topk_prob=True, **common)
    torch.manual_seed(4321 + len(case["name"]))
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
        if mla(case) and "nobias" not in case["flags"]:
            # a buffer, float32 on both sides (megatron-core's expert_bias, HF's
            # _keep_in_fp32_modules_strict): values a bf16 model's cast round-trips unchanged
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.copy_((torch.randn_like(b) * 0.1).to(torch.bfloat16).float())
    return model


def hf_tensors(model):
    """name -> tensor under the HF hub's names (per-expert, as the checkpoints on the hub and the
    maps name them; transformers 5 fuses experts in memory)."""
    import torch

    sd = {k: v.detach() for k, v in model.state_dict().items()}
    out = {}
    for k, v in sd.items():
        if ".mlp.experts.gate_up_proj" in k or ".mlp.experts.down_proj" in k:
            base = k.split(".mlp.experts.")[0] + ".mlp.experts."
            for e in range(v.shape[0]):
                if k.endswith("gate_up_proj"):
                    g, u = v[e].chunk(2, dim=0)
                    out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = g, u
                else:
                    out[f"{base}{e}.down_proj.weight"] = v[e]
        else:
            out[k] = v
    assert all(isinstance(v, torch.Tensor) for v in out.values())
    return out


def to_megatron_mla(sd, cfg):
    """deepseek_v3's HF tensors -> Megatron-Core's full tensors, per layer (and expert): MLA's
    projections as they are (mbridge's DeepseekV3Bridge: renames only), gate and up halves fused."""
    import torch

    full = {"emb": sd["model.embed_tokens.weight"], "final": sd["model.norm.weight"],
            "out": sd.get("lm_head.weight", sd["model.embed_tokens.weight"])}
    names = {"ln1": "input_layernorm.weight", "ln2": "post_attention_layernorm.weight",
             "q_down": "self_attn.q_a_proj.weight", "q_ln": "self_attn.q_a_layernorm.weight",
             "q_up": "self_attn.q_b_proj.weight", "kv_down": "self_attn.kv_a_proj_with_mqa.weight",
             "kv_ln": "self_attn.kv_a_layernorm.weight", "kv_up": "self_attn.kv_b_proj.weight",
             "proj": "self_attn.o_proj.weight"}
    if cfg.q_lora_rank is None:  # DeepSeek V2-Lite: one q projection, no q down/up and norm
        for k in ("q_down", "q_ln", "q_up"):
            del names[k]
        names["q"] = "self_attn.q_proj.weight"
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for k, n in names.items():
            full[(i, k)] = sd[p + n]
        if i < cfg.first_k_dense_replace:
            full[(i, "gate")], full[(i, "up")] = sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]
            full[(i, "fc2")] = sd[p + "mlp.down_proj.weight"]
            continue
        full[(i, "router")] = sd[p + "mlp.gate.weight"]
        full[(i, "expert_bias")] = sd[p + "mlp.gate.e_score_correction_bias"]
        for e in range(cfg.n_routed_experts):
            full[(i, "gate", e)] = sd[f"{p}mlp.experts.{e}.gate_proj.weight"]
            full[(i, "up", e)] = sd[f"{p}mlp.experts.{e}.up_proj.weight"]
            full[(i, "fc2", e)] = sd[f"{p}mlp.experts.{e}.down_proj.weight"]
        full[(i, "shared_gate")] = sd[p + "mlp.shared_experts.gate_proj.weight"]
        full[(i, "shared_up")] = sd[p + "mlp.shared_experts.up_proj.weight"]
        full[(i, "shared_fc2")] = sd[p + "mlp.shared_experts.down_proj.weight"]
    assert all(isinstance(v, torch.Tensor) for v in full.values())
    return full


def to_megatron(sd, cfg, family):
    """HF tensors -> Megatron-Core's full (unsharded) tensors, per layer (and expert)."""
    import torch

    if family == "deepseek_v3":
        return to_megatron_mla(sd, cfg)

    heads, groups = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    full = {"emb": sd["model.embed_tokens.weight"], "final": sd["model.norm.weight"]}
    full["out"] = sd.get("lm_head.weight", full["emb"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        q = sd[p + "self_attn.q_proj.weight"].view(groups, heads // groups * hd, -1)
        k = sd[p + "self_attn.k_proj.weight"].view(groups, hd, -1)
        v = sd[p + "self_attn.v_proj.weight"].view(groups, hd, -1)
        full[(i, "qkv")] = torch.cat([q, k, v], dim=1).reshape(-1, cfg.hidden_size)
        if family == "qwen2":
            qb = sd[p + "self_attn.q_proj.bias"].view(groups, -1)
            kb = sd[p + "self_attn.k_proj.bias"].view(groups, -1)
            vb = sd[p + "self_attn.v_proj.bias"].view(groups, -1)
            full[(i, "qkv_bias")] = torch.cat([qb, kb, vb], dim=1).reshape(-1)
        if family in ("qwen3", "qwen3_moe"):
            full[(i, "q_norm")] = sd[p + "self_attn.q_norm.weight"]
            full[(i, "k_norm")] = sd[p + "self_attn.k_norm.weight"]
        full[(i, "proj")] = sd[p + "self_attn.o_proj.weight"]
        full[(i, "ln1")] = sd[p + "input_layernorm.weight"]
        full[(i, "ln2")] = sd[p + "post_attention_layernorm.weight"]
        if family == "mixtral":
            full[(i, "router")] = sd[p + "block_sparse_moe.gate.weight"] if p + "block_sparse_moe.gate.weight" in sd \
                else sd[p + "mlp.gate.weight"]
        elif family == "qwen3_moe":
            full[(i, "router")] = sd[p + "mlp.gate.weight"]
        if family in ("mixtral", "qwen3_moe"):
            e = 0
            while f"{p}mlp.experts.{e}.gate_proj.weight" in sd:
                full[(i, "gate", e)] = sd[f"{p}mlp.experts.{e}.gate_proj.weight"]
                full[(i, "up", e)] = sd[f"{p}mlp.experts.{e}.up_proj.weight"]
                full[(i, "fc2", e)] = sd[f"{p}mlp.experts.{e}.down_proj.weight"]
                e += 1
        else:
            full[(i, "gate")] = sd[p + "mlp.gate_proj.weight"]
            full[(i, "up")] = sd[p + "mlp.up_proj.weight"]
            full[(i, "fc2")] = sd[p + "mlp.down_proj.weight"]
    return full


def rank_state_dict_mla(full, case, tp_rank, pp_rank, ep_rank, etp_rank, experts):
    """deepseek_v3: this rank's slices under GPTModel's names. The local spec's MLA projections
    are all column-parallel but linear_proj (q/kv down projections too: gather_output=False);
    the q/kv layernorms, router and expert bias whole; the shared expert split like a dense MLP."""
    import torch

    tp, pp, ep = case["tp"], case["pp"], case["ep"]
    rows = lambda t: t.chunk(tp, dim=0)[tp_rank]  # noqa: E731
    cols = lambda t: t.chunk(tp, dim=1)[tp_rank]  # noqa: E731
    layers, dense = layer_count(case)
    per_stage = layers // pp
    sd = {}
    if pp_rank == 0:
        sd["embedding.word_embeddings.weight"] = rows(full["emb"])
    if pp_rank == pp - 1:
        sd["decoder.final_layernorm.weight"] = full["final"]
        if not case["tied"] or pp > 1:
            sd["output_layer.weight"] = rows(full["out"])
    for local in range(per_stage):
        i = pp_rank * per_stage + local
        p = f"decoder.layers.{local}."
        a = p + "self_attention."
        sd[p + "input_layernorm.weight"] = full[(i, "ln1")]
        if (i, "q") in full:
            sd[a + "linear_q_proj.weight"] = rows(full[(i, "q")])
        else:
            sd[a + "linear_q_down_proj.weight"] = rows(full[(i, "q_down")])
            sd[a + "q_layernorm.weight"] = full[(i, "q_ln")]
            sd[a + "linear_q_up_proj.weight"] = rows(full[(i, "q_up")])
        sd[a + "linear_kv_down_proj.weight"] = rows(full[(i, "kv_down")])
        sd[a + "kv_layernorm.weight"] = full[(i, "kv_ln")]
        sd[a + "linear_kv_up_proj.weight"] = rows(full[(i, "kv_up")])
        sd[a + "linear_proj.weight"] = cols(full[(i, "proj")])
        sd[p + "pre_mlp_layernorm.weight"] = full[(i, "ln2")]
        if i < dense:
            sd[p + "mlp.linear_fc1.weight"] = torch.cat([rows(full[(i, "gate")]), rows(full[(i, "up")])])
            sd[p + "mlp.linear_fc2.weight"] = cols(full[(i, "fc2")])
            continue
        sd[p + "mlp.router.weight"] = full[(i, "router")]
        if "nobias" not in case["flags"]:
            sd[p + "mlp.router.expert_bias"] = full[(i, "expert_bias")].float()
        local_n = experts // ep
        erows = lambda t: t.chunk(tp, dim=0)[etp_rank]  # noqa: E731
        for j in range(local_n):
            e = ep_rank * local_n + j
            q = f"{p}mlp.experts.local_experts.{j}."
            sd[q + "linear_fc1.weight"] = torch.cat([erows(full[(i, "gate", e)]), erows(full[(i, "up", e)])])
            sd[q + "linear_fc2.weight"] = full[(i, "fc2", e)].chunk(tp, dim=1)[etp_rank]
        s = p + "mlp.shared_experts."
        sd[s + "linear_fc1.weight"] = torch.cat([rows(full[(i, "shared_gate")]), rows(full[(i, "shared_up")])])
        sd[s + "linear_fc2.weight"] = cols(full[(i, "shared_fc2")])
    return {k: v.clone().contiguous() for k, v in sd.items()}


def rank_state_dict(full, case, tp_rank, pp_rank, ep_rank, etp_rank, experts):
    """This rank's slices under GPTModel's own state_dict names (local layer and expert indices)."""
    import torch

    if mla(case):
        return rank_state_dict_mla(full, case, tp_rank, pp_rank, ep_rank, etp_rank, experts)
    tp, pp, ep = case["tp"], case["pp"], case["ep"]
    rows = lambda t: t.chunk(tp, dim=0)[tp_rank]  # noqa: E731
    cols = lambda t: t.chunk(tp, dim=1)[tp_rank]  # noqa: E731
    per_stage = LAYERS // pp
    sd = {}
    if pp_rank == 0:
        sd["embedding.word_embeddings.weight"] = rows(full["emb"])
    if pp_rank == pp - 1:
        sd["decoder.final_layernorm.weight"] = full["final"]
        if not case["tied"] or pp > 1:  # the last stage of a tied model keeps its own copy
            sd["output_layer.weight"] = rows(full["out"])
    for local in range(per_stage):
        i = pp_rank * per_stage + local
        p = f"decoder.layers.{local}."
        sd[p + "self_attention.linear_qkv.weight"] = rows(full[(i, "qkv")])
        if (i, "qkv_bias") in full:
            sd[p + "self_attention.linear_qkv.bias"] = rows(full[(i, "qkv_bias")])
        if (i, "q_norm") in full:
            sd[p + "self_attention.q_layernorm.weight"] = full[(i, "q_norm")]
            sd[p + "self_attention.k_layernorm.weight"] = full[(i, "k_norm")]
        sd[p + "self_attention.linear_proj.weight"] = cols(full[(i, "proj")])
        sd[p + "input_layernorm.weight"] = full[(i, "ln1")]
        sd[p + "pre_mlp_layernorm.weight"] = full[(i, "ln2")]
        if moe(case):
            sd[p + "mlp.router.weight"] = full[(i, "router")]
            local_n = experts // ep
            for j in range(local_n):
                e = ep_rank * local_n + j
                q = f"{p}mlp.experts.local_experts.{j}."
                # expert tensor parallelism is TP's size by default (megatron-core 0.16.1)
                erows = lambda t: t.chunk(tp, dim=0)[etp_rank]  # noqa: E731
                sd[q + "linear_fc1.weight"] = torch.cat([erows(full[(i, "gate", e)]), erows(full[(i, "up", e)])])
                sd[q + "linear_fc2.weight"] = full[(i, "fc2", e)].chunk(tp, dim=1)[etp_rank]
        else:
            sd[p + "mlp.linear_fc1.weight"] = torch.cat([rows(full[(i, "gate")]), rows(full[(i, "up")])])
            sd[p + "mlp.linear_fc2.weight"] = cols(full[(i, "fc2")])
    return {k: v.clone().contiguous() for k, v in sd.items()}


def megatron_args(case, hf):
    """The argparse.Namespace Megatron-LM's parse_args (core_v0.16.1) gives this model: the fields
    an HF config needs, and values of each kind its real args hold."""
    import torch
    from megatron.core.transformer.enums import AttnBackend

    c = hf
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    a = argparse.Namespace(
        num_layers=c.num_hidden_layers, hidden_size=c.hidden_size,
        ffn_hidden_size=c.intermediate_size, num_attention_heads=c.num_attention_heads,
        group_query_attention=True, num_query_groups=c.num_key_value_heads, kv_channels=hd,
        max_position_embeddings=c.max_position_embeddings, position_embedding_type="rope",
        rotary_base=int(c.rope_parameters["rope_theta"]), rotary_percent=1.0, rotary_interleaved=False,
        normalization="RMSNorm", layernorm_epsilon=c.rms_norm_eps, swiglu=True,
        untie_embeddings_and_output_weights=not case["tied"], add_qkv_bias=case["family"] == "qwen2",
        add_bias_linear=False, qk_layernorm=case["family"] in ("qwen3", "qwen3_moe"),
        apply_residual_connection_post_layernorm=False, layernorm_zero_centered_gamma=False,
        multi_latent_attention=False, num_experts=None, moe_router_topk=2, moe_ffn_hidden_size=None,
        moe_router_pre_softmax=False, moe_router_score_function="softmax", moe_router_enable_expert_bias=False,
        moe_aux_loss_coeff=0.0, padded_vocab_size=c.vocab_size, vocab_size=None,
        make_vocab_size_divisible_by=DIVISIBLE_BY, tokenizer_type="HuggingFaceTokenizer",
        tensor_model_parallel_size=case["tp"], pipeline_model_parallel_size=case["pp"],
        expert_model_parallel_size=case["ep"], ckpt_format="torch_dist", bf16=case["dtype"] == "bfloat16",
        params_dtype=getattr(torch, case["dtype"]), main_grads_dtype=torch.float32,
        attention_backend=AttnBackend.auto, exit_signal=signal.SIGTERM, cuda_graph_scope=["full"],
        data_path=None, save="/checkpoints/run", iteration=ITER)
    if moe(case):
        a.num_experts = getattr(c, "num_local_experts", None) or c.num_experts
        a.moe_ffn_hidden_size = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
        if case["family"] == "mixtral":
            a.ffn_hidden_size = c.intermediate_size
    if mla(case):
        # Megatron-LM's MLA and DeepSeek MoE arguments (--multi-latent-attention, --q-lora-rank,
        # ..., --moe-layer-freq "([0]*K+[1]*N)", which parse_args evaluates to a list)
        groups = "groups" in case["flags"]
        a.group_query_attention, a.num_query_groups = False, 1
        a.kv_channels = c.hidden_size // c.num_attention_heads
        a.multi_latent_attention, a.qk_layernorm = True, True
        a.q_lora_rank, a.kv_lora_rank = c.q_lora_rank, c.kv_lora_rank
        a.qk_head_dim, a.qk_pos_emb_head_dim, a.v_head_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        if "yarn" in case["flags"]:  # --rotary-scaling-factor 4 --mscale 0.707 --mscale-all-dim 0.707,
            # no --rope-type: None, which Megatron-LM makes yarn under MLA
            rp = c.rope_parameters
            a.rope_type, a.rotary_scaling_factor = None, rp["factor"]
            a.mscale, a.mscale_all_dim = rp["mscale"], rp["mscale_all_dim"]
        else:
            a.rope_type, a.rotary_scaling_factor, a.mscale, a.mscale_all_dim = "rope", 1.0, 1.0, 0.0
        a.num_experts, a.moe_ffn_hidden_size = c.n_routed_experts, c.moe_intermediate_size
        a.moe_shared_expert_intermediate_size = c.moe_intermediate_size * c.n_shared_experts
        a.moe_layer_freq = [0] * c.first_k_dense_replace + [1] * (c.num_hidden_layers - c.first_k_dense_replace)
        if "allmoe" in case["flags"]:
            a.moe_layer_freq = 1  # --moe-layer-freq 1: every layer MoE, stored stacked
        a.moe_router_topk = c.num_experts_per_tok
        a.moe_router_score_function = "sigmoid"
        a.moe_router_enable_expert_bias = "nobias" not in case["flags"]
        a.moe_router_topk_scaling_factor = c.routed_scaling_factor
        a.moe_router_num_groups = c.n_group if groups else None
        a.moe_router_group_topk = c.topk_group if groups else None
        a.moe_router_bias_update_rate = 1e-3
        a.mtp_num_layers = None
    return a


def mbridge_export(case, hf_cfg, stored):
    """mbridge 0.15.1's HF export of the stored (whole) tensors: layers unstacked and experts
    named as GPTModel's state dict with grouped GEMM names them (`...experts.linear_fc1.weightE`,
    what mbridge reads), each through Bridge._weight_to_hf_format."""
    from mbridge import AutoBridge

    if mla(case):
        return mbridge_export_mla(case, hf_cfg, stored)
    if getattr(hf_cfg, "head_dim", None) is None:  # transformers 5 writes null; mbridge reads the attribute
        hf_cfg.head_dim = hf_cfg.hidden_size // hf_cfg.num_attention_heads
    bridge = AutoBridge.from_config(hf_cfg)
    bridge.make_vocab_size_divisible_by = DIVISIBLE_BY * case["tp"]
    bridge.vocab_size = hf_cfg.vocab_size
    bridge.padded_vocab_size = stored["embedding.word_embeddings.weight"].shape[0]
    out = {}
    for key, t in stored.items():
        if key.startswith("decoder.layers."):
            rest = key[len("decoder.layers."):]
            for i in range(t.shape[0]):
                if rest.startswith("mlp.experts.experts."):
                    w = rest[len("mlp.experts.experts."):]  # linear_fc1.weight
                    for e in range(t.shape[1]):
                        names = [(f"decoder.layers.{i}.mlp.experts.{w}{e}", t[i, e])]
                        _convert(bridge, names, out)
                else:
                    if moe(case) and rest == "mlp.linear_fc1.layer_norm_weight":
                        # a MoE layer's pre-MLP norm: its module name, which mbridge maps (the
                        # local spec's keys map saves it under the dense fused name)
                        rest = "pre_mlp_layernorm.weight"
                    _convert(bridge, [(f"decoder.layers.{i}.{rest}", t[i])], out)
        else:
            _convert(bridge, [(key, t)], out)
    if case["tied"]:
        out.pop("lm_head.weight", None)
    return out


def mbridge_export_mla(case, hf_cfg, stored):
    """deepseek_v3: mbridge 0.15.1's DeepseekV3Bridge export of the stored tensors, each layer
    under its own number as megatron-core stored it, experts as grouped GEMM names them, and the
    local spec's separate q/kv layernorms under the fused names mbridge maps
    (`linear_q_up_proj.layer_norm_weight`: the same module's weight under the TE spec). Layers
    stored stacked (every layer alike) are exported one by one, as mbridge reads them."""
    import types

    from mbridge.models.deepseek_v3 import DeepseekV3Bridge

    class Bridge(DeepseekV3Bridge):
        def _build_config(self):  # see the module docstring: only these are read by the export
            return types.SimpleNamespace(mtp_num_layers=None, num_layers=hf_cfg.num_hidden_layers)

    bridge = Bridge(hf_cfg)
    bridge.make_vocab_size_divisible_by = DIVISIBLE_BY * case["tp"]
    bridge.vocab_size = hf_cfg.vocab_size
    bridge.padded_vocab_size = stored["embedding.word_embeddings.weight"].shape[0]
    fused = {"self_attention.q_layernorm.weight": "self_attention.linear_q_up_proj.layer_norm_weight",
             "self_attention.kv_layernorm.weight": "self_attention.linear_kv_up_proj.layer_norm_weight"}
    out = {}
    for key, t in stored.items():
        parts = key.split(".")
        if key.startswith("decoder.layers.") and not parts[2].isdigit():  # stacked [layers, ...]
            for i in range(t.shape[0]):
                head, rest = f"decoder.layers.{i}", ".".join(parts[2:])
                if rest.startswith("mlp.experts.experts."):
                    w = rest[len("mlp.experts.experts."):]
                    _convert(bridge, [(f"{head}.mlp.experts.{w}{e}", t[i, e]) for e in range(t.shape[1])], out)
                else:
                    _convert(bridge, [(f"{head}.{fused.get(rest, rest)}", t[i])], out)
        elif key.startswith("decoder.layers.") and parts[2].isdigit():
            head, rest = ".".join(parts[:3]), ".".join(parts[3:])
            if rest.startswith("mlp.experts.experts."):
                w = rest[len("mlp.experts.experts."):]
                _convert(bridge, [(f"{head}.mlp.experts.{w}{e}", t[e]) for e in range(t.shape[0])], out)
            else:
                _convert(bridge, [(f"{head}.{fused.get(rest, rest)}", t)], out)
        else:
            _convert(bridge, [(key, t)], out)
    if case["tied"]:
        out.pop("lm_head.weight", None)
    return out


def _convert(bridge, items, out):
    import torch

    for name, t in items:
        names, ts = bridge._weight_to_hf_format(name, t)
        for n, x in zip(names, ts):
            assert n not in out or torch.equal(out[n], x), f"mbridge made {n} twice, differently"
            out[n] = x.clone().contiguous()


def stored_tensors(d):
    """The checkpoint's tensors, whole, as torch's own DCP reader reshards them."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp.FileSystemReader(d).read_metadata()
    sd = {k: torch.zeros(tuple(v.size), dtype=v.properties.dtype)
          for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    dcp.load(sd, checkpoint_id=d, no_dist=True)
    return sd


def mla_model_parts(case, args):
    """deepseek_v3: megatron-core's MLATransformerConfig and the decoder block spec (the local
    spec per layer, dense or MoE by moe_layer_freq, this stage's layers), with the two patches
    the module docstring names."""
    import torch
    import torch.nn.functional as F
    import megatron.core.transformer.multi_latent_attention as mla_module
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import MLATransformerConfig
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if not isinstance(mla_module.TELinear, type):  # a MagicMock without Transformer Engine
        mla_module.HAVE_TE = False

    class MLACoreAttention(MegatronModule):
        """Causal softmax attention over [s, b, heads, d] with MLA's scale and k/v widths (the
        local DotProductAttention takes no k_channels/v_channels)."""

        def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                     softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None):
            super().__init__(config=config)
            self.scale = softmax_scale

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, packed_seq_params=None, **kw):
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
            return o.permute(2, 0, 1, 3).reshape(o.shape[2], o.shape[0], -1)

    layers, _ = layer_count(case)
    groups = args.moe_router_num_groups is not None
    cfg = MLATransformerConfig(
        num_layers=layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size, q_lora_rank=args.q_lora_rank, kv_lora_rank=args.kv_lora_rank,
        qk_head_dim=args.qk_head_dim, qk_pos_emb_head_dim=args.qk_pos_emb_head_dim, v_head_dim=args.v_head_dim,
        rope_type=args.rope_type or "yarn", rotary_base=args.rotary_base, rotary_scaling_factor=args.rotary_scaling_factor,
        mscale=args.mscale, mscale_all_dim=args.mscale_all_dim, normalization="RMSNorm",
        layernorm_epsilon=args.layernorm_epsilon, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, qk_layernorm=True, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, use_cpu_initialization=True,
        params_dtype=torch.float32, pipeline_dtype=torch.float32, tensor_model_parallel_size=case["tp"],
        pipeline_model_parallel_size=case["pp"], expert_model_parallel_size=case["ep"], sequence_parallel=False,
        num_moe_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_layer_freq=args.moe_layer_freq, moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
        moe_router_topk_scaling_factor=args.moe_router_topk_scaling_factor,
        moe_router_num_groups=args.moe_router_num_groups if groups else None,
        moe_router_group_topk=args.moe_router_group_topk if groups else None,
        moe_router_load_balancing_type="none", moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0)

    def layer_spec(is_moe):
        spec = get_gpt_layer_local_spec(num_experts=args.num_experts if is_moe else None, qk_layernorm=True,
                                        multi_latent_attention=True, normalization="RMSNorm")
        spec.submodules.self_attention.submodules.core_attention = MLACoreAttention
        return spec

    offset, n = get_transformer_layer_offset(cfg), get_num_layers_to_build(cfg)
    freq = args.moe_layer_freq if isinstance(args.moe_layer_freq, list) else [1] * layers
    specs = [layer_spec(f == 1) for f in freq][offset:offset + n]
    norm = LocalSpecProvider().layer_norm(rms_norm=True, for_qk=False)
    return cfg, TransformerBlockSubmodules(layer_specs=specs, layer_norm=norm)


def worker(rank, world, init_file, work, out_dir, cases):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    # A tied model under PP moves the last stage's output layer to the GPU to all-reduce it with
    # the first stage's embedding (language_module.setup_embeddings_and_output_layer): on CPU.
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=TIMEOUT)
    try:
        from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.moe import moe_utils
        from megatron.core.transformer.transformer_config import TransformerConfig

        # megatron-core 0.16.1's router gating reads te_general_gemm, defined only with
        # Transformer Engine installed: None is what it means without it.
        if not hasattr(moe_utils, "te_general_gemm"):
            moe_utils.te_general_gemm = None

        result = {}
        for case in cases:
            saved = torch.load(os.path.join(work, case["name"] + ".pt"), weights_only=False)
            hf, full, want_logits, args = saved["config"], saved["full"], saved["logits"], saved["args"]
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=case["tp"],
                                                     pipeline_model_parallel_size=case["pp"],
                                                     expert_model_parallel_size=case["ep"])
            tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
            kw = {}
            if moe(case):
                kw = dict(num_moe_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
                          moe_ffn_hidden_size=args.moe_ffn_hidden_size, moe_router_pre_softmax=False,
                          moe_router_load_balancing_type="none", moe_token_dispatcher_type="allgather",
                          moe_aux_loss_coeff=0.0)
            if mla(case):  # MLA: its own config and per-layer spec
                cfg, spec = mla_model_parts(case, args)
            else:
                cfg = TransformerConfig(
                    num_layers=LAYERS, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
                    num_query_groups=args.num_query_groups, kv_channels=args.kv_channels,
                    ffn_hidden_size=args.ffn_hidden_size, normalization="RMSNorm",
                    layernorm_epsilon=args.layernorm_epsilon,
                    gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                    add_qkv_bias=args.add_qkv_bias,
                    qk_layernorm=args.qk_layernorm, hidden_dropout=0.0, attention_dropout=0.0,
                    bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
                    apply_rope_fusion=False, persist_layer_norm=False, use_cpu_initialization=True,
                    params_dtype=torch.float32, pipeline_dtype=torch.float32,
                    tensor_model_parallel_size=case["tp"], pipeline_model_parallel_size=case["pp"],
                    expert_model_parallel_size=case["ep"], sequence_parallel=False, **kw)
                spec = get_gpt_layer_local_spec(num_experts=args.num_experts, qk_layernorm=args.qk_layernorm,
                                                normalization="RMSNorm")
            pp_rank = parallel_state.get_pipeline_model_parallel_rank()
            model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                             max_sequence_length=args.max_position_embeddings, position_embedding_type="rope",
                             rotary_base=args.rotary_base, parallel_output=False,
                             share_embeddings_and_output_weights=case["tied"],
                             pre_process=pp_rank == 0, post_process=pp_rank == case["pp"] - 1).eval()
            local = rank_state_dict(full, case, parallel_state.get_tensor_model_parallel_rank(), pp_rank,
                                    parallel_state.get_expert_model_parallel_rank(),
                                    parallel_state.get_expert_tensor_parallel_rank(), args.num_experts or 0)
            missing, unexpected = model.load_state_dict(local, strict=False)
            assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
            diff = None
            if case["pp"] == 1:
                ids = torch.tensor(PROMPT)
                pos = torch.arange(ids.shape[1]).unsqueeze(0)
                mask = torch.triu(torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool), diagonal=1)[None, None]
                with torch.no_grad():
                    logits = model(ids, pos, attention_mask=mask).float()
                diff = (logits - want_logits).abs().max().item()
            model.to(getattr(torch, case["dtype"]))
            out = os.path.join(out_dir, case["name"], f"iter_{ITER:07d}")
            os.makedirs(out, exist_ok=True)
            # Megatron-LM's generate_state_dict, less optimizer, scheduler and RNG state.
            state = {"args": args, "checkpoint_version": 3.0, "iteration": ITER,
                     "model": model.sharded_state_dict()}
            dist.barrier()
            dist_checkpointing.save(state, out)
            dist.barrier()
            if rank == 0:
                with open(os.path.join(out_dir, case["name"], "latest_checkpointed_iteration.txt"), "w") as f:
                    f.write(str(ITER))
            result[case["name"]] = diff
            parallel_state.destroy_model_parallel()
        if rank == 0:
            with open(os.path.join(work, "result.json"), "w") as f:
                json.dump(result, f)
    finally:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("ref_dir")
    ap.add_argument("cases", nargs="+")
    a = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    cases = [parse_case(c) for c in a.cases]
    out_dir, ref_dir = os.path.abspath(a.out_dir), os.path.abspath(a.ref_dir)
    work = tempfile.mkdtemp(prefix="megatron-families-work-")
    try:
        for case in cases:
            vocab = DIVISIBLE_BY * case["tp"] * 2  # Megatron-LM's padded size: the HF model's too
            model = hf_model(case, vocab)
            with torch.no_grad():
                logits = model(torch.tensor(PROMPT)).logits.float()
            sd = hf_tensors(model)
            model.to(getattr(torch, case["dtype"])).save_pretrained(os.path.join(ref_dir, case["name"]))
            torch.save({"config": None, "full": to_megatron(sd, model.config, case["family"]), "logits": logits,
                        "args": megatron_args(case, model.config)}, os.path.join(work, case["name"] + ".pt"))
        spawn(worker, 2, "megatron-families-save-",
              lambda scratch: (2, os.path.join(scratch, "rdzv"), work, out_dir, cases))
        with open(os.path.join(work, "result.json")) as f:
            diff = json.load(f)
        # The independent reference: mbridge's export of what megatron-core saved.
        import safetensors.torch
        import torch.distributed as dist
        from megatron.core import parallel_state
        from transformers import AutoConfig

        torch.cuda.current_device = lambda: "cpu"
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(work, 'rdzv-mb')}", rank=0,
                                world_size=1)
        try:
            parallel_state.initialize_model_parallel()
            for case in cases:
                d = os.path.join(out_dir, case["name"], f"iter_{ITER:07d}")
                hf_cfg = AutoConfig.from_pretrained(os.path.join(ref_dir, case["name"]))
                exported = mbridge_export(case, hf_cfg, stored_tensors(d))
                safetensors.torch.save_file(exported, os.path.join(ref_dir, case["name"], "mbridge.safetensors"))
        finally:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({c["name"]: {"files": files_under(os.path.join(out_dir, c["name"])),
                                  "max_logit_diff": diff[c["name"]]} for c in cases}))


if __name__ == "__main__":
    main()
