#!/usr/bin/env python3
"""Save a tiny FSDP2-sharded HF Llama with verl's own FSDPCheckpointManager (verl 0.9.1, CPU, gloo),
then merge it back with verl's own FSDP model merger.

    python verl_save.py OUT_DIR [--ranks 2] [--dtype float32|bfloat16] [--tied]

The model (fully_shard per decoder layer, then the root, on a 1-D mesh named "fsdp" as verl's
workers name it) is trained one AdamW step (LambdaLR scheduler, as verl's), then every rank calls
FSDPCheckpointManager(...).save_checkpoint(OUT_DIR/global_step_1/actor, global_step=1) with verl's
default contents (model, optimizer, extra), which writes there, per rank R of W:
model_world_size_W_rank_R.pt, optim_world_size_W_rank_R.pt, extra_state_world_size_W_rank_R.pt
(torch.save zips of the rank's DTensor shards / optimizer state / lr_scheduler+rng), and on rank 0
fsdp_config.json and huggingface/ (config.json and a tiny offline tokenizer). Rank 0 also writes
OUT_DIR/latest_checkpointed_iteration.txt as verl's trainer does, and
OUT_DIR/../reference-<name>.safetensors: the full, unsharded model state dict.
The sizes split unevenly over 3 ranks (vocab 130, intermediate 100: FSDP2's torch.chunk rows).

Then verl's FSDPModelMerger (what `python -m verl.model_merger merge --backend fsdp` runs; called
in-process because `-m` would run verl/__init__.py, see _import_verl) writes
OUT_DIR/../merged-<name>/, whose tensors are checked against the reference. The merger always
casts to bfloat16 and drops lm_head.weight when tied, so the check is against the reference in bf16.
The last stdout line is a JSON list of the files under OUT_DIR (relative paths).
"""
import argparse
import json
import os

from ranks import RANK_ENV, TIMEOUT, files_under, spawn


def _import_verl():
    """verl's real checkpoint and merger modules, imported without Ray or tensordict:
    - verl/__init__.py imports verl.protocol (DataProto: ray, tensordict) and
      verl/utils/checkpoint/__init__.py the Ray CheckpointHandler (verl.single_controller and every
      training engine in verl.workers.engine); the save and the merge use neither, so both packages
      are registered by path (their submodules import as usual) without running their __init__.
    - verl/utils/model.py (imported by verl.utils.fsdp_utils) imports tensordict, a compiled
      extension built per torch release, only for an isinstance in a helper the checkpoint code
      never calls: when tensordict is not installed, a stub module with an empty NonTensorData."""
    import importlib.machinery
    import importlib.util
    import sys
    import types

    if "tensordict" not in sys.modules and importlib.util.find_spec("tensordict") is None:
        td, tc = types.ModuleType("tensordict"), types.ModuleType("tensordict.tensorclass")
        tc.NonTensorData = type("NonTensorData", (), {})
        td.tensorclass = tc
        sys.modules.update({"tensordict": td, "tensordict.tensorclass": tc})
    for name in ("verl", "verl.utils.checkpoint"):
        if name not in sys.modules:
            spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
            spec.submodule_search_locations = list(importlib.util.find_spec(name).submodule_search_locations)
            sys.modules[name] = importlib.util.module_from_spec(spec)
    from verl.model_merger.base_model_merger import ModelMergerConfig
    from verl.model_merger.fsdp_model_merger import FSDPModelMerger
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
    return FSDPCheckpointManager, ModelMergerConfig, FSDPModelMerger


def worker(rank, world, init_file, out_dir, ref, dtype, tied):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=TIMEOUT)
    try:
        from safetensors.torch import save_file
        from tokenizers import Tokenizer, models, pre_tokenizers
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

        FSDPCheckpointManager = _import_verl()[0]
        cfg = LlamaConfig(vocab_size=130, hidden_size=64, intermediate_size=100, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                          tie_word_embeddings=tied, dtype=dtype, architectures=["LlamaForCausalLM"])
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))  # the merger wants ("fsdp",)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)  # verl's constant schedule
        ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        sched.step()

        # A tiny word-level tokenizer, built offline: verl saves it to huggingface/ and its merger loads it.
        vocab = {"<unk>": 0, "</s>": 1, **{f"t{i}": i for i in range(2, cfg.vocab_size)}}
        tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tk.pre_tokenizer = pre_tokenizers.Whitespace()
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="</s>")

        mgr = FSDPCheckpointManager(model=model, optimizer=opt, lr_scheduler=sched, processing_class=tokenizer)
        mgr.save_checkpoint(local_path=os.path.join(out_dir, "global_step_1", "actor"), global_step=1)

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            with open(os.path.join(out_dir, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write("1")  # what verl's RayPPOTrainer._save_checkpoint writes after the save
            save_file({k: v.clone().contiguous() for k, v in full.items()}, ref)  # tied: two clones
        dist.barrier()
    finally:
        dist.destroy_process_group()


def merge_and_check(actor_dir, merged_dir, ref):
    """verl's FSDP merger (as `python -m verl.model_merger merge --backend fsdp`), checked against ref."""
    import torch
    from safetensors.torch import load_file

    _, ModelMergerConfig, FSDPModelMerger = _import_verl()
    os.makedirs(merged_dir, exist_ok=True)
    FSDPModelMerger(ModelMergerConfig(operation="merge", backend="fsdp", local_dir=actor_dir, target_dir=merged_dir,
                                      hf_model_config_path=os.path.join(actor_dir, "huggingface"))).merge_and_save()
    merged, want = load_file(os.path.join(merged_dir, "model.safetensors")), load_file(ref)
    bad = [k for k, v in merged.items() if k not in want or not torch.equal(v, want[k].to(v.dtype))]
    if bad:
        raise SystemExit(f"verl merger output differs from the reference: {bad}")
    dtypes = sorted({str(v.dtype) for v in merged.values()})
    print(f"verl merger: {len(merged)} tensors {dtypes} equal the reference cast to them; "
          f"not in the merger output: {sorted(set(want) - set(merged))}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--tied", action="store_true", help="tie the embedding and the LM head")
    a = ap.parse_args()
    out_dir = os.path.abspath(a.out_dir)
    os.makedirs(out_dir, exist_ok=True)
    parent, name = os.path.split(out_dir)
    ref = os.path.join(parent, f"reference-{name}.safetensors")
    spawn(worker, a.ranks, "verl-save-",
          lambda scratch: (a.ranks, os.path.join(scratch, "rdzv"), out_dir, ref, a.dtype, a.tied))
    os.environ.update(RANK_ENV)  # the merger too: CPU, no Hugging Face network access
    merge_and_check(os.path.join(out_dir, "global_step_1", "actor"), os.path.join(parent, f"merged-{name}"), ref)
    print(json.dumps(files_under(out_dir)))


if __name__ == "__main__":
    main()
