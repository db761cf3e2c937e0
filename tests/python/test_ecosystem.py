"""Tier 4: the ecosystem, end to end, with REAL checkpoints and REAL packages.

The checkpoints come from tools/gen_checkpoint.py: a small random LlamaForCausalLM saved with
save_pretrained (the reference) and sharded by real torch DCP ranks (gloo, DTensor,
HuggingFaceStorageWriter). They are generated once per module, in parallel:

  fsdp3_tie   fsdp, world 3 (uneven chunks), tied embeddings, f32, plain layout, 2 files
  tp2_nemo    tp (the model's tp_plan), world 2, NeMo AutoModel layout, bf16, 2 files
  fsdp_tp4    fsdp_tp, world 4 (dp 2 x tp 2), plain layout, bf16, 3 files

What is checked against the reference, through one real ckptfs mount of all three:
  1. transformers AutoModelForCausalLM.from_pretrained(view): state dict and logits equal;
  2. safetensors.safe_open(framework="pt") (mmap) on every mounted file: tensors equal;
  3. the mounted files hold exactly the tensors torch's own consolidate_safetensors_files
     writes from the same shards; how the bytes differ is computed, recorded
     (record_property "byte_identity", printed) and asserted to be only the explained
     differences (header __metadata__, JSON formatting, padding);
  4. torch DCP's HuggingFaceStorageReader reads the same shards (from SRC) into a full
     single-process state dict, and into differently sharded DTensor state dicts in a
     2-rank gloo group (tests/python/dcp_reshard_load.py): the shards stay usable to resume;
  5. a training-run tree (step_100 NeMo, step_200 plain, checkpoint-300 plain) mounted at
     once; every step loads, and a step the generator writes while mounted appears and loads.
Plus reproductions of ckptfs bugs found on the way (see the test docstrings).

Skipped (never faked) without root, /dev/fuse and fusermount3. No timing assertions.
"""

from __future__ import annotations

import gc
import glob
import json
import os
import pathlib
import shutil
import struct
import subprocess
import sys
import time

import pytest

from conftest import ROOT, DaemonExited, Mount, requires_fuse

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")

pytestmark = requires_fuse

GEN = ROOT / "tools" / "gen_checkpoint.py"
RESHARD = pathlib.Path(__file__).parent / "dcp_reshard_load.py"
INDEX = "model.safetensors.index.json"
PROMPT = [[1, 5, 17, 42, 99, 128, 200, 255, 3, 64, 77, 180]]  # token ids, vocab 256
DEADLINE = 60.0  # seconds a new step may take to show up after its generator exits

SPECS = {
    "fsdp3_tie": dict(layout="fsdp", world=3, tie=True, dtype="f32", files=2),
    "tp2_nemo": dict(layout="tp", world=2, nemo=True, files=2),
    "fsdp_tp4": dict(layout="fsdp_tp", world=4, tp=2, files=3),
}
NAMES = list(SPECS)


# --- helpers ---------------------------------------------------------------------------------


def gen_cmd(out, ref, **opts) -> list[str]:
    cmd = [sys.executable, str(GEN), str(out), "--reference", str(ref)]
    for k, v in opts.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            cmd.append(flag)
        elif v is not False:
            cmd += [flag, str(v)]
    return cmd


def start_gen(out, ref, log: pathlib.Path, **opts) -> subprocess.Popen:
    """gen_checkpoint.py in the background; its log (stderr) goes to `log`."""
    with open(log, "w") as f:
        p = subprocess.Popen(gen_cmd(out, ref, **opts), stdout=subprocess.PIPE, stderr=f, text=True)
    p.log = log
    return p


def finish_gen(proc: subprocess.Popen, what: str) -> dict:
    out, _ = proc.communicate(timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"gen_checkpoint {what} failed ({proc.returncode}):\n"
                           + proc.log.read_text()[-4000:])
    return json.loads(out.strip().splitlines()[-1])


class Ckpt:
    """One generated checkpoint: where its shards, reference and mounted view are."""

    def __init__(self, name, summary, ref):
        self.name, self.summary, self.ref = name, summary, pathlib.Path(ref)
        self.nemo = summary["nemo"]
        self.shard_dir = pathlib.Path(summary["shard_dir"])
        self.rel = f"{name}/model" if self.nemo else name  # the view dir, relative to the mount

    def writer_mapping(self) -> dict[str, int]:
        """The fqn_to_index_mapping the writer used, in its insertion order."""
        if self.nemo:
            return json.loads((self.shard_dir / ".hf_metadata/fqn_to_file_index_mapping.json").read_text())
        wm = json.loads((self.ref / INDEX).read_text())["weight_map"]
        return {k: 1 if f == "model.safetensors" else int(f.split("-")[1]) for k, f in wm.items()}


def load_dir_tensors(d) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(glob.glob(os.path.join(str(d), "*.safetensors"))):
        out.update(load_file(f))
    return out


def split_file(path) -> tuple[bytes, bytes]:
    """(header JSON bytes as stored, data section) of a safetensors file."""
    b = pathlib.Path(path).read_bytes()
    (n,) = struct.unpack("<Q", b[:8])
    return b[8 : 8 + n], b[8 + n :]


def load_model(d):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(d), dtype="auto", output_loading_info=True)
    model.eval()
    return model, info


def logits(model):
    with torch.no_grad():
        return model(torch.tensor(PROMPT)).logits


def assert_model_equal(model, ref_model, ref_tensors, what):
    sd, rsd = model.state_dict(), ref_model.state_dict()
    assert list(sd) == list(rsd), what
    bad = [k for k in rsd if sd[k].dtype != rsd[k].dtype or not torch.equal(sd[k], rsd[k])]
    assert not bad, f"{what}: tensors differ from the reference model: {bad}"
    # ... and from the original bytes save_pretrained wrote (what the shards were cut from)
    bad = [k for k, v in ref_tensors.items() if not torch.equal(sd[k], v)]
    assert not bad, f"{what}: tensors differ from the reference files: {bad}"
    assert torch.equal(logits(model), logits(ref_model)), f"{what}: logits differ"


# --- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tmp_path_factory.mktemp("eco")


@pytest.fixture(scope="module")
def ckpts(base) -> dict[str, Ckpt]:
    """The three checkpoints of SPECS under base/src, references under base/ref-<name>."""
    t0 = time.monotonic()
    procs = {}
    for name, opts in SPECS.items():
        procs[name] = start_gen(base / "src" / name, base / f"ref-{name}", base / f"gen-{name}.log", **opts)
    out = {}
    try:
        for name, p in procs.items():
            s = finish_gen(p, name)
            out[name] = Ckpt(name, s, base / f"ref-{name}")
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    print(f"\n[ecosystem] generated {len(out)} checkpoints in {time.monotonic() - t0:.1f}s")
    return out


@pytest.fixture(scope="module")
def mnt(base, ckpts):
    m = Mount(base / "src", base / "mnt", settle=0).start()
    try:
        yield pathlib.Path(m.mnt)
    finally:
        gc.collect()  # models whose tensors are still mmapped from the mount
        m.stop()


@pytest.fixture(scope="module")
def references(ckpts):
    """Per checkpoint: (reference model from save_pretrained output, its tensors), lazily."""
    cache = {}

    def get(name):
        if name not in cache:
            model, info = load_model(ckpts[name].ref)
            cache[name] = (model, load_dir_tensors(ckpts[name].ref))
        return cache[name]

    return get


# --- 1. transformers from_pretrained ---------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_from_pretrained_through_mount(ckpts, mnt, references, name):
    ck = ckpts[name]
    view = mnt / ck.rel
    listing = sorted(os.listdir(view))
    # The view: consolidated files + index + the side files (NeMo: lifted from .hf_metadata).
    assert "config.json" in listing and INDEX in listing, listing
    assert "fqn_to_file_index_mapping.json" not in listing and ".hf_metadata" not in listing
    assert not [n for n in listing if n.startswith("shard-")], listing
    want_index = json.loads((ck.ref / INDEX).read_text())
    got_index = json.loads((view / INDEX).read_text())
    assert got_index["weight_map"] == want_index["weight_map"]
    assert got_index["metadata"]["total_size"] == ck.summary["total_bytes"]
    assert sorted(n for n in listing if n.endswith(".safetensors")) == sorted(set(want_index["weight_map"].values()))

    model, info = load_model(view)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ref_model, ref_tensors = references(name)
    assert model.dtype == ref_model.dtype == {"f32": torch.float32, "bf16": torch.bfloat16}[ck.summary["dtype"]]
    assert_model_equal(model, ref_model, ref_tensors, f"{name} via mount")
    if ck.summary["tie"]:
        assert "lm_head.weight" not in got_index["weight_map"]
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


# --- 2. safetensors safe_open (mmap) ---------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_safe_open_mmap_through_mount(ckpts, mnt, references, name):
    from safetensors import safe_open

    view = mnt / ckpts[name].rel
    _, ref_tensors = references(name)
    seen = {}
    for f in sorted(view.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            assert st.metadata() == {"format": "pt"}, st.metadata()
            for k in st.keys():
                assert k not in seen, f"{k} in both {seen.get(k)} and {f.name}"
                seen[k] = f.name
                t = st.get_tensor(k)
                assert t.dtype == ref_tensors[k].dtype and torch.equal(t, ref_tensors[k]), k
                if t.ndim == 2 and t.shape[0] > 3:  # a strided slice: random access through mmap
                    assert torch.equal(st.get_slice(k)[1:3, ::2], ref_tensors[k][1:3, ::2]), k
    assert set(seen) == set(ref_tensors)


# --- 3. same tensors as torch's consolidate_safetensors_files --------------------------------


def byte_identity_report(ours: pathlib.Path, theirs: pathlib.Path) -> tuple[list[str], dict]:
    """Compares one consolidated file of ckptfs with torch's; returns (differences, facts).

    Asserts everything that must hold (same tensors, same bytes per tensor) and that the
    differences are only the explained ones."""
    oh, od = split_file(ours)
    th, td = split_file(theirs)
    oj, tj = json.loads(oh), json.loads(th)
    facts = dict(file=ours.name, ckptfs_header=len(oh), torch_header=len(th), data_bytes=len(od))
    diffs = []
    if oh == th and od == td:
        return diffs, facts

    # torch: json.dumps(header) with default separators, no __metadata__, no padding.
    assert "__metadata__" not in tj
    assert th == json.dumps(tj).encode(), "torch header is not plain json.dumps (torch changed?)"
    meta = oj.pop("__metadata__", None)
    if meta is not None:
        assert meta == {"format": "pt"}, meta
        diffs.append('ckptfs header has __metadata__ {"format":"pt"}; torch writes none')
    stripped = oh.rstrip(b" ")
    pad = len(oh) - len(stripped)
    if pad:
        assert (8 + len(oh)) % 8 == 0 and pad < 8, (len(oh), pad)
        diffs.append(f"ckptfs header is space-padded to a multiple of 8 ({pad} spaces); torch: no padding")
    if b", " not in stripped and b": " not in stripped:
        diffs.append("ckptfs JSON is compact (',' ':'); torch uses json.dumps default (', ' ': ')")
    o_entry = list(next(iter(oj.values())))
    t_entry = list(next(iter(tj.values())))
    if o_entry != t_entry:
        diffs.append(f"entry key order: ckptfs {o_entry}, torch {t_entry}")

    # Same tensors, dtypes and shapes.
    assert set(oj) == set(tj), set(oj) ^ set(tj)
    for k in tj:
        assert (oj[k]["dtype"], oj[k]["shape"]) == (tj[k]["dtype"], tj[k]["shape"]), k
    assert len(od) == len(td)
    # Every tensor's bytes are equal wherever each file puts them.
    for k in tj:
        ob, oe = oj[k]["data_offsets"]
        tb, te = tj[k]["data_offsets"]
        assert od[ob:oe] == td[tb:te], f"{ours.name}: bytes of {k} differ from torch's"
    o_order = sorted(oj, key=lambda k: oj[k]["data_offsets"][0])
    t_order = sorted(tj, key=lambda k: tj[k]["data_offsets"][0])
    facts["same_tensor_order"] = o_order == t_order
    facts["data_identical"] = od == td
    if o_order == t_order:
        # Same layout: the data sections are identical, and torch's whole file is ckptfs's
        # file with the header re-serialised the torch way -- nothing else differs.
        assert all(oj[k]["data_offsets"] == tj[k]["data_offsets"] for k in tj)
        assert od == td, "same tensor order, yet the data sections differ"
        rebuilt = json.dumps({k: {kk: oj[k][kk] for kk in t_entry} for k in t_order}).encode()
        assert rebuilt == th
    else:
        diffs.append(f"tensor order differs: ckptfs {o_order[:3]}..., torch {t_order[:3]}...")
    return diffs, facts


@pytest.mark.parametrize("name", NAMES)
def test_same_tensors_as_torch_consolidation(ckpts, mnt, base, references, record_property, name):
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

    ck = ckpts[name]
    mapping = ck.writer_mapping()
    # The writer's mapping agrees with the shard file names (shard-R-model-K-of-M).
    for f in ck.shard_dir.glob("shard-*.safetensors"):
        if not ck.nemo:
            k = int(f.name.split("-")[3])
            keys = [x for x in json.loads(split_file(f)[0]) if x != "__metadata__"]
            assert all(mapping[x] == k for x in keys), f.name
    out = base / f"torch-{name}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    consolidate_safetensors_files(str(ck.shard_dir), str(out), mapping)

    view = mnt / ck.rel
    theirs = sorted(p.name for p in out.glob("*.safetensors"))
    ours = sorted(p.name for p in view.glob("*.safetensors"))
    assert ours == theirs

    # Tensor by tensor (the test's claim), with safetensors itself as the parser.
    a, b = load_dir_tensors(view), load_dir_tensors(out)
    assert list(sorted(a)) == list(sorted(b))
    bad = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not bad, bad

    # Index: same weight_map and total_size.
    oi, ti = json.loads((view / INDEX).read_text()), json.loads((out / INDEX).read_text())
    assert oi["weight_map"] == ti["weight_map"]
    assert oi["metadata"]["total_size"] == ti["metadata"]["total_size"]
    index_diffs = []
    if set(oi["metadata"]) != set(ti["metadata"]):
        index_diffs.append(f"index metadata keys: ckptfs {sorted(oi['metadata'])}, torch {sorted(ti['metadata'])}")
    if list(oi["weight_map"]) != list(ti["weight_map"]):
        index_diffs.append("index weight_map order: ckptfs sorted by name, torch by file then tensor order"
                           if list(oi["weight_map"]) == sorted(oi["weight_map"]) else "index weight_map order differs")

    # Bytes: identical or not, and exactly why.
    lines, all_identical = [], True
    for fname in theirs:
        identical = (view / fname).read_bytes() == (out / fname).read_bytes()
        all_identical &= identical
        diffs, facts = byte_identity_report(view / fname, out / fname)
        lines.append(f"{fname}: {'byte-identical' if identical else 'differs'} {facts}"
                     + "".join(f"\n    - {d}" for d in diffs))
    report = (f"{name}: files byte-identical to torch's: {all_identical}\n  " + "\n  ".join(lines)
              + "".join(f"\n  - {d}" for d in index_diffs))
    record_property("byte_identity", report)
    print("\n" + report)


# --- 4. torch DCP HuggingFaceStorageReader on the same shards --------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_dcp_reader_full_state_dict(ckpts, references, name):
    """Single process, no process group: every tensor loaded whole from the rank shards."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

    ck = ckpts[name]
    _, ref_tensors = references(name)
    state = {k: torch.zeros_like(v) for k, v in ref_tensors.items()}
    dcp.load(state, storage_reader=HuggingFaceStorageReader(str(ck.shard_dir)), no_dist=True)
    bad = [k for k, v in ref_tensors.items() if not torch.equal(state[k], v)]
    assert not bad, bad


def test_dcp_reader_resharded_multiprocess(ckpts, base):
    """2 gloo ranks load each checkpoint into DTensors placed differently from how it was
    written: fsdp world 3 -> Shard(0) world 2 (uneven -> even), tp world 2 -> Shard(0),
    fsdp_tp world 4 (2-D mesh) -> Shard(1) world 2 (column split)."""
    placement = {"fsdp3_tie": "shard0", "tp2_nemo": "shard0", "fsdp_tp4": "shard1"}
    jobs = [f"{ckpts[n].shard_dir}:{ckpts[n].ref}:{placement[n]}" for n in NAMES]
    r = subprocess.run([sys.executable, str(RESHARD), "--world", "2", "--result", str(base / "reshard"),
                        *jobs], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    results = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(results) == 2 * len(NAMES)
    for res in results:
        assert res["tensors"] > 0 and not res["bad_local"] and not res["bad_full"], res


# --- 5. a training-run tree, live --------------------------------------------------------------


def check_loads(view, ref_model, ref_tensors, what) -> None:
    """from_pretrained(view) equals the reference; the model (whose tensors may still be
    mmapped from the mount) is dropped before returning, so the mount can be unmounted."""
    model, info = load_model(view)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert_model_equal(model, ref_model, ref_tensors, what)
    del model
    gc.collect()


def header_shapes(view: pathlib.Path) -> dict:
    out = {}
    for f in view.glob("*.safetensors"):
        h = json.loads(split_file(f)[0])
        out.update({k: (v["dtype"], v["shape"]) for k, v in h.items() if k != "__metadata__"})
    return out


def view_complete(view: pathlib.Path) -> bool:
    try:
        names = os.listdir(view)
    except OSError:
        return False
    return "config.json" in names and (INDEX in names or "model.safetensors" in names)


def wait_complete(view: pathlib.Path, m: Mount) -> None:
    deadline = time.monotonic() + DEADLINE
    while not view_complete(view):
        assert time.monotonic() < deadline, f"{view} not shown after {DEADLINE}s: " + m.read_log()[-2000:]
        time.sleep(0.1)


def test_training_run_tree_live(ckpts, references, base):
    """SRC/run/{step_100 (NeMo), step_200 (plain), checkpoint-300 (plain)} mounted at once, with
    the default settle time; a step_400 written by the generator while mounted appears and loads."""
    src = base / "tree"
    run_dir = src / "run"
    layout = {"step_100": "tp2_nemo", "step_200": "fsdp_tp4", "checkpoint-300": "fsdp3_tie"}
    for step, name in layout.items():
        shutil.copytree(ckpts[name].summary["out_dir"], run_dir / step)
    m = Mount(src, base / "tree-mnt", opts=["settle=1"]).start()
    gen = None
    try:
        mroot = pathlib.Path(m.mnt)
        for step, name in layout.items():
            view = mroot / "run" / step / ("model" if ckpts[name].nemo else "")
            wait_complete(view, m)  # just copied: shown once settled (ctime, settle=1)
            check_loads(view, *references(name), f"{step} ({name})")

        # A new step written by real DCP ranks while mounted (plain layout, 1 output file).
        new_ref = base / "ref-step_400"
        gen = start_gen(run_dir / "step_400", new_ref, base / "gen-step_400.log", layout="fsdp", world=2,
                        files=1, seed=4)
        view = mroot / "run" / "step_400"
        early = []  # complete-looking views seen before the generator process had exited
        while gen.poll() is None:
            try:
                if view_complete(view):
                    early.append(header_shapes(view))
            except OSError:
                pass
            time.sleep(0.2)
        finish_gen(gen, "step_400")
        wait_complete(view, m)
        listing = sorted(os.listdir(view))
        print(f"\n[ecosystem] step_400 view: {listing}; complete-looking before the writer exited: "
              f"{len(early)} polls")
        ref_model, _ = load_model(new_ref)
        ref_tensors = load_dir_tensors(new_ref)
        check_loads(view, ref_model, ref_tensors, "step_400 (live)")
        # Whatever was shown while the ranks were still writing was never a partial checkpoint.
        want = {k: (str(v.dtype).replace("torch.", ""), list(v.shape)) for k, v in ref_tensors.items()}
        dt = {"float32": "F32", "bfloat16": "BF16"}
        want = {k: (dt[d], s) for k, (d, s) in want.items()}
        for seen in early:
            assert seen == want, "a partial step_400 was shown as complete"
        # The older steps are still there and unchanged.
        assert sorted(os.listdir(mroot / "run")) == ["checkpoint-300", "step_100", "step_200", "step_400"]
    finally:
        if gen is not None and gen.poll() is None:
            gen.kill()
            gen.communicate()
        m.stop()


# --- bugs found while writing these tests ----------------------------------------------------


def test_bug_mountpoint_inside_source_must_not_deadlock(ckpts, base):
    """BUG (reported): `ckptfs mount SRC SRC/view` -- a mountpoint inside the source tree.

    The scanner walks SRC, reaches SRC/view, which is its own mountpoint, and stats into its
    own FUSE mount: the daemon thread waits on itself (request_wait_answer), every later
    request on the mount hangs in uninterruptible sleep, and the daemon cannot exit on
    SIGTERM/SIGKILL; only aborting the connection (fusectl) frees it. Acceptable behaviours:
    refuse to mount (non-zero exit, a message), or serve with the mountpoint skipped.
    Everything that touches the mount runs in child processes, with a deadline, and the
    connection is aborted if they hang, so this test cannot hang the suite."""
    src = base / "inside"
    shutil.copytree(ckpts["fsdp_tp4"].summary["out_dir"], src / "ck")
    mnt = src / "view"
    mnt.mkdir()
    # Never a stat of MNT from here (it could hang): the mount table says when it is mounted.
    daemon = Mount(src, mnt, log=str(base / "inside.log"), probe="mountinfo")
    try:
        daemon.start()
    except DaemonExited as e:
        assert e.rc != 0 and e.log.strip(), "neither mounted nor refused with a message"
        return  # refused: acceptable
    probe, hung = None, False
    try:
        code = ("import os, sys; n = sum(len(f) for _, _, f in os.walk(sys.argv[1])); "
                "print(n, sorted(os.listdir(os.path.join(sys.argv[1], 'ck'))))")
        probe = subprocess.Popen([sys.executable, "-c", code, str(mnt)], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 20
        while probe.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        hung = probe.poll() is None
        if hung:
            daemon.abort_connection()
        out, err = probe.communicate(timeout=30)
    finally:
        if probe is not None and probe.poll() is None:
            probe.kill()
        daemon.stop(check=False)  # a daemon still blocked on its own mount: its connection aborted
    assert not hung, ("listing a mount whose mountpoint lies inside SRC hung for 20 s "
                      "(the daemon blocked on its own mount)")
    assert probe.returncode == 0, err
    assert INDEX in out, out
