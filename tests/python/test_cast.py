"""Cast views through a real mount, compared with the real torch (tier 3).

- `-o dtype=bf16|fp16|fp32` and NeMo's fqn_to_dtype_mapping.json (default `auto`) serve
  floating tensors cast on read; the bytes must equal torch's `.to(dtype)` bit for bit, on
  special values (zeros, infinities, NaNs with payloads, subnormals, rounding ties, max/min
  finite, overflow) and random bit patterns (every F16 and BF16 pattern).
- Headers, sizes and the index follow the served dtype; `dtype=stored` serves the shards.
- from_pretrained through the mount yields BF16 weights equal to stored_f32.to(bfloat16).

torch's own CPU cast gives other canonical NaNs in its scalar tail loops (the last n % 8
or n % 16 elements of F16->F32 and F64->BF16; see src/format/cast.hpp), so every tensor
compared here has a multiple of 64 elements: torch's vector kernels then cast all of it.
"""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest

from conftest import requires_fuse, run
from shardgen import TensorSpec, read_safetensors, write_checkpoint

torch = pytest.importorskip("torch")

pytestmark = requires_fuse

MODEL = "model-00001-of-00001.safetensors"
INDEX = "model.safetensors.index.json"
TORCH = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}
NP = {2: np.uint16, 4: np.uint32, 8: np.uint64}

F32_SPECIAL = [
    0x00000000, 0x80000000, 0x7F800000, 0xFF800000,                      # zeros, infinities
    0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FA5A5A5, 0xFFA5A5A5,  # NaNs
    0x7FFFFFFF, 0xFFFFFFFF, 0x7F801000, 0x7FBFE000, 0x7F802000,
    0x00000001, 0x80000001, 0x007FFFFF, 0x00008000, 0x00018000,          # f32 subnormals
    0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF,                      # BF16 ties
    0x3F801000, 0x3F803000, 0x3F801001, 0x33000000, 0x33C00000, 0x33000001,  # F16 ties
    0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F7FFF, 0x00800000, 0x80800000,          # max/min finite
    0x477FE000, 0x477FEFFF, 0x477FF000, 0xC77FF000, 0x47800000,          # F16 max, overflow
    0x38800000, 0x387FC000, 0x33800000, 0xB3800000, 0x387FE000,          # F16 subnormals
]
F64_SPECIAL = [
    0x0, 0x8000000000000000, 0x7FF0000000000000, 0xFFF0000000000000,
    0x7FF8000000000000, 0xFFF8000000000000, 0x7FF0000000000001, 0x7FF5A5A5A5A5A5A5,
    0xFFF5A5A5A5A5A5A5, 0x0000000000000001, 0x000FFFFFFFFFFFFF, 0x7FEFFFFFFFFFFFFF,
    0x3FF0000010000000, 0x3FF0000030000000, 0x3FF0000010000001,  # F32 ties
    0x3FF0020000000001, 0x3FF0010000000000, 0x3FF0010000010000,  # double-rounding cases
    0x47EFFFFFE0000000, 0x47EFFFFFF0000000, 0x36A0000000000000, 0x3690000000000000,
]


def bits_array(dt: str, n: int, seed: int) -> np.ndarray:
    """n (a multiple of 64) elements of `dt` as raw bits: specials, then random patterns."""
    rng = np.random.default_rng(seed)
    size = {"F32": 4, "F64": 8, "F16": 2, "BF16": 2}[dt]
    if size == 2:
        assert n == 65536
        return rng.permutation(np.arange(65536, dtype=np.uint32)).astype(np.uint16)
    special = F32_SPECIAL if dt == "F32" else F64_SPECIAL
    rand = rng.integers(0, 2 ** (8 * size), size=n, dtype=np.uint64).astype(NP[size])
    normal = rng.standard_normal(n // 2).astype(np.float32 if size == 4 else np.float64)
    rand[: n // 2] = normal.view(NP[size])
    rand[n // 2: n // 2 + len(special)] = np.array(special, dtype=NP[size])
    return rand


def torch_cast(dt_from: str, raw: bytes, dt_to: str) -> bytes:
    size = {"F32": 4, "F64": 8, "F16": 2, "BF16": 2}[dt_from]
    src = torch.frombuffer(bytearray(raw), dtype=INT[size]).view(TORCH[dt_from])
    return src.to(TORCH[dt_to]).contiguous().view(torch.uint8).numpy().tobytes()


def make_ckpt(d, dtype_map=None, extra=None):
    """NeMo-style: 4 ranks; column-split 2-D tensors of each float dtype, and an I64."""
    specs = []
    grids = {"F32": (1, 4), "F64": (4, 1), "F16": (1, 4), "BF16": (2, 2)}  # one chunk per rank
    for i, dt in enumerate(["F32", "F64", "F16", "BF16"]):
        n = 65536 if dt in ("F16", "BF16") else 8192
        arr = bits_array(dt, n, seed=i)
        specs.append(TensorSpec(f"w_{dt.lower()}", dt, (64, n // 64), grids[dt], array=arr.reshape(64, n // 64)))
    specs.append(TensorSpec("ids", "I64", (64,), (4,)))
    ck = write_checkpoint(str(d), specs, world=4, nemo=True)
    if dtype_map is not None:
        (d / ".hf_metadata" / "fqn_to_dtype_mapping.json").write_text(
            dtype_map if isinstance(dtype_map, str) else json.dumps(dtype_map, indent=2, sort_keys=True))
    return {t.name: (t.dtype, t.array.tobytes()) for t in ck.tensors}


def check_view(path, truth, served: dict):
    hdr, _, data = read_safetensors(path)
    assert os.stat(path).st_size == 8 + struct.unpack("<Q", open(path, "rb").read(8))[0] + len(data)
    for name, (dt, raw) in truth.items():
        want_dt = served.get(name, dt)
        e = hdr[name]
        assert e["dtype"] == want_dt, name
        got = data[e["data_offsets"][0]:e["data_offsets"][1]]
        want = raw if want_dt == dt else torch_cast(dt, raw, want_dt)
        if got != want:
            a, b = np.frombuffer(got, dtype=np.uint8), np.frombuffer(want, dtype=np.uint8)
            bad = np.nonzero(a != b)[0][:4] if len(a) == len(b) else "sizes differ"
            pytest.fail(f"{name}: {dt} -> {want_dt} differs from torch at bytes {bad}")
    return hdr, data


@pytest.mark.parametrize("to", ["bf16", "fp16", "fp32"])
def test_cast_option_matches_torch_bit_for_bit(tmp_path, mount_factory, to):
    src = tmp_path / "src" / "ckpt"
    truth = make_ckpt(src)
    m = mount_factory(tmp_path / "src", opts=[f"dtype={to}"])
    target = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}[to]
    served = {n: target for n, (dt, _) in truth.items() if dt in TORCH}
    path = os.path.join(m.mnt, "ckpt", MODEL)
    hdr, data = check_view(path, truth, served)
    index = json.loads(open(os.path.join(m.mnt, "ckpt", INDEX)).read())
    assert index["metadata"]["total_size"] == len(data)
    # Reads at odd offsets and lengths (partial elements) equal the whole file's bytes.
    whole = open(path, "rb").read()
    rng = np.random.default_rng(5)
    fd = os.open(path, os.O_RDONLY)
    try:
        for _ in range(300):
            off = int(rng.integers(0, len(whole)))
            n = int(rng.integers(1, 70000))
            assert os.pread(fd, n, off) == whole[off:off + n], (off, n)
    finally:
        os.close(fd)


def test_nemo_dtype_mapping_default_stored_and_hidden(tmp_path, mount_factory):
    src = tmp_path / "src" / "ckpt"
    mapping = {"w_f32": "BF16", "w_f64": "F64", "w_f16": "F32", "w_bf16": "F64", "ids": "BF16",
               "not.in.checkpoint": "F16"}
    truth = make_ckpt(src, mapping)
    served = {"w_f32": "BF16", "w_f16": "F32", "w_bf16": "F64"}  # ids: integers stay I64
    m = mount_factory(tmp_path / "src")
    d = os.path.join(m.mnt, "ckpt")
    check_view(os.path.join(d, MODEL), truth, served)
    assert "fqn_to_dtype_mapping.json" not in os.listdir(d)
    with pytest.raises(FileNotFoundError):
        os.stat(os.path.join(d, "fqn_to_dtype_mapping.json"))
    # F32 stored, BF16 served: half the bytes.
    hdr, _, _ = read_safetensors(os.path.join(d, MODEL))
    b, e = hdr["w_f32"]["data_offsets"]
    assert e - b == 8192 * 2
    m2 = mount_factory(tmp_path / "src", opts=["dtype=stored"])
    check_view(os.path.join(m2.mnt, "ckpt", MODEL), truth, {})
    r = run("inspect", src)
    assert "F32 -> BF16" in r.stdout and "BF16 -> F64" in r.stdout, r.stdout


def test_bad_dtype_mapping_is_a_named_problem(tmp_path, mount_factory):
    src = tmp_path / "src" / "ckpt"
    make_ckpt(src, '{"w_f32": "bfloat16"}')
    m = mount_factory(tmp_path / "src")
    d = os.path.join(m.mnt, "ckpt")
    assert MODEL not in os.listdir(d)
    r = run("inspect", src, check=False)
    assert r.returncode != 0
    assert "fqn_to_dtype_mapping.json" in r.stdout and "w_f32" in r.stdout and "bfloat16" in r.stdout
    # dtype=stored never reads the mapping: the checkpoint shows.
    m2 = mount_factory(tmp_path / "src", opts=["dtype=stored"])
    assert MODEL in os.listdir(os.path.join(m2.mnt, "ckpt"))


def test_from_pretrained_bf16_through_mapping(tmp_path, mount_factory):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   tie_word_embeddings=False, torch_dtype="bfloat16")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.float32)  # fp32 master weights
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    specs = [TensorSpec(k, "F32", tuple(v.shape), (4,) + (1,) * (v.dim() - 1), array=v.numpy())
             for k, v in sd.items()]
    src = tmp_path / "src" / "ckpt"
    write_checkpoint(str(src), specs, world=4, nemo=True,
                     extra_files={"config.json": cfg.to_json_string()})
    (src / ".hf_metadata" / "fqn_to_dtype_mapping.json").write_text(json.dumps({k: "BF16" for k in sd}))
    m = mount_factory(tmp_path / "src")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(m.mnt, "ckpt"), dtype="auto")
    got = loaded.state_dict()
    for k, v in sd.items():
        assert got[k].dtype == torch.bfloat16, k
        assert torch.equal(got[k].view(torch.int16), v.to(torch.bfloat16).view(torch.int16)), k


@pytest.mark.parametrize("dtype", [None, "bf16", "stored"])
def test_consolidate_writes_the_bytes_the_mount_serves(tmp_path, mount_factory, dtype):
    """`ckptfs consolidate --dtype D` (default auto: NeMo's mapping) writes exactly what a mount
    with `-o dtype=D` serves; the mapping files and consolidate.sh are not copied."""
    src = tmp_path / "src" / "ckpt"
    mapping = {"w_f32": "BF16", "w_f64": "F32", "w_f16": "F16", "w_bf16": "BF16", "ids": "I64"}
    truth = make_ckpt(src, mapping)
    (src / "consolidate.sh").write_text("#!/bin/sh\n")
    r = run("consolidate", src, tmp_path / "out", *(["--dtype", dtype] if dtype else []), check=False)
    assert r.returncode == 0, r.stderr
    m = mount_factory(tmp_path / "src", opts=[f"dtype={dtype}"] if dtype else [])
    view = os.path.join(m.mnt, "ckpt")
    out = tmp_path / "out"
    for name in (MODEL, INDEX):
        assert (out / name).read_bytes() == open(os.path.join(view, name), "rb").read(), name
    served = ({"w_f32": "BF16", "w_f64": "F32"} if dtype is None
              else {} if dtype == "stored"
              else {n: "BF16" for n, (dt, _) in truth.items() if dt in TORCH})
    check_view(out / MODEL, truth, served)
    left = set(os.listdir(out))
    assert not left & {"fqn_to_dtype_mapping.json", "fqn_to_file_index_mapping.json", "consolidate.sh"}


def test_consolidate_refuses_an_unknown_dtype(tmp_path):
    src = tmp_path / "ckpt"
    make_ckpt(src)
    r = run("consolidate", src, tmp_path / "out", "--dtype", "int4", check=False)
    assert r.returncode == 2 and "int4" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_consolidate_casts_long_row_sharded_runs(tmp_path, mount_factory):
    """Row-sharded chunks of 1 MiB are long runs that consolidate copies in the kernel
    (copy_file_range) when served as stored; cast, they must be converted like the view."""
    src = tmp_path / "src" / "ckpt"
    arr = bits_array("F32", 1 << 20, seed=9).reshape(1024, 1024)
    ck = write_checkpoint(str(src), [TensorSpec("big", "F32", (1024, 1024), (4, 1), array=arr)],
                          world=4)
    truth = {t.name: (t.dtype, t.array.tobytes()) for t in ck.tensors}
    r = run("consolidate", src, tmp_path / "out", "--dtype", "bf16", check=False)
    assert r.returncode == 0, r.stderr
    check_view(tmp_path / "out" / MODEL, truth, {"big": "BF16"})
    m = mount_factory(tmp_path / "src", opts=["dtype=bf16"])
    assert (tmp_path / "out" / MODEL).read_bytes() == open(os.path.join(m.mnt, "ckpt", MODEL), "rb").read()
