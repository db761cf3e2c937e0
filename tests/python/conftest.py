"""Shared fixtures for the real-mount and ecosystem tests (tiers 3 and 4).

Tests mount real FUSE filesystems with the built `ckptfs` binary (CKPTFS_BIN, default
build/src/ckptfs) and need root and /dev/fuse; without them they are skipped, never faked.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = os.environ.get("CKPTFS_BIN", str(ROOT / "build" / "src" / "ckptfs"))
sys.path.insert(0, str(pathlib.Path(__file__).parent))
sys.path.insert(0, str(ROOT / "tools"))


def fuse_available() -> bool:
    return os.geteuid() == 0 and os.path.exists("/dev/fuse") and shutil.which("fusermount3")


requires_fuse = pytest.mark.skipif(not fuse_available(), reason="needs root, /dev/fuse and fusermount3")


def have(module: str) -> bool:
    """Whether `module` imports here (a framework the tests use only when installed)."""
    try:
        __import__(module)
        return True
    except Exception:  # noqa: BLE001  (a framework that does not import here is absent)
        return False


def wait_for(pred, what: str, timeout: float = 10.0, interval: float = 0.05, fatal=()):
    """Polls pred() until it returns something truthy; OSErrors count as 'not yet', while an
    exception of a type in `fatal` fails at once."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        try:
            r = pred()
            if r:
                return r
            last = r
        except fatal:
            raise
        except OSError as e:
            last = e
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")
        time.sleep(interval)


def run(*args, check=True, **kw) -> subprocess.CompletedProcess:
    """Runs the ckptfs binary."""
    return subprocess.run([BIN, *map(str, args)], capture_output=True, text=True, check=check, **kw)


def unmount(mnt: str) -> None:
    for _ in range(50):
        if not os.path.ismount(mnt):
            return
        r = subprocess.run(["fusermount3", "-u", mnt], capture_output=True, text=True)
        if r.returncode == 0:
            return
        time.sleep(0.1)
    subprocess.run(["fusermount3", "-u", "-z", mnt], capture_output=True)


class Mount:
    """A foreground ckptfs daemon serving `src` at `mnt`; unmounted (and checked) on exit."""

    def __init__(self, src, mnt, opts=(), args=(), settle=0, log=None):
        self.src, self.mnt = str(src), str(mnt)
        self.opts = [f"settle={settle}", *opts]
        self.args = list(args)
        self.log = log or (str(mnt) + ".log")
        self.proc: subprocess.Popen | None = None

    # What start() runs and waits for; test_mpi.py's MpiMount (mpirun) overrides these.
    what = "ckptfs"
    start_timeout = 20.0
    new_session = False

    def command(self) -> list[str]:
        return [BIN, "mount", self.src, self.mnt, "-f", "-o", ",".join(self.opts), *self.args]

    def ready(self) -> bool:
        return os.path.ismount(self.mnt)

    def start(self):
        os.makedirs(self.mnt, exist_ok=True)
        self.logf = open(self.log, "w")
        self.proc = subprocess.Popen(self.command(), stdout=self.logf, stderr=subprocess.STDOUT,
                                     start_new_session=self.new_session)
        deadline = time.monotonic() + self.start_timeout
        while not self.ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.what} exited with {self.proc.returncode}: {self.read_log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.what} mount did not appear: " + self.read_log())
            time.sleep(0.02)
        return self

    def read_log(self) -> str:
        try:
            return pathlib.Path(self.log).read_text()
        except OSError:
            return ""

    def stop(self, check=True) -> int | None:
        if self.proc is None:
            return None
        unmount(self.mnt)
        try:
            rc = self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGKILL)
            rc = self.proc.wait()
        self.logf.close()
        self.proc = None
        if check:
            assert rc == 0, f"daemon exited {rc}: {self.read_log()}"
        return rc

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop(check=exc[0] is None)


@pytest.fixture
def mount_factory(tmp_path):
    mounts = []

    def make(src, **kw):
        m = Mount(src, tmp_path / f"mnt{len(mounts)}", **kw).start()
        mounts.append(m)
        return m

    yield make
    for m in mounts:
        m.stop(check=False)
