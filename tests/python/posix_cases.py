"""The cases of the differential POSIX suite (test_posix.py), after pjdfstest's categories:
chmod, chown, link, mkdir, mkfifo, open, rename, rmdir, symlink, truncate, ftruncate, unlink
and utimensat, with long names and a deep path. Each case runs the same calls in a fresh
directory and records what each returns (a value or an errno name) and what stat says
(type, mode, owner, link count, size, and times as set or as moved), as JSON on stdout, so
that the same case on a plain directory and on the mount can be compared.

    python posix_cases.py DIR CASE     (as root, or as another user: the test drops privileges)

Runs with the system python as well as the venv's (standard library only).
"""

from __future__ import annotations

import errno
import json
import os
import stat
import sys

NAME_MAX = 255


class Obs:
    """Records each call's outcome."""

    def __init__(self, root: str):
        self.root = root
        self.out: list = []

    def p(self, rel: str) -> str:
        return os.path.join(self.root, rel)

    def call(self, what: str, fn, *args, **kw):
        try:
            r = fn(*args, **kw)
        except OSError as e:
            self.out.append([what, errno.errorcode.get(e.errno, str(e.errno))])
            return None
        self.out.append([what, "ok"])
        return r

    def stat(self, rel: str, follow: bool = False, times: bool = False):
        try:
            s = os.stat(self.p(rel), follow_symlinks=follow)
        except OSError as e:
            self.out.append(["stat " + rel, errno.errorcode.get(e.errno, str(e.errno))])
            return None
        kind = stat.S_IFMT(s.st_mode)
        rec = ["stat " + rel, kind, oct(stat.S_IMODE(s.st_mode)), s.st_uid, s.st_gid, s.st_nlink,
               s.st_size if not stat.S_ISDIR(s.st_mode) else "dir"]
        if times:
            rec += [s.st_atime_ns, s.st_mtime_ns]
        self.out.append(rec)
        return s

    def note(self, what: str, value):
        self.out.append([what, value])


def write(o: Obs, rel: str, data: bytes = b"x", mode: int = 0o644):
    fd = o.call("create " + rel, os.open, o.p(rel), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    if fd is not None:
        os.write(fd, data)
        o.call("close " + rel, os.close, fd)


# --- cases ------------------------------------------------------------------------------------


def c_chmod(o: Obs):
    write(o, "f")
    for m in (0o0, 0o644, 0o4755, 0o2711, 0o1777, 0o7777):
        o.call(f"chmod f {m:o}", os.chmod, o.p("f"), m)
        o.stat("f")
    o.call("mkdir d", os.mkdir, o.p("d"), 0o755)
    o.call("chmod d 0700", os.chmod, o.p("d"), 0o700)
    o.stat("d")
    o.call("symlink l->f", os.symlink, "f", o.p("l"))
    o.call("chmod l (follows)", os.chmod, o.p("l"), 0o600)
    o.stat("f")
    o.call("chmod missing", os.chmod, o.p("missing"), 0o644)


def c_chown(o: Obs):
    write(o, "f")
    o.call("chown f 4321:4322", os.chown, o.p("f"), 4321, 4322)
    o.stat("f")
    o.call("chown f -1:-1", os.chown, o.p("f"), -1, -1)
    o.stat("f")
    o.call("symlink l->f", os.symlink, "f", o.p("l"))
    o.call("lchown l 55:56", os.lchown, o.p("l"), 55, 56)
    o.stat("l")
    o.stat("f")
    o.call("chown missing", os.chown, o.p("missing"), 1, 1)


def c_link(o: Obs):
    write(o, "f", b"abc")
    o.call("link f g", os.link, o.p("f"), o.p("g"))
    o.stat("f")
    o.call("link f g again", os.link, o.p("f"), o.p("g"))
    o.call("mkdir d", os.mkdir, o.p("d"))
    o.call("link d e", os.link, o.p("d"), o.p("e"))
    o.call("link missing x", os.link, o.p("missing"), o.p("x"))
    o.call("unlink f", os.unlink, o.p("f"))
    o.stat("g")
    o.call("link g f", os.link, o.p("g"), o.p("f"))
    o.call("unlink f again", os.unlink, o.p("f"))
    o.stat("g")  # the kernel's name g of the same inode still resolves
    o.call("link g d/h", os.link, o.p("g"), o.p("d/h"))
    o.stat("d/h")


def c_mkdir(o: Obs):
    for m in (0o755, 0o700, 0o1777, 0o2775):
        o.call(f"mkdir d{m:o}", os.mkdir, o.p(f"d{m:o}"), m)
        o.stat(f"d{m:o}")
    o.call("mkdir again", os.mkdir, o.p("d755"), 0o755)
    o.call("mkdir missing/x", os.mkdir, o.p("missing/x"))
    write(o, "f")
    o.call("mkdir f/x", os.mkdir, o.p("f/x"))
    o.call("mkdir NAME_MAX", os.mkdir, o.p("n" * NAME_MAX))
    o.call("mkdir NAME_MAX+1", os.mkdir, o.p("n" * (NAME_MAX + 1)))
    o.stat("n" * NAME_MAX)


def c_mkfifo(o: Obs):
    o.call("mkfifo p", os.mkfifo, o.p("p"), 0o640)
    o.stat("p")
    o.call("mkfifo again", os.mkfifo, o.p("p"))
    o.call("unlink p", os.unlink, o.p("p"))
    o.stat("p")


def c_open(o: Obs):
    write(o, "f", b"hello")
    o.call("O_EXCL existing", os.open, o.p("f"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    fd = o.call("O_APPEND", os.open, o.p("f"), os.O_WRONLY | os.O_APPEND)
    if fd is not None:
        os.write(fd, b"!")
        os.close(fd)
    o.stat("f")
    fd = o.call("O_TRUNC", os.open, o.p("f"), os.O_WRONLY | os.O_TRUNC)
    if fd is not None:
        os.close(fd)
    o.stat("f")
    o.call("mkdir d", os.mkdir, o.p("d"))
    o.call("O_DIRECTORY on a file", os.open, o.p("f"), os.O_RDONLY | os.O_DIRECTORY)
    o.call("O_WRONLY on a dir", os.open, o.p("d"), os.O_WRONLY)
    o.call("missing", os.open, o.p("missing"), os.O_RDONLY)
    o.call("missing/x O_CREAT", os.open, o.p("missing/x"), os.O_CREAT | os.O_WRONLY)
    fd = o.call("O_CREAT 0600", os.open, o.p("g"), os.O_CREAT | os.O_WRONLY, 0o600)
    if fd is not None:
        os.close(fd)
    o.stat("g")
    o.call("NAME_MAX+1", os.open, o.p("n" * (NAME_MAX + 1)), os.O_CREAT | os.O_WRONLY)
    fd = o.call("NAME_MAX", os.open, o.p("n" * NAME_MAX), os.O_CREAT | os.O_WRONLY)
    if fd is not None:
        os.close(fd)
    o.stat("n" * NAME_MAX)
    o.call("symlink l->f", os.symlink, "f", o.p("l"))
    o.call("O_NOFOLLOW on a link", os.open, o.p("l"), os.O_RDONLY | os.O_NOFOLLOW)


def c_rename(o: Obs):
    write(o, "a", b"aaa")
    write(o, "b", b"bb")
    o.call("rename a b", os.rename, o.p("a"), o.p("b"))
    o.stat("a")
    o.stat("b")
    o.call("mkdir d", os.mkdir, o.p("d"))
    o.call("mkdir e", os.mkdir, o.p("e"))
    write(o, "e/x")
    o.call("rename b d (file over dir)", os.rename, o.p("b"), o.p("d"))
    o.call("rename d b (dir over file)", os.rename, o.p("d"), o.p("b"))
    o.call("rename d e (over a non-empty dir)", os.rename, o.p("d"), o.p("e"))
    o.call("rename e e/sub (into itself)", os.rename, o.p("e"), o.p("e/sub"))
    o.call("rename b b (to itself)", os.rename, o.p("b"), o.p("b"))
    o.stat("b")
    o.call("rename missing x", os.rename, o.p("missing"), o.p("x"))
    o.call("rename d f (empty dir, fresh name)", os.rename, o.p("d"), o.p("f"))
    o.stat("f")
    o.call("mkdir g", os.mkdir, o.p("g"))
    o.call("rename f g (empty dir over empty dir)", os.rename, o.p("f"), o.p("g"))
    o.stat("g")
    o.call("rename e/x g/x (across dirs)", os.rename, o.p("e/x"), o.p("g/x"))
    o.stat("g/x")


def c_rmdir(o: Obs):
    o.call("mkdir d", os.mkdir, o.p("d"))
    write(o, "d/f")
    o.call("rmdir non-empty", os.rmdir, o.p("d"))
    o.call("rmdir a file", os.rmdir, o.p("d/f"))
    o.call("rmdir missing", os.rmdir, o.p("missing"))
    o.call("unlink d/f", os.unlink, o.p("d/f"))
    o.call("rmdir d", os.rmdir, o.p("d"))
    o.stat("d")


def c_symlink(o: Obs):
    o.call("symlink l->target", os.symlink, "target", o.p("l"))
    o.note("readlink l", o.call("readlink", os.readlink, o.p("l")))
    o.stat("l")
    o.call("symlink again", os.symlink, "x", o.p("l"))
    long_target = "t" * 4000
    o.call("symlink long target", os.symlink, long_target, o.p("m"))
    got = o.call("readlink m", os.readlink, o.p("m"))
    o.note("long target kept", got == long_target)
    o.call("stat dangling (follows)", os.stat, o.p("l"))
    o.call("unlink l", os.unlink, o.p("l"))


def c_truncate(o: Obs):
    write(o, "f", b"0123456789")
    for n in (0, 100, 3, 1 << 30):
        o.call(f"truncate {n}", os.truncate, o.p("f"), n)
        o.stat("f")
    o.call("mkdir d", os.mkdir, o.p("d"))
    o.call("truncate a dir", os.truncate, o.p("d"), 0)
    o.call("truncate missing", os.truncate, o.p("missing"), 0)
    o.call("truncate -1", os.truncate, o.p("f"), -1)
    s1 = o.stat("f", times=False)
    os.utime(o.p("f"), ns=(10**9, 10**9))
    o.call("truncate 5", os.truncate, o.p("f"), 5)
    s2 = os.stat(o.p("f"))
    o.note("truncate moves mtime", s1 is not None and s2.st_mtime_ns != 10**9)


def c_ftruncate(o: Obs):
    fd = os.open(o.p("f"), os.O_RDWR | os.O_CREAT, 0o644)
    os.write(fd, b"0123456789")
    os.utime(o.p("f"), ns=(10**9, 10**9))
    for n in (4, 0, 4096, 1 << 30):
        o.call(f"ftruncate {n}", os.ftruncate, fd, n)
        s = os.fstat(fd)
        o.note(f"fstat size {n}", s.st_size)
    o.note("ftruncate moves mtime", os.fstat(fd).st_mtime_ns != 10**9)
    o.call("ftruncate 100 TiB", os.ftruncate, fd, 100 << 40)
    o.note("size after 100 TiB", os.fstat(fd).st_size)
    os.close(fd)
    rfd = os.open(o.p("f"), os.O_RDONLY)
    o.call("ftruncate a read-only fd", os.ftruncate, rfd, 0)
    os.close(rfd)
    o.stat("f")


def c_unlink(o: Obs):
    write(o, "f", b"abc")
    fd = os.open(o.p("f"), os.O_RDONLY)
    o.call("unlink f (open)", os.unlink, o.p("f"))
    s = o.call("fstat after unlink", os.fstat, fd)
    o.note("fstat nlink, size", [s.st_nlink, s.st_size] if s else None)
    o.note("read after unlink", os.read(fd, 10).decode())
    os.close(fd)
    o.stat("f")
    o.call("mkdir d", os.mkdir, o.p("d"))
    o.call("unlink a dir", os.unlink, o.p("d"))
    o.call("unlink missing", os.unlink, o.p("missing"))
    fd = os.open(o.p("g"), os.O_RDWR | os.O_CREAT, 0o600)  # as TemporaryFile does
    os.unlink(o.p("g"))
    os.write(fd, b"xyz")
    s = o.call("fstat of a written unlinked file", os.fstat, fd)
    o.note("its size", s.st_size if s else None)
    os.close(fd)


def c_utimensat(o: Obs):
    write(o, "f")
    o.call("utime set", os.utime, o.p("f"), ns=(1_500_000_000_123, 1_600_000_000_456))
    o.stat("f", times=True)
    o.call("mkdir d", os.mkdir, o.p("d"))
    o.call("utime dir", os.utime, o.p("d"), ns=(1_400_000_000_000, 1_400_000_001_000))
    o.stat("d", times=True)
    o.call("symlink l->f", os.symlink, "f", o.p("l"))
    o.call("utime link nofollow", os.utime, o.p("l"), ns=(1_300_000_000_000, 1_300_000_000_000),
           follow_symlinks=False)
    s = os.lstat(o.p("l"))
    o.note("link mtime", s.st_mtime_ns)
    o.stat("f", times=True)
    o.call("utime now", os.utime, o.p("f"))
    o.note("now moved mtime", os.stat(o.p("f")).st_mtime_ns > 1_600_000_000_456)
    o.call("utime missing", os.utime, o.p("missing"), ns=(1, 1))


def c_deep(o: Obs):
    """A path longer than PATH_MAX, reached from a working directory inside it."""
    comp = "d" * 200
    cwd = os.open(o.root, os.O_RDONLY | os.O_DIRECTORY)
    depth = 0
    try:
        while depth < 22:  # 22 x 201 bytes: past 4096
            os.mkdir(comp, dir_fd=cwd)
            nxt = os.open(comp, os.O_RDONLY | os.O_DIRECTORY, dir_fd=cwd)
            os.close(cwd)
            cwd = nxt
            depth += 1
        o.note("depth", depth)
        fd = o.call("create deep", os.open, "f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=cwd)
        if fd is not None:
            os.write(fd, b"deep")
            os.close(fd)
        os.fchdir(cwd)
        o.call("truncate deep (relative)", os.truncate, "f", 2)
        o.note("deep size", os.stat("f").st_size)
        o.call("chmod deep", os.chmod, "f", 0o600)
        o.note("deep mode", oct(stat.S_IMODE(os.stat("f").st_mode)))
        o.call("rename deep", os.rename, "f", "g")
        o.call("unlink deep", os.unlink, "g")
    finally:
        os.chdir("/")
        os.close(cwd)


def st_bytes(n: int, name: str = "w") -> bytes:
    import struct
    h = json.dumps({name: {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]}}).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + bytes(range(256)) * (4 * n // 256) + bytes(4 * n % 256)


def c_model(o: Obs):
    """A consolidated file saved as save_pretrained saves it (temp name, rename over the final
    name): in the mount it is stored as rank shards, which the calls below meet."""
    fd = os.open(o.p(".tmp1"), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o640)
    body = st_bytes(4096)
    os.write(fd, body)
    o.call("rename over the final name", os.rename, o.p(".tmp1"), o.p("model.safetensors"))
    o.call("close", os.close, fd)
    o.stat("model.safetensors")
    with open(o.p("model.safetensors"), "rb") as f:
        o.note("reads back", f.read() == body)
    o.call("chmod 0600", os.chmod, o.p("model.safetensors"), 0o600)
    o.call("utime", os.utime, o.p("model.safetensors"), ns=(10**18, 10**18 + 7))
    o.stat("model.safetensors", times=True)
    o.call("truncate", os.truncate, o.p("model.safetensors"), 10)
    o.call("link", os.link, o.p("model.safetensors"), o.p("hard"))
    o.call("rename to another name", os.rename, o.p("model.safetensors"), o.p("x.safetensors"))
    o.call("unlink", os.unlink, o.p("model.safetensors"))
    o.call("stat at the end", os.stat, o.p("model.safetensors"))


CASES = {name[2:]: fn for name, fn in dict(globals()).items() if name.startswith("c_")}


def main():
    root, case = sys.argv[1], sys.argv[2]
    os.umask(0o022)
    o = Obs(root)
    CASES[case](o)
    print(json.dumps(o.out))


if __name__ == "__main__":
    main()
