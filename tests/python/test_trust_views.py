"""Tier 3: what a view serves, and to whom (issue 32): lifted folders under allow_other with real
users, writes under a model name in a native checkpoint directory, a shard rewritten in place
under an open file, and one directory's view build next to the others.

Every checkpoint is written by torch's own DCP writer (dcp.save, one process, no process group)
or as safetensors rank shards; every user is real (useradd, from test_trust.py) and acts from a
child process. Skipped (never faked) without root, /dev/fuse, torch or useradd.
"""

from __future__ import annotations

import errno
import json
import os
import pathlib
import shutil
import subprocess
import sys
import threading
import time

import pytest

from conftest import BIN, Mount, requires_fuse, wait_for
from test_trust import as_user, errno_of, users, world  # noqa: F401  (fixtures)

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

pytestmark = [requires_fuse,
              pytest.mark.skipif(shutil.which("useradd") is None, reason="needs useradd")]


def dcp_save(d: pathlib.Path, seed: int, rows: int = 64, cols: int = 64) -> dict:
    """A genuine torch DCP checkpoint of three tensors (dcp.save, no process group)."""
    g = torch.Generator().manual_seed(seed)
    sd = {"model.embed.weight": torch.randn(rows, cols, generator=g),
          "model.norm.weight": torch.randn(cols, generator=g),
          "lm_head.weight": torch.randn(rows, cols, generator=g)}
    d.mkdir(parents=True, exist_ok=True)
    dcp.save(sd, checkpoint_id=str(d))
    return sd


def mount(world, *opts) -> Mount:
    """A daemon for `with`: it starts on entering and is stopped (and checked) on leaving."""
    return Mount(world / "src", world / "mnt", opts=["allow_other", *opts],
                 log=str(world / "mnt.log"))


def model_files(d: pathlib.Path) -> list[str]:
    return sorted(n for n in os.listdir(d) if n.startswith("model") and n.endswith(".safetensors"))


# --- lifted folders --------------------------------------------------------------------------


@pytest.mark.parametrize("folder", [".hf_metadata", "huggingface"])
def test_lifted_folder_keeps_its_permissions(world, users, folder):
    """config.json of a 0700 huggingface/ (verl) or .hf_metadata/ (NeMo) is shown in the
    checkpoint directory; another user who could not search that folder in SRC neither lists it
    there nor opens it, even once root's lookup put the name in the kernel's cache."""
    a = users["a"]
    ck = world / "src" / "ck"
    dcp_save(ck, 1)
    for p in [ck, *ck.iterdir()]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    lifted = ck / folder
    lifted.mkdir()
    (lifted / "config.json").write_text('{"model_type": "llama"}')
    os.chmod(lifted / "config.json", 0o644)
    os.chmod(lifted, 0o700)  # root's
    with mount(world) as m:
        d = pathlib.Path(m.mnt) / "ck"
        # In SRC the user reaches nothing in the folder.
        assert errno_of(lambda: as_user(a, "read", lifted / "config.json")) == errno.EACCES
        assert (d / "config.json").read_text() == '{"model_type": "llama"}'  # root: cached
        assert "config.json" in os.listdir(d)
        assert "config.json" not in as_user(a, "listdir", d)
        assert errno_of(lambda: as_user(a, "read", d / "config.json")) == errno.EACCES
        assert model_files(d), "the consolidated files are still shown"
        os.chmod(lifted, 0o755)
        time.sleep(0)  # nothing cached decides: the daemon checks at each open
        assert as_user(a, "read", d / "config.json") == len('{"model_type": "llama"}')
        assert "config.json" in as_user(a, "listdir", d)


# --- writes under a model name in a native directory -----------------------------------------


_WRITE = r"""
import errno, os, sys
op, a, b = sys.argv[1], sys.argv[2], sys.argv[3]
try:
    if op == "write":  # the bytes of file b written to a, the way safetensors saves them
        data = open(b, "rb").read()
        fd = os.open(a, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, data)
        os.close(fd)
    else:
        os.rename(a, b)
    print(0)
except OSError as e:
    print(e.errno)
"""


def in_child(op: str, a, b) -> int:
    """errno of one write or rename made by a child process: the writer's view (a process sees
    what it wrote itself) is then not the test's."""
    r = subprocess.run([sys.executable, "-c", _WRITE, op, str(a), str(b)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return int(r.stdout.strip())


def test_a_model_name_in_a_native_directory_fails_at_close_and_keeps_the_view(world):
    """In a torch DCP directory every model name shows the consolidated view of the .distcp
    files. A file written there under a model name would be hidden: close() fails (EINVAL), and
    the view keeps serving the DCP checkpoint; a rename onto a shown name is refused before
    anything moves."""
    ck = world / "src" / "ck"
    want = dcp_save(ck, 2)
    with mount(world) as m:
        d = pathlib.Path(m.mnt) / "ck"
        shown = model_files(d)
        assert shown
        before = (d / shown[0]).read_bytes()
        (world / "bytes").write_bytes(before)  # a complete consolidated file: the view's own
        for name in ["model.safetensors", shown[0], "model-00001-of-00002.safetensors"]:
            assert in_child("write", d / name, world / "bytes") == errno.EINVAL, name
            assert model_files(d) == shown
            assert (d / shown[0]).read_bytes() == before
        assert in_child("write", d / "tmp.safetensors", world / "bytes") == 0
        assert in_child("rename", d / "tmp.safetensors", d / shown[0]) == errno.EINVAL
        assert (d / "tmp.safetensors").exists()
        assert (d / shown[0]).read_bytes() == before
        log = pathlib.Path(world / "mnt.log").read_text()
        assert "torch DCP checkpoint directory every model name shows" in log, log[-3000:]
    from safetensors.torch import load_file
    got = {}
    # What the view serves is still exactly the DCP checkpoint (read once more after remount).
    with mount(world) as m:
        for n in model_files(pathlib.Path(m.mnt) / "ck"):
            got.update({k: v.clone() for k, v in load_file(str(pathlib.Path(m.mnt) / "ck" / n)).items()})
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


# --- a shard rewritten in place under an open file -------------------------------------------


def test_a_distcp_rewritten_under_an_open_file_never_reads_as_a_mix(world):
    """torch rewrites .distcp files in place ("wb"). A consolidated file opened on v1 and read
    on after a dcp.save of v2 into the same directory gives EIO for what it had not read yet
    (or v1's bytes from the page cache), never v2's bytes under v1's header; a new open reads
    v2."""
    ck = world / "src" / "ck"
    dcp_save(ck, 3, rows=2048, cols=1024)  # 8 MiB per matrix: reads reach the daemon
    v1 = world / "v1"
    r = subprocess.run([str(BIN), "consolidate", str(ck), str(v1)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    with mount(world, "prefetch=off", "read_ahead_kb=128") as m:
        d = pathlib.Path(m.mnt) / "ck"
        name = model_files(d)[0]
        want = (v1 / name).read_bytes()
        fd = os.open(d / name, os.O_RDONLY)
        try:
            assert os.pread(fd, 4096, 0) == want[:4096]
            dcp_save(ck, 4, rows=2048, cols=1024)  # v2, in place
            outcomes = []
            for off in range(1 << 20, len(want), 4 << 20):
                try:
                    got = os.pread(fd, 65536, off)
                    assert got == want[off:off + len(got)], f"v2 bytes at {off} under v1's header"
                    outcomes.append("v1")
                except OSError as e:
                    assert e.errno == errno.EIO, e
                    outcomes.append("EIO")
            assert "EIO" in outcomes, outcomes  # prefetch off: nothing was cached
        finally:
            os.close(fd)
        log = pathlib.Path(world / "mnt.log").read_text()
        assert "changed under an open file" in log and ".distcp" in log, log[-3000:]
        # A new open reads v2, exactly as consolidate makes it.
        v2 = world / "v2"
        r = subprocess.run([str(BIN), "consolidate", str(ck), str(v2)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        got = wait_for(lambda: (d / name).read_bytes() == (v2 / name).read_bytes(), "v2 shown")
        assert got


# --- one directory's build next to the others ------------------------------------------------


def big_header_shards(d: pathlib.Path, shards: int, tensors: int) -> None:
    """Rank shards whose headers are large (many tiny tensors): reading them takes the build
    a while, and the consolidated view is valid."""
    d.mkdir(parents=True)
    for r in range(shards):
        header, info = {}, {}
        for t in range(tensors):
            name = f"layer.{t}.w"
            header[name] = {"dtype": "F32", "shape": [1], "data_offsets": [4 * t, 4 * t + 4]}
            info[name] = {"saved_offsets": [r], "shape": [shards]}
        header["__metadata__"] = {"format": "pt", "DCP_SHARDING_INFO": json.dumps(info),
                                  "DCP_VERSION": "1.0"}
        h = json.dumps(header, separators=(",", ":")).encode()
        h += b" " * (-len(h) % 8)
        (d / f"shard-{r + 1:05d}-model-00001-of-00001.safetensors").write_bytes(
            len(h).to_bytes(8, "little") + h + bytes(4 * tensors))


def test_one_directory_build_stalls_no_other(world):
    """Twelve readers list one checkpoint whose build reads 2 x ~10 MB of shard headers (~6 MB
    against the ASan+UBSan daemon, which reads them about six times slower: either build takes
    seconds to tens of seconds; more readers than the mount has FUSE workers: before, they held
    every worker for the build).
    Meanwhile another checkpoint directory lists and reads at once: its requests are not queued
    behind the slow build, because waiting requests are parked on their directory, not held by a
    worker."""
    src = world / "src"
    big_header_shards(src / "slow", shards=2,
                      tensors=60_000 if os.environ.get("CKPTFS_ASAN") == "1" else 100_000)
    big_header_shards(src / "quick", shards=2, tensors=4)
    with mount(world, "threads=4") as m:
        mnt = pathlib.Path(m.mnt)
        done, errors = [], []

        def reader():
            # A listing: the kernel sends each reader's OPENDIR to the daemon (a lookup of one
            # name is sent once, the others wait in the kernel), where it waits for the build.
            try:
                os.listdir(mnt / "slow")
                done.append(time.monotonic())
            except OSError as e:  # noqa: PERF203
                errors.append(e)

        threads = [threading.Thread(target=reader, daemon=True) for _ in range(12)]
        for t in threads:
            t.start()
        time.sleep(0.5)  # the readers are inside the daemon: the slow build has begun
        t0 = time.monotonic()
        quick = sorted(os.listdir(mnt / "quick"))
        data = (mnt / "quick" / "model-00001-of-00001.safetensors").read_bytes()
        t_quick = time.monotonic()
        assert "model-00001-of-00001.safetensors" in quick and data
        for t in threads:
            t.join(timeout=300)
        assert not errors, errors
        assert len(done) == 12
        # The other directory answered before the slow build ended (ordering, not speed).
        assert t_quick < min(done), (t_quick - t0, min(done) - t0)
