"""Model maps, issue 33: torchtitan 0.3.0's other model families under HF names.

One writer run (writers/titan_family_save.py, module-scoped) saves five tiny models with
torchtitan's own CheckpointManager (dcp.save, FSDP2 over 2 gloo ranks): DeepSeek V3 (bf16, MLA
with q_lora, dense + MoE layers, shared experts, the router's correction bias) and Qwen 3.5
(dense: GatedDeltaNet + gated attention + vision tower; and MoE) start from transformers
models through the adapter's from_hf; Kimi K2.5 (DeepSeek text tower + MoonViT) and gpt-oss
start from random torchtitan weights. For each:
  * exactly one built-in map detects it from the stored names (read with torch's DCP reader);
  * map_ref (docs/maps.md in Python) applied to the stored tensors reproduces the adapter's own
    to_hf bit for bit (names, dtypes, shapes, bytes), and the HF checkpoint it started from;
    Qwen 3.5 MoE's routed experts are served per expert, as transformers 5.23 saves and loads
    them (to_hf's fused, transposed gate_up_proj is refused by transformers 5.23's loader: shown
    here), equal to to_hf's tensors transposed back; gpt-oss's experts, which torchtitan 0.3.0's
    to_hf drops (shown here), are served as HF's GptOssExperts holds them (`transpose`: the last
    two axes swapped), checked by running torchtitan's own GptOssGroupedExperts on the stored
    tensors against HF's GptOssExperts as loaded through the mount;
  * a config.json that disagrees with the stored shapes is refused naming the tensor (map_ref,
    and `ckptfs inspect --map` on the C++ side);
  * one mount of all five (Qwen 3.5 MoE gets its config.json from `-o hf_config=`): each step
    directory serves to_hf's tensors exactly, and `from_pretrained` on it gives the original
    transformers model's state dict bit for bit (Kimi, gpt-oss: the same as from_pretrained of the
    expected tensors written to a plain directory).
Skipped (never faked) without torchtitan or transformers, the Qwen 3.5 cases without
flash-linear-attention (fla-core: torchtitan's Qwen 3.5 model code imports it), the mount tests
without FUSE.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

import map_ref
from conftest import BIN, Mount, have, requires_fuse
from test_maps_torchtitan import STEP, assert_same, load, read_dcp, same_bits, served

torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.skipif(not have("torchtitan.components.checkpointer"),
                                reason="torchtitan 0.3.0 not installed")
QWEN_OK = have("fla")  # torchtitan's Qwen 3.5 model code imports flash-linear-attention (fla-core)

WRITERS = pathlib.Path(__file__).parent / "writers"
# writer's model name -> (built-in map, dtype, from_pretrained's reference: "original", "to_hf" or None)
MODELS = {
    "deepseek-v3": ("torchtitan-deepseek-v3", torch.bfloat16, "original"),
    "kimi-k2.7": ("torchtitan-kimi-k2.7", torch.float32, "to_hf"),
    "qwen3.5": ("torchtitan-qwen3.5", torch.float32, "original"),
    "qwen3.5-moe": ("torchtitan-qwen3.5", torch.float32, "original"),
    "gpt-oss": ("torchtitan-gpt-oss", torch.float32, "expected"),
}
WRITTEN = [n for n in MODELS if QWEN_OK or not n.startswith("qwen3.5")]


def params(names):
    return [pytest.param(n, marks=pytest.mark.skipif(n not in WRITTEN, reason="fla-core not installed"))
            for n in names]


SERVED = list(MODELS)
NO_STEP_CONFIG = "qwen3.5-moe"  # its step directory has no config.json: the mount's hf_config gives it
AUTO = {"kimi-k2.7": "AutoModelForImageTextToText", "qwen3.5": "AutoModelForImageTextToText",
        "qwen3.5-moe": "AutoModelForImageTextToText", "deepseek-v3": "AutoModelForCausalLM",
        "gpt-oss": "AutoModelForCausalLM"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    src = tmp_path_factory.mktemp("titan-families") / "src"
    src.mkdir()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, str(WRITERS / "titan_family_save.py"), str(src), "--models", ",".join(WRITTEN)],
                       capture_output=True, text=True, timeout=400, env=env, cwd=str(src))
    assert r.returncode == 0, f"titan_family_save: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    files = json.loads(r.stdout.strip().splitlines()[-1])
    for name in WRITTEN:
        step = f"{name}/{STEP}"
        assert f"{step}/.metadata" in files and f"{step}/__1_0.distcp" in files, files
        assert (f"{step}/config.json" in files) == (name != NO_STEP_CONFIG), files
    return src


@pytest.fixture(scope="module")
def stored(saved):
    """Each model's stored tensors, read back with torch's own DCP reader."""
    out = {}
    for name in WRITTEN:
        out[name] = read_dcp(saved / name / STEP)
        assert_same(out[name], load(saved / name / "stored.safetensors"), f"{name}: DCP vs the model's state dict")
    return out


def config(saved, name) -> dict:
    return json.loads((saved / name / "config.json").read_text())


def experts_per_expert(to_hf: dict) -> dict:
    """Qwen 3.5 MoE: to_hf's fused gate_up_proj [E, D, 2F] and down_proj [E, F, D] (transposed) as
    transformers 5.23 saves them: one [F, D] gate_proj / up_proj and [D, F] down_proj per expert."""
    out = {}
    for k, v in to_hf.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            p = k[: -len("gate_up_proj")]
            gate, up = v.transpose(-2, -1).chunk(2, dim=1)
            for e in range(v.shape[0]):
                out[f"{p}{e}.gate_proj.weight"] = gate[e].contiguous()
                out[f"{p}{e}.up_proj.weight"] = up[e].contiguous()
        elif k.endswith("mlp.experts.down_proj"):
            p = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                out[f"{p}{e}.down_proj.weight"] = v[e].transpose(0, 1).contiguous()
        else:
            out[k] = v
    return out


GPT_OSS_EXPERTS = {"mlp1_weight_EGD": "gate_up_proj", "mlp1_bias_EG": "gate_up_proj_bias",
                   "mlp2_weight_EDF": "down_proj", "mlp2_bias_ED": "down_proj_bias"}


def gpt_oss_experts(saved) -> dict:
    """gpt-oss's experts as HF's GptOssExperts holds them, from the stored tensors (torchtitan's
    to_hf drops them): weights [E, in, out] (torchtitan's are [E, out, in]), biases as stored."""
    stored = load(saved / "gpt-oss" / "stored.safetensors")
    out = {}
    for k, v in stored.items():
        p, _, leaf = k.rpartition(".")
        if leaf in GPT_OSS_EXPERTS:
            layer = p.split(".")[1]
            out[f"model.layers.{layer}.mlp.experts.{GPT_OSS_EXPERTS[leaf]}"] = \
                (v.transpose(-2, -1) if "weight" in leaf else v).contiguous()
    return out


def expected(saved, name) -> dict:
    """What the view must serve: to_hf's output (Qwen 3.5 MoE: its experts per expert; gpt-oss: with
    its experts)."""
    want = load(saved / name / "to_hf.safetensors")
    if name == "gpt-oss":
        return {**want, **gpt_oss_experts(saved)}
    return experts_per_expert(want) if name == "qwen3.5-moe" else want


# --- detection and the maps, in Python (map_ref) -------------------------------------------------

@pytest.mark.parametrize("name", params(MODELS))
def test_exactly_one_builtin_detects_each_family(stored, name):
    hits = [m["name"] for m in map_ref.builtin_maps() if map_ref.detect(m, stored[name])]
    assert hits == [MODELS[name][0]], hits
    assert map_ref.choose(map_ref.builtin_maps(), stored[name])["name"] == MODELS[name][0]


@pytest.mark.parametrize("name", params(SERVED))
def test_map_ref_reproduces_to_hf(saved, stored, name):
    m = map_ref.choose(map_ref.builtin_maps(), stored[name])
    hf, sources = map_ref.apply(m, stored[name], config(saved, name))
    assert_same(hf, expected(saved, name), f"{name}: map vs torchtitan's to_hf")
    if MODELS[name][2] == "original":  # the HF checkpoint the model started from, as transformers saved it
        ck = load(saved / name / "hf" / "model.safetensors")
        mtp = sorted(k for k in hf if k not in ck)  # DeepSeek's MTP layer: HF's model has none
        assert all(k.startswith("model.layers.2.") for k in mtp) and (name != "deepseek-v3") == (not mtp), mtp
        assert_same({k: v for k, v in hf.items() if k in ck}, ck, f"{name}: map vs the HF checkpoint")
    if name == "deepseek-v3":
        assert sources["model.layers.2.shared_head.norm.weight"][0][0] == "mtp_layers.0.mtp_norm.weight"
        assert sources["model.layers.2.mlp.experts.3.down_proj.weight"][0][0] == \
            "mtp_layers.0.moe.routed_experts.inner_experts.w2_EDF"
        assert sources["model.layers.0.self_attn.q_a_proj.weight"][0][0] == "layers.0.attention.wq_a.weight"
        assert sources["model.layers.1.mlp.gate.e_score_correction_bias"][0][0] == "layers.1.moe.expert_bias_E"
        # torchtitan keeps it in fp32; a model-only save casts it to export_dtype, as every tensor
        assert hf["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.bfloat16
    if name == "kimi-k2.7":
        assert list(hf["vision_tower.patch_embed.proj.weight"].shape) == [32, 3, 4, 4]
        assert [s for s, _ in sources["vision_tower.encoder.blocks.1.wqkv.bias"]] == \
            [f"vision_encoder.layers.1.attn.w{x}.bias" for x in "qkv"]
    if name == "qwen3.5":
        assert list(hf["model.visual.patch_embed.proj.weight"].shape) == [32, 3, 2, 4, 4]
        assert [s for s, _ in sources["model.language_model.layers.0.linear_attn.conv1d.weight"]] == \
            [f"layers.0.attn.conv_{x}.weight" for x in "qkv"]


@pytest.mark.skipif(not QWEN_OK, reason="fla-core not installed")
def test_qwen35_moe_to_hf_layout_is_refused_by_transformers(saved, tmp_path):
    """Why Qwen 3.5 MoE's experts are served per expert, not as to_hf writes them: transformers 5.23
    refuses to_hf's fused gate_up_proj [E, D, 2F] (its parameter is [E, 2F, D])."""
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "model.safetensors").symlink_to(saved / "qwen3.5-moe" / "to_hf.safetensors")
    (plain / "config.json").write_text((saved / "qwen3.5-moe" / "config.json").read_text())
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        transformers.AutoModelForImageTextToText.from_pretrained(str(plain), dtype=torch.float32)


def test_gpt_oss_to_hf_drops_the_experts_the_map_serves(saved, stored):
    """torchtitan 0.3.0's to_hf maps 'mlp1_weight', not the stored 'mlp1_weight_EGD': it drops every
    expert tensor. The reference is then to_hf plus the experts in HF's layout (gpt_oss_experts)."""
    want = load(saved / "gpt-oss" / "to_hf.safetensors")
    assert not any("experts" in k for k in want), sorted(want)
    experts = gpt_oss_experts(saved)
    assert len(experts) == 4 * 2 and list(experts["model.layers.0.mlp.experts.gate_up_proj"].shape) == [4, 64, 96]


def test_gpt_oss_experts_as_served_compute_what_torchtitans_compute(saved):
    """The transpose is the right one: HF's GptOssExperts holding the served layout gives, token
    for token, what torchtitan's own GptOssGroupedExperts computes from the stored tensors."""
    from torchtitan.models.gpt_oss.moe import GptOssGroupedExperts
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    stored = load(saved / "gpt-oss" / "stored.safetensors")
    prefix = "layers.1.moe.routed_experts.inner_experts."
    tt = GptOssGroupedExperts(GptOssGroupedExperts.Config(dim=64, hidden_dim=48, num_experts=4))
    tt.load_state_dict({k[len(prefix):]: v for k, v in stored.items() if k.startswith(prefix)})
    hf = GptOssExperts(transformers.GptOssConfig(**{k: v for k, v in config(saved, "gpt-oss").items()
                                                    if k in ("hidden_size", "intermediate_size", "num_local_experts")}))
    served = gpt_oss_experts(saved)
    hf.load_state_dict({k.rpartition(".")[2]: v for k, v in served.items() if k.startswith("model.layers.1.")})
    torch.manual_seed(0)
    x = torch.randn(7, 64)
    route = torch.tensor([0, 0, 1, 2, 3, 3, 3])  # tokens sorted by expert, as torchtitan takes them
    with torch.no_grad():
        want = tt(x, torch.bincount(route, minlength=4)).float()
        got = hf(x.bfloat16().float(), route[:, None], torch.ones(7, 1)).float()
    # torchtitan computes in bf16 (weights and activations): compare as a relative error.
    def rel(a):
        return float((a - want).norm() / want.norm())
    assert rel(got) < 1e-2, rel(got)
    # A layout that is not the transpose (the same bytes reshaped) computes something else.
    bad = {k: (v.reshape(v.shape[0], v.shape[2], v.shape[1]) if v.dim() == 3 else v) for k, v in stored.items()
           if k.startswith(prefix)}
    hf.load_state_dict({GPT_OSS_EXPERTS[k[len(prefix):]]: v for k, v in bad.items()})
    with torch.no_grad():
        wrong = hf(x.bfloat16().float(), route[:, None], torch.ones(7, 1)).float()
    assert rel(wrong) > 0.3, rel(wrong)


def test_gpt_oss_consolidate_writes_the_transposed_experts(saved, tmp_path):
    """`ckptfs consolidate` (its copy threads through io::gather's shared windows, not the FUSE
    path) writes the same experts in HF's layout, bit for bit."""
    dst = tmp_path / "out"
    r = subprocess.run([BIN, "consolidate", str(saved / "gpt-oss" / STEP), str(dst), "--threads", "3"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert_same(served(dst), expected(saved, "gpt-oss"), "gpt-oss: consolidate vs to_hf with its experts")


# A config.json value that disagrees with the stored shapes: (key path, value, the stored tensor
# the C++ side names, the HF tensor map_ref names).
WRONG = {
    "deepseek-v3": (("kv_lora_rank",), 24, "layers.0.attention.wkv_a.weight",
                    "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"),
    "kimi-k2.7": (("vision_config", "patch_size"), 3, "vision_encoder.patch_embed.weight",
                  "vision_tower.patch_embed.proj.weight"),
    "qwen3.5": (("text_config", "linear_num_value_heads"), 2, "layers.0.attn.in_proj_q.weight",
                "model.language_model.layers.0.linear_attn.in_proj_qkv.weight"),
    "qwen3.5-moe": (("text_config", "num_experts"), 3, "layers.0.moe.router.gate.weight",
                    "model.language_model.layers.0.mlp.gate.weight"),
    "gpt-oss": (("intermediate_size",), 40, "layers.0.moe.routed_experts.inner_experts.mlp1_weight_EGD",
                "model.layers.0.mlp.experts.gate_up_proj"),
}


def wrong_config(saved, name) -> dict:
    cfg = config(saved, name)
    path, value, _, _ = WRONG[name]
    d = cfg
    for k in path[:-1]:
        d = d[k]
    d[path[-1]] = value
    return cfg


@pytest.mark.parametrize("name", params(SERVED))
def test_a_wrong_config_is_refused_naming_the_tensor(saved, stored, name, tmp_path):
    _, _, tensor, hf_tensor = WRONG[name]
    m = map_ref.load(map_ref.MAPS / f"{MODELS[name][0]}.json")
    with pytest.raises(map_ref.MapError) as e:
        map_ref.apply(m, stored[name], wrong_config(saved, name))
    assert f"'{hf_tensor}'" in str(e.value), str(e.value)
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps(wrong_config(saved, name)))
    # The step directory's own config.json wins over --hf-config: check a copy without it.
    step = tmp_path / "step"
    step.mkdir()
    for f in (saved / name / STEP).iterdir():
        if f.name != "config.json":
            os.link(f, step / f.name)  # ckptfs does not follow a symlinked shard
    r = subprocess.run([BIN, "inspect", "--map", MODELS[name][0], "--hf-config", str(bad), str(step)],
                       capture_output=True, text=True, timeout=60)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and f"tensor '{tensor}'" in out, out[-3000:]


# --- through the mount ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mounted(saved, tmp_path_factory):
    mnt = tmp_path_factory.mktemp("titan-families-mnt") / "mnt"
    hf_config = saved / NO_STEP_CONFIG / "config.json"
    opts = [f"hf_config={hf_config}"] if hf_config.exists() else []
    with Mount(saved, mnt, opts=opts, log=str(mnt) + ".log") as m:
        yield m


def loaded_state(name, d) -> dict:
    model = getattr(transformers, AUTO[name]).from_pretrained(str(d), dtype=MODELS[name][1])
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    del model  # its mmap of the mount's file, before the unmount
    return sd


@requires_fuse
@pytest.mark.parametrize("name", params(SERVED))
def test_mount_serves_to_hf_and_from_pretrained_loads_it(saved, mounted, name, tmp_path):
    d = pathlib.Path(mounted.mnt) / name / STEP
    names = sorted(os.listdir(d))
    assert ".metadata" in names and "config.json" in names and "model.safetensors.index.json" in names, names
    assert json.loads((d / "config.json").read_text()) == config(saved, name)
    want = expected(saved, name)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(want), \
        f"{name}: index: only served {sorted(set(index['weight_map']) - set(want))}, " \
        f"only expected {sorted(set(want) - set(index['weight_map']))}"
    assert_same(served(d), want, f"{name}: the mount vs torchtitan's to_hf")

    got = loaded_state(name, d)
    if MODELS[name][2] == "original":
        # transformers fuses experts at load (and casts DeepSeek's fp32 correction bias to the
        # model's dtype): the original model loaded from its own checkpoint is the reference.
        ref = loaded_state(name, saved / name / "hf")
        assert_same(got, ref, f"{name}: from_pretrained(mount) vs from_pretrained(the HF checkpoint)")
        # and the original model's own tensors, bit for bit (transformers keeps DeepSeek's
        # e_score_correction_bias in fp32 at load: the same values, in another dtype). Experts it
        # fuses at load are not under their original names: the comparison with ref covers them.
        orig = load(saved / name / "original.safetensors")
        common = [k for k in orig if k in got]
        bad = [k for k in common if not same_bits(got[k].to(orig[k].dtype), orig[k])]
        assert not bad and len(common) >= len(orig) // 2, (bad, len(common), len(orig))
    else:  # Kimi: to_hf's output (gpt-oss: with its experts) written to a plain directory
        plain = tmp_path / "plain"
        plain.mkdir()
        if name == "gpt-oss":
            st_torch.save_file(want, str(plain / "model.safetensors"))
        else:
            (plain / "model.safetensors").symlink_to(saved / name / "to_hf.safetensors")
        (plain / "config.json").write_text((saved / name / "config.json").read_text())
        ref = loaded_state(name, plain)
        assert_same(got, ref, f"{name}: from_pretrained(mount) vs from_pretrained(to_hf)")
    assert mounted.proc.poll() is None
