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

from conftest import Mount, have, requires_fuse

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
