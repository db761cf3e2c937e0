"""Helpers for the hostile-input tests (test_hostile.py, test_mount_fuzz.py).

Hostile inputs can wedge a FUSE daemon, and a process waiting on a FUSE request that the daemon
already took cannot even be killed until the daemon answers. So nothing here touches the mount
from the pytest process itself:
  * `Prober` is a child Python process that does the filesystem calls through the mount and
    answers over a pipe; a call that does not answer within its timeout raises `Hang` (an
    AssertionError, so the test fails naming the call) and the child is abandoned;
  * `HMount` is conftest's Mount that can run the daemon under a wrapper or with a preexec_fn,
    and checks and stops it without stat'ing the mount point (it reads /proc/self/mountinfo);
  * `cli()` runs the ckptfs CLI with a timeout and reports a hang or a signal as such.
"""

from __future__ import annotations

import base64
import json
import os
import pathlib
import select
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import BIN, Mount
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


def _unescape_mountinfo(s: str) -> str:
    return (s.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n")
            .replace("\\134", "\\"))


def mount_entry(mnt) -> dict | None:
    """The /proc/self/mountinfo entry of `mnt` (no stat of the mount point itself)."""
    mnt = str(mnt)
    want = os.path.join(os.path.realpath(os.path.dirname(mnt)), os.path.basename(mnt))
    found = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            if _unescape_mountinfo(parts[4]) == want:
                sep = parts.index("-")
                found = {"opts": parts[5].split(","), "fstype": parts[sep + 1],
                         "source": parts[sep + 2], "super_opts": parts[sep + 3].split(",")}
    return found


def is_mounted(mnt) -> bool:
    return mount_entry(mnt) is not None


class HMount(Mount):
    """conftest.Mount, plus: a command prefix (a wrapper that execs the daemon), a preexec_fn,
    and start/stop that never stat the mount point from the pytest process."""

    def __init__(self, src, mnt, opts=(), args=(), settle=0, log=None, prefix=(),
                 preexec_fn=None):
        super().__init__(src, mnt, opts=opts, args=args, settle=settle, log=log)
        self.prefix = [str(p) for p in prefix]
        self.preexec_fn = preexec_fn

    def start(self):
        os.makedirs(self.mnt, exist_ok=True)
        self.logf = open(self.log, "w")
        cmd = [*self.prefix, BIN, "mount", self.src, self.mnt, "-f", "-o", ",".join(self.opts),
               *self.args]
        self.proc = subprocess.Popen(cmd, stdout=self.logf, stderr=subprocess.STDOUT,
                                     preexec_fn=self.preexec_fn)
        deadline = time.monotonic() + 30
        while not is_mounted(self.mnt):
            if self.proc.poll() is not None:
                rc = self.proc.returncode
                self.proc = None
                self.logf.close()
                raise RuntimeError(f"ckptfs exited with {rc}: {self.read_log()}")
            if time.monotonic() > deadline:
                self.stop(check=False)
                raise TimeoutError("mount did not appear: " + self.read_log())
            time.sleep(0.02)
        return self

    def read_log(self) -> str:
        """The daemon's log; bytes that are not UTF-8 (names from SRC) are kept escaped."""
        try:
            return pathlib.Path(self.log).read_bytes().decode("utf-8", errors="backslashreplace")
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def rss_kb(self) -> int:
        for line in pathlib.Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    def stop(self, check=True) -> int | None:
        if self.proc is None:
            return None
        for _ in range(30):
            if not is_mounted(self.mnt):
                break
            try:
                r = subprocess.run(["fusermount3", "-u", self.mnt], capture_output=True,
                                   timeout=10)
                if r.returncode == 0:
                    break
            except subprocess.TimeoutExpired:
                pass
            time.sleep(0.1)
        else:
            subprocess.run(["fusermount3", "-u", "-z", self.mnt], capture_output=True, timeout=10)
        try:
            rc = self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGKILL)
            rc = self.proc.wait()
            if is_mounted(self.mnt):
                subprocess.run(["fusermount3", "-u", "-z", self.mnt], capture_output=True,
                               timeout=10)
        self.logf.close()
        self.proc = None
        reap_abandoned()
        if check:
            assert rc == 0, f"daemon exited {rc} (not 0) at unmount; log tail:\n" + \
                "\n".join(self.read_log().splitlines()[-15:])
        return rc


@pytest.fixture
def mounts(tmp_path):
    """Factory of HMounts (like conftest's mount_factory); every one is stopped at teardown."""
    made = []

    def make(src, mnt=None, **kw):
        m = HMount(src, mnt or tmp_path / f"mnt{len(made)}", **kw)
        made.append(m)
        return m.start()

    yield make
    problems = []
    for m in made:
        was_alive = m.alive()
        rc = m.stop(check=False)
        if was_alive and rc not in (0, None):  # a daemon that died mid-test failed the test
            problems.append(f"{m.mnt}: the daemon exited {rc} (not 0) at unmount; log tail:\n"
                            + "\n".join(m.read_log().splitlines()[-15:]))
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
