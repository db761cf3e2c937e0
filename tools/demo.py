#!/usr/bin/env python3
"""The Python half of tools/demo.sh: load a checkpoint through a ckptfs mount and check it.

  demo.py --view MNT/.../model --shards SRC/.../model --reference REF_DIR
          [--daemon-pid PID] [--mount-seconds S] [--work DIR] [--tokens N]

1. Waits (deadline 60 s) until the mounted view shows config.json and the index.
2. AutoModelForCausalLM.from_pretrained(view), timed: "load through the mount".
   ("Load" = from_pretrained + one pass over every parameter, as transformers 5 keeps the
   tensors memory-mapped; the reference is loaded first so that one-time start-up costs
   are not charged to either timed path.)
3. Checks it against from_pretrained(reference) (the save_pretrained output the shards were
   cut from): every tensor equal, logits equal on a fixed prompt of token ids, and the same
   greedy generation of --tokens tokens (no tokenizer: nothing is downloaded).
4. The alternative a user has today, timed on the same shards: torch's
   consolidate_safetensors_files into a temporary dir under --work (plus config.json), then
   from_pretrained of that copy (also checked), then the copy is deleted.
5. Prints a one-line summary; exits 1 if any check failed.

  demo.py --lora-view MNT/.../global_step_N/actor [--tokens N]

The hook for "a verl LoRA adapter loaded with PEFT" (lora_demo below): the base model by
from_pretrained(view), the adapter by PeftModel.from_pretrained(base, view/lora_adapter), greedy
tokens with the adapter and without it. demo.sh's step 9 calls it on the LoRA checkpoint verl's
own checkpoint manager saved into the mount (tests/python/writers/verl_save.py --lora 8).
The page cache is warm for both paths (the shards were just written or read): this is a
demonstration, not a benchmark (see tools/bench_load.py for cold/warm measurements).
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

PROMPT = [1, 306, 4658, 278, 6593, 310, 2834, 338]  # fixed token ids (Llama-like, < vocab)
INDEX = "model.safetensors.index.json"


def wait_for_view(view, timeout=60.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            names = os.listdir(view)
            if "config.json" in names and (INDEX in names or "model.safetensors" in names):
                return sorted(names)
        except OSError:
            pass
        if time.monotonic() > deadline:
            sys.exit(f"demo: {view} did not show a consolidated checkpoint within {timeout:.0f}s")
        time.sleep(0.1)


def vm_hwm_mb(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def lora_demo(view, tokens):
    """A verl LoRA checkpoint through the mount: the base model from the directory, the adapter
    from its lora_adapter/ folder with PEFT; greedy tokens with and without the adapter."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    base = AutoModelForCausalLM.from_pretrained(view, dtype="auto")
    model = PeftModel.from_pretrained(base, os.path.join(view, "lora_adapter"))
    model.eval()
    dt = time.perf_counter() - t0
    ids = torch.tensor([[t % base.config.vocab_size for t in PROMPT]])
    with torch.no_grad():
        gen = model.generate(input_ids=ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                             pad_token_id=0)[0, ids.shape[1]:].tolist()
        with model.disable_adapter():
            plain = model.generate(input_ids=ids, max_new_tokens=tokens, min_new_tokens=tokens,
                                   do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()
    cfg = model.peft_config["default"]
    print(f"demo: base model and LoRA adapter (r={cfg.r}, lora_alpha={cfg.lora_alpha}, "
          f"{len(cfg.target_modules)} layers) loaded through the mount in {dt:.2f} s")
    print(f"demo: greedy {tokens} tokens with the adapter    {gen}")
    print(f"demo: greedy {tokens} tokens without the adapter {plain}")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lora-view", help="a verl LoRA checkpoint dir inside the mount: run lora_demo only")
    ap.add_argument("--view", help="the checkpoint dir inside the mount")
    ap.add_argument("--shards", help="the rank-shard dir in SRC (for torch's consolidator)")
    ap.add_argument("--reference", help="save_pretrained output of the same model")
    ap.add_argument("--daemon-pid", type=int, help="ckptfs daemon pid (its peak RSS is reported)")
    ap.add_argument("--mount-seconds", type=float, help="how long `ckptfs mount` took (reported)")
    ap.add_argument("--work", default=tempfile.gettempdir(), help="where the consolidated copy goes")
    ap.add_argument("--tokens", type=int, default=10, help="greedy tokens to generate")
    a = ap.parse_args()
    if a.lora_view:
        return lora_demo(a.lora_view, a.tokens)
    if not (a.view and a.shards and a.reference):
        ap.error("--view, --shards and --reference are required (or --lora-view)")

    listing = wait_for_view(a.view)
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)

    sizes = {n: os.path.getsize(os.path.join(a.view, n)) for n in listing}
    print("demo: the mount shows " + ", ".join(f"{n} ({sizes[n]:,} B)" for n in listing))

    def load(d):
        """from_pretrained + one pass over every parameter: transformers 5 leaves safetensors
        tensors memory-mapped, so from_pretrained alone may not have read the bytes yet."""
        t0 = time.perf_counter()
        m = AutoModelForCausalLM.from_pretrained(d, dtype="auto")
        with torch.no_grad():
            for p in m.parameters():
                p.sum()
        dt = time.perf_counter() - t0
        m.eval()
        return m, dt

    def run(model):
        ids = torch.tensor([PROMPT])
        with torch.no_grad():
            logits = model(ids).logits
            out = model.generate(ids, max_new_tokens=a.tokens, do_sample=False, min_new_tokens=a.tokens,
                                 pad_token_id=0)
        return logits, out[0, len(PROMPT):].tolist()

    # Both timed paths start from the same state: the shards in the page cache (read them once).
    for n in sorted(os.listdir(a.shards)):
        if n.endswith(".safetensors"):
            with open(os.path.join(a.shards, n), "rb") as f:
                while f.read(1 << 24):
                    pass
    ref, _ = load(a.reference)  # first: it also warms up transformers' one-time start-up costs
    model, t_mount = load(a.view)
    failures = []

    sd, rsd = model.state_dict(), ref.state_dict()
    tensors = len(rsd)
    if list(sd) != list(rsd):
        failures.append(f"state dict keys differ: {sorted(set(sd) ^ set(rsd))}")
    else:
        bad = [k for k in rsd if not torch.equal(sd[k], rsd[k])]
        if bad:
            failures.append(f"{len(bad)} tensors differ from the reference, e.g. {bad[:3]}")
    logits, gen = run(model)
    ref_logits, ref_gen = run(ref)
    if not torch.equal(logits, ref_logits):
        failures.append("logits differ from the reference model's")
    print(f"demo: prompt token ids {PROMPT}")
    print(f"demo: greedy {a.tokens} tokens via mount     {gen}")
    print(f"demo: greedy {a.tokens} tokens via reference {ref_gen}  "
          f"{'(identical)' if gen == ref_gen else '(DIFFERENT)'}")
    if gen != ref_gen:
        failures.append("generated tokens differ")
    with open(os.path.join(a.view, INDEX)) as f:
        index = json.load(f)
    nbytes = index["metadata"]["total_size"]
    nfiles = len(set(index["weight_map"].values()))
    del model, sd

    # The alternative: consolidate with torch first, then load the copy.
    mapping_file = os.path.join(a.shards, ".hf_metadata", "fqn_to_file_index_mapping.json")
    if os.path.exists(mapping_file):
        with open(mapping_file) as f:
            mapping = json.load(f)
    else:  # plain layout: the writer's grouping is in the shard names, the order in the index
        mapping = {k: int(v.split("-")[1]) if v != "model.safetensors" else 1
                   for k, v in index["weight_map"].items()}
    tmp = tempfile.mkdtemp(prefix="consolidated-", dir=a.work)
    try:
        t0 = time.perf_counter()
        consolidate_safetensors_files(a.shards, tmp, mapping)
        t_cons = time.perf_counter() - t0
        for side in ("config.json", "generation_config.json"):
            for d in (os.path.join(a.shards, ".hf_metadata"), a.shards):
                if os.path.exists(os.path.join(d, side)):
                    shutil.copyfile(os.path.join(d, side), os.path.join(tmp, side))
                    break
        copy, t_copy_load = load(tmp)
        csd = copy.state_dict()
        if any(not torch.equal(csd[k], rsd[k]) for k in rsd):
            failures.append("torch's consolidated copy differs from the reference (generator problem?)")
        del copy, csd
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    hwm = vm_hwm_mb(a.daemon_pid) if a.daemon_pid else None
    t_alt = t_cons + t_copy_load
    t_ours = t_mount + (a.mount_seconds or 0.0)
    ours = (f"mount {a.mount_seconds:.2f} + from_pretrained {t_mount:.2f}" if a.mount_seconds is not None
            else f"from_pretrained {t_mount:.2f}")
    print(f"demo: consolidating first writes a {nbytes / 1e6:.1f} MB second copy to disk")
    if hwm is not None:
        print(f"demo: ckptfs daemon peak RSS {hwm:.1f} MB")
    status = "OK" if not failures else "FAILED"
    print(f"ckptfs demo {status}: {tensors} tensors, {nbytes:,} bytes in {nfiles} files; "
          f"loaded through the mount in {t_ours:.2f} s ({ours}); consolidating first would take "
          f"{t_alt:.2f} s (torch consolidate_safetensors_files {t_cons:.2f} + from_pretrained "
          f"{t_copy_load:.2f}), {t_alt / t_ours:.1f}x the mount path; greedy tokens "
          f"{'match' if gen == ref_gen else 'DIFFER'}")
    for f in failures:
        print(f"demo: CHECK FAILED: {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
