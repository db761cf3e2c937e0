#!/usr/bin/env python3
"""Save a tiny FSDP2-sharded HF Llama with NeMo AutoModel's own Checkpointer (CPU, gloo).

    PYTHONPATH=/tmp/fw/site python nemo_consolidated_save.py OUT_DIR [--ranks 2] [--seed 0]

What runs is the real NeMo code path a training recipe takes for a plain HF model
(nemo_automodel/recipes/base_recipe.py: save_checkpoint -> Checkpointer.save_model):
CheckpointingConfig(model_save_format="safetensors", save_consolidated=True).build(...)
.save_model(model, OUT_DIR, tokenizer=tok). OUT_DIR plays the recipe's
checkpoint_dir/epoch_E_step_S (only the model part is saved: no optim/, losses.json, config.yaml).
save_model writes, under OUT_DIR/model/:
  .hf_metadata/ (config, generation_config, tokenizer, fqn_to_file_index_mapping.json),
  consolidate.sh, one shard-0000R-model-00001-of-00001.safetensors per rank (NeMo's backported
  _HuggingFaceStorageWriter; DCP_SHARDING_INFO in the header), then consolidated/ (model-*.safetensors
  + model.safetensors.index.json + copies of the .hf_metadata files except the mapping), built on all
  ranks by NeMo's backported consolidate_safetensors_files_on_every_rank.
Then rank 0 writes OUT_DIR/reference.safetensors (the full, unsharded state dict).
The last stdout line is a JSON list of every file under OUT_DIR (relative paths).

Needs (beyond the ckptfs venv: torch 2.15, transformers 5.23, safetensors 0.8, tokenizers 0.23):
  nemo_automodel==0.7.0 (installed --no-deps in /tmp/fw/site; nothing else was needed)
No CUDA-only call is reached on this path with torch 2.15 on CPU, so nothing is monkeypatched; GPUs are
hidden (CUDA_VISIBLE_DEVICES="") so that torch.cuda.is_available() is False as on a CPU-only host (NeMo's
DCP writer would otherwise pick its CUDA-stream _OverlappingCpuLoader).
"""
import argparse
import json
import os
import sys

from ranks import TIMEOUT, files_under, spawn


def tiny_tokenizer():
    """A 128-entry word-level tokenizer built in memory (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(125)])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def worker(rank, world, init_file, out_dir, seed):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=TIMEOUT)
    try:
        from safetensors.torch import save_file
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from transformers import LlamaConfig, LlamaForCausalLM

        from nemo_automodel.components.checkpoint.config import CheckpointingConfig

        # Same weights on every rank (seeded), float32, untied head so every tensor is saved.
        cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                          tie_word_embeddings=False, dtype="float32", architectures=["LlamaForCausalLM"])
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg).to(torch.float32)

        # FSDP2 as NeMo's recipes apply it: per decoder layer, then the root. ModelState.state_dict()
        # (get_model_state_dict, default options) then yields DTensors sharded on dim 0, so each rank's
        # shard file holds its row block with DCP_SHARDING_INFO saved_offsets.
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)

        # model_repo_id names no cached snapshot (offline) -> NeMo uses its size-based file mapping
        # (one consolidated file here) and writes the repo id into consolidate.sh.
        ckpt_cfg = CheckpointingConfig(checkpoint_dir=out_dir, model_save_format="safetensors",
                                       save_consolidated=True, model_repo_id="ckptfs/tiny-llama",
                                       model_cache_dir=os.path.join(os.path.dirname(init_file), "hf-cache"),
                                       consolidation_timeout_minutes=2)
        checkpointer = ckpt_cfg.build(dp_rank=rank, tp_rank=0, pp_rank=0)
        checkpointer.save_model(model, out_dir, tokenizer=tiny_tokenizer())

        # The full state dict (collective; rank 0 receives it).
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            save_file({k: v.contiguous() for k, v in full.items()}, os.path.join(out_dir, "reference.safetensors"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    out_dir = os.path.abspath(a.out_dir)
    os.makedirs(out_dir, exist_ok=True)

    spawn(worker, a.ranks, "nemo-save-", lambda scratch: (a.ranks, os.path.join(scratch, "rdzv"), out_dir, a.seed))
    print(json.dumps(files_under(out_dir)))


if __name__ == "__main__":
    sys.exit(main())
