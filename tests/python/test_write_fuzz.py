"""Tier 3: the write path fuzzed through a real mount (issue 18).

Seeded random sequences of what writers do, into two directories of a real mount (-o ranks=2,
and a 1 MiB write memory so that large headers go to disk): saves the way safetensors makes
them (a temp name, ftruncate or not, writes in order, out of order or in random pieces, an
fsync, a rename while open or after close), direct writes with O_TRUNC, renames, unlinks and
hard links made in SRC while a file is written. Contents: consolidated safetensors files (any
dtype, 0-d and empty tensors, shuffled header keys, padding, __metadata__, headers of hundreds
of KB), hostile ones (lengths past the end or huge, JSON nested 200 deep, not JSON,
overlapping offsets, duplicate keys, DCP shards under model names), cut-short ones and random
bytes.

The oracle is the contract, not a model of ckptfs: after every close() that returned 0, the
file reads back exactly under its name; a close that failed leaves that name unspecified, and
every other name still reads back what it held; renames and unlinks move names only when they
succeed; a link made in SRC holds the bytes when the file it links is closed. At the end a
fresh daemon reads every name back again. The seed is printed on failure;
CKPTFS_WRITE_FUZZ_SECONDS bounds the run (default 60), CKPTFS_WRITE_FUZZ_SEED replays one.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import struct
import time

import pytest

from conftest import Mount, requires_fuse

pytestmark = requires_fuse

SECONDS = float(os.environ.get("CKPTFS_WRITE_FUZZ_SECONDS", "60"))
NAMES = ["model.safetensors", "model-00001-of-00002.safetensors",
         "model-00002-of-00002.safetensors", "adapter_model.safetensors", "notes.bin"]
DTYPES = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8, "U8": 1, "BOOL": 1, "F64": 8, "I8": 1}


def header_bytes(entries: list[tuple[str, dict]], rng: random.Random) -> bytes:
    parts = [json.dumps(k) + ":" + json.dumps(v, separators=(",", ":")) for k, v in entries]
    h = ("{" + ("," if rng.random() < 0.7 else ", ").join(parts) + "}").encode()
    pad = rng.choice([0, -len(h) % 8, rng.randrange(0, 64)])
    return h + b" " * pad


def consolidated(rng: random.Random, big: bool = False) -> bytes:
    n = rng.randrange(300, 3000) if big else rng.randrange(0, 7)
    entries, data, off = [], [], 0
    for i in range(n):
        dt = rng.choice(list(DTYPES))
        shape = [rng.randrange(0, 9 if big else 40) for _ in range(rng.choice([0, 1, 2, 2, 3]))]
        numel = 1
        for s in shape:
            numel *= s
        raw = rng.randbytes(numel * DTYPES[dt])
        name = (f"layers.{i}.w" + ("x" * rng.randrange(0, 300) if big else "")) if rng.random() < 0.9 else f"t{i}"
        entries.append((name, {"dtype": dt, "shape": shape, "data_offsets": [off, off + len(raw)]}))
        data.append(raw)
        off += len(raw)
    rng.shuffle(entries)  # file order is data order; key order is the writer's business
    if rng.random() < 0.6:
        entries.insert(rng.randrange(len(entries) + 1), ("__metadata__", {"format": "pt", "k": "v"}))
    h = header_bytes(entries, rng)
    return struct.pack("<Q", len(h)) + h + b"".join(data)


def hostile(rng: random.Random) -> bytes:
    good = consolidated(rng)
    kind = rng.randrange(9)
    if kind == 0:  # header length past the end
        return struct.pack("<Q", len(good) + 1000) + good[8:]
    if kind == 1:  # huge header length
        return struct.pack("<Q", rng.choice([2**63, 10**9, 100_000_001])) + good[8:]
    if kind == 2:  # nested 200 deep
        h = b'{"a":' + b"[" * 200 + b"]" * 200 + b"}"
        return struct.pack("<Q", len(h)) + h
    if kind == 3:  # not JSON
        h = b"{" + rng.randbytes(60)
        return struct.pack("<Q", len(h)) + h + rng.randbytes(100)
    if kind == 4:  # overlapping offsets
        e = [("a", {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}),
             ("b", {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]})]
        h = header_bytes(e, rng)
        return struct.pack("<Q", len(h)) + h + rng.randbytes(24)
    if kind == 5:  # duplicate keys
        h = b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"a":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}}'
        return struct.pack("<Q", len(h)) + h + b"abcd"
    if kind == 6:  # a DCP rank shard, under whatever name it gets
        e = [("w", {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}),
             ("__metadata__", {"DCP_SHARDING_INFO": json.dumps({"w": {"saved_offsets": [2, 0]}}),
                               "DCP_VERSION": "1.0", "format": "pt"})]
        h = header_bytes(e, rng)
        return struct.pack("<Q", len(h)) + h + rng.randbytes(16)
    if kind == 7:  # random bytes
        return rng.randbytes(rng.randrange(0, 5000))
    return b""  # empty


def content(rng: random.Random) -> tuple[bytes, int]:
    """(bytes, how many of them to write: fewer means cut short)."""
    r = rng.random()
    if r < 0.45:
        b = consolidated(rng)
    elif r < 0.55:
        b = consolidated(rng, big=True)
    elif r < 0.8:
        b = hostile(rng)
    else:
        b = consolidated(rng)
        return b, rng.randrange(0, len(b) + 1)
    return b, len(b)


def pieces(rng: random.Random, n: int) -> list[tuple[int, int]]:
    """(offset, length) covering [0, n) in one of the writers' orders."""
    style = rng.randrange(4)
    step = (1 << 20) if style == 0 else rng.choice([1, 7, 512, 4096, 65536, 300_000])
    step = max(step, n // 500)  # at most ~500 writes a file: the run goes to many files
    out = [(o, min(step, n - o)) for o in range(0, n, step)]
    if style == 2:
        out.reverse()
    elif style == 3:
        rng.shuffle(out)
    return out


class Fuzz:
    def __init__(self, mnt: pathlib.Path, src: pathlib.Path, rng: random.Random):
        self.mnt, self.src, self.rng = mnt, src, rng
        self.known: dict[str, bytes] = {}  # "d0/name" -> the bytes it must read back
        self.log: list[str] = []
        self.tmp = 0

    def forget(self, rel: str):
        self.known.pop(rel, None)

    def save(self):
        rng = self.rng
        d = rng.choice(["d0", "d1"])
        final = f"{d}/{rng.choice(NAMES)}"
        body, upto = content(rng)
        self.tmp += 1
        tmp = f"{d}/.tmp{self.tmp}"
        rename_open = rng.random() < 0.7
        sized = rng.random() < 0.7
        self.log.append(f"save {final} via {tmp}: {len(body)} bytes, {upto} written, "
                        f"{'sized, ' if sized else ''}rename {'while open' if rename_open else 'after close'}")
        fd = os.open(self.mnt / tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        link = None
        try:
            if sized:
                os.ftruncate(fd, len(body))
            for i, (o, n) in enumerate(pieces(rng, upto)):
                os.pwrite(fd, body[o:min(o + n, upto)], o)
                if link is None and i == 0 and rng.random() < 0.1:
                    link = self.src / f"link{self.tmp}"
                    os.link(self.src / tmp, link)
            if rng.random() < 0.15:
                os.fsync(fd)
            if rename_open:
                os.rename(self.mnt / tmp, self.mnt / final)
        except OSError:
            os.close(fd)
            raise
        # A plain file's POSIX content: the bytes written, zeros up to the size it was given.
        want = body[:upto] + b"\0" * ((len(body) if sized else upto) - upto)
        where = final if rename_open else tmp
        try:
            os.close(fd)
        except OSError as e:
            self.log.append(f"  close failed: {e}")
            self.forget(where)
            if rename_open:
                self.forget(tmp)
            return
        self.known[where] = want
        if link is not None:  # checked now: later writes to the name may share its inode
            got = link.read_bytes()
            assert got == want, f"{link}: a link made in SRC holds {len(got)} bytes, not the {len(want)} closed"
        if rename_open:
            self.forget(tmp)
            return
        try:
            os.rename(self.mnt / tmp, self.mnt / final)
            self.known[final] = self.known.pop(tmp)
        except OSError as e:
            self.log.append(f"  rename failed: {e}")

    def direct(self):
        rng = self.rng
        rel = f"{rng.choice(['d0', 'd1'])}/{rng.choice(NAMES)}"
        body, upto = content(rng)
        self.log.append(f"direct O_TRUNC {rel}: {len(body)} bytes, {upto} written")
        try:
            fd = os.open(self.mnt / rel, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError as e:
            self.log.append(f"  open failed: {e}")
            return
        self.forget(rel)  # O_TRUNC: whatever it held may be gone now
        for o, n in pieces(rng, upto):
            os.pwrite(fd, body[o:min(o + n, upto)], o)
        try:
            os.close(fd)
        except OSError as e:
            self.log.append(f"  close failed: {e}")
            return
        self.known[rel] = body[:upto]

    def rename(self):
        if not self.known:
            return
        a = self.rng.choice(sorted(self.known))
        b = f"{self.rng.choice(['d0', 'd1'])}/{self.rng.choice(NAMES)}"
        self.log.append(f"rename {a} -> {b}")
        try:
            os.rename(self.mnt / a, self.mnt / b)
        except OSError as e:
            self.log.append(f"  failed: {e}")
            return
        if a != b:
            self.known[b] = self.known.pop(a)

    def unlink(self):
        if not self.known:
            return
        a = self.rng.choice(sorted(self.known))
        self.log.append(f"unlink {a}")
        try:
            os.unlink(self.mnt / a)
        except OSError as e:
            self.log.append(f"  failed: {e}")
            return
        self.forget(a)

    def check(self, root: pathlib.Path | None = None):
        root = root or self.mnt
        for rel, want in sorted(self.known.items()):
            got = (root / rel).read_bytes()
            assert got == want, (f"{rel}: read back {len(got)} bytes, want {len(want)} "
                                 f"(first difference at {next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), min(len(got), len(want)))})")


def test_write_path_fuzz(tmp_path):
    seed = int(os.environ.get("CKPTFS_WRITE_FUZZ_SEED", random.SystemRandom().randrange(1 << 32)))
    rng = random.Random(seed)
    src = tmp_path / "src"
    for d in ("d0", "d1"):
        (src / d).mkdir(parents=True)
    opts = ["ranks=2", "write_mem_mb=1"]
    fz = None
    ops = 0
    try:
        with Mount(src, tmp_path / "mnt", opts=opts) as m:
            fz = Fuzz(pathlib.Path(m.mnt), src, rng)
            deadline = time.monotonic() + SECONDS
            while time.monotonic() < deadline:
                r = rng.random()
                if r < 0.5:
                    fz.save()
                elif r < 0.7:
                    fz.direct()
                elif r < 0.85:
                    fz.rename()
                else:
                    fz.unlink()
                fz.check()
                ops += 1
        with Mount(src, tmp_path / "mnt2", opts=opts) as m2:
            fz.check(pathlib.Path(m2.mnt))
    except Exception as e:  # the seed and the last steps replay the failure
        steps = "\n".join(fz.log[-15:]) if fz else ""
        raise AssertionError(f"write fuzz failed after {ops} operations, seed {seed} "
                             f"(CKPTFS_WRITE_FUZZ_SEED={seed} replays it):\n{steps}\n{e}") from e
    print(f"\nwrite fuzz: seed {seed}, {ops} operations, {len(fz.known)} files at the end")
