"""mount_util: the one way the Python tests start a ckptfs daemon (`Mount`) and stop it.

`Mount(src, mnt, ...)` runs `[PREFIX...] ckptfs mount SRC MNT -f -o settle=S,OPTS [ARGS...]`
(settle=None: no settle=), waits until MNT is mounted, and at stop() (or the end of a `with`)
unmounts MNT, reaps the daemon and, with check=True, fails unless it exited 0 (an ASan report
or a leak is a non-zero exit); a daemon that exits before mounting raises DaemonExited. Every start-up variant the tests need is a parameter of the same helper:
  * prefix: a wrapper that execs the daemon (setpriv, prlimit, mpirun -np N ...);
  * foreground=False: no -f (mpirun's ranks); argv: a whole command line of its own instead
    of `ckptfs mount ...` (systemd's ExecStart=), still stopped and reaped here;
  * env, preexec_fn, new_session (stop() then kills the whole process group, e.g. mpirun
    and its ranks);
  * probe="mountinfo": never stat MNT from the pytest process (a wedged daemon would hang
    it), only read /proc/self/mountinfo; probe="stat" (the default) waits until the daemon
    answered a stat of MNT; probe=None does not wait at all (the test waits its own way);
  * ready: a further condition for "started" (mpirun: every rank has reported);
  * start_timeout, stop_timeout, hang_fails (a daemon that outlives stop_timeout after the
    unmount fails the test even with check=False), after_stop (a hook run after the reap).
`Mounts` is the per-test factory behind the fixtures (conftest's mount_factory, hostile_util's
mounts, test_mpi's mpi_mounts): each mount made is stopped at teardown.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pathlib
import signal
import subprocess
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
# The binary under test: meson's `mount`/`mpi` suites set CKPTFS_BIN to the built target.
BIN = os.environ.get("CKPTFS_BIN", str(ROOT / "build" / "src" / "ckptfs"))


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
                found = {"dev": parts[2], "opts": parts[5].split(","), "fstype": parts[sep + 1],
                         "source": parts[sep + 2], "super_opts": parts[sep + 3].split(",")}
    return found


def is_mounted(mnt) -> bool:
    """Whether `mnt` is in the mount table (a dead connection, ENOTCONN, included)."""
    return mount_entry(mnt) is not None


def abort_connection(dev: str | None) -> None:
    """Aborts the FUSE connection of device `dev` ("0:NN"): the only way out of a daemon
    blocked on its own mount, and for the processes waiting on it."""
    if not dev:
        return
    conn = pathlib.Path("/sys/fs/fuse/connections")
    if not any(line.split()[2] == "fusectl" for line in open("/proc/mounts")):
        subprocess.run(["mount", "-t", "fusectl", "none", str(conn)], capture_output=True)
    try:
        (conn / dev.split(":")[1] / "abort").write_text("1")
    except OSError:
        pass


def splits_done(mnt, timeout: float = 120.0) -> None:
    """Waits until mount `mnt` has no split after close left: with write passthrough and more
    than one rank, a file is stored at close as its own one shard and split into its rank
    shards after (status.json's writes.splits_pending)."""
    import json  # noqa: PLC0415
    status = pathlib.Path(mnt) / ".ckptfs" / "status.json"
    deadline = time.monotonic() + timeout
    while json.loads(status.read_text())["writes"]["splits_pending"] != 0:
        if time.monotonic() > deadline:
            raise AssertionError(f"{mnt}: splits after close still pending after {timeout:.0f} s")
        time.sleep(0.02)


def in_proc_mounts(mnt) -> bool:
    """Whether `mnt` is in this process's mount table (a stat of a dead FUSE mount fails)."""
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == str(mnt) for line in f)


def wait_killed_mount_gone(mnt, timeout: float = 10.0) -> None:
    """After its daemon was killed: waits for auto_unmount to take `mnt` out of the mount table
    (/proc is asked: a stat of a dead FUSE mount fails with ENOTCONN, which os.path.ismount
    reads as "not a mount"), and fails if it does not, after a lazy unmount of what is left."""
    deadline = time.monotonic() + timeout
    while in_proc_mounts(mnt):
        if time.monotonic() > deadline:
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)
            raise AssertionError(f"{mnt}: the killed daemon's mount still there after {timeout:.0f} s")
        time.sleep(0.05)


@contextlib.contextmanager
def killed(m):
    """Runs the body on started mount `m` (it gets the mount point), then kills the daemon
    (kill -9) and waits until auto_unmount took its mount away; whatever the body raised, the
    mount is taken down."""
    try:
        yield pathlib.Path(m.mnt)
        m.proc.send_signal(signal.SIGKILL)
        m.proc.wait(timeout=30)
    finally:
        rc = m.stop(check=False)
        unmount(m.mnt)
    assert rc == -signal.SIGKILL, f"the daemon exited {rc}, not killed"
    wait_killed_mount_gone(m.mnt)


def unmount(mnt, mounted=os.path.ismount) -> None:
    """`fusermount3 -u MNT` until `mounted(MNT)` is false (about 5 s), then a lazy unmount."""
    mnt = str(mnt)
    for _ in range(50):
        if not mounted(mnt):
            return
        try:
            r = subprocess.run(["fusermount3", "-u", mnt], capture_output=True, timeout=10)
            if r.returncode == 0:
                return
        except subprocess.TimeoutExpired:
            pass
        time.sleep(0.1)
    subprocess.run(["fusermount3", "-u", "-z", mnt], capture_output=True, timeout=10)


class DaemonExited(RuntimeError):
    """The daemon exited before MNT was mounted (rc, and its log)."""

    def __init__(self, what: str, rc: int, log: str):
        super().__init__(f"{what} exited with {rc}: {log}")
        self.rc, self.log = rc, log


class Mount:
    """A ckptfs daemon serving `src` at `mnt`; see the module docstring for the parameters."""

    def __init__(self, src, mnt, opts=(), args=(), settle=0, log=None, *, prefix=(),
                 foreground=True, argv=None, env=None, preexec_fn=None, new_session=False,
                 probe="stat", ready=None, start_timeout=20.0, stop_timeout=20.0,
                 hang_fails=False, after_stop=None, what="ckptfs"):
        assert probe in ("stat", "mountinfo", None), probe
        self.src, self.mnt = str(src), str(mnt)
        self.opts = [*([] if settle is None else [f"settle={settle}"]), *opts]
        self.args = list(args)
        self.log = log or (str(mnt) + ".log")
        self.prefix = [str(p) for p in prefix]
        self.foreground = foreground
        self.argv = None if argv is None else [str(a) for a in argv]
        self.env, self.preexec_fn, self.new_session = env, preexec_fn, new_session
        self.probe, self.extra_ready = probe, ready
        self.start_timeout, self.stop_timeout = start_timeout, stop_timeout
        self.hang_fails, self.after_stop = hang_fails, after_stop
        self.what = what  # what the messages call the process started
        self.dev: str | None = None  # the FUSE connection's device, once mounted
        self.proc: subprocess.Popen | None = None
        self.logf = None

    def command(self) -> list[str]:
        if self.argv is not None:
            return self.argv
        return [*self.prefix, BIN, "mount", self.src, self.mnt, *(["-f"] if self.foreground else []),
                "-o", ",".join(self.opts), *self.args]

    # --- state ------------------------------------------------------------------------------

    def mounted(self) -> bool:
        """MNT is mounted, checked as `probe` says (the mount table only, or a stat)."""
        return is_mounted(self.mnt) if self.probe != "stat" else os.path.ismount(self.mnt)

    def ready(self) -> bool:
        return self.mounted() and (self.extra_ready is None or bool(self.extra_ready(self)))

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def rss_kb(self) -> int:
        for line in pathlib.Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    def read_log(self) -> str:
        """The daemon's log; bytes that are not UTF-8 (names from SRC) are kept escaped."""
        try:
            return pathlib.Path(self.log).read_bytes().decode("utf-8", errors="backslashreplace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 200) -> str:
        return "\n".join(self.read_log().splitlines()[-lines:])

    def abort_connection(self) -> None:
        """Aborts this mount's FUSE connection (a daemon blocked on its own mount)."""
        abort_connection(self.dev or (mount_entry(self.mnt) or {}).get("dev"))

    # --- start and stop ---------------------------------------------------------------------

    def start(self):
        os.makedirs(self.mnt, exist_ok=True)
        self.logf = open(self.log, "w")
        env = None if self.env is None else {**os.environ, **self.env}
        self.proc = subprocess.Popen(self.command(), stdout=self.logf, stderr=subprocess.STDOUT,
                                     env=env, preexec_fn=self.preexec_fn,
                                     start_new_session=self.new_session)
        if self.probe is None:
            return self
        deadline = time.monotonic() + self.start_timeout
        while not self.ready():
            if self.proc.poll() is not None:
                rc = self.proc.returncode
                self.proc = None
                self.logf.close()
                raise DaemonExited(self.what, rc, self.read_log())
            if time.monotonic() > deadline:
                log = self.read_log()
                self.stop(check=False)
                raise TimeoutError(f"{self.what} mount did not appear: " + log)
            time.sleep(0.02)
        self.dev = (mount_entry(self.mnt) or {}).get("dev")
        return self

    def _kill(self) -> None:
        try:
            if self.new_session:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the wrapper and what it started
            else:
                self.proc.send_signal(signal.SIGKILL)
        except ProcessLookupError:
            pass

    def stop(self, check=True) -> int | None:
        """Unmounts, reaps the daemon and returns its exit status (None if not started)."""
        if self.proc is None:
            return None
        unmount(self.mnt, mounted=is_mounted if self.probe != "stat" else os.path.ismount)
        hung = False
        try:
            rc = self.proc.wait(timeout=self.stop_timeout)
        except subprocess.TimeoutExpired:
            hung = True
            abort_connection(self.dev)  # a daemon blocked on its own mount cannot be killed
            self._kill()
            rc = self.proc.wait()
        if is_mounted(self.mnt):  # a dead mount (ENOTCONN) that a stat does not see
            subprocess.run(["fusermount3", "-u", "-z", self.mnt], capture_output=True, timeout=10)
        self.logf.close()
        self.proc = None
        if self.after_stop is not None:
            self.after_stop()
        if hung and self.hang_fails:
            raise AssertionError(f"{self.what} did not exit within {self.stop_timeout:.0f} s of "
                                 f"the unmount; log tail:\n{self.log_tail()}")
        if check:
            assert rc == 0, f"{self.what} exited {rc} (not 0) at unmount; log tail:\n{self.log_tail()}"
        return rc

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop(check=exc[0] is None)


class Mounts:
    """The mounts one test makes, as a factory: `make(src, mnt=None, **Mount's parameters)`.
    close() (at teardown) stops every one; with check=True a daemon that was still running
    and exits non-zero at that unmount fails the test."""

    def __init__(self, tmp_path, cls=Mount, check=False, **defaults):
        self.tmp_path, self.cls, self.check, self.defaults = pathlib.Path(tmp_path), cls, check, defaults
        self.made: list[Mount] = []

    def __call__(self, src, mnt=None, **kw) -> Mount:
        m = self.cls(src, mnt or self.tmp_path / f"mnt{len(self.made)}", **{**self.defaults, **kw})
        self.made.append(m)
        return m.start()

    def close(self) -> list[str]:
        """Stops them all; returns (check=True) or ignores the problems found."""
        gc.collect()  # file objects a test left open would keep MNT busy
        problems = []
        for m in self.made:
            was_alive = m.alive()
            rc = m.stop(check=False)
            if self.check and was_alive and rc not in (0, None):
                problems.append(f"{m.mnt}: the daemon exited {rc} (not 0) at unmount; log tail:\n"
                                + m.log_tail(15))
        return problems
