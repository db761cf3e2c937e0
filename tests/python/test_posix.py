"""Tier 3: POSIX through the writable mount, against a plain directory (issue 19).

  * A differential suite after pjdfstest's categories (posix_cases.py): each case runs the
    same calls in a fresh directory on ext4 (the plain side) and on the mount, as root and
    as an ordinary user, and every result must match: return value or errno, type, mode,
    owner, link count, size, and times where set. Differences that are deliberate are listed
    in EXPECTED, each with the section of docs/semantics.md that documents it; any other
    difference fails.
  * An fsx-like randomized test: thousands of writes, reads, truncates, mmap writes and
    reads on one file in the mount, checked against the same operations on a plain file;
    the seed is printed on failure (CKPTFS_FSX_SEED replays it, CKPTFS_FSX_OPS sizes it).
  * Replace by rename, 1,000 times: right after each rename returns, another process
    stats and opens the name, and never misses it.
  * cp -a, rsync -a (twice) and tar x into the mount: bytes, modes and times of the files and
    directories as the plain copy has them, and a second rsync sends nothing.
"""

from __future__ import annotations

import json
import mmap
import os
import pathlib
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import time

import pytest

from conftest import Mount, requires_fuse
from mount_util import splits_done

pytestmark = requires_fuse

CASES = pathlib.Path(__file__).parent / "posix_cases.py"
SYS_PY = "/usr/bin/python3"

# Deliberate differences: (case, call) -> why, with the section of docs/semantics.md. Every
# other difference fails.
EXPECTED: dict[tuple[str, str], str] = {
    ("model", "truncate"): "a consolidated file is not changed in place: EPERM (Writes, Deviations)",
    ("model", "link"): "only plain files that are not being written are linked: EPERM (Writes, Deviations)",
    ("model", "rename to another name"): "a consolidated file is not renamed: EXDEV, mv copies it "
                                          "(Writes, Deviations)",
    ("model", "unlink"): "follows from the refused rename: the plain side's name is gone already",
    ("model", "stat at the end"): "follows from the refused rename",
}


def case_names() -> list[str]:
    sys.path.insert(0, str(CASES.parent))
    import posix_cases
    return sorted(posix_cases.CASES)


def run_case(root: pathlib.Path, case: str, user: int | None) -> list:
    def drop():
        os.setgroups([])
        os.setgid(user)
        os.setuid(user)
    r = subprocess.run([SYS_PY, "-I", str(CASES), str(root), case], capture_output=True, text=True,
                       timeout=120, preexec_fn=drop if user is not None else None, cwd="/")
    assert r.returncode == 0, f"{case} in {root}: {r.stderr[-3000:]}"
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def roots():
    """A plain ext4 directory and a mount of another, both traversable by every user."""
    top = pathlib.Path(tempfile.mkdtemp(prefix="ckptfs-posix-", dir="/tmp"))
    os.chmod(top, 0o755)
    plain, src = top / "plain", top / "src"
    plain.mkdir()
    src.mkdir()
    m = Mount(src, top / "mnt", opts=["allow_other"], log=str(top / "mnt.log")).start()
    yield plain, pathlib.Path(m.mnt), m
    m.stop()
    shutil.rmtree(top, ignore_errors=True)


@pytest.mark.parametrize("user", [None, 65534], ids=["root", "nobody"])
@pytest.mark.parametrize("case", case_names())
def test_differential(roots, case, user):
    plain, mnt, m = roots
    tag = f"{case}-{user or 'root'}"
    sides = {}
    for name, root in (("plain", plain), ("mount", mnt)):
        d = root / tag
        d.mkdir()
        os.chmod(d, 0o777)
        sides[name] = run_case(d, case, user)
    a, b = sides["plain"], sides["mount"]
    diffs = []
    for i in range(max(len(a), len(b))):
        x = a[i] if i < len(a) else None
        y = b[i] if i < len(b) else None
        if x == y:
            continue
        what = (x or y)[0]
        if (case, what) in EXPECTED:
            continue
        diffs.append(f"  {what}: plain {x[1:] if x else None}, mount {y[1:] if y else None}")
    assert not diffs, f"{case} as {user or 'root'}:\n" + "\n".join(diffs)
    assert m.proc.poll() is None


# --- fsx --------------------------------------------------------------------------------------


def test_fsx(tmp_path):
    """Random writes, reads, truncates and mmap writes on one file in the mount and on a plain
    file, compared after every operation (fsx, in short)."""
    seed = int(os.environ.get("CKPTFS_FSX_SEED", random.SystemRandom().randrange(1 << 32)))
    ops = int(os.environ.get("CKPTFS_FSX_OPS", "3000"))
    rng = random.Random(seed)
    src, plain_dir = tmp_path / "src", tmp_path / "plain"
    src.mkdir()
    plain_dir.mkdir()
    log = []
    with Mount(src, tmp_path / "mnt") as m:
        paths = [pathlib.Path(m.mnt) / "fsx.bin", plain_dir / "fsx.bin"]
        fds = [os.open(p, os.O_RDWR | os.O_CREAT, 0o644) for p in paths]
        maxlen = 1 << 20
        try:
            for i in range(ops):
                op = rng.choice(["write", "write", "read", "truncate", "mapwrite", "mapread", "reopen"])
                size = os.fstat(fds[1]).st_size
                off = rng.randrange(0, maxlen)
                n = rng.randrange(1, 65536)
                log.append(f"{i} {op} off={off} n={n} size={size}")
                if op == "write":
                    data = rng.randbytes(n)
                    for fd in fds:
                        os.pwrite(fd, data, off)
                elif op == "truncate":
                    for fd in fds:
                        os.ftruncate(fd, off)
                elif op in ("mapwrite", "mapread") and size > 0:
                    off, n = off % size, min(n, size - off % size)
                    got = []
                    for fd in fds:
                        mm = mmap.mmap(fd, size)
                        if op == "mapwrite":
                            mm[off:off + n] = bytes([i % 251]) * n
                            mm.flush()
                        got.append(mm[off:off + n])
                        mm.close()
                    assert got[0] == got[1], f"mmap read at {off}+{n} differs"
                elif op == "reopen":
                    for k, p in enumerate(paths):
                        os.close(fds[k])
                        fds[k] = os.open(p, os.O_RDWR)
                a, b = (os.pread(fd, n, off) for fd in fds)
                assert a == b, f"read at {off}+{n}: {len(a)} vs {len(b)} bytes"
                sa, sb = (os.fstat(fd).st_size for fd in fds)
                assert sa == sb, f"size {sa} vs {sb}"
            a, b = (pathlib.Path(p).read_bytes() for p in paths)
            assert a == b, "whole file differs"
        except AssertionError as e:
            raise AssertionError(f"fsx seed {seed} (CKPTFS_FSX_SEED={seed} replays it): {e}\n"
                                 + "\n".join(log[-12:])) from None
        finally:
            for fd in fds:
                os.close(fd)
    print(f"\nfsx: seed {seed}, {ops} operations")


# --- replace by rename --------------------------------------------------------------------------


_WATCH = r'''
import os, sys
path = sys.argv[1]
misses = 0
for line in sys.stdin:
    try:
        os.stat(path)
        fd = os.open(path, os.O_RDONLY)
        os.read(fd, 8)
        os.close(fd)
    except OSError:
        misses += 1
    sys.stdout.write(".\n")
    sys.stdout.flush()
print(misses)
'''


def st_file(n: int, name: str = "w") -> bytes:
    h = json.dumps({name: {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]}}).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + os.urandom(4 * n)


@pytest.mark.parametrize("name", ["model.safetensors", "notes.bin"])
def test_replace_by_rename_is_visible_at_once(tmp_path, name):
    """1,000 replace-by-rename cycles (a temp file written, closed and renamed over the name,
    as save_pretrained and every safe writer do); right after each rename returns, another
    process stats and opens the name: zero misses."""
    src = tmp_path / "src"
    src.mkdir()
    with Mount(src, tmp_path / "mnt", opts=["ranks=2"]) as m:
        d = pathlib.Path(m.mnt)
        watcher = subprocess.Popen([sys.executable, "-c", _WATCH, str(d / name)], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True)
        try:
            for i in range(1000):
                body = st_file(16 + i % 7) if name.endswith(".safetensors") else os.urandom(100)
                (d / "x.tmp").write_bytes(body)
                os.rename(d / "x.tmp", d / name)
                watcher.stdin.write("\n")
                watcher.stdin.flush()
                assert watcher.stdout.readline() == ".\n"
            watcher.stdin.close()
            misses = int(watcher.stdout.readline())
        finally:
            watcher.kill()
        assert misses == 0, f"{misses} of 1000 stats or opens missed {name} right after the rename"
        assert (d / name).read_bytes() == body


# --- cp -a, rsync -a, tar x -------------------------------------------------------------------


def tree(root: pathlib.Path) -> dict:
    out = {}
    for p in sorted(root.rglob("*")):
        s = p.lstat()
        rel = str(p.relative_to(root))
        out[rel] = (oct(s.st_mode), s.st_mtime_ns, p.read_bytes() if p.is_file() else None)
    return out


@pytest.fixture
def sample_tree(tmp_path):
    """A checkpoint as save_pretrained leaves it (2 files + index), a config, a nested dir,
    modes and times of their own."""
    t = tmp_path / "tree"
    (t / "ck" / "sub").mkdir(parents=True)
    (t / "ck" / "model-00001-of-00002.safetensors").write_bytes(st_file(4096, "a.weight"))
    (t / "ck" / "model-00002-of-00002.safetensors").write_bytes(st_file(100, "b.weight"))
    (t / "ck" / "model.safetensors.index.json").write_text('{"metadata": {}, "weight_map": {}}\n')
    (t / "ck" / "config.json").write_text("{}\n")
    (t / "ck" / "sub" / "notes.txt").write_text("n\n")
    # A LoRA adapter's file: safetensors under a name that is no model name (stored whole).
    (t / "ck" / "adapter_model.safetensors").write_bytes(st_file(64, "lora_A.weight"))
    os.chmod(t / "ck" / "model-00002-of-00002.safetensors", 0o640)
    for i, p in enumerate(sorted(t.rglob("*"), reverse=True)):
        os.utime(p, ns=(1_600_000_000_000_000_000 + i, 1_600_000_000_000_000_000 + i * 1000))
    return t


@pytest.mark.parametrize("split", ["prompt", "late"])
@pytest.mark.parametrize("tool", ["cp", "rsync", "rsync-inplace", "tar"])
def test_copy_tools_keep_modes_and_times(tmp_path, sample_tree, tool, split):
    """Every file's and directory's mode and mtime, the checkpoint directory's own included (its
    view shows its newest input's mtime: the shards' and their commit records', which carry the
    copied file's times), files under 8 bytes and adapter_model.safetensors (kept whole after
    being held or routed while written) included. tools/setup.sh installs rsync.
    `late`: each split after close waits 300 ms (the hidden -o split_delay_ms), so it commits
    after the tool set the times, the directory's last (on a busy machine it does so anyway):
    the directory keeps the mtime the tool gave it, and the files the times."""
    if tool.startswith("rsync") and shutil.which("rsync") is None:
        pytest.skip("needs rsync (tools/setup.sh installs it)")
    src = tmp_path / "src"
    src.mkdir()
    # No attribute cache: each stat asks the daemon (a cached answer to the tool's own utimens
    # would hide a time lost afterwards, at close).
    opts = ["ranks=2", "attr_timeout=0"] + (["split_delay_ms=300"] if split == "late" else [])
    with Mount(src, tmp_path / "mnt", opts=opts) as m:
        dst = pathlib.Path(m.mnt)
        plain = tmp_path / "plain"
        plain.mkdir()
        for target in (plain, dst):
            if tool == "cp":
                subprocess.run(["cp", "-a", str(sample_tree / "ck"), str(target)], check=True)
            elif tool.startswith("rsync"):
                extra = ["--inplace"] if tool == "rsync-inplace" else []
                r = subprocess.run(["rsync", "-a", *extra, str(sample_tree / "ck"), str(target)],
                                   capture_output=True, text=True)
                assert r.returncode == 0, r.stderr
            else:
                tarball = tmp_path / "ck.tar"
                subprocess.run(["tar", "cf", str(tarball), "-C", str(sample_tree), "ck"], check=True)
                subprocess.run(["tar", "xf", str(tarball), "-C", str(target)], check=True)
        if split == "late":
            splits_done(m.mnt)
        want, got = tree(plain / "ck"), tree(dst / "ck")
        want["."] = (oct((plain / "ck").stat().st_mode), (plain / "ck").stat().st_mtime_ns, None)
        got["."] = (oct((dst / "ck").stat().st_mode), (dst / "ck").stat().st_mtime_ns, None)
        bad = {k: (want.get(k, (None,))[:2], got.get(k, (None,))[:2]) for k in set(want) | set(got)
               if want.get(k) != got.get(k)}
        assert not bad, f"{tool}: differs from the plain copy (mode, mtime): {bad}"
        # The shards were made (the files are stored as rank shards), and a second rsync sends
        # nothing: the mount says what the plain copy says.
        assert [n for n in os.listdir(src / "ck") if n.startswith("shard-")]
        if tool.startswith("rsync"):
            extra = ["--inplace"] if tool == "rsync-inplace" else []
            r = subprocess.run(["rsync", "-a", "--itemize-changes", *extra, str(sample_tree / "ck"),
                                str(dst)], capture_output=True, text=True)
            assert r.returncode == 0, r.stderr
            sent = [ln for ln in r.stdout.splitlines() if ln.startswith(">f")]
            assert not sent, f"a second rsync sent again: {sent}"
        assert m.proc.poll() is None


def test_attributes_set_right_after_close_keep_the_split(tmp_path):
    """shutil.copy2 (and cp -p, mv across file systems) sets a copy's mode and times after its
    close, while its split after close is pending: that is the daemon's own change of the one
    shard's attributes, not of its bytes, so the split still goes ahead. Every rank shard then
    has the mode and times given, and the bytes read back."""
    src = tmp_path / "src"
    src.mkdir()
    t = 1_600_000_000_000_000_000
    body = st_file(4096, "a.weight")
    orig = tmp_path / "orig.safetensors"
    orig.write_bytes(body)
    os.chmod(orig, 0o640)
    os.utime(orig, ns=(t, t))
    with Mount(src, tmp_path / "mnt", opts=["ranks=2", "split_delay_ms=300"]) as m:
        mnt = pathlib.Path(m.mnt)
        shutil.copy2(orig, mnt / "model.safetensors")  # copyfile, then chmod and utime by path
        (mnt / "ck").mkdir()
        (mnt / "ck" / "model.safetensors").write_bytes(body)
        with open(mnt / "ck" / "model.safetensors", "rb") as f:  # through a descriptor too
            os.chmod(f.fileno(), 0o600)
            os.utime(f.fileno(), ns=(t, t))
        splits_done(m.mnt)
        for d, mode in ((src, 0o640), (src / "ck", 0o600)):
            shards = sorted(n for n in os.listdir(d) if n.startswith("shard-"))
            assert len(shards) == 2, f"{d}: {sorted(os.listdir(d))}"
            got = {n: ((d / n).stat().st_mtime_ns, (d / n).stat().st_mode & 0o7777) for n in shards}
            assert set(got.values()) == {(t, mode)}, got
        for f in (mnt / "model.safetensors", mnt / "ck" / "model.safetensors"):
            assert f.read_bytes() == body
            assert f.stat().st_mtime_ns == t


def test_times_set_after_a_split_reach_every_shard(tmp_path):
    """A utimens through a descriptor opened before the split after close committed (its view
    still shows the file as one shard) reaches every rank shard the split made, and the record:
    the file shows the times it was given, in SRC and through the next mount."""
    src = tmp_path / "src"
    src.mkdir()
    t = 1_600_000_000_000_000_000
    with Mount(src, tmp_path / "mnt", opts=["ranks=2", "split_delay_ms=300"]) as m:
        f = pathlib.Path(m.mnt) / "model.safetensors"
        f.write_bytes(st_file(4096, "a.weight"))
        fd = os.open(f, os.O_RDONLY)  # the file as one shard, before its split
        try:
            splits_done(m.mnt)
            assert len([n for n in os.listdir(src) if n.startswith("shard-")]) == 2
            os.utime(fd, ns=(t, t))
        finally:
            os.close(fd)
    times = {n: (src / n).stat().st_mtime_ns for n in os.listdir(src) if n.startswith("shard-")}
    assert times and set(times.values()) == {t}, times
    assert (src / ".ckptfs" / "model.safetensors.commit").stat().st_mtime_ns == t
    with Mount(src, tmp_path / "mnt") as m:
        assert (pathlib.Path(m.mnt) / "model.safetensors").stat().st_mtime_ns == t
