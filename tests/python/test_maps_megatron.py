"""The built-in model map megatron-gpt (maps/megatron-gpt.json, docs/maps.md): Megatron-Core GPT
checkpoints in the Llama shape, saved by megatron-core's own dist_checkpointing.save (torch_dist),
served under HF's names and layouts, so that from_pretrained(MNT/iter_N) gives back the model.

One writer run (tests/python/writers/megatron_map_save.py, module-scoped) makes every case: a
tiny HF LlamaForCausalLM (GQA: 4 heads in 2 query groups; every parameter random), converted to
Megatron-Core's layout (QKV fused per query group, [gate; up], layers stacked, vocabulary padded
to a multiple of 128 x TP with random padding rows), loaded into a real megatron-core GPTModel
(its forward must reproduce HF's logits) and saved with TP 2 on 2 gloo ranks, 3 layers. The cases
cover tied and untied embeddings, the fused norm names of megatron-core 0.16.1's local and TE
specs and the separate norm names of a spec without the keys map, a padded and an unpadded
vocabulary, float32 and bfloat16. Checked: the map applied by the pure-Python reference
interpreter (map_ref) gives the original HF state dict bit for bit; through the mount (detected,
or named with -o map= and -o hf_config=), the consolidated files hold exactly the original
tensors and from_pretrained loads them; a config.json that disagrees with the checkpoint is
refused naming the tensor; without any config.json the stored names are served.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from conftest import BIN, Mount, requires_fuse

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")
transformers = pytest.importorskip("transformers")
if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core 0.16.1 not installed", allow_module_level=True)

import map_ref  # noqa: E402

WRITERS = pathlib.Path(__file__).parent / "writers"
ITER = "iter_0000003"
MEGATRON_FORMAT = "Megatron-Core torch_dist"

# name: (HF vocab_size, tied, norm names, dtype). TP 2: the vocabulary is padded to 256 or 512.
CASES = {
    "untied-te": (200, False, "te", "float32"),  # 56 padding rows
    "tied-te": (300, True, "te", "bfloat16"),  # 212 padding rows
    "untied-separate": (256, False, "separate", "bfloat16"),  # no padding
    "tied-separate": (200, True, "separate", "float32"),  # served with -o map=, -o hf_config=
}
BY_HF_CONFIG = "tied-separate"


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    """Every case, written once: gen/src/<case>/iter_0000003/ (megatron's files; config.json
    beside them except for BY_HF_CONFIG), gen/ref/<case>/ (the original, save_pretrained)."""
    root = tmp_path_factory.mktemp("megatron-maps")
    out, ref = root / "out", root / "ref"
    args = [f"{n}:{v}:{int(t)}:{names}:{dt}" for n, (v, t, names, dt) in CASES.items()]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, str(WRITERS / "megatron_map_save.py"), str(out), str(ref), *args,
                        "--tp", "2", "--layers", "3"],
                       capture_output=True, text=True, timeout=300, env=env, cwd=str(root))
    assert r.returncode == 0, f"megatron_map_save: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    result = json.loads(r.stdout.strip().splitlines()[-1])
    src = root / "src"
    for name in CASES:
        files = result[name]["files"]
        assert ".metadata" in files and "metadata.json" in files and len([f for f in files if f.endswith(".distcp")]) >= 2
        # Megatron-Core's forward on the converted weights is HF's: the conversion is Megatron's layout.
        assert result[name]["max_logit_diff"] < 1e-3, (name, result[name])
        d = src / name / ITER
        d.parent.mkdir(parents=True)
        shutil.move(str(out / name), str(d))
        (src / name / "latest_checkpointed_iteration.txt").write_text("3")
        if name != BY_HF_CONFIG:
            shutil.copy(ref / name / "config.json", d / "config.json")
    return {"src": src, "ref": ref, "root": root}


def load(path) -> dict:
    """A safetensors file's tensors, copied (none keeps a file of the mount mapped)."""
    return {k: v.clone() for k, v in safetensors_torch.load_file(str(path)).items()}


def original(gen, name) -> dict:
    return load(gen["ref"] / name / "model.safetensors")


def stored(d: pathlib.Path) -> dict:
    """The megatron checkpoint's tensors, whole, as torch's own reader reshards them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp.FileSystemReader(str(d)).read_metadata()
    sd = {k: torch.zeros(tuple(v.size), dtype=v.properties.dtype)
          for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    dcp.load(sd, checkpoint_id=str(d), no_dist=True)
    return sd


def assert_equal(got: dict, want: dict, what: str):
    assert sorted(got) == sorted(want), f"{what}: names differ: {sorted(set(got) ^ set(want))}"
    bad = [(k, str(got[k].dtype), list(got[k].shape)) for k in want
           if got[k].dtype != want[k].dtype or got[k].shape != want[k].shape or not torch.equal(got[k], want[k])]
    assert not bad, f"{what}: tensors differ: {bad}"


def served(d: pathlib.Path) -> dict:
    out = {}
    for p in sorted(d.glob("model*.safetensors")):
        out.update(load(p))
    return out


def inspect(*args) -> str:
    r = subprocess.run([BIN, "inspect", *map(str, args)], capture_output=True, text=True, timeout=60)
    return r.stdout + r.stderr


# --- the map alone, applied in Python --------------------------------------------------------

@pytest.mark.parametrize("name", list(CASES))
def test_map_reproduces_the_original(gen, name):
    """maps/megatron-gpt.json, applied by map_ref to the tensors megatron-core saved, gives the
    original HF state dict bit for bit; it is the only built-in map whose detect clause holds."""
    sd = stored(gen["src"] / name / ITER)
    assert sd["decoder.layers.self_attention.linear_qkv.weight"].shape == (3, 128, 64)  # stacked, fused
    assert sd["embedding.word_embeddings.weight"].shape[0] % 256 == 0  # padded
    assert ("output_layer.weight" in sd) == (not CASES[name][1])  # a tied model saves no output layer
    fmt = MEGATRON_FORMAT + " (.metadata, *.distcp, metadata.json)"
    assert [m["name"] for m in map_ref.builtin_maps() if map_ref.detect(m, sd, fmt)] == ["megatron-gpt"]
    m = map_ref.load(map_ref.MAPS / "megatron-gpt.json")
    assert not map_ref.detect(m, sd, "torch DCP")  # Megatron's metadata.json is part of the clause
    config = json.loads((gen["ref"] / name / "config.json").read_text())
    hf, _ = map_ref.apply(m, sd, config)
    assert_equal(hf, original(gen, name), f"map_ref({name})")


def test_map_refuses_a_config_that_disagrees(gen):
    """map_ref's refusals for configs that do not fit: the wrong number of query groups (the
    fused QKV rows do not add up), a vocabulary larger than the padded one, an untied config on
    a tied checkpoint (no output layer stored), fewer layers than stacked (one would be lost)."""
    m = map_ref.load(map_ref.MAPS / "megatron-gpt.json")
    sd = stored(gen["src"] / "tied-separate" / ITER)
    config = json.loads((gen["ref"] / "tied-separate" / "config.json").read_text())
    for change, says in [({"num_key_value_heads": 1}, "decoder.layers.self_attention.linear_qkv.weight"),
                         ({"vocab_size": 300}, "embedding.word_embeddings.weight"),
                         ({"tie_word_embeddings": False}, "output_layer.weight"),
                         ({"num_hidden_layers": 2}, "decoder.layers.")]:
        with pytest.raises(map_ref.MapError, match=says.replace(".", r"\.")):
            map_ref.apply(m, sd, {**config, **change})


# --- through the mount -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def mounted(gen, tmp_path_factory):
    """One mount of gen/src: the cases with their own config.json by detection, BY_HF_CONFIG
    with -o map=megatron-gpt and -o hf_config= (the only case without one)."""
    if not (os.geteuid() == 0 and os.path.exists("/dev/fuse") and shutil.which("fusermount3")):
        pytest.skip("needs root, /dev/fuse and fusermount3")
    t = tmp_path_factory.mktemp("megatron-maps-mnt")
    hf_config = gen["ref"] / BY_HF_CONFIG / "config.json"
    # -o map= names one map for the whole mount: BY_HF_CONFIG also through a second one naming it.
    only = t / "src-named"
    only.mkdir()
    shutil.copytree(gen["src"] / BY_HF_CONFIG, only / BY_HF_CONFIG)
    m = Mount(gen["src"], t / "mnt", opts=[f"hf_config={hf_config}"], log=str(t / "mnt.log"))
    named = Mount(only, t / "mnt-named", opts=["map=megatron-gpt", f"hf_config={hf_config}"],
                  log=str(t / "mnt-named.log"))
    try:
        m.start()
        named.start()
        yield {"detected": pathlib.Path(m.mnt), "named": pathlib.Path(named.mnt)}
        import gc

        gc.collect()
        assert named.alive() and m.alive(), m.log_tail() + named.log_tail()
    finally:  # a mount started is stopped, whatever failed
        named.stop()
        m.stop()


@requires_fuse
@pytest.mark.parametrize("name", list(CASES))
def test_from_pretrained_through_the_mount(gen, mounted, name):
    """MNT/<case>/iter_0000003 holds config.json, model-*.safetensors and the index beside
    megatron's own files; the safetensors hold exactly the original tensors (names, dtypes,
    bytes: no padding row, no output layer of a tied model); from_pretrained loads them."""
    vocab, tied, _, dtype = CASES[name]
    want = original(gen, name)
    views = [mounted["detected"]] + ([mounted["named"]] if name == BY_HF_CONFIG else [])
    for root in views:
        d = root / name / ITER
        names = sorted(os.listdir(d))
        assert {".metadata", "metadata.json", "common.pt", "config.json", "model.safetensors.index.json"} <= set(names), names
        assert json.loads((d / "config.json").read_text()) == json.loads((gen["ref"] / name / "config.json").read_text())
        index = json.loads((d / "model.safetensors.index.json").read_text())
        assert sorted(index["weight_map"]) == sorted(want)
        assert_equal(served(d), want, f"{root.name}/{name}: the consolidated files")
        model = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=getattr(torch, dtype))
        assert model.config.vocab_size == vocab
        sd = model.state_dict()
        ref_model = transformers.AutoModelForCausalLM.from_pretrained(str(gen["ref"] / name), dtype=getattr(torch, dtype))
        assert_equal(sd, ref_model.state_dict(), f"{root.name}/{name}: from_pretrained's state dict")
        if tied:
            assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        del model, sd, ref_model  # their maps of the mount's file, before the unmount


@requires_fuse
def test_inspect_names_the_map_and_the_rules(gen):
    """inspect says which map it used and, per HF tensor, its source tensor and rule."""
    d = gen["src"] / "untied-te" / ITER
    text = inspect(d)
    assert "megatron-gpt" in text, text
    text = inspect("--map", "megatron-gpt", d)
    for hf, src in [("model.layers.2.self_attn.v_proj.weight", "decoder.layers.self_attention.linear_qkv.weight"),
                    ("model.layers.0.mlp.up_proj.weight", "decoder.layers.mlp.linear_fc1.weight"),
                    ("lm_head.weight", "output_layer.weight")]:
        line = next((ln for ln in text.splitlines() if hf in ln), None)
        assert line is not None and src in line, f"{hf}: {line!r}\n{text}"
    d = gen["src"] / BY_HF_CONFIG / ITER
    text = inspect("--hf-config", gen["ref"] / BY_HF_CONFIG / "config.json", d)
    assert "megatron-gpt" in text and "model.layers.1.input_layernorm.weight" in text, text


@requires_fuse
def test_a_config_that_disagrees_is_refused(gen, tmp_path):
    """config.json files that do not fit the stored shapes: nothing consolidated is shown and
    inspect names the tensor; with no config.json at all, the stored names are served and inspect
    asks for hf_config."""
    src = tmp_path / "src"
    base = gen["src"] / "untied-te" / ITER
    config = json.loads((base / "config.json").read_text())
    bad = {"kv-heads": ({"num_key_value_heads": 1}, ["decoder.layers.self_attention.linear_qkv.weight", "axis"]),
           "vocab": ({"vocab_size": 300}, ["embedding.word_embeddings.weight"]),
           "ffn": ({"intermediate_size": 64}, ["decoder.layers.mlp.linear_fc1.weight", "axis"]),
           "layers": ({"num_hidden_layers": 2}, ["decoder.layers.", "axis 0"])}
    for case, (change, _) in bad.items():
        shutil.copytree(base, src / case)
        (src / case / "config.json").write_text(json.dumps({**config, **change}))
    shutil.copytree(base, src / "no-config")
    (src / "no-config" / "config.json").unlink()
    with Mount(src, tmp_path / "mnt", log=str(tmp_path / "mnt.log")) as m:
        for case, (_, says) in bad.items():
            names = os.listdir(pathlib.Path(m.mnt) / case)
            assert not [n for n in names if n.startswith("model")], (case, names)
            text = inspect(src / case)
            assert all(s in text for s in says), f"{case}: {says}\n{text}"
        d = pathlib.Path(m.mnt) / "no-config"
        index = json.loads((d / "model.safetensors.index.json").read_text())
        assert "decoder.layers.self_attention.linear_qkv.weight" in index["weight_map"], index
        assert "hf_config" in inspect(src / "no-config")
        assert m.proc.poll() is None
