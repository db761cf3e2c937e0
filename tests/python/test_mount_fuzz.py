"""A seeded, time-bounded random walk over a hostile SRC tree with one mount.

Builds a random tree (valid checkpoints of random shapes, grids and dtypes; truncated shards,
gaps, bad JSON, deep nesting, FIFOs, sockets, dangling / looping / outside symlinks, 0600
files, weird names), mounts it once, then loops: a random mutation in SRC, random reads right
away (which must answer, and never return fewer bytes than the file's size without an error),
then, once the view has had settle + revalidate + entry_timeout to catch up, the invariants:
  * every consolidated file (and index) the mount shows reads byte-exact against
    `ckptfs consolidate` of a snapshot copy of that checkpoint dir, or fails with an OSError:
    never wrong bytes, never short;
  * plain files read through the mount equal SRC's bytes, or fail with an OSError;
  * `canary.txt` in the root answers stat, read and the root listing within 5 s every round;
  * the daemon is alive; at the end it unmounts with exit 0.

CKPTFS_MOUNT_FUZZ_SECONDS (default 60) bounds the whole test; CKPTFS_MOUNT_FUZZ_SEED replays
a run. The seed is printed and is in every failure message.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import re
import shutil
import stat
import struct
import time

from conftest import requires_fuse
from hostile_util import INDEX, Prober, cli, hostile_mount
from shardgen import TensorSpec, write_checkpoint

pytestmark = requires_fuse

SECONDS = float(os.environ.get("CKPTFS_MOUNT_FUZZ_SECONDS", "60"))
SHARD_RE = re.compile(r"^shard-\d+-model-\d+-of-\d+\.safetensors$")
MODEL_RE = re.compile(r"^model-\d+-of-\d+\.safetensors$")
SETTLE, REVALIDATE, ENTRY = 0.5, 0.5, 0.5
QUIET = SETTLE + REVALIDATE + ENTRY + 0.5  # seconds after a mutation before the view must hold
DTYPES = ["F32", "BF16", "F16", "F64", "I8", "U8", "I32", "I64", "BOOL"]
WEIRD = ["step\n1", "ünïcødé", "sp ace", "\x1b[1mbold", "tab\tname", "\u202eevil",
         os.fsdecode(b"bytes\xff\xfe"), "-dash", ".hidden", "a" * 200]


def is_output(n: str) -> bool:
    return n == INDEX or bool(MODEL_RE.match(n))


class Fuzz:
    def __init__(self, root: pathlib.Path, seed: int):
        self.rng = random.Random(seed)
        self.seed = seed
        self.root = root
        self.src = root / "src"
        self.outside = root / "outside"
        self.specs: dict[str, tuple] = {}  # rel ckpt dir -> (specs, world, files, kw)
        self.history: list[str] = []
        self.n = 0
        self.snap_n = 0

    # --- generation ------------------------------------------------------------------------

    def note(self, what: str) -> None:
        self.history.append(what)

    def name(self, base: str) -> str:
        self.n += 1
        r = self.rng.random()
        if r < 0.2:
            return f"{self.rng.choice(WEIRD)}{self.n}"
        return f"{base}{self.n}"

    def random_specs(self, world: int, files: int) -> list[TensorSpec]:
        specs = []
        for i in range(self.rng.randint(1, 4)):
            nd = self.rng.choice([0, 1, 1, 2, 2, 2, 3])
            shape = tuple(self.rng.choice([1, 2, 3, 4, 5, 7, 8, 12]) for _ in range(nd))
            grid = tuple(self.rng.randint(1, min(s, 3)) for s in shape)
            rep = nd == 0 or self.rng.random() < 0.1
            tname = f"layers.{i}.{self.rng.choice(['w', 'bias', 'ünï', 'x y'])}"
            specs.append(TensorSpec(tname, self.rng.choice(DTYPES), shape,
                                    () if rep else grid, 1 + i % files, replicate=rep))
        return specs

    def new_checkpoint(self, parent: pathlib.Path) -> pathlib.Path:
        d = parent / self.name("step_")
        world, files = self.rng.randint(1, 4), self.rng.randint(1, 2)
        specs = self.random_specs(world, files)
        kw = dict(mapping=self.rng.random() < 0.2, full_shape_key=self.rng.random() < 0.5)
        write_checkpoint(str(d), specs, world=world, files=files,
                         seed=self.rng.randrange(1 << 30), **kw)
        rel = str(d.relative_to(self.src))
        self.specs[rel] = (specs, world, files, kw)
        self.note(f"new checkpoint {rel!r} world={world} files={files}")
        return d

    def shards(self, d: pathlib.Path) -> list[pathlib.Path]:
        try:
            return sorted(d / n for n in os.listdir(d) if SHARD_RE.match(n))
        except OSError:
            return []

    def break_checkpoint(self, d: pathlib.Path, kind: str) -> None:
        sh = self.shards(d)
        if kind in ("truncate", "dup_rank", "chmod"):  # these follow links: regular files only
            sh = [p for p in sh if stat.S_ISREG(os.lstat(p).st_mode)]
        if not sh:
            return
        victim = self.rng.choice(sh)
        if kind == "truncate":
            os.truncate(victim, self.rng.randrange(0, max(1, victim.stat().st_size)))
        elif kind == "gap":
            if victim.is_dir() and not victim.is_symlink():
                shutil.rmtree(victim)
            else:
                victim.unlink()
        elif kind == "bad_json":
            text = self.rng.choice([b'{"a": [1, 2', b'{"__metadata__": 5}', b"\xff\xfe garbage",
                                    b'{"w": {"dtype": "F32", "shape": [1e999], "data_offsets": [0, 4]}}'])
            self.replace_with_raw(victim, text, b"\0" * 8)
        elif kind == "deep":
            depth = self.rng.choice([1000, 100_000])
            info = json.dumps({"w": {"saved_offsets": [0]}})
            text = ('{"__metadata__":' + json.dumps({"DCP_SHARDING_INFO": info}) +
                    ',"w":{"dtype":"F32","shape":' + "[" * depth + "1" + "]" * depth +
                    ',"data_offsets":[0,4]}}').encode()
            self.replace_with_raw(victim, text, b"\0" * 4)
        elif kind == "fifo":
            tmp = d / ".fifo.tmp"
            os.mkfifo(tmp)
            os.replace(tmp, victim)
        elif kind == "socket":
            victim.unlink()
            os.mknod(victim, stat.S_IFSOCK | 0o644)
        elif kind == "symlink":
            victim.unlink()
            os.symlink(self.rng.choice(["nowhere", str(self.outside / "x.safetensors"),
                                        victim.name]), victim)
        elif kind == "chmod":
            os.chmod(victim, self.rng.choice([0o600, 0o000, 0o200]))
        elif kind == "meta_outside":
            meta = d / ".hf_metadata"
            if meta.is_symlink() or not meta.exists():
                if meta.is_symlink():
                    meta.unlink()
                os.symlink(self.outside, meta)
        elif kind == "dup_rank":
            dup = d / f"shard-{99:05d}-model-00001-of-00001.safetensors"
            if victim != dup:  # an earlier round's duplicate may be the victim itself
                shutil.copy(victim, dup)
        self.note(f"break {kind}: {victim.relative_to(self.src)!r}")

    def replace_with_raw(self, path: pathlib.Path, header: bytes, data: bytes) -> None:
        header += b" " * ((8 - (8 + len(header)) % 8) % 8)
        tmp = path.parent / ".raw.tmp"
        tmp.write_bytes(struct.pack("<Q", len(header)) + header + data)
        os.replace(tmp, path)

    def build(self) -> None:
        src, out = self.src, self.outside
        out.mkdir(parents=True)
        (out / "passwd").write_text("OUTSIDE-SECRET\n")
        (out / "fqn_to_file_index_mapping.json").write_text('{"outside.tensor": 1}')
        src.mkdir()
        (src / "canary.txt").write_text("canary\n")
        parents = [src]
        for _ in range(self.rng.randint(3, 6)):
            p = self.rng.choice(parents) / self.name("dir")
            p.mkdir()
            parents.append(p)
        for _ in range(self.rng.randint(4, 7)):
            self.new_checkpoint(self.rng.choice(parents))
        kinds = ["truncate", "gap", "bad_json", "deep", "fifo", "socket", "symlink", "chmod",
                 "meta_outside", "dup_rank"]
        for kind in self.rng.sample(kinds, self.rng.randint(4, len(kinds))):
            d = self.new_checkpoint(self.rng.choice(parents))
            self.break_checkpoint(d, kind)
        # Plain files and special entries.
        for _ in range(self.rng.randint(4, 8)):
            p = self.rng.choice(parents) / self.name("file")
            p.write_bytes(self.rng.randbytes(self.rng.randint(0, 5000)))
            if self.rng.random() < 0.3:
                os.chmod(p, 0o600)
        for _ in range(self.rng.randint(2, 5)):
            p = self.rng.choice(parents)
            kind = self.rng.choice(["fifo", "socket", "dangling", "loop", "outside", "strayname"])
            nm = self.name(kind)
            if kind == "fifo":
                os.mkfifo(p / nm)
            elif kind == "socket":
                os.mknod(p / nm, stat.S_IFSOCK | 0o644)
            elif kind == "dangling":
                os.symlink("no/such/target", p / nm)
            elif kind == "loop":
                os.symlink(nm + ".b", p / nm)
                os.symlink(nm, p / (nm + ".b"))
            elif kind == "outside":
                os.symlink(out, p / nm)
            else:
                (p / "shard-x.safetensors").write_bytes(b"not a shard")
            self.note(f"plain {kind} {str((p / nm).relative_to(src))!r}")

    # --- mutations -------------------------------------------------------------------------

    def checkpoint_dirs(self) -> list[pathlib.Path]:
        out = []
        for dirpath, dirnames, filenames in os.walk(self.src):
            dirnames[:] = [n for n in dirnames if n != ".hf_metadata"]
            if any(SHARD_RE.match(n) for n in dirnames + filenames):
                out.append(pathlib.Path(dirpath))
        return out

    def plain_files(self) -> list[pathlib.Path]:
        out = []
        for dirpath, dirnames, filenames in os.walk(self.src):
            if any(SHARD_RE.match(n) or n.startswith("shard-") for n in dirnames + filenames):
                dirnames[:] = []
                continue
            for n in filenames:
                p = pathlib.Path(dirpath) / n
                if stat.S_ISREG(os.lstat(p).st_mode):
                    out.append(p)
        return out

    def mutate(self) -> list[pathlib.Path]:
        """One random change in SRC; returns the checkpoint dirs it touched."""
        cks = self.checkpoint_dirs()
        op = self.rng.choice(["replace", "replace", "remove", "add", "truncate", "chmod", "fifo",
                              "new", "new", "rmtree", "rename", "restore", "bad_json", "deep"])
        if not cks:
            op = "new"
        d = self.rng.choice(cks) if cks else None
        rel = str(d.relative_to(self.src)) if d else ""
        if op == "new":
            parent = self.rng.choice([self.src] + [c.parent for c in cks])
            return [self.new_checkpoint(parent)]
        if op == "rmtree":
            shutil.rmtree(d)
            self.note(f"rmtree {rel!r}")
            return []
        if op == "rename":
            new = d.parent / self.name("renamed_")
            os.rename(d, new)
            if rel in self.specs:
                self.specs[str(new.relative_to(self.src))] = self.specs.pop(rel)
            self.note(f"rename {rel!r} -> {new.name!r}")
            return [new]
        if op in ("replace", "restore") and rel in self.specs:
            specs, world, files, kw = self.specs[rel]
            stage = self.root / "stage" / str(self.n)
            self.n += 1
            write_checkpoint(str(stage), specs, world=world, files=files,
                             seed=self.rng.randrange(1 << 30), **kw)
            staged = sorted(stage.iterdir())
            if op == "replace":
                s = self.rng.choice([p for p in staged if SHARD_RE.match(p.name)])
                os.replace(s, d / s.name)
                self.note(f"replace shard {rel!r}/{s.name}")
            else:
                for p in self.shards(d):
                    if p.is_dir() and not p.is_symlink():
                        shutil.rmtree(p)
                    else:
                        p.unlink()
                for p in staged:
                    if SHARD_RE.match(p.name):
                        os.replace(p, d / p.name)
                self.note(f"restore {rel!r}")
            shutil.rmtree(stage, ignore_errors=True)
            return [d]
        kind = {"remove": "gap", "add": "dup_rank", "truncate": "truncate", "chmod": "chmod",
                "fifo": "fifo", "bad_json": "bad_json", "deep": "deep"}.get(op, "truncate")
        self.break_checkpoint(d, kind)
        return [d]

    # --- references ------------------------------------------------------------------------

    def snapshot(self, d: pathlib.Path) -> pathlib.Path:
        """A copy of the checkpoint dir as it is now: regular files copied, symlinks, FIFOs and
        sockets recreated (never opened), .hf_metadata copied the same way."""
        self.snap_n += 1
        dst = self.root / "snap" / str(self.snap_n)

        def copy(s: pathlib.Path, t: pathlib.Path, top: bool):
            t.mkdir(parents=True)
            for n in os.listdir(s):
                a, b = s / n, t / n
                st = os.lstat(a)
                if stat.S_ISREG(st.st_mode):
                    shutil.copy2(a, b, follow_symlinks=False)
                elif stat.S_ISLNK(st.st_mode):
                    os.symlink(os.readlink(a), b)
                elif stat.S_ISFIFO(st.st_mode):
                    os.mkfifo(b)
                elif stat.S_ISSOCK(st.st_mode):
                    os.mknod(b, stat.S_IFSOCK | 0o644)
                elif stat.S_ISDIR(st.st_mode) and top and (n == ".hf_metadata" or n.startswith("shard-")):
                    copy(a, b, False)

        copy(d, dst, True)
        return dst

    def reference(self, d: pathlib.Path) -> dict[str, bytes] | None:
        snap = self.snapshot(d)
        out = self.root / "ref" / str(self.snap_n)
        r = cli("consolidate", snap, out, timeout=60)
        assert not r.timed_out, f"consolidate of a snapshot of {d} hung: {r!r}"
        assert r.rc in (0, 1), f"consolidate of a snapshot of {d} crashed: {r!r}"
        ref = None
        if r.rc == 0:
            ref = {n: (out / n).read_bytes() for n in os.listdir(out) if is_output(n)}
        shutil.rmtree(snap, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
        return ref


def test_mount_fuzz(tmp_path):
    seed = int(os.environ.get("CKPTFS_MOUNT_FUZZ_SEED", str(time.time_ns() % (1 << 32))))
    print(f"CKPTFS_MOUNT_FUZZ_SEED={seed}")
    t_end = time.monotonic() + SECONDS
    fz = Fuzz(tmp_path, seed)
    fz.build()
    m = hostile_mount(fz.src, tmp_path / "mnt", settle=SETTLE,
                      opts=[f"revalidate={REVALIDATE}", f"entry_timeout={ENTRY}",
                            f"attr_timeout={ENTRY}"]).start()
    mm = pathlib.Path(m.mnt)
    pr = Prober(timeout=20)
    rnd = 0
    stats = {"rounds": 0, "files_checked": 0, "os_errors": 0, "refs": 0}

    def mpath(p: pathlib.Path) -> pathlib.Path:
        return mm / p.relative_to(fz.src)

    def fail(msg: str):
        raise AssertionError(msg)

    def liveness():
        t0 = time.monotonic()
        try:
            st = pr.stat(mm / "canary.txt", timeout=5)
            data = pr.read(mm / "canary.txt", timeout=5)
            names = pr.listdir(mm, timeout=5)
        except AssertionError as e:
            fail(f"liveness: {e}")
        except OSError as e:
            fail(f"liveness: canary.txt: {e!r}")
        if st["size"] != 7 or data != b"canary\n" or "canary.txt" not in names:
            fail(f"liveness: canary.txt wrong: {st}, {data!r}")
        if time.monotonic() - t0 > 5:
            fail("liveness: canary.txt took more than 5 s")
        if not m.alive():
            fail(f"the daemon died (exit {m.proc.poll()})")

    def quick_reads():
        """Right after a mutation: whatever is shown must answer and never read short."""
        for d in fz.rng.sample(fz.checkpoint_dirs(), min(3, len(fz.checkpoint_dirs()))):
            try:
                names = pr.listdir(mpath(d))
            except AssertionError as e:
                fail(str(e))
            except OSError:
                continue
            for n in [n for n in names if is_output(n)][:2]:
                try:
                    fd = pr.call("open", mpath(d) / n, os.O_RDONLY)
                except AssertionError as e:
                    fail(str(e))
                except OSError:
                    continue
                try:
                    size = pr.call("fstat", fd)["size"]
                    data = pr.call("readall", fd)
                    if len(data) != size:
                        fail(f"{mpath(d) / n}: read {len(data)} of st_size {size} bytes, no error")
                except AssertionError as e:
                    fail(str(e))
                except OSError:
                    stats["os_errors"] += 1
                finally:
                    try:
                        pr.call("close", fd)
                    except OSError:
                        pass

    def check_checkpoint(d: pathlib.Path):
        ref = fz.reference(d)
        stats["refs"] += 1
        try:
            names = pr.listdir(mpath(d))
        except AssertionError as e:
            fail(str(e))
        except OSError as e:
            fail(f"listing checkpoint dir {mpath(d)} failed: {e!r}")
        for n in sorted(n for n in names if is_output(n)):
            try:
                got = pr.read(mpath(d) / n)
            except AssertionError as e:
                fail(str(e))
            except OSError:
                stats["os_errors"] += 1
                continue
            stats["files_checked"] += 1
            if ref is None:
                fail(f"{mpath(d) / n}: served {len(got)} bytes, but consolidate refuses a snapshot "
                     f"of {d}")
            if n not in ref:
                fail(f"{mpath(d) / n}: served, but consolidate wrote only {sorted(ref)}")
            if got != ref[n]:
                fail(f"{mpath(d) / n}: {len(got)} bytes differ from consolidate's {len(ref[n])}")

    def check_plain(p: pathlib.Path):
        want = p.read_bytes()
        try:
            got = pr.read(mpath(p))
        except AssertionError as e:
            fail(str(e))
        except OSError:
            stats["os_errors"] += 1
            return
        if got != want:
            fail(f"plain file {mpath(p)}: {len(got)} bytes differ from SRC's {len(want)}")

    def run_rounds():
        nonlocal rnd
        time.sleep(QUIET)  # the freshly built tree settles once
        while True:
            liveness()
            cks = fz.checkpoint_dirs()
            todo = fz.rng.sample(cks, min(len(cks), 4)) if rnd else cks
            for d in todo:
                check_checkpoint(d)
            plain = fz.plain_files()
            for p in fz.rng.sample(plain, min(len(plain), 3)):
                check_plain(p)
            stats["rounds"] = rnd
            if time.monotonic() + QUIET + 1 > t_end:
                return
            rnd += 1
            for _ in range(fz.rng.randint(1, 2)):
                fz.mutate()
            quick_reads()
            liveness()
            time.sleep(QUIET)

    try:
        run_rounds()
        pr.close()
        rc = m.stop(check=False)
        if rc != 0:
            fail(f"the daemon exited {rc} (not 0) at unmount")
    except Exception as e:
        tail = "\n".join(fz.history[-25:])
        log = "\n".join(m.read_log().splitlines()[-10:])
        raise AssertionError(f"CKPTFS_MOUNT_FUZZ_SEED={seed} round {rnd}: {e}\n"
                             f"last actions:\n{tail}\ndaemon log tail:\n{log}") from e
    finally:
        pr.close()
        m.stop(check=False)
    print(f"seed {seed}: {stats}")
