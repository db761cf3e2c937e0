"""The loader (issue 12) through its Python binding (ctypes over libckptfs_load.so) and the CLI.

CPU destination mode, no mount, no GPU needed:
  - every layout of the mount tests' corpus (test_mount.LAYOUTS), loaded into torch tensors,
    equals byte for byte both the generator's own arrays and the consolidated copy that
    `ckptfs consolidate` writes (read with shardgen's independent reader); the consolidated
    copy itself loads to the same bytes, and safetensors.safe_open agrees on one layout;
  - row slices, unknown names, wrong sizes and a broken checkpoint are refused clearly;
  - load_into fills a small transformers LlamaForCausalLM (bf16, and f32 into a bf16 model:
    converted) stored as rank shards; its parameters equal the model saved;
  - `ckptfs load --bench --json`: fields, checksums equal between shards and consolidated;
    `--device cuda:0` without a GPU fails clearly.
GPU tests skip, saying why, when torch.cuda.is_available() is false.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from conftest import BIN, ROOT
from shardgen import TensorSpec, tensor_bytes, write_checkpoint
from test_mount import LAYOUTS

torch = pytest.importorskip("torch")

LIB = os.environ.get("CKPTFS_LOAD_LIB", str(pathlib.Path(BIN).parent / "libckptfs_load.so"))
os.environ["CKPTFS_LOAD_LIB"] = LIB
sys.path.insert(0, str(ROOT / "python"))
import ckptfs_load  # noqa: E402

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(),
                               reason="no CUDA device (torch.cuda.is_available() is false): "
                                      "GPU loading is not tested here")


def raw(t) -> bytes:
    """The bytes of a tensor as stored (any dtype, 0-d and empty included)."""
    t = t.detach().cpu().contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def consolidated_bytes(d: pathlib.Path) -> dict:
    out = {}
    for f in sorted(d.glob("model*.safetensors")):
        out.update(tensor_bytes(str(f)))
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("load")
    cks = {}
    for lid, (_, writer) in LAYOUTS.items():
        d = root / lid
        ck = writer(str(d))
        cons = root / (lid + ".cons")
        subprocess.run([BIN, "consolidate", str(d), str(cons)], check=True, capture_output=True)
        cks[lid] = (d, cons, ck)
    return cks


@pytest.mark.parametrize("lid", list(LAYOUTS))
def test_every_layout_exact(corpus, lid):
    d, cons, ck = corpus[lid]
    truth = ck.truth()
    view = consolidated_bytes(cons)
    assert set(view) == set(truth)
    for src in (d, cons):
        # 1 thread with 1 MiB chunks in a ring of 2, and the defaults.
        for opts in ({"threads": 1, "chunk_mb": 1, "ring": 2}, {}):
            sd = ckptfs_load.load_state_dict(src, **opts)
            assert set(sd) == set(truth), src
            for name, (dt, shape, data) in truth.items():
                t = sd[name]
                assert raw(t) == data, (src, name)
                assert raw(t) == view[name][2], (src, name)
                if t.dtype != torch.uint8 or dt in ("U8", "BOOL"):
                    assert list(t.shape) == list(shape), name


def test_safe_open_agrees(corpus):
    safetensors = pytest.importorskip("safetensors")
    d, cons, _ = corpus["fsdp_row"]
    sd = ckptfs_load.load_state_dict(d)
    n = 0
    for f in sorted(cons.glob("model*.safetensors")):
        with safetensors.safe_open(str(f), framework="pt") as g:
            for k in g.keys():
                ref = g.get_tensor(k)
                # Random bits: NaNs among them, so bytes, not torch.equal.
                assert sd[k].dtype == ref.dtype and raw(sd[k]) == raw(ref), k
                n += 1
    assert n == len(sd)


def test_rows_checksums_and_errors(corpus, tmp_path):
    d, _, ck = corpus["tp_col_world8"]
    truth = ck.truth()
    name = "model.layers.0.mlp.down_proj.weight"  # column-sharded over 8 ranks
    dt, shape, data = truth[name]
    row = len(data) // shape[0]
    with ckptfs_load.Checkpoint(d) as c:
        buf = torch.empty(10 * row, dtype=torch.uint8)
        st = c.load([(name, buf.data_ptr(), 10 * row, (5, 15))], chunk_mb=1, checksum=True)
        assert raw(buf) == data[5 * row:15 * row]
        assert st.bytes == 10 * row and len(st.checksums) == 1
        with pytest.raises(ckptfs_load.LoadError, match="'no.such'"):
            c.load([("no.such", buf.data_ptr(), 4)])
        with pytest.raises(ckptfs_load.LoadError, match=r"'%s': the request has 3 bytes" % name):
            c.load([(name, buf.data_ptr(), 3)])
        with pytest.raises(ckptfs_load.LoadError, match=r"rows \[5, 99999\)"):
            c.load([(name, buf.data_ptr(), 10 * row, (5, 99999))])
    # A broken checkpoint (a shard cut short) is refused, naming the shard; never zeros.
    bad = tmp_path / "bad"
    write_checkpoint(str(bad), [TensorSpec("w", "F32", (8, 4), (2, 1))], world=2, seed=3)
    victim = sorted(bad.glob("shard-*"))[1]
    os.truncate(victim, victim.stat().st_size - 4)
    with pytest.raises(ckptfs_load.LoadError, match=victim.name) as e:
        ckptfs_load.load_state_dict(bad)
    assert "not a complete, valid checkpoint" in str(e.value)


def _tiny_llama(dtype):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(dtype), cfg


def _save_as_shards(model, d, world=4, bf16=True):
    specs = []
    for i, (name, p) in enumerate(model.state_dict().items()):
        t = p.detach().contiguous()
        arr = t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()
        grid = ((world,) + (1,) * (t.dim() - 1)) if t.dim() == 2 and i % 2 else \
            ((1, world) if t.dim() == 2 else ())
        specs.append(TensorSpec(name, "BF16" if t.dtype == torch.bfloat16 else "F32",
                                tuple(t.shape), grid, 1 + i % 2, array=arr,
                                replicate=t.dim() < 2))
    write_checkpoint(str(d), specs, world=world, files=2)


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float32], ids=["bf16", "f32_into_bf16"])
def test_load_into_transformers_model(tmp_path, stored):
    src, cfg = _tiny_llama(stored)
    _save_as_shards(src, tmp_path / "ck")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(1)
    dst = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    missing, unexpected = ckptfs_load.load_into(dst, tmp_path / "ck")
    assert missing == [] and unexpected == []
    ref = src.state_dict()
    for k, v in dst.state_dict().items():
        assert torch.equal(v, ref[k].to(torch.bfloat16)), k


def test_transformers_style_loader(tmp_path):
    """The loader of docs/loader.md, as written there (device cpu): logits equal."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(2)
    src = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    _save_as_shards(src, tmp_path / "ck")
    cfg.save_pretrained(str(tmp_path / "ck"))

    def from_shards(ckpt_dir, config_dir, device="cuda:0", dtype=torch.bfloat16):
        config = transformers.AutoConfig.from_pretrained(config_dir)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)
        ckptfs_load.load_into(model, ckpt_dir)  # every parameter in place, from the shards
        return model.eval()

    torch.manual_seed(3)
    model = from_shards(tmp_path / "ck", tmp_path / "ck", device="cpu")
    ids = torch.tensor([[1, 5, 17, 42, 99, 128]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, src.eval()(ids).logits)


def cli(*args, check=True):
    return subprocess.run([BIN, "load", *map(str, args)], capture_output=True, text=True,
                          check=check)


def test_cli_bench_json(corpus):
    d, cons, ck = corpus["grids_2d_3d"]
    total = sum(len(b) for _, _, b in ck.truth().values())
    a = json.loads(cli(d, "--bench", "--json", "--threads", 3, "--chunk-mb", 1).stdout)
    b = json.loads(cli(cons, "--json").stdout)
    assert a["input"] == "rank_shards" and b["input"] == "consolidated"
    assert a["bytes"] == b["bytes"] == total and a["bytes_read"] >= total
    assert a["tensors"] == len(ck.truth()) and a["device"] == "cpu" and a["threads"] == 3
    assert a["seconds"] > 0 and a["gbps"] > 0 and a["bench"] is True
    for force in (True, False):  # the host memory's huge-page advice, forced either way
        env = {**os.environ, "CKPTFS_LOAD_HUGEPAGES": str(int(force))}
        r = subprocess.run([BIN, "load", str(d), "--json"], capture_output=True, text=True,
                           env=env, check=True)
        assert json.loads(r.stdout)["huge_pages"] is force
    assert a["checksum"] == b["checksum"] and a["checksums"] == b["checksums"]
    text = cli(d).stdout
    assert "GB/s" in text and a["checksum"] in text
    r = cli(d, "--direct", "--json")
    assert json.loads(r.stdout)["checksum"] == a["checksum"]


def test_cli_refusals(corpus, tmp_path):
    d = corpus["fsdp_row"][0]
    if not torch.cuda.is_available():
        r = cli(d, "--device", "cuda:0", check=False)
        assert r.returncode == 1 and "cuda:0" in r.stderr, r.stderr
    r = cli(d, "--device", "tpu", check=False)
    assert r.returncode == 2 and "expected cpu or cuda:N" in r.stderr
    r = cli(tmp_path, check=False)
    assert r.returncode == 1 and "no rank shard files" in r.stderr
    r = cli(d, "--chunk-mb", 0, check=False)
    assert r.returncode == 2
    # A broken checkpoint: refused, one problem a line, naming the shard and the tensor.
    bad = tmp_path / "bad"
    write_checkpoint(str(bad), [TensorSpec("w", "F32", (8, 4), (2, 1))], world=2, seed=3)
    victim = sorted(bad.glob("shard-*"))[0]
    os.truncate(victim, victim.stat().st_size - 4)
    r = cli(bad, check=False)
    lines = r.stderr.splitlines()
    assert r.returncode == 1 and "not a complete, valid checkpoint" in lines[0], r.stderr
    assert any(victim.name in ln and "tensor 'w'" in ln for ln in lines[1:]), r.stderr
    assert r.stdout == ""


HUGE_PROBE = """
import ckptfs_load, torch
t = torch.empty(64 << 20, dtype=torch.uint8)  # above malloc's mmap threshold: its own mapping
ckptfs_load._advise_huge(t)
at, inside = t.data_ptr() + (8 << 20), False
for line in open("/proc/self/smaps"):
    head = line.split()[0]
    if "-" in head and not head.endswith(":"):
        lo, hi = (int(x, 16) for x in head.split("-"))
        inside = lo <= at < hi
    elif inside and line.startswith("VmFlags:"):
        print(ckptfs_load._huge_pages_pay(), " hg" in line)
        break
"""


def test_huge_page_rule_is_the_librarys():
    """The binding advises fresh CPU tensors MADV_HUGEPAGE by the library's rule
    (ckptfs_load_huge_pages): $CKPTFS_LOAD_HUGEPAGES forces it either way, seen as the "hg"
    flag of the tensor's mapping in /proc/self/smaps."""
    for force, want in (("1", "True True"), ("0", "False False")):
        env = {**os.environ, "CKPTFS_LOAD_HUGEPAGES": force,
               "PYTHONPATH": str(ROOT / "python")}
        r = subprocess.run([sys.executable, "-c", HUGE_PROBE], capture_output=True, text=True,
                           env=env, timeout=120)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == want, (force, r.stdout, r.stderr)


def test_nccl_without_a_gpu_fails_cleanly():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: this checks the no-GPU error path")
    if not ckptfs_load.features()["nccl"]:
        with pytest.raises(ckptfs_load.LoadError, match="without NCCL"):
            ckptfs_load.nccl_unique_id()
        return
    uid = ckptfs_load.nccl_unique_id()  # needs no GPU
    assert len(uid) == 128
    with pytest.raises(ckptfs_load.LoadError, match="cudaSetDevice"):
        ckptfs_load.Comm(uid, 0, 1, 0)


@needs_gpu
def test_gpu_load_state_dict(corpus):
    d, _, ck = corpus["tp_col_world8"]
    sd = ckptfs_load.load_state_dict(d, device="cuda:0")
    for name, (_, _, data) in ck.truth().items():
        assert sd[name].is_cuda and raw(sd[name]) == data, name


@needs_gpu
def test_gpu_cli(corpus):
    d, cons, _ = corpus["fsdp_row"]
    a = json.loads(cli(d, "--device", "cuda:0", "--json").stdout)
    b = json.loads(cli(cons, "--json").stdout)
    assert a["device"] == "cuda:0" and a["checksum"] == b["checksum"]


RENAME_EXCHANGE = 2


def _exchanging(a, b, runs, check):
    """Runs `ckptfs load` `runs` times while another thread exchanges paths a and b (renameat2
    RENAME_EXCHANGE: both names exist throughout) in a tight loop; check(result) per run."""
    import ctypes
    import threading

    libc = ctypes.CDLL(None, use_errno=True)
    stop = threading.Event()

    def exchange():
        while not stop.is_set():
            assert libc.renameat2(-100, bytes(a), -100, bytes(b), RENAME_EXCHANGE) == 0, \
                ctypes.get_errno()

    t = threading.Thread(target=exchange)
    t.start()
    try:
        for _ in range(runs):
            check()
    finally:
        stop.set()
        t.join()


def test_direct_reads_only_the_checked_shard(tmp_path):
    """`--direct` reads each rank shard through a descriptor of the very file the build read and
    source::open_shard stamp-checked, never by opening its path again (issue 34). The impostor:
    a file with the same tensors but a header 64 bytes longer, so every tensor's data starts 64
    bytes later. A load that takes the offsets from one file and the bytes from the other gives
    a checksum of neither: that is the failure.
      1. The impostor exchanged with a shard while loads run: each load is exact (it read one of
         the two, consistently) or refuses the shard as changed since the build read it (most
         are refused: an exchange also changes both files' ctime, part of the stamp).
      2. The whole checkpoint directory exchanged with a copy holding the impostor: every load
         is exact (the build, the stamp checks and the reads all go through the one directory
         descriptor opened first; before, --direct opened each shard by its path again, which
         by then could name the other directory's file).
    /tmp is ext4 here: O_DIRECT opens."""
    import shutil

    d = tmp_path / "ck"
    write_checkpoint(str(d), [TensorSpec("w", "F32", (1024, 512), (2, 1)),
                              TensorSpec("b", "BF16", (512,), (2,))], world=2, seed=11)
    good = json.loads(cli(d, "--direct", "--json").stdout)
    if good.get("direct_fallback"):
        pytest.skip(f"{tmp_path}: no O_DIRECT on this file system")
    victim = sorted(d.glob("shard-*"))[0]
    data = victim.read_bytes()
    n = int.from_bytes(data[:8], "little")
    impostor = (n + 64).to_bytes(8, "little") + data[8:8 + n] + b" " * 64 + data[8 + n:]
    d2 = tmp_path / "ck2"
    shutil.copytree(d, d2)
    (d2 / victim.name).write_bytes(impostor)
    other = tmp_path / "other"
    other.write_bytes(impostor)
    assert json.loads(cli(d2, "--direct", "--json").stdout)["checksum"] == good["checksum"]

    seen = {"exact": 0, "refused": 0}

    def exact_or_refused():
        r = cli(d, "--direct", "--json", check=False)
        if r.returncode == 0:
            assert json.loads(r.stdout)["checksum"] == good["checksum"], \
                "a load read one file's offsets in another file's bytes"
            seen["exact"] += 1
        else:
            assert "changed since the checkpoint was read" in r.stderr, r.stderr
            assert victim.name in r.stderr, r.stderr
            seen["refused"] += 1

    _exchanging(victim, other, 30, exact_or_refused)
    assert seen["refused"] > 0, seen  # each exchange also moves both files' ctime: refused

    def exact():
        r = cli(d, "--direct", "--json", check=False)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["checksum"] == good["checksum"], \
            "a load read one directory's offsets in the other directory's file"

    _exchanging(d, d2, 30, exact)
