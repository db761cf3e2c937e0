#!/usr/bin/env python3
"""Generate a REAL rank-sharded checkpoint (PyTorch DCP + HuggingFace safetensors) and its
consolidated reference, for ckptfs tests, benchmarks and the demo.

Synopsis:
  gen_checkpoint.py OUT [--reference DIR] [--layout fsdp|tp|fsdp_tp] [--world N] [--tp T]
                        [--nemo] [--files K] [--layers L] [--hidden H] [--intermediate I]
                        [--heads A] [--kv-heads G] [--vocab V] [--tie|--no-tie]
                        [--dtype bf16|f32] [--seed S]

Steps:
 1. Build a small LlamaForCausalLM from a LlamaConfig (never touches the HF hub) and fill every
    parameter from a torch.Generator seeded with --seed, so equal options give equal bytes.
 2. save_pretrained() it into the reference dir (default: OUT/../reference-<basename OUT>).
    --files K picks the smallest max_shard_size for which huggingface_hub's greedy split (the one
    save_pretrained uses) yields at most K files; that is exactly K files whenever the model has
    at least K tensors (K=1 gives a single model.safetensors, no index).
 3. Spawn --world gloo processes on CPU. Each rank wraps the reference tensors in DTensors
    (DeviceMesh on "cpu", distribute_tensor) with the placements of --layout:
      fsdp     1-D mesh (N): every tensor Shard(0);
      tp       1-D mesh (N): the model's tp_plan: colwise* -> Shard(0) (bias too),
               rowwise* -> Shard(1) (bias Replicate), embedding_rowwise -> Shard(0),
               embedding_colwise -> Shard(1), anything else Replicate;
      fsdp_tp  2-D mesh (dp=N/T, tp=T): (Shard(0), <tp placement>).
    and calls dcp.save(state_dict, storage_writer=HuggingFaceStorageWriter(shard_dir,
    fqn_to_index_mapping, save_distributed=True)). The state dict keys are exactly the
    reference's weight_map keys (a tied lm_head is dropped as save_pretrained does).
 4. Plain layout: shards + config.json + generation_config.json in OUT.
    --nemo (NeMo AutoModel): shards in OUT/model/, one file per rank
    (fqn_to_index_mapping=None), and OUT/model/.hf_metadata/ with config.json,
    generation_config.json and fqn_to_file_index_mapping.json ({fqn: k}, sorted keys as NeMo
    writes it, which is also the weight_map order in the index).
 5. Print a one-line JSON summary on stdout; logs go to stderr.

Python use: generate(out_dir, reference_dir=None, **options) -> summary dict (option names as
in DEFAULTS below). The ranks are started with the "spawn" method, so a calling script needs the
usual `if __name__ == "__main__":` guard (pytest is fine). Only the standard library is imported
at module level so that spawned ranks start fast (they never import transformers). Each rank
reads the full reference tensors, so peak memory is about (world + 2) x the model size.

Determinism: equal options give byte-identical reference files and identical shard contents
(tensors, DCP_SHARDING_INFO); only the order of the keys inside a shard's __metadata__ varies
from run to run (safetensors serialises that map from a Rust HashMap).
"""
import argparse
import glob
import json
import os
import shutil
import socket
import sys
import time

LAYOUTS = ("fsdp", "tp", "fsdp_tp")
DEFAULTS = dict(layout="fsdp", world=2, tp=2, nemo=False, files=2, layers=2, hidden=64,
                intermediate=128, heads=4, kv_heads=2, vocab=256, tie=False, dtype="bf16",
                seed=0)


def log(msg):
    print(f"[gen_checkpoint] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- model + reference

def build_model(opts):
    """A LlamaForCausalLM with deterministic random weights (in opts['dtype'])."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[opts["dtype"]]
    config = LlamaConfig(
        num_hidden_layers=opts["layers"], hidden_size=opts["hidden"],
        intermediate_size=opts["intermediate"], num_attention_heads=opts["heads"],
        num_key_value_heads=opts["kv_heads"], vocab_size=opts["vocab"],
        tie_word_embeddings=opts["tie"], max_position_embeddings=128)
    torch.manual_seed(opts["seed"])
    model = LlamaForCausalLM(config)
    # Overwrite the default init (norms are all ones there) so that every tensor, and every
    # chunk of it, has distinctive values: a misplaced chunk must show in a comparison.
    gen = torch.Generator().manual_seed(opts["seed"])
    with torch.no_grad():
        for _, p in model.named_parameters():  # a tied lm_head is listed once
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if p.ndim == 1 else 0.02 * noise)
    model.to(dtype)
    model.config.dtype = dtype
    return model


def saved_state_dict(model):
    """model.state_dict() minus the tied copies that save_pretrained drops."""
    tied = set(getattr(model, "all_tied_weights_keys", None) or {}) if model.config.tie_word_embeddings else set()
    return {k: v for k, v in model.state_dict().items() if k not in tied}


def pick_max_shard_size(state_dict, files):
    """Smallest max_shard_size (bytes) for which save_pretrained's split gives <= `files` files.

    huggingface_hub's split is next-fit bin packing, whose file count never grows when the
    capacity grows, so a binary search works."""
    from huggingface_hub import split_torch_state_dict_into_shards

    total = sum(t.numel() * t.element_size() for t in state_dict.values())
    if files <= 1:
        return total

    def count(size):
        return len(split_torch_state_dict_into_shards(state_dict, max_shard_size=size).filename_to_tensors)

    lo, hi = 1, total
    while lo < hi:
        mid = (lo + hi) // 2
        if count(mid) <= files:
            hi = mid
        else:
            lo = mid + 1
    return lo


def write_reference(model, ref_dir, files):
    """save_pretrained into ref_dir; returns the weight_map {fqn: file name} in file order."""
    from safetensors import safe_open

    os.makedirs(ref_dir, exist_ok=True)
    # save_pretrained removes stale numbered shards itself, but not a stale single file / index.
    for stale in glob.glob(os.path.join(ref_dir, "model*.safetensors*")):
        os.remove(stale)
    sd = saved_state_dict(model)
    max_size = pick_max_shard_size(sd, files)
    model.save_pretrained(ref_dir, max_shard_size=max_size)
    index = os.path.join(ref_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
    else:
        with safe_open(os.path.join(ref_dir, "model.safetensors"), "pt") as f:
            weight_map = {k: "model.safetensors" for k in f.keys()}
    if set(weight_map) != set(sd):
        raise RuntimeError(f"save_pretrained keys differ from the state dict: "
                           f"{sorted(set(weight_map) ^ set(sd))}")
    nfiles = len(set(weight_map.values()))
    log(f"reference: {len(weight_map)} tensors in {nfiles} file(s), max_shard_size={max_size} B -> {ref_dir}")
    return weight_map


def file_index(file_name):
    """model-0000k-of-0000m.safetensors -> k; model.safetensors -> 1."""
    return 1 if file_name == "model.safetensors" else int(file_name.split("-")[1])


# ----------------------------------------------------------------------------- placements

def tp_style_placement(style, param_name):
    """A transformers 5.x TP style -> ('S', dim) or ('R',) for one parameter (torch-free)."""
    style = style or ""
    if style.startswith("colwise"):  # colwise, colwise_rep, colwise_gather_output
        return ("S", 0)
    if style.startswith("rowwise"):  # rowwise, rowwise_rep, rowwise_split_input
        return ("R",) if param_name == "bias" else ("S", 1)
    if style == "embedding_rowwise":
        return ("S", 0)
    if style == "embedding_colwise":
        return ("S", 1)
    return ("R",)  # norms, packed_*/MoE styles (not modelled), unplanned modules


def plan_placements(model, keys, layout):
    """{fqn: [placement per mesh dim]}, each placement ('S', dim) or ('R',)."""
    import re

    # model.tp_plan (5.x) is the full-model plan: base_model_tp_plan prefixed with "model."
    # plus the head's own _tp_plan (lm_head colwise_gather_output, embed_tokens embedding_rowwise).
    plan = dict(getattr(model, "tp_plan", None) or {})
    if not plan:
        prefix = model.base_model_prefix
        plan = {f"{prefix}.{k}": v for k, v in (model.config.base_model_tp_plan or {}).items()}
        plan.update(getattr(model, "_tp_plan", None) or {})
    patterns = [(re.compile(re.escape(k).replace(r"\*", r"\d+")), v) for k, v in plan.items()]

    out = {}
    for fqn in keys:
        module, _, param = fqn.rpartition(".")
        style = next((v for rx, v in patterns if rx.fullmatch(module)), None)
        tp = tp_style_placement(style, param)
        out[fqn] = {"fsdp": [("S", 0)], "tp": [tp], "fsdp_tp": [("S", 0), tp]}[layout]
    return out


# ----------------------------------------------------------------------------- ranks

def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, job):
    """One training rank: build DTensors from the reference files and dcp.save them."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=job["init_method"], rank=rank,
                            world_size=job["world"])
    try:
        mesh = init_device_mesh("cpu", tuple(job["mesh_shape"]), mesh_dim_names=tuple(job["mesh_names"]))
        by_file = {}
        for fqn in job["keys"]:
            by_file.setdefault(job["weight_map"][fqn], []).append(fqn)
        loaded = {}
        for fname, fqns in by_file.items():
            with safe_open(os.path.join(job["reference_dir"], fname), "pt") as f:
                for fqn in fqns:
                    loaded[fqn] = f.get_tensor(fqn)
        state = {}
        for fqn in job["keys"]:  # model (module) order, as a training state dict has it
            placements = [Shard(p[1]) if p[0] == "S" else Replicate() for p in job["placements"][fqn]]
            # Every rank holds the full tensor, so no scatter is needed (src_data_rank=None):
            # each rank just keeps its own chunk, exactly as a scatter from rank 0 would give.
            state[fqn] = distribute_tensor(loaded[fqn], mesh, placements, src_data_rank=None)
        del loaded
        writer = HuggingFaceStorageWriter(job["shard_dir"], fqn_to_index_mapping=job["mapping"],
                                          save_distributed=True)
        dcp.save(state, storage_writer=writer)
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- entry points

def generate(out_dir, reference_dir=None, **options):
    """Build, save the reference, shard with DCP; returns the summary dict (see module doc)."""
    unknown = set(options) - set(DEFAULTS)
    if unknown:
        raise TypeError(f"unknown options: {sorted(unknown)}")
    opts = {**DEFAULTS, **options}
    layout, world = opts["layout"], opts["world"]
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}")
    if world < 1:
        raise ValueError("world must be >= 1")
    if layout == "fsdp_tp":
        if opts["tp"] < 1 or world % opts["tp"]:
            raise ValueError(f"fsdp_tp needs world ({world}) divisible by tp ({opts['tp']})")
        mesh_shape, mesh_names = [world // opts["tp"], opts["tp"]], ["dp", "tp"]
    else:
        mesh_shape, mesh_names = [world], ["dp" if layout == "fsdp" else "tp"]

    t0 = time.time()
    out_dir = os.path.abspath(out_dir)
    if reference_dir is None:
        reference_dir = os.path.join(os.path.dirname(out_dir), "reference-" + os.path.basename(out_dir))
    reference_dir = os.path.abspath(reference_dir)

    import torch.multiprocessing as mp

    model = build_model(opts)
    weight_map = write_reference(model, reference_dir, opts["files"])
    keys = [k for k in saved_state_dict(model) if k in weight_map]  # module order
    placements = plan_placements(model, keys, layout)
    total_bytes = sum(t.numel() * t.element_size() for t in saved_state_dict(model).values())
    mapping = {fqn: file_index(name) for fqn, name in weight_map.items()}  # weight_map order
    del model

    shard_dir = os.path.join(out_dir, "model") if opts["nemo"] else out_dir
    os.makedirs(shard_dir, exist_ok=True)
    for stale in glob.glob(os.path.join(shard_dir, "shard-*.safetensors")):
        os.remove(stale)
    meta_dir = os.path.join(shard_dir, ".hf_metadata") if opts["nemo"] else out_dir
    os.makedirs(meta_dir, exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        src = os.path.join(reference_dir, name)
        if os.path.exists(src):
            shutil.copyfile(src, os.path.join(meta_dir, name))
    if opts["nemo"]:
        # NeMo AutoModel: json.dump(mapping, f, indent=2, sort_keys=True)
        with open(os.path.join(meta_dir, "fqn_to_file_index_mapping.json"), "w") as f:
            json.dump(mapping, f, indent=2, sort_keys=True)

    job = dict(init_method=f"tcp://127.0.0.1:{_free_port()}", world=world, mesh_shape=mesh_shape,
               mesh_names=mesh_names, keys=keys, weight_map=weight_map, placements=placements,
               reference_dir=reference_dir, shard_dir=shard_dir,
               mapping=None if opts["nemo"] else mapping)
    log(f"saving layout={layout} mesh={dict(zip(mesh_names, mesh_shape))} nemo={opts['nemo']} -> {shard_dir}")
    t1 = time.time()
    mp.spawn(_worker, args=(job,), nprocs=world, join=True)
    shard_files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(shard_dir, "shard-*.safetensors")))
    log(f"{len(shard_files)} shard files in {time.time() - t1:.1f}s (ranks), {time.time() - t0:.1f}s total")

    return dict(layout=layout, world=world, mesh=dict(zip(mesh_names, mesh_shape)),
                nemo=opts["nemo"], tie=opts["tie"], dtype=opts["dtype"], seed=opts["seed"],
                tensors=len(weight_map), reference_files=len(set(weight_map.values())),
                shard_files=len(shard_files), total_bytes=total_bytes, out_dir=out_dir,
                shard_dir=shard_dir, reference_dir=reference_dir,
                seconds=round(time.time() - t0, 2))


def parse_args(argv=None):
    d = DEFAULTS
    p = argparse.ArgumentParser(
        description="Generate a real DCP rank-sharded HF safetensors checkpoint of a small random "
                    "Llama model, plus its save_pretrained reference. Prints a JSON summary line.")
    p.add_argument("out", metavar="OUT", help="output dir (shards go here, or in OUT/model with --nemo)")
    p.add_argument("--reference", metavar="DIR",
                   help="reference (save_pretrained) dir; default OUT/../reference-<basename OUT>")
    p.add_argument("--layout", choices=LAYOUTS, default=d["layout"],
                   help="fsdp: Shard(0) everywhere; tp: the model's tp_plan; fsdp_tp: 2-D (dp, tp) mesh "
                        "(default %(default)s)")
    p.add_argument("--world", type=int, default=d["world"], help="number of ranks (default %(default)s)")
    p.add_argument("--tp", type=int, default=d["tp"], help="tp size for fsdp_tp (default %(default)s)")
    p.add_argument("--nemo", action="store_true",
                   help="NeMo AutoModel layout: OUT/model/shard-*-model-00001-of-00001 + .hf_metadata/")
    p.add_argument("--files", type=int, default=d["files"],
                   help="number of consolidated files the reference is split into (default %(default)s)")
    p.add_argument("--layers", type=int, default=d["layers"], help="default %(default)s")
    p.add_argument("--hidden", type=int, default=d["hidden"], help="default %(default)s")
    p.add_argument("--intermediate", type=int, default=d["intermediate"], help="default %(default)s")
    p.add_argument("--heads", type=int, default=d["heads"], help="attention heads (default %(default)s)")
    p.add_argument("--kv-heads", type=int, default=d["kv_heads"],
                   help="key/value heads, < heads for GQA (default %(default)s)")
    p.add_argument("--vocab", type=int, default=d["vocab"], help="default %(default)s")
    p.add_argument("--tie", action=argparse.BooleanOptionalAction, default=d["tie"],
                   help="tie lm_head to embed_tokens (default: untied)")
    p.add_argument("--dtype", choices=("bf16", "f32"), default=d["dtype"], help="default %(default)s")
    p.add_argument("--seed", type=int, default=d["seed"], help="default %(default)s")
    return p.parse_args(argv)


def main(argv=None):
    a = vars(parse_args(argv))
    out, ref = a.pop("out"), a.pop("reference")
    try:
        summary = generate(out, ref, **a)
    except ValueError as e:  # bad option combination: report it like argparse does
        sys.exit(f"gen_checkpoint.py: error: {e}")
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
