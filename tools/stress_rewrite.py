#!/usr/bin/env python3
"""Stress of a consolidated file written anew while another thread opens its name (issue 35).

Mounts SRC (a fresh directory under --dir) with the given binary and mount options, stores
version 0 of ck/model.safetensors, then for each round writes version k over it with
`open(O_WRONLY|O_TRUNC)` (or O_CREAT|O_TRUNC, or a new file renamed over it, --how) while a
second thread opens the name in a loop (--opener open|read|stat). After each close it reads
the name back; on a mismatch it says which 4 KiB pages hold which version and what a fresh
read-only mount of SRC reads (the stored bytes), and exits 1. Exits 0 when every round read
back as written.

It found a defect, fixed on 2026-12-04 (docs/semantics.md): with prefetch on, the opener's
opens started pushes of the old version into the inode the writer wrote through, and the
file was stored as the old version with the new one's last page. Before the fix, on Linux
6.18 and tmpfs, --how trunc or create with --opener open or read failed within 2-230 rounds
(ranks=1 and ranks=2, write passthrough on and off, at 3f7c4ba too); --how rename, --opener
stat and prefetch=off passed 300 rounds. After it, every combination passes 300.

Usage (as root, with the venv of tools/setup.sh):
  stress_rewrite.py [--bin build/src/ckptfs] [--opts ranks=1] [--rounds 300]
                    [--how trunc|create|rename] [--opener open|read|stat] [--dir /dev/shm/ckptfs-stress]
  STRESS_LOG=PATH keeps the daemon's log there.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def version(k: int) -> bytes:
    import torch
    from safetensors.torch import save
    return save({f"w{4 * k + i}": torch.full((256, 64), float(4 * k + i)) for i in range(4)})


def mount(binary: str, src: str, mnt: str, opts: str) -> subprocess.Popen:
    os.makedirs(mnt, exist_ok=True)
    log = os.environ.get("STRESS_LOG")  # the daemon's log, where wanted
    err = open(log, "ab") if log else subprocess.DEVNULL
    p = subprocess.Popen([binary, "mount", src, mnt, "-f", "-o", opts], stderr=err)
    deadline = time.monotonic() + 30
    while not os.path.ismount(mnt):
        if p.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"stress_rewrite: the mount of {src} at {mnt} did not come up")
        time.sleep(0.02)
    return p


def unmount(mnt: str, p: subprocess.Popen) -> None:
    while subprocess.run(["fusermount3", "-u", mnt], capture_output=True).returncode:
        time.sleep(0.05)
    p.wait(timeout=60)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "src", "ckptfs"))
    ap.add_argument("--opts", default="ranks=1")
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--how", choices=["trunc", "create", "rename"], default="trunc")
    ap.add_argument("--opener", choices=["open", "read", "stat"], default="open")
    ap.add_argument("--dir", default="/dev/shm/ckptfs-stress")
    a = ap.parse_args()
    shutil.rmtree(a.dir, ignore_errors=True)
    src, mnt = os.path.join(a.dir, "src"), os.path.join(a.dir, "mnt")
    os.makedirs(os.path.join(src, "ck"))
    versions = [version(k) for k in range(a.rounds + 1)]
    index = {v: k for k, v in enumerate(versions)}
    daemon = mount(a.bin, src, mnt, f"settle=0,{a.opts}")
    p = os.path.join(mnt, "ck", "model.safetensors")
    stop = threading.Event()

    def opener() -> None:
        while not stop.is_set():
            try:
                if a.opener == "stat":
                    os.stat(p)
                else:
                    with open(p, "rb") as f:
                        if a.opener == "read":
                            f.read()
            except OSError:
                pass  # between versions the name may be missing for a moment

    bad = None
    try:
        with open(p, "wb") as f:
            f.write(versions[0])
        t = threading.Thread(target=opener)
        t.start()
        try:
            for k in range(1, a.rounds + 1):
                target = p + ".tmp" if a.how == "rename" else p
                flags = os.O_WRONLY | os.O_TRUNC | (os.O_CREAT if a.how != "trunc" else 0)
                fd = os.open(target, flags, 0o644)
                try:
                    data, done = versions[k], 0
                    while done < len(data):
                        done += os.write(fd, data[done:])
                finally:
                    os.close(fd)
                if a.how == "rename":
                    os.rename(target, p)
                with open(p, "rb") as f:
                    got = f.read()
                if got != versions[k]:
                    bad = (k, got)
                    break
        finally:
            stop.set()
            t.join()
    finally:
        unmount(mnt, daemon)
    if bad is None:
        print(f"stress_rewrite: {a.rounds} rounds ({a.how}, opener {a.opener}, -o {a.opts}): "
              f"every one read back as written")
        shutil.rmtree(a.dir, ignore_errors=True)
        return 0
    k, got = bad
    pages = []
    for off in range(0, max(len(got), len(versions[k])), 4096):
        chunk = got[off:off + 4096]
        owners = [j for j in (k, k - 1) if versions[j][off:off + 4096] == chunk]
        pages.append(owners[0] if owners else None)
    runs, start = [], 0
    for i in range(1, len(pages) + 1):
        if i == len(pages) or pages[i] != pages[start]:
            runs.append(f"pages {start}-{i - 1}: version {pages[start]}")
            start = i
    ro = os.path.join(a.dir, "ro")
    daemon = mount(a.bin, src, ro, "ro,settle=0")
    try:
        with open(os.path.join(ro, "ck", "model.safetensors"), "rb") as f:
            stored = index.get(f.read(), "none of them")
    finally:
        unmount(ro, daemon)
    print(f"stress_rewrite: round {k} ({a.how}, opener {a.opener}, -o {a.opts}): read "
          f"{len(got)} bytes, not version {k} ({len(versions[k])} bytes): {'; '.join(runs)}; "
          f"a fresh read-only mount of SRC reads version {stored}; SRC kept at {src}")
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
