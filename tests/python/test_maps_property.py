"""Model maps (issue 22): a random-map property test against torch doing the same rearrangement.

Fifteen random cases (seeded): random stored tensors (rank 1-4, float, bfloat16, half, double,
int64 or uint8 holding arbitrary bit patterns), saved with torch's own DCP writer
(`torch.distributed.checkpoint.save(..., no_dist=True)`) into one directory per case with its
config.json, and a random map per case: renames with captures matched or bound by `for`,
`index` selections (literals, expressions, config keys, `let` names, `for` captures), `rows`
rearrangements (each leading axis split into 1-3 named sizes taken from `let`, the map's
`axes`, config.json, or inferred; the names permuted, regrouped and sliced), `concat` of 1-3
parts, dropped tensors, `when` and `optional` rules. The expected HF tensors are made by torch
itself, with einops' semantics written as torch ops: index, reshape into the named sizes,
narrow, permute, reshape into the groups, cat. They are also checked against map_ref (the
pure-Python reference of docs/maps.md).
  * twelve cases go through `ckptfs consolidate CASE OUT --map CASE.json` (the extent map the
    mount serves), each output compared bit for bit, names, dtypes and shapes included;
  * three cases share one map whose sizes all come from each directory's own config.json; one
    mount with `-o map=PATH` serves all three, read back with safetensors.
Skipped (never faked) without torch and safetensors; the mount test without FUSE.
"""

from __future__ import annotations

import json
import math
import pathlib
import random
import warnings

import pytest

import map_ref
from conftest import Mount, fuse_available, run

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

CONSOLIDATED = 12
SHARED = 3
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.uint8]


def random_tensor(g: torch.Generator, shape, dtype):
    """Arbitrary bit patterns (NaNs included) of `dtype`: maps move bytes, never values."""
    n = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(dtype).reshape(shape)


def einops_rows(t, lhs, rhs, size, slices):
    """`rows` as torch ops: split the leading axes into the named sizes (row-major), narrow the
    sliced names, permute into the RHS order, merge the RHS groups; the last axis untouched."""
    order = [n for g in lhs for n in g]
    x = t.reshape(*[size[n] for n in order], t.shape[-1])
    out = dict(size)
    for n, (lo, hi) in slices.items():
        x = x.narrow(order.index(n), lo, hi - lo)
        out[n] = hi - lo
    x = x.permute(*[order.index(n) for g in rhs for n in g], len(order))
    return x.reshape(*[math.prod(out[n] for n in g) for g in rhs], t.shape[-1])


class Gen:
    def __init__(self, seed: int):
        self.r = random.Random(seed)
        self.g = torch.Generator().manual_seed(seed)
        self.map = {"ckptfs_map": 1, "name": f"random-{seed}", "tensors": []}
        self.config: dict = {}
        self.stored: dict = {}
        self.expected: dict = {}
        self.prefixed = self.r.random() < 0.3
        if self.prefixed:
            self.map["prefixes"] = ["model."]

    def p(self, pct):
        return self.r.random() * 100 < pct

    def store(self, name, shape, dtype):
        t = random_tensor(self.g, shape, dtype)
        self.stored[("model." if self.prefixed and self.p(50) else "") + name] = t
        return t

    def define(self, let, name, size, may_be_unknown):
        """Makes a rows name known (let, axes or config.json) or leaves it to be inferred."""
        if may_be_unknown and self.p(35):
            return False
        k = self.r.randrange(5)
        if k == 0:
            let[name] = str(size)
        elif k == 1:
            self.config["c_" + name] = size + 3
            let[name] = f"c_{name} - 3"
        elif k == 2:
            self.config["c_" + name] = size * 2
            self.map.setdefault("axes", {})[name] = f"(c_{name}) / 2"
        elif k == 3:
            self.config[name] = size
        else:
            self.map.setdefault("axes", {})[name] = f"{size} * 1 + 0"
        return True

    def index_entry(self, let, name, v):
        k = self.r.randrange(4)
        if k == 0:
            return str(v)
        if k == 1:
            return f"{v} + 0"
        if k == 2:
            self.config["c_" + name] = v
            return "c_" + name
        let[name] = str(v)
        return name

    def rows(self, let, pre, factors, tail, one_group):
        """A rows text for leading axes split into `factors`; the last `tail` groups (single
        names) stay as they are after the first RHS group. Returns (text, lhs, rhs, size, slices)."""
        lhs, size, free = [], {}, []
        for gi, fs in enumerate(factors):
            names, unknown = [], False
            for i, f in enumerate(fs):
                n = f"{pre}x{gi}_{i}"
                names.append(n)
                size[n] = f
                if not self.define(let, n, f, not unknown):
                    unknown = True
            lhs.append(names)
            if gi < len(factors) - tail:
                free += names
        self.r.shuffle(free)
        rhs = []
        if one_group:
            rhs.append(free)
        else:
            i = 0
            while i < len(free):
                k = self.r.randint(1, len(free) - i)
                rhs.append(free[i:i + k])
                i += k
        rhs += lhs[len(factors) - tail:]
        slices, items_of = {}, []
        known = lambda n: n in let or n in self.config or n in self.map.get("axes", {})  # noqa: E731
        for gi, g in enumerate(rhs):
            items = []
            for n in g:
                item = n
                if gi < len(rhs) - tail and self.p(35):
                    lo = self.r.randrange(size[n])
                    hi = self.r.randint(lo + 1, size[n])
                    slices[n] = (lo, hi)
                    hi_t = f"{n} - {size[n] - hi}" if known(n) and self.p(50) else str(hi)
                    lo_t = f"({lo} * 2) / 2" if self.p(20) else str(lo)
                    item = f"{n}[{lo_t}:{hi_t}]"
                items.append(item)
            items_of.append(items)
        fmt = lambda items: items[0] if len(items) == 1 and self.p(60) else "(" + " ".join(items) + ")"  # noqa: E731
        text = " ".join(fmt(g) for g in lhs) + " -> " + " ".join(fmt(i) for i in items_of)
        return text, lhs, rhs, size, slices

    def single(self, k):
        dtype = self.r.choice(DTYPES)
        rank = self.r.randint(1, 4)
        nidx = self.r.randint(1, min(2, rank - 1)) if rank > 1 and self.p(40) else 0
        shape = [self.r.randint(1, 3) for _ in range(nidx)]
        by_for = nidx > 0 and self.p(40)
        matched = not by_for and self.p(20)
        rest = rank - nidx
        use_rows = rest >= 2 and self.p(85)
        while True:
            factors = [[self.r.randint(1, 4) for _ in range(self.r.randint(1, 3) if use_rows else 1)]
                       for _ in range(rest - 1)]
            if math.prod(math.prod(f) for f in factors) <= 256:
                break
        shape += [math.prod(f) for f in factors] + [self.r.randint(1, 5)]
        rule, let, pre = {}, {}, f"r{k}"
        values = [self.r.randrange(shape[d]) for d in range(nidx)]
        index = ["L" if d == 0 and by_for else self.index_entry(let, f"{pre}i{d}", values[d])
                 for d in range(nidx)]
        hf, src = f"out.{k}", f"st.{k}.w"
        bindings = [None]
        if by_for:
            hf += ".{L}"
            bindings = list(range(shape[0]))
            rule["for"] = {"L": str(shape[0]) if self.p(50) else f"{pre}_n"}
            self.config[f"{pre}_n"] = shape[0]
        if matched:
            hf += ".{L}"
            bindings = sorted(self.r.sample([0, 1, 2, 5, 10, 11], self.r.randint(1, 3)))
            src = f"st.{k}.{{L}}.w"
        rule.update(hf=hf, **{"from": src})
        if nidx:
            rule["index"] = index
        r = self.rows(let, pre, factors, 0, False) if use_rows else None
        if r:
            rule["rows"] = r[0]
        if let:
            rule["let"] = let
        tensors = {b: self.store(src.replace("{L}", str(b)) if matched else src, shape, dtype)
                   for b in (bindings if matched else [None])}
        for b in bindings:
            t = tensors[b if matched else None]
            for d, v in enumerate(values):
                t = t[b if (d == 0 and by_for) else v]
            if r:
                t = einops_rows(t, *r[1:])
            self.expected[hf.replace("{L}", str(b))] = t
        if self.p(40):
            rule["shape"] = [str(x) for x in t.shape]
        self.map["tensors"].append(rule)

    def concat(self, k):
        dtype = self.r.choice(DTYPES)
        tail = [self.r.randint(1, 4) for _ in range(self.r.randint(0, 2))]
        by_for = self.p(25)
        nl = self.r.randint(1, 3)
        hf = f"cat.{k}" + (".{L}" if by_for else "")
        rule, rule_let, parts, pieces = {"hf": hf}, {}, [], []
        if by_for:
            rule["for"] = {"L": str(nl)}
        for pi in range(self.r.randint(1, 3)):
            part, part_let = {}, {}
            let = part_let if self.p(50) else rule_let
            pre = f"c{k}p{pi}"
            shape, index, values = [], [], []
            if by_for:
                shape.append(nl)
                index.append("L")
            if self.p(30):
                n = self.r.randint(1, 3)
                v = self.r.randrange(n)
                shape.append(n)
                values.append(v)
                index.append(self.index_entry(let, pre + "i", v))
            r = None
            if tail and self.p(70):
                factors = [[self.r.randint(1, 3) for _ in range(self.r.randint(1, 3))]]
                factors += [[x] for x in tail[:-1]]
                shape.append(math.prod(factors[0]))
                r = self.rows(let, pre, factors, len(factors) - 1, True)
            else:
                shape.append(self.r.randint(1, 4))
            shape += tail
            name = f"st.{k}.{pi}.w"
            t = self.store(name, shape, dtype)
            part["from"] = name
            if index:
                part["index"] = index
            if r:
                part["rows"] = r[0]
            if part_let:
                part["let"] = part_let
            parts.append(part)
            pieces.append((t, values, r))
        rule["concat"] = parts
        if rule_let:
            rule["let"] = rule_let
        for b in (range(nl) if by_for else [None]):
            outs = []
            for t, values, r in pieces:
                if by_for:
                    t = t[b]
                for v in values:
                    t = t[v]
                outs.append(einops_rows(t, *r[1:]) if r else t)
            self.expected[hf.replace("{L}", str(b))] = torch.cat(outs, 0)
        self.map["tensors"].append(rule)

    def make(self):
        for k in range(self.r.randint(1, 4)):
            (self.concat if self.p(30) else self.single)(k)
        if self.p(40):
            self.store(f"junk.{self.r.randrange(100)}.buf", [self.r.randint(1, 5)], torch.uint8)
            self.map["drop"] = ["junk.*"]
        if self.p(30):
            self.store("head.w", [2, 3], torch.float32)
            self.config["tied"] = True
            self.map["tensors"].append({"hf": "lm_head", "from": "head.w", "when": "!tied"})
        if self.p(20):
            self.map["tensors"].append({"hf": "maybe", "from": "absent.w", "optional": True})
        return self


# One map for several checkpoints: every size from the directory's config.json (a Llama-like
# RoPE permutation, Megatron-like stacked QKV split per query group, gate/up joined, a padded
# vocabulary cut).
SHARED_MAP = {
    "ckptfs_map": 1,
    "name": "shared",
    "axes": {"heads": "n_heads", "groups": "n_groups", "hd": "head_dim", "half": "hd / 2",
             "q": "heads / groups * hd"},
    "tensors": [
        {"hf": "rope.{L}", "from": "layers.{L}.wq", "rows": "(heads half two) -> (heads two half)",
         "let": {"two": "2"}, "shape": ["heads * hd", "dim"]},
        {"hf": "q.{L}", "from": "stack.qkv", "for": {"L": "n_layers"}, "index": ["L"],
         "let": {"part": "q + 2 * hd"}, "rows": "(groups part) -> (groups part[0:q])"},
        {"hf": "k.{L}", "from": "stack.qkv", "for": {"L": "n_layers"}, "index": ["L"],
         "let": {"part": "q + 2 * hd"}, "rows": "(groups part) -> (groups part[q:q+hd])"},
        {"hf": "v.{L}", "from": "stack.qkv", "for": {"L": "n_layers"}, "index": ["L"],
         "let": {"part": "q + 2 * hd"}, "rows": "(groups part) -> (groups part[q+hd:q+2*hd])"},
        {"hf": "fc1.{L}", "for": {"L": "n_layers"},
         "concat": [{"from": "stack.w1", "index": ["L"]}, {"from": "stack.w3", "index": ["L"]}],
         "shape": ["2 * ffn", "dim"]},
        {"hf": "emb", "from": "emb", "rows": "v -> v[0:vocab]", "shape": ["vocab", "dim"]},
    ],
    "drop": ["junk.*"],
}


def shared_case(seed: int):
    r = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    groups = r.choice([1, 2])
    c = {"n_heads": groups * r.choice([1, 2]), "n_groups": groups, "head_dim": r.choice([2, 4, 6]),
         "n_layers": r.randint(1, 3), "dim": r.randint(1, 5), "ffn": r.randint(1, 4),
         "vocab": r.randint(3, 9)}
    dtype = r.choice(DTYPES)
    heads, hd, nl, dim = c["n_heads"], c["head_dim"], c["n_layers"], c["dim"]
    q = heads // groups * hd
    part = q + 2 * hd
    stored = {f"layers.{layer}.wq": random_tensor(g, [heads * hd, dim], dtype) for layer in range(nl)}
    stored["stack.qkv"] = random_tensor(g, [nl, groups * part, dim], dtype)
    stored["stack.w1"] = random_tensor(g, [nl, c["ffn"], dim], dtype)
    stored["stack.w3"] = random_tensor(g, [nl, c["ffn"], dim], dtype)
    stored["emb"] = random_tensor(g, [c["vocab"] + r.randint(0, 3), dim], dtype)
    stored["junk.rope"] = random_tensor(g, [3], torch.uint8)
    want = {}
    for layer in range(nl):
        want[f"rope.{layer}"] = einops_rows(stored[f"layers.{layer}.wq"], [["heads", "half", "two"]],
                                            [["heads", "two", "half"]],
                                            {"heads": heads, "half": hd // 2, "two": 2}, {})
        qkv = stored["stack.qkv"][layer].reshape(groups, part, dim)
        want[f"q.{layer}"] = qkv[:, :q].reshape(-1, dim)
        want[f"k.{layer}"] = qkv[:, q:q + hd].reshape(-1, dim)
        want[f"v.{layer}"] = qkv[:, q + hd:].reshape(-1, dim)
        want[f"fc1.{layer}"] = torch.cat([stored["stack.w1"][layer], stored["stack.w3"][layer]])
    want["emb"] = stored["emb"][:c["vocab"]]
    return stored, c, want


def save(d: pathlib.Path, stored: dict, config: dict):
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: no_dist says so on purpose
        dcp.save({k: v.contiguous() for k, v in stored.items()}, checkpoint_id=str(d), no_dist=True)
    (d / "config.json").write_text(json.dumps(config))


def same_bits(a, b) -> bool:
    if a.dtype != b.dtype or list(a.shape) != list(b.shape):
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def assert_same(got: dict, want: dict, what: str):
    assert set(got) == set(want), f"{what}: names {sorted(got)} != {sorted(want)}"
    for n, t in want.items():
        assert got[n].dtype == t.dtype and list(got[n].shape) == list(t.shape), \
            f"{what}: {n} is {got[n].dtype} {list(got[n].shape)}, torch says {t.dtype} {list(t.shape)}"
        assert same_bits(got[n], t), f"{what}: {n} differs from torch's rearrangement"


def read_dir(d: pathlib.Path) -> dict:
    """Every tensor of a consolidated directory, checked against its index file."""
    out = {}
    files = sorted(d.glob("model-*.safetensors"))
    assert files, f"no model files in {d}: {sorted(p.name for p in d.iterdir())}"
    for f in files:
        out.update({k: v.clone() for k, v in safetensors_torch.load_file(str(f)).items()})
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(out)
    return out


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    root = tmp_path_factory.mktemp("maps-property")
    src, maps = root / "src", root / "maps"
    src.mkdir()
    maps.mkdir()
    out = []
    for seed in range(1, CONSOLIDATED + 1):
        c = Gen(seed).make()
        d = src / f"case{seed}"
        save(d, c.stored, c.config)
        path = maps / f"case{seed}.json"
        path.write_text(json.dumps(c.map))
        out.append((d, path, c))
    shared = root / "shared"
    shared.mkdir()
    for seed in range(SHARED):
        stored, config, want = shared_case(100 + seed)
        save(shared / f"ckpt{seed}", stored, config)
        out.append((shared / f"ckpt{seed}", None, (stored, config, want)))
    (maps / "shared.json").write_text(json.dumps(SHARED_MAP))
    return root, out


@pytest.mark.parametrize("i", range(CONSOLIDATED))
def test_consolidate_matches_torch(cases, i):
    root, all_cases = cases
    d, path, c = all_cases[i]
    # The reference interpreter agrees with torch first (the expected values are right), except
    # where a concat rule has a `let` of its own: map_ref gives each part only the part's `let`,
    # while format/model_map (and this generator) let the parts see the rule's too.
    if not any("concat" in r and "let" in r for r in c.map["tensors"]):
        hf, _ = map_ref.apply(c.map, c.stored, c.config)
        assert_same(hf, c.expected, f"map_ref, case {i + 1}")
    dst = root / "out" / d.name
    r = run("consolidate", d, dst, "--map", path, check=False)
    assert r.returncode == 0, f"consolidate case {i + 1}: {r.stderr}\nmap: {json.dumps(c.map)}"
    assert json.loads((dst / "config.json").read_text()) == c.config
    assert_same(read_dir(dst), c.expected, f"ckptfs, case {i + 1}, map {json.dumps(c.map)}")


def test_shared_map_through_one_mount(cases, tmp_path):
    root, all_cases = cases
    shared = [c for c in all_cases if c[1] is None]
    for d, _, (stored, config, want) in shared:
        hf, _ = map_ref.apply(SHARED_MAP, stored, config)
        assert_same(hf, want, f"map_ref, {d.name}")
    if not fuse_available():
        pytest.skip("needs root, /dev/fuse and fusermount3")
    mnt = tmp_path / "mnt"
    with Mount(root / "shared", mnt, opts=[f"map={root / 'maps' / 'shared.json'}"],
               log=str(tmp_path / "mnt.log")):
        for d, _, (stored, config, want) in shared:
            view = mnt / d.name
            assert json.loads((view / "config.json").read_text()) == config
            assert_same(read_dir(view), want, f"mount, {d.name}, config {config}")
