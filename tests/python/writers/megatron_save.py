#!/usr/bin/env python3
"""Save a tiny Megatron-Core GPT with megatron-core's own dist_checkpointing.save (torch_dist
backend), tensor parallel 2 on 2 ranks (CPU, gloo).

    PYTHONPATH=<megatron-core 0.16.1> python megatron_save.py OUT_DIR [--tp 2] [--layers 3]

The layers are stacked (one global tensor per parameter kind, [layers, ...], chunked per layer
and TP rank), as Megatron saves them. megatron-core saves on CPU once torch.cuda.synchronize
and torch.cuda.current_device are stubbed in the saving process (../shared/notes/native.md);
nothing else is changed. OUT_DIR then holds .metadata, __R_k.distcp files, metadata.json and
common.pt. The last stdout line is a JSON list of the files under OUT_DIR.
"""
import argparse
import json
import os

from ranks import TIMEOUT, files_under, spawn


def worker(rank, world, init_file, out_dir, tp, layers):
    import torch
    import torch.distributed as dist

    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=TIMEOUT)
    try:
        from megatron.core import dist_checkpointing, parallel_state
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        from megatron.core.transformer.transformer_config import TransformerConfig

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        torch.manual_seed(0)
        try:
            model_parallel_cuda_manual_seed(0)
        except Exception:  # noqa: BLE001  (CUDA RNG tracker: not needed on CPU)
            pass
        cfg = TransformerConfig(num_layers=layers, hidden_size=64, num_attention_heads=4,
                                num_query_groups=2, ffn_hidden_size=128, use_cpu_initialization=True,
                                gated_linear_unit=True, add_bias_linear=False,
                                params_dtype=torch.float32)
        model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=256,
                         max_sequence_length=64, share_embeddings_and_output_weights=False)
        dist_checkpointing.save(model.sharded_state_dict(prefix=""), out_dir)
        dist.barrier()
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=3)
    a = ap.parse_args()
    out_dir = os.path.abspath(a.out_dir)
    os.makedirs(out_dir, exist_ok=True)
    spawn(worker, a.tp, "megatron-save-",
          lambda scratch: (a.tp, os.path.join(scratch, "rdzv"), out_dir, a.tp, a.layers))
    print(json.dumps(files_under(out_dir)))


if __name__ == "__main__":
    main()
