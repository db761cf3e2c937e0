#!/usr/bin/env python3
"""Time to a loaded model: ckptfs mount vs consolidating first vs a native consolidated copy.

A synthetic TinyLlama-shaped checkpoint (hidden 2048, intermediate 5632, 32 heads, 4 KV heads,
vocab 32000, bf16; the layer count is picked from --size) is written once as REAL torch DCP
rank shards by tools/gen_checkpoint.py (default fsdp_tp on 4 ranks), together with its
save_pretrained reference. For each storage (disk: --dir, tmpfs: --tmpfs) and cache state it
times, each variant in a fresh child process:

  (a) ckptfs   start `ckptfs mount SRC MNT -f` (default options), wait for the view, then
               from_pretrained(MNT/ckpt) in the child
  (b) torch    consolidate_safetensors_files(shards -> a new dir on the same storage) +
               from_pretrained of that dir, in the child
  (c) native   from_pretrained of the pre-consolidated copy (the save_pretrained output) on the
               same storage
  (d) loader   no mount: ckptfs_load.from_pretrained(SRC/ckpt) in the child (the model built on
               the meta device, filled in place by libckptfs_load from the rank shards; the
               library next to --bin)

"Loaded" means from_pretrained (for (d) ckptfs_load's) returned AND every parameter was read
once (a sum over it): transformers 5 keeps safetensors tensors memory-mapped, so
from_pretrained alone may not have touched the bytes. Every child imports torch/transformers and loads a tiny model first,
then reports READY; only after that are the caches dropped (cold) and the clock started, so
interpreter start-up is charged to no variant. The child also checks that the model it loaded
has the same checksum as the reference.

  cold  `sync; echo 3 > /proc/sys/vm/drop_caches` right before the clock starts. On tmpfs
        the backing files stay in RAM (that is where tmpfs keeps them); what is cold there is
        the FUSE mount's page cache, the consolidated copy of (b) and the parsed headers.
  warm  the timed run directly follows an untimed run of the same variant (backing files in
        the page cache). (a) still mounts afresh each run, so the mount's own page cache
        starts empty: the realistic "training just wrote the shards" case.
  hot   (--modes hot) like warm, but (a) keeps its mount: the timed load re-reads a
        checkpoint through a mount that already served it (its page cache is warm).

Peak RSS: the ckptfs daemon's VmHWM (read from /proc/<pid>/status before unmounting) and the
loading child's VmHWM (which counts resident file-backed mmap pages too, i.e. the model).

Usage (as root; needs a built build/src/ckptfs and the venv of tools/setup.sh):
  bench_load.py [--size GB] [--storage disk,tmpfs] [--modes cold,warm] [--repeat N]
                [--dir /var/tmp/ckptfs-bench-load] [--tmpfs /dev/shm/ckptfs-bench-load]
                [--layout fsdp_tp --world 4 --tp 2 --files 2] [--variants abcd] [--keep]
Prints a markdown table: absolute seconds (median of --repeat runs) and the ratios (a)/(b),
(a)/(c), (d)/(c). The machine is noisy: compare ratios within one run, not absolute figures
across runs.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GEN = os.path.join(ROOT, "tools", "gen_checkpoint.py")
ENV = dict(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_PROGRESS_BARS="1",
           TRANSFORMERS_VERBOSITY="error", PYTHONDONTWRITEBYTECODE="1")
os.environ.update(ENV)

HIDDEN, INTER, HEADS, KV_HEADS, VOCAB = 2048, 5632, 32, 4, 32000


def model_bytes(layers: int) -> int:
    head_dim = HIDDEN // HEADS
    per_layer = (2 * HIDDEN * HIDDEN + 2 * HIDDEN * KV_HEADS * head_dim  # q, o, k, v
                 + 3 * HIDDEN * INTER + 2 * HIDDEN)                       # mlp, 2 norms
    return 2 * (2 * VOCAB * HIDDEN + HIDDEN + layers * per_layer)          # bf16, untied head


def layers_for(size_gb: float) -> int:
    return max(1, round((size_gb * 1e9 - model_bytes(0)) / (model_bytes(1) - model_bytes(0))))


# ----------------------------------------------------------------------------- child (loader)

def child_main() -> int:
    """Loader child: import, warm up, READY, then one command from stdin, result on stdout."""
    import resource

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    tiny = sys.argv[sys.argv.index("--child") + 1]
    out = {}
    sys.path.insert(0, os.path.join(ROOT, "python"))
    import ckptfs_load

    def load(path, loader=False):
        if loader:
            m = ckptfs_load.from_pretrained(path)
        else:
            m = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
        out["returned_at"] = time.perf_counter()  # before the pass over the parameters
        s = 0.0
        with torch.no_grad():
            for p in m.parameters():
                s += float(p.float().sum()) if p.numel() < 4096 else float(p.sum(dtype=torch.float32))
        return m, s

    if not os.path.exists(os.path.join(tiny, "config.json")):
        cfg = LlamaConfig(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)
        LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tiny)
    m, _ = load(tiny)  # one-time costs (lazy imports, first from_pretrained) paid here
    m, _ = load(tiny, loader=True)  # and the library's
    del m
    print("READY", flush=True)
    cmd = json.loads(sys.stdin.readline())
    out.clear()
    t0 = time.perf_counter()
    if cmd["op"] == "consolidate_load":
        with open(cmd["mapping"]) as f:
            mapping = json.load(f)
        consolidate_safetensors_files(cmd["shards"], cmd["out"], mapping)
        for side in ("config.json", "generation_config.json"):
            src = os.path.join(cmd["side_dir"], side)
            if os.path.exists(src):
                shutil.copyfile(src, os.path.join(cmd["out"], side))
        out["cons_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        m, out["checksum"] = load(cmd["out"])
        out["load_s"] = time.perf_counter() - t1
    else:
        m, out["checksum"] = load(cmd["path"], loader=cmd["op"] == "loader")
        out["load_s"] = time.perf_counter() - t0
    out["total_s"] = time.perf_counter() - t0
    out["returned_s"] = out.pop("returned_at") - t0  # the load returned; the rest is the pass
    with open("/proc/self/status") as f:
        out["hwm_mb"] = next(int(x.split()[1]) for x in f if x.startswith("VmHWM:")) / 1024
    out["maxrss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(out), flush=True)
    return 0


# ----------------------------------------------------------------------------- parent

def log(msg):
    print(f"[bench_load] {msg}", file=sys.stderr, flush=True)


def drop_caches():
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def is_mounted(mnt: str) -> bool:
    with open("/proc/mounts") as f:
        return any(line.split()[1] == mnt for line in f)


def vm_hwm_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(x.split()[1]) for x in f if x.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        return None


class Child:
    def __init__(self, py, tiny):
        self.p = subprocess.Popen([py, os.path.abspath(__file__), "--child", tiny], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        line = self.p.stdout.readline()
        if line.strip() != "READY":
            self.p.kill()
            raise RuntimeError(f"loader child did not start: {line!r}")

    def run(self, cmd: dict) -> dict:
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        t_done = time.perf_counter()  # before the child's (slow) interpreter teardown
        rc = self.p.wait(timeout=600)
        if rc != 0 or not line.startswith("{"):
            raise RuntimeError(f"loader child failed ({rc}): {line!r}")
        r = json.loads(line)
        r["t_done"] = t_done
        return r


def unmount(mnt: str, daemon: subprocess.Popen):
    for _ in range(100):
        if not is_mounted(mnt):
            break
        if subprocess.run(["fusermount3", "-u", mnt], capture_output=True).returncode == 0:
            break
        time.sleep(0.1)
    if is_mounted(mnt):
        subprocess.run(["fusermount3", "-u", "-z", mnt], capture_output=True)
    try:
        daemon.wait(timeout=30)
    except subprocess.TimeoutExpired:
        daemon.kill()
        daemon.wait()


def start_mount(st: dict, a):
    """Starts `ckptfs mount -f` on st["src"] and waits until the view shows the index.
    Returns (daemon, log file, view path)."""
    mnt = st["mnt"]
    os.makedirs(mnt, exist_ok=True)
    logf = open(mnt + ".log", "w")
    daemon = subprocess.Popen([a.bin, "mount", st["src"], mnt, "-f", *a.mount_args],
                              stdout=logf, stderr=subprocess.STDOUT)
    view = os.path.join(mnt, "ckpt")
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(view, "model.safetensors.index.json")):
        if daemon.poll() is not None or time.monotonic() > deadline:
            unmount(mnt, daemon)
            logf.close()
            raise RuntimeError("ckptfs mount failed: " + open(mnt + ".log").read())
        time.sleep(0.005)
    return daemon, logf, view


def run_variant(v: str, st: dict, a, cold: bool, hot: bool = False) -> dict:
    child = Child(a.python, st["tiny"])
    if cold:
        drop_caches()
    if v == "a" and hot:
        # The mount stays up: an untimed load fills its page cache, then a fresh child
        # loads again through the same mount (re-loading a checkpoint that is mounted).
        daemon, logf, view = start_mount(st, a)
        try:
            child.run({"op": "load", "path": view})
            second = Child(a.python, st["tiny"])
            t0 = time.perf_counter()
            r = second.run({"op": "load", "path": view})
            r["total_s"] = r.pop("t_done") - t0
            r["mount_s"] = 0.0
            r["daemon_hwm_mb"] = vm_hwm_mb(daemon.pid)
        finally:
            unmount(st["mnt"], daemon)
            logf.close()
        return r
    if v == "a":
        t0 = time.perf_counter()
        daemon, logf, view = start_mount(st, a)
        try:
            t_mount = time.perf_counter() - t0
            r = child.run({"op": "load", "path": view})
            r["total_s"] = r.pop("t_done") - t0
            r["mount_s"] = t_mount
            r["daemon_hwm_mb"] = vm_hwm_mb(daemon.pid)
        finally:
            unmount(st["mnt"], daemon)
            logf.close()
        return r
    if v == "b":
        out = st["consolidated"]
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        try:
            t0 = time.perf_counter()
            r = child.run({"op": "consolidate_load", "shards": st["shards"], "out": out,
                           "mapping": st["mapping"], "side_dir": st["shards"]})
            r["total_s"] = r.pop("t_done") - t0
        finally:
            shutil.rmtree(out, ignore_errors=True)
        return r
    t0 = time.perf_counter()
    if v == "d":
        r = child.run({"op": "loader", "path": st["shards"]})
    else:
        r = child.run({"op": "load", "path": st["reference"]})
    r["total_s"] = r.pop("t_done") - t0
    return r


def ensure_checkpoint(a) -> dict:
    layers = layers_for(a.size)
    opts = ["--layout", a.layout, "--world", str(a.world), "--tp", str(a.tp), "--files", str(a.files),
            "--layers", str(layers), "--hidden", str(HIDDEN), "--intermediate", str(INTER),
            "--heads", str(HEADS), "--kv-heads", str(KV_HEADS), "--vocab", str(VOCAB),
            "--dtype", "bf16", "--seed", "0"]
    stamp = os.path.join(a.dir, "generated.json")
    src, ref = os.path.join(a.dir, "src"), os.path.join(a.dir, "reference")
    ck = os.path.join(src, "ckpt")
    try:
        with open(stamp) as f:
            info = json.load(f)
        if info["opts"] == opts and os.path.isdir(ck) and os.path.isdir(ref):
            log(f"reusing {ck} ({info['summary']['total_bytes'] / 1e9:.2f} GB)")
            return info
    except (OSError, ValueError, KeyError):
        pass
    shutil.rmtree(a.dir, ignore_errors=True)
    os.makedirs(src)
    log(f"generating ~{model_bytes(layers) / 1e9:.2f} GB ({layers} layers) with gen_checkpoint.py "
        f"{' '.join(opts)} (peak memory about (world + 2) x the model)")
    t0 = time.perf_counter()
    r = subprocess.run([a.python, GEN, ck, "--reference", ref, *opts], stdout=subprocess.PIPE, text=True,
                       check=True)
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    # The writer's fqn_to_index_mapping, in its order (the index weight_map order), for torch.
    with open(os.path.join(ref, "model.safetensors.index.json")) as f:
        wm = json.load(f)["weight_map"]
    mapping = {k: int(v.split("-")[1]) for k, v in wm.items()}
    with open(os.path.join(a.dir, "mapping.json"), "w") as f:
        json.dump(mapping, f)
    info = dict(opts=opts, layers=layers, summary=summary, gen_seconds=round(time.perf_counter() - t0, 1))
    with open(stamp, "w") as f:
        json.dump(info, f)
    return info


def storage_paths(base: str, a) -> dict:
    return dict(src=os.path.join(base, "src"), shards=os.path.join(base, "src", "ckpt"),
                reference=os.path.join(base, "reference"), consolidated=os.path.join(base, "consolidated"),
                mnt=os.path.join(base, "mnt"), mapping=os.path.join(a.dir, "mapping.json"),
                tiny=os.path.join(a.dir, "tiny"))


def fmt(x, nd=2):
    return "–" if x is None else f"{x:.{nd}f}"


def main() -> int:
    if "--child" in sys.argv:
        return child_main()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--size", type=float, default=2.0, help="checkpoint size in GB (default %(default)s)")
    ap.add_argument("--storage", default="disk,tmpfs", help="disk and/or tmpfs (default %(default)s)")
    ap.add_argument("--modes", default="cold,warm", help="cold, warm and/or hot (default %(default)s)")
    ap.add_argument("--variants", default="abc", help="which of (a) (b) (c) (d) to run (default %(default)s)")
    ap.add_argument("--repeat", type=int, default=1, help="timed runs per cell; the median is shown")
    ap.add_argument("--dir", default="/var/tmp/ckptfs-bench-load", help="disk work dir (kept for reuse)")
    ap.add_argument("--tmpfs", default="/dev/shm/ckptfs-bench-load", help="tmpfs work dir (removed after)")
    ap.add_argument("--layout", default="fsdp_tp", choices=("fsdp", "tp", "fsdp_tp"))
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--files", type=int, default=2, help="consolidated output files")
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "src", "ckptfs"))
    ap.add_argument("--python", default=sys.executable, help="interpreter for the children")
    ap.add_argument("--mount-opt", action="append", default=[], help="extra -o option for (a) (repeatable)")
    ap.add_argument("--keep", action="store_true", help="keep the tmpfs copy")
    a = ap.parse_args()
    a.mount_args = ["-o", ",".join(a.mount_opt)] if a.mount_opt else []
    if os.geteuid() != 0:
        sys.exit("bench_load.py: run as root (drop_caches, FUSE mounts)")
    lib = os.path.join(os.path.dirname(os.path.abspath(a.bin)), "libckptfs_load.so")
    if os.path.exists(lib):  # (d) loads with the library built with --bin (the children inherit)
        os.environ.setdefault("CKPTFS_LOAD_LIB", lib)
    cmdline = " ".join(shlex.quote(x) for x in [sys.executable, *sys.argv])

    info = ensure_checkpoint(a)
    s = info["summary"]
    disk = storage_paths(a.dir, a)
    storages = [x for x in a.storage.split(",") if x]
    modes = [x for x in a.modes.split(",") if x]
    rows, checksums = [], set()
    for storage in storages:
        if storage == "disk":
            st = disk
        elif storage == "tmpfs":
            st = storage_paths(a.tmpfs, a)
            shutil.rmtree(a.tmpfs, ignore_errors=True)
            os.makedirs(a.tmpfs)
            log(f"copying the shards and the reference to {a.tmpfs}")
            shutil.copytree(disk["src"], st["src"])          # copy2: mtimes kept (no settle wait)
            shutil.copytree(disk["reference"], st["reference"])
        else:
            sys.exit(f"unknown storage {storage}")
        try:
            for mode in modes:
                res = {v: [] for v in a.variants}
                for _ in range(a.repeat):
                    for v in a.variants:  # interleaved, to spread drift over the variants
                        if mode in ("warm", "hot"):
                            run_variant(v, st, a, cold=False)  # untimed: warms the caches
                        r = run_variant(v, st, a, cold=(mode == "cold"), hot=(mode == "hot"))
                        checksums.add(r["checksum"])
                        log(f"{storage} {mode} ({v}): {json.dumps({k: round(x, 3) if isinstance(x, float) else x for k, x in r.items()})}")
                        res[v].append(r)
                med = {v: {k: statistics.median(x[k] for x in rs) for k in rs[0] if rs[0][k] is not None}
                       for v, rs in res.items()}
                rows.append((storage, mode, med))
        finally:
            if storage == "tmpfs" and not a.keep:
                shutil.rmtree(a.tmpfs, ignore_errors=True)
    if len(checksums) != 1:
        log(f"WARNING: the variants loaded different models (checksums {sorted(checksums)})")

    gb = s["total_bytes"] / 1e9
    print(f"\n## time to a loaded model, {gb:.2f} GB checkpoint\n")
    print(f"Command: `{cmdline}`\n")
    print(f"Checkpoint: LlamaForCausalLM, {info['layers']} layers, hidden {HIDDEN}, intermediate {INTER}, "
          f"heads {HEADS}/{KV_HEADS}, vocab {VOCAB}, bf16, {s['tensors']} tensors, {s['total_bytes']:,} bytes; "
          f"DCP shards: layout {s['layout']}, mesh {s['mesh']}, {s['shard_files']} shard files, "
          f"{s['reference_files']} consolidated files.  ")
    try:
        import importlib.metadata as md
        vers = ", ".join(f"{p} {md.version(p)}" for p in ("torch", "transformers", "safetensors"))
    except Exception:  # noqa: BLE001 - versions are informative only
        vers = "?"
    print(f"Machine: {platform.node()}, Linux {platform.release()}, {os.cpu_count()} CPUs, "
          f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM; {vers}; "
          f"disk dir {a.dir}, tmpfs dir {a.tmpfs}; median of {a.repeat} run(s).\n")
    print("| storage | cache | (a) mount + from_pretrained(mount) s | (b) torch consolidate + from_pretrained s "
          "| (c) from_pretrained(native copy) s | (d) ckptfs_load.from_pretrained(SRC) s | (a)/(b) | (a)/(c) "
          "| (d)/(c) | ckptfs daemon VmHWM MB | loader VmHWM MB (a / b / c / d) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for storage, mode, m in rows:
        ra, rb, rc, rd = m.get("a"), m.get("b"), m.get("c"), m.get("d")
        cell_a = f"{fmt(ra['total_s'])} ({fmt(ra['mount_s'])} + {fmt(ra['load_s'])})" if ra else "–"
        cell_b = f"{fmt(rb['total_s'])} ({fmt(rb['cons_s'])} + {fmt(rb['load_s'])})" if rb else "–"
        cell_c = f"{fmt(rc['total_s'])} (returned {fmt(rc['returned_s'])})" if rc else "–"
        cell_d = f"{fmt(rd['total_s'])} (returned {fmt(rd['returned_s'])})" if rd else "–"
        ab = f"{ra['total_s'] / rb['total_s']:.2f}" if ra and rb else "–"
        ac = f"{ra['total_s'] / rc['total_s']:.2f}" if ra and rc else "–"
        dc = f"{rd['total_s'] / rc['total_s']:.2f}" if rd and rc else "–"
        hwm = " / ".join(fmt(r["hwm_mb"], 0) if r else "–" for r in (ra, rb, rc, rd))
        print(f"| {storage} | {mode} | {cell_a} | {cell_b} | {cell_c} | {cell_d} | {ab} | {ac} | {dc} "
              f"| {fmt(ra.get('daemon_hwm_mb') if ra else None, 0)} | {hwm} |")
    print("\n(a) = mount start until the view is listed + from_pretrained + one pass over every parameter; "
          "(b) = torch consolidate_safetensors_files into a new dir on the same storage (no fsync) + the same "
          "load; (c) = the same load of the save_pretrained copy; (d) = ckptfs_load.from_pretrained of the "
          "rank shards (no mount; meta-device model filled in place by libckptfs_load) + the same pass; "
          "'returned': when the load call returned, before the pass. "
          "Loader VmHWM includes resident file-backed mmap pages (the model itself).")
    print(f"All variants loaded the same model: {len(checksums) == 1}")
    return 0 if len(checksums) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
