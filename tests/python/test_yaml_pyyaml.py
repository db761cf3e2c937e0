"""format/yaml against PyYAML: random documents written by yaml.safe_dump in every style it has
(block, flow, mixed; plain, quoted and block-scalar strings; folded at random widths; anchors for
shared values) must read through the C++ reader (tests/support/yaml_to_json, CKPTFS_YAML_TO_JSON)
exactly as yaml.safe_load reads them. run_config.yaml is written by safe_dump; a person may add
what safe_load reads, so hand-written forms are checked the same way, and what the reader
refuses must be what it documents (tags other than the core scalar ones, merge keys, collections
as keys, YAML 1.1's other line breaks, more than one document).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import random
import subprocess

import pytest

yaml = pytest.importorskip("yaml")

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOOL = os.environ.get("CKPTFS_YAML_TO_JSON", str(ROOT / "build" / "tests" / "yaml_to_json"))
if not os.access(TOOL, os.X_OK):
    pytest.skip(f"no yaml_to_json at {TOOL} (tests/meson.build builds it)", allow_module_level=True)

# Strings that PyYAML must quote, or that resolve to something else when plain.
TRICKY = ["", " ", "yes", "No", "on", "OFF", "true", "null", "~", "Null", "1e-06", "1.0e-06", "1.0e10", "1.0E+10", "6.02e23", "0x1F",
          "017", "0o17", "1:30", "190:20:30.15", "1_000", ".inf", "-.inf", ".nan", "3.", ".5", "-.5",
          "a: b", "a:b", "#x", "x #y", "- x", "-", "? x", ": x", "[x]", "{x}", "*a", "&a", "!x",
          "%x", "@x", "`x", "'", '"', "it's", 'say "hi"', "back\\slash", "tab\there", "line\nbreak",
          "two\n\nbreaks", "trailing\n", " lead", "trail ", "\u00e9t\u00e9", "\u2028", "\u00a0x",
          "x\u0085y", "emoji \U0001F600", "http://h:80/p", "/tmp/nemo_experiments/default",
          "torch.nn.functional.silu", "megatron.bridge.models.gpt_provider.GPTModelProvider",
          "---", "...", "--- x", "a,b", "a]b"]


def word(r: random.Random) -> str:
    return "".join(r.choice("abcdefghij_ ") for _ in range(r.randint(1, 12))).strip() or "k"


def scalar(r: random.Random):
    k = r.random()
    if k < 0.25:
        return r.choice(TRICKY)
    if k < 0.35:
        return " ".join(word(r) for _ in range(r.randint(8, 30)))  # folded at the width
    if k < 0.5:
        return r.choice([r.randint(-10, 10), r.randint(-2**63, 2**63 - 1), r.randint(0, 2**64 - 1)])
    if k < 0.65:
        return r.choice([0.0, -0.0, 1e-06, 1e20, 1e-300, 1.5e300, 0.1, 1 / 3, r.uniform(-1e6, 1e6),
                         float("inf"), float("-inf"), float("nan")])
    if k < 0.75:
        return r.choice([True, False, None])
    return word(r)


def value(r: random.Random, depth: int, shared: list):
    if depth > 4 or r.random() < 0.45:
        return scalar(r)
    if shared and r.random() < 0.1:
        return r.choice(shared)  # the same object twice: safe_dump writes an anchor and an alias
    if r.random() < 0.5:
        v = [value(r, depth + 1, shared) for _ in range(r.randint(0, 5))]
    else:
        v = {r.choice([word(r), r.choice(TRICKY)]): value(r, depth + 1, shared) for _ in range(r.randint(0, 6))}
    if r.random() < 0.2:
        shared.append(v)
    return v


def as_json(v):
    """safe_load's value as the reader gives it: JSON has no non-finite floats (null)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, list):
        return [as_json(x) for x in v]
    if isinstance(v, dict):
        return {str(k): as_json(x) for k, x in v.items()}
    return v


def read_all(texts: list[str]) -> list:
    data = "\0".join(texts).encode()
    r = subprocess.run([TOOL], input=data, capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr.decode()
    lines = r.stdout.decode().split("\n")[:-1]
    assert len(lines) == len(texts)
    return [("error", ln[7:]) if ln.startswith("error: ") else json.loads(ln) for ln in lines]


def dump(r: random.Random, doc) -> str:
    style = r.choice([None, None, None, "'", '"', "|", ">"])
    return yaml.safe_dump(doc, default_flow_style=r.choice([False, False, None, True]),
                          default_style=style, width=r.choice([20, 40, 80, 200]),
                          allow_unicode=r.random() < 0.5, explicit_start=r.random() < 0.2,
                          sort_keys=r.random() < 0.5, indent=r.choice([2, 2, 4]))


def test_safe_dump_reads_as_safe_load():
    r = random.Random(20261201)
    texts, want = [], []
    for _ in range(1500):
        doc = value(r, 0, []) if r.random() < 0.2 else {word(r): value(r, 1, []) for _ in range(r.randint(1, 8))}
        text = dump(r, doc)
        texts.append(text)
        want.append(as_json(yaml.safe_load(text)))
    got = read_all(texts)
    # YAML 1.1's other line breaks (NEL, LS, PS), written raw with allow_unicode: refused as
    # documented, naming them; escaped (\\N, \\L, \\P) they are read.
    raw_breaks = {i for i, t in enumerate(texts) if any(b in t for b in ("\u0085", "\u2028", "\u2029"))}
    for i in raw_breaks:
        assert isinstance(got[i], tuple) and "U+2028" in got[i][1], (texts[i], got[i])
    assert len(raw_breaks) < len(texts) // 4, len(raw_breaks)
    # safe_dump writes complex keys ("? ") for an empty key, a key with a line break and every
    # key under a block style: they must be among what was read.
    assert sum("? " in t for i, t in enumerate(texts) if i not in raw_breaks) > 100
    bad = [(t, g, w) for i, (t, g, w) in enumerate(zip(texts, got, want)) if g != w and i not in raw_breaks]
    assert not bad, f"{len(bad)} of {len(texts)} differ; the first:\n{bad[0][0]}\n-> {bad[0][1]}\nPyYAML: {bad[0][2]}"


def test_written_by_hand():
    """Forms a person editing a config writes (comments, flow over lines, anchors, block scalars)."""
    texts = [
        "# run\nmodel:   # the provider\n  num_layers: 2   # two\n  dims: [64,\n    128]   # c\n  x: {a: 1, b: [2, 3]}\n",
        "a: &base\n  hidden_size: 64\n  n: 2\nb: *base\nc: [*base, 1]\n",
        "a: |\n  line one\n    indented\n  three\nb: >-\n  folded\n  text\n\n  para\n",
        "- a\n-   - b\n    - c\n- k: v\n  k2:\n  - 1\n  - 2\n",
        "key with spaces: value with spaces\n'quoted key': \"x\"\n\"q2\": 'y'\n",
        "a: 'x\n\n  y'\nb: \"p\\\n  q\"\n",
        "%YAML 1.1\n--- \nx: 1\n...\n",
        "? ''\n: empty key\n? |-\n  multi\n  line\n: - a\n  - b\n",
        "empty_map: {}\nempty_seq: []\nnull_value:\nnext: 1\n",
    ]
    got = read_all(texts)
    for t, g in zip(texts, got):
        assert g == as_json(yaml.safe_load(t)), (t, g)


def test_refused_as_documented():
    """PyYAML's safe_load would construct (tags), merge (<<), take a collection as a key, break
    lines at U+2028 or read several documents: the reader refuses these, naming the line, rather
    than reading them otherwise."""
    cases = {
        "a: !!python/object/apply:os.system ['true']\n": "a tag",
        "a: !custom x\n": "a tag",
        "base: &b {x: 1}\nc:\n  <<: *b\n": "a merge key",
        "? [a, b]\n: c\n": "a complex key that is a collection",
        "a: x\u2028y\n": "U+2028",
        "a: 1\n---\nb: 2\n": "more than one document",
        "a: 1\na: 2\n": "duplicate key",
    }
    got = read_all(list(cases))
    for (text, says), g in zip(cases.items(), got):
        assert isinstance(g, tuple) and says in g[1], (text, g)
