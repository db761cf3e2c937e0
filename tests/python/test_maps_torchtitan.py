"""Model maps (issue 22), torchtitan: a torchtitan checkpoint served under HF's names and layouts.

One writer run (writers/titan_map_save.py, module-scoped) makes three HF models from tiny
configs with a fixed seed (LlamaForCausalLM bf16 untied; Qwen3ForCausalLM fp32 tied with
head_dim != hidden/heads; Qwen3MoeForCausalLM fp32 with 4 grouped experts, layer 1 dense),
converts each with torchtitan 0.3.0's own StateDictAdapter.from_hf, loads it into torchtitan's
model, and saves it with torchtitan's CheckpointManager (dcp.save, FSDP2 over 2 gloo ranks;
Llama with the full training state, the Qwens model only). Then:
  * map_ref (the pure-Python reference of docs/maps.md) detects the right built-in map from the
    stored names and, applied to the stored tensors, reproduces the HF checkpoint and torchtitan's
    own to_hf output bit for bit; a map without Llama's RoPE rows, or a config that disagrees with
    the shapes, does not;
  * one mount of all three (Llama and the MoE hold their config.json in the step directory; Qwen 3
    gets it from `-o hf_config=`): each step directory serves config.json and model*.safetensors
    whose tensors equal to_hf's (names, dtypes, bytes), and `from_pretrained` on it gives the
    original model's state dict bit for bit;
  * `ckptfs inspect` names, for q_proj, the stored tensor and the rule;
  * mounted without a config, the detected Qwen 3 checkpoint stays under its stored names and
    inspect names the map it would use and asks for hf_config.
Skipped (never faked) without torchtitan, torch, transformers; the mount tests without FUSE.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import warnings

import pytest

import map_ref
import writer_cache
from conftest import BIN, Mount, have, requires_fuse

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.skipif(not have("torchtitan.components.checkpointer"),
                                reason="torchtitan 0.3.0 not installed")

WRITERS = pathlib.Path(__file__).parent / "writers"
STEP = pathlib.Path("checkpoint") / "step-1"
# writer's model name -> (built-in map, dtype, tied, config.json in the step directory)
MODELS = {
    "llama3": ("torchtitan-llama3", torch.bfloat16, False, True),
    "qwen3": ("torchtitan-qwen3", torch.float32, True, False),
    "qwen3-moe": ("torchtitan-qwen3-moe", torch.float32, False, True),
}
TRAINING_STATE = ("optimizer", "lr_scheduler", "train_state", "dataloader")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    src = tmp_path_factory.mktemp("titan-maps") / "src"
    src.mkdir()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    r = writer_cache.run([sys.executable, WRITERS / "titan_map_save.py", src], [src], timeout=300, env=env,
                         cwd=str(src))
    assert r.returncode == 0, f"titan_map_save: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    files = json.loads(r.stdout.strip().splitlines()[-1])
    for name, (_, _, _, own_config) in MODELS.items():
        step = f"{name}/{STEP}"
        assert f"{step}/.metadata" in files and f"{step}/__1_0.distcp" in files, files
        assert (f"{step}/config.json" in files) == own_config, files
    return src


def load(path) -> dict:
    """A safetensors file's tensors, copied (a mapping of a file in the mount keeps it busy)."""
    return {k: v.clone() for k, v in safetensors_torch.load_file(str(path)).items()}


def read_dcp(d: pathlib.Path) -> dict:
    """The model's tensors of a DCP checkpoint (the training state left out), read with torch's own reader."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(d))
    md = reader.read_metadata()
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()
          if isinstance(m, TensorStorageMetadata) and k.split(".")[0] not in TRAINING_STATE}
    with warnings.catch_warnings():  # "torch.distributed is disabled ...": no_dist is meant
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(sd, storage_reader=reader, no_dist=True)
    return sd


def same_bits(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def assert_same(got: dict, want: dict, what: str):
    assert sorted(got) == sorted(want), (f"{what}: names differ: only served {sorted(set(got) - set(want))}, "
                                         f"only expected {sorted(set(want) - set(got))}")
    bad = [f"{k}: served {got[k].dtype} {list(got[k].shape)}, expected {want[k].dtype} {list(want[k].shape)}"
           + ("" if got[k].dtype != want[k].dtype or got[k].shape != want[k].shape else " (bytes differ)")
           for k in want if not same_bits(got[k], want[k])]
    assert not bad, f"{what}: tensors differ:\n  " + "\n  ".join(bad)


def config(saved, name) -> dict:
    return json.loads((saved / name / "hf" / "config.json").read_text())


# --- the maps, checked in Python (map_ref) -------------------------------------------------------

@pytest.mark.parametrize("name", list(MODELS))
def test_map_ref_reproduces_hf_and_to_hf(saved, name):
    stored = read_dcp(saved / name / STEP)
    # The checkpoint holds what from_hf made (and, for the MoE, torchtitan's expert_bias_E).
    from_hf = load(saved / name / "from_hf.safetensors")
    extra = sorted(set(stored) - set(from_hf))
    assert extra == (["layers.0.moe.expert_bias_E"] if name == "qwen3-moe" else []), extra
    assert_same({k: stored[k] for k in from_hf}, from_hf, f"{name}: stored vs from_hf")

    chosen = map_ref.choose(map_ref.builtin_maps(), stored)
    assert chosen is not None and chosen["name"] == MODELS[name][0], chosen and chosen["name"]
    hf, sources = map_ref.apply(chosen, stored, config(saved, name))
    assert_same(hf, load(saved / name / "to_hf.safetensors"), f"{name}: map vs torchtitan's to_hf")
    assert_same(hf, load(saved / name / "hf" / "model.safetensors"), f"{name}: map vs the HF checkpoint")
    assert [s for s, _ in sources["model.layers.0.self_attn.q_proj.weight"]] == \
        ["layers.0.attention.qkv_linear.wq.weight"]
    if name == "qwen3-moe":
        assert sources["model.layers.0.mlp.experts.3.down_proj.weight"][0][0] == \
            "layers.0.moe.routed_experts.inner_experts.w2_EDF"


def test_map_ref_wrong_maps_fail(saved):
    """The bit-for-bit checks can fail: Llama without its RoPE rows differs in q and k only; a
    config whose heads disagree with the stored rows refuses, naming the tensor and the axis."""
    stored = read_dcp(saved / "llama3" / STEP)
    want = load(saved / "llama3" / "to_hf.safetensors")
    m = json.loads((map_ref.MAPS / "torchtitan-llama3.json").read_text())
    for rule in m["tensors"]:
        rule.pop("rows", None)
        rule.pop("let", None)
    hf, _ = map_ref.apply(m, stored, config(saved, "llama3"))
    differ = sorted(k for k in want if not same_bits(hf[k], want[k]))
    assert differ == sorted(f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(2) for p in "qk"), differ

    cfg = dict(config(saved, "llama3"), num_attention_heads=8)
    with pytest.raises(map_ref.MapError, match=r"attention\.qkv_linear\.wq\.weight.*axis 0"):
        map_ref.apply(map_ref.load(map_ref.MAPS / "torchtitan-llama3.json"), stored, cfg)


# --- through the mount ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mounted(saved, tmp_path_factory):
    """One mount of all three; Qwen 3's step directory has no config.json: hf_config gives it."""
    mnt = tmp_path_factory.mktemp("titan-maps-mnt") / "mnt"
    hf_config = saved / "qwen3" / "hf" / "config.json"
    with Mount(saved, mnt, opts=[f"hf_config={hf_config}"], log=str(mnt) + ".log") as m:
        yield m


def served(d: pathlib.Path) -> dict:
    out = {}
    for p in sorted(d.glob("model*.safetensors")):
        out.update(load(p))
    return out


@requires_fuse
@pytest.mark.parametrize("name", list(MODELS))
def test_mount_serves_hf(saved, mounted, name):
    _, dtype, tied, _ = MODELS[name]
    d = pathlib.Path(mounted.mnt) / name / STEP
    names = sorted(os.listdir(d))
    assert ".metadata" in names and "config.json" in names and "model.safetensors.index.json" in names, names
    assert json.loads((d / "config.json").read_text()) == config(saved, name)
    want = load(saved / name / "to_hf.safetensors")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(want), \
        f"{name}: index: only served {sorted(set(index['weight_map']) - set(want))}, " \
        f"only expected {sorted(set(want) - set(index['weight_map']))}"
    got = served(d)
    assert_same(got, want, f"{name}: the mount vs torchtitan's to_hf")
    assert_same(got, load(saved / name / "hf" / "model.safetensors"), f"{name}: the mount vs the HF checkpoint")

    model = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=dtype)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if tied:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    del model  # its mmap of the mount's file, before the unmount
    assert_same(sd, load(saved / name / "original.safetensors"), f"{name}: from_pretrained(mount) vs the original")
    assert mounted.proc.poll() is None


def inspect(*args) -> str:
    r = subprocess.run([BIN, "inspect", *map(str, args)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout + r.stderr


def q_proj_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if "model.layers.0.self_attn.q_proj.weight" in ln]
    assert lines, text
    return lines[0]


def test_inspect_names_source_and_rule(saved):
    # Llama: detected, its own config.json; the rule is the RoPE row order.
    line = q_proj_line(inspect(saved / "llama3" / STEP))
    assert "layers.0.attention.qkv_linear.wq.weight" in line and "(heads half two) -> (heads two half)" in line, line
    # Qwen 3: named, with the config from elsewhere; the rule is a rename.
    text = inspect("--map", "torchtitan-qwen3", "--hf-config", saved / "qwen3" / "hf" / "config.json",
                   saved / "qwen3" / STEP)
    assert "layers.0.attention.qkv_linear.wq.weight" in q_proj_line(text), text
    assert "torchtitan-qwen3" in text, text


@requires_fuse
def test_detected_without_config_keeps_stored_names(saved, tmp_path):
    """Qwen 3's step directory has no config.json and no hf_config is given: the checkpoint is
    served under torchtitan's names, as before maps, and inspect asks for hf_config."""
    want = load(saved / "qwen3" / "from_hf.safetensors")
    with Mount(saved / "qwen3", tmp_path / "mnt", log=str(tmp_path / "mnt.log")) as m:
        assert_same(served(pathlib.Path(m.mnt) / STEP), want, "qwen3 without config.json")
        assert m.proc.poll() is None
    text = inspect(saved / "qwen3" / STEP)
    assert "torchtitan-qwen3" in text and ("hf_config" in text or "hf-config" in text), text


# --- the same map without a mount: consolidate, verify, ckptfs load, the Python binding ----------

def test_consolidate_verify_and_load_through_the_map(saved, tmp_path):
    """consolidate --map/--hf-config writes the bytes the mount serves (and config.json); verify
    accepts the checkpoint; `ckptfs load` and ckptfs_load.load_state_dict(map=..., hf_config=...)
    give the HF tensors with no mount, each equal to torchtitan's own to_hf."""
    hf_config = saved / "qwen3" / "hf" / "config.json"
    for name in ("llama3", "qwen3"):
        step = saved / name / STEP
        extra = [] if MODELS[name][3] else ["--hf-config", str(hf_config)]
        out = tmp_path / f"{name}-out"
        r = subprocess.run([BIN, "consolidate", str(step), str(out), *extra], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        want = load(saved / name / "to_hf.safetensors")
        assert_same(served(out), want, f"{name}: consolidate")
        assert json.loads((out / "config.json").read_text()) == config(saved, name)
        r = subprocess.run([BIN, "verify", str(step), *extra], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        r = subprocess.run([BIN, "load", str(step), "--json", *extra], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        assert json.loads(r.stdout)["bytes"] == sum(t.numel() * t.element_size() for t in want.values())

    lib = os.environ.get("CKPTFS_LOAD_LIB", str(pathlib.Path(BIN).parent / "libckptfs_load.so"))
    if os.environ.get("CKPTFS_ASAN") == "1":  # an ASan library would need its runtime preloaded
        lib = str(pathlib.Path(__file__).parents[2] / "build" / "src" / "libckptfs_load.so")
    code = (
        "import sys, torch\n"
        "from safetensors.torch import load_file\n"
        "import ckptfs_load\n"
        "sd = ckptfs_load.load_state_dict(sys.argv[1], hf_config=sys.argv[2])\n"
        "want = load_file(sys.argv[3])\n"
        "assert sorted(sd) == sorted(want), sorted(set(sd) ^ set(want))\n"
        "bad = [k for k in want if not torch.equal(sd[k].view(torch.uint8), want[k].view(torch.uint8))]\n"
        "assert not bad, bad\n"
        "named = ckptfs_load.load_state_dict(sys.argv[1], map='torchtitan-qwen3', hf_config=sys.argv[2])\n"
        "assert sorted(named) == sorted(want)\n"
        "try:\n"
        "    ckptfs_load.load_state_dict(sys.argv[1], map='no-such-map')\n"
        "    raise SystemExit('an unknown map was accepted')\n"
        "except ckptfs_load.LoadError as e:\n"
        "    assert 'no-such-map' in str(e), e\n"
        "print('ok', len(sd))\n")
    env = dict(os.environ, CKPTFS_LOAD_LIB=lib, PYTHONPATH=str(pathlib.Path(__file__).parents[2] / "python"))
    r = subprocess.run([sys.executable, "-c", code, str(saved / "qwen3" / STEP), str(hf_config),
                        str(saved / "qwen3" / "to_hf.safetensors")], capture_output=True, text=True, timeout=120,
                       env=env)
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stdout + r.stderr
