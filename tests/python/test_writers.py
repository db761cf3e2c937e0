"""Tier 4: consolidating writers save into the mount unmodified (issue 19).

Each writer is the framework's own code, run from tests/python/writers/ as a separate
process with 2 ranks on gloo (CPU):
  torch_hf_save.py           torch DCP HuggingFaceStorageWriter(save_distributed=True,
                             enable_consolidation=True), with and without a file mapping;
  titan_hf_save.py           torchtitan 0.3.0's CheckpointManager with last_save_in_hf (its
                             own HF writer choice and consolidation, with and without a mapping);
  nemo_consolidated_save.py  NeMo AutoModel 0.7.0's Checkpointer, save_consolidated=True.

Every save runs twice: into a plain directory and into the mount at the same relative path.
Then every file the mount shows under the consolidated output is compared byte for byte with
the plain save's; the rank shards (in SRC) hold the same tensors as the plain save's shards
(their headers' __metadata__ key order varies from run to run in torch, so tensors are
compared, not bytes); the consolidated output and the mount's own consolidated view of the
shards both equal the reference state dict; and, for the HF models, from_pretrained loads
both. Skipped (never faked) without root, /dev/fuse or the framework packages.
"""

from __future__ import annotations

import filecmp
import json
import os
import pathlib
import shutil
import signal
import struct
import subprocess
import sys

import pytest

from conftest import ROOT, Mount, have, requires_fuse
from mount_util import killed, splits_done

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

pytestmark = requires_fuse

WRITERS = pathlib.Path(__file__).parent / "writers"


def run_writer(script: str, out: pathlib.Path, *args: str, timeout: float = 240) -> list[str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, str(WRITERS / script), str(out), *args], capture_output=True,
                       text=True, timeout=timeout, env=env, cwd=str(out.parent))
    assert r.returncode == 0, f"{script} {out}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def tensors(path: pathlib.Path) -> dict:
    return safetensors_torch.load_file(str(path))


def same_tensors(a: dict, b: dict) -> list[str]:
    if sorted(a) != sorted(b):
        return [f"names differ: {sorted(set(a) ^ set(b))}"]
    return [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]


def shard_tensors(d: pathlib.Path) -> dict:
    """Every shard of `d` (in SRC): name -> {tensor: bytes} with the sharding info of each."""
    out = {}
    for p in sorted(d.glob("shard-*.safetensors")):
        with safetensors_torch.safe_open(str(p), "pt") as f:
            info = json.loads(f.metadata()["DCP_SHARDING_INFO"])
            out[p.name] = {k: (f.get_tensor(k), info[k]["saved_offsets"]) for k in f.keys()}
    return out


def assert_same_shards(src: pathlib.Path, plain: pathlib.Path):
    a, b = shard_tensors(src), shard_tensors(plain)
    assert sorted(a) == sorted(b), f"shard files: {sorted(a)} vs {sorted(b)}"
    for name in a:
        assert sorted(a[name]) == sorted(b[name]), name
        for k in a[name]:
            (ta, oa), (tb, ob) = a[name][k], b[name][k]
            assert oa == ob and ta.dtype == tb.dtype and torch.equal(ta, tb), f"{name}: {k}"


def assert_same_files(view: pathlib.Path, plain: pathlib.Path, names: list[str]):
    for n in names:
        assert filecmp.cmp(view / n, plain / n, shallow=False), f"{view / n} differs from {plain / n}"


@pytest.fixture
def dirs(tmp_path):
    src, plain = tmp_path / "src", tmp_path / "plain"
    src.mkdir()
    plain.mkdir()
    m = Mount(src, tmp_path / "mnt", log=str(tmp_path / "mnt.log")).start()
    yield src, pathlib.Path(m.mnt), plain, m
    m.stop()


@pytest.mark.parametrize("mapping", [False, True], ids=["one-file", "mapping"])
def test_torch_hf_writer_with_consolidation(dirs, mapping):
    """torch's HF writer with enable_consolidation: the writer lists and reads back its own
    rank shards in out/sharded/ (it died with 'No DCP custom metadata found' on the
    synthesized file before), and its consolidated output is the plain save's, byte for byte;
    the mount's view of out/sharded/ is the same tensors."""
    src, mnt, plain, m = dirs
    args = ["--mapping"] if mapping else []
    run_writer("torch_hf_save.py", plain / "out", *args)
    run_writer("torch_hf_save.py", mnt / "out", *args)
    want = sorted(n for n in os.listdir(plain / "out") if n != "sharded")
    assert sorted(n for n in os.listdir(mnt / "out") if n != "sharded") == want
    assert_same_files(mnt / "out", plain / "out", want)
    assert_same_shards(src / "out" / "sharded", plain / "out" / "sharded")
    ref = tensors(plain / "reference-out.safetensors")
    got = {}
    for n in want:
        if n.endswith(".safetensors"):
            got.update(tensors(mnt / "out" / n))
    assert not same_tensors(got, ref)
    view = {}
    for n in os.listdir(mnt / "out" / "sharded"):
        if n.endswith(".safetensors"):
            view.update(tensors(mnt / "out" / "sharded" / n))
    assert not same_tensors(view, ref), "the mount's view of the rank shards"
    assert_stored_once(src / "out", mnt / "out", plain / "out", want)
    if mapping:  # several files, every header written first: each stored once all the same
        assert len([n for n in want if n.endswith(".safetensors")]) == 2, want
        assert m.proc.poll() is None
        return
    # A new save into sharded/ (the test's own open with O_TRUNC of a rank shard there) leaves
    # what out/ stored as it was: it gets its own copy of that shard first.
    victim = sorted(n for n in os.listdir(src / "out" / "sharded") if n.startswith("shard-"))[0]
    with open(mnt / "out" / "sharded" / victim, "wb") as f:
        f.write(b"not a shard")
    assert (src / "out" / victim).stat().st_nlink == 1
    assert_same_files(mnt / "out", plain / "out", want)
    # Removing sharded/ leaves out/'s files whole.
    shutil.rmtree(mnt / "out" / "sharded")
    assert_same_files(mnt / "out", plain / "out", want)
    assert m.proc.poll() is None


def consolidated(d: pathlib.Path) -> list[str]:
    return sorted(n for n in os.listdir(d) if n.startswith("model") and n.endswith(".safetensors"))


@pytest.mark.parametrize("mapping", [False, True], ids=["one-file", "mapping"])
def test_torch_hf_writer_saves_again(dirs, mapping):
    """A second consolidating save into the same out/, of other weights: torch writes each
    output file's header over a name that stores the first save's file, closes it, and reopens
    it to append. That close failed (EINVAL: 'the name keeps the consolidated file stored under
    it') and the save raised. Now the second save is the plain directory's, byte for byte, and
    stored once."""
    src, mnt, plain, m = dirs
    args = ["--mapping"] if mapping else []
    for seed in ("0", "1"):
        run_writer("torch_hf_save.py", plain / "out", "--seed", seed, *args)
        run_writer("torch_hf_save.py", mnt / "out", "--seed", seed, *args)
    want = sorted(n for n in os.listdir(plain / "out") if n != "sharded")
    assert sorted(n for n in os.listdir(mnt / "out") if n != "sharded") == want
    assert_stored_once(src / "out", mnt / "out", plain / "out", want)
    got = {}
    for n in consolidated(mnt / "out"):
        got.update(tensors(mnt / "out" / n))
    assert not same_tensors(got, tensors(plain / "reference-out.safetensors")), "the second save"
    assert m.proc.poll() is None


# torch's public offline consolidation, as a user runs it: rank shards of one directory
# (argv[1]) into argv[2] consolidated files of each later argument's directory, every header
# first, then each reopened to append its data.
_CONSOLIDATE = """
import glob, os, sys
from safetensors import safe_open
from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files
inp, files = sys.argv[1], int(sys.argv[2])
names = set()
for f in glob.glob(os.path.join(inp, "*.safetensors")):
    with safe_open(f, "pt") as s:
        names.update(s.keys())
names = sorted(names)
for out in sys.argv[3:]:
    os.makedirs(out, exist_ok=True)
    consolidate_safetensors_files(inp, out, {k: 1 + i * files // len(names) for i, k in enumerate(names)})
"""


def test_torch_consolidate_into_a_directory_again(dirs):
    """torch's consolidate_safetensors_files(input_dir, output_dir) run twice into the same
    output_dir in the mount (no sharded/ beside it), of other weights the second time, into one
    file and into two: its header over a name that stores the first run's file, closed, then
    reopened to append. That close failed (EINVAL: 'the name keeps the consolidated file stored
    under it') unless sharded/ was beside it. Every run gives the plain directory's files, byte
    for byte."""
    src, mnt, plain, m = dirs
    for seed in ("0", "1"):
        run_writer("torch_hf_save.py", plain / f"in{seed}", "--seed", seed)
    for seed in ("0", "1"):
        for files in (1, 2):
            outs = [plain / f"out{files}", mnt / f"out{files}"]
            r = subprocess.run([sys.executable, "-c", _CONSOLIDATE, str(plain / f"in{seed}" / "sharded"),
                                str(files), *map(str, outs)], capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, f"seed {seed}, {files} file(s): {r.stderr[-3000:]}"
            want = sorted(os.listdir(outs[0]))
            assert len(consolidated(outs[0])) == files, want
            assert sorted(os.listdir(outs[1])) == want, f"seed {seed}"
            assert_same_files(outs[1], outs[0], want)
            got = {}
            for n in consolidated(outs[1]):
                got.update(tensors(outs[1] / n))
            ref = tensors(plain / f"reference-in{seed}.safetensors")
            assert not same_tensors(got, ref), f"seed {seed}, {files} file(s)"
            del got  # its tensors map the mount's files
    assert m.proc.poll() is None


# torch's HF save (torch/distributed/checkpoint/_consolidate_hf_safetensors.py), replayed from a
# plain save's files by one process (the test's own must not become a writer there): the rank
# shards into sharded/, then every header ("wb"), then each file reopened ("r+b") and its data
# appended; killed (SIGKILL) once `argv[3]` files are complete.
_CONSOLIDATOR = """
import os, shutil, signal, struct, sys
plain, out, complete = sys.argv[1], sys.argv[2], int(sys.argv[3])
os.makedirs(os.path.join(out, "sharded"), exist_ok=True)
for n in os.listdir(os.path.join(plain, "sharded")):
    shutil.copyfile(os.path.join(plain, "sharded", n), os.path.join(out, "sharded", n))
names = sorted(n for n in os.listdir(plain) if n.startswith("model") and n.endswith(".safetensors"))
blobs = {n: open(os.path.join(plain, n), "rb").read() for n in names}
head = {n: 8 + struct.unpack("<Q", b[:8])[0] for n, b in blobs.items()}
for n in names:
    with open(os.path.join(out, n), "wb") as f:
        f.write(blobs[n][:head[n]])
for i, n in enumerate(names):
    if i == complete:
        os.kill(os.getpid(), signal.SIGKILL)
    with open(os.path.join(out, n), "r+b") as f:
        f.seek(0, os.SEEK_END)
        f.write(blobs[n][head[n]:])
"""


@pytest.mark.parametrize("case", ["again-one-file", "again-mapping", "first-mapping"])
def test_torch_hf_consolidator_killed(tmp_path, case):
    """torch's consolidator killed (SIGKILL) while it saves into out/: saving again, after the
    headers (one file) or between its two files (mapping); or in the first save, between its two
    files. The files it stored complete show; never the first save's file beside the second
    save's. A name whose header waits for its data shows what the plain directory shows (the
    header alone, which loads nothing) where nothing else of out/ is stored (the header over
    the name dropped the first save's file, as the plain directory's O_TRUNC does), and nothing
    beside a file stored complete (the checkpoint's view hides it). So it stays after the daemon
    is killed (kill -9) and the mount made again. Then the save run again is the plain
    directory's, stored once."""
    mapping, again = "mapping" in case, case.startswith("again")
    src, plain0, plain = tmp_path / "src", tmp_path / "plain0", tmp_path / "plain"
    for d in (src, plain0, plain):
        d.mkdir()
    args = ["--mapping"] if mapping else []
    run_writer("torch_hf_save.py", plain0 / "out", "--seed", "0", *args)
    run_writer("torch_hf_save.py", plain / "out", "--seed", "1", *args)
    files = consolidated(plain / "out")
    assert len(files) == (2 if mapping else 1), files
    complete = 1 if mapping else 0
    # What readers see with the consolidator killed: the files it stored complete, and none
    # whose header waits for its data.
    shown = files[:complete]
    headers = files if again and not mapping else []  # the header alone, as written
    first = tmp_path / "mnt"

    def check(mnt: pathlib.Path):
        got = consolidated(mnt / "out")
        assert got == sorted(shown + headers), f"shown: {got} (a model of two saves?), want {shown} + {headers}"
        assert_same_files(mnt / "out", plain / "out", shown)
        for n in headers:
            want = (plain / "out" / n).read_bytes()
            want = want[:8 + struct.unpack("<Q", want[:8])[0]]
            assert (mnt / "out" / n).read_bytes() == want, f"{n}: not the header alone"
        for n in sorted(set(files) - set(shown) - set(headers)):
            assert not (mnt / "out" / n).exists(), f"{n} is shown"
        # No index names a part of the set as the whole (the first save's lists them all, and a
        # loader fails on the missing file): none is made up for it.
        index = mnt / "out" / "model.safetensors.index.json"
        assert index.exists() == again, sorted(os.listdir(mnt / "out"))

    with killed(Mount(src, first, log=str(tmp_path / "mnt.1.log")).start()) as mnt:
        if again:
            run_writer("torch_hf_save.py", mnt / "out", "--seed", "0", *args)
            assert_same_files(mnt / "out", plain0 / "out", files)
        r = subprocess.run([sys.executable, "-c", _CONSOLIDATOR, str(plain / "out"), str(mnt / "out"),
                            str(complete)], capture_output=True, text=True, timeout=120)
        assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
        check(mnt)
    with Mount(src, first, log=str(tmp_path / "mnt.2.log")) as m2:
        mnt = pathlib.Path(m2.mnt)
        check(mnt)
        run_writer("torch_hf_save.py", mnt / "out", "--seed", "1", *args)
        want = sorted(n for n in os.listdir(plain / "out") if n != "sharded")
        assert sorted(n for n in os.listdir(mnt / "out") if n != "sharded") == want
        assert_stored_once(src / "out", mnt / "out", plain / "out", want)
        assert m2.proc.poll() is None


def assert_stored_once(src: pathlib.Path, mnt: pathlib.Path, plain: pathlib.Path, want: list[str],
                       origin: pathlib.Path | None = None):
    """The consolidated files are stored as links of the rank shards in `origin` (sharded/ by
    default) that they were made from (one stored copy), and still read as the plain save's."""
    splits_done(next(p for p in mnt.parents if p.is_mount()))
    origin = origin or src / "sharded"
    stored = sorted(n for n in os.listdir(src) if n.startswith("shard-"))
    assert stored, sorted(os.listdir(src))
    for n in stored:
        a, b = (src / n).stat(), (origin / n).stat()
        assert (a.st_ino, a.st_nlink) == (b.st_ino, 2), f"{n}: not stored as a link of {origin / n}"
    top = src if origin.is_relative_to(src) else origin
    inodes = {p.stat().st_ino: p.stat().st_size for p in top.rglob("*") if p.is_file()}
    consolidated = sum((plain / n).stat().st_size for n in want if n.endswith(".safetensors"))
    assert sum(inodes.values()) < consolidated * 1.1 + 65536, "the bytes are stored twice"
    assert_same_files(mnt, plain, want)


@pytest.mark.skipif(not have("torchtitan.components.checkpoint"), reason="torchtitan 0.3.0 not installed")
@pytest.mark.parametrize("mapping", [False, True], ids=["one-file", "mapping"])
def test_torchtitan_last_save_in_hf(dirs, mapping):
    """torchtitan's CheckpointManager (last_save_in_hf): torch's consolidation, or with a
    mapping every rank's own consolidate_safetensors_files_on_every_rank, into the mount."""
    src, mnt, plain, m = dirs
    args = ["--mapping"] if mapping else []
    run_writer("titan_hf_save.py", plain / "t", *args)
    run_writer("titan_hf_save.py", mnt / "t", *args)
    step = pathlib.Path("checkpoint") / "step-1"
    want = sorted(n for n in os.listdir(plain / "t" / step) if n != "sharded")
    assert sorted(n for n in os.listdir(mnt / "t" / step) if n != "sharded") == want
    assert_same_files(mnt / "t" / step, plain / "t" / step, want)
    assert_same_shards(src / "t" / step / "sharded", plain / "t" / step / "sharded")
    ref = tensors(plain / "t" / "reference.safetensors")
    got = {}
    for n in want:
        if n.endswith(".safetensors"):
            got.update(tensors(mnt / "t" / step / n))
    assert not same_tensors(got, ref)
    assert_stored_once(src / "t" / step, mnt / "t" / step, plain / "t" / step, want)
    assert m.proc.poll() is None


@pytest.mark.skipif(not have("nemo_automodel.components.checkpoint.checkpointing"),
                    reason="nemo_automodel 0.7.0 not installed")
def test_nemo_save_consolidated_again(dirs):
    """A second NeMo save into the same checkpoint directory, of other weights: NeMo's
    os.makedirs(model/.hf_metadata, exist_ok=True) met EEXIST from the mkdir and then no
    directory (the view hides it), and raised FileExistsError. Its mkdir makes it a writer
    there now, which sees the directory as written; every consolidated file is the plain
    directory's second save, byte for byte. Its open of each consolidated file (O_TRUNC over
    the first save's, on the name the kernel holds) is written by the kernel too, and stored
    once, as links of the second save's shards (it went through WRITE requests and was stored
    as rank shards of its own: twice)."""
    src, mnt, plain, m = dirs
    for seed in ("0", "1"):
        run_writer("nemo_consolidated_save.py", plain / "n", "--seed", seed)
        run_writer("nemo_consolidated_save.py", mnt / "n", "--seed", seed)
    cons = pathlib.Path("model") / "consolidated"
    want = sorted(os.listdir(plain / "n" / cons))
    assert sorted(os.listdir(mnt / "n" / cons)) == want
    assert_same_files(mnt / "n" / cons, plain / "n" / cons, want)
    assert_same_shards(src / "n" / "model", plain / "n" / "model")
    assert_stored_once(src / "n" / cons, mnt / "n" / cons, plain / "n" / cons, want,
                       origin=src / "n" / "model")
    assert m.proc.poll() is None


@pytest.mark.skipif(not have("nemo_automodel.components.checkpoint.checkpointing"),
                    reason="nemo_automodel 0.7.0 not installed")
def test_nemo_save_consolidated(dirs):
    """NeMo AutoModel's Checkpointer with save_consolidated=True, 2 ranks: it lists the
    .hf_metadata/ it made (FileNotFoundError before) and consolidates its shards into
    model/consolidated/; every file there equals the plain save's; from_pretrained loads both
    model/consolidated/ and the mount's own view of model/ (the rank shards, consolidated on
    read) as the reference."""
    src, mnt, plain, m = dirs
    run_writer("nemo_consolidated_save.py", plain / "n")
    run_writer("nemo_consolidated_save.py", mnt / "n")
    cons = pathlib.Path("model") / "consolidated"
    want = sorted(os.listdir(plain / "n" / cons))
    assert sorted(os.listdir(mnt / "n" / cons)) == want
    assert_same_files(mnt / "n" / cons, plain / "n" / cons, want)
    assert_same_shards(src / "n" / "model", plain / "n" / "model")
    for n in os.listdir(plain / "n" / "model" / ".hf_metadata"):
        assert filecmp.cmp(src / "n" / "model" / ".hf_metadata" / n,
                           plain / "n" / "model" / ".hf_metadata" / n, shallow=False), n
    ref = tensors(plain / "n" / "reference.safetensors")
    transformers = pytest.importorskip("transformers")
    for d in (mnt / "n" / cons, mnt / "n" / "model"):
        model = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)
        sd = {k: v for k, v in model.state_dict().items() if k in ref}
        assert not same_tensors(sd, ref), f"from_pretrained({d})"
    # One stored copy: model/consolidated/'s files are links of model/'s rank shards (the
    # origin is the directory above, NeMo's layout), and still read as the plain save's.
    assert_stored_once(src / "n" / cons, mnt / "n" / cons, plain / "n" / cons, want,
                       origin=src / "n" / "model")
    # A new save of a rank shard in model/ leaves what consolidated/ stored as it was, also
    # after consolidated/ was renamed: it gets its own copy of that shard first.
    os.rename(mnt / "n" / cons, mnt / "n" / "model" / "hf")
    hf = pathlib.Path("model") / "hf"
    victim = sorted(n for n in os.listdir(src / "n" / "model") if n.startswith("shard-"))[0]
    with open(mnt / "n" / "model" / victim, "wb") as f:
        f.write(b"not a shard")
    assert (src / "n" / hf / victim).stat().st_nlink == 1
    assert_same_files(mnt / "n" / hf, plain / "n" / cons, want)
    # Removing model/'s shards leaves consolidated/'s files whole.
    for n in os.listdir(src / "n" / "model"):
        if n.startswith("shard-"):
            os.unlink(mnt / "n" / "model" / n)
    assert_same_files(mnt / "n" / hf, plain / "n" / cons, want)
    assert m.proc.poll() is None
