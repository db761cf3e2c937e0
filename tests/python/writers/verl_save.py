#!/usr/bin/env python3
"""Save a tiny FSDP-sharded HF Llama with verl's own FSDPCheckpointManager (verl 0.9.1, CPU, gloo),
then merge it back with verl's own FSDP model merger.

    python verl_save.py OUT_DIR [--ranks 2] [--dtype float32|bfloat16] [--tied]
                        [--strategy fsdp2|fsdp] [--hsdp] [--no-mesh] [--lora R] [--lora-only] [--no-merge]
                        [--case OUT_DIR2:FLAGS ...]

Each `--case` is another checkpoint the same ranks save after the first, with its own flags (all
but --ranks and --no-merge): one start-up of torch, transformers and verl for all of them.

The model is wrapped as verl's FSDP engine (verl/workers/engine/fsdp/transformer_impl.py) wraps it:
- `--strategy fsdp2` (the default here, as before): verl's own apply_fsdp2 (fully_shard per decoder
  layer and embedding, then the root).
- `--strategy fsdp` (verl's default strategy): FSDP1, `FullyShardedDataParallel(..., device_mesh=mesh)`
  with verl's own get_fsdp_wrap_policy and get_sharding_strategy, use_orig_params=False (verl's
  default). Two departures, both forced by CPU: `sync_module_states=False` (torch refuses True
  without a GPU; every rank builds the model from the same seed instead, so the ranks agree as
  the sync would make them) and no MixedPrecision (verl's bf16 param_dtype is a GPU setting; the
  rank files hold the parameters' own dtype either way). `--no-mesh` leaves device_mesh out
  (older verl, other FSDP1 users): FSDP1 then saves ShardedTensors, not DTensors.
- The mesh is verl's create_device_mesh's: 1-D ("fsdp",), or with `--hsdp` 2-D
  ("ddp", "fsdp") of (ranks / 2, 2): HSDP (FSDP1 HYBRID_SHARD, FSDP2 placements
  [Replicate, Shard(0)]); --hsdp needs an even --ranks of at least 4.
- `--lora R`: before wrapping, verl's _build_lora_module: enable_input_require_grads, then
  peft.get_peft_model(model, LoraConfig(task_type=CAUSAL_LM, r=R, lora_alpha=2R,
  target_modules="all-linear", bias="none")). The rank files then hold the PEFT-wrapped names
  (base_model.model....q_proj.base_layer.weight, ...lora_A.default.weight) and rank 0 writes
  lora_train_meta.json. `--lora-only`: checkpoint.save_lora_only (only the LoRA tensors saved).
  Rank 0 rebuilds the trained PEFT model outside FSDP (the same LoraConfig, the gathered full
  state dict loaded into it) and writes OUT_DIR/../peft-reference-<name>/ with PEFT's own
  save_pretrained, OUT_DIR/../logits-<name>.safetensors (its logits on a fixed input: the trained
  PEFT model's forward) and OUT_DIR/../base-reference-<name>.safetensors (PEFT's unload(): the
  base model under its HF names).

The model is trained one AdamW step (LambdaLR scheduler, as verl's), then every rank calls
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
`--no-merge` skips it (verl's merger cannot merge a LoRA-only checkpoint, and the tests that have
other references skip it for time).
The last stdout line is a JSON list of the files under OUT_DIR (relative paths).
"""
import argparse
import json
import os
import shlex

from ranks import RANK_ENV, TIMEOUT, files_under, spawn


def _import_verl():
    """verl's real checkpoint, merger and FSDP-engine helper modules, imported without Ray or tensordict:
    - verl/__init__.py imports verl.protocol (DataProto: ray, tensordict), verl/utils/checkpoint/__init__.py
      the Ray CheckpointHandler (verl.single_controller and every training engine in verl.workers.engine),
      and verl/workers/__init__.py and verl/workers/engine/__init__.py the engines themselves; the save,
      the merge and the wrapping helpers use none of them, so these packages are registered by path
      (their submodules import as usual) without running their __init__.
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
    for name in ("verl", "verl.utils.checkpoint", "verl.workers", "verl.workers.engine",
                 "verl.workers.engine.fsdp"):
        if name not in sys.modules:
            spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
            spec.submodule_search_locations = list(importlib.util.find_spec(name).submodule_search_locations)
            sys.modules[name] = importlib.util.module_from_spec(spec)
    from verl.model_merger.base_model_merger import ModelMergerConfig
    from verl.model_merger.fsdp_model_merger import FSDPModelMerger
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
    return FSDPCheckpointManager, ModelMergerConfig, FSDPModelMerger


def _wrap(model, mesh, strategy, lora):
    """The model wrapped as verl's FSDP engine wraps it (_build_fsdp_module), on CPU."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from verl.utils.fsdp_utils import apply_fsdp2, get_fsdp_wrap_policy
    from verl.workers.engine.fsdp.utils import get_sharding_strategy

    if strategy == "fsdp2":
        apply_fsdp2(model, {"mesh": mesh}, {})
        return model
    return FSDP(model, auto_wrap_policy=get_fsdp_wrap_policy(module=model, config=None, is_lora=lora > 0),
                sharding_strategy=get_sharding_strategy(mesh) if mesh is not None else None,
                process_group=None if mesh is not None else dist.group.WORLD,
                sync_module_states=False,  # CPU: torch refuses True; every rank is seeded alike instead
                device_id=torch.device("cpu"),  # verl passes its accelerator's id: here the CPU
                device_mesh=mesh, use_orig_params=False)


def _peft_config(lora):
    """verl's _build_lora_module's LoraConfig (target_parameters and exclude_modules unset: None)."""
    from peft import LoraConfig, TaskType

    return LoraConfig(task_type=TaskType.CAUSAL_LM, r=lora, lora_alpha=2 * lora, target_modules="all-linear",
                      bias="none")


def _peft_references(cfg, dtype, lora, full, ids, parent, name):
    """Rank 0: the trained PEFT model rebuilt outside FSDP (the full state dict loaded into a fresh
    get_peft_model of the same config), saved the ways PEFT saves it: save_pretrained (the adapter),
    its logits on `ids`, merge_and_unload()'s merged model, and unload()'s base model."""
    import torch
    from peft import get_peft_model
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    model = get_peft_model(LlamaForCausalLM(cfg).to(getattr(torch, dtype)), _peft_config(lora))
    missing, unexpected = model.load_state_dict(full, strict=False)
    lora_keys = [k for k in missing if "lora_" in k]
    assert not unexpected and not lora_keys, (unexpected, lora_keys)
    model.eval()
    model.save_pretrained(os.path.join(parent, f"peft-reference-{name}"))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    save_file({"logits": logits.contiguous(), "input_ids": ids.contiguous()},
              os.path.join(parent, f"logits-{name}.safetensors"))
    if any(".base_layer." in k for k in full):  # save_lora_only stores no base weight to merge
        merged = get_peft_model(LlamaForCausalLM(cfg).to(getattr(torch, dtype)), _peft_config(lora))
        merged.load_state_dict(full, strict=False)
        save_file({k: v.clone().contiguous() for k, v in merged.merge_and_unload().state_dict().items()},
                  os.path.join(parent, f"merged-reference-{name}.safetensors"))
    base = model.unload()
    save_file({k: v.clone().contiguous() for k, v in base.state_dict().items()},
              os.path.join(parent, f"base-reference-{name}.safetensors"))


def save_case(rank, world, c):
    """One checkpoint: case `c` (argparse's namespace: out_dir, ref, dtype, tied, strategy, hsdp,
    no_mesh, lora, lora_only) built, trained one step and saved by every rank."""
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    FSDPCheckpointManager = _import_verl()[0]
    cfg = LlamaConfig(vocab_size=130, hidden_size=64, intermediate_size=100, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=c.tied, dtype=c.dtype, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)  # every rank alike: stands in for sync_module_states (see the docstring)
    model = LlamaForCausalLM(cfg).to(getattr(torch, c.dtype))
    if c.lora:
        from peft import get_peft_model

        model.enable_input_require_grads()
        model = get_peft_model(model, _peft_config(c.lora))
    # verl's create_device_mesh's shapes and names (it asks for the accelerator's device type).
    mesh = None
    if not c.no_mesh:
        mesh = (init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("ddp", "fsdp")) if c.hsdp
                else init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",)))
    model = _wrap(model, mesh, c.strategy, c.lora)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
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

    ckpt_cfg = OmegaConf.create({"save_contents": ["model", "optimizer", "extra"],
                                 "load_contents": ["model", "optimizer", "extra"],
                                 "save_lora_only": c.lora_only})
    mgr = FSDPCheckpointManager(model=model, optimizer=opt, lr_scheduler=sched, processing_class=tokenizer,
                                checkpoint_config=ckpt_cfg)
    mgr.save_checkpoint(local_path=os.path.join(c.out_dir, "global_step_1", "actor"), global_step=1)

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        with open(os.path.join(c.out_dir, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("1")  # what verl's RayPPOTrainer._save_checkpoint writes after the save
        save_file({k: v.clone().contiguous() for k, v in full.items()}, c.ref)  # tied: two clones
        if c.lora:
            parent, name = os.path.split(c.out_dir)
            _peft_references(cfg, c.dtype, c.lora, full, ids, parent, name)
    dist.barrier()


def worker(rank, world, init_file, cases):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=TIMEOUT)
    try:
        for c in cases:
            save_case(rank, world, c)
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


def case_parser(with_out_dir=True):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    if with_out_dir:
        ap.add_argument("out_dir")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--tied", action="store_true", help="tie the embedding and the LM head")
    ap.add_argument("--strategy", default="fsdp2", choices=["fsdp2", "fsdp"], help="verl's actor strategy")
    ap.add_argument("--hsdp", action="store_true", help="a 2-D ('ddp', 'fsdp') mesh of (ranks/2, 2)")
    ap.add_argument("--no-mesh", action="store_true", help="FSDP1 without a device mesh (ShardedTensors)")
    ap.add_argument("--lora", type=int, default=0, metavar="R", help="LoRA of rank R (peft, all-linear)")
    ap.add_argument("--lora-only", action="store_true", help="checkpoint.save_lora_only")
    return ap


def main():
    ap = case_parser()
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--no-merge", action="store_true", help="skip verl's model merger")
    ap.add_argument("--case", action="append", default=[], metavar="OUT_DIR:FLAGS",
                    help="another checkpoint saved by the same ranks (one start-up for all): its "
                         "directory and its own flags (--strategy, --hsdp, --lora, ...), e.g. "
                         "'x/lora:--strategy fsdp --lora 8'")
    a = ap.parse_args()
    cases = [a]
    for spec in a.case:
        out, _, flags = spec.partition(":")
        cases.append(case_parser().parse_args([out, *shlex.split(flags)]))
    for c in cases:
        if c.hsdp and (a.ranks < 4 or a.ranks % 2):
            ap.error("--hsdp needs an even --ranks of at least 4")
        if c.no_mesh and (c.strategy != "fsdp" or c.hsdp):
            ap.error("--no-mesh is FSDP1's (--strategy fsdp), without --hsdp")
        if c.lora_only and not c.lora:
            ap.error("--lora-only needs --lora R")
        c.out_dir = os.path.abspath(c.out_dir)
        os.makedirs(c.out_dir, exist_ok=True)
        parent, name = os.path.split(c.out_dir)
        c.ref = os.path.join(parent, f"reference-{name}.safetensors")
    spawn(worker, a.ranks, "verl-save-",
          lambda scratch: (a.ranks, os.path.join(scratch, "rdzv"), [argparse.Namespace(**vars(c)) for c in cases]))
    os.environ.update(RANK_ENV)  # the merger too: CPU, no Hugging Face network access
    for c in cases:
        # A LoRA run's merger output is not checked here: verl's merger writes the base weights
        # with the adapter merged in (and the adapter beside them), which is not the base-model
        # reference this check compares with; the LoRA tests compare the mount with PEFT instead.
        if not a.no_merge and not c.lora:
            parent, name = os.path.split(c.out_dir)
            merge_and_check(os.path.join(c.out_dir, "global_step_1", "actor"),
                            os.path.join(parent, f"merged-{name}"), c.ref)
    print(json.dumps(files_under(a.out_dir) if len(cases) == 1
                     else {c.out_dir: files_under(c.out_dir) for c in cases}))


if __name__ == "__main__":
    main()
