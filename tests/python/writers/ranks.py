"""Runs a writer script's ranks: mp.spawn on CPU + gloo with no Hugging Face network access, a
scratch directory kept out of the output, and the list of files the save left."""
import os
import shutil
import tempfile
from datetime import timedelta

# Environment of the rank processes only (set around the spawn, so importing a writer changes nothing):
# CPU + gloo even on a GPU host, and no Hugging Face network access.
RANK_ENV = {"CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
TIMEOUT = timedelta(seconds=90)  # every collective; a hung rank fails the run instead of blocking it


def spawn(worker, nprocs, prefix, args):
    """mp.spawn(worker, args=args(scratch)) under RANK_ENV; scratch (a rendezvous file's home,
    removed after) is a fresh directory outside the output."""
    import torch.multiprocessing as mp

    scratch = tempfile.mkdtemp(prefix=prefix)
    saved = {k: os.environ.get(k) for k in RANK_ENV}
    os.environ.update(RANK_ENV)
    try:
        mp.spawn(worker, args=args(scratch), nprocs=nprocs, join=True)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(scratch, ignore_errors=True)


def files_under(out_dir):
    """Every file under out_dir, as sorted relative paths (the writer scripts print it last, as JSON)."""
    return sorted(os.path.relpath(os.path.join(d, f), out_dir) for d, _, fs in os.walk(out_dir) for f in fs)
