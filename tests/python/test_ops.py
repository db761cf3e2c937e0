"""Operations (issue 11): version, man page against --help, status, systemd units, install.

Mount tests need root and /dev/fuse (skipped otherwise, never faked); the rest run anywhere
the binary is built.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess

import pytest

from conftest import BIN, ROOT, Mount, requires_fuse, run, wait_for
from shardgen import llama_like, write_checkpoint

SUBCOMMANDS = ["mount", "inspect", "verify", "consolidate", "status", "version"]
MAN = ROOT / "man" / "ckptfs.1"


# --- version ------------------------------------------------------------------------------

def test_version_names_libraries_and_features():
    meson = (ROOT / "meson.build").read_text()
    want = re.search(r"version\s*:\s*'([^']+)'", meson).group(1)
    for argv in (["--version"], ["version"], ["-V"]):
        out = run(*argv).stdout
        assert out.splitlines()[0] == f"ckptfs {want}", out
        assert re.search(r"^libfuse 3\.\d+ \(built\), 3\.\d+\.\d+ \(running\)$", out, re.M), out
        assert re.search(r"^spdlog \d+\.\d+\.\d+$", out, re.M), out
        assert re.search(r"^fmt \d+\.\d+\.\d+$", out, re.M), out
        assert re.search(r"^features: openmpi=(yes|no) cuda=(yes|no) nccl=(yes|no) sd_notify=yes$",
                         out, re.M), out
    assert run("version", "--help").stdout.startswith("usage: ckptfs version")
    assert run("version", "extra", check=False).returncode == 2


# --- man page -------------------------------------------------------------------------------

def roff_text(s: str) -> str:
    """The plain text of roff source: escapes and font switches dropped."""
    s = s.replace(r"\-", "-").replace(r"\(em", "-").replace(r"\e", "\\")
    s = re.sub(r"\\f[BIRP]", "", s)
    s = re.sub(r"\\[&|^]", "", s)
    return s


def man_sections() -> dict[str, list[str]]:
    """Lines of the man page by subsection: `.SS name` (a subcommand) or `.SH name`."""
    out: dict[str, list[str]] = {}
    cur = None
    for line in MAN.read_text().splitlines():
        m = re.match(r"\.S[HS]\s+\"?([^\"]+)\"?", line)
        if m:
            cur = m.group(1).strip()
            out[cur] = []
        elif cur is not None:
            out[cur].append(line)
    return out


def man_tags(lines: list[str]) -> list[str]:
    """The tag lines of .TP paragraphs (the option names) as plain text."""
    tags = []
    for i, line in enumerate(lines):
        if line.strip() == ".TP" and i + 1 < len(lines):
            tag = re.sub(r"^\.(B|I|BI|BR|IR|RB)\s+", "", lines[i + 1])
            tags.append(roff_text(tag).replace('"', ""))
    return tags


FLAG = re.compile(r"(?<![\w-])(--?[a-zA-Z][\w-]*)")


def help_flags(cmd: str) -> set[str]:
    """Every -x / --long option named in the options list of `ckptfs CMD --help`."""
    text = run(cmd, "--help").stdout
    flags = set()
    in_opts = False
    for line in text.splitlines():
        if line == "options:":
            in_opts = True
            continue
        if in_opts and line and not line.startswith(" "):
            in_opts = False
        if in_opts and re.match(r"^  -", line):
            col = re.split(r"\s{2,}", line.strip())[0]
            flags |= set(FLAG.findall(col))
    return flags


def split_o_names(col: str) -> set[str]:
    return {m.group(0) for part in col.split(", ") if (m := re.match(r"[a-z_]+", part.strip()))}


def help_o_options() -> set[str]:
    """The names of the ckptfs -o options in `ckptfs mount --help`."""
    text = run("mount", "--help").stdout
    names = set()
    in_o = False
    for line in text.splitlines():
        if line.startswith("ckptfs -o options:"):
            in_o = True
            continue
        if in_o and re.match(r"^  [a-z]", line):
            names |= split_o_names(re.split(r"\s{2,}", line.strip())[0])
    return names


def test_man_page_matches_help():
    assert MAN.exists()
    sections = man_sections()
    top = run("--help").stdout
    listed = set(re.findall(r"^  ([a-z]+) ", top, re.M))
    assert listed == set(SUBCOMMANDS), listed
    for cmd in SUBCOMMANDS:
        name = f"ckptfs {cmd}"
        assert name in sections, f"man page has no .SS \"{name}\" section"
        in_man = set()
        for tag in man_tags(sections[name]):
            in_man |= set(FLAG.findall(tag))
        in_help = help_flags(cmd)
        assert in_help, f"no options parsed from 'ckptfs {cmd} --help'"
        assert in_help - in_man == set(), f"{cmd}: in --help, not in the man page"
        assert in_man - in_help == set(), f"{cmd}: in the man page, not in --help"
    assert "MOUNT OPTIONS" in sections
    in_man = set()
    for tag in man_tags(sections["MOUNT OPTIONS"]):
        in_man |= split_o_names(tag)
    in_help = help_o_options()
    assert len(in_help) > 10, in_help
    assert in_help - in_man == set(), "-o options in --help, not in the man page"
    assert in_man - in_help == set(), "-o options in the man page, not in --help"


def test_man_page_renders_cleanly():
    r = subprocess.run(["man", "--warnings", "-l", "-Tutf8", str(MAN)], capture_output=True,
                       text=True, env={**os.environ, "MANWIDTH": "100"})
    if r.returncode != 0 and "not found" in r.stderr:
        pytest.skip("man not installed")
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip() == "", r.stderr
    plain = re.sub(".\b", "", r.stdout)  # overstrike bold and underline
    assert "ckptfs status" in plain and "MOUNT OPTIONS" in plain


# --- status -------------------------------------------------------------------------------

def status(mnt, *extra):
    return run("status", mnt, *extra)


@requires_fuse
def test_status_through_a_real_mount(tmp_path):
    src = tmp_path / "src"
    good = src / "good"
    bad = src / "bad"
    good.mkdir(parents=True)
    bad.mkdir(parents=True)
    write_checkpoint(str(good), llama_like(layers=1, files=1, world=2), world=2)
    write_checkpoint(str(bad), llama_like(layers=1, files=1, world=2), world=2)
    os.truncate(bad / "shard-00002-model-00001-of-00001.safetensors", 20)  # header cut short
    (src / "plain.txt").write_text("x" * 10000)
    # prefetch=off: every byte read is a read request (pushed bytes count under "prefetch").
    with Mount(src, tmp_path / "mnt", opts=["prefetch=off"]) as m:
        mnt = pathlib.Path(m.mnt)
        # Hidden from listings, there to whoever names it.
        assert ".ckptfs" not in os.listdir(mnt)
        ls = subprocess.run(["ls", "-a", str(mnt)], capture_output=True, text=True, check=True)
        assert ".ckptfs" not in ls.stdout.split(), ls.stdout
        assert os.listdir(mnt / ".ckptfs") == ["status.json"]
        # Read-only, whatever the caller.
        with pytest.raises(OSError):
            open(mnt / ".ckptfs" / "status.json", "w")
        with pytest.raises(OSError):
            (mnt / ".ckptfs" / "other").write_text("x")
        with pytest.raises(OSError):
            (mnt / "sub" / ".ckptfs").mkdir(parents=True)

        os.listdir(mnt / "good")
        os.listdir(mnt / "bad")
        s1 = json.loads(status(mnt, "--json").stdout)
        assert s1["source"] == str(src)
        by_path = {c["path"]: c for c in s1["checkpoints"]["list"]}
        assert by_path[str(good)]["state"] == "serving", s1
        assert by_path[str(good)]["files"] == 1
        assert by_path[str(bad)]["state"] == "refused", s1
        assert any("shard-00002" in p and "header" in p
                   for p in by_path[str(bad)]["problems"]), by_path[str(bad)]
        assert s1["checkpoints"]["serving"] == 1 and s1["checkpoints"]["refused"] == 1
        assert s1["checkpoints"]["refused_total"] >= 1

        # bytes served grows by at least what a read returns
        data = (mnt / "good" / "model-00001-of-00001.safetensors").read_bytes()
        assert (mnt / "plain.txt").read_bytes() == b"x" * 10000
        s2 = json.loads((mnt / ".ckptfs" / "status.json").read_text())
        assert s2["reads"]["bytes"] >= s1["reads"]["bytes"] + len(data) + 10000
        assert s2["reads"]["requests"] > s1["reads"]["requests"]
        for key in ("writes", "prefetch", "errors", "cache", "pid", "uptime_s", "version"):
            assert key in s2, key
        assert s2["pid"] == m.proc.pid

        human = status(mnt).stdout
        assert "1 serving" in human and "1 refused" in human, human
        assert re.search(r"refused\s+" + re.escape(str(bad)), human), human
        assert "reads:" in human and "errors: 0" in human, human
    r = run("status", tmp_path, check=False)
    assert r.returncode == 1 and "not a ckptfs mount" in r.stderr, r.stderr
