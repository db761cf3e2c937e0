#!/usr/bin/env python3
"""The write half of the demo: save_pretrained INTO the mount, as a training job whose
output_dir is the mount would, then show what SRC holds and that it reads back exactly.

1. loads the model from the reference checkpoint;
2. save_pretrained into MNT/<step> (2 files + index) and, for comparison, into a plain directory;
3. lists SRC/<step>: rank shards (DCP layout, DCP_SHARDING_INFO), no model-*.safetensors;
4. compares every file of the mount with the plain save, byte for byte;
5. from_pretrained from the mount: same weights as the model saved.
Exits non-zero on any difference.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import struct
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reference", required=True, help="a save_pretrained checkpoint to load")
    ap.add_argument("--out", required=True, help="where to save, inside the mount")
    ap.add_argument("--src", required=True, help="the same directory in SRC")
    ap.add_argument("--plain", required=True, help="a plain directory for the comparison save")
    ap.add_argument("--status", help="the mount's .ckptfs/status.json: wait for its splits after close")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.reference, torch_dtype=torch.bfloat16)
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    shard = f"{max(total // 2 + 1, 1) // 1000}KB"
    for d in (args.out, args.plain):
        shutil.rmtree(d, ignore_errors=True)
    # The first save_pretrained of a process pays for lazy imports and first-touch costs: an
    # untimed one into a scratch directory first, so that neither timed save carries them.
    model.save_pretrained(args.plain + ".warmup", max_shard_size=shard)
    shutil.rmtree(args.plain + ".warmup")
    t0 = time.perf_counter()
    model.save_pretrained(args.out, max_shard_size=shard)
    t_mount = time.perf_counter() - t0
    t0 = time.perf_counter()
    model.save_pretrained(args.plain, max_shard_size=shard)
    t_plain = time.perf_counter() - t0
    print(f"save_pretrained ({total / 1e6:.0f} MB, max_shard_size={shard}): "
          f"{t_mount:.2f} s into the mount, {t_plain:.2f} s into a plain directory")
    if args.status:
        # Each file was stored at close as its own one shard; its split into the mount's rank
        # shards runs after close (status.json's writes.splits_pending counts what is left).
        t0 = time.perf_counter()
        while True:
            with open(args.status) as f:
                if json.load(f)["writes"].get("splits_pending", 0) == 0:
                    break
            if time.perf_counter() - t0 > 120:
                print("FAIL: the splits after close did not finish in 120 s")
                return 1
            time.sleep(0.01)
        print(f"split into rank shards after close: done {time.perf_counter() - t0:.2f} s after "
              "save_pretrained returned")

    print(f"\nwhat SRC holds ({args.src}):")
    for name in sorted(os.listdir(args.src)):
        path = os.path.join(args.src, name)
        if os.path.isdir(path):
            print(f"  {'':>12}    {name}/   (ckptfs commit records)")
            continue
        note = ""
        if name.startswith("shard-"):
            with open(path, "rb") as f:
                n = struct.unpack("<Q", f.read(8))[0]
                meta = json.loads(f.read(n)).get("__metadata__", {})
            note = "   DCP_SHARDING_INFO" if "DCP_SHARDING_INFO" in meta else "   (no sharding info!)"
        print(f"  {os.path.getsize(path):12d} B  {name}{note}")
    real = [n for n in os.listdir(args.src) if n.startswith("model") and n.endswith(".safetensors")]
    if real:
        print(f"FAIL: SRC holds consolidated files: {real}")
        return 1

    names = sorted(os.listdir(args.plain))
    if sorted(os.listdir(args.out)) != names:
        print(f"FAIL: the mount lists {sorted(os.listdir(args.out))}, the plain save {names}")
        return 1
    _, mismatch, errors = filecmp.cmpfiles(args.out, args.plain, names, shallow=False)
    if mismatch or errors:
        print(f"FAIL: differ from the plain save: {mismatch + errors}")
        return 1
    print(f"\nall {len(names)} files read back through the mount byte for byte equal to the plain save")

    again = AutoModelForCausalLM.from_pretrained(args.out, torch_dtype=torch.bfloat16)
    want = model.state_dict()
    bad = [k for k, v in again.state_dict().items() if not torch.equal(v, want[k])]
    if bad:
        print(f"FAIL: from_pretrained of the mount differs in {bad[:5]}")
        return 1
    print(f"from_pretrained({args.out}): all {len(want)} tensors equal the saved model")
    return 0


if __name__ == "__main__":
    sys.exit(main())
