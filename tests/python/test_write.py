"""Tier 3/4: the WRITE path, through real read-write mounts (contract: the write path notes).

Real writers write into a `ckptfs mount` and what they wrote is checked byte for byte, against
the same writer's output in a plain directory, and in SRC against the on-disk contract:

  1. save_pretrained of a small Llama (1 file; 3 files + index; a TP split from the
     config's base_model_tp_plan) into a mount with -o ranks=N: every file reads back
     byte-exact (listing, bytes, sizes, read bits); SRC holds only rank shards
     (DCP_SHARDING_INFO, the promised split), which torch DCP's HuggingFaceStorageReader loads
     in one process and into a resharded 2-rank gloo mesh; from_pretrained from the mount
     equals the model; `ckptfs inspect/verify SRC/dir` accept it; a second mount -o ro shows
     the same bytes; two saves into one directory (3 files, then 2) end as in a plain one.
  2. a real transformers.Trainer (save_steps, save_total_limit rotation by rmtree) writing into
     the mount, then resuming from it: the step, the weights and the optimizer state.
  3. torch DCP HuggingFaceStorageWriter(save_distributed=True), 2 gloo ranks, writing into the
     mount (tools/gen_checkpoint.py): from_pretrained of the directory equals the reference;
     written files and shards show at once even with settle=30.
  4. POSIX on plain files and directories through the mount (rename, RENAME_NOREPLACE, rmtree,
     rmdir of a hidden remainder, unlink, fsync, truncate, chmod, utime, directory mtimes,
     O_EXCL, O_APPEND, statfs, symlinks, hard links, ownership of a non-root caller's files,
     EXDEV for consolidated files and mv's copy fallback, the reserved name .ckptfs).
  5. faults: kill -9 of a writer (mid-file, and after renaming over an older file) and of the
     daemon mid-file, ENOSPC on a small tmpfs, six concurrent writers, a reader during a write,
     an open reader of a file being replaced, files that only look like safetensors.

Models are a few MB; the slow writers (tests/python/slow_writer.py) write a few MiB in 64 KiB
chunks. No timing assertions: "visible at once" checks use settle=30, where waiting for the
settle time would show as a failure, never as a measured duration. Skipped (never faked)
without root, /dev/fuse and fusermount3.
"""

from __future__ import annotations

import copy
import ctypes
import errno
import filecmp
import gc
import glob
import json
import os
import pathlib
import re
import select
import shutil
import signal
import stat
import struct
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from conftest import ROOT, Mount, requires_fuse, run, unmount, wait_for
from mount_util import splits_done, wait_killed_mount_gone

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")

pytestmark = requires_fuse

HERE = pathlib.Path(__file__).parent
GEN = ROOT / "tools" / "gen_checkpoint.py"
RESHARD = HERE / "dcp_reshard_load.py"
SLOW = HERE / "slow_writer.py"
INDEX = "model.safetensors.index.json"
DCP1 = "model-00001-of-00001.safetensors"  # how the view names the one file of DCP rank shards
SHARD_RE = re.compile(r"^shard-(\d{5})-model-(\d{5})-of-(\d{5})\.safetensors$")
MODEL_RE = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")
KIB, MIB = 1024, 1024 * 1024


# --- helpers: files --------------------------------------------------------------------------


def read(p) -> bytes:
    with open(p, "rb") as f:
        return f.read()


def mkdir(p) -> pathlib.Path:
    p = pathlib.Path(p)
    p.mkdir(parents=True, exist_ok=True)
    return p


def names(d) -> list[str]:
    return sorted(os.listdir(d))


def names_elsewhere(d) -> list[str]:
    """The listing another process sees. The process that wrote rank shards through the mount
    sees that directory as written for a while (the writer's view, docs/semantics.md)."""
    r = subprocess.run([sys.executable, "-c", "import os, sys; print('\\n'.join(sorted(os.listdir(sys.argv[1]))))",
                        str(d)], capture_output=True, text=True, timeout=30, check=True)
    return [n for n in r.stdout.splitlines() if n]


def files_of(d) -> dict[str, bytes]:
    """name -> bytes of every regular file directly in d."""
    return {n: read(os.path.join(d, n)) for n in names(d) if os.path.isfile(os.path.join(d, n))}


def src_shards(d) -> list[str]:
    return sorted(n for n in os.listdir(d) if SHARD_RE.match(n))


def st_header(path) -> dict:
    b = read(path)
    (n,) = struct.unpack("<Q", b[:8])
    return json.loads(b[8:8 + n])


def loads_complete(b: bytes) -> bool:
    """Does safetensors accept these bytes as a whole, complete file?"""
    from safetensors.torch import load

    try:
        load(b)
        return True
    except Exception:
        return False


def expect_errno(fn, *codes):
    try:
        r = fn()
    except OSError as e:
        assert e.errno in codes, f"errno {errno.errorcode.get(e.errno)} ({e}), expected {[errno.errorcode[c] for c in codes]}"
        return e
    if isinstance(r, int):
        os.close(r)
    elif hasattr(r, "close"):
        r.close()
    raise AssertionError(f"succeeded, expected {[errno.errorcode[c] for c in codes]}")


def log_tail(m: Mount, n: int = 30) -> str:
    return "\n".join(m.read_log().splitlines()[-n:])


def assert_alive(m: Mount) -> None:
    assert m.proc is not None and m.proc.poll() is None, (
        f"the daemon died (exit {m.proc.returncode if m.proc else None}):\n{log_tail(m)}")
    assert os.path.ismount(m.mnt)


_libc = ctypes.CDLL(None, use_errno=True)
RENAME_NOREPLACE = 1


def renameat2(old, new, flags: int) -> None:
    AT_FDCWD = -100
    r = _libc.renameat2(AT_FDCWD, os.fsencode(str(old)), AT_FDCWD, os.fsencode(str(new)),
                        ctypes.c_uint(flags))
    if r != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), str(old))


# --- helpers: tensors and safetensors bytes --------------------------------------------------


def tensors(seed: int, kib: int, prefix: str = "") -> dict:
    """A deterministic state dict of about `kib` KiB: one big 2-D f32 tensor (>= 64 KiB, so it
    is split across ranks), a 1-D f32 and a bf16 one (small: whole on one rank)."""
    g = torch.Generator().manual_seed(seed)
    rows = max(1, kib * KIB // (256 * 4))
    return {prefix + "big.weight": torch.randn(rows, 256, generator=g),
            prefix + "small.bias": torch.randn(256, generator=g),
            prefix + "norm.weight": torch.randn(64, generator=g).to(torch.bfloat16)}


def blob(seed: int, kib: int, prefix: str = "") -> bytes:
    """The bytes safetensors' save_file writes for tensors(seed, kib, prefix)."""
    from safetensors.torch import save

    return save(tensors(seed, kib, prefix), metadata={"format": "pt"})


def save_file_to(path, seed: int, kib: int) -> bytes:
    """Writes tensors(seed, kib) with the real safetensors writer; returns the expected bytes."""
    from safetensors.torch import save_file

    save_file(tensors(seed, kib), str(path), metadata={"format": "pt"})
    return blob(seed, kib)


# --- helpers: models -------------------------------------------------------------------------


def llama_config(hidden=128, inter=256, vocab=512, layers=2, tp_plan=False):
    from transformers import LlamaConfig

    if tp_plan:
        # transformers 5.x never writes base_model_tp_plan into config.json (it is dropped in
        # _remove_keys_not_serialized); this config writes Llama's own default plan, the way a
        # config carrying one looks on disk, so that -o split=tp has a plan to follow.
        class PlanConfig(LlamaConfig):
            def _remove_keys_not_serialized(self, d):
                plan = d.get("base_model_tp_plan")
                super()._remove_keys_not_serialized(d)
                if plan:
                    d["base_model_tp_plan"] = plan

        cls = PlanConfig
    else:
        cls = LlamaConfig
    c = cls(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
            max_position_embeddings=64, tie_word_embeddings=False)
    if tp_plan:
        c.base_model_tp_plan = dict(LlamaConfig.base_model_tp_plan)
    return c


def make_model(seed: int, dtype, **cfg):
    """A LlamaForCausalLM with deterministic, distinctive weights in `dtype`."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(**cfg))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if p.ndim == 1 else 0.02 * noise)
    model.to(dtype)
    model.config.dtype = dtype
    model.eval()
    return model


def max_shard_size_for(model, files: int) -> int:
    from gen_checkpoint import pick_max_shard_size  # tools/ is on sys.path (conftest)

    return pick_max_shard_size(model.state_dict(), files)


def load_model(d):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(d), dtype="auto", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model


def diff_state(got: dict, want: dict) -> list[str]:
    bad = sorted(set(got) ^ set(want))
    bad += [k for k in want if k in got and (got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k]))]
    return bad


def load_dir_tensors(d) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(glob.glob(os.path.join(str(d), "*.safetensors"))):
        out.update(load_file(f))
    return out


def dcp_full_load(shard_dir, like: dict) -> dict:
    """torch DCP HuggingFaceStorageReader, one process, every tensor whole."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

    state = {k: torch.zeros_like(v) for k, v in like.items()}
    dcp.load(state, storage_reader=HuggingFaceStorageReader(str(shard_dir)), no_dist=True)
    return state


def sharding_info(srcdir) -> dict:
    """fqn -> list of (shard file, saved_offsets, local shape, full shape) over SRC's shards."""
    out = {}
    for n in src_shards(srcdir):
        h = st_header(os.path.join(srcdir, n))
        meta = h.pop("__metadata__", {})
        assert "DCP_SHARDING_INFO" in meta, f"{n}: no DCP_SHARDING_INFO in {meta}"
        info = json.loads(meta["DCP_SHARDING_INFO"])
        assert set(info) == set(h), f"{n}: DCP_SHARDING_INFO names {sorted(info)} != tensors {sorted(h)}"
        for k, e in h.items():
            out.setdefault(k, []).append((n, info[k]["saved_offsets"], e["shape"], info[k].get("shape")))
    return out


# --- helpers: the slow writer ----------------------------------------------------------------


class Writer:
    """tests/python/slow_writer.py in a child process, with its progress read as it goes."""

    def __init__(self, data: bytes, dest, tmpdir, mode="direct", chunk=64 * KIB, sleep=0.01,
                 rename_after=None):
        self.data, self.dest = data, pathlib.Path(dest)
        tmpdir = pathlib.Path(tmpdir)
        tmpdir.mkdir(parents=True, exist_ok=True)
        self.data_path = tmpdir / f"writer-{os.getpid()}-{id(self)}.bin"
        self.data_path.write_bytes(data)
        cmd = [sys.executable, str(SLOW), str(self.data_path), str(dest), "--mode", mode,
               "--chunk", str(chunk), "--sleep", str(sleep)]
        if rename_after is not None:
            cmd += ["--rename-after", str(rename_after)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.buf = b""
        self.written = 0
        self.tmp_name = None
        self.events = []

    def _next_line(self, deadline):
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"writer {self.dest}: no progress (last {self.events[-1:]})")
            r, _, _ = select.select([fd], [], [], left)
            if r:
                chunk = os.read(fd, 65536)
                if not chunk:
                    err = self.proc.stderr.read().decode(errors="replace") if self.proc.poll() is not None else ""
                    raise EOFError(f"writer {self.dest} ended (rc {self.proc.poll()}) after "
                                   f"{self.events[-1:]}: {err[-2000:]}")
                self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        words = line.decode().split()
        self.events.append(words)
        if words[0] == "w":
            self.written = int(words[1])
        elif words[0] == "tmp":
            self.tmp_name = words[1]
        return words

    def wait_for(self, pred, timeout=60.0):
        """Reads progress until pred(words) holds for one line."""
        deadline = time.monotonic() + timeout
        while True:
            words = self._next_line(deadline)
            if pred(words):
                return words

    def wait_written(self, n: int, timeout=60.0) -> int:
        if self.written < n:
            self.wait_for(lambda w: w[0] == "w" and int(w[1]) >= n, timeout)
        return self.written

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.proc.stdout.close()
        self.proc.stderr.close()

    def finish(self, timeout=120.0) -> None:
        out, err = self.proc.communicate(timeout=timeout)
        for line in (self.buf + out).decode().splitlines():
            self.events.append(line.split())
        assert self.proc.returncode == 0, f"writer {self.dest} failed ({self.proc.returncode}): {err.decode()[-2000:]}"
        assert self.events[-1] == ["closed"], self.events[-3:]


def check_not_complete_but_wrong(path, target: bytes, allowed: tuple[bytes, ...] = ()) -> str:
    """After a writer of `target` died mid-file: the name is absent, or reads as one of
    `allowed` (an older committed file), or reads as exactly a prefix of what was written
    (cut short), and never as a complete-looking safetensors file with other contents."""
    try:
        got = read(path)
    except FileNotFoundError:
        return "absent"
    if got in allowed:
        return "old bytes"
    assert got != target, f"{path}: reads as the complete file, though its writer was killed mid-way"
    assert not loads_complete(got), (
        f"{path}: {len(got)} bytes that load as a complete safetensors file, but are neither the "
        f"older file nor what the writer wrote (complete-but-wrong)")
    assert len(got) < len(target) and got == target[:len(got)], (
        f"{path}: {len(got)} bytes, not a prefix of what the writer wrote")
    return f"cut short at {len(got)}"


# =============================================================================================
# 1. save_pretrained into the mount
# =============================================================================================

# name -> (files, dtype, mount options, config with base_model_tp_plan, seed)
SAVES = {
    "one_file_r4": dict(files=1, dtype="f32", opts=("ranks=4",), tp=False, seed=1),
    "three_files_r4": dict(files=3, dtype="bf16", opts=("ranks=4",), tp=False, seed=2),
    "three_files_tp3": dict(files=3, dtype="f32", opts=("ranks=3", "split=tp"), tp=True, seed=3),
}
DTYPES = {"f32": "float32", "bf16": "bfloat16"}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tmp_path_factory.mktemp("write")


@pytest.fixture(scope="module")
def saved(base):
    """case -> the model, its save_pretrained into a plain dir (ref) and into MNT/ck (lazily)."""
    cache, mounts = {}, []

    def get(name):
        if name in cache:
            return cache[name]
        spec = SAVES[name]
        root = base / f"sp-{name}"
        model = make_model(spec["seed"], getattr(torch, DTYPES[spec["dtype"]]), tp_plan=spec["tp"])
        size = max_shard_size_for(model, spec["files"])
        ref = root / "ref"
        model.save_pretrained(str(ref), max_shard_size=size)
        m = Mount(mkdir(root / "src"), root / "mnt", opts=spec["opts"]).start()
        mounts.append(m)
        view = pathlib.Path(m.mnt) / "ck"
        model.save_pretrained(str(view), max_shard_size=size)
        ranks = int(next(o for o in spec["opts"] if o.startswith("ranks="))[6:])
        c = SimpleNamespace(name=name, model=model, ref=ref, mount=m, view=view, src=root / "src",
                            srcdir=root / "src" / "ck", files=spec["files"], ranks=ranks, tp=spec["tp"],
                            root=root)
        ref_models = sorted(n for n in os.listdir(ref) if MODEL_RE.match(n))
        assert len(ref_models) == spec["files"], ref_models  # the setup gives what the case names
        cache[name] = c
        return c

    yield get
    gc.collect()  # models whose tensors are still mmapped from a mount
    for m in mounts:
        m.stop()


@pytest.mark.parametrize("name", list(SAVES))
def test_save_pretrained_reads_back_byte_exact(saved, name):
    """Every file save_pretrained wrote into the mount (config, generation config, weights,
    index) is listed and reads back byte-exact, with the same size and read bits, as the same save
    into a plain directory; no .ckptfs or shard name shows."""
    c = saved(name)
    assert names(c.view) == names(c.ref)
    for n in names(c.ref):
        p, r = c.view / n, c.ref / n
        assert filecmp.cmp(p, r, shallow=False), f"{n} differs"
        assert read(p) == read(r), n
        sp, sr = os.stat(p), os.stat(r)
        assert sp.st_size == sr.st_size, n
        # Who may read it is kept; a file served from rank shards shows read bits only (as
        # every consolidated view file does), so the write bits are not compared.
        assert sp.st_mode & 0o444 == sr.st_mode & 0o444, (
            f"{n}: mode {oct(sp.st_mode)} through the mount, {oct(sr.st_mode)} in a plain dir")
        assert stat.S_ISREG(sp.st_mode)
    assert_alive(c.mount)


@pytest.mark.parametrize("name", list(SAVES))
def test_save_pretrained_src_holds_rank_shards(saved, name):
    """SRC/ck holds shard-R-model-K-of-M for every rank and file and no real model*.safetensors;
    config and index are stored as written; every shard carries DCP_SHARDING_INFO; the shards of
    file K hold exactly the tensors of model-K and tile each one; big tensors are split the way
    -o split promises (even: dim 0 in `ranks` pieces; tp: colwise dim 0, rowwise dim 1)."""
    c = saved(name)
    splits_done(c.mount.mnt)  # with ranks above 1, each file's split into them runs after close
    src = names(c.srcdir)
    assert not [n for n in src if MODEL_RE.match(n)], f"real model files in SRC: {src}"
    m = c.files
    want = sorted(f"shard-{r:05d}-model-{k:05d}-of-{m:05d}.safetensors"
                  for r in range(1, c.ranks + 1) for k in range(1, m + 1))
    assert src_shards(c.srcdir) == want
    assert read(c.srcdir / "config.json") == read(c.ref / "config.json")
    if m > 1:
        assert read(c.srcdir / INDEX) == read(c.ref / INDEX)
    assert set(src) - set(want) <= {"config.json", "generation_config.json", INDEX, ".ckptfs"}, src

    info = sharding_info(c.srcdir)
    ref_files = sorted(n for n in os.listdir(c.ref) if MODEL_RE.match(n))
    for k, fname in enumerate(ref_files, start=1):
        ref_h = st_header(c.ref / fname)
        ref_h.pop("__metadata__", None)
        in_k = {t for t, chunks in info.items() for (sn, *_r) in chunks if SHARD_RE.match(sn).group(2) == f"{k:05d}"}
        assert in_k == set(ref_h), f"shards of file {k}: {sorted(in_k ^ set(ref_h))}"
        for t, e in ref_h.items():
            chunks = info[t]
            numel = 1
            for s in e["shape"]:
                numel *= s
            got = 0
            for sn, off, local, full in chunks:
                assert full is None or full == e["shape"], f"{t} in {sn}: full shape {full}"
                assert all(o + s <= d for o, s, d in zip(off, local, e["shape"])), (t, sn, off, local)
                n_ = 1
                for s in local:
                    n_ *= s
                got += n_
            assert got == numel, f"{t}: chunks hold {got} of {numel} elements"

    def split_dims(t):
        chunks = info[t]
        return len(chunks), {d for _, off, _, _ in chunks for d, o in enumerate(off) if o}

    if c.tp:
        # f32, hidden 128, intermediate 256: gate/up (colwise) and down (rowwise) are 128 KiB.
        for layer in range(2):
            for proj, dim in (("mlp.gate_proj", 0), ("mlp.up_proj", 0), ("mlp.down_proj", 1)):
                t = f"model.layers.{layer}.{proj}.weight"
                assert split_dims(t) == (c.ranks, {dim}), f"{t}: {info[t]}"
    else:
        # The embedding is >= 64 KiB in both dtypes: cut on dim 0 into `ranks` pieces.
        assert split_dims("model.embed_tokens.weight") == (c.ranks, {0}), info["model.embed_tokens.weight"]
    for t, chunks in info.items():  # 1-D tensors go whole to one rank
        if len(chunks[0][2]) == 1:
            assert len(chunks) == 1 and chunks[0][1] == [0], (t, chunks)


@pytest.mark.parametrize("name", list(SAVES))
def test_from_pretrained_from_mount(saved, name):
    """from_pretrained of MNT/ck gives exactly the saved model's state dict (values and dtypes)."""
    c = saved(name)
    model = load_model(c.view)
    bad = diff_state(model.state_dict(), c.model.state_dict())
    assert not bad, bad
    assert model.dtype == c.model.dtype
    del model
    gc.collect()


@pytest.mark.parametrize("name", list(SAVES))
def test_dcp_reader_full_load_of_src(saved, name):
    """torch DCP's HuggingFaceStorageReader on SRC/ck (the rank shards the mount wrote), in one
    process, loads every tensor equal to the plain save_pretrained output."""
    c = saved(name)
    ref = load_dir_tensors(c.ref)
    got = dcp_full_load(c.srcdir, ref)
    assert not diff_state(got, ref), diff_state(got, ref)


def test_dcp_reader_two_ranks_resharded(saved, base):
    """2 gloo ranks load each SRC/ck into DTensors (Shard(0), Shard(1), Replicate): every local
    chunk and every all-gathered tensor equals the reference (tests/python/dcp_reshard_load.py)."""
    placement = {"one_file_r4": "shard1", "three_files_r4": "shard0", "three_files_tp3": "rep"}
    jobs = [f"{saved(n).srcdir}:{saved(n).ref}:{placement[n]}" for n in SAVES]
    r = subprocess.run([sys.executable, str(RESHARD), "--world", "2", "--result", str(base / "reshard"), *jobs],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    results = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(results) == 2 * len(SAVES)
    for res in results:
        assert res["tensors"] > 0 and not res["bad_local"] and not res["bad_full"], res


@pytest.mark.parametrize("name", list(SAVES))
def test_cli_inspect_and_verify_src(saved, name):
    """`ckptfs inspect SRC/ck` and `ckptfs verify SRC/ck` accept the shards the mount wrote;
    inspect --json finds one valid checkpoint made of exactly those shards, whose outputs are
    the files save_pretrained wrote, holding its tensors."""
    c = saved(name)
    for cmd in ("inspect", "verify"):
        r = run(cmd, c.srcdir, check=False, timeout=60)
        assert r.returncode == 0, f"ckptfs {cmd} exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
    r = run("inspect", c.srcdir, "--json", check=False, timeout=60)
    assert r.returncode == 0, r.stderr
    [ck] = json.loads(r.stdout)["checkpoints"]
    assert ck["valid"] is True and ck["problems"] == [], ck["problems"]
    assert sorted(s["name"] for s in ck["shards"]) == src_shards(c.srcdir)
    assert sorted(o["name"] for o in ck["outputs"]) == sorted(n for n in os.listdir(c.ref) if MODEL_RE.match(n))
    assert sorted(t["name"] for t in ck["tensors"]) == sorted(c.model.state_dict())


def test_save_pretrained_twice_into_one_dir(px, base):
    """save_pretrained of one model in 3 files, then of another in 2 files, into the same
    directory (as a run that saves to one place does): the mount ends up with the same listing
    and bytes as the same two saves into a plain directory, from_pretrained gives the second
    model, and SRC holds only the second save's shards (none of the 3-file set is left)."""
    first = make_model(11, torch.bfloat16, hidden=64, inter=128, vocab=256)
    second = make_model(12, torch.bfloat16, hidden=64, inter=128, vocab=256)
    ref, view, srcdir = base / "twice-ref", px.mnt / "twice", px.src / "twice"
    for d in (ref, view):
        first.save_pretrained(str(d), max_shard_size=max_shard_size_for(first, 3))
        second.save_pretrained(str(d), max_shard_size=max_shard_size_for(second, 2))
    assert names(view) == names(ref)
    assert files_of(view) == files_of(ref)
    model = load_model(view)
    assert not diff_state(model.state_dict(), second.state_dict())
    del model
    gc.collect()
    assert src_shards(srcdir) == sorted(f"shard-{r:05d}-model-{k:05d}-of-00002.safetensors"
                                        for r in (1, 2) for k in (1, 2)), names(srcdir)


@pytest.mark.parametrize("name", list(SAVES))
def test_second_mount_ro_same_bytes(saved, name):
    """A second daemon serving the same SRC with -o ro shows the same listing and bytes as the
    plain save, reports itself read-only (statvfs ST_RDONLY) and refuses a write with EROFS."""
    c = saved(name)
    with Mount(c.src, c.root / "ro-mnt", opts=["ro"]) as m:
        view = pathlib.Path(m.mnt) / "ck"
        assert files_of(view) == files_of(c.ref)
        assert names(view) == names(c.ref)
        assert os.statvfs(m.mnt).f_flag & os.ST_RDONLY
        expect_errno(lambda: open(view / "new.txt", "wb"), errno.EROFS)
        expect_errno(lambda: os.unlink(view / "config.json"), errno.EROFS)
    assert names(c.view) == names(c.ref)


# =============================================================================================
# 2. transformers.Trainer: checkpoints, rotation, resume
# =============================================================================================


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n=16, seq=16, vocab=256, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i], "attention_mask": torch.ones_like(self.x[i])}


def trainer_args(out, max_steps):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(out), max_steps=max_steps, save_strategy="steps", save_steps=2,
                             save_total_limit=2, per_device_train_batch_size=4, learning_rate=1e-3,
                             report_to=[], use_cpu=True, logging_strategy="no", disable_tqdm=True,
                             dataloader_num_workers=0, seed=0)


def deep_equal(a, b, path="") -> list[str]:
    """Differences between two nested (dict/list/tensor/scalar) structures."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        return [] if ok else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(map(str, set(a) ^ set(b)))}"]
        return [d for k in a for d in deep_equal(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: len {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in deep_equal(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


@pytest.fixture(scope="module")
def trained(base):
    """A Trainer run (max_steps 6, save_steps 2, save_total_limit 2) with output_dir on a
    -o ranks=2 mount; the model weights at every save are kept for comparison."""
    from transformers import Trainer, TrainerCallback

    class Snap(TrainerCallback):
        def __init__(self):
            self.at = {}

        def on_save(self, args, state, control, model=None, **kw):
            self.at[state.global_step] = {k: v.detach().clone() for k, v in model.state_dict().items()}

    root = base / "trainer"
    m = Mount(mkdir(root / "src"), root / "mnt", opts=["ranks=2"]).start()
    try:
        out = pathlib.Path(m.mnt) / "run"
        snap = Snap()
        model = make_model(7, torch.float32, hidden=64, inter=128, vocab=256)
        trainer = Trainer(model=model, args=trainer_args(out, 6), train_dataset=RandomTokens(), callbacks=[snap])
        trainer.train()
        yield SimpleNamespace(mount=m, out=out, src=root / "src" / "run", snaps=snap.at, trainer=trainer,
                              state=trainer.state)
    finally:
        gc.collect()
        m.stop()


def test_trainer_rotation_leaves_last_two(trained):
    """After 6 steps with save_steps=2 and save_total_limit=2, only checkpoint-4 and
    checkpoint-6 remain, in the mount and in SRC (checkpoint-2 was shutil.rmtree'd through
    the mount, hidden .ckptfs included), and each holds rank shards, not model.safetensors."""
    t = trained
    assert t.state.global_step == 6
    assert sorted(t.snaps) == [2, 4, 6]
    ck = lambda d: sorted(n for n in os.listdir(d) if n.startswith("checkpoint-"))  # noqa: E731
    assert ck(t.out) == ["checkpoint-4", "checkpoint-6"]
    assert ck(t.src) == ["checkpoint-4", "checkpoint-6"], f"SRC: {os.listdir(t.src)}"
    assert not (t.src / "checkpoint-2").exists()
    for n in (4, 6):
        d = t.src / f"checkpoint-{n}"
        assert src_shards(d) == [f"shard-{r:05d}-model-00001-of-00001.safetensors" for r in (1, 2)], names(d)
        assert "model.safetensors" not in os.listdir(d)
        view = names(t.out / f"checkpoint-{n}")
        for f in ("config.json", "model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json",
                  "training_args.bin", "rng_state.pth"):
            assert f in view, view
        assert not [x for x in view if x.startswith((".ckptfs", "shard-", ".tmp"))], view
    assert_alive(t.mount)


def test_trainer_checkpoints_load(trained):
    """checkpoint-4 and checkpoint-6 load with from_pretrained from the mount and equal the
    model's weights at that step; torch DCP reads the same weights from their SRC shards;
    trainer_state.json and optimizer.pt load and say the right step."""
    t = trained
    for n in (4, 6):
        view = t.out / f"checkpoint-{n}"
        model = load_model(view)
        bad = diff_state(model.state_dict(), t.snaps[n])
        assert not bad, f"checkpoint-{n}: {bad}"
        del model
        gc.collect()
        got = dcp_full_load(t.src / f"checkpoint-{n}", load_dir_tensors(view))
        assert not diff_state(got, {k: v for k, v in t.snaps[n].items() if k in got}), n
        assert json.loads((view / "trainer_state.json").read_text())["global_step"] == n
        opt = torch.load(view / "optimizer.pt", weights_only=True)
        assert opt["state"] and all(int(s["step"]) == n for s in opt["state"].values()), n


def test_trainer_resume_from_mount(trained):
    """A new Trainer with resume_from_checkpoint=True and max_steps=8 resumes from
    checkpoint-6 on the mount: its first step starts at global_step 6 with the checkpoint's
    weights and exactly the optimizer state in optimizer.pt; it ends at step 8, and rotation
    leaves checkpoint-6 and checkpoint-8."""
    from transformers import Trainer, TrainerCallback

    t = trained
    saved_opt = torch.load(t.out / "checkpoint-6" / "optimizer.pt", weights_only=True)

    class Probe(TrainerCallback):
        def __init__(self):
            self.first = None
            self.saves = {}

        def on_step_begin(self, args, state, control, model=None, optimizer=None, **kw):
            if self.first is None:
                self.first = dict(step=state.global_step,
                                  weights={k: v.detach().clone() for k, v in model.state_dict().items()},
                                  opt=copy.deepcopy(optimizer.state_dict()))  # live tensors

        def on_save(self, args, state, control, model=None, **kw):
            self.saves[state.global_step] = {k: v.detach().clone() for k, v in model.state_dict().items()}

    probe = Probe()
    model = make_model(99, torch.float32, hidden=64, inter=128, vocab=256)  # other weights: must be loaded
    trainer = Trainer(model=model, args=trainer_args(t.out, 8), train_dataset=RandomTokens(), callbacks=[probe])
    trainer.train(resume_from_checkpoint=True)
    assert probe.first is not None
    assert probe.first["step"] == 6
    assert not diff_state(probe.first["weights"], t.snaps[6]), "resumed weights differ from checkpoint-6"
    diffs = deep_equal(probe.first["opt"]["state"], saved_opt["state"], "state")
    assert not diffs, f"optimizer state after resume differs from optimizer.pt: {diffs[:10]}"
    assert deep_equal(probe.first["opt"]["param_groups"], saved_opt["param_groups"], "param_groups") == []
    assert trainer.state.global_step == 8
    ck = sorted(n for n in os.listdir(t.out) if n.startswith("checkpoint-"))
    assert ck == ["checkpoint-6", "checkpoint-8"]
    assert sorted(n for n in os.listdir(t.src) if n.startswith("checkpoint-")) == ck
    model8 = load_model(t.out / "checkpoint-8")
    assert not diff_state(model8.state_dict(), probe.saves[8])
    del model8, trainer
    gc.collect()
    assert_alive(t.mount)


# =============================================================================================
# 3. torch DCP HuggingFaceStorageWriter(save_distributed=True) into the mount
# =============================================================================================


def test_dcp_save_distributed_into_mount(base):
    """2 gloo ranks dcp.save DTensor shards (fsdp, Shard(0)) with HuggingFaceStorageWriter
    (save_distributed=True) straight into MNT/dcp (tools/gen_checkpoint.py, which also copies
    config.json in through the mount). The shard files are stored as written, the view shows the
    consolidated files (no shard names), and from_pretrained of MNT/dcp equals the
    save_pretrained reference."""
    root = base / "dcp"
    with Mount(mkdir(root / "src"), root / "mnt", opts=["ranks=4"]) as m:
        out = pathlib.Path(m.mnt) / "dcp"
        ref = root / "ref"
        r = subprocess.run([sys.executable, str(GEN), str(out), "--reference", str(ref), "--layout", "fsdp",
                            "--world", "2", "--files", "2", "--dtype", "f32", "--seed", "5"],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-4000:] + "\n" + log_tail(m)
        srcdir = root / "src" / "dcp"
        shards = src_shards(srcdir)
        assert shards == sorted(f"shard-{r:05d}-model-{k:05d}-of-00002.safetensors" for r in (1, 2) for k in (1, 2))
        listing = names(out)
        assert not [n for n in listing if SHARD_RE.match(n)], listing
        assert {"config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"} <= set(listing), listing
        assert read(out / "config.json") == read(ref / "config.json")
        ref_tensors = load_dir_tensors(ref)
        assert not diff_state(load_dir_tensors(out), ref_tensors)
        model = load_model(out)
        bad = diff_state(model.state_dict(), load_model(ref).state_dict())
        assert not bad, bad
        del model
        gc.collect()


def test_written_files_visible_without_settle(mount_factory, tmp_path):
    """With settle=30, a consolidated file written through the mount, and DCP rank shards
    written through it, are shown and readable as soon as close() returns: files the mount
    saw being written need no settle wait."""
    from shardgen import TensorSpec, tensor_bytes, write_checkpoint

    m = mount_factory(mkdir(tmp_path / "src"), settle=30)
    mnt = pathlib.Path(m.mnt)
    (mnt / "a").mkdir()
    want = save_file_to(mnt / "a" / "model.safetensors", 40, 256)
    assert names(mnt / "a") == ["model.safetensors"]
    assert read(mnt / "a" / "model.safetensors") == want

    specs = [TensorSpec("w", "F32", (64, 32), (2, 1)), TensorSpec("b", "BF16", (32,), (), replicate=True)]
    ck = write_checkpoint(str(mnt / "b"), specs, world=2, seed=3)
    assert src_shards(tmp_path / "src" / "b") == ["shard-00001-model-00001-of-00001.safetensors",
                                                  "shard-00002-model-00001-of-00001.safetensors"]
    assert names_elsewhere(mnt / "b") == [DCP1, INDEX]
    # The writer itself lists what it wrote (and finds the consolidated files by name).
    assert names(mnt / "b") == src_shards(tmp_path / "src" / "b")
    assert tensor_bytes(str(mnt / "b" / DCP1)) == ck.truth()


def test_written_file_opens_the_moment_close_returns(mount_factory, tmp_path):
    """Written under its final name (torch.save style) or renamed there while open
    (save_pretrained style), a consolidated file opens and reads back the moment close()
    returns, every time: the kernel's entry for the file being written is dropped before
    close() returns, not some time after (once seen as ENOENT in about 1 close in 20)."""
    m = mount_factory(mkdir(tmp_path / "src"), settle=30)
    mnt = pathlib.Path(m.mnt)
    for i in range(24):
        d = mkdir(mnt / f"s{i}")
        if i % 2:
            want = blob(100 + i, 16)
            with open(d / ".tmpX", "wb") as f:
                f.write(want)
                os.rename(d / ".tmpX", d / "model.safetensors")
        else:
            want = save_file_to(d / "model.safetensors", 100 + i, 16)
        assert read(d / "model.safetensors") == want, f"round {i}"


# =============================================================================================
# 4. POSIX through the mount
# =============================================================================================


@pytest.fixture(scope="module")
def px(base):
    """One -o ranks=2 mount for the POSIX tests; each test works in its own directory."""
    m = Mount(mkdir(base / "px-src"), base / "px-mnt", opts=["ranks=2"]).start()
    ns = SimpleNamespace(mount=m, mnt=pathlib.Path(m.mnt), src=base / "px-src")
    yield ns
    gc.collect()
    m.stop()


def fresh(px, name) -> tuple[pathlib.Path, pathlib.Path]:
    """(MNT/name, SRC/name), created empty through the mount."""
    d = px.mnt / name
    d.mkdir()
    return d, px.src / name


def test_rename_over_file_and_dirs(px):
    """rename replaces an existing file (both names, SRC too), replaces an empty directory,
    refuses a non-empty one (ENOTEMPTY/EEXIST), moves a checkpoint directory with its committed
    model.safetensors, and a plain file renamed over a committed model.safetensors replaces
    it and takes its shards away."""
    d, s = fresh(px, "rename")
    (d / "a").write_bytes(b"new contents")
    (d / "b").write_bytes(b"old")
    os.rename(d / "a", d / "b")
    assert names(d) == ["b"] and read(d / "b") == b"new contents"
    assert names(s) == ["b"] and read(s / "b") == b"new contents"

    (d / "full").mkdir()
    (d / "full" / "f").write_bytes(b"x")
    (d / "empty").mkdir()
    os.rename(d / "full", d / "empty")
    assert names(d) == ["b", "empty"] and read(d / "empty" / "f") == b"x"
    assert names(s) == ["b", "empty"] and read(s / "empty" / "f") == b"x"
    (d / "other").mkdir()
    (d / "other" / "g").write_bytes(b"y")
    expect_errno(lambda: os.rename(d / "other", d / "empty"), errno.ENOTEMPTY, errno.EEXIST)

    (d / "ck").mkdir()
    want = save_file_to(d / "ck" / "model.safetensors", 41, 128)
    os.rename(d / "ck", d / "ck2")
    assert names(d / "ck2") == ["model.safetensors"]
    assert read(d / "ck2" / "model.safetensors") == want
    assert src_shards(s / "ck2") and not (s / "ck").exists()

    (d / "ck2" / "plain.txt").write_bytes(b"not a model")
    os.rename(d / "ck2" / "plain.txt", d / "ck2" / "model.safetensors")
    assert names(d / "ck2") == ["model.safetensors"]
    assert read(d / "ck2" / "model.safetensors") == b"not a model"
    assert src_shards(s / "ck2") == [], "the replaced file's shards are still in SRC"


def test_rename_noreplace_eexist(px):
    """renameat2(RENAME_NOREPLACE) onto an existing file, directory or committed
    model.safetensors fails with EEXIST and changes nothing; onto a free name it renames."""
    d, s = fresh(px, "noreplace")
    (d / "a").write_bytes(b"A")
    (d / "b").write_bytes(b"B")
    (d / "dir").mkdir()
    want = save_file_to(d / "model.safetensors", 42, 64)
    for target in ("b", "dir", "model.safetensors"):
        expect_errno(lambda: renameat2(d / "a", d / target, RENAME_NOREPLACE), errno.EEXIST)
    assert read(d / "a") == b"A" and read(d / "b") == b"B" and read(d / "model.safetensors") == want
    renameat2(d / "a", d / "c", RENAME_NOREPLACE)
    assert names(d) == ["b", "c", "dir", "model.safetensors"]
    assert read(s / "c") == b"A" and not (s / "a").exists()


def test_rmtree_of_checkpoint_dir_removes_everything(px):
    """shutil.rmtree through the mount of a directory holding a committed model.safetensors,
    config.json and a subdirectory removes the SRC directory entirely, hidden .ckptfs included."""
    d, s = fresh(px, "rmtree")
    (d / "config.json").write_text('{"a": 1}')
    want = save_file_to(d / "model.safetensors", 43, 128)
    (d / "sub").mkdir()
    (d / "sub" / "x.bin").write_bytes(b"x" * 100)
    assert read(d / "model.safetensors") == want
    assert src_shards(s) and (s / ".ckptfs").is_dir(), names(s)
    shutil.rmtree(d)
    assert not d.exists()
    assert not s.exists(), f"SRC left behind: {names(s)}"


def test_rmdir_of_dir_with_only_hidden_remainder(px):
    """A directory whose view is empty but whose SRC holds the shard of a broken checkpoint (a
    rank missing) and an empty .hf_metadata: rmdir through the mount works and removes the SRC
    directory with its hidden remainder."""
    from shardgen import TensorSpec, write_checkpoint

    s = px.src / "broken"
    # full_shape_key: the shards name the full shape, so a missing rank is a gap, not a smaller tensor
    write_checkpoint(str(s), [TensorSpec("w", "F32", (8, 4), (2, 1))], world=2, seed=4, full_shape_key=True)
    os.unlink(s / "shard-00002-model-00001-of-00001.safetensors")  # rank 2 never arrived
    (s / ".hf_metadata").mkdir()
    d = px.mnt / "broken"
    wait_for(lambda: d.is_dir() and names(d) == [], "the broken checkpoint's dir to show empty")
    os.rmdir(d)
    assert not d.exists()
    assert not s.exists(), f"SRC left behind: {names(s)}"


def test_unlink_consolidated_removes_shards(px):
    """unlink of an intercepted model.safetensors removes its rank shards from SRC, and so
    does unlink of a file the view synthesized from DCP shards written through the mount; the
    directories are then empty and rmdir works."""
    from shardgen import TensorSpec, write_checkpoint

    d, s = fresh(px, "unlink")
    save_file_to(d / "model.safetensors", 44, 128)
    splits_done(px.mnt)
    assert len(src_shards(s)) == 2
    os.unlink(d / "model.safetensors")
    assert names(d) == []
    assert src_shards(s) == [], names(s)
    records = [str(p.relative_to(s)) for p in (s / ".ckptfs").rglob("*") if "model.safetensors" in p.name] \
        if (s / ".ckptfs").exists() else []
    assert records == [], f"the unlinked file's record is still in SRC: {records}"
    expect_errno(lambda: os.stat(d / "model.safetensors"), errno.ENOENT)
    os.rmdir(d)
    assert not s.exists()

    d2, s2 = fresh(px, "unlink-dcp")
    write_checkpoint(str(d2), [TensorSpec("w", "F32", (32, 8), (2, 1))], world=2, seed=1)
    assert names_elsewhere(d2) == [DCP1, INDEX]
    os.unlink(d2 / DCP1)
    assert src_shards(s2) == [], names(s2)
    assert names_elsewhere(d2) == [], "the synthesized index outlived the only file it indexed"
    os.rmdir(d2)
    assert not s2.exists()


def test_fsync_mid_file_and_at_end(px):
    """fsync during and after writing a consolidated model.safetensors and a plain file
    succeeds, and both read back byte-exact (committed as shards at close)."""
    d, s = fresh(px, "fsync")
    data = blob(68, 1024)
    for name, body in (("model.safetensors", data), ("plain.bin", data[::-1])):
        fd = os.open(d / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            half = len(body) // 2
            os.write(fd, body[:half])
            os.fsync(fd)
            os.write(fd, body[half:])
            os.fsync(fd)
        finally:
            os.close(fd)
        assert read(d / name) == body, name
    assert len(src_shards(s)) == 2 and read(s / "plain.bin") == data[::-1]


def test_truncate_and_ftruncate(px):
    """truncate and ftruncate shrink and grow (with zeros) a plain file, O_TRUNC empties it,
    and SRC holds the same bytes."""
    d, s = fresh(px, "trunc")
    body = bytes(range(256)) * 40
    (d / "t.bin").write_bytes(body)
    os.truncate(d / "t.bin", 4000)
    assert read(d / "t.bin") == body[:4000] and os.stat(d / "t.bin").st_size == 4000
    fd = os.open(d / "t.bin", os.O_RDWR)
    try:
        os.ftruncate(fd, 6000)
        assert os.fstat(fd).st_size == 6000
        os.pwrite(fd, b"END", 5997)
    finally:
        os.close(fd)
    want = body[:4000] + b"\0" * 1997 + b"END"
    assert read(d / "t.bin") == want and read(s / "t.bin") == want
    fd = os.open(d / "t.bin", os.O_WRONLY | os.O_TRUNC)
    os.close(fd)
    assert read(d / "t.bin") == b"" and read(s / "t.bin") == b""


def test_chmod_utime_ns(px):
    """chmod and utime (nanosecond times) on a plain file and a directory are stored in SRC
    and reported by stat through the mount."""
    d, s = fresh(px, "attrs")
    (d / "f").write_bytes(b"f")
    os.chmod(d / "f", 0o640)
    os.chmod(d, 0o750)
    assert stat.S_IMODE(os.stat(d / "f").st_mode) == 0o640 == stat.S_IMODE(os.stat(s / "f").st_mode)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o750 == stat.S_IMODE(os.stat(s).st_mode)
    at, mt = 1_111_111_111_222_333_444, 1_234_567_891_987_654_321
    os.utime(d / "f", ns=(at, mt))
    for p in (d / "f", s / "f"):
        st = os.stat(p)
        assert (st.st_atime_ns, st.st_mtime_ns) == (at, mt), p


def test_directory_mtime_changes(px):
    """A directory's mtime moves forward when an entry is created, made (mkdir), renamed in
    or removed through the mount: Trainer rotation sorts checkpoints by it."""
    d, s = fresh(px, "dirmtime")
    (d / "keep").write_bytes(b"k")
    old = 1_000_000_000_000_000_000  # 2001

    def reset():
        os.utime(d, ns=(old, old))
        assert os.stat(d).st_mtime_ns == old

    steps = {
        "create": lambda: (d / "new").write_bytes(b"n"),
        "mkdir": lambda: os.mkdir(d / "sub"),
        "rename in": lambda: os.rename(px.mnt / "dirmtime-outside", d / "moved"),
        "unlink": lambda: os.unlink(d / "new"),
        "consolidated file": lambda: save_file_to(d / "model.safetensors", 45, 64),
    }
    (px.mnt / "dirmtime-outside").write_bytes(b"o")
    for what, op in steps.items():
        reset()
        op()
        assert os.stat(d).st_mtime_ns > old, f"{what}: directory mtime unchanged through the mount"
        assert os.stat(s).st_mtime_ns > old, f"{what}: directory mtime unchanged in SRC"


def test_o_excl_and_o_append(px):
    """O_CREAT|O_EXCL on an existing plain file or a committed model.safetensors fails with
    EEXIST (and on a free name creates it); O_APPEND appends."""
    d, s = fresh(px, "excl")
    (d / "x").write_bytes(b"abc")
    save_file_to(d / "model.safetensors", 46, 64)
    for n in ("x", "model.safetensors"):
        expect_errno(lambda: os.open(d / n, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644), errno.EEXIST)
    fd = os.open(d / "y", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    os.close(fd)
    assert (s / "y").exists()
    for _ in range(2):
        with open(d / "x", "ab") as f:
            f.write(b"def")
    fd = os.open(d / "x", os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, b"!")
    finally:
        os.close(fd)
    assert read(d / "x") == b"abcdefdef!" == read(s / "x")


def test_created_by_non_root_is_owned_by_caller(base):
    """With -o allow_other, files and directories a non-root caller (uid/gid 65534) creates
    through the mount belong to that caller in SRC, a committed model.safetensors's shards too."""
    import tempfile

    src = mkdir(base / "owner-src")
    # pytest's base temp is 0700: the mount point goes where uid 65534 can reach it
    top = pathlib.Path(tempfile.mkdtemp(prefix="ckptfs-owner-"))
    os.chmod(top, 0o755)
    try:
        _owned_by_caller(src, top / "mnt")
    finally:
        shutil.rmtree(top, ignore_errors=True)


def _owned_by_caller(src, mnt_path):
    with Mount(src, mnt_path, opts=["ranks=2", "allow_other"], log=str(src) + ".mnt.log") as m:
        mnt = pathlib.Path(m.mnt)
        (mnt / "open").mkdir()
        os.chmod(mnt / "open", 0o777)
        body = blob(69, 128)
        code = ("import os, sys; d = sys.argv[1]; os.mkdir(d + '/sub'); "
                "open(d + '/sub/f.txt', 'w').write('x'); open(d + '/sub/model.safetensors', 'wb').write(sys.stdin.buffer.read())")

        def drop():
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)

        # the system python: the venv's lies under /root, which uid 65534 cannot enter
        r = subprocess.run(["/usr/bin/python3", "-c", code, str(mnt / "open")], input=body, preexec_fn=drop,
                           capture_output=True, timeout=60)
        assert r.returncode == 0, r.stderr.decode()[-2000:]
        splits_done(mnt)
        for p in (src / "open" / "sub", src / "open" / "sub" / "f.txt",
                  *[src / "open" / "sub" / n for n in src_shards(src / "open" / "sub")]):
            st = os.stat(p)
            assert (st.st_uid, st.st_gid) == (65534, 65534), f"{p}: owned by {st.st_uid}:{st.st_gid}"
        assert len(src_shards(src / "open" / "sub")) == 2
        st = os.stat(mnt / "open" / "sub" / "model.safetensors")
        assert st.st_uid == 65534, st
        assert read(mnt / "open" / "sub" / "model.safetensors") == body


def test_statfs(px):
    """statvfs through the read-write mount reports SRC's filesystem (its size) and no
    read-only flag."""
    a, b = os.statvfs(px.mnt), os.statvfs(px.src)
    assert a.f_bsize > 0 and a.f_blocks > 0
    assert not a.f_flag & os.ST_RDONLY
    assert a.f_blocks * a.f_frsize == b.f_blocks * b.f_frsize
    assert a.f_namemax >= 255


def test_symlink_readlink(px):
    """symlink through the mount stores a link in SRC; readlink returns the target; open
    follows it; unlink removes the link only."""
    d, s = fresh(px, "links")
    (d / "target.txt").write_bytes(b"T")
    os.symlink("target.txt", d / "l")
    os.symlink("../nowhere/x", d / "dangling")
    assert os.readlink(d / "l") == "target.txt" == os.readlink(s / "l")
    assert os.readlink(d / "dangling") == "../nowhere/x"
    assert stat.S_ISLNK(os.lstat(d / "l").st_mode) and stat.S_ISLNK(os.lstat(s / "l").st_mode)
    assert read(d / "l") == b"T"
    os.unlink(d / "l")
    assert names(d) == ["dangling", "target.txt"] and read(s / "target.txt") == b"T"


def test_hard_link_plain_only(px):
    """A hard link to a plain file works (same bytes, nlink 2); to a committed
    model.safetensors it is refused."""
    d, s = fresh(px, "hard")
    (d / "p").write_bytes(b"plain")
    os.link(d / "p", d / "q")
    assert read(d / "q") == b"plain" and os.stat(d / "p").st_nlink == 2
    assert os.stat(s / "p").st_ino == os.stat(s / "q").st_ino
    save_file_to(d / "model.safetensors", 47, 64)
    with pytest.raises(OSError):
        os.link(d / "model.safetensors", d / "copy.safetensors")
    assert "copy.safetensors" not in names(d)


def test_rename_consolidated_is_exdev_and_mv_copies(px):
    """os.rename of a committed model.safetensors (to another name or directory), and of a
    file synthesized from DCP shards, fails with EXDEV; `mv` then falls back to copy + unlink:
    the destination reads byte-exact, committed as shards there, and the source's shards are
    gone."""
    from shardgen import TensorSpec, write_checkpoint

    d, s = fresh(px, "exdev")
    (d / "dst").mkdir()
    want = save_file_to(d / "model.safetensors", 48, 256)
    expect_errno(lambda: os.rename(d / "model.safetensors", d / "other.safetensors"), errno.EXDEV)
    expect_errno(lambda: os.rename(d / "model.safetensors", d / "dst" / "model.safetensors"), errno.EXDEV)
    r = subprocess.run(["mv", str(d / "model.safetensors"), str(d / "dst" / "model.safetensors")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert names(d) == ["dst"] and names(d / "dst") == ["model.safetensors"]
    assert read(d / "dst" / "model.safetensors") == want
    splits_done(px.mnt)  # the copy is split into its rank shards after its close
    assert src_shards(s) == [] and len(src_shards(s / "dst")) == 2

    d2, _ = fresh(px, "exdev-dcp")
    write_checkpoint(str(d2), [TensorSpec("w", "F32", (32, 8), (2, 1))], world=2, seed=2)
    assert names_elsewhere(d2) == [DCP1, INDEX]
    expect_errno(lambda: os.rename(d2 / DCP1, d2 / "x.safetensors"), errno.EXDEV)
    assert names_elsewhere(d2) == [DCP1, INDEX]


def test_ckptfs_name_is_reserved(px):
    """The name .ckptfs cannot be created through the mount (mkdir, create: EPERM), in a
    plain directory or a checkpoint directory, and the real one is never shown."""
    d, s = fresh(px, "reserved")
    save_file_to(d / "model.safetensors", 49, 64)
    assert ".ckptfs" not in names(d)
    expect_errno(lambda: os.stat(d / ".ckptfs"), errno.ENOENT)
    for where in (px.mnt / "reserved-sub", d):
        os.makedirs(where, exist_ok=True)
        expect_errno(lambda: os.mkdir(where / ".ckptfs"), errno.EPERM)
        expect_errno(lambda: os.open(where / ".ckptfs", os.O_CREAT | os.O_WRONLY, 0o644), errno.EPERM)
    # At the root of the mount .ckptfs exists: the daemon's read-only status directory.
    expect_errno(lambda: os.mkdir(px.mnt / ".ckptfs"), errno.EEXIST)
    expect_errno(lambda: os.open(px.mnt / ".ckptfs", os.O_CREAT | os.O_WRONLY, 0o644), errno.EISDIR)
    expect_errno(lambda: os.mkdir(px.mnt / ".ckptfs" / "x"), errno.EPERM)
    assert ".ckptfs" not in os.listdir(px.mnt)
    assert not (px.src / ".ckptfs").exists()
    assert read(d / "model.safetensors") == blob(49, 64)


# =============================================================================================
# 5. Faults
# =============================================================================================


def test_writer_killed_mid_file(mount_factory, tmp_path):
    """kill -9 of two writers mid-file: one writing B/model.safetensors directly, one
    replacing C/model.safetensors save_pretrained-style (.tmpXXXXXX, ftruncate, rename at the
    end). Nothing under a final name reads complete-but-wrong, the committed A/ and the older
    C/model.safetensors read byte-exact, and the daemon lives on."""
    m = mount_factory(mkdir(tmp_path / "src"), opts=("ranks=2",))
    mnt = pathlib.Path(m.mnt)
    for x in "ABC":
        (mnt / x).mkdir()
    old_a = save_file_to(mnt / "A" / "model.safetensors", 50, 512)
    old_c = save_file_to(mnt / "C" / "model.safetensors", 51, 512)
    new = blob(52, 4096)
    wb = Writer(new, mnt / "B" / "model.safetensors", tmp_path, mode="direct", sleep=0.02)
    wc = Writer(new, mnt / "C" / "model.safetensors", tmp_path, mode="tmp", sleep=0.02)
    try:
        wb.wait_written(MIB)
        wc.wait_written(MIB)
    finally:
        wb.kill()
        wc.kill()
    assert_alive(m)
    assert read(mnt / "A" / "model.safetensors") == old_a
    assert read(mnt / "C" / "model.safetensors") == old_c
    print("\nB/model.safetensors:", check_not_complete_but_wrong(mnt / "B" / "model.safetensors", new))
    for d in ("B", "C"):
        for n in names(mnt / d):
            if MODEL_RE.match(n):
                check_not_complete_but_wrong(mnt / d / n, new, (old_c,) if d == "C" else ())
    # The older file is still the real thing: from SRC's shards too.
    assert not diff_state(dcp_full_load(tmp_path / "src" / "C", tensors(51, 512)), tensors(51, 512))
    assert_alive(m)


def test_open_reader_keeps_old_bytes_during_replacement(mount_factory, tmp_path):
    """A reader that opened (and mmapped) D/model.safetensors before a save_pretrained-style
    writer replaced it keeps reading the old bytes while the new file is written under the
    name, and after it is committed; a fresh open then reads the new bytes."""
    import mmap

    m = mount_factory(mkdir(tmp_path / "src"), opts=("ranks=2",))
    mnt = pathlib.Path(m.mnt)
    (mnt / "D").mkdir()
    old = save_file_to(mnt / "D" / "model.safetensors", 70, 512)
    new = blob(71, 2048)
    with open(mnt / "D" / "model.safetensors", "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        try:
            w = Writer(new, mnt / "D" / "model.safetensors", tmp_path, mode="tmp", sleep=0.02, rename_after=8)
            try:
                w.wait_for(lambda words: words == ["renamed"])
                w.wait_written(MIB)
                f.seek(0)
                assert f.read() == old, "an open reader of the old file reads other bytes mid-replacement"
                assert mm[:] == old
                w.finish()
            finally:
                w.kill()
            assert read(mnt / "D" / "model.safetensors") == new
            f.seek(0)
            assert f.read() == old, "an open reader of the old file reads other bytes after the commit"
            assert mm[:] == old
        finally:
            mm.close()
    assert read(mnt / "D" / "model.safetensors") == new
    assert_alive(m)


def test_writer_killed_after_rename_while_replacing(mount_factory, tmp_path):
    """A save_pretrained-style writer replacing D/model.safetensors renames its temp file over
    it while still writing (as safetensors does), then is killed (-9): D/model.safetensors is
    never the new size with zeros where nothing was written, and a fresh open reads the older,
    committed file byte-exact."""
    m = mount_factory(mkdir(tmp_path / "src"), opts=("ranks=2",))
    mnt = pathlib.Path(m.mnt)
    (mnt / "D").mkdir()
    old = save_file_to(mnt / "D" / "model.safetensors", 53, 512)
    new = blob(54, 4096)
    w = Writer(new, mnt / "D" / "model.safetensors", tmp_path, mode="tmp", sleep=0.02, rename_after=8)
    try:
        w.wait_for(lambda words: words == ["renamed"])
        w.wait_written(MIB + 512 * KIB)
    finally:
        w.kill()
    assert_alive(m)
    outcome = check_not_complete_but_wrong(mnt / "D" / "model.safetensors", new, (old,))
    print(f"\nD/model.safetensors after the killed replacement: {outcome}")
    # The cut-short new file is never committed, so a fresh open gets the committed older file
    # (once the kernel has dropped the entry that pointed at the file being written).
    wait_for(lambda: (mnt / "D" / "model.safetensors").read_bytes() == old,
             "the older file under its name again", timeout=5)
    assert_alive(m)


def test_daemon_killed_mid_file(tmp_path):
    """kill -9 of the daemon while B/model.safetensors is being written (auto_unmount takes
    the mount away); remount the same SRC: the committed A/ reads byte-exact, B shows only
    config.json (the half-written file is not shown under its final name, and no staging
    leftovers show), SRC/B is eventually cleaned of them, and rmtree of B works."""
    src = mkdir(tmp_path / "src")
    m = Mount(src, tmp_path / "mnt", opts=["ranks=2"], log=str(tmp_path / "mnt.1.log")).start()
    w = None
    try:
        mnt = pathlib.Path(m.mnt)
        (mnt / "A").mkdir()
        (mnt / "B").mkdir()
        (mnt / "A" / "config.json").write_text('{"a": 1}')
        (mnt / "B" / "config.json").write_text('{"b": 1}')
        old = save_file_to(mnt / "A" / "model.safetensors", 55, 1024)
        assert read(mnt / "A" / "model.safetensors") == old
        w = Writer(blob(56, 4096), mnt / "B" / "model.safetensors", tmp_path, mode="direct", sleep=0.02)
        w.wait_written(MIB)
        m.proc.send_signal(signal.SIGKILL)
        m.proc.wait(timeout=30)
    finally:
        if w is not None:
            w.kill()
        rc = m.stop(check=False)
        unmount(m.mnt)
    assert rc == -signal.SIGKILL
    wait_killed_mount_gone(m.mnt)

    with Mount(src, tmp_path / "mnt", opts=["ranks=2"], log=str(tmp_path / "mnt.2.log")) as m2:
        mnt = pathlib.Path(m2.mnt)
        assert names(mnt / "A") == ["config.json", "model.safetensors"]
        assert read(mnt / "A" / "model.safetensors") == old
        if "model.safetensors" in names(mnt / "B"):
            raise AssertionError(
                f"the uncommitted B/model.safetensors is shown under its final name after the remount "
                f"({os.stat(mnt / 'B' / 'model.safetensors').st_size} bytes; SRC/B: {names(src / 'B')})")
        assert names(mnt / "B") == ["config.json"], "leftovers of the uncommitted file are shown"
        wait_for(lambda: (names(mnt / "B") == ["config.json"]
                          and set(os.listdir(src / "B")) - {".ckptfs"} == {"config.json"}),
                 "SRC/B to be cleaned of the uncommitted file's leftovers", timeout=20)
        shutil.rmtree(mnt / "B")
        assert not (src / "B").exists(), names(src / "B")
        assert read(mnt / "A" / "model.safetensors") == old
        assert_alive(m2)


def test_enospc_on_small_source(small_tmpfs, mount_factory, tmp_path):
    """SRC on an 8 MiB tmpfs: writing a 12 MiB consolidated file fails at write() or close()
    with ENOSPC; the committed A/model.safetensors still reads byte-exact, the failed name does
    not read as complete, and once it is removed the space is back (a 3 MiB file commits)."""
    src = small_tmpfs / "src"
    src.mkdir()
    m = mount_factory(src, opts=("ranks=2",))
    mnt = pathlib.Path(m.mnt)
    (mnt / "A").mkdir()
    (mnt / "B").mkdir()
    old = save_file_to(mnt / "A" / "model.safetensors", 57, 1024)
    big = blob(58, 12 * 1024)
    errs = []
    fd = os.open(mnt / "B" / "model.safetensors", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for off in range(0, len(big), MIB):
            try:
                os.write(fd, big[off:off + MIB])
            except OSError as e:
                errs.append(("write", e.errno))
                break
    finally:
        try:
            os.close(fd)
        except OSError as e:
            errs.append(("close", e.errno))
    assert errs, "12 MiB went into an 8 MiB tmpfs without an error"
    assert errs[0][1] == errno.ENOSPC, f"first error {errs[0][0]}: {errno.errorcode.get(errs[0][1])}"
    assert_alive(m)
    assert read(mnt / "A" / "model.safetensors") == old
    check_not_complete_but_wrong(mnt / "B" / "model.safetensors", big)
    if (mnt / "B" / "model.safetensors").exists():
        os.unlink(mnt / "B" / "model.safetensors")
    want = save_file_to(mnt / "B" / "model.safetensors", 59, 3 * 1024)
    assert read(mnt / "B" / "model.safetensors") == want
    assert read(mnt / "A" / "model.safetensors") == old


def test_concurrent_writers(mount_factory, tmp_path):
    """Six writers at once: two real safetensors save_file processes (V/, W/), two slow
    save_pretrained-style writers into X/ and Y/, and two into the same directory Z/ under
    different names (model-00001-of-00002 directly, model-00002-of-00002 via temp + rename).
    Every file reads back byte-exact and is committed as its own rank shards."""
    m = mount_factory(mkdir(tmp_path / "src"), opts=("ranks=2",))
    mnt = pathlib.Path(m.mnt)
    for x in "VWXYZ":
        (mnt / x).mkdir()
    code = ("import sys, torch; from safetensors.torch import save_file; g = torch.Generator().manual_seed(int(sys.argv[2])); "
            "rows = 2048 * 1024 // 1024; "
            "save_file({'big.weight': torch.randn(rows, 256, generator=g), 'small.bias': torch.randn(256, generator=g), "
            "'norm.weight': torch.randn(64, generator=g).to(torch.bfloat16)}, sys.argv[1], metadata={'format': 'pt'})")
    real = {x: subprocess.Popen([sys.executable, "-c", code, str(mnt / x / "model.safetensors"), str(seed)],
                                stderr=subprocess.PIPE, text=True) for x, seed in (("V", 60), ("W", 61))}
    want = {("V", "model.safetensors"): blob(60, 2048), ("W", "model.safetensors"): blob(61, 2048)}
    jobs = {("X", "model.safetensors"): (blob(62, 2048), "tmp"),
            ("Y", "model.safetensors"): (blob(63, 2048), "tmp"),
            # two files of one checkpoint: their tensor names differ, as save_pretrained's do
            ("Z", "model-00001-of-00002.safetensors"): (blob(64, 2048, "layers.0."), "direct"),
            ("Z", "model-00002-of-00002.safetensors"): (blob(65, 1536, "layers.1."), "tmp")}
    writers = [Writer(data, mnt / d / n, tmp_path, mode=mode, sleep=0.005) for (d, n), (data, mode) in jobs.items()]
    for w in writers:
        w.finish()
    for x, p in real.items():
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, f"save_file into {x} failed: {err[-2000:]}"
    want.update({k: v[0] for k, v in jobs.items()})
    assert_alive(m)
    for (d, n), data in want.items():
        assert read(mnt / d / n) == data, f"{d}/{n} differs"
    assert names(mnt / "Z") == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    splits_done(mnt)  # ranks=2: each file is split into its rank shards after its close
    for d in "VWXY":
        assert src_shards(tmp_path / "src" / d) == [f"shard-{r:05d}-model-00001-of-00001.safetensors" for r in (1, 2)]
    assert src_shards(tmp_path / "src" / "Z") == sorted(
        f"shard-{r:05d}-model-{k:05d}-of-00002.safetensors" for r in (1, 2) for k in (1, 2))


def test_reader_while_writing(mount_factory, tmp_path):
    """While a save_pretrained-style writer writes (ftruncate to the full size first), a
    reader opens the file by its temp name, and after the rename by its final name, and reads
    it whole: what was written so far reads exact, every other byte reads as zero or as the
    data; the daemon survives, and after close the final file is exact."""
    import numpy as np

    m = mount_factory(mkdir(tmp_path / "src"), opts=("ranks=2",))
    mnt = pathlib.Path(m.mnt)
    (mnt / "R").mkdir()
    data = blob(66, 4096)
    target = np.frombuffer(data, dtype=np.uint8)
    w = Writer(data, mnt / "R" / "model.safetensors", tmp_path, mode="tmp", sleep=0.02, rename_after=32)

    def check_partial(path, what):
        before = w.written
        got = read(path)
        assert len(got) == len(data), f"{what}: {len(got)} bytes, the file was ftruncated to {len(data)}"
        assert got[:before] == data[:before], f"{what}: the first {before} bytes written read back wrong"
        g = np.frombuffer(got, dtype=np.uint8)
        bad = np.nonzero((g != target) & (g != 0))[0]
        assert bad.size == 0, f"{what}: bytes that are neither the data nor zero at {bad[:5]}"

    try:
        w.wait_for(lambda words: words[0] == "tmp")
        w.wait_written(512 * KIB)
        check_partial(mnt / "R" / w.tmp_name, f"temp name {w.tmp_name}")
        w.wait_for(lambda words: words == ["renamed"])
        w.wait_written(2 * MIB + 512 * KIB)
        check_partial(mnt / "R" / "model.safetensors", "final name before close")
        assert_alive(m)
        w.finish()
    finally:
        w.kill()
    assert_alive(m)
    assert names(mnt / "R") == ["model.safetensors"]
    assert read(mnt / "R" / "model.safetensors") == data
    splits_done(mnt)  # ranks=2: the file is split into its rank shards after its close
    assert len(src_shards(tmp_path / "src" / "R")) == 2


def test_lookalike_and_cut_short_files_stored_as_written(px):
    """Files named model*.safetensors that are not complete safetensors files, a valid
    length + '{' + garbage, and a real header with only half its data (closed early), are
    stored as plain files and read back exactly as written, with exact sizes; a valid
    consolidated file under another name (adapter_model.safetensors) is stored whole."""
    d, s = fresh(px, "lookalike")
    rng = __import__("random").Random(5)
    garbage = bytes(rng.randrange(256) for _ in range(200))
    fake = struct.pack("<Q", 200) + b"{" + garbage[1:] + bytes(rng.randrange(256) for _ in range(100 * KIB))
    full = blob(67, 512)
    cut = full[:len(full) // 2]
    (d / "a").mkdir()
    (d / "b").mkdir()
    (d / "c").mkdir()
    cases = {"a/model.safetensors": fake, "b/model-00001-of-00002.safetensors": cut,
             "c/adapter_model.safetensors": full}
    for rel, data in cases.items():
        with open(d / rel, "wb") as f:
            f.write(data)
    for rel, data in cases.items():
        assert read(d / rel) == data, rel
        assert os.stat(d / rel).st_size == len(data), rel
        assert read(s / rel) == data, f"SRC/{rel} is not the plain file as written"
        assert src_shards(s / rel.split("/")[0]) == [], rel
    assert_alive(px.mount)
