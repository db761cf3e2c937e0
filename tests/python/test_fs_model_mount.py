"""Tier 3: the reference-model test of the write path replayed through a real mount (issue 34).

tests/unit/test_fs_model.cpp drives seeded random op sequences (creates, writes in pieces in any
order, flushes, fsyncs, closes, renames, unlinks, mkdir, rmdir, changes made directly in SRC)
into fs::Filesystem and checks the whole tree against its reference model after every step.
Its FsModelMount variant replays the same seeds with POSIX syscalls on a mount, through the
kernel's FUSE client; this test makes that mount and runs it. One mount per rank count
(-o ranks=1, 2, 3: the unit variant draws the count per sequence), each serving an empty SRC
with short settle and revalidate times and no kernel caching of entries and attributes, so
that "time passes" is a short sleep; writer_view=0 as in the unit variant (the model is what
every other process sees). With ranks 2 and 3 the kernel writes the files (write passthrough)
and each is split after its close; the hidden -o split_delay_ms holds each split 200 ms, so
steps run between a close and its split. The sequences of one mount run one after the other, each from an
empty tree.

CKPTFS_MODEL_MOUNT_SEQS sequences per mount (default 3), CKPTFS_MODEL_OPS steps each (default
150); a failure shows the seed, the step, the ops that led there and the daemon's log, and
CKPTFS_MODEL_SEED=S replays one sequence on each mount. The daemon must exit 0 at the unmount
(under ASan: no leak, no error report).
"""

from __future__ import annotations

import os
import pathlib
import subprocess

import pytest

from conftest import BIN, Mount, requires_fuse

pytestmark = requires_fuse

# build/src/ckptfs -> build/tests/test_fs_model (tests/meson.build: 'test_' + the unit's name).
MODEL_TEST = pathlib.Path(BIN).resolve().parents[1] / "tests" / "test_fs_model"
SEQS = int(os.environ.get("CKPTFS_MODEL_MOUNT_SEQS", "3"))
SETTLE = REVALIDATE = 0.05  # seconds
# What "time passes" sleeps: past settle and revalidate (the kernel keeps nothing: timeouts 0).
WAIT_MS = int(os.environ.get("CKPTFS_MODEL_WAIT_MS", "150"))
# With ranks > 1 a file the kernel wrote is stored at close as its own one shard and split after
# close; the split waits this long first, so the model's checks run in both states.
SPLIT_DELAY_MS = 200


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_model_sequences_through_fuse(tmp_path, ranks):
    if not MODEL_TEST.exists():
        pytest.skip(f"no {MODEL_TEST} (a build without GoogleTest)")
    src = tmp_path / "src"
    src.mkdir()
    opts = [f"ranks={ranks}", f"revalidate={REVALIDATE}", "entry_timeout=0", "attr_timeout=0",
            "writer_view=0"]
    if ranks > 1:  # each split after close waits (hidden option): steps read between the close
        opts.append(f"split_delay_ms={SPLIT_DELAY_MS}")  # and the split, and after it
    with Mount(src, tmp_path / "mnt", opts=opts, settle=SETTLE) as m:
        env = {**os.environ, "CKPTFS_MODEL_MOUNT": m.mnt, "CKPTFS_MODEL_SRC": str(src),
               "CKPTFS_MODEL_RANKS": str(ranks), "CKPTFS_MODEL_WAIT_MS": str(WAIT_MS),
               "CKPTFS_MODEL_MOUNT_SEQS": str(SEQS),
               "CKPTFS_MODEL_FIRST": str((ranks - 1) * SEQS)}  # each mount its own seeds
        r = subprocess.run([str(MODEL_TEST), "--gtest_filter=FsModelMount.*"], env=env,
                           capture_output=True, text=True, timeout=600)
        out = r.stdout + r.stderr
        assert r.returncode == 0, (f"{MODEL_TEST.name} exited {r.returncode} (ranks={ranks}):\n{out}"
                                   f"\ndaemon log tail:\n{m.log_tail(40)}")
        assert "[  PASSED  ] 1 test" in r.stdout and "SKIPPED" not in r.stdout, out
        assert m.alive(), "the daemon died:\n" + m.log_tail()
        print(out)
