"""The native formats' trust model, verl and model maps (issue 32), through a real mount: genuine
files, surgically corrupted, as a red team made them.

  * verl with a world of hard links to one rank file: refused from the listing at once, naming
    both files, before any rank is parsed; the daemon stays small; other directories answer.
  * the built-in Megatron map over a config of 2^24 query groups (a 128 MiB store): the mount
    answers, the directory is served within a hang guard, and the daemon's peak memory does not
    grow with the 2^24 rows.
  * verl state-dict keys that cannot name a tensor (`__metadata__`, invalid UTF-8): refused,
    naming the file and the tensor; listing again gives the same.

Every file is written by torch itself (torch.save of DTensors on a 1-rank gloo mesh, as verl's
FSDPCheckpointManager saves them; dcp.save, as megatron-core's torch_dist backend), in one
subprocess per module; the edits are byte-for-byte. Nothing touches the mount from the pytest
process: a hostile_util.Prober does, with a timeout (a hang guard, not a timing).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from conftest import requires_fuse
from hostile_util import INDEX, Prober, cli, mounts, prober  # noqa: F401  (fixtures)

pytest.importorskip("torch")
pytestmark = requires_fuse

ASAN = os.environ.get("CKPTFS_ASAN") == "1"  # RSS is meaningless under ASan: not checked

GROUPS = 1 << 24  # the Megatron config's query groups (and heads): one row each
WIDE_TENSORS = 512  # the verl rank file every rank links to
LINKS = 1024

# Runs in a subprocess (torch.distributed is initialised there, never in pytest's process).
_WRITER = r'''
import json, os, sys, tempfile
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

out, groups, wide = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))

def verl(d, sd):
    # verl's layout for a world of 1: torch.save({key: DTensor}) and fsdp_config.json.
    os.makedirs(d)
    torch.save({k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in sd.items()},
               os.path.join(d, "model_world_size_1_rank_0.pt"))
    with open(os.path.join(d, "fsdp_config.json"), "w") as f:
        json.dump({"FSDP_version": 2, "world_size": 1}, f)

g = torch.Generator().manual_seed(0)
verl(os.path.join(out, "wide"),
     {f"model.layers.{i // 8}.t{i % 8}.weight": torch.randn(16, generator=g) for i in range(wide)})
norm = torch.randn(8, generator=g)
verl(os.path.join(out, "verl-metadata"), {"model.norm.weight": norm, "__metadata__": norm * 2})
# "\u00e9" is two bytes (c3 a9) in the pickle: the test makes them ff fe, invalid UTF-8.
verl(os.path.join(out, "verl-utf8"), {"model.norm.weight": norm, "model.\u00e9.weight": norm * 2})

# Megatron-Core GPT's torch_dist keys, as the built-in map megatron-gpt detects them: 2 stacked
# layers, `groups` query groups of one row each (head_dim 1, hidden 1), uint8.
d = os.path.join(out, "megatron")
u8 = torch.uint8
sd = {
    "embedding.word_embeddings.weight": torch.zeros(1, 1, dtype=u8),
    "decoder.layers.self_attention.linear_qkv.layer_norm_weight": torch.zeros(2, 1, dtype=u8),
    "decoder.layers.self_attention.linear_qkv.weight":
        torch.arange(3 * groups, dtype=torch.int64).to(u8).repeat(2).reshape(2, 3 * groups, 1),
    "decoder.layers.self_attention.linear_proj.weight": torch.zeros(2, 1, groups, dtype=u8),
    "decoder.layers.mlp.linear_fc1.layer_norm_weight": torch.zeros(2, 1, dtype=u8),
    "decoder.layers.mlp.linear_fc1.weight": torch.zeros(2, 2, 1, dtype=u8),
    "decoder.layers.mlp.linear_fc2.weight": torch.zeros(2, 1, 1, dtype=u8),
    "decoder.final_layernorm.weight": torch.zeros(1, dtype=u8),
    "output_layer.weight": torch.zeros(1, 1, dtype=u8),
}
dcp.save(sd, checkpoint_id=d)
with open(os.path.join(d, "metadata.json"), "w") as f:
    json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1}, f)
with open(os.path.join(d, "config.json"), "w") as f:
    json.dump({"hidden_size": 1, "num_attention_heads": groups, "num_key_value_heads": groups,
               "head_dim": 1, "intermediate_size": 1, "vocab_size": 1, "num_hidden_layers": 2,
               "tie_word_embeddings": False}, f)
dist.destroy_process_group()
'''


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    out = tmp_path_factory.mktemp("trust-verl-maps")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-c", _WRITER, str(out), str(GROUPS), str(WIDE_TENSORS)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, f"writer: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return out


def peak_kb(pid: int) -> int:
    """The daemon's peak resident set (VmHWM), in KiB."""
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def consolidated(names) -> list[str]:
    return [n for n in names if n == INDEX or (n.startswith("model") and n.endswith(".safetensors"))]


def plain_dir(src: pathlib.Path) -> pathlib.Path:
    """A directory that is no checkpoint, to show the rest of the mount answers."""
    d = src / "plain"
    d.mkdir()
    (d / "notes.txt").write_text("hello\n")
    return d


def test_a_world_of_hard_links_is_refused_from_the_listing(made, tmp_path, mounts, prober):
    """1024 hard links of one rank file (512 tensors) as model_world_size_1024_rank_R.pt: the
    directory shows nothing consolidated, the reason names rank 1's file and rank 0's, no rank
    is parsed (the daemon's peak memory does not grow with the links: it read and kept every
    rank's state dict), and the mount's other directories answer."""
    src = tmp_path / "src"
    d = src / "global_step_1" / "actor"
    d.mkdir(parents=True)
    rank0 = made / "wide" / "model_world_size_1_rank_0.pt"
    for r in range(LINKS):
        os.link(rank0, d / f"model_world_size_{LINKS}_rank_{r}.pt")
    (d / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": LINKS}))
    plain_dir(src)
    m = mounts(src)
    base = peak_kb(m.pid)
    md = pathlib.Path(m.mnt)
    for _ in range(2):
        names = prober.listdir(md / "global_step_1" / "actor", timeout=60)
        assert not consolidated(names), names
        assert f"model_world_size_{LINKS}_rank_{LINKS - 1}.pt" in names
    assert prober.read(md / "plain" / "notes.txt", timeout=20) == b"hello\n"
    assert m.alive()
    if not ASAN:
        grown = (peak_kb(m.pid) - base) / 1024
        assert grown < 64, f"the daemon's peak memory grew {grown:.0f} MiB over {LINKS} links"
    r = cli("inspect", d, timeout=120)
    assert not r.timed_out, r
    assert (f"model_world_size_{LINKS}_rank_1.pt: the same file as "
            f"model_world_size_{LINKS}_rank_0.pt") in r.out, r
    assert "hard links" in r.out and "more problem" in r.out, r
    log = m.read_log()
    assert f"model_world_size_{LINKS}_rank_1.pt" in log and "the same file as" in log, m.log_tail(30)


def test_a_megatron_config_of_millions_of_query_groups(made, tmp_path, mounts, prober):
    """The built-in map megatron-gpt over 2 layers of 2^24 query groups (a 128 MiB store): the
    mount answers while the view is built, the directory is served within a hang guard (each of
    q, k and v is one strided run of the fused QKV), the bytes are the stored ones, and the
    daemon's peak memory does not grow with the rows (a 24-byte tuple per row, sorted: 400 MB)."""
    src = tmp_path / "src"
    ck = src / "iter_0000001"
    ck.mkdir(parents=True)
    for f in (made / "megatron").iterdir():  # .metadata, __0_0.distcp, metadata.json, config.json
        os.link(f, ck / f.name)
    plain_dir(src)
    m = mounts(src)
    base = peak_kb(m.pid)
    md = pathlib.Path(m.mnt)
    other = Prober()
    try:
        prober.submit("listdir", md / "iter_0000001")  # the daemon builds the view meanwhile
        assert other.listdir(md / "plain", timeout=60) == ["notes.txt"]
        names = prober.result(timeout=120)
        assert "model-00001-of-00001.safetensors" in names and INDEX in names, names
        index = json.loads(prober.read(md / "iter_0000001" / INDEX, timeout=60))
        assert "model.layers.1.self_attn.v_proj.weight" in index["weight_map"], index
        if not ASAN:
            grown = (peak_kb(m.pid) - base) / 1024
            assert grown < 128, f"the daemon's peak memory grew {grown:.0f} MiB building the view"
        # The header, and the first rows of layer 0's q_proj: rows 0, 3, 6, ... of the fused QKV.
        fd = prober.call("open", md / "iter_0000001" / "model-00001-of-00001.safetensors",
                         os.O_RDONLY, timeout=60)
        n = int.from_bytes(prober.call("pread", fd, 8, 0, timeout=60), "little")
        header = json.loads(prober.call("pread", fd, n, 8, timeout=60))
        q = header["model.layers.0.self_attn.q_proj.weight"]
        assert q["dtype"] == "U8" and q["shape"] == [GROUPS, 1], q
        rows = prober.call("pread", fd, 16, 8 + n + q["data_offsets"][0], timeout=60)
        assert rows == bytes((3 * i) % 256 for i in range(16)), rows
        prober.call("close", fd, timeout=60)
    finally:
        other.close()
    assert m.alive()


@pytest.mark.parametrize("case", ["__metadata__", "invalid-utf8"])
def test_verl_keys_that_cannot_name_a_tensor(made, tmp_path, mounts, prober, case):
    """A verl rank file whose state dict holds a key `__metadata__` (the safetensors header's own
    field) or a key that is not UTF-8 (the header is JSON): refused, naming the file and the
    tensor; listed twice, the directory shows the same, and the daemon lives."""
    src = tmp_path / "src"
    d = src / "actor"
    d.parent.mkdir()
    name = "model_world_size_1_rank_0.pt"
    if case == "__metadata__":
        shutil.copytree(made / "verl-metadata", d)
        says, shown = "a tensor named '__metadata__'", "__metadata__"
    else:
        shutil.copytree(made / "verl-utf8", d)
        data = (d / name).read_bytes()
        key = "model.\u00e9.weight".encode()
        assert data.count(key) == 1, "the key is pickled once (a stored zip member)"
        (d / name).write_bytes(data.replace(key, b"model.\xff\xfe.weight"))
        says, shown = "not valid UTF-8", "model.\\xff\\xfe.weight"
    plain_dir(src)
    m = mounts(src)
    md = pathlib.Path(m.mnt)
    for _ in range(2):
        names = prober.listdir(md / "actor", timeout=60)
        assert not consolidated(names), names
        assert name in names and "fsdp_config.json" in names, names
    assert prober.read(md / "plain" / "notes.txt", timeout=20) == b"hello\n"
    assert m.alive()
    r = cli("inspect", d, timeout=60)
    assert not r.timed_out and r.rc != 0, r
    assert name in r.out and says in r.out and shown in r.out, r
    log = m.read_log()
    assert name in log and says in log, m.log_tail(30)
