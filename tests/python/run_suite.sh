#!/usr/bin/env bash
# tests/python/run_suite.sh: meson's `mount` and `mpi` suites (tests/meson.build), pytest over
# real FUSE mounts with the ckptfs binary in CKPTFS_BIN (meson passes the built target).
#   run_suite.sh mount|mpi [PYTEST ARGS...]     (meson test --test-args '...' adds the args)
# The tiers, as tools/test.sh runs them (CKPTFS_ASAN=1, which meson sets in a build with
# -Db_sanitize=address,..., picks the tier against the ASan+UBSan daemon):
#   mount          every test not marked `mpi`
#   mount, ASan    the real-mount, hostile-source, trust, CLI and write-path files (the write
#                  path's reference model through a mount too; the YAML reader against
#                  PyYAML), but not the tests
#                  that load the Python binding's library into the venv's Python (written_through,
#                  every_tool: its ASan build cannot load there); the randomized mount and write
#                  tests get CKPTFS_ASAN_{MOUNT,WRITE}_FUZZ_SECONDS (default 30) each. The daemon
#                  must exit 0 after every clean unmount: a leak or an error report fails the
#                  test that mounted it.
#   mpi            the tests marked `mpi`: the parallel flush under mpirun
#   mpi, ASan      the same; OpenMPI keeps allocations past MPI_Finalize and unloads its
#                  components (so their frames cannot be named): components stay loaded, and
#                  leaks whose stack is in the OpenMPI libraries only are suppressed
#                  (tests/support/lsan_mpi.supp).
# Exits 77 (meson's SKIP) where the suite cannot run: not root, no /dev/fuse or fusermount3, no
# venv with pytest and torch (tools/setup.sh makes it; CKPTFS_VENV, default
# ${CKPTFS_CACHE:-~/.cache/ckptfs}/venv), for mpi no mpirun or a ckptfs built without OpenMPI,
# or when the arguments select no test at all.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
tier=${1:?usage: run_suite.sh mount|mpi [PYTEST ARGS...]}
shift
skip() { echo "SKIP ($tier suite): $*"; exit 77; }

[[ $tier == mount || $tier == mpi ]] || { echo "run_suite.sh: unknown suite '$tier'" >&2; exit 2; }
[[ $(id -u) == 0 ]] || skip "needs root (real FUSE mounts, other users, network namespaces)"
[[ -c /dev/fuse ]] || skip "needs /dev/fuse"
command -v fusermount3 >/dev/null || skip "needs fusermount3 (fuse3)"
VENV=${CKPTFS_VENV:-${CKPTFS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ckptfs}/venv}
py=$VENV/bin/python
[[ -x $py ]] || skip "no Python venv at $VENV (tools/setup.sh makes it)"
"$py" -c 'import pytest, torch' 2>/dev/null || skip "the venv at $VENV lacks pytest or torch"
export CKPTFS_BIN=${CKPTFS_BIN:-$ROOT/build/src/ckptfs}
[[ -x $CKPTFS_BIN ]] || { echo "run_suite.sh: no ckptfs binary at $CKPTFS_BIN" >&2; exit 1; }
if [[ $tier == mpi ]]; then
  command -v mpirun >/dev/null || skip "needs mpirun (OpenMPI)"
  [[ $(ldd "$CKPTFS_BIN" 2>/dev/null) == *libmpi* ]] || skip "ckptfs was built without OpenMPI (-Dmpi)"
fi

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONDONTWRITEBYTECODE=1
# The frameworks' writers' outputs, made in one tier and copied in the next (writer_cache.py);
# keyed by the writers' sources and command lines. After changing the venv: rm -rf build-writers.
export CKPTFS_WRITER_CACHE=${CKPTFS_WRITER_CACHE:-$ROOT/build-writers}
# meson puts the build's library folder first in LD_LIBRARY_PATH (the suites depend on
# libckptfs_load.so); the tests name that library by its path, so the folder is taken out again.
if [[ -n ${LD_LIBRARY_PATH:-} ]]; then
  ldp=":$LD_LIBRARY_PATH:"
  ldp=${ldp//:$(dirname "$CKPTFS_BIN"):/:}
  ldp=${ldp#:}
  ldp=${ldp%:}
  if [[ -n $ldp ]]; then export LD_LIBRARY_PATH=$ldp; else unset LD_LIBRARY_PATH; fi
fi
args=(-q -p no:cacheprovider --durations=12)  # the slowest tests, for the CI time budget
# The mount tiers run their files on CKPTFS_TEST_WORKERS pytest-xdist workers (default 2, this
# CI machine's cores; 1 runs them in one process): a file's tests stay on one worker, in order,
# with its module fixtures (--dist loadfile). Much of the tier waits on the frameworks' writers'
# gloo jobs, daemons and child processes, so two files at once fill the cores. The mpi tier runs
# alone: its mpirun jobs take the cores themselves.
workers=${CKPTFS_TEST_WORKERS:-2}
if [[ $tier == mount ]] && ((workers > 1)) && "$py" -c 'import xdist' 2>/dev/null; then
  args+=(-n "$workers" --dist loadfile)
fi
if [[ ${CKPTFS_ASAN:-0} == 1 ]]; then
  export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
  if [[ $tier == mount ]]; then
    export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
    export CKPTFS_MOUNT_FUZZ_SECONDS=${CKPTFS_ASAN_MOUNT_FUZZ_SECONDS:-30}
    export CKPTFS_WRITE_FUZZ_SECONDS=${CKPTFS_ASAN_WRITE_FUZZ_SECONDS:-30}
    files=(test_mount.py test_hostile.py test_mount_fuzz.py test_cli.py test_write.py
           test_trust.py test_write_fuzz.py test_native.py test_maps_torchtitan.py
           test_passthrough.py test_trust_dcp.py test_trust_verl_maps.py test_trust_views.py
           test_fs_model_mount.py test_write_passthrough.py test_yaml_pyyaml.py)
    args+=("${files[@]/#/tests/python/}" -m "not mpi" -k "not written_through and not every_tool")
  else
    export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:fast_unwind_on_malloc=0
    export LSAN_OPTIONS="suppressions=$ROOT/tests/support/lsan_mpi.supp"
    export OMPI_MCA_mca_base_component_disable_dlclose=1
    args+=(tests/python -m mpi)
  fi
elif [[ $tier == mount ]]; then
  args+=(tests/python -m "not mpi")
else
  args+=(tests/python -m mpi)
fi

echo "$tier suite: $py -m pytest ${args[*]} $*  (CKPTFS_BIN=$CKPTFS_BIN)"
"$py" -m pytest "${args[@]}" "$@"
rc=$?
((rc == 5)) && skip "pytest collected no test"  # the arguments selected nothing
exit $rc
