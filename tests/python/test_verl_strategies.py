"""Tier 4: every strategy verl's checkpoint manager writes, served (issue 33, "a user's first
checkpoint just works"): FSDP1 (verl's default strategy, fsdp_config.json FSDP_version 1), FSDP2,
HSDP (a 2x2 ("ddp", "fsdp") mesh: [Replicate, Shard(0)]), FSDP1 without a device mesh (refused,
saying why), and LoRA: the base model under HF names in the checkpoint directory and the adapter,
as PEFT saves it, in lora_adapter/ (with verl's save_lora_only, the adapter alone), or with
-o lora=merged the model PEFT's merge_and_unload() gives, computed on read (F32, and BF16 weights
with F32 factors as PEFT's autocast_adapter_dtype leaves them).

Every checkpoint is written by verl 0.9.1's own FSDPCheckpointManager (tests/python/writers/
verl_save.py) on 4 gloo ranks, one AdamW step, with the model wrapped as verl's FSDP engine wraps
it (verl's apply_fsdp2, or FSDP1 with verl's wrap policy and sharding strategy), and LoRA from
peft's get_peft_model with verl's LoraConfig (all-linear, r=6: 6 rows over 4 ranks leave the last
one empty). Two departures from a GPU run, both forced by CPU: FSDP1's sync_module_states=True is
refused by torch without a GPU, so it is False and every rank builds the model from the same seed
(the ranks then agree as the sync would make them); and no MixedPrecision. The references are the
writer's: the full state dict gathered by torch, and for LoRA the trained PEFT model rebuilt
outside FSDP with PEFT's own save_pretrained (the adapter), its logits, and unload() (the base).
One writer run and one mount serve the whole module (CI time: a 2-core machine).
"""

from __future__ import annotations

import filecmp
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

from conftest import BIN, ROOT, Mount, have, requires_fuse

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = requires_fuse

WRITERS = pathlib.Path(__file__).parent / "writers"
ACTOR = pathlib.Path("global_step_1") / "actor"
RANKS = 4
LORA = 6
# name -> verl_save.py flags: saved by the same 4 ranks in one run.
CASES = {
    "fsdp": "--strategy fsdp",
    "fsdp2": "--strategy fsdp2",
    "hsdp": "--strategy fsdp --hsdp",
    "nomesh": "--strategy fsdp --no-mesh",
    "lora": f"--strategy fsdp --lora {LORA}",
    "lora-only": f"--strategy fsdp2 --lora {LORA} --lora-only",
    "lora-bf16": f"--strategy fsdp2 --lora {LORA} --dtype bfloat16",
}


def load(path: pathlib.Path) -> dict:
    """A safetensors file's tensors, copied (a mapping of a file in the mount would keep it busy)."""
    return {k: v.clone() for k, v in safetensors_torch.load_file(str(path)).items()}


def assert_equal(got: dict, want: dict, what: str):
    assert sorted(got) == sorted(want), f"{what}: names differ: {sorted(set(got) ^ set(want))}"
    bad = [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
    assert not bad, f"{what}: tensors differ: {bad}"


def inspect(d: pathlib.Path) -> str:
    r = subprocess.run([BIN, "inspect", str(d)], capture_output=True, text=True)
    return r.stdout + r.stderr


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    if not have("omegaconf") or importlib.util.find_spec("verl") is None:
        pytest.skip("verl 0.9.1 not installed (tools/requirements-frameworks.txt)")
    root = tmp_path_factory.mktemp("verl-strategies") / "src"
    root.mkdir()
    first, *rest = CASES.items()
    args = [str(root / first[0]), *first[1].split(), "--ranks", str(RANKS), "--no-merge"]
    for name, flags in rest:
        args += ["--case", f"{root / name}:{flags}"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, str(WRITERS / "verl_save.py"), *args], capture_output=True,
                       text=True, timeout=300, env=env, cwd=str(root))
    assert r.returncode == 0, f"verl_save: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return root


@pytest.fixture(scope="module")
def mnt(src, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("verl-strategies-mnt")
    with Mount(src, tmp / "mnt", log=str(tmp / "mnt.log")) as m:
        yield pathlib.Path(m.mnt)
        assert m.proc.poll() is None


@pytest.fixture(scope="module")
def merged_mnt(src, tmp_path_factory):
    """The same rank files mounted with -o lora=merged."""
    tmp = tmp_path_factory.mktemp("verl-strategies-merged")
    with Mount(src, tmp / "mnt", opts=["lora=merged"], log=str(tmp / "mnt.log")) as m:
        yield pathlib.Path(m.mnt)  # its log: mnt.log beside it
        assert m.proc.poll() is None


def served(d: pathlib.Path) -> dict:
    out = {}
    for p in sorted(d.glob("model*.safetensors")):
        out.update(load(p))
    return out


@pytest.mark.parametrize("name,version", [("fsdp", 1), ("fsdp2", 2), ("hsdp", 1)])
def test_every_strategy_is_served_exactly(src, mnt, name, version):
    """FSDP1 (verl's default), FSDP2 and HSDP checkpoints are served as the full model, exactly
    (an HSDP replica group's copies are read once, from the first)."""
    d = mnt / name / ACTOR
    assert json.loads((d / "fsdp_config.json").read_text())["FSDP_version"] == version
    assert_equal(served(d), load(src / f"reference-{name}.safetensors"), f"verl {name}")
    if name == "fsdp":  # the default strategy: from_pretrained loads it, nothing missing
        model, info = transformers.AutoModelForCausalLM.from_pretrained(str(d), output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        del model


def test_fsdp1_without_a_mesh_is_refused_saying_why(src, mnt):
    """FSDP1 without a device mesh saves ShardedTensors: nothing consolidated is shown, and inspect
    says what the rank files hold (not merely which pickle global was refused)."""
    names = os.listdir(mnt / "nomesh" / ACTOR)
    assert not [n for n in names if n.startswith("model.") or n.startswith("model-")], names
    text = inspect(src / "nomesh" / ACTOR)
    assert "FSDP1 without a device mesh saves ShardedTensors" in text, text


def adapter_config_fields(path: pathlib.Path) -> dict:
    """The fields of an adapter_config.json that decide how PEFT loads and applies the adapter."""
    c = json.loads(path.read_text())
    keys = ["r", "lora_alpha", "peft_type", "task_type", "bias", "fan_in_fan_out", "use_rslora", "use_dora",
            "modules_to_save", "layers_to_transform", "rank_pattern", "alpha_pattern", "lora_bias"]
    return {**{k: c.get(k) for k in keys}, "target_modules": sorted(c["target_modules"])}


def peft_forward(base, adapter: pathlib.Path, ids) -> "torch.Tensor":
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the writer's forward: one thread, one summation order
    try:
        model = peft.PeftModel.from_pretrained(base, str(adapter))
        model.eval()
        with torch.no_grad():
            return model(input_ids=ids).logits
    finally:
        torch.set_num_threads(threads)


def test_lora_base_model_and_adapter(src, mnt):
    """A LoRA checkpoint (PEFT-wrapped names in the rank files): from_pretrained of the directory
    gives the base model bit for bit, with no missing or unexpected weight; lora_adapter/ holds
    PEFT's own save_pretrained output (adapter_model.safetensors byte for byte, the config's
    fields that matter); PeftModel.from_pretrained on them computes the trained model's logits."""
    d = mnt / "lora" / ACTOR
    ref = src / "peft-reference-lora"
    names = os.listdir(d)
    assert "lora_adapter" in names and "model.safetensors.index.json" in names, names
    assert sorted(os.listdir(d / "lora_adapter")) == ["adapter_config.json", "adapter_model.safetensors"]
    base_ref = load(src / "base-reference-lora.safetensors")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(base_ref)
    base, info = transformers.AutoModelForCausalLM.from_pretrained(str(d), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert_equal(dict(base.state_dict()), base_ref, "the base model")
    assert filecmp.cmp(d / "lora_adapter" / "adapter_model.safetensors", ref / "adapter_model.safetensors",
                       shallow=False)
    assert adapter_config_fields(d / "lora_adapter" / "adapter_config.json") == \
        adapter_config_fields(ref / "adapter_config.json")
    want = load(src / "logits-lora.safetensors")
    assert torch.equal(peft_forward(base, d / "lora_adapter", want["input_ids"]), want["logits"])
    del base
    text = inspect(src / "lora" / ACTOR)
    assert "lora_adapter/adapter_model.safetensors" in text and "LoRA (r=6, lora_alpha=12)" in text, text


def test_lora_only_shows_the_adapter_alone(src, mnt, tmp_path):
    """verl's save_lora_only stores no base weight: the directory shows lora_adapter/ and no model
    file or index; the adapter is PEFT's, and on the base model it started from computes the trained
    model's logits. inspect says why there is no model."""
    d = mnt / "lora-only" / ACTOR
    names = os.listdir(d)
    assert "lora_adapter" in names, names
    assert not [n for n in names if n.startswith("model.") or n.startswith("model-")], names
    ref = src / "peft-reference-lora-only"
    assert filecmp.cmp(d / "lora_adapter" / "adapter_model.safetensors", ref / "adapter_model.safetensors",
                       shallow=False)
    assert adapter_config_fields(d / "lora_adapter" / "adapter_config.json") == \
        adapter_config_fields(ref / "adapter_config.json")
    base_dir = tmp_path / "base"  # the base model training began from (frozen under LoRA)
    base_dir.mkdir()
    (base_dir / "config.json").write_bytes((d / "config.json").read_bytes())
    safetensors_torch.save_file(load(src / "base-reference-lora-only.safetensors"), str(base_dir / "model.safetensors"))
    base = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir))
    want = load(src / "logits-lora-only.safetensors")
    assert torch.equal(peft_forward(base, d / "lora_adapter", want["input_ids"]), want["logits"])
    del base
    text = inspect(src / "lora-only" / ACTOR)
    assert "adapter only" in text and "save_lora_only" in text, text


def test_lora_every_tool(src, mnt, tmp_path):
    """verify and consolidate read the LoRA checkpoint; consolidate writes the base model and
    lora_adapter/ as the mount shows them, byte for byte; `ckptfs load` of the rank files and of
    the consolidated copy load the same base model (one checksum), and refuses the adapter alone;
    the Python binding loads the base model."""
    d = src / "lora" / ACTOR
    r = subprocess.run([BIN, "verify", str(d)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    out = tmp_path / "consolidated"
    r = subprocess.run([BIN, "consolidate", str(d), str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert "lora_adapter/adapter_model.safetensors" in files and "lora_adapter/adapter_config.json" in files
    assert not [f for f in files if f.endswith(".pt") or f.endswith("_meta.json")], files
    for f in files:
        assert filecmp.cmp(out / f, mnt / "lora" / ACTOR / f, shallow=False), f
    sums = []
    for where in (d, out):
        r = subprocess.run([BIN, "load", str(where)], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr
        sums.append([ln for ln in r.stdout.splitlines() if ln.startswith("checksum")])
    assert sums[0] and sums[0] == sums[1], sums
    r = subprocess.run([BIN, "load", str(src / "lora-only" / ACTOR)], capture_output=True, text=True)
    assert r.returncode != 0 and "LoRA adapter only" in r.stderr, r.stdout + r.stderr
    os.environ.setdefault("CKPTFS_LOAD_LIB", str(pathlib.Path(BIN).parent / "libckptfs_load.so"))
    sys.path.insert(0, str(ROOT / "python"))
    import ckptfs_load

    assert_equal(ckptfs_load.load_state_dict(str(d)), load(src / "base-reference-lora.safetensors"),
                 "the Python binding")


def test_lora_adapter_is_no_more_readable_than_the_rank_files(src):
    """The adapter folder's files follow the consolidated files' rule: whoever may read every rank
    file (and fsdp_config.json, lora_train_meta.json) reads them; with the rank files 0600, another
    user lists the folder but reads neither file, and no file of the folder can be written."""
    import shutil
    import tempfile

    world = pathlib.Path(tempfile.mkdtemp(prefix="ckptfs-verl-perm-", dir="/tmp"))
    os.chmod(world, 0o755)
    try:
        d = world / "src" / "actor"
        shutil.copytree(src / "lora" / ACTOR, d)
        os.chmod(world / "src", 0o755)
        os.chmod(d, 0o755)
        for p in d.glob("model_world_size_*"):
            os.chmod(p, 0o600)
        with Mount(world / "src", world / "mnt", opts=["allow_other"], log=str(world / "mnt.log")) as m:
            a = pathlib.Path(m.mnt) / "actor" / "lora_adapter"
            user = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
            r = subprocess.run([*user, "ls", str(a)], capture_output=True, text=True, timeout=20)
            assert r.returncode == 0 and r.stdout.split() == ["adapter_config.json", "adapter_model.safetensors"], r
            for n in ("adapter_config.json", "adapter_model.safetensors"):
                assert os.stat(a / n).st_mode & 0o044 == 0, n
                r = subprocess.run([*user, "cat", str(a / n)], capture_output=True, timeout=20)
                assert r.returncode != 0 and b"Permission denied" in r.stderr, (n, r)
            assert (a / "adapter_model.safetensors").read_bytes() == \
                (src / "peft-reference-lora" / "adapter_model.safetensors").read_bytes()
            for fn in (lambda: open(a / "adapter_model.safetensors", "r+b"), lambda: (a / "x").write_text("x"),
                       lambda: os.rename(a / "adapter_config.json", a / "y.json")):
                with pytest.raises(PermissionError):
                    fn()
    finally:
        shutil.rmtree(world, ignore_errors=True)


def off_by_more_than_a_rounding(got: "torch.Tensor", want: "torch.Tensor", base: "torch.Tensor") -> int:
    """How many elements of a merged weight differ from PEFT's by more than one unit in the last
    place of the magnitudes summed (|W| + |delta|): a GEMM summing in another order moves the delta
    by a rounding, which near W = -delta is many units of the (tiny) result."""
    eps = torch.finfo(want.dtype).eps
    g, w, b = got.double(), want.double(), base.double()
    return int(((g - w).abs() > eps * (b.abs() + (w - b).abs())).sum())


@pytest.mark.parametrize("name", ["lora", "lora-bf16"])
def test_lora_merged_is_peft_merge_and_unload(src, merged_mnt, name):
    """-o lora=merged: the directory shows the merged model and no adapter folder; from_pretrained
    loads it with nothing missing; every weight is PEFT's merge_and_unload() of the trained model
    (the writer's, outside ckptfs) within a rounding (bit for bit on x86-64 with torch's MKL: the
    count is printed), the LoRA layers' weights differing from the base model's (the merge is not
    a no-op)."""
    d = merged_mnt / name / ACTOR
    names = os.listdir(d)
    assert "lora_adapter" not in names and "config.json" in names, names
    got = served(d)
    want = load(src / f"merged-reference-{name}.safetensors")
    base = load(src / f"base-reference-{name}.safetensors")
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
    far = {k: off_by_more_than_a_rounding(got[k], want[k], base[k]) for k in want}
    far = {k: n for k, n in far.items() if n or got[k].dtype != want[k].dtype}
    assert not far, f"elements further than a rounding from merge_and_unload: {far}"
    exact = sum(torch.equal(got[k], want[k]) for k in want)
    merged = [k for k in want if "_proj." in k]
    assert merged and all(not torch.equal(got[k], base[k]) for k in merged), "the merge changed nothing"
    print(f"{name}: {exact}/{len(want)} tensors bit-equal to merge_and_unload")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(d), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert {str(v.dtype) for v in got.values()} == {str(v.dtype) for v in want.values()}
    del model


def test_lora_merged_without_a_base_weight_shows_the_adapter_saying_why(src, merged_mnt):
    """-o lora=merged on verl's save_lora_only: nothing to merge into, so lora_adapter/ is shown as
    without the option (PEFT's own adapter, byte for byte), and the daemon's log says why."""
    d = merged_mnt / "lora-only" / ACTOR
    names = os.listdir(d)
    assert "lora_adapter" in names, names
    assert filecmp.cmp(d / "lora_adapter" / "adapter_model.safetensors",
                       src / "peft-reference-lora-only" / "adapter_model.safetensors", shallow=False)
    log = (merged_mnt.parent / "mnt.log").read_text()
    assert "-o lora=merged: the rank files hold no base weight to merge into" in log, log[-2000:]
