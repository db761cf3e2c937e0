#!/usr/bin/env python3
"""What a model map or the LoRA split costs: a checkpoint read through the map (or split), against
the same model stored under HF names and layouts (issues 22 and 33; figures in docs/benchmarks.md).

One Llama-shaped model (bf16, --layers layers of hidden 2048, 16 heads, 8 kv heads, ffn 5632,
vocabulary 32000: about 1.2 GB at 10 layers) is saved four times into DIR/src:
  titan/  by torch's dcp.save under torchtitan's names and layouts (torchtitan 0.3.0's from_hf:
          wq and wk rows permuted for RoPE), with config.json: served through the built-in map
          torchtitan-llama3, q_proj and k_proj as one run per row pair (4 KiB rows);
  hf/     by dcp.save under HF's names and layouts: served as stored, one run per chunk;
  lora/   verl's layout of a LoRA run (torch.save of DTensors, Shard(0) on a 1-rank gloo mesh, in
          model_world_size_1_rank_0.pt; fsdp_config.json; lora_train_meta.json): the same base
          weights under PEFT's names (base_model.model....q_proj.base_layer.weight) and a rank-16
          lora_A/lora_B pair for each of the 7 linear modules of every layer: served through the
          LoRA split (the base model in the directory, the adapter in lora_adapter/);
  base/   the same verl layout of the base weights alone, under HF names: served as stored;
  unsplit/ lora/'s rank file without lora_train_meta.json: served as stored, under PEFT's names;
  gptoss/, gptoss_hf/ (--pairs gptoss): gpt-oss-20b's expert shapes, 8 experts, 2 layers (about
          1.0 GB), under torchtitan's names (the experts transposed on read by the built-in map
          torchtitan-gpt-oss: strided reads through io::gather's window) and under HF's, as stored.
Pairs compared: titan/hf (the map, DCP: the model files hold the same bytes), lora/base (the
split against the base model a user would otherwise have: the model files hold the same bytes,
the rank file 2.5 times the tensors), lora/unsplit (the same rank file, split or not: the
split's own cost) and, with --pairs merged, lora/base again with lora/ mounted -o lora=merged
(every linear weight computed on read as W + 2 * (B @ A): the merge's cost; the same bytes' size). Each round mounts SRC afresh for each directory and times the first listing
(the daemon builds the view: headers or pickles parsed, the map compiled or the split made) and
reads every consolidated model file with read(2) in 8 MiB calls: first with the source files
dropped from the page cache (cold: echo 1 > /proc/sys/vm/drop_caches), then again once the kernel
has dropped the mount's pages (warm source, fresh FUSE reads: the daemon's work with the disk out
of the way). The two directories of a pair alternate within a round, in alternating order;
medians of --rounds, and the ratios titan/hf and lora/base. Compare within one run.

Usage (as root, with the venv of tools/setup.sh):
  bench_maps.py [--layers 10] [--rounds 5] [--pairs titan,lora,split,merged,gptoss] [--bin build/src/ckptfs]
                [--dir /var/tmp/ckptfs-bench-maps]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_attention_heads=16,
           num_key_value_heads=8, rms_norm_eps=1e-5, tie_word_embeddings=False, torch_dtype="bfloat16",
           architectures=["LlamaForCausalLM"], model_type="llama", max_position_embeddings=2048)


def save(src: str, layers: int, pairs: list[str]) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(0)
    h, ffn, heads, kv = CFG["hidden_size"], CFG["intermediate_size"], CFG["num_attention_heads"], CFG["num_key_value_heads"]
    hd = h // heads

    def w(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    def unpermute(x, n):  # torchtitan's from_hf (_reverse_permute)
        return x.view(n, 2, x.shape[0] // n // 2, x.shape[1]).transpose(1, 2).reshape(x.shape).contiguous()

    hf = {"model.embed_tokens.weight": w(CFG["vocab_size"], h), "model.norm.weight": w(h),
          "lm_head.weight": w(CFG["vocab_size"], h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        hf |= {p + "self_attn.q_proj.weight": w(heads * hd, h), p + "self_attn.k_proj.weight": w(kv * hd, h),
               p + "self_attn.v_proj.weight": w(kv * hd, h), p + "self_attn.o_proj.weight": w(h, heads * hd),
               p + "mlp.gate_proj.weight": w(ffn, h), p + "mlp.up_proj.weight": w(ffn, h),
               p + "mlp.down_proj.weight": w(h, ffn), p + "input_layernorm.weight": w(h),
               p + "post_attention_layernorm.weight": w(h)}
    tt = {"tok_embeddings.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"],
          "lm_head.weight": hf["lm_head.weight"]}
    for i in range(layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        tt |= {q + "attention.qkv_linear.wq.weight": unpermute(hf[p + "self_attn.q_proj.weight"], heads),
               q + "attention.qkv_linear.wk.weight": unpermute(hf[p + "self_attn.k_proj.weight"], kv),
               q + "attention.qkv_linear.wv.weight": hf[p + "self_attn.v_proj.weight"],
               q + "attention.wo.weight": hf[p + "self_attn.o_proj.weight"],
               q + "feed_forward.w1.weight": hf[p + "mlp.gate_proj.weight"],
               q + "feed_forward.w3.weight": hf[p + "mlp.up_proj.weight"],
               q + "feed_forward.w2.weight": hf[p + "mlp.down_proj.weight"],
               q + "attention_norm.weight": hf[p + "input_layernorm.weight"],
               q + "ffn_norm.weight": hf[p + "post_attention_layernorm.weight"]}
    cfg = dict(CFG, num_hidden_layers=layers)
    if "titan" in pairs:
        dcp.save(tt, checkpoint_id=os.path.join(src, "titan"), no_dist=True)
        dcp.save(hf, checkpoint_id=os.path.join(src, "hf"), no_dist=True)
        for d in ("titan", "hf"):
            with open(os.path.join(src, d, "config.json"), "w") as f:
                json.dump(cfg, f)
    if "gptoss" in pairs:
        save_gpt_oss(src, w)
    if "lora" in pairs or "split" in pairs or "merged" in pairs:
        r = 16
        peft = {}
        for k, v in hf.items():
            mod = k.rsplit(".", 1)[0]
            if mod.endswith(LINEAR):  # a LoRA layer: the base layer and its A, B pair
                peft[f"base_model.model.{mod}.base_layer.weight"] = v
                peft[f"base_model.model.{mod}.lora_A.default.weight"] = w(r, v.shape[1])
                peft[f"base_model.model.{mod}.lora_B.default.weight"] = w(v.shape[0], r)
            else:
                peft[f"base_model.model.{k}"] = v
        save_verl(os.path.join(src, "lora"), peft, cfg)
        with open(os.path.join(src, "lora", "lora_train_meta.json"), "w") as f:
            json.dump({"r": r, "lora_alpha": 2 * r, "task_type": "CAUSAL_LM"}, f)
        save_verl(os.path.join(src, "base"), hf, cfg)
        # The same rank file with no lora_train_meta.json: served unsplit, under PEFT's names.
        save_verl(os.path.join(src, "unsplit"), peft, cfg)


# gpt-oss-20b's expert shapes (hidden 2880, intermediate 2880), 8 experts, 2 layers: the experts
# are 99% of the bytes.
GPT_OSS = dict(vocab_size=8192, hidden_size=2880, intermediate_size=2880, num_local_experts=8,
               num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_hidden_layers=2,
               tie_word_embeddings=False, architectures=["GptOssForCausalLM"], model_type="gpt_oss",
               torch_dtype="bfloat16")


def save_gpt_oss(src: str, w) -> None:
    """gptoss/: torchtitan 0.3.0's gpt-oss names and layouts (experts [E, 2F, D] and [E, D, F]),
    served through torchtitan-gpt-oss, the experts transposed on read; gptoss_hf/: the same bytes
    as HF's GptOssExperts holds them ([E, D, 2F], [E, F, D], written transposed), served as stored."""
    import torch.distributed.checkpoint as dcp

    c = GPT_OSS
    h, f, e, heads, kv, hd = (c["hidden_size"], c["intermediate_size"], c["num_local_experts"],
                              c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"])
    tt, hf = {"tok_embeddings.weight": w(c["vocab_size"], h), "norm.weight": w(h),
              "lm_head.weight": w(c["vocab_size"], h)}, {}
    for i in range(c["num_hidden_layers"]):
        q = f"layers.{i}."
        tt |= {q + "attention.qkv_linear.wq.weight": w(heads * hd, h), q + "attention.qkv_linear.wq.bias": w(heads * hd),
               q + "attention.qkv_linear.wk.weight": w(kv * hd, h), q + "attention.qkv_linear.wk.bias": w(kv * hd),
               q + "attention.qkv_linear.wv.weight": w(kv * hd, h), q + "attention.qkv_linear.wv.bias": w(kv * hd),
               q + "attention.wo.weight": w(h, heads * hd), q + "attention.wo.bias": w(h),
               q + "attention.sinks": w(heads), q + "attention_norm.weight": w(h), q + "ffn_norm.weight": w(h),
               q + "moe.router.gate.weight": w(e, h), q + "moe.router.gate.bias": w(e),
               q + "moe.routed_experts.inner_experts.mlp1_weight_EGD": w(e, 2 * f, h),
               q + "moe.routed_experts.inner_experts.mlp1_bias_EG": w(e, 2 * f),
               q + "moe.routed_experts.inner_experts.mlp2_weight_EDF": w(e, h, f),
               q + "moe.routed_experts.inner_experts.mlp2_bias_ED": w(e, h)}
    names = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "lm_head.weight": "lm_head.weight"}
    layer = {"attention.qkv_linear.wq": "self_attn.q_proj", "attention.qkv_linear.wk": "self_attn.k_proj",
             "attention.qkv_linear.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
             "attention.sinks": "self_attn.sinks", "attention_norm": "input_layernorm",
             "ffn_norm": "post_attention_layernorm", "moe.router.gate": "mlp.router",
             "moe.routed_experts.inner_experts.mlp1_weight_EGD": "mlp.experts.gate_up_proj",
             "moe.routed_experts.inner_experts.mlp1_bias_EG": "mlp.experts.gate_up_proj_bias",
             "moe.routed_experts.inner_experts.mlp2_weight_EDF": "mlp.experts.down_proj",
             "moe.routed_experts.inner_experts.mlp2_bias_ED": "mlp.experts.down_proj_bias"}
    for k, v in tt.items():
        if k in names:
            hf[names[k]] = v
            continue
        _, i, rest = k.split(".", 2)
        mod = next(m for m in layer if rest.startswith(m))
        new = f"model.layers.{i}.{layer[mod]}{rest[len(mod):]}"
        hf[new] = v.transpose(-2, -1).contiguous() if "_weight_" in rest else v
    for d, sd in (("gptoss", tt), ("gptoss_hf", hf)):
        dcp.save(sd, checkpoint_id=os.path.join(src, d), no_dist=True)
        with open(os.path.join(src, d, "config.json"), "w") as fh:
            json.dump(c, fh)


# The modules verl's LoRA (target_modules="all-linear") wraps in a Llama.
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def save_verl(d: str, sd: dict, cfg: dict) -> None:
    """verl's layout for a world of 1 (bench_native.save_verl: the rank file and fsdp_config.json),
    and the HF config in huggingface/ as verl's checkpoint manager writes it."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_native import save_verl as save_rank_file

    save_rank_file(d, sd)
    os.makedirs(os.path.join(d, "huggingface"))
    with open(os.path.join(d, "huggingface", "config.json"), "w") as f:
        json.dump(cfg, f)


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("1\n")


def read_all(path: str) -> float:
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(8 << 20):
            pass
    return time.perf_counter() - t0


def consolidated(d: str) -> list[str]:
    return sorted(os.path.join(d, n) for n in os.listdir(d) if n.startswith("model-") and n.endswith(".safetensors"))


def warm_source(src: str, d: str) -> None:
    for n in os.listdir(os.path.join(src, d)):
        if os.path.isfile(os.path.join(src, d, n)):
            read_all(os.path.join(src, d, n))


def one_round(binary: str, src: str, mnt: str, log: str, order: tuple[str, str], opts: dict) -> dict:
    """`opts`: extra -o options of the mount serving a directory."""
    out = {}
    for mode in ("cold", "warm"):
        for d in order:
            os.makedirs(mnt, exist_ok=True)
            if mode == "cold":
                drop_caches()
            else:
                warm_source(src, d)
            o = ",".join(["settle=0,prefetch=off", *([opts[d]] if d in opts else [])])
            proc = subprocess.Popen([binary, "mount", src, mnt, "-f", "-o", o],
                                    stdout=open(log, "a"), stderr=subprocess.STDOUT)
            try:
                deadline = time.monotonic() + 30
                while not os.path.ismount(mnt):
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"mount failed; see {log}")
                    time.sleep(0.02)
                t0 = time.perf_counter()
                names = os.listdir(os.path.join(mnt, d))
                if mode == "cold":  # the first listing builds the view
                    out[f"{d} list s"] = time.perf_counter() - t0
                files = consolidated(os.path.join(mnt, d))
                assert files, f"{d}: nothing consolidated: {names}"
                size = sum(os.path.getsize(p) for p in files)
                out[f"{d} {mode} GB/s"] = size / sum(read_all(p) for p in files) / 1e9
            finally:
                subprocess.run(["fusermount3", "-u", mnt], capture_output=True)
                proc.wait(timeout=30)
    return out


# pair -> (the directory through the map or split, the one served as stored, what inspect says,
# the -o options of the first one's mount)
PAIRS = {"titan": ("titan", "hf", "model map: torchtitan-llama3", ""),
         "lora": ("lora", "base", "lora: LoRA (r=16", ""),
         "split": ("lora", "unsplit", "lora: LoRA (r=16", ""),
         "merged": ("lora", "base", "lora: LoRA (r=16", "lora=merged"),
         "gptoss": ("gptoss", "gptoss_hf", "model map: torchtitan-gpt-oss", "")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "src", "ckptfs"))
    ap.add_argument("--dir", default="/var/tmp/ckptfs-bench-maps")
    ap.add_argument("--pairs", default="titan,lora,split",
                    help="titan (the map, vs hf), lora (the split, vs base), split (the split, vs unsplit), "
                         "merged (-o lora=merged, vs base), "
                         "gptoss (the map with its experts transposed on read, vs the same bytes stored transposed)")
    a = ap.parse_args()
    pairs = [p for p in a.pairs.split(",") if p]
    assert set(pairs) <= set(PAIRS), f"--pairs: {pairs}: known are {sorted(PAIRS)}"
    src = os.path.join(a.dir, "src")
    if os.path.exists(a.dir):
        shutil.rmtree(a.dir)
    os.makedirs(src)
    t0 = time.perf_counter()
    save(src, a.layers, pairs)
    print(f"saved {', '.join(pairs)} in {time.perf_counter() - t0:.1f} s", flush=True)
    for p in pairs:
        d, _, want, _ = PAIRS[p]
        insp = subprocess.run([a.bin, "inspect", os.path.join(src, d)], capture_output=True, text=True)
        assert want in insp.stdout, insp.stdout[:2000] + insp.stderr
    rounds = []
    for r in range(a.rounds):
        res = {}
        for p in pairs:
            d, ref, _, opt = PAIRS[p]
            order = (d, ref) if r % 2 == 0 else (ref, d)
            got = one_round(a.bin, src, os.path.join(a.dir, "mnt"), os.path.join(a.dir, "mount.log"), order,
                            {d: opt} if opt else {})
            res |= {f"{p}: {k}": v for k, v in got.items()}
        rounds.append(res)
    for key in sorted(rounds[0]):
        vals = [x[key] for x in rounds]
        print(f"{key:30s} median {statistics.median(vals):.3f}  (all: {', '.join(f'{v:.3f}' for v in vals)})")
    for p in pairs:
        d, ref, _, _ = PAIRS[p]
        for key in ("cold GB/s", "warm GB/s", "list s"):
            ratios = [x[f"{p}: {d} {key}"] / x[f"{p}: {ref} {key}"] for x in rounds]
            label = f"{p}: {d}/{ref}"
            print(f"{label} {key:10s}{' ' * max(1, 28 - len(label))}median {statistics.median(ratios):.3f}  "
                  f"(all: {', '.join(f'{v:.3f}' for v in ratios)})")
    shutil.rmtree(a.dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
