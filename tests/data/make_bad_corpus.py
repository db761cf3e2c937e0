#!/usr/bin/env python3
"""Generates tests/data/bad/: a corpus of malformed rank-sharded checkpoints.

Usage: make_bad_corpus.py [--out DIR]     (default: the bad/ directory beside this script)

Each case is one small directory holding `shard-RRRRR-model-KKKKK-of-MMMMM.safetensors` files
(and sometimes `.hf_metadata/`), built from a valid checkpoint by breaking exactly one thing.
`bad/EXPECTED.json` maps every case to what `ckptfs verify` / `inspect` / `consolidate` must
say about it:

  {"<case>": {"description": "...",
              "line": [substrings that must all appear on ONE output line],
              "absent_lines": [[substrings that must NOT all appear on one line], ...]}}

`line` always holds the offending file's name (relative to the checkpoint directory) and a
phrase naming the problem, plus the tensor whenever one tensor is concerned. Where the file
cannot be parsed far enough to know its tensors (framing, header JSON, __metadata__), no
tensor can be named and none is required. Every case must make `verify`, `inspect` and
`consolidate` exit 1.

`bad/headers/*.safetensors` are single files for fuzzers: `bad_*` are the malformed files of
the header-level cases, `ok_*` valid seeds (DCP metadata, 0-d and empty tensors, sub-byte).

Only the standard library is used and no randomness: tensor bytes are a fixed pattern, JSON
is serialized with fixed separators and key order, so running this again reproduces the corpus
byte for byte (tests/python/test_cli.py checks that the committed corpus is up to date).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import struct

HERE = pathlib.Path(__file__).resolve().parent

W = "model.layers.0.mlp.up_proj.weight"  # the tensor most cases break
NORM = "model.norm.weight"               # a replicated companion tensor
BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8,
        "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
        "I64": 64, "U64": 64, "F64": 64, "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}


def shard(r: int, k: int = 1, m: int = 1) -> str:
    """File name of rank r (0-based) for output file k of m."""
    return f"shard-{r + 1:05d}-model-{k:05d}-of-{m:05d}.safetensors"


def pattern(n: int, seed: int) -> bytes:
    return bytes((i * 31 + seed * 17 + 7) & 0xFF for i in range(n))


def nbytes(dtype: str, shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * BITS[dtype] // 8


def dcp_meta(info: dict) -> dict:
    return {"DCP_SHARDING_INFO": json.dumps(info, separators=(",", ":")), "DCP_VERSION": "1.0",
            "format": "pt"}


def frame(text: bytes, align: bool = True) -> bytes:
    """8-byte little-endian length + header text (space-padded so data starts 8-aligned)."""
    if align:
        text += b" " * ((8 - (8 + len(text)) % 8) % 8)
    return struct.pack("<Q", len(text)) + text


def safetensors(tensors: list, metadata: dict | None = None, seed: int = 0) -> bytes:
    """tensors: (name, dtype, shape[, raw]) tuples laid out back to back."""
    obj, pos, blobs = {}, 0, []
    if metadata is not None:
        obj["__metadata__"] = metadata
    for i, t in enumerate(tensors):
        name, dt, shape = t[:3]
        raw = t[3] if len(t) > 3 else pattern(nbytes(dt, shape), seed * 101 + i)
        obj[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [pos, pos + len(raw)]}
        pos += len(raw)
        blobs.append(raw)
    return frame(json.dumps(obj, separators=(",", ":")).encode()) + b"".join(blobs)


def raw_file(header_text: str | bytes, data: bytes = b"") -> bytes:
    """A file from literal header text (for headers json.dumps cannot produce)."""
    if isinstance(header_text, str):
        header_text = header_text.encode()
    return frame(header_text) + data


def rank_file(r: int, world: int = 2, dtype: str = "F32", rows: int = 4, cols: int = 4,
              extra_info: dict | None = None) -> bytes:
    """A valid rank-r shard of the base checkpoint: W [rows, cols] split by rows over `world`
    ranks, NORM [cols] replicated on every rank."""
    step = rows // world
    info = {W: {"saved_offsets": [r * step, 0]}, NORM: {"saved_offsets": [0]}}
    info.update(extra_info or {})
    return safetensors([(W, dtype, [step, cols]), (NORM, dtype, [cols])], dcp_meta(info), seed=r)


class Corpus:
    def __init__(self, out: pathlib.Path):
        self.out = out
        self.expected: dict[str, dict] = {}
        self.header_seeds: dict[str, bytes] = {}

    def case(self, name: str, description: str, files: dict, line: list,
             seed_file: str | None = None, absent_lines=()):
        """files: relative path -> bytes | ("symlink", target) | ("dir", {name: bytes})."""
        d = self.out / name
        d.mkdir(parents=True)
        for rel, content in files.items():
            p = d / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, tuple) and content[0] == "symlink":
                os.symlink(content[1], p)
            elif isinstance(content, tuple) and content[0] == "dir":
                p.mkdir()
                for sub, b in content[1].items():
                    (p / sub).write_bytes(b)
            else:
                p.write_bytes(content)
        assert name not in self.expected
        self.expected[name] = {"description": description, "line": list(line),
                               "absent_lines": [list(a) for a in absent_lines]}
        if seed_file is not None:
            self.header_seeds[f"bad_{name}"] = files[seed_file]

    def header_case(self, name: str, description: str, broken: bytes, phrase: str,
                    tensor_on_line: str | None = None):
        """Rank 1 of the base checkpoint replaced by `broken` (a single-file problem)."""
        bad = shard(1, 1, 1)
        line = [bad, phrase] + ([tensor_on_line] if tensor_on_line else [])
        self.case(name, description, {shard(0): rank_file(0), bad: broken}, line,
                  seed_file=bad)

    def write_meta(self):
        text = json.dumps(self.expected, indent=2, sort_keys=True) + "\n"
        (self.out / "EXPECTED.json").write_text(text)
        readme = [
            "# Malformed rank-sharded checkpoints (generated; do not edit)",
            "",
            "Regenerate with `python3 tests/data/make_bad_corpus.py`; checked by",
            "`tests/python/test_cli.py`. Each directory is one checkpoint with one thing broken.",
            "Every case must make `ckptfs verify`, `inspect` and `consolidate` exit 1 (never a",
            "crash or hang; `consolidate` writes nothing), with one output line holding all of",
            "`line` from `EXPECTED.json` (the file, the tensor when one is concerned, a phrase)",
            "and no line holding all of any `absent_lines` entry.",
            "",
            "Entries named like shards that are not regular files (`shard_is_directory`,",
            "`shard_is_symlink`) or whose names do not parse (`shard_name_k_gt_m`): ckptfs",
            "neither follows symlinks nor reads them, but must not skip them silently (the",
            "chunks they hold would vanish, and a missing tail chunk is invisible): the",
            "checkpoint is invalid and a problem names the entry and says what it is.",
            "",
            "`headers/`: single files for fuzzers (`bad_<case>` = the broken file of a",
            "single-file case, `ok_*` = valid seeds).",
            "",
            "| case | what is broken |",
            "|---|---|",
        ]
        for name, e in sorted(self.expected.items()):
            readme.append(f"| `{name}` | {e['description']} |")
        (self.out / "README.md").write_text("\n".join(readme) + "\n")
        hd = self.out / "headers"
        hd.mkdir()
        for name, b in sorted(self.header_seeds.items()):
            (hd / f"{name}.safetensors").write_bytes(b)


def build(c: Corpus) -> None:
    good1 = rank_file(1)
    info1 = {W: {"saved_offsets": [2, 0]}, NORM: {"saved_offsets": [0]}}

    # ---- one file's safetensors framing / header ------------------------------------------
    c.header_case("truncated_data", "rank 1's file is 5 bytes shorter than its header says; the "
                  "header parses, so the tensor whose bytes are cut (model.norm.weight, the "
                  "last one) is known and must be named", good1[:-5], "truncated", NORM)
    c.header_case("header_len_past_eof", "header length 4096 in a file of about 200 bytes",
                  struct.pack("<Q", 4096) + good1[8:], "runs past the end")
    c.header_case("header_len_over_cap", "header length 100000001, one past the 100 MB cap",
                  struct.pack("<Q", 100_000_001) + good1[8:], "exceeds the 100000000 byte limit")
    c.header_case("header_not_json", "header text is not JSON",
                  raw_file('{"model.layers.0.mlp.up_proj.weight": {"dtype": F32}}', b"\0" * 32),
                  "not valid")
    c.header_case("header_invalid_utf8", "a tensor name in the header holds the byte 0xFF",
                  raw_file(b'{"model.layers.0.mlp.up_proj.weight\xff":{"dtype":"F32","shape":[2,4],'
                           b'"data_offsets":[0,32]}}', pattern(32, 1)), "UTF-8")
    c.header_case("header_not_object", "header is a JSON array",
                  raw_file("[1,2,3]"), "does not start with '{'")
    c.header_case("header_len_zero", "header length 0 (empty header text)",
                  struct.pack("<Q", 0), "does not start with '{'")
    c.header_case("zero_length_file", "rank 1's file is empty (0 bytes)", b"", "too short")
    c.header_case("seven_byte_file", "rank 1's file has 7 bytes, less than the length field",
                  b"\x10\0\0\0\0\0\0", "too short")
    meta1 = json.dumps(dcp_meta(info1), separators=(",", ":"))
    c.header_case(
        "duplicate_tensor_name", "the header lists the same tensor twice",
        raw_file('{"__metadata__":' + meta1 + ',"' + W + '":{"dtype":"F32","shape":[2,4],'
                 '"data_offsets":[0,32]},"' + NORM + '":{"dtype":"F32","shape":[4],'
                 '"data_offsets":[32,48]},"' + W + '":{"dtype":"F32","shape":[2,4],'
                 '"data_offsets":[0,32]}}', pattern(48, 1)),
        "duplicate", W)
    c.header_case("metadata_value_not_string",
                  "__metadata__['DCP_SHARDING_INFO'] is a JSON object instead of a string",
                  safetensors([(W, "F32", [2, 4]), (NORM, "F32", [4])],
                              {"DCP_SHARDING_INFO": info1, "format": "pt"}, seed=1),
                  "is not a string")
    c.header_case("metadata_not_object", "__metadata__ is a JSON array",
                  safetensors([(W, "F32", [2, 4]), (NORM, "F32", [4])], ["format", "pt"], seed=1),
                  "__metadata__ is not an object")
    c.header_case("unknown_dtype", "a tensor has dtype F128",
                  safetensors([(W, "F128", [2, 4], pattern(32, 1)), (NORM, "F32", [4])],
                              dcp_meta(info1), seed=1),
                  "unknown dtype 'F128'", W)
    c.header_case("missing_dtype", "a tensor entry has no dtype",
                  raw_file('{"' + W + '":{"shape":[2,4],"data_offsets":[0,32]}}', pattern(32, 1)),
                  "dtype", W)
    c.header_case("offsets_disagree_with_shape",
                  "data_offsets span 16 bytes for a [2, 4] F32 chunk (32 bytes)",
                  raw_file('{"__metadata__":' + meta1 + ',"' + W + '":{"dtype":"F32","shape":[2,4],'
                           '"data_offsets":[0,16]},"' + NORM + '":{"dtype":"F32","shape":[4],'
                           '"data_offsets":[16,32]}}', pattern(32, 1)),
                  "needs 32", W)
    c.header_case("shape_overflow", "shape [4294967296, 4294967297] overflows 64 bits of elements",
                  raw_file('{"' + W + '":{"dtype":"U8","shape":[4294967296,4294967297],'
                           '"data_offsets":[0,8]}}', pattern(8, 1)),
                  "overflows 64 bits", W)
    c.header_case("bytes_overflow",
                  "shape [2**62, 1] of F32 fits 64 bits of elements but not bytes",
                  raw_file('{"' + W + '":{"dtype":"F32","shape":[4611686018427387904,1],'
                           '"data_offsets":[0,8]}}', pattern(8, 1)),
                  "overflow", W)
    c.header_case("negative_shape", "shape [-2, 4]",
                  raw_file('{"' + W + '":{"dtype":"F32","shape":[-2,4],"data_offsets":[0,32]}}',
                           pattern(32, 1)),
                  "non-negative integer", W)
    c.header_case("offsets_hole", "8 unused bytes between two tensors' data",
                  raw_file('{"__metadata__":' + meta1 + ',"' + W + '":{"dtype":"F32","shape":[2,4],'
                           '"data_offsets":[0,32]},"' + NORM + '":{"dtype":"F32","shape":[4],'
                           '"data_offsets":[40,56]}}', pattern(56, 1)),
                  "hole", NORM)
    c.header_case("offsets_overlap", "two tensors' data overlap by 16 bytes",
                  raw_file('{"__metadata__":' + meta1 + ',"' + W + '":{"dtype":"F32","shape":[2,4],'
                           '"data_offsets":[0,32]},"' + NORM + '":{"dtype":"F32","shape":[4],'
                           '"data_offsets":[16,32]}}', pattern(32, 1)),
                  "overlap", NORM)
    c.header_case("f4_chunk_odd_elements", "an F4 chunk of 3 elements (12 bits, not whole bytes)",
                  raw_file('{"' + W + '":{"dtype":"F4","shape":[1,3],"data_offsets":[0,2]}}',
                           pattern(2, 1)),
                  "whole number of bytes", W)

    # ---- DCP_SHARDING_INFO -------------------------------------------------------------------
    c.header_case("sharding_info_not_json", "DCP_SHARDING_INFO is not JSON",
                  safetensors([(W, "F32", [2, 4]), (NORM, "F32", [4])],
                              {"DCP_SHARDING_INFO": "{not json", "format": "pt"}, seed=1),
                  "DCP_SHARDING_INFO is not valid JSON")
    c.header_case("sharding_info_missing_tensor",
                  "a tensor of the header is not in DCP_SHARDING_INFO",
                  safetensors([(W, "F32", [2, 4]), (NORM, "F32", [4])],
                              dcp_meta({NORM: {"saved_offsets": [0]}}), seed=1),
                  "no DCP_SHARDING_INFO entry", W)
    c.header_case("sharding_info_extra_tensor",
                  "DCP_SHARDING_INFO lists a tensor the header does not have",
                  safetensors([(W, "F32", [2, 4]), (NORM, "F32", [4])],
                              dcp_meta({**info1, "model.ghost.weight": {"saved_offsets": [0]}}),
                              seed=1),
                  "no header entry", "model.ghost.weight")
    c.header_case("saved_offsets_rank_mismatch", "saved_offsets [2] for a 2-d [2, 4] chunk",
                  safetensors([(W, "F32", [2, 4]), (NORM, "F32", [4])],
                              dcp_meta({W: {"saved_offsets": [2]}, NORM: {"saved_offsets": [0]}}),
                              seed=1),
                  "saved_offsets [2] has rank 1", W)
    c.header_case("saved_offsets_not_integer", "saved_offsets [2.5, 0]",
                  safetensors([(W, "F32", [2, 4]), (NORM, "F32", [4])],
                              dcp_meta({W: {"saved_offsets": [2.5, 0]},
                                        NORM: {"saved_offsets": [0]}}), seed=1),
                  "non-negative integer", W)
    c.header_case("saved_offsets_missing", "a DCP_SHARDING_INFO entry without saved_offsets",
                  safetensors([(W, "F32", [2, 4]), (NORM, "F32", [4])],
                              dcp_meta({W: {"offsets": [2, 0]}, NORM: {"saved_offsets": [0]}}),
                              seed=1),
                  "saved_offsets", W)
    c.header_case(
        "sharding_info_duplicate_key",
        "DCP_SHARDING_INFO names the tensor twice ([0, 0] then [2, 0]); which one is meant is "
        "ambiguous, so it must be refused like a duplicate header key (json.loads and nlohmann "
        "silently keep the last)",
        safetensors([(W, "F32", [2, 4]), (NORM, "F32", [4])],
                    {"DCP_SHARDING_INFO": '{"' + W + '":{"saved_offsets":[0,0]},"' + W +
                     '":{"saved_offsets":[2,0]},"' + NORM + '":{"saved_offsets":[0]}}',
                     "format": "pt"}, seed=1),
        "duplicate", W)
    c.header_case(
        "chunk_offset_overflow", "saved_offsets [2**64-1, 0]: offset + size overflows",
        safetensors([(W, "F32", [2, 4]), (NORM, "F32", [4])],
                    dcp_meta({W: {"saved_offsets": [18446744073709551615, 0]},
                              NORM: {"saved_offsets": [0]}}), seed=1),
        "overflows", W)

    # ---- how the chunks of the ranks fit together ---------------------------------------------
    c.case("gap_missing_middle_rank",
           "W [6, 4] split by rows over 3 ranks; rank 1 (shard-00002) is absent",
           {shard(0): rank_file(0, world=3, rows=6), shard(2): rank_file(2, world=3, rows=6)},
           [shard(0), shard(2), W, "gap", "missing shard"])
    c.case("missing_tail_rank_with_full_shape",
           "DCP_SHARDING_INFO carries the full shape [6, 4]; the last rank (rows 4..6) is absent",
           {shard(r): rank_file(r, world=3, rows=6,
                                extra_info={W: {"saved_offsets": [r * 2, 0], "shape": [6, 4]}})
            for r in (0, 1)},
           [shard(0), W, "gap", "missing shard"])
    c.case("chunk_overlap", "rank 0 holds rows 0..2 and rank 1 rows 1..4 of W [4, 4]",
           {shard(0): safetensors([(W, "F32", [2, 4]), (NORM, "F32", [4])],
                                  dcp_meta({W: {"saved_offsets": [0, 0]},
                                            NORM: {"saved_offsets": [0]}}), seed=0),
            shard(1): safetensors([(W, "F32", [3, 4]), (NORM, "F32", [4])],
                                  dcp_meta({W: {"saved_offsets": [1, 0]},
                                            NORM: {"saved_offsets": [0]}}), seed=1)},
           [shard(0), shard(1), W, "chunks overlap"])
    c.case("chunk_outside_full_shape", "full shape [4, 4] in the metadata; rank 1's chunk is at "
           "row 4", {shard(0): rank_file(0, extra_info={W: {"saved_offsets": [0, 0],
                                                            "shape": [4, 4]}}),
                     shard(1): rank_file(1, extra_info={W: {"saved_offsets": [4, 0],
                                                            "shape": [4, 4]}})},
           [shard(1), W, "outside the tensor shape"])
    c.case("full_shape_mismatch", "rank 0 says full shape [4, 4], rank 1 says [6, 4]",
           {shard(0): rank_file(0, extra_info={W: {"saved_offsets": [0, 0], "shape": [4, 4]}}),
            shard(1): rank_file(1, extra_info={W: {"saved_offsets": [2, 0], "shape": [6, 4]}})},
           [shard(1), shard(0), W, "full shape [6, 4] differs from [4, 4]"])
    c.case("dtype_mismatch_between_ranks", "W is F32 on rank 0 and F16 on rank 1",
           {shard(0): rank_file(0),
            shard(1): safetensors([(W, "F16", [2, 4]), (NORM, "F32", [4])], dcp_meta(info1),
                                  seed=1)},
           [shard(1), shard(0), W, "dtype F16 differs from F32"])
    c.case("ndim_mismatch_between_ranks", "W is [2, 4] on rank 0 and 1-d [8] on rank 1",
           {shard(0): rank_file(0),
            shard(1): safetensors([(W, "F32", [8]), (NORM, "F32", [4])],
                                  dcp_meta({W: {"saved_offsets": [8]},
                                            NORM: {"saved_offsets": [0]}}), seed=1)},
           [shard(1), shard(0), W, "differs"])
    c.case("output_count_mismatch",
           "ranks 0 and 2 say 2 output files (…-of-00002), rank 1 says 3 (…-of-00003)",
           {shard(0, 1, 2): rank_file(0, world=3, rows=6),
            shard(1, 1, 3): rank_file(1, world=3, rows=6),
            shard(2, 1, 2): rank_file(2, world=3, rows=6)},
           [shard(1, 1, 3), "output files"],
           absent_lines=[[shard(0, 1, 2), "output files"], [shard(2, 1, 2), "output files"]])
    b = "model.layers.0.mlp.down_proj.weight"
    c.case("tensor_in_different_k",
           "W goes to output file 1 on rank 0 but to output file 2 on rank 1",
           {shard(0, 1, 2): rank_file(0),
            shard(0, 2, 2): safetensors([(b, "F32", [4])], dcp_meta({b: {"saved_offsets": [0]}})),
            shard(1, 1, 2): safetensors([(NORM, "F32", [4])],
                                        dcp_meta({NORM: {"saved_offsets": [0]}}), seed=1),
            shard(1, 2, 2): safetensors([(W, "F32", [2, 4]), (b, "F32", [4])],
                                        dcp_meta({W: {"saved_offsets": [2, 0]},
                                                  b: {"saved_offsets": [0]}}), seed=1)},
           [shard(1, 2, 2), shard(0, 1, 2), W, "output file 2 here but in file 1"])
    c.case("f4_split_inside_byte",
           "F4 [2, 3] split by columns 1 + 2: each chunk is whole bytes but rank 0's rows end "
           "half-way through a byte of the consolidated tensor",
           {shard(0): safetensors([(W, "F4", [2, 1])], dcp_meta({W: {"saved_offsets": [0, 0]}})),
            shard(1): safetensors([(W, "F4", [2, 2])], dcp_meta({W: {"saved_offsets": [0, 1]}}),
                                  seed=1)},
           [shard(0), W, "F4", "inside a byte"])
    c.case("f6_split_inside_byte",
           "F6_E2M3 [2, 4] split by columns 2 + 2 (each row run is 12 bits)",
           {shard(0): safetensors([(W, "F6_E2M3", [2, 2])],
                                  dcp_meta({W: {"saved_offsets": [0, 0]}})),
            shard(1): safetensors([(W, "F6_E2M3", [2, 2])],
                                  dcp_meta({W: {"saved_offsets": [0, 2]}}), seed=1)},
           [shard(0), W, "F6_E2M3", "inside a byte"])

    # ---- NeMo layout: .hf_metadata/fqn_to_file_index_mapping.json -------------------------------
    mapping = ".hf_metadata/fqn_to_file_index_mapping.json"
    nemo = {shard(0): rank_file(0), shard(1): rank_file(1),
            ".hf_metadata/config.json": b'{"model_type": "llama"}\n'}
    c.case("nemo_mapping_missing_shard",
           "the mapping lists lm_head.weight, which no shard holds (its shard is missing)",
           {**nemo, mapping: json.dumps({W: 1, NORM: 1, "lm_head.weight": 2}).encode()},
           [mapping, "lm_head.weight", "found in no shard"])
    c.case("nemo_mapping_not_json", "the mapping file is not JSON",
           {**nemo, mapping: b'{"model.layers.0.mlp.up_proj.weight": 1,'},
           [mapping, "not valid JSON"])
    c.case("nemo_mapping_bad_index", "the mapping sends W to file index 0",
           {**nemo, mapping: json.dumps({W: 0, NORM: 1}).encode()},
           [mapping, W, "1..99999"])
    c.case("nemo_tensor_not_in_mapping", "the shards hold NORM, which the mapping does not list",
           {**nemo, mapping: json.dumps({W: 1}).encode()},
           [shard(0), NORM, "not in fqn_to_file_index_mapping.json"])

    # ---- directory entries named like shards that are not regular files ------------------------
    # Decision: ckptfs does not follow symlinks and cannot read directories, but it must not
    # skip such an entry silently either (the user sees it in `ls`, and a bare "gap ... missing
    # shard?" would point them the wrong way): the checkpoint is invalid and a problem names the
    # entry and says what it is.
    c.case("shard_is_directory", "shard-00002-… is a directory (holding a README)",
           {shard(0): rank_file(0),
            shard(1): ("dir", {"README": b"a directory named like a shard file\n"})},
           [shard(1), "directory"])
    c.case("shard_is_symlink", "shard-00002-… is a symlink to a valid rank-1 file beside it",
           {shard(0): rank_file(0), "rank1.bin": good1, shard(1): ("symlink", "rank1.bin")},
           [shard(1), "symlink"])

    c.case("shard_name_k_gt_m",
           "rank 1's file is named shard-00002-model-00003-of-00001 (K > M): it looks like a "
           "shard but its name cannot be parsed; skipping it silently would drop its chunks",
           {shard(0): rank_file(0), "shard-00002-model-00003-of-00001.safetensors": good1},
           ["shard-00002-model-00003-of-00001.safetensors", "not a rank shard file name"])

    # Valid fuzzer seeds.
    c.header_seeds["ok_rank0"] = rank_file(0)
    c.header_seeds["ok_plain"] = safetensors([("a", "BF16", [3, 2]), ("b", "I64", [2])],
                                             {"format": "pt"}, seed=5)
    c.header_seeds["ok_0d_empty"] = safetensors(
        [("scalar", "F32", []), ("empty", "F16", [0, 4]), ("flag", "BOOL", [3])],
        dcp_meta({"scalar": {"saved_offsets": []}, "empty": {"saved_offsets": [0, 0]},
                  "flag": {"saved_offsets": [0]}}), seed=6)
    c.header_seeds["ok_subbyte"] = safetensors(
        [("f4", "F4", [2, 4]), ("f6", "F6_E3M2", [4, 4])],
        dcp_meta({"f4": {"saved_offsets": [0, 0], "shape": [2, 4]},
                  "f6": {"saved_offsets": [0, 0]}}), seed=7)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE / "bad"))
    out = pathlib.Path(ap.parse_args().out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    c = Corpus(out)
    build(c)
    c.write_meta()


if __name__ == "__main__":
    main()
