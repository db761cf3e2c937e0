"""Shared fixtures for the real-mount and ecosystem tests (tiers 3 and 4).

Tests mount real FUSE filesystems with the built `ckptfs` binary (CKPTFS_BIN, default
build/src/ckptfs) and need root and /dev/fuse; without them they are skipped, never faked.
Every daemon is started through mount_util.Mount (re-exported here). They run as meson's
`mount` and `mpi` suites (tests/python/run_suite.sh): the tests marked `mpi` (under mpirun)
form the second.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import time

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
# The one daemon start-up helper (and the binary under test), re-exported for the test files.
from mount_util import BIN, ROOT, DaemonExited, Mount, Mounts, is_mounted, mount_entry, unmount  # noqa: E402,F401

sys.path.insert(0, str(ROOT / "tools"))


def pytest_configure(config):
    config.addinivalue_line("markers", "mpi: runs ckptfs under mpirun (meson's mpi suite; the "
                            "mount suite deselects these)")


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


@pytest.fixture
def small_tmpfs(tmp_path):
    """An 8 MiB tmpfs mounted at tmp_path/tmpfs (real ENOSPC); unmounted at teardown."""
    d = tmp_path / "tmpfs"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "ckptfs-test", str(d)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", str(d)], capture_output=True)
        if os.path.ismount(d):
            subprocess.run(["umount", "-l", str(d)], capture_output=True)


@pytest.fixture
def mount_factory(tmp_path):
    """make(src, **Mount's parameters) -> a started Mount at tmp_path/mntN; all stopped at
    teardown (their exit status unchecked)."""
    mounts = Mounts(tmp_path)
    yield mounts
    mounts.close()
