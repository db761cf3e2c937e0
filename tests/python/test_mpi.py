"""Tier 4: the parallel flush with a real mpirun (issue 10; docs/architecture.md, "The OpenMPI
flusher").

`mpirun -np 3 ckptfs mount SRC MNT` on this one machine: rank 0 serves the mount, ranks 1 and 2
write the shards they own (shard i+1 is owned by rank i % 3) into the shared SRC. Two ways to
simulate the nodes (the `fabric` parameter):
  lo     all ranks in this network namespace, TCP over the loopback interface
         (--mca btl self,tcp --mca btl_tcp_if_include lo);
  netns  ranks 1 and 2 each in its own network namespace, joined to rank 0 by veth pairs on a
         bridge: mpirun sees three hosts (a hostfile of their addresses) and starts the remote
         orted daemons through a plm_rsh_agent script that runs `ip netns exec NS sh -c CMD`
         instead of ssh; out-of-band and MPI traffic both cross the veth links. The file
         system is shared (one machine): the shared-target mode, as on Lustre or NFS.

  1. save_pretrained of a small Llama (2 files + index) into the head's mount: every file reads
     back byte-exact through the mount, SRC holds shard-00001..3 of each file, each written by
     its owner (the ranks' logs), and a plain (non-MPI) remount of SRC reads the same bytes.
  2. a rank killed (-9) mid-flush while a slow writer replaces model.safetensors: under plain
     mpirun the job is aborted (the writer sees an error or the mount disappears); with
     --enable-recovery the job lives and the writer's close fails with EIO after -o
     mpi_timeout. Either way nothing is committed: a plain remount cleans the staging and the
     previous checkpoint reads back byte-exact.
  3. a rank whose target does not hold SRC (-o target=...%r): its staging cannot be opened, so
     the file is stored whole (never split into a set that misses a shard) and reads back exact.
  4. more shards than ranks (-o ranks=5), targets reaching SRC by other paths, an fsync in the
     middle of the file; reads of remote shards over MPI (a reader during the write, a rewrite
     that makes the head stage the whole file); the in-flight bound holding against ranks
     slower than the writer (-o mpi_inflight_mb=2, target_rate_mb=20); -o mpi=off.

Each mpirun lasts a few seconds; the whole file stays well under a minute. Skipped (never
faked) without root, /dev/fuse, fusermount3, mpirun, or a ckptfs built with OpenMPI.
"""

from __future__ import annotations

import errno
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import time

import pytest

from conftest import BIN, DaemonExited, Mount, Mounts, requires_fuse, wait_for

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_write import (  # noqa: E402  (after the importorskips, as test_write needs them)
    MIB, MODEL_RE, SHARD_RE, Writer, blob, make_model, max_shard_size_for, mkdir, names, read,
    save_file_to)
from mount_util import in_proc_mounts, splits_done  # noqa: E402


def built_with_mpi() -> bool:
    try:
        out = subprocess.run(["ldd", BIN], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "libmpi" in out


MPIRUN = shutil.which("mpirun")
pytestmark = [
    pytest.mark.mpi,  # meson's mpi suite
    requires_fuse,
    pytest.mark.skipif(MPIRUN is None, reason="needs mpirun (OpenMPI)"),
    pytest.mark.skipif(not built_with_mpi(), reason="ckptfs was built without OpenMPI (-Dmpi)"),
]

NP = 3
RANK_RE = re.compile(r"mpi rank (\d+) of (\d+) on \S+ \(pid (\d+)\)")


# rtc_hwloc_vmhole=none: mpirun 4.1.4 itself segfaulted about once in 20 starts here, in
# hwloc_shmem_topology_write (sharing its topology through a hole it finds in the address
# space); without the hole it does not share it, and the crash went away.
COMMON_ARGS = ["--mca", "rtc_hwloc_vmhole", "none"]
LO_ARGS = ["--mca", "btl", "self,tcp", "--mca", "btl_tcp_if_include", "lo"]

# The simulated nodes share this machine's /tmp and its host name, so their orted daemons would
# share one session directory (/tmp/ompi.HOST.UID/jf.N/): each orted clears the job family's
# stale directories as it starts, which raced with another creating its own (CI once failed so:
# "mkdir ... /tmp/ompi.vm.0/jf.N/0/1: File exists"). A real node has a /tmp of its own; the agent
# gives each namespace one (orte_tmpdir_base, short: the session holds unix sockets).
AGENT = """#!/bin/sh
# plm_rsh_agent for the tests: "agent HOST CMD..." runs CMD in the network namespace of HOST,
# with a session directory of its own.
host="$1"; shift
ns=$(awk -v h="$host" '$1 == h { print $2 }' "$(dirname "$0")/hosts.map")
[ -n "$ns" ] || { echo "agent: unknown host $host" >&2; exit 1; }
mkdir -p "/tmp/$ns" || exit 1
export OMPI_MCA_orte_tmpdir_base="/tmp/$ns"
exec ip netns exec "$ns" /bin/sh -c "$*"
"""


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


@pytest.fixture(scope="module")
def netns(tmp_path_factory):
    """NP-1 network namespaces on a bridge with rank 0's address; the mpirun arguments that
    place one rank in each. Names and subnet carry this process's id (concurrent runs)."""
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2 (ip) for network namespaces")
    tag = os.getpid() % 1000
    net = f"10.78.{tag % 250}"
    br, made_ns, made_links = f"ckb{tag}", [], []
    d = tmp_path_factory.mktemp("netns")
    try:
        _ip("link", "add", br, "type", "bridge")
        made_links.append(br)
        _ip("addr", "add", f"{net}.1/24", "dev", br)
        _ip("link", "set", br, "up")
        hosts = [f"{net}.1 slots=1"]
        lines = []
        for i in range(2, NP + 1):
            ns, veth = f"ckns{tag}-{i}", f"ckv{tag}-{i}"
            _ip("netns", "add", ns)
            made_ns.append(ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            made_links.append(veth)
            _ip("link", "set", veth, "master", br)
            _ip("link", "set", veth, "up")
            _ip("netns", "exec", ns, "ip", "addr", "add", f"{net}.{i}/24", "dev", "eth0")
            _ip("netns", "exec", ns, "ip", "link", "set", "eth0", "up")
            _ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
            hosts.append(f"{net}.{i} slots=1")
            lines.append(f"{net}.{i} {ns}")
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        for ns in made_ns:
            _ip("netns", "del", ns, check=False)
        for link in made_links:
            _ip("link", "del", link, check=False)
        pytest.skip(f"cannot make network namespaces here: {getattr(e, 'stderr', e)}")
    (d / "agent.sh").write_text(AGENT)
    (d / "agent.sh").chmod(0o755)
    (d / "hosts.map").write_text("\n".join(lines) + "\n")
    (d / "hostfile").write_text("\n".join(hosts) + "\n")
    yield ["--hostfile", str(d / "hostfile"), "--mca", "plm_rsh_agent", str(d / "agent.sh"),
           "--mca", "oob_tcp_if_include", f"{net}.0/24", "--mca", "btl", "self,tcp",
           "--mca", "btl_tcp_if_include", f"{net}.0/24"]
    for ns in made_ns:
        _ip("netns", "del", ns, check=False)
        shutil.rmtree(f"/tmp/{ns}", ignore_errors=True)
    for link in made_links:
        _ip("link", "del", link, check=False)


@pytest.fixture(params=["lo", "netns"])
def fabric(request):
    """The mpirun arguments of one way to simulate the nodes (see the module docstring)."""
    if request.param == "lo":
        return LO_ARGS
    return request.getfixturevalue("netns")


class MpiMount(Mount):
    """conftest's Mount in its mpirun form: `mpirun -np N ckptfs mount SRC MNT` in a session of
    its own (stop() kills mpirun and the ranks it started as one group); started once rank 0
    serves MNT and every other rank has reported; mpirun must exit within 60 s of the unmount
    (a failure even with check=False). Adds the queries of the job's output."""

    def __init__(self, src, mnt, opts=(), np=NP, recovery=False, fabric=None, **kw):
        prefix = [MPIRUN, "--allow-run-as-root", "--oversubscribe", "-np", str(np), *COMMON_ARGS,
                  *(LO_ARGS if fabric is None else fabric)]
        if recovery:
            prefix.append("--enable-recovery")
        kw = {"start_timeout": 30.0, "stop_timeout": 60.0, **kw}
        # The fault tests below drive the request path (each file streamed to its owners as it
        # is written): it is what they name unless a test picks the write path itself.
        if not any(str(o).startswith("write_passthrough=") for o in opts):
            opts = (*opts, "write_passthrough=off")
        super().__init__(src, mnt, opts=opts, prefix=prefix, foreground=False, new_session=True,
                         ready=lambda m: len(m.rank_pids()) == np - 1, hang_fails=True,
                         what="mpirun", **kw)
        self.np = np

    def wait_log(self, pattern: str, timeout=10.0) -> None:
        """Waits until the job's output matches `pattern` (a regex): mpirun forwards the
        processes' output asynchronously, so a line may land a moment after the fact."""
        rx = re.compile(pattern)
        try:
            wait_for(lambda: rx.search(self.read_log()), f"{pattern!r} in the log", timeout=timeout)
        except AssertionError as e:
            raise AssertionError(f"{e}: {self.read_log()[-3000:]}") from None

    def rank_pids(self) -> dict[int, int]:
        return {int(m[1]): int(m[3]) for m in RANK_RE.finditer(self.read_log())}


@pytest.fixture
def mpi_mounts(tmp_path):
    """make(src, mnt, opts=, np=, recovery=, fabric=) -> a started MpiMount; all stopped at
    teardown (their exit status unchecked)."""
    made = Mounts(tmp_path, cls=MpiMount)
    yield made
    made.close()


def assert_kernel_wrote(m) -> None:
    """The kernel wrote the files into the head's SRC itself (write passthrough): no WRITE
    request reached the head. Skipped (never faked) where the kernel refused passthrough."""
    text = m.read_log()
    if "FUSE passthrough is off" in text or "write path: passthrough" not in text:
        pytest.skip("the kernel refused FUSE passthrough")
    w = json.loads((pathlib.Path(m.mnt) / ".ckptfs" / "status.json").read_text())["writes"]
    assert w["passthrough"] and w["backed_opens"] > 0 and w["requests"] == 0, w


def shards_by_file(d) -> dict[tuple[int, int], list[int]]:
    out: dict[tuple[int, int], list[int]] = {}
    for n in os.listdir(d):
        if m := SHARD_RE.match(n):
            out.setdefault((int(m[2]), int(m[3])), []).append(int(m[1]))
    return {k: sorted(v) for k, v in out.items()}


def staging_left(d) -> list[str]:
    st = pathlib.Path(d) / ".ckptfs"
    return sorted(n for n in os.listdir(st) if n.startswith("tx-")) if st.is_dir() else []


WRITE_PATHS = pytest.mark.parametrize("write_path", ["write_passthrough=on", "write_passthrough=off"],
                                      ids=["passthrough", "requests"])


@WRITE_PATHS
def test_save_pretrained_shared_target(mpi_mounts, tmp_path, fabric, write_path):
    """save_pretrained (2 files + index) into the head's mount reads back byte-exact; SRC holds
    the 3 shards of each file (ranks default to the world size) and nothing else by a model
    name; the ranks served the writes (their commands arrived: the files exist only through
    them); a plain remount of SRC without MPI reads the same bytes. Both write paths: with
    passthrough (the default) the kernel writes each file into SRC, close() stores it as its
    one shard, and the split after close sends it to the owners (issue 35 item 3)."""
    model = make_model(7, torch.float32)
    size = max_shard_size_for(model, 2)
    ref = tmp_path / "ref"
    model.save_pretrained(str(ref), max_shard_size=size)
    src = mkdir(tmp_path / "src")
    m = mpi_mounts(src, tmp_path / "mnt", fabric=fabric, opts=(write_path,))
    view = pathlib.Path(m.mnt) / "ck"
    model.save_pretrained(str(view), max_shard_size=size)
    assert names(view) == names(ref)
    for n in names(ref):
        assert read(view / n) == read(ref / n), n
    if write_path.endswith("on"):
        assert_kernel_wrote(m)
        splits_done(m.mnt)
        m.wait_log(r"model-00002-of-00002.safetensors: split into 3 rank shards after its close")
    files = shards_by_file(src / "ck")
    assert files == {(1, 2): [1, 2, 3], (2, 2): [1, 2, 3]}, files
    assert not [n for n in os.listdir(src / "ck") if MODEL_RE.match(n)]
    assert not staging_left(src / "ck")
    if write_path.endswith("off"):
        m.wait_log(r"stored as 3 rank shard\(s\)")
    for n in names(ref):
        assert read(view / n) == read(ref / n), n
    m.stop()
    assert "mpi rank 1: done" in m.read_log() and "mpi rank 2: done" in m.read_log()
    with Mount(src, tmp_path / "plain") as p:
        for n in names(ref):
            assert read(pathlib.Path(p.mnt) / "ck" / n) == read(ref / n), n


def test_mpi_off_keeps_local_flusher(mpi_mounts, tmp_path):
    """-o mpi=off under mpirun -np 1: the local flusher (one shard, as without mpirun)."""
    src = mkdir(tmp_path / "src")
    m = mpi_mounts(src, tmp_path / "mnt", opts=("mpi=off",), np=1)
    mkdir(pathlib.Path(m.mnt) / "d")
    want = save_file_to(pathlib.Path(m.mnt) / "d" / "model.safetensors", 3, 512)
    # A consolidated file can be missing (ENOENT) for a moment right after its close returned,
    # whether written under its final name or renamed there while open (seen with the local
    # flusher alone, about 1 close in 15-30: a read-path race, not the flush's); wait for the
    # name, then check the bytes.
    wait_for(lambda: (pathlib.Path(m.mnt) / "d" / "model.safetensors").exists(), "the name")
    assert read(pathlib.Path(m.mnt) / "d" / "model.safetensors") == want
    assert shards_by_file(src / "d") == {(1, 1): [1]}
    assert "mpi: head" not in m.read_log()
    m.stop()


@pytest.mark.parametrize("recovery", [False, True], ids=["abort", "enable-recovery"])
def test_rank_killed_mid_flush(mpi_mounts, tmp_path, recovery, fabric):
    """kill -9 of rank 2 while a slow writer replaces D/model.safetensors (save_pretrained
    style: .tmpXXXXXX, ftruncate, writes, rename, close). The writer sees an error (EIO from
    close after mpi_timeout, or the mount's connection aborted when mpirun ends the job) and
    never a hang; nothing is committed: after a plain remount (whose recovery removes the
    staging and the empty placeholder) D/model.safetensors is the previous file, byte-exact."""
    src = mkdir(tmp_path / "src")
    m = mpi_mounts(src, tmp_path / "mnt", opts=("mpi_timeout=3",), recovery=recovery,
                   fabric=fabric)
    mnt = pathlib.Path(m.mnt)
    mkdir(mnt / "D")
    old = save_file_to(mnt / "D" / "model.safetensors", 60, 512)
    assert shards_by_file(src / "D") == {(1, 1): [1, 2, 3]}
    new = blob(61, 4096)
    w = Writer(new, mnt / "D" / "model.safetensors", tmp_path, mode="tmp", chunk=128 * 1024,
               sleep=0.02)
    try:
        w.wait_written(MIB)
        os.kill(m.rank_pids()[2], signal.SIGKILL)
        t0 = time.monotonic()
        out, err = w.proc.communicate(timeout=60)  # never a hang
        took = time.monotonic() - t0
    finally:
        if w.proc.poll() is None:
            w.kill()
    err = err.decode(errors="replace")
    assert w.proc.returncode != 0, f"the writer saw no error: {out[-500:]!r}"
    assert ("Input/output error" in err or "connection abort" in err.lower()
            or "Transport endpoint" in err), err[-2000:]
    print(f"\nwriter failed after {took:.1f} s: {err.strip().splitlines()[-1]}")
    if recovery:
        # The job lives on: the mount still serves the previous file. At unmount the head
        # ends the job with MPI_Abort (finalizing would wait for the lost rank forever); stop()
        # fails unless mpirun exits (its status is 0 under --enable-recovery, even so).
        assert os.path.ismount(m.mnt)
        assert read(mnt / "D" / "model.safetensors") == old
        m.wait_log("did not answer within 3 s")
        m.stop(check=False)
        assert "ending the job (MPI_Abort)" in pathlib.Path(m.log).read_text()
    else:
        # mpirun ends the job. FUSE's auto_unmount usually removes the mount, unless mpirun
        # killed fusermount3's watchdog too: then a dead mount (ENOTCONN) stays until
        # `fusermount3 -u` (stop() does it).
        rc = m.stop(check=False)
        assert rc != 0
    assert not in_proc_mounts(m.mnt)
    # Nothing committed: the record still names the previous file's shards.
    with Mount(src, tmp_path / "plain") as p:
        got = pathlib.Path(p.mnt) / "D"
        assert read(got / "model.safetensors") == old
        assert names(got) == ["model.safetensors"], names(got)
        assert not staging_left(src / "D")
    assert shards_by_file(src / "D") == {(1, 1): [1, 2, 3]}


@pytest.mark.parametrize("recovery", [False, True], ids=["abort", "enable-recovery"])
def test_rank_killed_before_the_split_after_close_loses_nothing(mpi_mounts, tmp_path, recovery):
    """With write passthrough close() returns once the file is stored in the head's SRC as its
    own one shard; the split after close sends it to the owners later (held here by the hidden
    -o split_delay_ms). kill -9 of rank 2 before that split loses nothing: under plain mpirun
    the job ends (the head with it); with --enable-recovery the split gives up after
    mpi_timeout, the file stays its one shard and reads back through the mount. Either way a
    plain remount reads the closed bytes back exactly, with no staging left."""
    src = mkdir(tmp_path / "src")
    m = mpi_mounts(src, tmp_path / "mnt", recovery=recovery,
                   opts=("write_passthrough=on", "mpi_timeout=3", "split_delay_ms=1500"))
    mnt = pathlib.Path(m.mnt)
    mkdir(mnt / "D")
    want = save_file_to(mnt / "D" / "model.safetensors", 62, 512)  # close() returned 0
    assert_kernel_wrote(m)
    assert shards_by_file(src / "D") == {(1, 1): [1]}  # the file itself, not split yet
    os.kill(m.rank_pids()[2], signal.SIGKILL)
    if recovery:
        m.wait_log(r"D/model.safetensors: stays stored as one shard: .*rank 2 .*did not answer",
                   timeout=30)
        assert read(mnt / "D" / "model.safetensors") == want
    m.stop(check=False)
    assert not in_proc_mounts(m.mnt)
    with Mount(src, tmp_path / "plain") as p:
        assert read(pathlib.Path(p.mnt) / "D" / "model.safetensors") == want
        assert not staging_left(src / "D")
    assert shards_by_file(src / "D") == {(1, 1): [1]}


def test_rank_without_src_stores_whole(mpi_mounts, tmp_path):
    """Shared mode with -o rank_src=T%r naming empty T1, T2 (a rank that does not see SRC
    there): ranks 1 and 2 cannot open the staging the head made in SRC, so the head keeps the
    file whole rather than split it into a set missing shards; it reads back byte-exact, and
    the error (naming the rank and its host) is in the log."""
    src = mkdir(tmp_path / "src")
    for r in range(NP):
        mkdir(tmp_path / f"t{r}")
    m = mpi_mounts(src, tmp_path / "mnt", opts=(f"rank_src={tmp_path}/t%r",))
    mkdir(pathlib.Path(m.mnt) / "d")
    want = save_file_to(pathlib.Path(m.mnt) / "d" / "model.safetensors", 4, 512)
    assert read(pathlib.Path(m.mnt) / "d" / "model.safetensors") == want
    assert not shards_by_file(src / "d")
    assert read(src / "d" / "model.safetensors") == want
    m.wait_log(r"stored whole, not split: .*rank 1 \(")
    m.stop()


def test_more_shards_than_ranks_target_elsewhere_fsync(mpi_mounts, tmp_path):
    """-o ranks=5 with 3 ranks (shards 1..5 owned by ranks 0,1,2,0,1: a rank with two open
    shards), every rank reaching SRC through its own path (-o rank_src=.../view%r, a symlink to
    SRC: a shared file system mounted elsewhere), and an fsync in the middle of the file (the
    owners' Sync before all bytes came): the file reads back byte-exact, as 5 shards."""
    src = mkdir(tmp_path / "src")
    for r in range(NP):
        os.symlink(src, tmp_path / f"view{r}")
    m = mpi_mounts(src, tmp_path / "mnt", opts=("ranks=5", f"rank_src={tmp_path}/view%r"))
    mnt = pathlib.Path(m.mnt)
    mkdir(mnt / "d")
    want = blob(8, 2048)
    with open(mnt / "d" / ".tmpA1b2C3", "wb") as f:
        f.write(want[:len(want) // 3])
        f.flush()
        os.fsync(f.fileno())
        f.write(want[len(want) // 3:])
        os.rename(mnt / "d" / ".tmpA1b2C3", mnt / "d" / "model.safetensors")
    wait_for((mnt / "d" / "model.safetensors").exists,
             "the name after close (see test_mpi_off_keeps_local_flusher)")
    assert read(mnt / "d" / "model.safetensors") == want
    assert shards_by_file(src / "d") == {(1, 1): [1, 2, 3, 4, 5]}
    m.wait_log(r"stored as 5 rank shard\(s\)")
    m.stop()


def test_read_during_write_and_rewrite_read_back_from_ranks(mpi_mounts, tmp_path):
    """Bytes of shards the ranks own are read back from them over MPI (the Read request) while
    the file is being written: a second descriptor reads what was written so far, exact; then
    a rewrite of an earlier byte (not in stream order) makes the head fall back to staging the
    whole file, which reads every routed byte back from the owners; at close the file is split
    again. It reads back with the rewrite, as 3 shards."""
    src = mkdir(tmp_path / "src")
    m = mpi_mounts(src, tmp_path / "mnt")
    mnt = pathlib.Path(m.mnt)
    mkdir(mnt / "d")
    data = bytearray(blob(9, 1024))
    p = mnt / "d" / "model.safetensors"
    half = len(data) // 2
    with open(p, "wb", buffering=0) as w:
        w.write(data[:half])
        with open(p, "rb", buffering=0) as r:
            assert r.read(half) == bytes(data[:half])
        at = len(data) - (len(data) - half) // 2  # a data byte far into the file's data
        w.write(data[half:])
        w.seek(at)
        w.write(b"\x7f")
        data[at] = 0x7F
    wait_for(p.exists, "the name after close (see test_mpi_off_keeps_local_flusher)")
    assert read(p) == bytes(data)
    assert shards_by_file(src / "d") == {(1, 1): [1, 2, 3]}
    m.stop()


def test_backpressure_bounds_bytes_in_flight(mpi_mounts, tmp_path):
    """A writer faster than the ranks' storage (-o target_rate_mb=20 caps every rank's writes)
    with -o mpi_inflight_mb=2: the bytes sent and not yet delivered never exceed the bound
    (the head logs its peak at unmount; without the bound it would hold rank 1's whole 8 MiB
    chunk), the writer is held back instead, and the file reads back byte-exact."""
    src = mkdir(tmp_path / "src")
    m = mpi_mounts(src, tmp_path / "mnt", opts=("mpi_inflight_mb=2", "target_rate_mb=20"), np=2)
    mkdir(pathlib.Path(m.mnt) / "d")
    p = pathlib.Path(m.mnt) / "d" / "model.safetensors"
    want = save_file_to(p, 10, 16 * 1024)
    wait_for(p.exists, "the name after close (see test_mpi_off_keeps_local_flusher)")
    assert read(p) == want
    assert shards_by_file(src / "d") == {(1, 1): [1, 2]}
    m.stop()
    peak = re.search(r"peak in flight (\d+) MiB", m.read_log())
    assert peak and int(peak[1]) <= 2, m.read_log()[-2000:]


def test_rank_write_error_reaches_the_writer(mpi_mounts, tmp_path):
    """A rank whose storage fills up (hidden -o mpi_fault=2:1: rank 2's writes fail with ENOSPC
    after 1 MiB): the writer's close() fails with ENOSPC, the message (in the log) names the
    file, the shard, the rank and its host; nothing is committed (the previous file stays, no
    staging is left), and the mount keeps serving."""
    src = mkdir(tmp_path / "src")
    m = mpi_mounts(src, tmp_path / "mnt", opts=("mpi_fault=2:1",))
    mnt = pathlib.Path(m.mnt)
    mkdir(mnt / "d")
    old = save_file_to(mnt / "d" / "model.safetensors", 11, 256)  # rank 2 gets < 1 MiB
    new = blob(12, 8 * 1024)
    tmp = mnt / "d" / ".tmpQwErTy"
    f = open(tmp, "wb")
    f.write(new)
    os.rename(tmp, mnt / "d" / "model.safetensors")
    with pytest.raises(OSError) as e:
        f.close()
    assert e.value.errno == errno.ENOSPC, e.value
    m.wait_log(r"\.tmpQwErTy: shard 3 \(sync\): rank 2 \(\S+\): .*No space left on device")
    assert read(mnt / "d" / "model.safetensors") == old
    assert shards_by_file(src / "d") == {(1, 1): [1, 2, 3]}
    assert not staging_left(src / "d")
    m.stop()


def test_rank_write_error_never_reads_back_as_zeros(mpi_mounts, tmp_path):
    """A consolidated file under a name that is not a model file's (weights.safetensors) is
    routed while written and stored whole at close: the head reads every routed byte back from
    the owners. When rank 2's writes failed (-o mpi_fault=2:1), that read fails too: close()
    reports the error instead of storing a file with zeros where rank 2's bytes were lost."""
    src = mkdir(tmp_path / "src")
    m = mpi_mounts(src, tmp_path / "mnt", opts=("mpi_fault=2:1",))
    mnt = pathlib.Path(m.mnt)
    mkdir(mnt / "d")
    new = blob(13, 8 * 1024)
    f = open(mnt / "d" / "weights.safetensors", "wb")
    f.write(new)
    with pytest.raises(OSError) as e:
        f.close()
    assert e.value.errno == errno.ENOSPC, e.value
    # What is stored is what could be read back before the failure: a prefix of the file,
    # cut short (so never mistaken for a complete one), with no zeros standing in for lost bytes.
    got = read(mnt / "d" / "weights.safetensors")
    assert len(got) < len(new) and got == new[:len(got)], (len(got), len(new))
    m.stop()


# --- node-local targets (-o target=T%r) -------------------------------------------------------

def target_shards(t) -> dict[str, list[int]]:
    """Shard files under target directory `t`, by the path of their directory (relative to
    `t`): {".../.ckptfs/nl-...": [shard numbers]}, shards being written (rank-0000i) included;
    anything else in `t` but directories fails."""
    out: dict[str, list[int]] = {}
    for d, dirs, files in os.walk(t):
        for n in files:
            if d == str(t) and n == ".ckptfs-owner":  # the source the target belongs to
                continue
            m = SHARD_RE.match(n) or re.fullmatch(r"rank-(\d{5})", n)
            assert m, f"{d}/{n}: not a shard file in a node-local target"
            out.setdefault(os.path.relpath(d, t), []).append(int(m[1]))
    return {k: sorted(v) for k, v in out.items()}


def owned_by(rank: int, shards: list[int]) -> bool:
    return all((s - 1) % NP == rank for s in shards)


@WRITE_PATHS
def test_save_pretrained_node_local_targets(mpi_mounts, tmp_path, fabric, write_path):
    """-o target=T%r: save_pretrained (2 files + index) into the head's mount reads back
    byte-exact; each target T0..T2 holds only the shards its rank owns (shard i+1 on rank
    i % 3), under ck/.ckptfs/nl-*/; SRC holds no shard file, only the commit records (and the
    plain files); the bytes of ranks 1 and 2 are read back over MPI (ReadPath). After a remount
    under mpirun it reads back the same; a plain remount without MPI lists the files but a read
    fails with EIO (never zeros), naming the rank that holds the shard. With passthrough the
    file is first its own one shard in the head's SRC, which the split after close replaces."""
    model = make_model(17, torch.float32)
    size = max_shard_size_for(model, 2)
    ref = tmp_path / "ref"
    model.save_pretrained(str(ref), max_shard_size=size)
    src = mkdir(tmp_path / "src")
    targets = [tmp_path / f"T{r}" for r in range(NP)]  # made by the ranks (mkdir -p)
    opts = (f"target={tmp_path}/T%r", write_path)
    m = mpi_mounts(src, tmp_path / "mnt", opts=opts, fabric=fabric)
    view = pathlib.Path(m.mnt) / "ck"
    model.save_pretrained(str(view), max_shard_size=size)
    assert names(view) == names(ref)
    for n in names(ref):
        assert read(view / n) == read(ref / n), n
    if write_path.endswith("on"):
        assert_kernel_wrote(m)
        splits_done(m.mnt)
        for n in names(ref):
            assert read(view / n) == read(ref / n), n
    assert not shards_by_file(src / "ck")
    assert not [n for n in os.listdir(src / "ck") if MODEL_RE.match(n)]
    records = sorted(os.listdir(src / "ck" / ".ckptfs"))
    assert records == ["model-00001-of-00002.safetensors.commit",
                       "model-00002-of-00002.safetensors.commit"], records
    for r, t in enumerate(targets):
        held = target_shards(t)
        assert len(held) == 2 and all(d.startswith("ck/.ckptfs/nl-") for d in held), held
        assert all(owned_by(r, v) and v for v in held.values()), (r, held)
    m.stop()
    m2 = mpi_mounts(src, tmp_path / "mnt2", opts=opts, fabric=fabric)
    for n in names(ref):
        assert read(pathlib.Path(m2.mnt) / "ck" / n) == read(ref / n), n
    m2.stop()
    with Mount(src, tmp_path / "plain") as p:
        got = pathlib.Path(p.mnt) / "ck"
        assert names(got) == names(ref)
        with pytest.raises(OSError) as e:
            read(got / "model-00001-of-00002.safetensors")
        assert e.value.errno == errno.EIO
    assert re.search(r"node-local target of MPI rank \d", pathlib.Path(p.log).read_text())
    # The loader (issue 12) reads SRC directly: it refuses, naming the rank, never zeros.
    r = subprocess.run([BIN, "load", str(src / "ck")], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "node-local target of MPI rank" in r.stderr, r.stderr[-2000:]


def test_node_local_one_shard_moves_to_its_target(mpi_mounts, tmp_path):
    """-o target=T%r,ranks=1 with write passthrough: close() stores the file in SRC as its own
    one shard, and the split after close moves it to rank 0's target even though it is one
    shard: SRC keeps only the record, as with the request path."""
    src = mkdir(tmp_path / "src")
    m = mpi_mounts(src, tmp_path / "mnt",
                   opts=(f"target={tmp_path}/T%r", "ranks=1", "write_passthrough=on"))
    mnt = pathlib.Path(m.mnt)
    mkdir(mnt / "d")
    want = save_file_to(mnt / "d" / "model.safetensors", 31, 512)
    assert_kernel_wrote(m)
    splits_done(m.mnt)
    assert read(mnt / "d" / "model.safetensors") == want
    assert not shards_by_file(src / "d")
    held = target_shards(tmp_path / "T0")
    assert list(held.values()) == [[1]] and not target_shards(tmp_path / "T1"), held
    m.stop()


def test_node_local_replace_rename_remove(mpi_mounts, tmp_path):
    """Node-local targets through a file's life: a rewrite of model.safetensors commits a new
    nl- directory on every owner and drops the replaced one; the checkpoint directory renamed
    in the view keeps reading the same shards (the record names their paths); a new directory
    under the old name gets its own nl- directories; the file's removal drops its shards from
    every target, and rmdir then succeeds."""
    src = mkdir(tmp_path / "src")
    targets = [tmp_path / f"T{r}" for r in range(NP)]
    m = mpi_mounts(src, tmp_path / "mnt", opts=(f"target={tmp_path}/T%r",))
    mnt = pathlib.Path(m.mnt)
    mkdir(mnt / "d")
    first = save_file_to(mnt / "d" / "model.safetensors", 21, 512)
    before = [target_shards(t) for t in targets]
    assert all(len(b) == 1 for b in before), before
    second = save_file_to(mnt / "d" / "model.safetensors", 22, 768)
    wait_for((mnt / "d" / "model.safetensors").exists, "the name after close")
    assert read(mnt / "d" / "model.safetensors") == second
    after = [target_shards(t) for t in targets]
    assert all(len(a) == 1 for a in after) and all(
        set(a) != set(b) for a, b in zip(after, before)), (before, after)
    os.rename(mnt / "d", mnt / "e")
    assert read(mnt / "e" / "model.safetensors") == second
    mkdir(mnt / "d")
    third = save_file_to(mnt / "d" / "model.safetensors", 23, 256)
    assert read(mnt / "d" / "model.safetensors") == third
    assert read(mnt / "e" / "model.safetensors") == second
    assert all(len(target_shards(t)) == 2 for t in targets)
    os.unlink(mnt / "e" / "model.safetensors")
    os.rmdir(mnt / "e")
    assert not (src / "e").exists()
    left = [target_shards(t) for t in targets]
    assert all(list(x) == [d for d in x if d.startswith("d/")] and len(x) == 1 for x in left), left
    assert first != second
    m.stop()


def test_node_local_rank_killed_mid_flush(mpi_mounts, tmp_path):
    """kill -9 of rank 2 while a slow writer replaces D/model.safetensors with node-local
    targets: the writer gets an error, never a hang; nothing is committed: after a remount
    under mpirun the previous file reads back byte-exact, and the remount's sweep removed the
    dead write's nl- directories from every target (each holds the previous file's only)."""
    src = mkdir(tmp_path / "src")
    targets = [tmp_path / f"T{r}" for r in range(NP)]
    opts = (f"target={tmp_path}/T%r", "mpi_timeout=3")
    m = mpi_mounts(src, tmp_path / "mnt", opts=opts)
    mnt = pathlib.Path(m.mnt)
    mkdir(mnt / "D")
    old = save_file_to(mnt / "D" / "model.safetensors", 60, 512)
    committed = [target_shards(t) for t in targets]
    w = Writer(blob(61, 4096), mnt / "D" / "model.safetensors", tmp_path, mode="tmp",
               chunk=128 * 1024, sleep=0.02)
    try:
        w.wait_written(MIB)
        assert any(len(target_shards(t)) == 2 for t in targets[:2])  # the new write's shards
        os.kill(m.rank_pids()[2], signal.SIGKILL)
        out, err = w.proc.communicate(timeout=60)  # never a hang
    finally:
        if w.proc.poll() is None:
            w.kill()
    assert w.proc.returncode != 0, f"the writer saw no error: {out[-500:]!r}"
    assert m.stop(check=False) != 0
    assert not in_proc_mounts(m.mnt)
    m2 = mpi_mounts(src, tmp_path / "mnt2", opts=opts)
    assert read(pathlib.Path(m2.mnt) / "D" / "model.safetensors") == old
    m2.wait_log(r"rank [01] removed \d+ node-local directories no record names")
    assert [target_shards(t) for t in targets] == committed
    m2.stop()


def test_node_local_column_split_reads_back(mpi_mounts, tmp_path):
    """-o split=tp with node-local targets: Llama's colwise/rowwise plan cuts tensors along
    dim 1 too, so the writer's bytes reach each owner as one short run per row (coalesced into
    large messages on the way, flush::mpi::WriteCombiner). The file reads back byte-exact and
    each target holds only its rank's shards."""
    model = make_model(19, torch.bfloat16, tp_plan=True)
    ref = tmp_path / "ref"
    model.save_pretrained(str(ref))
    src = mkdir(tmp_path / "src")
    m = mpi_mounts(src, tmp_path / "mnt", opts=(f"target={tmp_path}/T%r", "split=tp"))
    view = pathlib.Path(m.mnt) / "ck"
    model.save_pretrained(str(view))
    for n in names(ref):
        assert read(view / n) == read(ref / n), n
    for r in range(NP):
        held = target_shards(tmp_path / f"T{r}")
        assert held and all(owned_by(r, v) for v in held.values()), (r, held)
    m.stop()


def test_node_local_target_of_another_source_is_refused(mpi_mounts, tmp_path):
    """A node-local target belongs to the source that first used it (T/.ckptfs-owner): a job
    mounting another SRC with the same targets is refused at start (its sweep would remove the
    first source's shards), naming both sources; the first source's file still reads back."""
    src = mkdir(tmp_path / "src")
    opts = (f"target={tmp_path}/T%r",)
    m = mpi_mounts(src, tmp_path / "mnt", opts=opts)
    mkdir(pathlib.Path(m.mnt) / "d")
    want = save_file_to(pathlib.Path(m.mnt) / "d" / "model.safetensors", 31, 256)
    m.stop()
    other = mkdir(tmp_path / "other")
    mnt = mkdir(tmp_path / "mnt-other")
    with pytest.raises(DaemonExited) as refused:  # mpirun ends with no mount made
        mpi_mounts(other, mnt, opts=opts, settle=None, start_timeout=120.0)
    assert refused.value.rc != 0
    assert not os.path.ismount(mnt)
    out = refused.value.log
    assert "holds the shards of another source" in out and str(src) in out, out[-3000:]
    m2 = mpi_mounts(src, tmp_path / "mnt2", opts=opts)
    assert read(pathlib.Path(m2.mnt) / "d" / "model.safetensors") == want
    m2.stop()
