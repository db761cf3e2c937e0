"""Runs a writer script's ranks: mp.spawn on CPU + gloo with no Hugging Face network access, a
scratch directory kept out of the output, and the list of files the save left."""
import os
import shutil
import sys
import tempfile
from datetime import timedelta

# Environment of the rank processes only (set around the spawn, so importing a writer changes nothing):
# CPU + gloo even on a GPU host, and no Hugging Face network access.
RANK_ENV = {"CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
TIMEOUT = timedelta(seconds=90)  # every collective; a hung rank fails the run instead of blocking it


def spawn(worker, nprocs, prefix, args):
    """mp.spawn(worker, args=args(scratch)) under RANK_ENV; scratch (a rendezvous file's home,
    removed after) is a fresh directory outside the output.

    A rank killed by SIGABRT is run again, once, with all the others and a fresh rendezvous: on a
    loaded 2-core machine torch's gloo ranks have died that way ("terminate called without an
    active exception", a C++ thread torn down at exit; seen once in the ASan tier's
    test_torchtitan_native_checkpoint). An exception in a rank, any other signal, or a second
    SIGABRT fails the run as before; the tests check what was written either way."""
    import torch.multiprocessing as mp

    saved = {k: os.environ.get(k) for k in RANK_ENV}
    os.environ.update(RANK_ENV)
    try:
        for attempt in (1, 2):
            scratch = tempfile.mkdtemp(prefix=prefix)
            try:
                mp.spawn(worker, args=args(scratch), nprocs=nprocs, join=True)
                return
            except mp.ProcessExitedException as e:
                if attempt == 2 or e.signal_name != "SIGABRT":
                    raise
                print(f"ranks: {e}; running the ranks again, once", file=sys.stderr, flush=True)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def files_under(out_dir):
    """Every file under out_dir, as sorted relative paths (the writer scripts print it last, as JSON)."""
    return sorted(os.path.relpath(os.path.join(d, f), out_dir) for d, _, fs in os.walk(out_dir) for f in fs)
