"""Synthetic rank-sharded checkpoints for tests, written with numpy and the standard library.

This is an independent implementation of the on-disk format (safetensors + DCP_SHARDING_INFO)
so tests check ckptfs against something other than its own code. Real torch DCP checkpoints
come from tools/gen_checkpoint.py; this module covers what torch cannot easily produce:
arbitrary chunk grids, every dtype, and broken files.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field

import numpy as np

# dtype name -> (numpy dtype used to hold raw values, element bytes)
DTYPES = {
    "BOOL": (np.uint8, 1), "U8": (np.uint8, 1), "I8": (np.int8, 1),
    "F8_E4M3": (np.uint8, 1), "F8_E5M2": (np.uint8, 1), "F8_E8M0": (np.uint8, 1),
    "I16": (np.int16, 2), "U16": (np.uint16, 2), "F16": (np.float16, 2), "BF16": (np.uint16, 2),
    "I32": (np.int32, 4), "U32": (np.uint32, 4), "F32": (np.float32, 4),
    "I64": (np.int64, 8), "U64": (np.uint64, 8), "F64": (np.float64, 8), "C64": (np.uint64, 8),
}


def header_bytes(entries: dict, metadata: dict | None = None, align: int = 8) -> bytes:
    """Serialize a safetensors header (8-byte length + JSON padded with spaces)."""
    obj = {}
    if metadata is not None:
        obj["__metadata__"] = metadata
    obj.update(entries)
    text = json.dumps(obj, separators=(",", ":")).encode()
    if align:
        text += b" " * ((align - (8 + len(text)) % align) % align)
    return struct.pack("<Q", len(text)) + text


def write_safetensors(path: str, tensors: list, metadata: dict | None = None) -> None:
    """tensors: list of (name, dtype_name, shape, raw_bytes)."""
    entries, pos, blobs = {}, 0, []
    for name, dt, shape, raw in tensors:
        entries[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [pos, pos + len(raw)]}
        pos += len(raw)
        blobs.append(raw)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "wb") as f:
        f.write(header_bytes(entries, metadata))
        for b in blobs:
            f.write(b)


def read_safetensors(path: str) -> tuple[dict, dict, bytes]:
    """Independent reader: returns (entries, metadata, data) without any ckptfs code."""
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    hdr = json.loads(blob[8:8 + n])
    meta = hdr.pop("__metadata__", None) or {}
    return hdr, meta, blob[8 + n:]


def tensor_bytes(path: str) -> dict[str, tuple[str, list, bytes]]:
    hdr, _, data = read_safetensors(path)
    return {k: (v["dtype"], v["shape"], data[v["data_offsets"][0]:v["data_offsets"][1]])
            for k, v in hdr.items()}


def random_array(rng: np.random.Generator, dt: str, shape) -> np.ndarray:
    npdt, size = DTYPES[dt]
    raw = rng.integers(0, 256, size=int(np.prod(shape, dtype=np.int64)) * size, dtype=np.uint8)
    if dt in ("F16", "F32", "F64"):  # keep floats finite so torch comparisons are meaningful
        return rng.standard_normal(size=shape).astype(npdt)
    if dt == "BOOL":  # only 0 and 1 are valid bools (same draws, so later tensors are unchanged)
        return (raw % 2).reshape(shape)
    return raw.view(npdt).reshape(shape)


def split_points(n: int, pieces: int) -> list[int]:
    """torch.chunk-style split of n into `pieces` (last pieces may be smaller or empty)."""
    step = -(-n // pieces) if pieces else n
    pts = [min(i * step, n) for i in range(pieces)] + [n]
    return pts


@dataclass
class TensorSpec:
    name: str
    dtype: str
    shape: tuple
    grid: tuple = ()       # pieces per dim; () = whole tensor
    file_index: int = 1    # k of model-k-of-m
    array: np.ndarray | None = None
    replicate: bool = False  # every rank holds the whole tensor


@dataclass
class Checkpoint:
    dir: str
    world: int
    files: int
    tensors: list = field(default_factory=list)

    def truth(self) -> dict[str, tuple[str, list, bytes]]:
        return {t.name: (t.dtype, list(t.shape), t.array.tobytes()) for t in self.tensors}


def chunks_of(t: TensorSpec):
    """Yields (offsets, sizes) of every grid cell of t, row-major."""
    grid = t.grid or tuple(1 for _ in t.shape)
    pts = [split_points(n, p) for n, p in zip(t.shape, grid)]
    cells = [[]]
    for d, p in enumerate(pts):
        cells = [c + [(p[i], p[i + 1] - p[i])] for c in cells for i in range(len(p) - 1)]
    for c in cells:
        yield [o for o, _ in c], [s for _, s in c]


def write_checkpoint(dir: str, specs: list[TensorSpec], world: int, files: int = 1, seed: int = 0,
                     mapping: bool = False, nemo: bool = False, extra_files: dict | None = None,
                     full_shape_key: bool = False) -> Checkpoint:
    """Writes shard-R-model-K-of-M files the way torch DCP's HF writer lays them out.

    Grid cells are dealt to ranks round-robin. With `nemo`, every rank writes one file
    (…-model-00001-of-00001) and the grouping goes to .hf_metadata/fqn_to_file_index_mapping.json.
    """
    rng = np.random.default_rng(seed)
    ck = Checkpoint(dir, world, files)
    per_rank_file: dict[tuple[int, int], list] = {}
    info: dict[tuple[int, int], dict] = {}
    for t in specs:
        if t.array is None:
            t.array = random_array(rng, t.dtype, t.shape)
        ck.tensors.append(t)
        cells = list(chunks_of(t))
        assign = ([(r, cells[0]) for r in range(world)] if t.replicate
                  else [(i % world, c) for i, c in enumerate(cells)])
        for r, (off, sz) in assign:
            if int(np.prod(sz, dtype=np.int64)) == 0 and int(np.prod(t.shape, dtype=np.int64)) > 0:
                continue  # DCP writes no data for empty local chunks of a non-empty tensor
            sl = tuple(slice(o, o + s) for o, s in zip(off, sz))
            part = np.ascontiguousarray(t.array[sl])
            k = 1 if nemo else t.file_index
            key = (r, k)
            per_rank_file.setdefault(key, []).append((t.name, t.dtype, sz, part.tobytes()))
            entry = {"saved_offsets": off}
            if full_shape_key:
                entry["shape"] = list(t.shape)
            info.setdefault(key, {})[t.name] = entry
    m = 1 if nemo else files
    for (r, k), items in sorted(per_rank_file.items()):
        meta = {"DCP_SHARDING_INFO": json.dumps(info[(r, k)]), "DCP_VERSION": "1.0", "format": "pt"}
        name = f"shard-{r + 1:05d}-model-{k:05d}-of-{m:05d}.safetensors"
        write_safetensors(os.path.join(dir, name), items, meta)
    side = dict(extra_files or {})
    if mapping or nemo:
        meta_dir = os.path.join(dir, ".hf_metadata")
        os.makedirs(meta_dir, exist_ok=True)
        with open(os.path.join(meta_dir, "fqn_to_file_index_mapping.json"), "w") as f:
            json.dump({t.name: t.file_index for t in specs}, f)
        for name, text in side.items():
            with open(os.path.join(meta_dir, name), "w") as f:
                f.write(text)
        side = {}
    for name, text in side.items():
        with open(os.path.join(dir, name), "w") as f:
            f.write(text)
    return ck


def llama_like(layers: int = 2, hidden: int = 64, inter: int = 128, vocab: int = 256,
               dtype: str = "BF16", files: int = 2, layout: str = "row", world: int = 4):
    """Specs shaped like a small Llama with FSDP-row or TP-column style grids."""
    specs = []

    def g(shape, col=False):
        if layout == "row":
            return (world,) + (1,) * (len(shape) - 1)
        if layout == "col" and len(shape) == 2:
            return (1, world) if col else (world, 1)
        return (1,) * len(shape)

    specs.append(TensorSpec("model.embed_tokens.weight", dtype, (vocab, hidden), g((vocab, hidden)), 1))
    for i in range(layers):
        k = 1 + (i * files) // layers
        p = f"model.layers.{i}"
        for n, shp, col in [("self_attn.q_proj", (hidden, hidden), False),
                            ("self_attn.k_proj", (hidden // 2, hidden), False),
                            ("self_attn.v_proj", (hidden // 2, hidden), False),
                            ("self_attn.o_proj", (hidden, hidden), True),
                            ("mlp.gate_proj", (inter, hidden), False),
                            ("mlp.up_proj", (inter, hidden), False),
                            ("mlp.down_proj", (hidden, inter), True)]:
            specs.append(TensorSpec(f"{p}.{n}.weight", dtype, shp, g(shp, col), k))
        for n in ("input_layernorm", "post_attention_layernorm"):
            specs.append(TensorSpec(f"{p}.{n}.weight", dtype, (hidden,), (), k, replicate=True))
    specs.append(TensorSpec("model.norm.weight", dtype, (hidden,), (), files, replicate=True))
    specs.append(TensorSpec("lm_head.weight", dtype, (vocab, hidden), g((vocab, hidden)), files))
    return specs
