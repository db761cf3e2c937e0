"""ckptfs_load.from_pretrained (issue 23, the fast path without a mount): equal to transformers'.

A tiny LlamaForCausalLM (untied head) and a tiny Qwen3ForCausalLM (tie_word_embeddings=True),
every parameter random bf16 (norms included), are saved twice: save_pretrained (the
consolidated reference) and as rank shards (shardgen's independent writer of the DCP HF
layout: row/column grids over 4 ranks, 2 files, replicated 1-D tensors) with config.json and
generation_config.json beside them. From both, ckptfs_load.from_pretrained must give the model
transformers.AutoModelForCausalLM.from_pretrained(reference, dtype="auto") gives:
  - every state_dict tensor bit for bit, with its dtype;
  - every buffer (named_buffers, non-persistent ones such as RoPE's inv_freq included);
  - tied parameters share storage exactly where transformers' do;
  - eval() mode, config dtype, the generation config;
  - the logits of one forward pass, bit for bit.
Also: an f32 checkpoint into dtype=bfloat16 (converted as transformers converts), load_into into
a tied model (the tied copy is skipped, not missing), and clear LoadErrors for a shape mismatch
and a missing tensor (strict=False: missing tensors initialised as transformers does).
"""

from __future__ import annotations

import copy
import os
import pathlib
import shutil
import sys

import pytest

from conftest import BIN, ROOT
from shardgen import TensorSpec, write_checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

os.environ.setdefault("CKPTFS_LOAD_LIB", str(pathlib.Path(BIN).parent / "libckptfs_load.so"))
sys.path.insert(0, str(ROOT / "python"))
import ckptfs_load  # noqa: E402

transformers.utils.logging.set_verbosity_error()
SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
IDS = torch.tensor([[1, 5, 17, 42, 99, 128, 200, 3]])


def raw(t) -> bytes:
    t = t.detach().cpu().contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def save_shards(sd: dict, d: pathlib.Path, world: int = 4, skip=()):
    """sd as rank shards: 2-D tensors alternately row- and column-split over the ranks."""
    specs = []
    for i, (name, t) in enumerate(sd.items()):
        if name in skip:
            continue
        t = t.detach().contiguous()
        arr = t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()
        grid = (((world, 1) if i % 2 else (1, world)) if t.dim() == 2 else ())
        specs.append(TensorSpec(name, "BF16" if t.dtype == torch.bfloat16 else "F32",
                                tuple(t.shape), grid, 1 + i % 2, array=arr,
                                replicate=t.dim() < 2))
    write_checkpoint(str(d), specs, world=world, files=2)


def make(root: pathlib.Path, cfg, seed: int, dtype=torch.bfloat16):
    """A random model of cfg saved as root/ref (save_pretrained) and root/shards."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape) * 0.5)
    model.save_pretrained(str(root / "ref"))
    # As save_pretrained and torch's DCP HF writer: a tied head is stored once.
    sd = {k: v for k, v in model.state_dict().items()
          if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    save_shards(sd, root / "shards")
    for side in ("config.json", "generation_config.json"):
        shutil.copyfile(root / "ref" / side, root / "shards" / side)
    return root


def models():
    return {
        "llama": transformers.LlamaConfig(**SMALL, tie_word_embeddings=False),
        "qwen3_tied": transformers.Qwen3Config(**SMALL, head_dim=16, tie_word_embeddings=True),
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipe")
    return {name: make(root / name, cfg, seed=i) for i, (name, cfg) in enumerate(models().items())}


def tied_groups(model) -> set:
    """Names of the state_dict grouped by the storage they share (groups of 2 or more)."""
    by_ptr = {}
    for k, v in model.state_dict(keep_vars=True).items():
        by_ptr.setdefault(v.data_ptr(), []).append(k)
    return {tuple(sorted(v)) for v in by_ptr.values() if len(v) > 1}


def assert_same_model(ours, ref):
    assert type(ours) is type(ref)
    a, b = ours.state_dict(), ref.state_dict()
    assert list(a) == list(b)
    for k in b:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert raw(a[k]) == raw(b[k]), k
    ba, bb = dict(ours.named_buffers(remove_duplicate=False)), dict(ref.named_buffers(remove_duplicate=False))
    assert list(ba) == list(bb) and bb, "the models have different buffers"
    for k in bb:
        assert ba[k].dtype == bb[k].dtype and raw(ba[k]) == raw(bb[k]), k
    assert tied_groups(ours) == tied_groups(ref)
    assert not ours.training and not any(m.training for m in ours.modules())
    assert ours.config.dtype == ref.config.dtype
    assert ours.generation_config.to_dict() == ref.generation_config.to_dict()
    assert [p.requires_grad for p in ours.parameters()] == [p.requires_grad for p in ref.parameters()]
    with torch.no_grad():
        la, lb = ours(IDS).logits, ref(IDS).logits
    assert torch.isfinite(lb).all() and raw(la) == raw(lb)


@pytest.mark.parametrize("name", ["llama", "qwen3_tied"])
def test_recipe_equals_from_pretrained(saved, name):
    root = saved[name]
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(root / "ref"), dtype="auto")
    for src in ("shards", "ref"):
        ours = ckptfs_load.from_pretrained(root / src, threads=1, chunk_mb=1)
        assert_same_model(ours, ref)
    if name == "qwen3_tied":
        assert ours.lm_head.weight is ours.model.embed_tokens.weight
        assert tied_groups(ref) == {("lm_head.weight", "model.embed_tokens.weight")}
    else:
        assert tied_groups(ref) == set()
        assert any(k.endswith("rotary_emb.inv_freq") for k, _ in ours.named_buffers())


def test_recipe_options(saved, tmp_path):
    """config= a path, model_cls, dtype given; an f32 checkpoint into a bf16 model."""
    root = saved["llama"]
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(root / "ref"), dtype="auto")
    cfg_dir = tmp_path / "cfg"
    cfg_dir.mkdir()
    shutil.copyfile(root / "ref" / "config.json", cfg_dir / "config.json")
    shards = tmp_path / "bare"  # shards without config.json: config= is needed
    shutil.copytree(root / "shards", shards)
    (shards / "config.json").unlink()
    (shards / "generation_config.json").unlink()
    with pytest.raises(ckptfs_load.LoadError, match="no config.json"):
        ckptfs_load.from_pretrained(shards)
    ours = ckptfs_load.from_pretrained(shards, model_cls=transformers.LlamaForCausalLM,
                                       config=cfg_dir / "config.json", dtype=torch.bfloat16)
    sd = ours.state_dict()
    assert all(raw(v) == raw(ref.state_dict()[k]) for k, v in sd.items())
    assert raw(ours.model.rotary_emb.inv_freq) == raw(ref.model.rotary_emb.inv_freq)
    # f32 stored, bf16 asked for: converted exactly as from_pretrained(dtype=bfloat16) does.
    f32 = tmp_path / "f32"
    save_shards({k: v.float() for k, v in ref.state_dict().items()}, f32)
    ref32 = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(ref.config),
                                                           dtype=torch.float32)
    ref32.load_state_dict({k: v.float() for k, v in ref.state_dict().items()})
    ref32.save_pretrained(str(tmp_path / "f32ref"))
    want = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "f32ref"),
                                                              dtype=torch.bfloat16)
    got = ckptfs_load.from_pretrained(f32, config=ref.config, dtype="bfloat16")
    for k, v in want.state_dict().items():
        assert got.state_dict()[k].dtype == torch.bfloat16 and raw(got.state_dict()[k]) == raw(v), k
    assert ref.config.dtype == torch.bfloat16
    got = ckptfs_load.from_pretrained(f32, config=ref.config)  # auto: config.dtype (bf16)
    assert all(p.dtype == torch.bfloat16 for p in got.parameters())
    assert ref.config.dtype == torch.bfloat16  # the caller's config is not changed


def test_load_into_tied_model(saved):
    root = saved["qwen3_tied"]
    cfg = transformers.AutoConfig.from_pretrained(str(root / "ref"))
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    missing, unexpected = ckptfs_load.load_into(model, root / "shards")
    assert missing == [] and unexpected == []
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(root / "ref"), dtype="auto")
    assert raw(model.lm_head.weight) == raw(ref.lm_head.weight)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_refusals(saved, tmp_path):
    root = saved["llama"]
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(root / "ref"), dtype="auto")
    # The model does not fit the checkpoint: the tensor and both shapes are named.
    cfg = transformers.AutoConfig.from_pretrained(str(root / "ref"))
    cfg.intermediate_size = 96
    with pytest.raises(ckptfs_load.LoadError) as e:
        ckptfs_load.from_pretrained(root / "shards", config=cfg)
    msg = str(e.value)
    assert "model.layers.0.mlp.gate_proj.weight" in msg and "(96, 64)" in msg and "(128, 64)" in msg
    # A tensor missing from the checkpoint: named; strict=False initialises it as
    # transformers does (an RMSNorm weight: ones).
    gone = tmp_path / "gone"
    save_shards(ref.state_dict(), gone, skip={"model.norm.weight"})
    with pytest.raises(ckptfs_load.LoadError, match=r"missing from the checkpoint: \['model.norm.weight'\]"):
        ckptfs_load.from_pretrained(gone, config=ref.config)
    m = ckptfs_load.from_pretrained(gone, config=ref.config, strict=False)
    assert torch.equal(m.model.norm.weight, torch.ones(64, dtype=torch.bfloat16))
    assert raw(m.model.embed_tokens.weight) == raw(ref.model.embed_tokens.weight)
    assert raw(m.model.rotary_emb.inv_freq) == raw(ref.model.rotary_emb.inv_freq)
