"""Write passthrough (issue 35): the kernel writes a file opened for writing into its file in SRC.

With FUSE passthrough (Linux 6.9+, root) a read-write mount hands the kernel the file being
written (its CREATE and OPEN replies carry a backing file), so a save runs at the speed of the
page cache and no WRITE request reaches the daemon; a consolidated file under a model name is
split into rank shards at close from SRC. These tests run real mounts and check what only the
kernel path gives (the daemon counts no WRITE request) and what must not change with it: the
bytes, the shards, the errors a writer sees, and what other users can reach under allow_other.
Skipped (never faked) without root, /dev/fuse, or a kernel that refuses the backing ioctl.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from conftest import fuse_available
from mount_util import Mount, killed, splits_done  # noqa: E402

pytestmark = [pytest.mark.skipif(not fuse_available(), reason="needs root and /dev/fuse")]

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")


def status(mnt) -> dict:
    return json.loads((pathlib.Path(mnt) / ".ckptfs" / "status.json").read_text())


def kernel_backs_or_skip(m):
    text = pathlib.Path(m.log).read_text() if os.path.exists(m.log) else ""
    if "FUSE passthrough is off" in text or "write path: passthrough" not in text:
        pytest.skip("the kernel refused FUSE passthrough: " + text.splitlines()[-1])


def model(n=6, rows=512, first=0):
    g = torch.Generator().manual_seed(7 + first)
    return {f"model.layers.{i}.mlp.weight": torch.randn(rows, 256, generator=g)
            for i in range(first, first + n)}


def test_a_save_is_written_by_the_kernel_and_split_at_close(tmp_path, mount_factory):
    src = tmp_path / "src"
    (src / "ck").mkdir(parents=True)
    m = mount_factory(src, opts=["ranks=2"])
    sd = model()
    st.save_file(sd, str(pathlib.Path(m.mnt) / "ck" / "model.safetensors"))
    (pathlib.Path(m.mnt) / "ck" / "config.json").write_text('{"model_type": "llama"}')
    kernel_backs_or_skip(m)
    w = status(m.mnt)["writes"]
    assert w["passthrough"] is True
    assert w["backed_opens"] >= 2
    assert w["requests"] == 0, w  # every byte went from the writer to SRC through the kernel
    splits_done(m.mnt)
    names = sorted(os.listdir(src / "ck"))
    assert names == [".ckptfs", "config.json",
                     "shard-00001-model-00001-of-00001.safetensors",
                     "shard-00002-model-00001-of-00001.safetensors"], names
    back = st.load_file(str(pathlib.Path(m.mnt) / "ck" / "model.safetensors"))
    assert all(torch.equal(back[k], sd[k]) for k in sd)
    assert (src / "ck" / "config.json").read_text() == '{"model_type": "llama"}'


def test_a_consolidated_file_beside_its_shards_is_stored_once(tmp_path, mount_factory):
    """A consolidated file written beside the rank shards it was made from (OUT/sharded/, where
    torch DCP's enable_consolidation and torchtitan's last_save_in_hf leave them) is stored,
    after its close, as hard links of those shards once every byte reads as their view: one
    stored copy (write/dedup). One byte of difference, or shards of another owner, and it stays
    its own one shard. Either way it reads back as written."""
    from shardgen import TensorSpec, write_checkpoint
    src = tmp_path / "src"
    cases = ("same", "differs", "other-owner")
    for i, case in enumerate(cases):
        write_checkpoint(str(src / case / "sharded"),
                         [TensorSpec("a.weight", "F32", (64, 32), (2, 1)),
                          TensorSpec("b.weight", "BF16", (16, 16), (1, 2))], world=2, seed=i)
    for p in (src / "other-owner" / "sharded").glob("shard-*"):
        os.chown(p, 12345, 12345)
    m = mount_factory(src)
    kernel_backs_or_skip(m)
    mnt = pathlib.Path(m.mnt)
    name = "model-00001-of-00001.safetensors"
    written = {}
    for case in cases:
        body = bytearray((mnt / case / "sharded" / name).read_bytes())
        if case == "differs":
            body[-1] ^= 1
        written[case] = bytes(body)
        (mnt / case / name).write_bytes(written[case])
    splits_done(m.mnt)
    for case in cases:
        d = src / case
        stored = sorted(n for n in os.listdir(d) if n.startswith("shard-"))
        if case == "same":
            origin = sorted(n for n in os.listdir(d / "sharded") if n.startswith("shard-"))
            assert stored == origin, stored
            for n in stored:
                assert (d / n).stat().st_ino == (d / "sharded" / n).stat().st_ino, n
        else:
            assert len(stored) == 1 and (d / stored[0]).stat().st_nlink == 1, (case, stored)
        assert (mnt / case / name).read_bytes() == written[case], case
    # sharded/ renamed, then a new save there (an open with O_TRUNC of a rank shard) leaves what
    # `same` stored as it was: it gets its own copy of that shard first.
    os.rename(mnt / "same" / "sharded", mnt / "same" / "old")
    victim = sorted(n for n in os.listdir(src / "same" / "old") if n.startswith("shard-"))[0]
    with open(mnt / "same" / "old" / victim, "wb") as f:
        f.write(b"not a shard")
    assert (src / "same" / "old" / victim).read_bytes() == b"not a shard"
    assert (src / "same" / victim).stat().st_nlink == 1
    assert (mnt / "same" / name).read_bytes() == written["same"]
    # What `same` stored is the shards' inodes: removing their first directory leaves it whole.
    shutil.rmtree(src / "same" / "old")
    assert (mnt / "same" / name).read_bytes() == written["same"]


@pytest.mark.parametrize("threads", [2, 1])
def test_splits_of_different_files_run_at_once(tmp_path, mount_factory, threads):
    """-o split_threads=2: two files closed one after the other are split into their rank
    shards at the same time (status.json's writes.splits_running reaches 2 while the hidden
    split_delay_ms holds each split); with one thread never more than one runs. Either way
    every file ends as its rank shards and reads back as written."""
    src = tmp_path / "src"
    for d in ("a", "b"):
        (src / d).mkdir(parents=True)
    m = mount_factory(src, opts=["ranks=2", f"split_threads={threads}", "split_delay_ms=1500"])
    kernel_backs_or_skip(m)
    mnt = pathlib.Path(m.mnt)
    want = {}
    for i, d in enumerate(("a", "b")):
        sd = model(2, first=2 * i)
        st.save_file(sd, str(mnt / d / "model.safetensors"))
        want[d] = sd
    peak = 0
    while True:
        w = status(m.mnt)["writes"]
        assert w["split_threads"] == threads, w
        peak = max(peak, w["splits_running"])
        if w["splits_pending"] == 0:
            break
        time.sleep(0.01)
    assert peak == threads, peak
    for d, sd in want.items():
        assert len([n for n in os.listdir(src / d) if n.startswith("shard-")]) == 2, d
        back = st.load_file(str(mnt / d / "model.safetensors"))
        assert all(torch.equal(back[k], sd[k]) for k in sd), d


def test_write_passthrough_off_keeps_the_request_path(tmp_path, mount_factory):
    src = tmp_path / "src"
    (src / "ck").mkdir(parents=True)
    m = mount_factory(src, opts=["write_passthrough=off"])
    sd = model(2)
    st.save_file(sd, str(pathlib.Path(m.mnt) / "ck" / "model.safetensors"))
    w = status(m.mnt)["writes"]
    assert w["passthrough"] is False and w["backed_opens"] == 0
    assert w["requests"] > 0 and w["bytes"] >= sum(t.numel() * 4 for t in sd.values())
    assert "write path: FUSE requests (write_passthrough=off)" in pathlib.Path(m.log).read_text()
    back = st.load_file(str(pathlib.Path(m.mnt) / "ck" / "model.safetensors"))
    assert all(torch.equal(back[k], sd[k]) for k in sd)


@pytest.mark.parametrize("ranks", [2, 1])
def test_a_descriptor_writing_after_another_ones_close_stored_the_file_is_told(tmp_path,
                                                                              mount_factory,
                                                                              ranks):
    """A dup'd descriptor writing after a close() stored the file (the kernel sends its bytes
    past the daemon): the close() of that descriptor fails, never silently. With 2 ranks the
    bytes went to the file that was split, and the name keeps what the first close() stored;
    with 1 rank the file is its own shard, so the name shows the write in place, as a plain
    file would."""
    src = tmp_path / "src"
    (src / "ck").mkdir(parents=True)
    m = mount_factory(src, opts=[f"ranks={ranks}"])
    sd = model(2)
    data = st.save(sd)
    p = pathlib.Path(m.mnt) / "ck" / "model.safetensors"
    fd = os.open(p, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    os.write(fd, data)
    dup = os.dup(fd)
    os.close(fd)  # stored here (with 2 ranks: as its one shard, and split into two after)
    kernel_backs_or_skip(m)
    assert (src / "ck" / ".ckptfs" / "model.safetensors.commit").exists()
    splits_done(m.mnt)
    os.pwrite(dup, b"XXXX", 200)
    with pytest.raises(OSError) as e:
        os.close(dup)
    assert e.value.errno == errno.EIO
    assert "written after close() stored it" in pathlib.Path(m.log).read_text()
    if ranks == 2:
        assert p.read_bytes() == data  # what the first close() reported stored
    else:
        assert p.read_bytes() == data[:200] + b"XXXX" + data[204:]


def test_readers_of_a_file_being_written_see_its_bytes(tmp_path, mount_factory):
    src = tmp_path / "src"
    src.mkdir()
    m = mount_factory(src)
    p = pathlib.Path(m.mnt) / "log.txt"
    with open(p, "wb", buffering=0) as w:
        w.write(b"hello")
        assert p.read_bytes() == b"hello"
        with open(p, "rb") as r, mmap.mmap(r.fileno(), 0, prot=mmap.PROT_READ) as mm:
            assert mm[:5] == b"hello"
        w.write(b" world")
        assert p.read_bytes() == b"hello world"
    kernel_backs_or_skip(m)
    assert (src / "log.txt").read_bytes() == b"hello world"
    assert status(m.mnt)["writes"]["requests"] == 0


def rewrite(p: pathlib.Path) -> int:
    """An open of consolidated file `p` for writing anew on the name the kernel holds (a stat
    first, as NeMo's and torch's second saves meet it): OPEN with O_TRUNC, not CREATE."""
    os.stat(p)
    return os.open(p, os.O_WRONLY | os.O_TRUNC)


def write_anew(p: pathlib.Path, data: bytes) -> None:
    """Writes consolidated file `p` anew (rewrite) with `data`, and closes it."""
    fd = rewrite(p)
    try:
        assert os.write(fd, data) == len(data)
    finally:
        os.close(fd)


def test_a_consolidated_file_written_anew_is_written_by_the_kernel(tmp_path, mount_factory):
    """A consolidated file opened with O_TRUNC over the name that stores it (its node the
    view's, not a file in SRC) gets a backing file like a created one: no WRITE request, readers
    opened meanwhile read the new bytes from the same file and stat shows its size, as in a
    plain directory; stored at close and split into the mount's ranks. A reader of the old
    version open at that moment keeps the request path (the kernel serves one inode's opens one
    way): it goes on reading the old version, and the new one reads back after the close. It
    went through WRITE requests every time, and its readers saw the old version until the
    close."""
    src = tmp_path / "src"
    (src / "ck").mkdir(parents=True)
    m = mount_factory(src, opts=["ranks=2"])
    p = pathlib.Path(m.mnt) / "ck" / "model.safetensors"
    sds = [model(4, 256, first=4 * k) for k in range(3)]
    st.save_file(sds[0], str(p))
    kernel_backs_or_skip(m)
    splits_done(m.mnt)
    before = status(m.mnt)["writes"]
    data = st.save(sds[1])
    half = len(data) // 2
    fd = rewrite(p)
    try:
        os.write(fd, data[:half])
        assert os.stat(p).st_size == half
        assert p.read_bytes() == data[:half]  # what it holds now, not the old version
        os.write(fd, data[half:])
    finally:
        os.close(fd)
    after = status(m.mnt)["writes"]
    assert after["requests"] == before["requests"], (before, after)
    assert after["backed_opens"] >= before["backed_opens"] + 1, (before, after)
    splits_done(m.mnt)
    assert p.read_bytes() == data
    names = sorted(n for n in os.listdir(src / "ck") if not n.startswith("."))
    assert names == ["shard-00001-model-00001-of-00001.safetensors",
                     "shard-00002-model-00001-of-00001.safetensors"], names
    # Beside a reader of the version it replaces: the request path, and that reader's bytes
    # stay the old version's.
    data2 = st.save(sds[2])
    with open(p, "rb") as r:
        head = r.read(4096)
        write_anew(p, data2)
        assert head + r.read() == data
    assert status(m.mnt)["writes"]["requests"] > after["requests"]
    # The kernel sends the old reader's RELEASE after its close returned; until the daemon has
    # it, that reader's shards stay open, and a fresh open of the name the kernel still holds
    # could be served from them (a race of the request path, not of this change).
    deadline = time.monotonic() + 10
    while status(m.mnt)["cache"]["shard_fds_open"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert p.read_bytes() == data2
    back = st.load_file(str(p))
    assert all(torch.equal(back[k], sds[2][k]) for k in sds[2])
    del back  # its tensors map the file


def test_an_open_of_a_replaced_version_looks_its_name_up_again(tmp_path, mount_factory):
    """A consolidated file written anew beside a reader of its old version (the request
    path): once the writer's close returned, an open that reaches the old version's inode
    (here through the reader's /proc link, as the kernel sends one whose entry it still held
    when the invalidation was on its way) answers ESTALE, so that the kernel looks the name up
    again, where it used to be served the old bytes from the shard fds that reader keeps
    open. By its name the file reads as written; the reader goes on with the old version."""
    src = tmp_path / "src"
    (src / "ck").mkdir(parents=True)
    m = mount_factory(src, opts=["ranks=2"])
    p = pathlib.Path(m.mnt) / "ck" / "model.safetensors"
    old = st.save(model(4, 256))
    new = st.save(model(4, 256, first=4))
    p.write_bytes(old)
    splits_done(m.mnt)
    with open(p, "rb") as r:
        head = r.read(4096)
        write_anew(p, new)
        with pytest.raises(OSError) as e:
            open(f"/proc/self/fd/{r.fileno()}", "rb").close()
        assert e.value.errno == errno.ESTALE, e.value
        assert p.read_bytes() == new
        assert head + r.read() == old
    assert p.read_bytes() == new


@pytest.mark.parametrize("opts", [["ranks=1"], ["ranks=2", "write_passthrough=off"]])
def test_a_file_written_anew_while_another_thread_opens_it_is_stored_as_written(
        tmp_path, mount_factory, opts):
    """A consolidated file written anew with O_TRUNC, round after round, while another thread
    opens and reads its name in a loop, with prefetch on (the default on small machines): each
    round reads back as written, and a fresh read-only mount of SRC reads the last one. The
    readers' opens started prefetch pushes of the old version into the inode the writer wrote
    through; the kernel sends a writer's WRITE requests from pages it has unlocked, and a push
    meanwhile put the old bytes in them: the file was stored as the old version with the new
    one's last page, within 2 to 230 rounds (tools/stress_rewrite.py)."""
    src = tmp_path / "src"
    (src / "ck").mkdir(parents=True)
    m = mount_factory(src, opts=[*opts, "prefetch=on"])
    p = pathlib.Path(m.mnt) / "ck" / "model.safetensors"
    versions = [st.save(model(4, 256, first=4 * k)) for k in range(300)]
    p.write_bytes(versions[0])
    stop = threading.Event()

    def opener():
        while not stop.is_set():
            try:
                p.read_bytes()
            except OSError:
                pass  # between versions the name may be missing for a moment

    t = threading.Thread(target=opener)
    t.start()
    try:
        for k in range(1, len(versions)):
            write_anew(p, versions[k])
            assert p.read_bytes() == versions[k], f"round {k}"
    finally:
        stop.set()
        t.join()
    splits_done(m.mnt)
    ro = mount_factory(src, opts=["ro"])
    assert (pathlib.Path(ro.mnt) / "ck" / "model.safetensors").read_bytes() == versions[-1]


def test_a_daemon_killed_while_a_consolidated_file_is_written_anew_keeps_the_old_one(tmp_path):
    """kill -9 of the daemon while the kernel writes a consolidated file anew over the name
    that stores it: nothing of the new file was closed, so after a remount the name reads as
    the version it was replacing, and the never-closed file is gone from SRC."""
    src = tmp_path / "src"
    (src / "ck").mkdir(parents=True)
    m = Mount(src, tmp_path / "mnt", opts=["ranks=2"], log=str(tmp_path / "mnt.1.log")).start()
    old, new = model(4, 256), model(4, 256, first=4)
    with killed(m) as mnt:
        p = mnt / "ck" / "model.safetensors"
        st.save_file(old, str(p))
        kernel_backs_or_skip(m)
        splits_done(m.mnt)
        requests = status(m.mnt)["writes"]["requests"]
        fd = rewrite(p)
        os.write(fd, st.save(new)[:100000])
        assert status(m.mnt)["writes"]["requests"] == requests  # written by the kernel
        assert (src / "ck" / "model.safetensors").exists()
    try:
        os.close(fd)
    except OSError:
        pass  # its daemon is gone (ENOTCONN)
    with Mount(src, tmp_path / "mnt", opts=["ranks=2"], log=str(tmp_path / "mnt.2.log")) as m2:
        back = st.load_file(str(pathlib.Path(m2.mnt) / "ck" / "model.safetensors"))
        assert sorted(back) == sorted(old) and all(torch.equal(back[k], old[k]) for k in old)
        del back
        assert not (src / "ck" / "model.safetensors").exists(), sorted(os.listdir(src / "ck"))


def test_other_users_reach_nothing_through_a_backed_file(mount_factory):
    """allow_other: root writes two files through the kernel path (one 0644, one 0600) and keeps
    them open; another user gets from them exactly what SRC would give: a read of the 0644
    file, and EACCES for a write open, a truncate, a shared writable mapping of the read-only
    descriptor (EACCES), and any open of the 0600 file."""
    world = pathlib.Path(tempfile.mkdtemp(prefix="ckptfs-wpt-", dir="/tmp"))
    try:
        os.chmod(world, 0o755)
        (world / "src").mkdir(mode=0o755)
        m = mount_factory(world / "src", world / "mnt", opts=["allow_other"])
        mnt = world / "mnt"
        shared = os.open(mnt / "shared.bin", os.O_CREAT | os.O_RDWR, 0o644)
        secret = os.open(mnt / "secret.bin", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            os.write(shared, b"s" * 4096)
            os.write(secret, b"x" * 4096)
            kernel_backs_or_skip(m)
            code = r"""
import errno, mmap, os, sys
shared, secret = sys.argv[1], sys.argv[2]
out = []
def attempt(name, fn):
    try:
        fn()
        out.append(name + "=ok")
    except OSError as e:
        out.append(name + "=" + errno.errorcode[e.errno])
fd = os.open(shared, os.O_RDONLY)
out.append("read=%d" % len(os.pread(fd, 8192, 0)))
def map_write():
    mm = mmap.mmap(fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    mm[0:1] = b"Z"
attempt("mmap_write", map_write)
attempt("write_open", lambda: os.open(shared, os.O_WRONLY))
attempt("truncate", lambda: os.truncate(shared, 0))
attempt("secret_read", lambda: os.open(secret, os.O_RDONLY))
attempt("secret_write", lambda: os.open(secret, os.O_WRONLY))
print(" ".join(out))
"""
            r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                                sys.executable, "-I", "-c", code, str(mnt / "shared.bin"),
                                str(mnt / "secret.bin")],
                               capture_output=True, text=True, timeout=60, cwd="/")
            assert r.returncode == 0, r.stderr
            assert r.stdout.split() == ["read=4096", "mmap_write=EACCES", "write_open=EACCES",
                                        "truncate=EACCES", "secret_read=EACCES",
                                        "secret_write=EACCES"], r.stdout
        finally:
            os.close(shared)
            os.close(secret)
        assert (world / "src" / "shared.bin").read_bytes() == b"s" * 4096
        assert (world / "src" / "secret.bin").read_bytes() == b"x" * 4096
        assert status(m.mnt)["writes"]["backed_opens"] >= 2
        m.stop()
    finally:
        shutil.rmtree(world, ignore_errors=True)


def test_a_save_with_ranks_returns_stored_as_one_shard_and_is_split_after_close(tmp_path,
                                                                                mount_factory):
    """With more than one rank, close() stores the file as its own one shard (no byte copied)
    and returns; the split into the rank shards runs after it. A reader at any moment reads
    the closed bytes; status shows the splits pending; unmount waits for them."""
    src = tmp_path / "src"
    (src / "ck").mkdir(parents=True)
    m = mount_factory(src, opts=["ranks=4"])
    sds = [model(4, 1024), model(3, 2048, first=4)]
    for k, sd in enumerate(sds, 1):
        st.save_file(sd, str(pathlib.Path(m.mnt) / "ck" / f"model-{k:05d}-of-00002.safetensors"))
    kernel_backs_or_skip(m)
    seen = [status(m.mnt)["writes"]["splits_pending"]]
    for k, sd in enumerate(sds, 1):
        back = st.load_file(str(pathlib.Path(m.mnt) / "ck" / f"model-{k:05d}-of-00002.safetensors"))
        assert all(torch.equal(back[n], sd[n]) for n in sd)
        seen.append(status(m.mnt)["writes"]["splits_pending"])
        del back  # its tensors map the file: the mount could not go while they live
    assert all(0 <= n <= 2 for n in seen), seen
    # Unmount waits for the splits: when the daemon has exited, each file is its 4 shards.
    rc = m.stop()
    assert rc == 0
    names = sorted(os.listdir(src / "ck"))
    assert names == sorted([".ckptfs"] + [f"shard-{r:05d}-model-{k:05d}-of-00002.safetensors"
                                          for k in (1, 2) for r in (1, 2, 3, 4)]), names
    assert not [n for n in os.listdir(src / "ck" / ".ckptfs") if n.startswith("tx-")]
    log = pathlib.Path(m.log).read_text()
    assert "split into 4 rank shards after its close" in log, log[-2000:]
    m2 = mount_factory(src, opts=["ranks=4"])
    for k, sd in enumerate(sds, 1):
        back = st.load_file(str(pathlib.Path(m2.mnt) / "ck" / f"model-{k:05d}-of-00002.safetensors"))
        assert all(torch.equal(back[n], sd[n]) for n in sd)


def test_a_split_after_close_out_of_space_leaves_the_one_shard(small_tmpfs, mount_factory):
    """SRC on an 8 MiB tmpfs: a 5 MiB save fits, and close() returns 0 with it stored as its one
    shard; the split into two rank shards needs another 5 MiB and fails with ENOSPC. The file
    stays its one shard (nothing of the split left behind, the log says why) and reads back
    exactly, through this mount and the next."""
    src = small_tmpfs / "src"
    (src / "ck").mkdir(parents=True)
    m = mount_factory(src, opts=["ranks=2"])
    sd = model(5, 1024)  # 5 MiB of tensors
    st.save_file(sd, str(pathlib.Path(m.mnt) / "ck" / "model.safetensors"))
    kernel_backs_or_skip(m)
    splits_done(m.mnt)
    names = sorted(os.listdir(src / "ck"))
    assert names == [".ckptfs", "shard-00001-model-00001-of-00001.safetensors"], names
    assert not [n for n in os.listdir(src / "ck" / ".ckptfs") if n.startswith("tx-")]
    log = pathlib.Path(m.log).read_text()
    assert "stays stored as one shard" in log and "No space left on device" in log, log[-2000:]
    back = st.load_file(str(pathlib.Path(m.mnt) / "ck" / "model.safetensors"))
    assert all(torch.equal(back[n], sd[n]) for n in sd)
    del back
    assert m.stop() == 0
    m2 = mount_factory(src, opts=["ranks=2"])
    back = st.load_file(str(pathlib.Path(m2.mnt) / "ck" / "model.safetensors"))
    assert all(torch.equal(back[n], sd[n]) for n in sd)


def test_a_daemon_killed_while_splits_after_close_run_loses_nothing_closed(tmp_path):
    """kill -9 of the daemon right after the saves returned, while their splits are queued or
    running: after a remount every file reads as closed, from its one shard or its rank
    shards, and no staging is left."""
    src = tmp_path / "src"
    (src / "ck").mkdir(parents=True)
    m = Mount(src, tmp_path / "mnt", opts=["ranks=4"], log=str(tmp_path / "mnt.1.log")).start()
    sds = [model(8, 16384, first=8 * k) for k in range(3)]  # 128 MiB each
    pending = None
    with killed(m) as mnt:
        for k, sd in enumerate(sds, 1):
            st.save_file(sd, str(mnt / "ck" / f"model-{k:05d}-of-00003.safetensors"))
        kernel_backs_or_skip(m)
        pending = status(m.mnt)["writes"]["splits_pending"]
    print(f"splits pending at the kill: {pending}")
    with Mount(src, tmp_path / "mnt", opts=["ranks=4"], log=str(tmp_path / "mnt.2.log")) as m2:
        for k, sd in enumerate(sds, 1):
            back = st.load_file(str(pathlib.Path(m2.mnt) / "ck" / f"model-{k:05d}-of-00003.safetensors"))
            assert all(torch.equal(back[n], sd[n]) for n in sd)
            del back  # its tensors map the file: the unmount waits for them
        assert not [n for n in os.listdir(src / "ck" / ".ckptfs") if n.startswith("tx-")]
        for k in (1, 2, 3):  # one shard or four, never a mix
            shards = [n for n in os.listdir(src / "ck") if f"model-{k:05d}-of-00003" in n]
            assert len(shards) in (1, 4), sorted(os.listdir(src / "ck"))
