"""Tier 4: a user's first checkpoint just works (issue 33), the view's side: config.json.

  * `-o hf_config=PATH` is honoured in every layout, not only for mapped checkpoints: accelerate's
    own FSDP save (`save_fsdp_model`, what `Accelerator.save_state` calls) writes no config.json,
    and with the option the checkpoint directory shows one, so `from_pretrained` loads it;
  * the first lookup after mounting finds that config.json (before, it answered ENOENT until
    something listed the directory, so `from_pretrained` as the first access failed with
    "Unrecognized model");
  * a directory's own config.json still wins over the option.

The checkpoint is written by accelerate's own save (tests/python/writers/dcp_fsdp_save.py
--accelerate: FSDP2 on 2 gloo ranks). Skipped (never faked) without root, /dev/fuse, torch,
transformers or accelerate.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from conftest import BIN, Mount, have, requires_fuse

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

pytestmark = requires_fuse

WRITERS = pathlib.Path(__file__).parent / "writers"
CK = "run/checkpoint-1"


@pytest.fixture(scope="module")
def accelerate_saved(tmp_path_factory):
    """SRC/run/checkpoint-1/{pytorch_model_fsdp_0/, optimizer_0/}, config.json moved out to
    SRC/hf-config.json (what a user keeps beside the run)."""
    if not have("accelerate"):
        pytest.skip("accelerate not installed")
    src = tmp_path_factory.mktemp("first-try") / "src"
    (src / "run").mkdir(parents=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, str(WRITERS / "dcp_fsdp_save.py"), str(src / CK), "--ranks", "2",
                        "--dtype", "bfloat16", "--tied", "--accelerate"],
                       capture_output=True, text=True, timeout=300, env=env, cwd=str(src))
    assert r.returncode == 0, f"writer: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    shutil.move(str(src / CK / "config.json"), str(src.parent / "hf-config.json"))
    return src


def load(path: pathlib.Path) -> dict:
    return {k: v.clone() for k, v in safetensors_torch.load_file(str(path)).items()}


def test_hf_config_is_shown_in_every_layout_from_the_first_lookup(accelerate_saved, tmp_path):
    src = accelerate_saved
    cfg = src.parent / "hf-config.json"
    want = load(src / "run" / "reference-checkpoint-1.safetensors")
    # Without the option: no config.json, as accelerate wrote it.
    with Mount(src, tmp_path / "mnt", log=str(tmp_path / "mnt.log")) as m:
        d = pathlib.Path(m.mnt) / CK
        assert not (d / "config.json").exists()
        assert "config.json" not in os.listdir(d)
    # With it: the very first access of the mount is from_pretrained (config.json first).
    with Mount(src, tmp_path / "mnt", opts=[f"hf_config={cfg}"], log=str(tmp_path / "mnt.log")) as m:
        d = pathlib.Path(m.mnt) / CK
        model = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.bfloat16)
        sd = model.state_dict()
        bad = [k for k, v in want.items() if not torch.equal(sd[k], v)]
        assert not bad, bad
        del model, sd
        assert json.loads((d / "config.json").read_text()) == json.loads(cfg.read_text())
        assert os.listdir(d).count("config.json") == 1
    # A fresh mount, config.json looked up before anything else touched the directory.
    with Mount(src, tmp_path / "mnt", opts=[f"hf_config={cfg}"], log=str(tmp_path / "mnt.log")) as m:
        assert os.stat(pathlib.Path(m.mnt) / CK / "config.json").st_size == cfg.stat().st_size
    # The directory's own config.json wins over the option.
    own = {**json.loads(cfg.read_text()), "ckptfs_test": "own"}
    (src / CK / "config.json").write_text(json.dumps(own))
    try:
        with Mount(src, tmp_path / "mnt", opts=[f"hf_config={cfg}"], log=str(tmp_path / "mnt.log")) as m:
            d = pathlib.Path(m.mnt) / CK
            assert json.loads((d / "config.json").read_text())["ckptfs_test"] == "own"
            assert os.listdir(d).count("config.json") == 1
    finally:
        (src / CK / "config.json").unlink()


# --- never a silently wrong model -----------------------------------------------------------

MEGATRON_GPT2 = {  # Megatron-Core GPT with learned absolute positions (GPT-2's): no map serves it
    "embedding.word_embeddings.weight": (128, 64), "embedding.position_embeddings.weight": (64, 64),
    "decoder.layers.self_attention.linear_qkv.weight": (2, 192, 64),
    "decoder.layers.self_attention.linear_proj.weight": (2, 64, 64),
    "decoder.layers.mlp.linear_fc1.weight": (2, 256, 64), "decoder.layers.mlp.linear_fc2.weight": (2, 64, 128),
    "decoder.final_layernorm.weight": (64,), "output_layer.weight": (128, 64),
}


def test_a_trainers_names_no_map_serves_never_load_as_random_weights(tmp_path):
    """A torch DCP checkpoint under Megatron-Core's names (learned absolute positions, which no
    built-in map serves) beside a hand-written HF config.json: before, from_pretrained built a
    LlamaForCausalLM of random weights and only warned. Now the view shows no config.json, so it
    fails; the log, `ckptfs status` and `ckptfs inspect` name each built-in map and why it does
    not fit, and say what to give."""
    import torch.distributed.checkpoint as dcp

    src = tmp_path / "src"
    d = src / "iter_0000010"
    g = torch.Generator().manual_seed(0)
    dcp.save({k: torch.randn(*s, generator=g) for k, s in MEGATRON_GPT2.items()}, checkpoint_id=str(d),
             no_dist=True)
    # What megatron-core's torch_dist backend writes beside its DCP files.
    (d / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1}))
    (d / "config.json").write_text(json.dumps(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        architectures=["LlamaForCausalLM"]).to_dict()))
    with Mount(src, tmp_path / "mnt", log=str(tmp_path / "mnt.log")) as m:
        mnt = pathlib.Path(m.mnt) / "iter_0000010"
        names = os.listdir(mnt)
        assert "config.json" not in names and any(n.startswith("model") for n in names), names
        assert not (mnt / "config.json").exists()
        with pytest.raises((OSError, ValueError)):  # no config.json: "Unrecognized model"
            transformers.AutoModelForCausalLM.from_pretrained(str(mnt))
        r = subprocess.run([BIN, "status", "--json", m.mnt], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        entry = [c for c in json.loads(r.stdout)["checkpoints"]["list"] if c["path"].endswith("iter_0000010")]
        assert entry and "unmapped_native" in entry[0], entry
        tried = entry[0]["unmapped_native"]["maps_tried"]
        assert any(t.startswith("megatron-gpt: ") and "embedding.position_embeddings.weight" in t for t in tried), tried
        log = pathlib.Path(m.log).read_text()
        assert "no model map fits" in log and "-o map=PATH" in log, log[-2000:]
    r = subprocess.run([BIN, "inspect", str(d)], capture_output=True, text=True)
    assert "none fits" in r.stdout and "megatron-gpt: " in r.stdout and "-o map=PATH" in r.stdout, r.stdout
