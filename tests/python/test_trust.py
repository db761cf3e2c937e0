"""Tier 3: the writable mount's trust model (issue 18), attacked as local users would.

The daemon runs as root with -o allow_other, as the fstab example has it. The test makes real
users with useradd (ckptfs-a and ckptfs-b in group ckptfs-team, ckptfs-c outside it) and acts
as them through the mount from child processes (/usr/bin/python3 after setgroups/setgid/setuid),
in group-shared (2775) and sticky (1777) directories:

  severe  O_CREAT on a hidden shard name never hands over another user's file; the sticky bit
          holds for hidden and consolidated names (rename over, unlink, rmdir of what the view
          hides); status.json is the mount owner's; node-local MPI mode serves a private file
          to its owner only, and a record the daemon did not write is never read;
  defects what close() returned 0 for reads back or close() fails (plain bytes over a stored
          name, a model name among other files' shards, a header too large to split, a hard
          link made in SRC while writing); the write path's memory is bounded; one refused
          checkpoint of thousands of shards logs one line; the loader under a thread limit
          finishes or fails cleanly and never kills its caller; ckptfs status after errors.

The same classes run in shared-MPI mode where the fs layer is the same code (one case), and the
node-local cases under mpirun. Skipped (never faked) without root, /dev/fuse, useradd.
"""

from __future__ import annotations

import errno
import fcntl
import grp
import json
import os
import pathlib
import pwd
import re
import shutil
import stat
import struct
import subprocess
import sys
import tempfile
import time

import pytest

from conftest import BIN, ROOT, Mount, requires_fuse, wait_for
from mount_util import splits_done

pytestmark = [requires_fuse,
              pytest.mark.skipif(shutil.which("useradd") is None, reason="needs useradd")]

TEAM = "ckptfs-team"
USERS = {"a": ("ckptfs-a", TEAM), "b": ("ckptfs-b", TEAM), "c": ("ckptfs-c", None)}
SHARD1 = "shard-00001-model-00001-of-00001.safetensors"
MODEL = "model.safetensors"
SYS_PY = "/usr/bin/python3"  # the venv lives under /root, which the users cannot enter


# --- users and acting as them ---------------------------------------------------------------


class User:
    def __init__(self, name: str):
        pw = pwd.getpwnam(name)
        self.name, self.uid, self.gid = name, pw.pw_uid, pw.pw_gid

    def __repr__(self):
        return self.name


@pytest.fixture(scope="session")
def users() -> dict[str, User]:
    """ckptfs-a, -b (group ckptfs-team) and -c, made once if missing. pytest-xdist's workers
    (run_suite.sh) ask at once: the check and the useradd run under one lock file."""
    out = {}
    with open("/tmp/ckptfs-test-users.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            grp.getgrnam(TEAM)
        except KeyError:
            subprocess.run(["groupadd", TEAM], check=True, capture_output=True)
        for key, (name, group) in USERS.items():
            try:
                pwd.getpwnam(name)
            except KeyError:
                cmd = ["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin"]
                cmd += ["-N", "-g", group] if group else ["-U"]
                subprocess.run(cmd + [name], check=True, capture_output=True)
            out[key] = User(name)
    return out


# A child that does one filesystem operation and prints its outcome as JSON.
_OP = r'''
import json, os, sys
op, args = sys.argv[1], json.loads(sys.argv[2])
try:
    if op == "open":  # path, flags, mode -> opens, writes stdin if any, reads back
        fd = os.open(args[0], args[1], args[2] if len(args) > 2 else 0o644)
        data = sys.stdin.buffer.read()
        if data:
            os.write(fd, data)
        out = {"ok": True}
        os.close(fd)
    elif op == "read":
        with open(args[0], "rb") as f:
            out = {"ok": len(f.read())}
    elif op == "rename":
        os.rename(args[0], args[1]); out = {"ok": True}
    elif op == "unlink":
        os.unlink(args[0]); out = {"ok": True}
    elif op == "rmdir":
        os.rmdir(args[0]); out = {"ok": True}
    elif op == "mkdir":
        os.mkdir(args[0], args[1]); out = {"ok": True}
    elif op == "save":  # path, bytes from stdin, the way safetensors saves: temp, rename, close
        d, name = os.path.split(args[0])
        tmp = os.path.join(d, ".tmpUSER" + str(os.getpid()))
        data = sys.stdin.buffer.read()
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, args[1] if len(args) > 1 else 0o600)
        os.ftruncate(fd, len(data))
        view = memoryview(data)
        for off in range(0, len(data), 1 << 20):
            os.pwrite(fd, view[off:off + (1 << 20)], off)
        os.rename(tmp, args[0])
        os.close(fd)
        out = {"ok": True}
    elif op == "listdir":
        out = {"ok": sorted(os.listdir(args[0]))}
    elif op == "stat":
        s = os.stat(args[0]); out = {"ok": [s.st_uid, s.st_gid, s.st_mode, s.st_size]}
    else:
        out = {"exc": "unknown op " + op}
except OSError as e:
    out = {"errno": e.errno, "msg": e.strerror}
print(json.dumps(out))
'''


def drop_to(u: User):
    def fn():
        os.initgroups(u.name, u.gid)
        os.setgid(u.gid)
        os.setuid(u.uid)
    return fn


def as_user(u: User, op: str, *args, data: bytes = b"", timeout: float = 60):
    """Runs one operation as `u`; returns the result or raises OSError with its errno."""
    r = subprocess.run([SYS_PY, "-I", "-c", _OP, op, json.dumps([str(a) if isinstance(a, pathlib.Path)
                                                                else a for a in args])],
                       input=data, capture_output=True, preexec_fn=drop_to(u), timeout=timeout,
                       cwd="/")
    assert r.returncode == 0, f"{op} as {u}: exit {r.returncode}: {r.stderr.decode()[-2000:]}"
    res = json.loads(r.stdout)
    if "errno" in res:
        raise OSError(res["errno"], res["msg"])
    if "exc" in res:
        raise RuntimeError(res["exc"])
    return res["ok"]


def errno_of(fn) -> int:
    try:
        fn()
    except OSError as e:
        return e.errno
    return 0


# --- files ------------------------------------------------------------------------------------


def st_bytes(tensors: dict[str, tuple[str, list[int], bytes]], metadata=None) -> bytes:
    """A consolidated safetensors file, written without the safetensors package."""
    header, data, off = {}, b"", 0
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(raw)]}
        data += raw
        off += len(raw)
    if metadata:
        header["__metadata__"] = metadata
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def model_bytes(seed: int, rows: int = 256) -> bytes:
    rnd = __import__("random").Random(seed)
    w = bytes(rnd.getrandbits(8) for _ in range(rows * 64 * 4))
    b = bytes(rnd.getrandbits(8) for _ in range(64 * 4))
    return st_bytes({"layer.weight": ("F32", [rows, 64], w), "layer.bias": ("F32", [64], b)},
                    {"format": "pt"})


@pytest.fixture
def world():
    """A scratch tree every user can traverse: src/ (0755) and mnt/ (pytest's tmp is 0700)."""
    d = pathlib.Path(tempfile.mkdtemp(prefix="ckptfs-trust-", dir="/tmp"))
    os.chmod(d, 0o755)
    (d / "src").mkdir()
    os.chmod(d / "src", 0o755)
    yield d
    with open("/proc/self/mountinfo") as f:
        busy = any(" " + str(d) in line for line in f)
    if not busy:
        shutil.rmtree(d, ignore_errors=True)


def mkdir_as(path: pathlib.Path, uid: int, gid: int, mode: int) -> pathlib.Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, uid, gid)
    os.chmod(path, mode)
    return path


def mount(world, *opts, **kw) -> Mount:
    return Mount(world / "src", world / "mnt", opts=["allow_other", *opts],
                 log=str(world / "mnt.log"), **kw).start()


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read())[1])


# =============================================================================================
# Severe: names the kernel cannot see
# =============================================================================================


def test_o_creat_on_a_hidden_shard_name_hands_over_nothing(world, users):
    """In a group-shared 2775 directory, B's open(O_CREAT|O_RDWR) of the hidden shard of A's
    0600 model is refused (EACCES, the check the kernel makes for that file), the shard stays
    A's, A's model reads back whole; with O_EXCL the name exists (EEXIST)."""
    a, b, c = users["a"], users["b"], users["c"]
    team = mkdir_as(world / "src" / "team", 0, grp.getgrnam(TEAM).gr_gid, 0o2775)
    m = mount(world, "ranks=1")
    try:
        mt = pathlib.Path(m.mnt) / "team"
        body = model_bytes(1)
        as_user(a, "save", mt / MODEL, 0o600, data=body)
        assert os.stat(team / SHARD1).st_uid == a.uid
        assert stat.S_IMODE(os.stat(team / SHARD1).st_mode) == 0o600
        for flags in (os.O_CREAT | os.O_RDWR, os.O_CREAT | os.O_RDONLY, os.O_CREAT | os.O_WRONLY | os.O_TRUNC):
            e = errno_of(lambda: as_user(b, "open", mt / SHARD1, flags, 0o600))
            assert e == errno.EACCES, f"B opened A's 0600 shard with flags {flags:#o} (errno {e})"
        assert errno_of(lambda: as_user(b, "open", mt / SHARD1, os.O_CREAT | os.O_EXCL | os.O_RDWR)) == errno.EEXIST
        st = os.stat(team / SHARD1)
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (a.uid, 0o600), "the shard changed hands"
        assert (mt / MODEL).read_bytes() == body
        assert as_user(a, "read", mt / MODEL) == len(body)
        assert errno_of(lambda: as_user(c, "read", mt / MODEL)) == errno.EACCES
    finally:
        m.stop()


def test_sticky_bit_holds_for_hidden_and_consolidated_names(world, users):
    """In a 1777 directory B can neither rename a file of its own over the hidden shard of A's
    model or over the consolidated name, nor unlink A's model, nor replace A's (empty, hidden)
    .hf_metadata with a directory of its own: EPERM each time, as for visible names."""
    a, b = users["a"], users["b"]
    sticky = mkdir_as(world / "src" / "sticky", 0, 0, 0o1777)
    m = mount(world, "ranks=2")
    try:
        mt = pathlib.Path(m.mnt) / "sticky"
        body = model_bytes(2)
        as_user(a, "save", mt / MODEL, 0o644, data=body)
        splits_done(m.mnt)  # the two rank shards, not the one stored at close
        as_user(a, "mkdir", mt / ".hf_metadata", 0o755)  # hidden once the shards are there
        as_user(b, "open", mt / "evil.bin", os.O_CREAT | os.O_WRONLY, 0o644, data=b"evil")
        as_user(b, "mkdir", mt / "evildir", 0o755)
        for target in (SHARD1, "shard-00002-model-00001-of-00001.safetensors", MODEL):
            e = errno_of(lambda: as_user(b, "rename", mt / "evil.bin", mt / target))
            assert e == errno.EPERM, f"B renamed over A's {target} (errno {e})"
        assert errno_of(lambda: as_user(b, "rename", mt / "evildir", mt / ".hf_metadata")) == errno.EPERM
        assert errno_of(lambda: as_user(b, "unlink", mt / MODEL)) == errno.EPERM
        assert (mt / MODEL).read_bytes() == body
        assert sorted(n for n in os.listdir(sticky) if n.startswith("shard-")) == [
            SHARD1, "shard-00002-model-00001-of-00001.safetensors"]
        # Their owners may.
        as_user(b, "unlink", mt / "evil.bin")
        as_user(a, "unlink", mt / MODEL)
        assert not [n for n in os.listdir(sticky) if n.startswith("shard-")]
    finally:
        m.stop()


def test_rmdir_takes_hidden_entries_only_when_the_caller_could(world, users):
    """C may remove A's directory from a 0777 parent, but the directory is A's and sticky and
    holds A's broken checkpoint (hidden): rmdir answers ENOTEMPTY and the shard stays. In C's
    own directory the same leftovers go with it."""
    a, c = users["a"], users["c"]
    top = mkdir_as(world / "src" / "open", 0, 0, 0o777)
    m = mount(world, "ranks=2")
    try:
        mo = pathlib.Path(m.mnt) / "open"
        for owner, d, mode in ((a, "adir", 0o1777), (c, "cdir", 0o777)):
            as_user(owner, "mkdir", mo / d, mode)
            os.chmod(top / d, mode)  # the caller's umask aside
            as_user(a, "save", mo / d / MODEL, 0o644, data=model_bytes(3))
            splits_done(m.mnt)  # stored as one shard at close; damage the two rank shards
            (top / d / SHARD1).unlink()  # rank 1 lost: refused, nothing shown
            wait_for(lambda: as_user(c, "listdir", mo / d) == [], f"{d} to show nothing")
        assert errno_of(lambda: as_user(c, "rmdir", mo / "adir")) == errno.ENOTEMPTY
        assert (top / "adir" / "shard-00002-model-00001-of-00001.safetensors").exists()
        as_user(c, "rmdir", mo / "cdir")
        assert not (top / "cdir").exists()
    finally:
        m.stop()


def test_status_is_for_the_mounts_owner(world, users):
    """status.json names private directories: only root (the mount's owner) reads it."""
    c = users["c"]
    secret = mkdir_as(world / "src" / "alice" / "secret-project-x", 0, 0, 0o700)
    os.chmod(world / "src" / "alice", 0o700)
    m = mount(world)
    try:
        (pathlib.Path(m.mnt) / "alice" / "secret-project-x" / "ck").mkdir()
        shutil.copy(ROOT / "tests/data/sample/model/shard-00001-model-00001-of-00001.safetensors",
                    secret / "ck")
        status = pathlib.Path(m.mnt) / ".ckptfs" / "status.json"
        assert stat.S_IMODE(os.stat(status).st_mode) == 0o400
        assert errno_of(lambda: as_user(c, "read", status)) == errno.EACCES
        r = subprocess.run([BIN, "status", m.mnt], capture_output=True, text=True,
                           preexec_fn=drop_to(c), timeout=30)
        assert r.returncode == 1 and "secret" not in r.stdout + r.stderr, r
        assert "Permission denied" in r.stderr or "permission" in r.stderr.lower(), r.stderr
        assert json.loads(status.read_text())["source"] == str(world / "src")
    finally:
        m.stop()


# =============================================================================================
# Defects: what close() returned 0 for reads back
# =============================================================================================


def test_plain_bytes_over_a_stored_name_fail_at_close(world, users):
    """O_TRUNC rewrite of a committed model.safetensors with bytes that are no safetensors
    file: close() fails (EINVAL, the stored version stays: a writer killed mid-save looks the
    same); renaming a plain file over it replaces it. Among another file's shards, a model
    name holds only a consolidated file: refused at close, and at rename before anything moves."""
    m = mount(world, "ranks=2")
    try:
        d = pathlib.Path(m.mnt) / "d"
        d.mkdir()
        v1 = model_bytes(5)
        (d / "x.tmp").write_bytes(v1)
        os.rename(d / "x.tmp", d / MODEL)
        assert (d / MODEL).read_bytes() == v1
        fd = os.open(d / MODEL, os.O_WRONLY | os.O_TRUNC)
        os.write(fd, b"hello, not safetensors")
        with pytest.raises(OSError) as ei:
            os.close(fd)
        assert ei.value.errno == errno.EINVAL
        assert (d / MODEL).read_bytes() == v1
        (d / "plain.bin").write_bytes(b"plain")
        os.rename(d / "plain.bin", d / MODEL)
        assert (d / MODEL).read_bytes() == b"plain"
        # A model name among other files' shards.
        e = pathlib.Path(m.mnt) / "e"
        e.mkdir()
        (e / "a.tmp").write_bytes(model_bytes(6))
        os.rename(e / "a.tmp", e / "model-00001-of-00002.safetensors")
        fd = os.open(e / "b.tmp", os.O_RDWR | os.O_CREAT)
        os.write(fd, b"plain")
        os.rename(e / "b.tmp", e / "model-00002-of-00002.safetensors")
        with pytest.raises(OSError) as ei:
            os.close(fd)
        assert ei.value.errno == errno.EINVAL
        (e / "c.bin").write_bytes(b"plain")
        with pytest.raises(OSError) as ei:
            os.rename(e / "c.bin", e / "model-00002-of-00002.safetensors")
        assert ei.value.errno == errno.EINVAL
        assert (e / "c.bin").read_bytes() == b"plain"
        assert (e / "model-00001-of-00002.safetensors").read_bytes() == model_bytes(6)
    finally:
        m.stop()


def test_header_too_large_to_split_is_stored_whole(world):
    """A consolidated file whose rank shard header would pass the 100 MB safetensors cap (520
    tensors with 100 KB names: a 52 MB header, its shard header twice that): close() succeeds
    and it reads back byte for byte (stored whole, as written)."""
    tensors = {(f"t{i:04d}." + "n" * 100_000): ("F32", [1], struct.pack("<f", i)) for i in range(520)}
    body = st_bytes(tensors, {"format": "pt"})
    assert 50_000_000 < struct.unpack("<Q", body[:8])[0] < 100_000_000
    m = mount(world, "ranks=1")
    try:
        d = pathlib.Path(m.mnt) / "big"
        d.mkdir()
        with open(d / ".tmpbig", "wb") as f:
            f.write(body)
            os.rename(d / ".tmpbig", d / MODEL)
        got = (d / MODEL).read_bytes()
        assert got == body, f"read back {len(got)} bytes of {len(body)}"
        assert not [n for n in os.listdir(world / "src" / "big") if n.startswith("shard-")]
        assert "shard header would be" in m.read_log()
    finally:
        m.stop()


def test_hard_link_made_in_src_while_writing_keeps_the_bytes(world):
    """A link made in SRC to the file being written through the mount holds every byte once
    the file is committed as shards (it was an empty placeholder while written)."""
    m = mount(world, "ranks=2")
    try:
        d = pathlib.Path(m.mnt) / "d"
        d.mkdir()
        body = model_bytes(7, rows=4096)
        fd = os.open(d / ".tmpL", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        os.ftruncate(fd, len(body))
        os.pwrite(fd, body[: len(body) // 2], 0)
        os.link(world / "src" / "d" / ".tmpL", world / "src" / "kept.bin")
        os.pwrite(fd, body[len(body) // 2:], len(body) // 2)
        os.rename(d / ".tmpL", d / MODEL)
        os.close(fd)
        assert (world / "src" / "kept.bin").read_bytes() == body
        assert (d / MODEL).read_bytes() == body
        assert [n for n in os.listdir(world / "src" / "d") if n.startswith("shard-")]
    finally:
        m.stop()


@pytest.mark.skipif(bool(os.environ.get("CKPTFS_ASAN")), reason="RSS is meaningless under ASan")
@pytest.mark.parametrize("kernel_writes", ["off", "on"])
def test_write_memory_is_bounded(world, users, kernel_writes):
    """Six writers each hold an unfinished 12 MB header open (any user can, under allow_other):
    with -o write_mem_mb=16 the daemon's RSS grows by well under the 72 MB they sent (through
    requests the headers go to disk; with write passthrough the daemon never holds them);
    every file then completes and reads back exactly."""
    m = mount(world, "ranks=2", "write_mem_mb=16", f"write_passthrough={kernel_writes}")
    try:
        d = pathlib.Path(m.mnt) / "mem"
        d.mkdir()
        os.chmod(d, 0o777)
        before = rss_kb(m.proc.pid)
        bodies, fds = [], []
        for i in range(6):
            names = {f"t{j:05d}." + "x" * 2000: ("F32", [1], struct.pack("<f", j)) for j in range(6000)}
            body = st_bytes(names, {"format": "pt", "i": str(i)})
            hl = struct.unpack("<Q", body[:8])[0]
            assert hl > 12_000_000
            fd = os.open(d / f".tmp{i}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            os.write(fd, body[: 8 + hl - 100])  # the header, all but its last 100 bytes
            bodies.append(body)
            fds.append(fd)
        grown = (rss_kb(m.proc.pid) - before) / 1024
        assert grown < 40, f"daemon RSS grew {grown:.0f} MiB holding 6 unfinished 12 MB headers"
        for i, (fd, body) in enumerate(zip(fds, bodies)):
            hl = struct.unpack("<Q", body[:8])[0]
            os.pwrite(fd, body[8 + hl - 100:], 8 + hl - 100)
            os.rename(d / f".tmp{i}", d / f"model-{i + 1:05d}-of-00006.safetensors")
            os.close(fd)
        for i, body in enumerate(bodies):
            assert (d / f"model-{i + 1:05d}-of-00006.safetensors").read_bytes() == body, i
        if kernel_writes == "off":
            assert "held on disk instead" in m.read_log()
    finally:
        m.stop()


def test_one_refused_checkpoint_logs_one_line(world):
    """5,000 empty shard files (every one a problem): one log line for the checkpoint, naming
    the first problems and how many more."""
    d = world / "src" / "flood"
    d.mkdir()
    for r in range(1, 5001):
        (d / f"shard-{r:05d}-model-00001-of-00001.safetensors").touch()
    m = mount(world)
    try:
        assert os.listdir(pathlib.Path(m.mnt) / "flood") == []
        for _ in range(3):  # revalidations do not log it again
            time.sleep(1.1)
            os.listdir(pathlib.Path(m.mnt) / "flood")
        lines = [ln for ln in m.read_log().splitlines() if "flood" in ln]
        assert 1 <= len(lines) <= 3, f"{len(lines)} log lines about one refused checkpoint"
        assert "4996 more problem(s)" in lines[0], lines[0][:500]
    finally:
        m.stop()


def test_status_after_errors_counts_them(world):
    """Once the daemon counted an error (EIO: a shard truncated under an open file), `ckptfs
    status` prints it (it crashed on exactly that before) and --json reports it by errno."""
    src = world / "src" / "ck"
    shutil.copytree(ROOT / "tests/data/sample/model", src)
    m = mount(world, "prefetch=off")
    try:
        f = pathlib.Path(m.mnt) / "ck" / "model-00001-of-00002.safetensors"
        fd = os.open(f, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            assert len(os.pread(fd, 1, 0)) == 1
            for shard in src.glob("shard-*"):
                os.truncate(shard, os.path.getsize(shard) // 2)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            with pytest.raises(OSError) as ei:
                for off in range(0, size, 1 << 16):
                    os.pread(fd, 1 << 16, off)
            assert ei.value.errno == errno.EIO
        finally:
            os.close(fd)
        r = subprocess.run([BIN, "status", m.mnt], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r
        assert re.search(r"errors: [1-9]\d* \(\d+ EIO\)", r.stdout), r.stdout
        j = json.loads(subprocess.run([BIN, "status", m.mnt, "--json"], capture_output=True,
                                      text=True, timeout=30, check=True).stdout)
        assert j["errors"]["by_errno"]["EIO"] >= 1
    finally:
        m.stop()


# =============================================================================================
# The loader: no exception crosses into its caller
# =============================================================================================


def test_loader_under_a_thread_limit_never_aborts(world, users):
    """As an ordinary user with RLIMIT_NPROC 3, `ckptfs load --threads 16` starts what threads
    it can and finishes (it died of SIGABRT before), and the binding in a plain Python process
    does the same and refuses 100,000 threads with EINVAL (the C API accepted any count)."""
    c = users["c"]
    ck = world / "src" / "ck"
    shutil.copytree(ROOT / "tests/data/sample/model", ck)
    for p in [ck, *ck.rglob("*")]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    r = subprocess.run(["prlimit", "--nproc=3", BIN, "load", str(ck), "--threads", "16"],
                       capture_output=True, text=True, preexec_fn=drop_to(c), timeout=120)
    assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-2000:]}"
    assert "checksum" in r.stdout, r.stdout
    code = (
        "import ctypes, sys\n"
        "from ckptfs_load import Checkpoint, LoadError\n"
        "ck = Checkpoint(sys.argv[1])\n"
        "bufs = [ctypes.create_string_buffer(t.nbytes or 1) for t in ck.tensors]\n"
        "reqs = [(t.name, ctypes.addressof(b), t.nbytes) for t, b in zip(ck.tensors, bufs)]\n"
        "st = ck.load(reqs, threads=16, checksum=True)\n"
        "try:\n"
        "    ck.load(reqs, threads=100000)\n"
        "    print('accepted')\n"
        "except LoadError as e:\n"
        "    print('refused', e.errno)\n"
        "print('ok', st.bytes)\n")
    # The plain build's library: an ASan one would need the ASan runtime preloaded.
    env = {"PYTHONPATH": str(ROOT / "python"),
           "CKPTFS_LOAD_LIB": str(ROOT / "build" / "src" / "libckptfs_load.so"), "PATH": "/usr/bin:/bin"}
    r = subprocess.run(["prlimit", "--nproc=3", SYS_PY, "-c", code, str(ck)], capture_output=True,
                       text=True, preexec_fn=drop_to(c), timeout=120, env=env)
    assert r.returncode == 0, f"the Python process died ({r.returncode}): {r.stderr[-2000:]}"
    assert f"refused {errno.EINVAL}" in r.stdout and "ok " in r.stdout, r.stdout


# =============================================================================================
# Under mpirun: shared targets (the same fs layer) and node-local targets (records)
# =============================================================================================


def _mpi():
    """test_mpi's mpirun mount, or a skip reason."""
    try:
        import test_mpi
    except Exception as e:  # noqa: BLE001  (its importorskips, an OpenMPI-less build)
        pytest.skip(f"test_mpi unavailable: {e}")
    if test_mpi.MPIRUN is None or not test_mpi.built_with_mpi():
        pytest.skip("needs mpirun and a ckptfs built with OpenMPI")
    return test_mpi


@pytest.mark.mpi  # meson's mpi suite
def test_shared_mpi_o_creat_on_a_hidden_shard(world, users):
    """Shared-target MPI mode (np 2): the head's fs layer makes the same check as locally."""
    tm = _mpi()
    a, b = users["a"], users["b"]
    team = mkdir_as(world / "src" / "team", 0, grp.getgrnam(TEAM).gr_gid, 0o2775)
    m = tm.MpiMount(world / "src", world / "mnt", opts=["allow_other"], np=2).start()
    try:
        mt = pathlib.Path(m.mnt) / "team"
        body = model_bytes(9)
        as_user(a, "save", mt / MODEL, 0o600, data=body)
        assert sorted(n for n in os.listdir(team) if n.startswith("shard-")) == [
            SHARD1, "shard-00002-model-00001-of-00001.safetensors"]
        e = errno_of(lambda: as_user(b, "open", mt / SHARD1, os.O_CREAT | os.O_RDWR, 0o600))
        assert e == errno.EACCES, e
        assert os.stat(team / SHARD1).st_uid == a.uid
        assert as_user(a, "read", mt / MODEL) == len(body)
    finally:
        m.stop()


@pytest.mark.mpi  # meson's mpi suite
def test_node_local_private_file_and_records_not_ours(world, users):
    """Node-local targets (np 2, -o target=T/%r): A's 0600 model shows as A's and 0600, reads
    back for A, and is refused to C (it was shown 0444 to everyone: no shard file in SRC carries
    a mode, so the record does). A version 2 record C plants in a .ckptfs of its own, naming A's
    shards on the targets, is never read: nothing is shown there."""
    tm = _mpi()
    a, c = users["a"], users["c"]
    targets = world / "targets"
    targets.mkdir()
    home_a = mkdir_as(world / "src" / "home-a", a.uid, a.gid, 0o755)
    home_c = mkdir_as(world / "src" / "home-c", c.uid, c.gid, 0o755)
    m = tm.MpiMount(world / "src", world / "mnt", opts=["allow_other", f"target={targets}/%r"],
                    np=2).start()
    try:
        ma = pathlib.Path(m.mnt) / "home-a"
        body = model_bytes(10)
        as_user(a, "save", ma / MODEL, 0o600, data=body)
        uid, _, mode, size = as_user(a, "stat", ma / MODEL)
        assert (uid, stat.S_IMODE(mode), size) == (a.uid, 0o600, len(body))  # the file's own
        assert as_user(a, "read", ma / MODEL) == len(body)
        assert errno_of(lambda: as_user(c, "read", ma / MODEL)) == errno.EACCES
        rec = json.loads((home_a / ".ckptfs" / f"{MODEL}.commit").read_text())
        assert rec["ckptfs_record"] == 2 and rec["file_mode"] == 0o600 and rec["file_uid"] == a.uid
        # C's plant: the same record, made readable to all, in C's own directory.
        rec["file_uid"], rec["file_gid"], rec["file_mode"] = c.uid, c.gid, 0o644
        planted = mkdir_as(home_c / ".ckptfs", c.uid, c.gid, 0o700)
        (planted / f"{MODEL}.commit").write_text(json.dumps(rec))
        os.chown(planted / f"{MODEL}.commit", c.uid, c.gid)
        assert as_user(c, "listdir", pathlib.Path(m.mnt) / "home-c") == []
        assert errno_of(lambda: as_user(c, "read", pathlib.Path(m.mnt) / "home-c" / MODEL)) == errno.ENOENT
    finally:
        m.stop()


def test_accelerate_model_folder_is_searched_for_the_caller(world, users):
    """accelerate's layout serves ckpt/model-*.safetensors from ckpt/pytorch_model_fsdp_0/: a
    caller who cannot search that folder in SRC cannot read what the view makes of it, and one
    who can (x only) reads it, as the kernel would decide for the folder's files."""
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    a = users["a"]
    ckpt = world / "src" / "ckpt"
    sub = ckpt / "pytorch_model_fsdp_0"
    sd = {"model": {"layer.weight": torch.arange(64.0).reshape(8, 8)}}
    dcp.save(sd, checkpoint_id=str(sub), no_dist=True)  # torch's own writer, as accelerate calls it
    os.chmod(ckpt, 0o755)
    for p in sub.iterdir():
        os.chmod(p, 0o644)
    m = mount(world)
    try:
        out = pathlib.Path(m.mnt) / "ckpt" / "model-00001-of-00001.safetensors"
        size = len(out.read_bytes())
        os.chmod(sub, 0o700)  # root's folder; its files 0644
        assert errno_of(lambda: as_user(a, "read", sub / ".metadata")) == errno.EACCES
        wait_for(lambda: errno_of(lambda: as_user(a, "read", out)) == errno.EACCES,
                 "a caller who cannot search pytorch_model_fsdp_0/ to be refused its tensors")
        os.chmod(sub, 0o711)  # searchable, not listable: its files can be read in SRC
        assert as_user(a, "read", sub / ".metadata") > 0
        wait_for(lambda: errno_of(lambda: as_user(a, "read", out)) == 0,
                 "a caller who can search pytorch_model_fsdp_0/ to read its tensors")
        assert as_user(a, "read", out) == size
    finally:
        m.stop()
