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

SUBCOMMANDS = ["mount", "inspect", "verify", "consolidate", "load", "status", "version"]
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
        # plain.txt is read by the kernel from SRC where read passthrough is on (the default
        # as root with write passthrough): a backed open, no read request.
        plain_backed = s2["reads"]["backed_opens"] > s1["reads"]["backed_opens"]
        assert s2["reads"]["bytes"] >= (s1["reads"]["bytes"] + len(data)
                                        + (0 if plain_backed else 10000))
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


# --- systemd ------------------------------------------------------------------------------

UNIT_IN = ROOT / "systemd" / "ckptfs@.service.in"


def unit_lines(text: str) -> dict[str, list[str]]:
    """Key -> values of a unit file (all sections; continuation lines are not used here)."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line[0] in "#;[":
            continue
        k, _, v = line.partition("=")
        out.setdefault(k.strip(), []).append(v.strip())
    return out


def read_env_file(path) -> dict[str, str]:
    """An EnvironmentFile= as systemd reads it: KEY=VALUE lines, # comments, quotes removed."""
    env = {}
    for line in pathlib.Path(path).read_text().splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        k, _, v = line.partition("=")
        v = v.strip()
        if len(v) >= 2 and v[0] == v[-1] and v[0] in "\"'":
            v = v[1:-1]
        env[k.strip()] = v
    return env


def expand_exec(line: str, env: dict[str, str]) -> list[str]:
    """systemd's ExecStart= expansion: words split as a shell would (quotes honoured, no
    globbing), then ${VAR} replaced as one word and $VAR split on white space."""
    import shlex
    argv = []
    for word in shlex.split(line):
        if (m := re.fullmatch(r"\$\{(\w+)\}", word)):
            argv.append(env.get(m.group(1), ""))
        elif (m := re.fullmatch(r"\$(\w+)", word)):
            argv.extend(env.get(m.group(1), "").split())
        else:
            argv.append(re.sub(r"\$\{(\w+)\}", lambda x: env.get(x.group(1), ""), word))
    return argv


def configured_unit(tmp_path, bindir) -> pathlib.Path:
    unit = tmp_path / "units" / "ckptfs@test.service"
    unit.parent.mkdir(exist_ok=True)
    unit.write_text(UNIT_IN.read_text().replace("@BINDIR@", str(bindir)))
    return unit


def test_unit_settings():
    u = unit_lines(UNIT_IN.read_text())
    assert u["Type"] == ["notify"]
    assert u["EnvironmentFile"] == ["/etc/ckptfs/%i.conf"]
    assert u["Restart"] == ["on-failure"]
    assert u["DeviceAllow"] == ["/dev/fuse rw"]
    assert "CAP_SYS_ADMIN" in u["CapabilityBoundingSet"][0]
    # Nothing that gives the service its own mount namespace: the mount would be invisible.
    for k in ("ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateDevices", "ReadOnlyPaths",
              "ProtectKernelTunables", "ProtectControlGroups", "PrivateMounts", "TemporaryFileSystem",
              "ProtectClock", "ProtectKernelModules", "ProtectKernelLogs", "BindPaths"):
        assert k not in u, k
    assert " -f " in u["ExecStart"][0]
    assert u["ExecStop"][0].split()[1:] == ["-u", "${MNT}"]


@pytest.mark.skipif(not os.path.exists("/usr/bin/systemd-analyze"), reason="no systemd-analyze")
def test_systemd_analyze_verify(tmp_path):
    unit = configured_unit(tmp_path, pathlib.Path(BIN).parent)
    mnt_unit = tmp_path / "units" / "mnt-checkpoints.mount"
    mnt_unit.write_text((ROOT / "systemd" / "mnt-checkpoints.mount").read_text())
    for u in (unit, mnt_unit):
        r = subprocess.run(["systemd-analyze", "verify", "--man=no", str(u)],
                           capture_output=True, text=True)
        # Complaints about other units on this machine (none of ours) are not ours to fix.
        ours = [l for l in r.stderr.splitlines() if u.name in l or "ckptfs" in l]
        assert r.returncode == 0 and not ours, r.stderr


@requires_fuse
def test_unit_execstart_and_execstop_as_systemd_runs_them(tmp_path):
    """Runs the unit's ExecStart= with its EnvironmentFile= expanded as systemd does, with a
    NOTIFY_SOCKET: READY=1 comes once the mount serves; ExecStop= unmounts, STOPPING=1."""
    import socket
    src = tmp_path / "src dir"  # a space: ${SRC} must stay one word
    (src / "step1").mkdir(parents=True)
    write_checkpoint(str(src / "step1"), llama_like(layers=1, files=1, world=2), world=2)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    conf = tmp_path / "test.conf"
    conf.write_text(f'# written by the test\nSRC="{src}"\nMNT={mnt}\nOPTIONS=ro,settle=0\n')
    unit = unit_lines(configured_unit(tmp_path, pathlib.Path(BIN).parent).read_text())
    env = {}
    for e in unit.get("Environment", []):
        k, _, v = e.partition("=")
        env[k] = v
    env.update(read_env_file(conf))
    pre = expand_exec(unit["ExecStartPre"][0].lstrip("-"), env)
    assert pre == ["/usr/bin/fusermount3", "-u", "-z", str(mnt)], pre
    subprocess.run(pre, capture_output=True)  # "-": its failure (nothing mounted) is ignored
    start = expand_exec(unit["ExecStart"][0], env)
    stop = expand_exec(unit["ExecStop"][0], env)
    assert start[:5] == [BIN, "mount", "-f", str(src), str(mnt)], start
    assert stop == ["/usr/bin/fusermount3", "-u", str(mnt)], stop

    sock_path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(sock_path)
    sock.settimeout(20)
    # The unit's own command line; the test waits for READY=1 itself (probe=None).
    daemon = Mount(src, mnt, argv=start, env={"NOTIFY_SOCKET": sock_path}, probe=None,
                   log=str(tmp_path / "daemon.log"))
    proc = daemon.start().proc
    try:
        ready = sock.recv(4096).decode()
        assert "READY=1" in ready.splitlines(), ready
        assert f"STATUS=serving {src} at {mnt}" in ready, ready
        assert os.path.ismount(mnt)  # READY=1 comes once the mount is in place
        assert os.listdir(mnt / "step1") == ["model-00001-of-00001.safetensors",
                                             "model.safetensors.index.json"]
        with pytest.raises(OSError):
            (mnt / "x").write_text("read-only")
        assert json.loads(run("status", mnt, "--json").stdout)["read_only"] is True
        subprocess.run(stop, check=True, capture_output=True)
        stopping = sock.recv(4096).decode()
        assert "STOPPING=1" in stopping.splitlines(), stopping
        assert proc.wait(timeout=20) == 0
        assert not os.path.ismount(mnt)
    finally:
        daemon.stop(check=False)  # a daemon still running: unmounted and reaped
        sock.close()


# --- install and the mount helpers ----------------------------------------------------------

def test_meson_install_into_destdir(tmp_path):
    build = pathlib.Path(BIN).parents[1]
    if not (build / "meson-info").exists():
        pytest.skip("CKPTFS_BIN is not in a meson build directory")
    info = json.loads((build / "meson-info" / "intro-buildoptions.json").read_text())
    opt = {o["name"]: o["value"] for o in info}
    prefix, bindir = opt["prefix"], opt["bindir"]
    dest = tmp_path / "dest"
    r = subprocess.run(["meson", "install", "-C", str(build), "--no-rebuild", "--destdir",
                        str(dest)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    root = dest / prefix.lstrip("/")
    exe = root / bindir / "ckptfs"
    assert os.access(exe, os.X_OK)
    out = subprocess.run([str(exe), "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("ckptfs ")
    unitdir = opt["systemdunitdir"] or f"{prefix}/lib/systemd/system"
    unit = dest / unitdir.lstrip("/") / "ckptfs@.service"
    u = unit_lines(unit.read_text())
    assert u["ExecStart"][0].split()[0] == f"{prefix}/{bindir}/ckptfs", u["ExecStart"]
    assert "@BINDIR@" not in unit.read_text()
    man = root / opt["mandir"] / "man1" / "ckptfs.1"
    assert man.read_text() == MAN.read_text()
    for name in ("mount.ckptfs", "mount.fuse.ckptfs"):
        helper = dest / opt["mount_helper_dir"].lstrip("/") / name
        assert helper.is_symlink() and os.readlink(helper) == f"{prefix}/{bindir}/ckptfs"
    examples = root / opt["datadir"] / "doc" / "ckptfs" / "examples"
    assert sorted(p.name for p in examples.iterdir()) == [
        "ckptfs.conf.example", "fstab.example", "mnt-checkpoints.mount"]


@requires_fuse
def test_mount_helpers(tmp_path):
    """`mount -t ckptfs` runs /sbin/mount.ckptfs SRC MNT -n -o opts, `mount -t fuse.ckptfs`
    /sbin/mount.fuse.ckptfs (both the binary under that name: run here as mount(8) would, the
    host's /sbin is left alone) or, without it, mount.fuse3, which finds ckptfs in PATH."""
    src = tmp_path / "src"
    (src / "step1").mkdir(parents=True)
    write_checkpoint(str(src / "step1"), llama_like(layers=1, files=1, world=2), world=2)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    helper = bindir / "mount.ckptfs"
    helper.symlink_to(BIN)
    (bindir / "mount.fuse.ckptfs").symlink_to(BIN)
    (bindir / "ckptfs").symlink_to(BIN)
    want = ["model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    for i, argv in enumerate([
            [str(helper), str(src), "{mnt}", "-n", "-o", "ro,settle=0"],
            [str(bindir / "mount.fuse.ckptfs"), str(src), "{mnt}", "-o", "ro,settle=0", "-t",
             "fuse.ckptfs"],
            ["mount.fuse3", str(src), "{mnt}", "-t", "ckptfs", "-o", "ro,settle=0"]]):
        mnt = tmp_path / f"mnt{i}"
        mnt.mkdir()
        argv = [a.replace("{mnt}", str(mnt)) for a in argv]
        env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"}
        r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
        try:
            assert r.returncode == 0, r.stderr
            assert os.path.ismount(mnt)
            assert sorted(os.listdir(mnt / "step1")) == want
            fstype = [l.split()[2] for l in open("/proc/mounts") if l.split()[1] == str(mnt)]
            assert fstype == ["fuse.ckptfs"], fstype
        finally:
            subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True)
        wait_for(lambda: not os.path.ismount(mnt), "unmount")
    # mount -f (fake) passes -f on: nothing is mounted
    mnt = tmp_path / "mnt-fake"
    mnt.mkdir()
    r = subprocess.run([str(helper), str(src), str(mnt), "-f", "-o", "ro"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and not os.path.ismount(mnt), r.stderr


# --- progress -------------------------------------------------------------------------------

def run_with_tty_stderr(argv) -> tuple[int, str, str]:
    """Runs argv with stderr on a pseudo-terminal (stdout a pipe); returns rc, stdout, tty."""
    import pty
    master, slave = pty.openpty()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=slave, text=False)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the other side is closed
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    out = proc.stdout.read().decode()
    return proc.wait(timeout=60), out, b"".join(chunks).decode(errors="replace")


def test_progress_bars_on_a_tty_only(tmp_path):
    src = tmp_path / "ckpt"
    src.mkdir()
    write_checkpoint(str(src), llama_like(layers=2, files=2, world=2, hidden=128, inter=256),
                     world=2, files=2)
    bar = re.compile(r"\r\S.* \[#* *\] \d+\.\d/\d+\.\d GB +\d+ MB/s +ETA \d+s")
    rc, out, tty = run_with_tty_stderr([BIN, "consolidate", str(src), str(tmp_path / "out1")])
    assert rc == 0, tty
    assert bar.search(tty) and "consolidate [" in tty, repr(tty)
    assert re.search(r"\[#{30}\] ", tty), repr(tty)  # ends full
    rc, out, tty = run_with_tty_stderr([BIN, "verify", "--data", str(src)])
    assert rc == 0 and out.startswith("ok:"), tty
    assert bar.search(tty) and "verify --data [" in tty, repr(tty)
    # Not a terminal: nothing but the command's own output.
    r = run("consolidate", src, tmp_path / "out2")
    assert r.stderr == "" and r.stdout == ""
    r = run("verify", "--data", src)
    assert r.stderr == "" and r.stdout.startswith("ok:")
    rc, out, tty = run_with_tty_stderr([BIN, "verify", str(src)])  # no --data: no bar
    assert rc == 0 and "[" not in tty, repr(tty)
