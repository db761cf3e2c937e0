"""map_ref: a small pure-Python reference interpreter of ckptfs model maps (docs/maps.md).

It applies a map to a stored state dict (name -> torch.Tensor, the trainer's own names and
layouts) and a config.json (a dict), the way the mount is specified to, with torch ops instead
of byte runs, so a map can be checked in Python without the mount:

    m = map_ref.load(ROOT / "maps" / "torchtitan-llama3.json")
    hf, sources = map_ref.apply(m, stored, config)   # hf: HF name -> tensor, in output order
    map_ref.detect(m, stored)                        # whether the map's detect clause holds
    map_ref.choose(map_ref.builtin_maps(), stored)   # the first built-in whose clause holds

What it implements: the strict JSON (duplicate and unknown keys refused, the arithmetic keys
refused by name), expressions (+ - * / and parentheses, exact division, `|` alternatives,
dotted config paths, true/false as 1/0, null as missing; inside its own definition a name
means config.json's value, so `"head_dim": "head_dim | hidden_size / num_attention_heads"`
works), patterns with {NAME} captures (decimal, no leading zero) and `*` in `drop`,
`prefixes`, `axes`, rules (numbered from 1) with `from` or a `concat` list of parts, `index`,
`rows` (einops-style `LHS -> RHS` over the leading axes with `name[a:b]` slices), `let`,
`for`, `offset` (a size added to a capture where `hf` writes it), `shape`, `split_last` (the
last axis written as several, row-major), `transpose` ([-2, -1]: the last two axes swapped), `when` (`key` /
`!key`), `optional`, `drop`, `refuse` (stored tensors the map cannot serve, and why), and
`detect` (`all`, `any`, `none`, `format`). What it checks: every capture of `from` appears in `hf`, each HF name is
made once, every index and slice is within its axis, an `index` by a `for` capture counts
exactly the axis it selects from (no expert silently lost), the `rows` sizes match the stored
axes, no output reads a stored row twice (a pass over row ids), and every stored tensor is
read by some rule, dropped, or belongs to a rule whose `when` does not hold.
Errors are MapError with a message naming the rule or tensor. It is a reference for tests, not
the product: the caps and the fuzz-hardening of format/model_map are the C++ side's.
"""

from __future__ import annotations

import itertools
import json
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
MAPS = ROOT / "maps"

ARITHMETIC = ("transpose", "permute", "sum", "add", "mean", "scale", "mul", "cast", "dtype", "reshape", "view")
TOP_KEYS = {"ckptfs_map", "name", "about", "detect", "prefixes", "axes", "tensors", "drop", "hf_config",
            "hf_config_requires", "refuse"}
RULE_KEYS = {"hf", "from", "concat", "index", "rows", "let", "for", "offset", "shape", "split_last", "transpose", "when",
             "optional"}
PART_KEYS = {"from", "index", "rows", "let"}
DETECT_KEYS = {"all", "any", "none", "format"}
NAME_RE = re.compile(r"[a-z0-9._-]{1,64}")
CAPTURE_RE = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


class MapError(ValueError):
    pass


# --- loading ---------------------------------------------------------------------------------

def _no_duplicates(pairs):
    seen = {}
    for k, v in pairs:
        if k in seen:
            raise MapError(f"duplicate key {k!r}")
        seen[k] = v
    return seen


def _check_keys(obj, allowed, what):
    if not isinstance(obj, dict):
        raise MapError(f"{what}: not an object")
    for k in obj:
        if k in allowed:
            continue
        if k in ARITHMETIC:
            raise MapError(f"{what}: {k!r} needs arithmetic on the bytes; a zero-copy map cannot do it")
        raise MapError(f"{what}: unknown key {k!r}")


def _str_list(v, what):
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise MapError(f"{what}: not a list of strings")
    return v


def _size_list(v, what):
    """A list of sizes: expressions, or bare non-negative integers (docs/maps.md)."""
    ok = lambda s: isinstance(s, str) or (isinstance(s, int) and not isinstance(s, bool) and s >= 0)  # noqa: E731
    if not isinstance(v, list) or not all(ok(s) for s in v):
        raise MapError(f"{what}: not a list of sizes")
    return v


def _str_dict(v, what):
    # Values are expressions; a bare non-negative integer (`{"two": 2}`) is taken as its literal.
    ok = lambda s: isinstance(s, str) or (isinstance(s, int) and not isinstance(s, bool) and s >= 0)  # noqa: E731
    if not isinstance(v, dict) or not all(ok(s) for s in v.values()):
        raise MapError(f"{what}: not an object of expressions")
    return v


def load(src) -> dict:
    """A map from a path, a JSON string or an already parsed object, validated."""
    if isinstance(src, dict):
        m = src
    else:
        is_text = isinstance(src, str) and src.lstrip().startswith("{")
        text = src if is_text else pathlib.Path(src).read_text()
        m = json.loads(text, object_pairs_hook=_no_duplicates)
    _check_keys(m, TOP_KEYS, "map")
    if m.get("ckptfs_map") != 1 or isinstance(m.get("ckptfs_map"), bool):
        raise MapError("map: 'ckptfs_map' must be 1")
    if not isinstance(m.get("name"), str) or not NAME_RE.fullmatch(m["name"]):
        raise MapError("map: 'name' must match [a-z0-9._-]{1,64}")
    if "about" in m and not isinstance(m["about"], str):
        raise MapError("map: 'about' is not a string")
    if "detect" in m:
        _check_keys(m["detect"], DETECT_KEYS, "detect")
        for k in ("all", "any", "none"):
            if k in m["detect"]:
                _str_list(m["detect"][k], f"detect.{k}")
        if "format" in m["detect"] and not isinstance(m["detect"]["format"], str):
            raise MapError("detect.format is not a string")
    _str_list(m.get("prefixes", []), "prefixes")
    _str_dict(m.get("axes", {}), "axes")
    _str_list(m.get("drop", []), "drop")
    if not isinstance(m.get("refuse", []), list):
        raise MapError("map: 'refuse' is not a list")
    for i, r in enumerate(m.get("refuse", []), 1):
        _check_keys(r, {"from", "why"}, f"refuse {i}")
        if not isinstance(r.get("from"), str) or not isinstance(r.get("why"), str) or not r["why"]:
            raise MapError(f"refuse {i}: needs 'from' (a pattern) and 'why' (one line)")
    if not isinstance(m.get("tensors"), list) or not m["tensors"]:
        raise MapError("map: 'tensors' must be a non-empty list")
    for i, r in enumerate(m["tensors"], 1):
        what = f"rule {i} ({r.get('hf')!r})" if isinstance(r, dict) else f"rule {i}"
        _check_keys(r, RULE_KEYS, what)
        if not isinstance(r.get("hf"), str):
            raise MapError(f"{what}: 'hf' must be a string")
        parts = _parts(r, what)
        for p in parts:
            _check_part(p, what)
        if "for" in r:
            _str_dict(r["for"], f"{what}: for")
        if "shape" in r:
            _size_list(r["shape"], f"{what}: shape")
        if "split_last" in r and (not _size_list(r["split_last"], f"{what}: split_last") or len(r["split_last"]) > 16):
            raise MapError(f"{what}: 'split_last' must be a list of 1 to 16 sizes")
        if "transpose" in r:
            if r["transpose"] != [-2, -1] or any(isinstance(x, bool) for x in r["transpose"]):
                raise MapError(f"{what}: 'transpose' is {r['transpose']!r}; only [-2, -1] (the last two axes "
                               f"swapped) is served, another permutation needs arithmetic on the bytes")
            if "concat" in r or "rows" in r or "split_last" in r:
                raise MapError(f"{what}: 'transpose' goes with one 'from', without 'rows' or 'split_last'")
        if "when" in r and (not isinstance(r["when"], str) or not r["when"].lstrip("!")):
            raise MapError(f"{what}: 'when' must be a config key or its negation")
        if "optional" in r and not (isinstance(r["optional"], bool) or r["optional"] == "absent"):
            raise MapError(f"{what}: 'optional' must be true, false or \"absent\"")
        hf_caps = set(CAPTURE_RE.findall(r["hf"]))
        for p in parts:
            missing = set(CAPTURE_RE.findall(p["from"])) - hf_caps
            if missing:
                raise MapError(f"{what}: capture(s) {sorted(missing)} of 'from' do not appear in 'hf'")
        for c in r.get("for", {}):
            if c not in hf_caps:
                raise MapError(f"{what}: 'for' capture {c!r} does not appear in 'hf'")
        if "offset" in r:
            _str_dict(r["offset"], f"{what}: offset")
        for c in r.get("offset", {}):
            if c not in hf_caps:
                raise MapError(f"{what}: 'offset' capture {c!r} does not appear in 'hf'")
        for c in CAPTURE_RE.findall(parts[0]["from"]):
            if c in r.get("for", {}):
                raise MapError(f"{what}: capture {c!r} is both matched and in 'for'")
    return m


def _parts(r, what):
    """The rule's parts: [rule] for a `from`, the list of a `concat` (exactly one of the two)."""
    if ("from" in r) == ("concat" in r):
        raise MapError(f"{what}: exactly one of 'from' and 'concat'")
    if "from" in r:
        return [r]
    c = r["concat"]
    if not isinstance(c, list) or not c or not all(isinstance(p, dict) for p in c):
        raise MapError(f"{what}: 'concat' is not a list of parts")
    if "index" in r or "rows" in r:
        raise MapError(f"{what}: 'index' and 'rows' belong in each 'concat' part")
    return c


def _check_part(p, what):
    if p is not None and "hf" not in p:  # a concat part
        _check_keys(p, PART_KEYS, what + " part")
    if not isinstance(p.get("from"), str):
        raise MapError(f"{what}: part 'from' must be a pattern")
    if "index" in p:
        _str_list(p["index"], f"{what}: index")
    if "rows" in p and not isinstance(p["rows"], str):
        raise MapError(f"{what}: 'rows' must be a string")
    if "let" in p:
        _str_dict(p["let"], f"{what}: let")


def builtin_maps() -> list[dict]:
    """Every maps/*.json of the repository, loaded, in the detection order of maps/meson.build
    (the order the C++ side tries them in); files it does not list come last, by name."""
    listed = re.findall(r"'([^']+\.json)'", (MAPS / "meson.build").read_text())
    files = [MAPS / n for n in listed] + [p for p in sorted(MAPS.glob("*.json")) if p.name not in listed]
    return [load(p) for p in files]


# --- expressions -----------------------------------------------------------------------------

_TOKEN = re.compile(r"\s*(?:(\d+)|([A-Za-z_][A-Za-z0-9_.]*)|(\S))")


class _Unresolved(Exception):
    def __init__(self, name):
        self.name = name


def _tokens(text):
    out, pos = [], 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            raise MapError(f"expression {text!r}: cannot read at {pos}")
        num, name, op = m.groups()
        if op is not None and op not in "+-*/()":
            raise MapError(f"expression {text!r}: unexpected {op!r}")
        out.append(("n", int(num)) if num is not None else ("v", name) if name is not None else ("o", op))
        pos = m.end()
    return out


def _eval_tokens(toks, lookup, text):
    pos = 0

    def peek():
        return toks[pos] if pos < len(toks) else (None, None)

    def atom():
        nonlocal pos
        kind, val = peek()
        if kind == "n":
            pos += 1
            return val
        if kind == "v":
            pos += 1
            return lookup(val)
        if (kind, val) == ("o", "("):
            pos += 1
            v = expr()
            if peek() != ("o", ")"):
                raise MapError(f"expression {text!r}: ')' expected")
            pos += 1
            return v
        raise MapError(f"expression {text!r}: a number, name or '(' expected")

    def term():
        nonlocal pos
        v = atom()
        while peek() in (("o", "*"), ("o", "/")):
            op = peek()[1]
            pos += 1
            w = atom()
            if op == "*":
                v *= w
            else:
                if w == 0 or v % w:
                    raise MapError(f"expression {text!r}: {v} / {w} does not divide exactly")
                v //= w
        return v

    def expr():
        nonlocal pos
        v = term()
        while peek() in (("o", "+"), ("o", "-")):
            op = peek()[1]
            pos += 1
            w = term()
            v = v + w if op == "+" else v - w
        return v

    v = expr()
    if pos != len(toks):
        raise MapError(f"expression {text!r}: unexpected {toks[pos][1]!r}")
    return v


class Env:
    """Named sizes: captures and row sizes (extra), a rule's `let`, the map's `axes`, config.json."""

    def __init__(self, config, axes=None, let=None, extra=None, parent=None):
        self.config, self.axes, self.let = config, axes or {}, let or {}
        self.extra = dict(extra or {})
        self.parent = parent
        self.cache, self.busy = {}, set()

    def child(self, let=None, extra=None):
        return Env(self.config, self.axes, let, extra, parent=self)

    def lookup(self, name):
        if name in self.extra:
            return self.extra[name]
        if name in self.cache:
            return self.cache[name]
        # Inside its own expression a name means what it would without the definition: an axis
        # `head_dim` = "head_dim | hidden_size / num_attention_heads" reads config.json's head_dim.
        src = self.let.get(name) if name in self.let and name not in self.busy else None
        if src is None and self.parent is None and name in self.axes and name not in self.busy:
            src = self.axes[name]
        if src is not None:
            self.busy.add(name)
            try:
                v = self.eval(src)
            finally:
                self.busy.discard(name)
            self.cache[name] = v
            return v
        if self.parent is not None:
            return self.parent.lookup(name)
        v = config_value(self.config, name)
        if v is None:
            raise _Unresolved(name)
        return v

    def eval(self, text):
        if isinstance(text, int) and not isinstance(text, bool):
            text = str(text)
        if not isinstance(text, str) or len(text) > 256:
            raise MapError(f"expression {text!r}: not a string of at most 256 characters")
        unresolved = []
        for alt in text.split("|"):
            toks = _tokens(alt)
            if not toks:
                raise MapError(f"expression {text!r}: an empty alternative")
            try:
                v = _eval_tokens(toks, self.lookup, text)
            except _Unresolved as e:
                unresolved.append(e.name)
                continue
            if v < 0:
                raise MapError(f"expression {text!r} is {v}, negative")
            return v
        raise MapError(f"expression {text!r}: {', '.join(repr(n) for n in unresolved)} not in config.json")


def config_value(config, name):
    """config.json's value at a dotted path as an integer (true 1, false 0), None where absent or null."""
    v = config
    for part in name.split("."):
        if not isinstance(v, dict) or part not in v:
            return None
        v = v[part]
    if v is None:
        return None
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, int) and v >= 0:
        return v
    raise MapError(f"config.json: {name!r} is {v!r}, not a non-negative integer")


# --- patterns --------------------------------------------------------------------------------

def _pattern_re(pattern, wildcard=False):
    out, pos, seen = [], 0, set()
    for m in CAPTURE_RE.finditer(pattern):
        out.append(_literal(pattern[pos:m.start()], wildcard))
        name = m.group(1)
        out.append(f"(?P={name})" if name in seen else f"(?P<{name}>0|[1-9][0-9]*)")
        seen.add(name)
        pos = m.end()
    out.append(_literal(pattern[pos:], wildcard))
    return re.compile("".join(out))


def _literal(s, wildcard):
    if wildcard:
        return ".*".join(re.escape(p) for p in s.split("*"))
    return re.escape(s)


def matches(pattern, names, wildcard=False):
    """{name: captures} for every name the pattern matches."""
    rx = _pattern_re(pattern, wildcard)
    out = {}
    for n in names:
        m = rx.fullmatch(n)
        if m:
            out[n] = {k: int(v) for k, v in m.groupdict().items()}
    return out


def substitute(pattern, binding):
    return CAPTURE_RE.sub(lambda m: str(binding[m.group(1)]), pattern)


# --- rows ------------------------------------------------------------------------------------

_ROWS_TOKEN = re.compile(r"\s*(?:(\()|(\))|([A-Za-z_][A-Za-z0-9_]*)(?:\[([^\]:]*):([^\]]*)\])?)")


def parse_rows(text):
    """'LHS -> RHS' as two lists of groups, each group a list of (name, slice or None)."""
    if text.count("->") != 1:
        raise MapError(f"rows {text!r}: one '->' expected")
    sides = []
    for side in text.split("->"):
        groups, cur, pos, side = [], None, 0, side.strip()
        while pos < len(side):
            m = _ROWS_TOKEN.match(side, pos)
            if not m or m.end() == pos:
                raise MapError(f"rows {text!r}: cannot read {side[pos:]!r}")
            op, cl, name, a, b = m.groups()
            if op:
                if cur is not None:
                    raise MapError(f"rows {text!r}: nested '('")
                cur = []
            elif cl:
                if cur is None or not cur:
                    raise MapError(f"rows {text!r}: unbalanced or empty '()'")
                groups.append(cur)
                cur = None
            else:
                item = (name, None if a is None else (a.strip(), b.strip()))
                (cur.append(item) if cur is not None else groups.append([item]))
            pos = m.end()
        if cur is not None:
            raise MapError(f"rows {text!r}: '(' not closed")
        sides.append(groups)
    lhs, rhs = sides
    lnames = [n for g in lhs for n, _ in g]
    if any(s is not None for g in lhs for _, s in g):
        raise MapError(f"rows {text!r}: slices belong on the right-hand side")
    if len(set(lnames)) != len(lnames):
        raise MapError(f"rows {text!r}: a name appears twice on the left-hand side")
    rnames = [n for g in rhs for n, _ in g]
    if sorted(rnames) != sorted(lnames):
        raise MapError(f"rows {text!r}: each left-hand name must appear exactly once on the right")
    if len(lnames) > 16:
        raise MapError(f"rows {text!r}: more than 16 names")
    return lhs, rhs


def apply_rows(t, text, env, what):
    """The rearrangement of every axis but the last of t (of the one axis of a 1-D t, when the
    left-hand side names it: single elements moved, a bias split like its weight); the new tensor."""
    lhs, rhs = parse_rows(text)
    if len(lhs) == t.dim() == 1:
        return apply_rows(t.unsqueeze(-1), text, env, what).squeeze(-1)
    lead = list(t.shape[:-1])
    if len(lhs) != len(lead):
        raise MapError(f"{what}: rows {text!r} names {len(lhs)} leading axes; the tensor has {len(lead)} "
                       f"(shape {list(t.shape)})")
    sizes = {}
    for ax, (group, n) in enumerate(zip(lhs, lead)):
        known, unknown = {}, []
        for name, _ in group:
            try:
                known[name] = env.lookup(name)
            except _Unresolved:
                unknown.append(name)
        if len(unknown) > 1:
            raise MapError(f"{what}: rows {text!r}: {unknown} are all unknown in one group")
        prod = 1
        for v in known.values():
            prod *= v
        if unknown:
            if prod == 0 or n % prod:
                raise MapError(f"{what}: axis {ax} is {n} rows; it does not divide by "
                               f"{' x '.join(f'{k}={v}' for k, v in known.items())} = {prod}")
            known[unknown[0]] = n // prod
        elif prod != n:
            raise MapError(f"{what}: axis {ax} is {n} rows; '{' '.join(g for g, _ in group)}' is "
                           f"{' x '.join(str(known[g]) for g, _ in group)} = {prod}")
        sizes.update(known)
    order = [n for g in lhs for n, _ in g]
    x = t.reshape(*[sizes[n] for n in order], t.shape[-1])
    senv = env.child(extra=sizes)
    out_sizes = {}
    for g in rhs:
        for name, sl in g:
            ax = order.index(name)
            if sl is None:
                out_sizes[name] = sizes[name]
                continue
            a, b = senv.eval(sl[0]), senv.eval(sl[1])
            if not 0 <= a < b <= sizes[name]:
                raise MapError(f"{what}: rows {text!r}: slice {name}[{a}:{b}] is outside 0..{sizes[name]}")
            x = x.narrow(ax, a, b - a)
            out_sizes[name] = b - a
    perm = [order.index(n) for g in rhs for n, _ in g] + [len(order)]
    x = x.permute(*perm)
    new = []
    for g in rhs:
        p = 1
        for n, _ in g:
            p *= out_sizes[n]
        new.append(p)
    return x.reshape(*new, t.shape[-1])


# --- applying a map --------------------------------------------------------------------------

def strip_prefixes(m, names):
    """stored name -> name as the map matches it (the first matching prefix stripped)."""
    out = {}
    for n in names:
        s = n
        for p in m.get("prefixes", []):
            if n.startswith(p):
                s = n[len(p):]
                break
        if s in out.values():
            raise MapError(f"stored tensors {n!r} and another are both {s!r} once the prefix is stripped")
        out[n] = s
    return out


def detect(m, names, fmt=""):
    """Whether the map's detect clause holds over the stored names (a map with none: False)."""
    d = m.get("detect")
    if not d:
        return False
    names = list(strip_prefixes(m, names).values())

    def hit(p):  # `*` matches any run of characters in detect too (docs/maps.md)
        return bool(matches(p, names, wildcard=True))

    return (all(hit(p) for p in d.get("all", [])) and (not d.get("any") or any(hit(p) for p in d["any"]))
            and not any(hit(p) for p in d.get("none", [])) and d.get("format", "") in fmt)


def refused(m, names):
    """(stored name, why) for the first stored tensor a `refuse` pattern of the map matches, or None.
    A detected map that refuses leaves the checkpoint under its stored names; a named one is refused."""
    for n, s in strip_prefixes(m, names).items():
        for r in m.get("refuse", []):
            if matches(r["from"], [s], wildcard=True):
                return n, r["why"]
    return None


def choose(maps, names, fmt=""):
    """The first map whose detect clause holds, or None."""
    return next((m for m in maps if detect(m, names, fmt)), None)


def _when(rule, config):
    w = rule.get("when")
    if w is None:
        return True
    neg = w.startswith("!")
    v = config_value(config, w.lstrip("!"))
    v = bool(v) if v is not None else False  # docs/maps.md: a key missing from config.json is false
    return (not v) if neg else v


def _bindings(rule, parts, local, env, what):
    """Every binding of the rule's captures, sorted by the captures in 'hf' order."""
    fors = {c: env.eval(e) for c, e in rule.get("for", {}).items()}
    for c, n in fors.items():
        if n > 1 << 20:
            raise MapError(f"{what}: 'for' {c} counts {n}, over 2^20")
    hf_caps = list(dict.fromkeys(CAPTURE_RE.findall(rule["hf"])))
    for c in hf_caps:
        if c not in fors and not any(c in CAPTURE_RE.findall(p["from"]) for p in parts):
            raise MapError(f"{what}: capture {c!r} of 'hf' is bound by neither 'from' nor 'for'")
    candidates = set()
    for p in parts:
        for caps in matches(p["from"], local).values():
            candidates.add(tuple(sorted((k, v) for k, v in caps.items() if k not in fors)))
    out = []
    for cand in candidates:
        for combo in itertools.product(*[range(n) for n in fors.values()]):
            b = dict(cand)
            b.update(zip(fors, combo))
            if all(k in b for p in parts for k in CAPTURE_RE.findall(p["from"])):
                ok = [substitute(p["from"], b) in local for p in parts]
                if any(ok) and not all(ok):
                    missing = [substitute(p["from"], b) for p, o in zip(parts, ok) if not o]
                    raise MapError(f"{what}: stored tensor(s) {missing} missing")
                if all(ok):
                    out.append(b)
    key = lambda b: tuple(b.get(c, -1) for c in hf_caps)  # noqa: E731
    return sorted({tuple(sorted(b.items())): b for b in out}.values(), key=key)


def apply(m, stored, config, *, check_coverage=True):
    """(hf, sources): the HF tensors the map makes of `stored` (name -> tensor), in output order,
    and per HF name a list of (stored name, rule text) saying where it came from."""
    import torch

    m = load(m)
    r = refused(m, stored)
    if r is not None:
        raise MapError(f"map {m['name']!r} cannot serve stored tensor {r[0]!r}: {r[1]}")
    env = Env(config, m.get("axes", {}))
    to_local = strip_prefixes(m, stored)
    local = {s: n for n, s in to_local.items()}  # stripped name -> stored name
    read, skipped = set(), set()
    hf, sources = {}, {}
    base = {n: k << 40 for k, n in enumerate(sorted(stored))}  # row ids unique across stored tensors
    for i, rule in enumerate(m["tensors"], 1):
        what = f"rule {i} ({rule['hf']!r})"
        parts = _parts(rule, what)
        if not _when(rule, config):
            for p in parts:
                skipped.update(local[s] for s in matches(p["from"], local))
            continue
        bindings = _bindings(rule, parts, local, env, what)
        if not bindings:
            if rule.get("optional"):
                continue
            raise MapError(f"{what}: no stored tensor matches {[p['from'] for p in parts]}")
        for b in bindings:
            oenv = env.child(let=rule.get("let", {}), extra=b)
            name = substitute(rule["hf"], {k: v + (oenv.eval(rule["offset"][k]) if k in rule.get("offset", {}) else 0)
                                           for k, v in b.items()})
            if name in hf:
                raise MapError(f"{what}: HF tensor {name!r} is made twice")
            pieces, ids, srcs = [], [], []
            for p in parts:
                src = local[substitute(p["from"], b)]
                penv = env.child(let=p.get("let", {}), extra=b) if p is not rule else \
                    env.child(let=rule.get("let", {}), extra=b)
                t = stored[src]
                rid = torch.arange(int(torch.tensor(t.shape[:-1]).prod()) if t.dim() > 1 else 1,
                                   dtype=torch.int64).reshape(*t.shape[:-1], 1)
                for j, e in enumerate(p.get("index", [])):
                    v = b[e] if e in b else penv.eval(e)
                    if t.dim() < 2:
                        raise MapError(f"{what}: index {j} on {src!r} of shape {list(t.shape)}: no leading axis left")
                    if not 0 <= v < t.shape[0]:
                        raise MapError(f"{what}: index {e}={v} is outside axis 0 of {src!r} ({t.shape[0]})")
                    if e in rule.get("for", {}) and env.eval(rule["for"][e]) != t.shape[0]:
                        raise MapError(f"{what}: 'for' {e} counts {env.eval(rule['for'][e])} but indexes an axis of "
                                       f"{t.shape[0]} in {src!r}: the rest would be lost")
                    t, rid = t[v], rid[v]
                if "rows" in p:
                    if len(parse_rows(p["rows"])[0]) == t.dim() == 1:  # elements moved: ids per element
                        rid = rid * t.shape[-1] + torch.arange(t.shape[-1])
                    t = apply_rows(t, p["rows"], penv, f"{what}: tensor {src!r}")
                    rid = apply_rows(rid, p["rows"], penv, f"{what}: tensor {src!r}")
                pieces.append(t)
                ids.append(rid.reshape(-1) + base[src])
                how = p.get("rows") or ("index " + ",".join(p["index"]) if "index" in p else "as stored")
                srcs.append((src, how))
                read.add(src)
            if len(pieces) > 1:
                if len({x.dtype for x in pieces}) != 1 or len({tuple(x.shape[1:]) for x in pieces}) != 1:
                    raise MapError(f"{what}: the concat parts disagree in dtype or trailing shape: "
                                   f"{[(str(x.dtype), list(x.shape)) for x in pieces]}")
                t = torch.cat(pieces, 0)
            else:
                t = pieces[0]
            allid = torch.cat(ids)
            if allid.unique().numel() != allid.numel():
                raise MapError(f"{what}: HF tensor {name!r} reads a stored row twice")
            if rule.get("transpose"):
                if t.dim() < 2:
                    raise MapError(f"{what}: 'transpose' of a tensor of shape {list(t.shape)}: it needs two axes")
                t = t.transpose(-2, -1)
            if "split_last" in rule:
                benv = env.child(let=rule.get("let", {}), extra=b)
                split = [benv.eval(e) for e in rule["split_last"]]
                prod = 1
                for v in split:
                    prod *= v
                if t.dim() == 0 or prod != t.shape[-1]:
                    raise MapError(f"{what}: the last axis of {name!r} ({list(t.shape)}) is not 'split_last' "
                                   f"{rule['split_last']} = {split}")
                t = t.reshape(*t.shape[:-1], *split)
            if "shape" in rule:
                benv = env.child(let=rule.get("let", {}), extra=b)
                want = [benv.eval(e) for e in rule["shape"]]
                if want != list(t.shape):
                    bad = next((k for k, (x, y) in enumerate(zip(want, t.shape)) if x != y), len(want))
                    raise MapError(f"{what}: HF tensor {name!r} is {list(t.shape)}; 'shape' says {want} "
                                   f"(axis {bad}: {rule['shape'][bad] if bad < len(rule['shape']) else 'rank'})")
            hf[name] = t.contiguous().clone()
            sources[name] = srcs
    if check_coverage:
        dropped = {n for p in m.get("drop", []) for n in matches(p, local, wildcard=True)}
        for s, n in local.items():
            if n not in read and n not in skipped and s not in dropped:
                raise MapError(f"stored tensor {n!r} is neither mapped nor dropped by map {m['name']!r}")
    return hf, sources


# --- hf_config: the config.json a map makes of a native config -------------------------------

def _native(native, key):
    v = native
    for part in key.split("."):
        if not isinstance(v, dict) or part not in v:
            return None
        v = v[part]
    return v


def _native_int(native, key):
    v = _native(native, key)
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, int) and v >= 0:
        return v
    return None


def _holds(native, cond):
    neg = cond.startswith("!")
    v = _native_int(native, cond.lstrip("!"))
    return bool(v) != neg


_OMIT = object()


def _scalar_eq(x, want):
    """An int or a bool element equal to `want` (bools as 0 and 1)."""
    return isinstance(x, (bool, int)) and int(x) == int(want)


class _NativeEnv(Env):
    """Expressions over a native config's fields (no axes, no lets)."""

    def __init__(self, native):
        super().__init__({})
        self.native = native

    def lookup(self, name):
        v = _native_int(self.native, name)
        if v is None:
            raise _Unresolved(name)
        return v


def _render(t, native, where, what):
    if isinstance(t, list):
        return [x for x in (_render(e, native, f"{where}[{i}]", what) for i, e in enumerate(t)) if x is not _OMIT]
    if not isinstance(t, dict):
        return t
    if not any(k.startswith("$") for k in t):
        out = {}
        for k, v in t.items():
            x = _render(v, native, f"{where}.{k}", what)
            if x is not _OMIT:
                out[k] = x
        return out
    kinds = [k for k in t if k in ("$int", "$bool", "$copy", "$leading", "$map", "$refuse")]
    if len(kinds) != 1 or set(t) - {"$int", "$bool", "$copy", "$leading", "$map", "$refuse", "of", "then", "cases",
                                    "if", "else"}:
        raise MapError(f"hf_config {where!r}: a computed value has exactly one of $int, $bool, $copy, $leading, "
                       f"$map, $refuse, and 'if', 'else'")
    if ("$leading" in t) != ("of" in t and "then" in t) or ("$leading" not in t and ("of" in t or "then" in t)):
        raise MapError(f"hf_config {where!r}: 'of' and 'then' go together with $leading")
    if ("$map" in t) != ("cases" in t):
        raise MapError(f"hf_config {where!r}: 'cases' goes with $map, and $map needs it")

    def otherwise(why):
        if "else" in t:
            return _render(t["else"], native, where, what)
        if why is None:
            return _OMIT
        raise MapError(f"hf_config {where!r}: {why} in {what}")

    if "if" in t and not _holds(native, t["if"]):
        return otherwise(None)
    if "$int" in t:
        env = _NativeEnv(native)
        try:
            return env.eval(t["$int"])
        except MapError as e:
            if "not in config.json" in str(e):
                return otherwise(str(e))
            raise
    if "$bool" in t:
        key = t["$bool"].lstrip("!")
        v = _native(native, key)
        if not isinstance(v, (bool, int)):
            return otherwise(f"{key!r} is not a boolean")
        return bool(v) != t["$bool"].startswith("!")
    if "$leading" in t:
        # the count of leading elements equal to `of`, every later one `then`; a scalar stands
        # for a list of itself throughout (Megatron-LM's moe_layer_freq 1)
        key, v = t["$leading"], _native(native, t["$leading"])
        if v is None:
            if "else" in t:
                return _render(t["else"], native, where, what)
            raise MapError(f"hf_config {where!r}: no value for {key} in {what}")
        if not isinstance(v, list):
            if _scalar_eq(v, t["then"]):
                return 0
            raise MapError(f"hf_config {where!r}: {key} is {v!r}: neither a list nor {t['then']!r} in {what}")
        n = 0
        while n < len(v) and _scalar_eq(v[n], t["of"]):
            n += 1
        for i in range(n, len(v)):
            if not _scalar_eq(v[i], t["then"]):
                raise MapError(f"hf_config {where!r}: {key}[{i}] is {v[i]!r}: after the leading {t['of']!r} every "
                               f"element must be {t['then']!r} in {what}")
        return n
    if "$refuse" in t:
        raise MapError(f"hf_config {where!r}: {t['$refuse']} in {what}")
    if "$map" in t:
        # the case a value selects: a string as it is, true/false, a number equal to the case's
        # number (1, 1.0, 1e0 alike), "null" for no value (absent or null)
        key, v, cases = t["$map"], _native(native, t["$map"]), t["cases"]

        def number(text):
            try:
                return float(text)
            except ValueError:
                return None

        if v is None:
            hit = "null" if "null" in cases else None
        elif isinstance(v, bool):
            hit = ("true" if v else "false") if ("true" if v else "false") in cases else None
        elif isinstance(v, str):
            hit = v if v in cases else None
        elif isinstance(v, (int, float)):
            hit = next((c for c in cases if number(c) is not None and number(c) == v), None)
        else:
            return otherwise(f"{key!r} is {type(v).__name__}, not a string, a number or a bool")
        if hit is not None:
            return _render(cases[hit], native, f"{where}[{hit}]", what)
        if v is None:
            return otherwise(f"no value for {key}")
        return otherwise(f"{key} is {v!r}, not one of {', '.join(cases)}")
    for alt in (a.strip() for a in t["$copy"].split("|")):
        v = _native(native, alt)
        if v is not None:
            return v
    return otherwise(f"no value for {t['$copy']!r}")


def hf_config(m, native, what="the native config"):
    """The config.json the map's `hf_config` template makes of `native` (a dict: Megatron-LM's
    args), after `hf_config_requires`; MapError naming the key or field otherwise."""
    m = load(m)
    if not isinstance(m.get("hf_config"), dict):
        raise MapError(f"map {m['name']!r} has no 'hf_config' template")
    for k, want in m.get("hf_config_requires", {}).items():
        v = _native(native, k)
        if v is not None and v != want:
            raise MapError(f"map {m['name']!r} reads only models with {k} = {want!r} (hf_config_requires); "
                           f"{what} has {v!r}")
    out = {}
    for k, v in m["hf_config"].items():
        x = _render(v, native, k, what)
        if x is not _OMIT:
            out[k] = x
    return out
