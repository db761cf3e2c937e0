#!/usr/bin/env python3
"""What a model map costs: a torchtitan-layout checkpoint read through the map, against the same
model stored under HF names and layouts (issue 22; figures in docs/benchmarks.md).

One Llama-shaped model (bf16, --layers layers of hidden 2048, 16 heads, 8 kv heads, ffn 5632,
vocabulary 32000: about 1.2 GB at 10 layers) is saved twice by torch's dcp.save into DIR/src:
  titan/  torchtitan's names and layouts (torchtitan 0.3.0's from_hf: wq and wk rows permuted for
          RoPE), with config.json: served through the built-in map torchtitan-llama3, q_proj and
          k_proj as one run per row pair (4 KiB rows);
  hf/     HF's names and layouts: served as stored, one run per chunk.
Both hold one .distcp file, so the only difference is the map. Each round mounts SRC afresh and
reads every consolidated file of each directory with read(2) in 8 MiB calls: first with the
source files dropped from the page cache (cold: echo 1 > /proc/sys/vm/drop_caches), then again
once the kernel has dropped the mount's pages (warm source, fresh FUSE reads: the daemon's work
with the disk out of the way). The two directories alternate within a round, in alternating
order; medians of --rounds, and the ratio titan/hf of read throughput. Compare within one run.

Usage (as root, with the venv of tools/setup.sh):
  bench_maps.py [--layers 10] [--rounds 5] [--bin build/src/ckptfs] [--dir /var/tmp/ckptfs-bench-maps]
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


def save(src: str, layers: int) -> None:
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
    dcp.save(tt, checkpoint_id=os.path.join(src, "titan"), no_dist=True)
    dcp.save(hf, checkpoint_id=os.path.join(src, "hf"), no_dist=True)
    cfg = dict(CFG, num_hidden_layers=layers)
    for d in ("titan", "hf"):
        with open(os.path.join(src, d, "config.json"), "w") as f:
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
        read_all(os.path.join(src, d, n))


def one_round(binary: str, src: str, mnt: str, log: str, order: tuple[str, str]) -> dict:
    out = {}
    for mode in ("cold", "warm"):
        for d in order:
            os.makedirs(mnt, exist_ok=True)
            if mode == "cold":
                drop_caches()
            else:
                warm_source(src, d)
            proc = subprocess.Popen([binary, "mount", src, mnt, "-f", "-o", "settle=0,prefetch=off"],
                                    stdout=open(log, "a"), stderr=subprocess.STDOUT)
            try:
                deadline = time.monotonic() + 30
                while not os.path.ismount(mnt):
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"mount failed; see {log}")
                    time.sleep(0.02)
                files = consolidated(os.path.join(mnt, d))
                assert files, f"{d}: nothing consolidated: {os.listdir(os.path.join(mnt, d))}"
                size = sum(os.path.getsize(p) for p in files)
                out[f"{d} {mode} GB/s"] = size / sum(read_all(p) for p in files) / 1e9
            finally:
                subprocess.run(["fusermount3", "-u", mnt], capture_output=True)
                proc.wait(timeout=30)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "src", "ckptfs"))
    ap.add_argument("--dir", default="/var/tmp/ckptfs-bench-maps")
    a = ap.parse_args()
    src = os.path.join(a.dir, "src")
    if os.path.exists(a.dir):
        shutil.rmtree(a.dir)
    os.makedirs(src)
    t0 = time.perf_counter()
    save(src, a.layers)
    size = sum(os.path.getsize(os.path.join(src, "hf", n)) for n in os.listdir(os.path.join(src, "hf")))
    print(f"saved 2 x {size / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s", flush=True)
    insp = subprocess.run([a.bin, "inspect", os.path.join(src, "titan")], capture_output=True, text=True)
    assert "model map: torchtitan-llama3" in insp.stdout, insp.stdout[:2000] + insp.stderr
    rounds = []
    for r in range(a.rounds):
        order = ("titan", "hf") if r % 2 == 0 else ("hf", "titan")
        rounds.append(one_round(a.bin, src, os.path.join(a.dir, "mnt"), os.path.join(a.dir, "mount.log"), order))
    for key in sorted(rounds[0]):
        vals = [x[key] for x in rounds]
        print(f"{key:24s} median {statistics.median(vals):.3f}  (all: {', '.join(f'{v:.3f}' for v in vals)})")
    for mode in ("cold", "warm"):
        ratios = [x[f"titan {mode} GB/s"] / x[f"hf {mode} GB/s"] for x in rounds]
        print(f"titan/hf {mode:4s}            median {statistics.median(ratios):.3f}  "
              f"(all: {', '.join(f'{v:.3f}' for v in ratios)})")
    shutil.rmtree(a.dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
