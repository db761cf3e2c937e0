"""map_ref (the pure-Python reference of docs/maps.md) against plain torch: the `rows` table of
the spec (RoPE order, a fused QKV split per query group, gate/up halves, vocabulary padding),
`index` with `for`, `concat`, `when` and `drop`, and the refusals the spec names. The maps'
tests (test_maps_*.py) rely on it; this keeps it honest. No mount, no framework."""

from __future__ import annotations

import pytest

import map_ref

torch = pytest.importorskip("torch")


def one(rule, stored, config=None, **top):
    m = {"ckptfs_map": 1, "name": "t", "tensors": [rule], **top}
    return map_ref.apply(m, stored, config or {})[0]


def test_rope_rows():
    heads, hd, dim = 3, 8, 5
    w = torch.randn(heads * hd, dim)
    got = one({"hf": "q", "from": "wq", "rows": "(heads half two) -> (heads two half)", "let": {"two": "2"}},
              {"wq": w}, {"num_attention_heads": heads, "head_dim": hd},
              axes={"heads": "num_attention_heads", "half": "head_dim / 2"})["q"]
    assert torch.equal(got, w.view(heads, hd // 2, 2, dim).transpose(1, 2).reshape(heads * hd, dim))


def test_fused_qkv_split_per_group():
    groups, per, hd, dim = 2, 3, 4, 6  # 3 query heads per group
    qkv = torch.randn(groups * (per + 2) * hd, dim)
    g = qkv.view(groups, per + 2, hd, dim)
    axes = {"groups": "2", "q": str(per * hd), "hd": str(hd)}
    cases = {"q": ("(groups part) -> (groups part[0:q])", g[:, :per]),
             "k": ("(groups part) -> (groups part[q:q+hd])", g[:, per:per + 1]),
             "v": ("(groups part) -> (groups part[q+hd:q+2*hd])", g[:, per + 1:])}
    for name, (rows, want) in cases.items():
        got = one({"hf": name, "from": "qkv", "rows": rows}, {"qkv": qkv}, axes=axes)[name]
        assert torch.equal(got, want.reshape(-1, dim)), name


def test_gate_up_halves_and_vocab_padding():
    fc1 = torch.randn(2 * 7, 4)
    gate = one({"hf": "g", "from": "fc1", "rows": "(two f) -> (two[0:1] f)", "let": {"two": "2"}}, {"fc1": fc1})["g"]
    up = one({"hf": "u", "from": "fc1", "rows": "(two f) -> (two[1:2] f)", "let": {"two": "2"}}, {"fc1": fc1})["u"]
    assert torch.equal(gate, fc1[:7]) and torch.equal(up, fc1[7:])
    emb = torch.randn(16, 4)
    got = one({"hf": "e", "from": "emb", "rows": "v -> v[0:vocab_size]"}, {"emb": emb}, {"vocab_size": 11})["e"]
    assert torch.equal(got, emb[:11])


def test_index_for_concat_when_drop():
    stack = torch.randn(3, 5, 4)  # 3 layers stacked
    m = {"ckptfs_map": 1, "name": "t", "tensors": [
        {"hf": "l.{L}.w", "from": "stack", "for": {"L": "n"}, "index": ["L"]},
        {"hf": "cat.{L}", "concat": [{"from": "a.{L}"}, {"from": "b.{L}", "index": ["0"]}]},
        {"hf": "head", "from": "head", "when": "!tie_word_embeddings"}],
        "drop": ["rope.*"]}
    stored = {"stack": stack, "a.0": torch.randn(2, 4), "b.0": torch.randn(1, 3, 4), "a.1": torch.randn(2, 4),
              "b.1": torch.randn(1, 3, 4), "head": torch.randn(2, 4), "rope.cache": torch.randn(2)}
    hf, _ = map_ref.apply(m, stored, {"n": 3, "tie_word_embeddings": True})
    assert list(hf) == ["l.0.w", "l.1.w", "l.2.w", "cat.0", "cat.1"]
    assert all(torch.equal(hf[f"l.{i}.w"], stack[i]) for i in range(3))
    assert torch.equal(hf["cat.1"], torch.cat([stored["a.1"], stored["b.1"][0]]))
    hf, _ = map_ref.apply(m, stored, {"n": 3, "tie_word_embeddings": False})
    assert "head" in hf


@pytest.mark.parametrize("rule,stored,config,message", [
    ({"hf": "x", "from": "w", "permute": True}, {"w": [4, 4]}, {}, "'permute' needs arithmetic"),
    ({"hf": "x", "from": "w", "transpose": True}, {"w": [4, 4]}, {}, "is True; only"),
    ({"hf": "x", "from": "w", "transpose": [-2, -1]}, {"w": [4]}, {}, "it needs two axes"),
    ({"hf": "x", "from": "w", "rows": "(a b) -> (b a)", "let": {"a": "3"}}, {"w": [8, 2]}, {}, "does not divide"),
    ({"hf": "x", "from": "w", "rows": "(a b) -> (a b)", "let": {"a": "3", "b": "3"}}, {"w": [8, 2]}, {}, "3 x 3 = 9"),
    ({"hf": "x", "from": "w", "rows": "v -> v[0:n]"}, {"w": [8, 2]}, {"n": 9}, "outside"),
    ({"hf": "x", "from": "w", "index": ["5"]}, {"w": [3, 2, 2]}, {}, "outside axis 0"),
    ({"hf": "x.{E}", "from": "w", "for": {"E": "2"}, "index": ["E"]}, {"w": [3, 2, 2]}, {}, "the rest would be lost"),
    ({"hf": "x", "concat": [{"from": "w"}, {"from": "w"}]}, {"w": [3, 2]}, {}, "reads a stored row twice"),
    ({"hf": "x", "from": "w", "shape": ["h"]}, {"w": [3, 2]}, {"h": 3}, "'shape' says"),
    ({"hf": "x", "from": "w", "shape": ["h / 2"]}, {"w": [3, 2]}, {"h": 3}, "does not divide exactly"),
    ({"hf": "x", "from": "w"}, {"w": [2], "extra": [2]}, {}, "'extra' is neither mapped nor dropped"),
    ({"hf": "x", "from": "l.{L}.w"}, {"l.0.w": [2]}, {}, "do not appear in 'hf'"),
])
def test_refusals(rule, stored, config, message):
    with pytest.raises(map_ref.MapError, match=message.replace("(", r"\(").replace("'", "'")):
        one(rule, {k: torch.zeros(v) for k, v in stored.items()}, config)


def test_strict_json():
    with pytest.raises(map_ref.MapError, match="duplicate key"):
        map_ref.load('{"ckptfs_map": 1, "name": "a", "name": "b", "tensors": []}')
    with pytest.raises(map_ref.MapError, match="unknown key"):
        map_ref.load({"ckptfs_map": 1, "name": "a", "tensors": [{"hf": "x", "from": "y"}], "extra": 1})
