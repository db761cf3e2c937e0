"""Helpers for the hostile-input tests (test_hostile.py, test_mount_fuzz.py).

Hostile inputs can wedge a FUSE daemon, and a process waiting on a FUSE request that the daemon
already took cannot even be killed until the daemon answers. So nothing here touches the mount
from the pytest process itself:
  * `Prober` is a child Python process that does the filesystem calls through the mount and
    answers over a pipe; a call that does not answer within its timeout raises `Hang` (an
    AssertionError, so the test fails naming the call) and the child is abandoned;
  * `hostile_mount` is conftest's Mount (a wrapper, a preexec_fn, ... are its parameters) set to
    check and stop the daemon without stat'ing the mount point (it reads /proc/self/mountinfo);
  * `cli()` runs the ckptfs CLI with a timeout and reports a hang or a signal as such.
"""

from __future__ import annotations

import base64
import json
import os
import pathlib
import select
import shutil
import subprocess
import sys
import time

import pytest

from conftest import BIN, Mount, Mounts, mount_entry  # noqa: F401  (mount_entry: re-exported)
from conftest import wait_for as _wait_for

MODEL_FILE_PREFIX = "model-"
INDEX = "model.safetensors.index.json"


class Hang(AssertionError):
    """A filesystem call through the mount (or a command) did not answer in time."""


# The child: one JSON request per line on stdin, one JSON answer per line on stdout.
_CHILD = r'''
import base64, json, os, stat, sys
fds = {}

def b64(b):
    return base64.b64encode(b).decode()

def st(s):
    return {"mode": s.st_mode, "ino": s.st_ino, "size": s.st_size, "uid": s.st_uid,
            "gid": s.st_gid, "nlink": s.st_nlink, "mtime": s.st_mtime, "mtime_ns": s.st_mtime_ns,
            "blocks": s.st_blocks}

def readall(fd):
    out, off = [], 0
    while True:
        b = os.pread(fd, 1 << 20, off)
        if not b:
            return b"".join(out)
        out.append(b)
        off += len(b)

def do(op, a):
    if op == "listdir":
        return os.listdir(a[0])
    if op == "stat":
        return st(os.stat(a[0]))
    if op == "lstat":
        return st(os.lstat(a[0]))
    if op == "readlink":
        return os.readlink(a[0])
    if op == "read":
        fd = os.open(a[0], os.O_RDONLY)
        try:
            return b64(readall(fd))
        finally:
            os.close(fd)
    if op == "read_nonblock":
        fd = os.open(a[0], os.O_RDONLY | os.O_NONBLOCK)
        try:
            return b64(os.read(fd, a[1]))
        finally:
            os.close(fd)
    if op == "open":
        fd = os.open(a[0], a[1])
        fds[fd] = a[0]
        return fd
    if op == "pread":
        return b64(os.pread(a[0], a[1], a[2]))
    if op == "readall":
        return b64(readall(a[0]))
    if op == "fstat":
        return st(os.fstat(a[0]))
    if op == "fadvise_dontneed":
        os.posix_fadvise(a[0], 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    if op == "close":
        fds.pop(a[0], None)
        os.close(a[0])
        return True
    if op == "ping":
        return os.getpid()
    raise ValueError("unknown op " + op)

for line in sys.stdin:
    req = json.loads(line)
    try:
        res = {"ok": do(req["op"], req["args"])}
    except OSError as e:
        res = {"errno": e.errno, "msg": e.strerror, "file": e.filename}
    except Exception as e:
        res = {"exc": repr(e)}
    sys.stdout.write(json.dumps(res) + "\n")
    sys.stdout.flush()
'''

_ABANDONED: list[subprocess.Popen] = []


class Prober:
    """Filesystem calls through the mount, made by a child process, each with a timeout."""

    BYTES_OPS = {"read", "read_nonblock", "pread", "readall"}

    def __init__(self, timeout: float = 20.0):
        self.timeout = timeout
        self.p: subprocess.Popen | None = None
        self.pending = None
        self._spawn()

    def _spawn(self):
        self.p = subprocess.Popen([sys.executable, "-I", "-c", _CHILD], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd="/")
        self._buf = b""
        self.pending = None

    def submit(self, op: str, *args):
        assert self.pending is None, "one call at a time per Prober"
        args = [os.fsdecode(a) if isinstance(a, os.PathLike) else a for a in args]
        self.p.stdin.write((json.dumps({"op": op, "args": args}) + "\n").encode())
        self.p.stdin.flush()
        self.pending = (op, args, time.monotonic())

    def done(self) -> bool:
        """True when the pending call has answered (result() will not block)."""
        if b"\n" in self._buf:
            return True
        r, _, _ = select.select([self.p.stdout], [], [], 0)
        if r:
            chunk = os.read(self.p.stdout.fileno(), 1 << 20)
            if not chunk:
                return True
            self._buf += chunk
        return b"\n" in self._buf

    def result(self, timeout: float | None = None):
        op, args, t0 = self.pending
        timeout = self.timeout if timeout is None else timeout
        deadline = t0 + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                self._abandon()
                raise Hang(f"{op}{tuple(args)!r} through the mount did not answer within "
                           f"{timeout:.0f} s (hung)")
            r, _, _ = select.select([self.p.stdout], [], [], left)
            if r:
                chunk = os.read(self.p.stdout.fileno(), 1 << 20)
                if not chunk:
                    self.pending = None
                    rc = self.p.wait()
                    self._spawn()
                    raise AssertionError(f"prober died ({rc}) during {op}{tuple(args)!r}")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        self.pending = None
        res = json.loads(line)
        if "errno" in res:
            raise OSError(res["errno"], res["msg"], res.get("file"))
        if "exc" in res:
            raise RuntimeError(f"{op}{tuple(args)!r}: {res['exc']}")
        v = res["ok"]
        if op in self.BYTES_OPS:
            return base64.b64decode(v)
        return v

    def call(self, op: str, *args, timeout: float | None = None):
        self.submit(op, *args)
        return self.result(timeout)

    def elapsed(self) -> float:
        return time.monotonic() - self.pending[2] if self.pending else 0.0

    def _abandon(self):
        """Kills a child stuck in the mount. One blocked in a FUSE request the daemon already
        took dies only when the daemon answers or goes away: it is reaped at the end."""
        try:
            self.p.kill()
        except ProcessLookupError:
            pass
        try:
            self.p.wait(timeout=2)
        except subprocess.TimeoutExpired:
            _ABANDONED.append(self.p)
        self._spawn()

    # conveniences
    def listdir(self, p, timeout=None):
        return self.call("listdir", p, timeout=timeout)

    def stat(self, p, timeout=None):
        return self.call("stat", p, timeout=timeout)

    def lstat(self, p, timeout=None):
        return self.call("lstat", p, timeout=timeout)

    def read(self, p, timeout=None) -> bytes:
        return self.call("read", p, timeout=timeout)

    def readlink(self, p, timeout=None) -> str:
        return self.call("readlink", p, timeout=timeout)

    def exists(self, p, timeout=None) -> bool:
        try:
            self.call("lstat", p, timeout=timeout)
            return True
        except FileNotFoundError:
            return False

    def close(self):
        if self.p is None:
            return
        try:
            self.p.stdin.close()
        except OSError:
            pass
        try:
            self.p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.p.kill()
            try:
                self.p.wait(timeout=2)
            except subprocess.TimeoutExpired:
                _ABANDONED.append(self.p)
        self.p = None


def reap_abandoned():
    for p in list(_ABANDONED):
        try:
            p.wait(timeout=5)
            _ABANDONED.remove(p)
        except subprocess.TimeoutExpired:
            pass


@pytest.fixture
def prober():
    pr = Prober()
    yield pr
    pr.close()


# --- mounts ----------------------------------------------------------------------------------


def hostile_mount(src, mnt, **kw) -> Mount:
    """conftest's Mount as the hostile tests run it: started and stopped without a stat of the
    mount point from the pytest process (it reads /proc/self/mountinfo), 30 s to start, and the
    abandoned probers reaped once the daemon is gone. Takes every Mount parameter (prefix: a
    wrapper that execs the daemon, preexec_fn, ...)."""
    return Mount(src, mnt, **{"probe": "mountinfo", "start_timeout": 30.0,
                              "after_stop": reap_abandoned, **kw})


@pytest.fixture
def mounts(tmp_path):
    """Factory of hostile_mounts (like conftest's mount_factory); every one is stopped at
    teardown, and a daemon that was running then and exits non-zero fails the test."""
    made = Mounts(tmp_path, cls=hostile_mount, check=True)
    yield made
    problems = made.close()
    if problems:
        pytest.fail("\n".join(problems))


@pytest.fixture
def world_tmp():
    """A scratch directory every user can traverse (pytest's tmp_path is 0700)."""
    import tempfile
    d = tempfile.mkdtemp(prefix="ckptfs-hostile-", dir="/tmp")
    os.chmod(d, 0o755)
    yield pathlib.Path(d)
    with open("/proc/self/mountinfo") as f:
        busy = any(" " + d in line for line in f)
    if not busy:
        shutil.rmtree(d, ignore_errors=True)


# --- CLI -------------------------------------------------------------------------------------


class CliResult:
    def __init__(self, argv, rc, out: str, err: str, elapsed: float, timed_out: bool):
        self.argv, self.rc, self.stdout, self.stderr = argv, rc, out, err
        self.out = out + err
        self.elapsed, self.timed_out = elapsed, timed_out

    def __repr__(self):
        tail = self.out[-1500:]
        return (f"<{' '.join(map(str, self.argv))}: rc={self.rc} timed_out={self.timed_out} "
                f"{self.elapsed:.1f}s\n{tail}>")


def cli(*args, timeout: float = 60, prefix=()) -> CliResult:
    """Runs `ckptfs ARGS` (optionally under a wrapper); never raises on failure or timeout."""
    argv = [*map(str, prefix), BIN, *map(str, args)]
    t0 = time.monotonic()
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = p.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        timed_out = True
    dec = lambda b: b.decode("utf-8", errors="surrogateescape")  # noqa: E731
    return CliResult(argv, p.returncode, dec(out), dec(err), time.monotonic() - t0, timed_out)


def assert_exit(r: CliResult, code: int, within: float | None = None):
    assert not r.timed_out, f"hung (killed after {r.elapsed:.0f} s): {r!r}"
    assert r.rc >= 0, f"killed by signal {-r.rc}: {r!r}"
    assert r.rc == code, f"exit {r.rc}, expected {code}: {r!r}"
    if within is not None:
        assert r.elapsed < within, f"took {r.elapsed:.1f} s (limit {within} s): {r!r}"


def consolidate_ref(ckdir, out, timeout: float = 60) -> dict[str, bytes]:
    """`ckptfs consolidate` of ckdir into out: {name: bytes} of its model files and index."""
    r = cli("consolidate", ckdir, out, timeout=timeout)
    assert_exit(r, 0)
    return {n: pathlib.Path(out, n).read_bytes() for n in os.listdir(out)
            if n == INDEX or (n.startswith(MODEL_FILE_PREFIX) and n.endswith(".safetensors"))}


def no_openat2_helper() -> pathlib.Path | None:
    p = os.environ.get("CKPTFS_NO_OPENAT2")
    cand = pathlib.Path(p) if p else pathlib.Path(os.path.abspath(BIN)).parents[1] / "tests" / "no_openat2"
    return cand if cand.is_file() and os.access(cand, os.X_OK) else None


def wait_for(pred, what: str, timeout: float = 10.0, interval: float = 0.05):
    """conftest.wait_for, where a Hang fails at once."""
    return _wait_for(pred, what, timeout, interval, fatal=(Hang,))
