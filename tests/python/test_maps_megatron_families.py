"""Every Megatron-Core family the built-in maps serve (docs/maps.md: megatron-gpt, -qwen2, -qwen3,
-mixtral, -qwen3-moe, -deepseek-v3), in Megatron-LM's own layout (CKPT/latest_checkpointed_iteration.txt,
CKPT/iter_0000010/ with common.pt holding `args`), served with NO options: the map is detected
from the stored names and the format, and config.json is made by the map's hf_config template
from Megatron-LM's args, so from_pretrained(MNT/CKPT/iter_0000010) gives back the model.

One writer run (tests/python/writers/megatron_families_save.py, module-scoped) makes every case
with megatron-core's own dist_checkpointing.save on 2 gloo ranks: TP 2, PP 2 and EP 2, tied and
untied, float32 and bfloat16; DeepSeek V3's multi-latent attention with megatron-core's local
spec (the writer's docstring says what it patches to build MLA on CPU). Each case is checked
against two references: the original HF model (save_pretrained) and mbridge 0.15.1's export
mapping applied to what megatron-core saved (an independent conversion, the names and splits of
another project).
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

from conftest import BIN, Mount, requires_fuse

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")
transformers = pytest.importorskip("transformers")
for mod in ("megatron.core", "mbridge", "einops"):
    if importlib.util.find_spec(mod.split(".")[0]) is None or importlib.util.find_spec(mod) is None:
        pytest.skip(f"{mod} not installed (tools/requirements-frameworks.txt)", allow_module_level=True)

import map_ref  # noqa: E402

WRITERS = pathlib.Path(__file__).parent / "writers"
ITER = "iter_0000010"
FORMAT = "Megatron-Core torch_dist (.metadata, *.distcp, metadata.json)"

# name: (family, TP, PP, EP, tied, dtype, the map that must be detected)
CASES = {
    "llama-pp2": ("llama", 1, 2, 1, False, "float32", "megatron-gpt"),
    "qwen2-tp2": ("qwen2", 2, 1, 1, False, "bfloat16", "megatron-qwen2"),
    "qwen3-pp2-tied": ("qwen3", 1, 2, 1, True, "float32", "megatron-qwen3"),
    "mixtral-tp2": ("mixtral", 2, 1, 1, False, "bfloat16", "megatron-mixtral"),
    "qwen3moe-ep2-tied": ("qwen3_moe", 1, 1, 2, True, "float32", "megatron-qwen3-moe"),
    # multi-latent attention, dense first layers (stored one by one), a sigmoid router with its
    # expert bias and a shared expert
    "deepseekv3-ep2": ("deepseek_v3", 1, 1, 2, False, "bfloat16", "megatron-deepseek-v3"),
    "deepseekv3-tp2": ("deepseek_v3", 2, 1, 1, False, "float32", "megatron-deepseek-v3"),
    "deepseekv3-pp2": ("deepseek_v3", 1, 2, 1, False, "float32", "megatron-deepseek-v3"),
    # MLA's default rope: YaRN (Megatron-LM's args: rope_type None, rotary_scaling_factor, mscale)
    "deepseekv3-yarn": ("deepseek_v3", 2, 1, 1, False, "bfloat16", "megatron-deepseek-v3"),
    # every layer MoE (moe_layer_freq 1): megatron-core stores the layers stacked, [layers, ...];
    # no q_lora_rank (DeepSeek V2-Lite's one q projection)
    "deepseekv3-allmoe-pp2": ("deepseek_v3", 1, 2, 1, False, "float32", "megatron-deepseek-v3"),
}
# The writer's flags (megatron_families_save.py): group-limited routing; no expert bias; YaRN; every
# layer MoE, and no q_lora_rank.
FLAGS = {"deepseekv3-ep2": "groups", "deepseekv3-pp2": "nobias", "deepseekv3-yarn": "yarn",
         "deepseekv3-allmoe-pp2": "allmoe,noqlora"}


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    """gen/src/<case>/{latest_checkpointed_iteration.txt, iter_0000010/} as Megatron-LM lays them
    out (no config.json anywhere), gen/ref/<case>/ the original and mbridge's export."""
    root = tmp_path_factory.mktemp("megatron-families")
    src, ref = root / "src", root / "ref"
    # CKPTFS_MEGATRON_FAMILIES_REUSE=DIR: a previous run's src/ and ref/ (DIR/out.json beside them),
    # copied instead of written again: for checking that a test fails when the code is broken.
    reuse = os.environ.get("CKPTFS_MEGATRON_FAMILIES_REUSE")
    if reuse and (pathlib.Path(reuse) / "out.json").exists():
        shutil.copytree(pathlib.Path(reuse) / "src", src)
        shutil.copytree(pathlib.Path(reuse) / "ref", ref)
        return {"src": src, "ref": ref, "root": root}
    args = [f"{n}:{f}:{tp}:{pp}:{ep}:{int(t)}:{dt}" + (f":{FLAGS[n]}" if n in FLAGS else "")
            for n, (f, tp, pp, ep, t, dt, _) in CASES.items()]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, str(WRITERS / "megatron_families_save.py"), str(src), str(ref), *args],
                       capture_output=True, text=True, timeout=420, env=env, cwd=str(root))
    assert r.returncode == 0, f"megatron_families_save: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-6000:]}"
    result = json.loads(r.stdout.strip().splitlines()[-1])
    if reuse:
        shutil.copytree(src, pathlib.Path(reuse) / "src")
        shutil.copytree(ref, pathlib.Path(reuse) / "ref")
        (pathlib.Path(reuse) / "out.json").write_text(json.dumps(result))
    for name, (_, _, pp, *_rest) in CASES.items():
        files = result[name]["files"]
        assert f"{ITER}/common.pt" in files and f"{ITER}/.metadata" in files, files
        assert "latest_checkpointed_iteration.txt" in files and not any(f.endswith("config.json") for f in files)
        if pp == 1:  # megatron-core's forward on the converted weights is HF's
            assert result[name]["max_logit_diff"] < 2e-3, (name, result[name])
    return {"src": src, "ref": ref, "root": root}


def load(path) -> dict:
    return {k: v.clone() for k, v in safetensors_torch.load_file(str(path)).items()}


def stored(d: pathlib.Path) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp.FileSystemReader(str(d)).read_metadata()
    sd = {k: torch.zeros(tuple(v.size), dtype=v.properties.dtype)
          for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    dcp.load(sd, checkpoint_id=str(d), no_dist=True)
    return sd


def native_args(d: pathlib.Path) -> dict:
    """common.pt's args as the C++ reader gives them: the scalar fields, dtypes by name, and
    non-empty lists of ints and bools (moe_layer_freq)."""
    args = torch.load(str(d / "common.pt"), weights_only=False)["args"]
    out = {}
    for k, v in vars(args).items():
        if isinstance(v, torch.dtype):
            out[k] = str(v).removeprefix("torch.")
        elif v is None or isinstance(v, (bool, int, float, str)):
            out[k] = v
        elif isinstance(v, (list, tuple)) and v and all(isinstance(x, (bool, int)) for x in v):
            out[k] = list(v)
    return out


def assert_equal(got: dict, want: dict, what: str):
    assert sorted(got) == sorted(want), f"{what}: names differ: {sorted(set(got) ^ set(want))}"
    bad = [(k, str(got[k].dtype), list(got[k].shape)) for k in want
           if got[k].dtype != want[k].dtype or got[k].shape != want[k].shape or not torch.equal(got[k], want[k])]
    assert not bad, f"{what}: tensors differ: {bad}"


def original(gen, name) -> dict:
    """The original's tensors as the checkpoint can hold them. DeepSeek V3's expert bias
    (e_score_correction_bias, a buffer) is float32 in megatron-core and in HF's model
    (_keep_in_fp32_modules_strict), but HF's save_pretrained of a bf16 model writes it in bf16:
    its float32 values are compared. A model without expert bias stores none; HF's buffer then
    keeps its zeros."""
    want = load(gen["ref"] / name / "model.safetensors")
    for k in [k for k in want if k.endswith(".mlp.gate.e_score_correction_bias")]:
        if FLAGS.get(name) == "nobias":
            assert not want.pop(k).any(), k
        else:
            want[k] = want[k].float()
    return want


def served(d: pathlib.Path) -> dict:
    out = {}
    for p in sorted(d.glob("model*.safetensors")):
        out.update(load(p))
    return out


def inspect(*args) -> str:
    r = subprocess.run([BIN, "inspect", *map(str, args)], capture_output=True, text=True, timeout=60)
    return r.stdout + r.stderr


# --- the maps alone, applied in Python --------------------------------------------------------

@pytest.mark.parametrize("name", list(CASES))
def test_map_ref_matches_both_references(gen, name):
    """The one built-in map whose detect clause holds, with the config.json its hf_config
    template makes of common.pt's args, applied by map_ref to what megatron-core saved: the
    original HF tensors bit for bit, and mbridge's export of the same checkpoint bit for bit."""
    *_, dtype, want_map = CASES[name]
    d = gen["src"] / name / ITER
    sd = stored(d)
    assert [m["name"] for m in map_ref.builtin_maps() if map_ref.detect(m, sd, FORMAT)] == [want_map]
    m = map_ref.load(map_ref.MAPS / f"{want_map}.json")
    config = map_ref.hf_config(m, native_args(d), "common.pt")
    ref_config = json.loads((gen["ref"] / name / "config.json").read_text())
    keys = ("architectures", "model_type", "num_hidden_layers", "hidden_size", "num_attention_heads",
            "num_key_value_heads", "vocab_size", "tie_word_embeddings", "rms_norm_eps", "dtype")
    if want_map == "megatron-deepseek-v3":  # every key the template makes (MLA and routing sizes too)
        keys = list(config)
    for k in keys:
        assert config.get(k) == ref_config.get(k), (k, config.get(k), ref_config.get(k))
    hf, _ = map_ref.apply(m, sd, config)
    assert_equal(hf, original(gen, name), f"map_ref({name}) vs the original")
    assert_equal(hf, load(gen["ref"] / name / "mbridge.safetensors"), f"map_ref({name}) vs mbridge")


def test_hf_config_refusals_name_the_field():
    """The template refuses what the architecture it names cannot compute (hf_config_requires),
    and a computed value with no field and no 'else', naming the key and the fields."""
    m = map_ref.load(map_ref.MAPS / "megatron-gpt.json")
    base = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "group_query_attention": False,
            "ffn_hidden_size": 96, "max_position_embeddings": 64, "layernorm_epsilon": 1e-5,
            "padded_vocab_size": 256, "untie_embeddings_and_output_weights": True, "params_dtype": "bfloat16",
            "normalization": "RMSNorm", "swiglu": True}
    c = map_ref.hf_config(m, base)
    assert c["num_key_value_heads"] == 4 and c["head_dim"] == 16 and c["rope_theta"] == 10000  # else branches
    with pytest.raises(map_ref.MapError, match="swiglu"):
        map_ref.hf_config(m, {**base, "swiglu": False})
    with pytest.raises(map_ref.MapError, match="num_hidden_layers"):
        map_ref.hf_config(m, {k: v for k, v in base.items() if k != "num_layers"})


# --- through the mount, with no options -------------------------------------------------------

def mount_for_module(src, tmp_path_factory, name):
    """A mount of src with no options, for a module fixture (yields its path)."""
    if not (os.geteuid() == 0 and os.path.exists("/dev/fuse") and shutil.which("fusermount3")):
        pytest.skip("needs root, /dev/fuse and fusermount3")
    t = tmp_path_factory.mktemp(name)
    m = Mount(src, t / "mnt", log=str(t / "mnt.log"))
    try:
        m.start()
        yield pathlib.Path(m.mnt)
        import gc

        gc.collect()
        assert m.alive(), m.log_tail()
    finally:
        m.stop()


@pytest.fixture(scope="module")
def mounted(gen, tmp_path_factory):
    yield from mount_for_module(gen["src"], tmp_path_factory, "megatron-families-mnt")


def logits(model):
    with torch.no_grad():
        return model(torch.tensor([[3, 17, 5, 99, 42, 7, 150, 1]])).logits.float()


@requires_fuse
@pytest.mark.parametrize("name", list(CASES))
def test_from_pretrained_with_no_options(gen, mounted, name):
    """MNT/<case>/iter_0000010 shows config.json (made from common.pt's args by the detected
    map), model-*.safetensors holding exactly the original tensors and mbridge's export, and
    from_pretrained of it computes the original model's logits."""
    *_, tied, dtype, want_map = CASES[name]
    d = mounted / name / ITER
    names = set(os.listdir(d))
    assert {"config.json", "model.safetensors.index.json", "common.pt", ".metadata"} <= names, names
    config = json.loads((d / "config.json").read_text())
    ref_config = json.loads((gen["ref"] / name / "config.json").read_text())
    assert config["architectures"] == ref_config["architectures"] and config["dtype"] == dtype, config
    got = served(d)
    assert_equal(got, original(gen, name), f"{name}: the consolidated files")
    assert_equal(got, load(gen["ref"] / name / "mbridge.safetensors"), f"{name}: vs mbridge's export")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32,
                                                                   output_loading_info=True)
    bias_left = {k for k in model.state_dict() if k.endswith("e_score_correction_bias")} \
        if FLAGS.get(name) == "nobias" else set()
    assert set(info["missing_keys"]) == bias_left and not info["unexpected_keys"], info
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(gen["ref"] / name), dtype=torch.float32)
    assert type(model) is type(ref)
    assert torch.equal(logits(model), logits(ref)), f"{name}: another model's logits"
    if tied:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    del model, ref, got
    assert want_map in inspect(gen["src"] / name / ITER)


@requires_fuse
def test_hf_config_option_wins(gen, tmp_path):
    """-o hf_config=PATH is what the view shows and what sizes the map, over common.pt's args."""
    name = "qwen2-tp2"
    cfg = json.loads((gen["ref"] / name / "config.json").read_text())
    cfg["ckptfs_test_marker"] = 1
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    src = tmp_path / "src"
    shutil.copytree(gen["src"] / name, src / name)
    with Mount(src, tmp_path / "mnt", opts=[f"hf_config={path}"], log=str(tmp_path / "mnt.log")) as m:
        d = pathlib.Path(m.mnt) / name / ITER
        assert "config.json" in os.listdir(d)
        assert json.loads((d / "config.json").read_text()) == cfg
        assert_equal(served(d), load(gen["ref"] / name / "model.safetensors"), "with -o hf_config")


class Evil:
    def __reduce__(self):
        return (os.system, ("true",))


def rewrite_common(d: pathlib.Path, **changes):
    """common.pt saved again with `args` fields changed, or with extra top-level values."""
    sd = torch.load(str(d / "common.pt"), weights_only=False)
    extra = changes.pop("extra", {})
    for k, v in changes.items():
        setattr(sd["args"], k, v)
    sd.update(extra)
    torch.save(sd, str(d / "common.pt"))


@requires_fuse
def test_refusals_name_the_file_the_map_and_the_rule(gen, tmp_path):
    """Nothing is served under HF names where the model could be wrong, and inspect says why:
    a common.pt holding a global outside the list (names the file and the global), args the
    architecture cannot compute (names the map, hf_config_requires and the field), args that
    disagree with the stored shapes (names the map, the rule and the tensor), a common.pt that is
    not a zip; a map named for another family names the rule and the stored tensor."""
    src = tmp_path / "src"
    base = gen["src"] / "qwen2-tp2" / ITER
    cases = {
        "evil": ({"extra": {"evil": Evil()}}, ["common.pt", "posix.system", "not one this reader allows"]),
        "no-swiglu": ({"swiglu": False}, ["megatron-qwen2", "hf_config_requires", "swiglu"]),
        "groups": ({"num_query_groups": 1}, ["megatron-qwen2", "rule", "decoder.layers.self_attention.linear_qkv"]),
    }
    for case, (change, _) in cases.items():
        shutil.copytree(base, src / case)
        rewrite_common(src / case, **change)
    shutil.copytree(base, src / "not-a-zip")
    (src / "not-a-zip" / "common.pt").write_bytes(b"\x80\x04not a zip")
    with Mount(src, tmp_path / "mnt", log=str(tmp_path / "mnt.log")) as m:
        for case, (_, says) in [*cases.items(), ("not-a-zip", (None, ["common.pt"]))]:
            names = os.listdir(pathlib.Path(m.mnt) / case)
            assert "config.json" not in names, (case, names)
            index = json.loads((pathlib.Path(m.mnt) / case / "model.safetensors.index.json").read_text()) \
                if "model.safetensors.index.json" in names else {"weight_map": {}}
            assert not any(k.startswith("model.layers.") for k in index["weight_map"]), (case, index)
            text = inspect(src / case)
            assert all(s in text for s in says), f"{case}: {says}\n{text}"
        assert m.proc.poll() is None
    text = inspect("--map", "megatron-qwen2", "--hf-config", gen["ref"] / "llama-pp2" / "config.json",
                   gen["src"] / "llama-pp2" / ITER)
    assert "megatron-qwen2" in text and "rule" in text and "linear_qkv.bias" in text, text


# --- Megatron-Bridge: its run_config.yaml, no Megatron-LM args --------------------------------

# The cases Megatron-Bridge 0.3.1 can make a provider for (its AutoBridge has no Mixtral bridge).
BRIDGE_CASES = ["llama-pp2", "qwen2-tp2", "qwen3-pp2-tied", "qwen3moe-ep2-tied", "deepseekv3-yarn"]


@pytest.fixture(scope="module")
def bridge(gen, tmp_path_factory):
    """gen's checkpoints as Megatron-Bridge lays them out (Megatron-LM's layout, which Bridge
    keeps): common.pt with no `args` (Bridge keeps none) and iter_0000010/run_config.yaml, written
    by Megatron-Bridge's own ConfigContainer.to_yaml around the provider its AutoBridge makes of
    the original HF model, with the case's TP, PP and EP (tests/python/writers/bridge_run_config.py).
    The weights are megatron-core's dist_checkpointing.save, which Bridge's save_checkpoint calls."""
    if importlib.util.find_spec("megatron.bridge") is None:
        pytest.skip("megatron-bridge not installed (tools/requirements-frameworks.txt)")
    src = tmp_path_factory.mktemp("megatron-bridge") / "src"
    cases = []
    for name in BRIDGE_CASES:
        _, tp, pp, ep, *_ = CASES[name]
        shutil.copytree(gen["src"] / name, src / name)
        d = src / name / ITER
        sd = torch.load(str(d / "common.pt"), weights_only=False)
        del sd["args"]
        torch.save(sd, str(d / "common.pt"))
        cases.append(f"{gen['ref'] / name}:{d}:{tp}:{pp}:{ep}")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, str(WRITERS / "bridge_run_config.py"), *cases], capture_output=True,
                       text=True, timeout=300, env=env, cwd=str(src.parent))
    assert r.returncode == 0, f"bridge_run_config: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    for name in BRIDGE_CASES:
        assert (src / name / ITER / "run_config.yaml").exists(), name
    return src


@pytest.fixture(scope="module")
def bridge_mounted(bridge, tmp_path_factory):
    yield from mount_for_module(bridge, tmp_path_factory, "megatron-bridge-mnt")


@requires_fuse
@pytest.mark.parametrize("name", BRIDGE_CASES)
def test_megatron_bridge_run_config_with_no_options(gen, bridge, bridge_mounted, name):
    """MNT/<case>/iter_0000010 of a Megatron-Bridge checkpoint shows config.json made by the
    detected map from run_config.yaml's model (no args anywhere), the original tensors (and so
    mbridge's export), and from_pretrained of it as the mount's first access computes the
    original model's logits."""
    *_, tied, dtype, want_map = CASES[name]
    d = bridge_mounted / name / ITER
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32,
                                                                   output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(gen["ref"] / name), dtype=torch.float32)
    assert type(model) is type(ref)
    assert torch.equal(logits(model), logits(ref)), f"{name}: another model's logits"
    config = json.loads((d / "config.json").read_text())
    ref_config = json.loads((gen["ref"] / name / "config.json").read_text())
    for k in ("architectures", "num_hidden_layers", "hidden_size", "num_attention_heads",
              "num_key_value_heads", "vocab_size", "tie_word_embeddings", "rms_norm_eps"):
        assert config.get(k) == ref_config.get(k), (k, config.get(k), ref_config.get(k))
    got = served(d)
    assert_equal(got, original(gen, name), f"{name}: the consolidated files")
    assert_equal(got, load(gen["ref"] / name / "mbridge.safetensors"), f"{name}: vs mbridge's export")
    del model, ref, got
    text = inspect(bridge / name / ITER)
    assert want_map in text and "run_config.yaml" in text, text


@requires_fuse
def test_megatron_bridge_refusals_name_the_file(gen, bridge, tmp_path):
    """A run_config.yaml that is not what Bridge writes makes no config.json, and inspect says
    why naming the file and the line: a tag that would construct an object (refused before
    anything is read), a GeGLU model (not the SwiGLU the architecture computes: the map's
    hf_config_requires), a file with no `model`; a Megatron-LM common.pt's args win over it."""
    src = tmp_path / "src"
    base = bridge / "qwen2-tp2" / ITER
    text = (base / "run_config.yaml").read_text()
    cases = {
        "tag": (text.replace("model:\n", "model:\n  evil: !!python/object/apply:os.system ['true']\n", 1),
                ["run_config.yaml: line", "a tag ('!!python/object/apply:os.system')"]),
        "geglu": (text.replace("torch.nn.functional.silu", "torch.nn.functional.gelu"),
                  ["megatron-qwen2", "hf_config_requires", "swiglu"]),
        "no-model": ("train:\n  train_iters: 10\n", ["megatron-qwen2", "hf_config"]),
    }
    for case, (body, _) in cases.items():
        shutil.copytree(base, src / case)
        (src / case / "run_config.yaml").write_text(body)
    # Megatron-LM's args and a run_config.yaml beside them: the args are read.
    shutil.copytree(gen["src"] / "qwen2-tp2" / ITER, src / "args-win")
    (src / "args-win" / "run_config.yaml").write_text(cases["geglu"][0])
    with Mount(src, tmp_path / "mnt", log=str(tmp_path / "mnt.log")) as m:
        for case, (_, says) in cases.items():
            names = os.listdir(pathlib.Path(m.mnt) / case)
            assert "config.json" not in names, (case, names)
            out = inspect(src / case)
            assert all(s in out for s in says), f"{case}: {says}\n{out}"
        assert "config.json" in os.listdir(pathlib.Path(m.mnt) / "args-win")
        assert_equal(served(pathlib.Path(m.mnt) / "args-win"), original(gen, "qwen2-tp2"), "args-win")
        assert m.proc.poll() is None


def test_megatron_bridge_verify_consolidate_and_load(gen, bridge, tmp_path):
    """The CLI reads a Megatron-Bridge checkpoint as the mount does, with no options: verify
    passes, consolidate writes the original's tensors and a config.json made from
    run_config.yaml (from_pretrained of the copy computes the original's logits), and load reads
    the bytes the view serves (its checksum against the consolidated copy's)."""
    name = "qwen3-pp2-tied"
    d = bridge / name / ITER
    r = subprocess.run([BIN, "verify", str(d)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    out = tmp_path / "out"
    r = subprocess.run([BIN, "consolidate", str(d), str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    assert_equal(served(out), original(gen, name), "consolidate's copy")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(gen["ref"] / name), dtype=torch.float32)
    assert torch.equal(logits(model), logits(ref))
    sums = []
    for p in (d, out):
        r = subprocess.run([BIN, "load", str(p)], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        sums.append([ln for ln in r.stdout.splitlines() if ln.startswith("checksum")])
    assert sums[0] and sums[0] == sums[1], sums
