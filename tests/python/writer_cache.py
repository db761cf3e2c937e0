"""A framework writer's output, made once per test run and copied for the next tier that asks.

tools/test.sh runs the mount tests twice, against the plain daemon and against the ASan+UBSan one;
the checkpoints the frameworks' own writers make (tests/python/writers/: torch DCP under FSDP,
megatron-core, torchtitan, verl, each a multi-rank gloo job of tens of seconds) are the same both
times. With CKPTFS_WRITER_CACHE set (run_suite.sh sets it to build-writers/ in the checkout,
which a fresh clone starts without), a writer's run is kept there under a key of

  - the bytes of every file in tests/python/writers/ (a changed writer is a new key),
  - its command line, with the output directories written as placeholders,
  - the Python that runs it,

and a later run with the same key gets copies of the output directories (mtimes kept) and the
same stdout, without running the writer. Only a run that exited 0 is kept. Without the variable
(a developer's pytest run) every writer runs, as before.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

WRITERS = pathlib.Path(__file__).parent / "writers"


def _key(argv: list[str], outs: list[pathlib.Path]) -> str:
    h = hashlib.sha256()
    for f in sorted(WRITERS.glob("*.py")):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    h.update(json.dumps([sys.executable, _placeheld(argv, outs)]).encode())
    return h.hexdigest()[:32]


def _placeheld(texts: list[str], outs: list[pathlib.Path]) -> list[str]:
    out = []
    for t in texts:
        for k, o in enumerate(outs):
            t = t.replace(str(o), f"@OUT{k}@")
        out.append(t)
    return out


def _restored(text: str, outs: list[pathlib.Path]) -> str:
    for k, o in enumerate(outs):
        text = text.replace(f"@OUT{k}@", str(o))
    return text


def run(argv: list[str], outs: list[pathlib.Path], **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(argv, capture_output=True, text=True, **kwargs), where the writer leaves
    what it makes in the directories `outs` (each may exist, empty, before)."""
    argv = [str(a) for a in argv]
    root = os.environ.get("CKPTFS_WRITER_CACHE")
    if not root:
        return subprocess.run(argv, capture_output=True, text=True, **kwargs)
    entry = pathlib.Path(root) / _key(argv, outs)
    if (entry / "result.json").is_file():
        res = json.loads((entry / "result.json").read_text())
        for k, o in enumerate(outs):
            shutil.copytree(entry / f"out{k}", o, symlinks=True, dirs_exist_ok=True)
        print(f"writer_cache: {pathlib.Path(argv[1]).name}: the outputs of an earlier run "
              f"({entry.name})", file=sys.stderr)
        return subprocess.CompletedProcess(argv, 0, _restored(res["stdout"], outs),
                                           _restored(res["stderr"], outs))
    r = subprocess.run(argv, capture_output=True, text=True, **kwargs)
    if r.returncode == 0:
        pathlib.Path(root).mkdir(parents=True, exist_ok=True)
        tmp = pathlib.Path(tempfile.mkdtemp(dir=root, prefix=".new-"))
        for k, o in enumerate(outs):
            shutil.copytree(o, tmp / f"out{k}", symlinks=True)
        (tmp / "result.json").write_text(json.dumps({
            "stdout": _placeheld([r.stdout], outs)[0], "stderr": _placeheld([r.stderr], outs)[0]}))
        try:
            os.rename(tmp, entry)
        except OSError:  # kept meanwhile by another run of the same key
            shutil.rmtree(tmp, ignore_errors=True)
    return r
