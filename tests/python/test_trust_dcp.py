"""Real mounts: the trust model of torch DCP checkpoints (issue 32), against what a red team made
of genuine dcp.save output.

Every checkpoint here is written by torch itself (dcp.save with the default FileSystemWriter),
or its `.metadata` is pickled by torch's own classes (Metadata, TensorStorageMetadata,
_StorageInfo ...), exactly as dcp.save's coordinator pickles it, then cut where the attack
needs it:
  (a) a dcp.save of v2 over v1, SIGKILLed once its first .distcp was closed, is never served
      (it would mix v2 and v1 tensors); the complete v2 save then shows v2 exactly;
  (b) a key that is not UTF-8, a key `__metadata__` and a model key below `model.` that would
      be served as `__metadata__` refuse their directory, naming the file and the tensor,
      while listings and other directories' reads answer;
  (c) 60,000 chunks, and 300 chunks over one 65,536-member archive, are refused within a
      bounded time while other directories answer (a hang guard, not a speed assertion);
  (d) 25,000 .distcp files are read one descriptor at a time (no fd growth in the daemon),
      and a .metadata naming more files than the cap is refused by it.
Nothing touches the mount from the pytest process: hostile_util's Prober does, with timeouts.
Skipped (never faked) without root, /dev/fuse or torch.
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
import select
import signal
import subprocess
import sys
import threading
import time
import zipfile

import pytest

from conftest import requires_fuse
from hostile_util import Prober, cli, mounts, prober, wait_for  # noqa: F401  (fixtures)

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")
from torch.distributed.checkpoint.filesystem import FileSystemWriter, _StorageInfo  # noqa: E402
from torch.distributed.checkpoint.metadata import (  # noqa: E402
    ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata)

pytestmark = requires_fuse

MODEL = "model-00001-of-00001.safetensors"
HANG = 60.0  # a hang guard for what a hostile directory costs the daemon, not a speed limit


def save(d: pathlib.Path, sd: dict):
    """dcp.save as a trainer calls it (no process group), one .distcp file per tensor."""
    dcp.save(sd, storage_writer=FileSystemWriter(str(d), single_file_per_rank=False), no_dist=True)


def model_sd(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {k: torch.randn(64, 32, generator=g) for k in ("a", "b", "c")}}


def served(p: Prober, d: pathlib.Path) -> dict:
    return safetensors_torch.load(p.read(d / MODEL))


def metadata(tensors: dict) -> bytes:
    """.metadata as dcp.save's coordinator pickles it: {key: (size, [(offsets, sizes, file,
    offset, length), ...])}, float32."""
    sdm, sd = {}, {}
    for key, (size, chunks) in tensors.items():
        cs = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s, *_ in chunks]
        sdm[key] = TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32),
                                         size=torch.Size(size), chunks=cs)
        for o, _, f, off, n in chunks:
            sd[MetadataIndex(fqn=key, offset=torch.Size(o))] = _StorageInfo(relative_path=f, offset=off, length=n)
    return pickle.dumps(Metadata(state_dict_metadata=sdm, planner_data={k: (k,) for k in tensors},
                                 storage_data=sd))


def archive(t) -> bytes:
    """torch.save of one tensor: what DCP stores per chunk."""
    b = io.BytesIO()
    torch.save(t, b)
    return b.getvalue()


def raw_log(m) -> bytes:
    try:
        return pathlib.Path(m.log).read_bytes()
    except OSError:
        return b""


def log_says(m, *parts: bytes, timeout: float = 10.0):
    wait_for(lambda: all(x in raw_log(m) for x in parts), f"the log to name {parts}", timeout)


# (a) ----------------------------------------------------------------------------------------

# A dcp.save that stops for good once its first .distcp file is closed (the parent then kills
# it with SIGKILL): FileSystem.create_stream, which every .distcp write goes through, is
# wrapped. argv: the checkpoint directory, the state dict (torch.save'd).
KILLED_SAVE = r"""
import contextlib, sys, time, torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem as fs
create = fs.FileSystem.create_stream
@contextlib.contextmanager
def create_stream(self, path, mode):
    with create(self, path, mode) as s:
        yield s
    if str(path).endswith(".distcp"):
        print("closed", path, flush=True)
        time.sleep(3600)
fs.FileSystem.create_stream = create_stream
sd = torch.load(sys.argv[2])
dcp.save(sd, storage_writer=fs.FileSystemWriter(sys.argv[1], single_file_per_rank=False), no_dist=True)
"""


def test_a_save_killed_midway_is_never_served_mixed(tmp_path, mounts, prober):
    src = tmp_path / "src"
    ck = src / "step"
    ck.mkdir(parents=True)
    v1, v2 = model_sd(1), model_sd(2)
    save(ck, v1)
    files = sorted(p.name for p in ck.glob("*.distcp"))
    assert len(files) == 3, files
    torch.save(v2, tmp_path / "v2.pt")
    time.sleep(0.05)  # v2's files are then newer than v1's .metadata on any clock granularity
    child = subprocess.Popen([sys.executable, "-c", KILLED_SAVE, str(ck), str(tmp_path / "v2.pt")],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    try:
        ready, _, _ = select.select([child.stdout], [], [], 120)  # torch's import, then one file
        line = child.stdout.readline() if ready else ""
        assert line.startswith("closed "), (line, child.stderr.read() if child.poll() is not None else "")
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    written = pathlib.Path(line.split(" ", 1)[1].strip()).name
    assert written in files and not (ck / ".metadata.tmp").exists()
    # The state a kill leaves: one file of v2, the others and .metadata of v1.
    meta_ns = (ck / ".metadata").stat().st_mtime_ns
    for f in files:
        assert ((ck / f).stat().st_mtime_ns > meta_ns) == (f == written), f

    m = mounts(src)
    d = pathlib.Path(m.mnt) / "step"
    names = prober.listdir(d)
    assert not [n for n in names if n.startswith("model")], names  # absent, never a mix
    assert ".metadata" in names and written in names
    assert not prober.exists(d / MODEL)
    log_says(m, written.encode(), b"written after .metadata")

    # The save done again, completely: v2 exactly.
    save(ck, v2)
    got = wait_for(lambda: MODEL in prober.listdir(d) and served(prober, d), "v2 to be served", 20)
    want = v2["model"]
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    assert m.alive()


# (b) ----------------------------------------------------------------------------------------


def test_names_that_cannot_be_served_refuse_their_directory(tmp_path, mounts, prober):
    src = tmp_path / "src"
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    save(src / "good", {"model": {"w": t}})
    save(src / "not-utf8", {"model": {"w": t, "norm": t + 1}})
    meta = src / "not-utf8" / ".metadata"
    # Every 'norm' made invalid UTF-8, same length: the pickle stays well formed.
    meta.write_bytes(meta.read_bytes().replace(b"norm", b"n\xffrm"))
    save(src / "reserved", {"__metadata__": t, "w": t})
    save(src / "reserved-below-model", {"model": {"__metadata__": t, "w": t}})

    m = mounts(src)
    root = pathlib.Path(m.mnt)
    assert sorted(prober.listdir(root)) == ["good", "not-utf8", "reserved", "reserved-below-model"]
    for name in ("not-utf8", "reserved", "reserved-below-model"):
        for _ in range(2):  # a second listing answers too
            names = prober.listdir(root / name)
            assert ".metadata" in names and not [n for n in names if n.startswith("model")], names
    # The log names the file and the tensor (escaped: the raw byte never reaches it).
    log_says(m, b".metadata", b"model.n\\xffrm")
    log_says(m, b"'__metadata__'", b"safetensors header's own field")
    log_says(m, b"tensor 'model.__metadata__'")
    assert b"n\xffrm" not in raw_log(m)
    # Another directory is served meanwhile, and still is.
    assert torch.equal(served(prober, root / "good")["w"], t)
    assert m.alive()
    # The CLI says so too, naming the file, and never aborts (inspect, consolidate and load
    # died of an uncaught JSON exception before).
    for args in (["inspect"], ["verify"], ["consolidate"], ["load"]):
        d = src / "not-utf8"
        extra = [tmp_path / f"out-{args[0]}"] if args[0] == "consolidate" else []
        r = cli(*args, d, *extra, timeout=120)
        assert not r.timed_out and r.rc > 0, f"{args[0]}: {r!r}"
        assert ".metadata" in r.out and "UTF-8" in r.out, f"{args[0]}: {r!r}"


# (c) ----------------------------------------------------------------------------------------


def test_many_chunks_and_a_huge_chunk_archive_stay_bounded(tmp_path, mounts):
    src = tmp_path / "src"
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    save(src / "good", {"model": {"w": t}})
    # 60,000 chunks of one tensor over 512 files, each range inside its file (8 MB .metadata).
    d = src / "chunks60k"
    d.mkdir()
    n, length = 60_000, 1500
    for f in range(512):
        with open(d / f"__{f}_0.distcp", "wb") as fh:
            fh.truncate((n // 512 + 1) * length)
    (d / ".metadata").write_bytes(metadata({"w": ([2 * n, 3], [
        ([2 * i, 0], [2, 3], f"__{i % 512}_0.distcp", (i // 512) * length, length) for i in range(n)])}))
    # 300 chunks, each [0, len) of one archive of 65,536 members (7 MB).
    d = src / "members65k"
    d.mkdir()
    one = zipfile.ZipFile(io.BytesIO(archive(torch.zeros(2, 3))))
    z = io.BytesIO()
    with zipfile.ZipFile(z, "w", zipfile.ZIP_STORED) as w:
        for info in one.infolist():
            w.writestr(info.filename, one.read(info.filename))
        for i in range(65_536 - len(one.infolist())):
            w.writestr(f"archive/x/{i}", b"")
    (d / "__0_0.distcp").write_bytes(z.getvalue())
    (d / ".metadata").write_bytes(metadata({"w": ([600, 3], [
        ([2 * i, 0], [2, 3], "__0_0.distcp", 0, len(z.getvalue())) for i in range(300)])}))

    m = mounts(src)
    root = pathlib.Path(m.mnt)
    hostile, other = Prober(timeout=HANG), Prober(timeout=10)
    try:
        for name in ("chunks60k", "members65k"):
            hostile.submit("listdir", root / name)
            # The mount answers other directories while that one is read.
            assert torch.equal(served(other, root / "good")["w"], t)
            assert "good" in other.listdir(root)
            names = hostile.result()
            assert not [x for x in names if x.startswith("model")], (name, names)
        log_says(m, b"chunks60k", b"no zip end-of-central-directory record")
        log_says(m, b"members65k", b"overlap")
    finally:
        hostile.close()
        other.close()
    assert m.alive()


# (d) ----------------------------------------------------------------------------------------


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_many_files_one_descriptor_at_a_time_and_the_file_cap(tmp_path, mounts, prober):
    src = tmp_path / "src"
    # 25,000 .distcp files (a 25,000-rank save), each a chunk: torch.save of rows [i, i + 1).
    d = src / "files25k"
    d.mkdir(parents=True)
    n = 25_000
    row = torch.arange(4, dtype=torch.float32).reshape(1, 4)
    blob = archive(row)
    for i in range(n):
        with open(d / f"__{i}_0.distcp", "wb") as fh:
            fh.write(blob)
    (d / ".metadata").write_bytes(metadata({"w": ([n, 4], [
        ([i, 0], [1, 4], f"__{i}_0.distcp", 0, len(blob)) for i in range(n)])}))
    # One file past the cap (65,536 files): refused before any is opened.
    d = src / "files-past-cap"
    d.mkdir()
    (d / "__0_0.distcp").write_bytes(blob)
    k = 65_537
    (d / ".metadata").write_bytes(metadata({"w": ([k, 4], [
        ([i, 0], [1, 4], f"__{i}_0.distcp", 0, len(blob)) for i in range(k)])}))

    m = mounts(src)
    root = pathlib.Path(m.mnt)
    base = fd_count(m.pid)
    peak, stop = [base], threading.Event()

    def sample():
        while not stop.is_set():
            try:
                peak[0] = max(peak[0], fd_count(m.pid))
            except OSError:
                pass
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        names = prober.listdir(root / "files25k", timeout=HANG)
    finally:
        stop.set()
        sampler.join()
    assert MODEL in names, names[:5]
    assert peak[0] - base < 32, f"the daemon held {peak[0] - base} more descriptors while reading"
    st = prober.stat(root / "files25k" / MODEL)
    assert st["size"] > n * 16  # the header, then 25,000 rows of 16 bytes

    names = prober.listdir(root / "files-past-cap", timeout=HANG)
    assert not [x for x in names if x.startswith("model")], names
    log_says(m, b"files-past-cap", b"names more than 65536 files (kMaxDistcpFiles)")
    assert m.alive()
