#!/usr/bin/env python3
"""A slow writer for test_write.py: writes the bytes of DATA to DEST in fixed chunks with a
sleep between them, and reports how far it got, so a test can kill it (or the daemon) at a
known point, or read the file while it is being written. Standard library only (starts fast).

  slow_writer.py DATA DEST [--mode direct|tmp] [--chunk B] [--sleep S] [--rename-after N]

Modes (the two ways real writers write, see shared/notes/writers.md):
  direct  open(DEST, O_WRONLY|O_CREAT|O_TRUNC, 0644), write from offset 0, close
          (torch.save, DCP rank files);
  tmp     save_pretrained / safetensors save_file: open(dir/.tmpXXXXXX,
          O_RDWR|O_CREAT|O_EXCL, 0600), ftruncate(final size), write from offset 0,
          rename(tmp, DEST) while the file is still open, then close. --rename-after N renames
          after N chunks instead of after the last one (the file stays open and is written on).

Progress on stdout, one flushed line per event:
  open DEST | tmp NAME      the file is open
  w N                       N bytes written so far (after each chunk)
  renamed                   rename(tmp, DEST) returned
  closed                    close() returned
"""
import argparse
import os
import random
import string
import sys
import time


def say(*words):
    print(*words, flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data")
    p.add_argument("dest")
    p.add_argument("--mode", choices=["direct", "tmp"], default="direct")
    p.add_argument("--chunk", type=int, default=64 * 1024)
    p.add_argument("--sleep", type=float, default=0.01)
    p.add_argument("--rename-after", type=int, default=None)
    a = p.parse_args(argv)
    with open(a.data, "rb") as f:
        data = f.read()

    tmp = None
    if a.mode == "direct":
        fd = os.open(a.dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        say("open", a.dest)
    else:
        name = ".tmp" + "".join(random.choice(string.ascii_letters + string.digits) for _ in range(6))
        tmp = os.path.join(os.path.dirname(a.dest), name)
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        say("tmp", name)
        os.ftruncate(fd, len(data))

    for i, off in enumerate(range(0, len(data), a.chunk)):
        if tmp is not None and a.rename_after is not None and i == a.rename_after:
            os.rename(tmp, a.dest)
            tmp = None
            say("renamed")
        piece = memoryview(data)[off:off + a.chunk]
        while piece:
            n = os.write(fd, piece)
            piece = piece[n:]
        say("w", min(off + a.chunk, len(data)))
        if a.sleep:
            time.sleep(a.sleep)
    if tmp is not None:
        os.rename(tmp, a.dest)
        say("renamed")
    os.close(fd)
    say("closed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
