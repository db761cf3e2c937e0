#!/usr/bin/env bash
# Runs every test of ckptfs on a fresh Debian 12 machine (as root), installing what it needs:
#   1. set-up (apt packages, Python venv)            tools/setup.sh
#   2. build and unit tests                           build/
#      the release and plain builds a packager makes  build-release/, build-plain/
#   3. unit tests under AddressSanitizer + UBSan      build-asan/
#   4. formatting (clang-format --dry-run -Werror)
#   5. bounded libFuzzer runs of the parsers (clang)  build-fuzz/
#   6. real-mount, hostile-source, CLI, write-path and ecosystem tests (pytest)
#   7. the real-mount, hostile-source, CLI, write-path and parallel-flush (mpirun) tests again,
#      against the ASan+UBSan binary
# Environment: CKPTFS_FUZZ_SECONDS (default 60 per target), CKPTFS_MOUNT_FUZZ_SECONDS (default
# 60, the randomized mount test), CKPTFS_WRITE_FUZZ_SECONDS (default 60, the write-path fuzz
# through a mount), CKPTFS_PYTEST_ARGS.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
step() { printf '\n=== %s\n' "$*"; }

step "set-up"
VENV=$(tools/setup.sh | tail -n 1)

step "build and unit tests"
[[ -f build/build.ninja ]] || meson setup build >/dev/null
flock /tmp/ckptfs-build.lock ninja -C build
meson test -C build --suite unit --print-errorlogs --no-rebuild

step "the release and plain builds (as packagers build; warnings are errors there too)"
for bt in release plain; do
  [[ -f build-$bt/build.ninja ]] ||
    meson setup build-$bt -Dbuildtype=$bt -Dtests=disabled >/dev/null
  flock /tmp/ckptfs-build.lock ninja -C build-$bt src/ckptfs src/libckptfs_load.so >/dev/null
  echo "build-$bt: ok"
done

step "unit tests under ASan + UBSan"
[[ -f build-asan/build.ninja ]] ||
  meson setup build-asan -Db_sanitize=address,undefined -Db_lundef=false -Dbuildtype=debug >/dev/null
flock /tmp/ckptfs-build.lock ninja -C build-asan
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
  meson test -C build-asan --suite unit --print-errorlogs --no-rebuild

step "formatting"
mapfile -t sources < <(git ls-files '*.cpp' '*.hpp')
clang-format --dry-run -Werror "${sources[@]}"
echo "clang-format: ${#sources[@]} files clean"

step "fuzzing (${CKPTFS_FUZZ_SECONDS:-60}s per target)"
[[ -f build-fuzz/build.ninja ]] ||
  CXX=clang++ meson setup build-fuzz -Dfuzz=enabled -Dtests=disabled -Db_sanitize=address,undefined \
    -Db_lundef=false >/dev/null
flock /tmp/ckptfs-build.lock ninja -C build-fuzz tests/fuzz_header tests/fuzz_checkpoint \
  tests/fuzz_side_files tests/fuzz_torch
fuzz() {  # target, seed directories...
  local target=$1 work=build-fuzz/corpus-$1
  shift
  mkdir -p "$work"
  build-fuzz/tests/$target -max_total_time="${CKPTFS_FUZZ_SECONDS:-60}" -max_len=65536 \
    -print_final_stats=1 "$work" "$@" 2>&1 | tail -n 4
}
fuzz fuzz_header tests/fuzz/seeds tests/data/bad/headers
fuzz fuzz_checkpoint tests/fuzz/seeds tests/data/bad/headers
fuzz fuzz_side_files tests/fuzz/seeds-json
fuzz fuzz_torch tests/fuzz/seeds-torch

step "real-mount, hostile-source, CLI and ecosystem tests"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONDONTWRITEBYTECODE=1
# shellcheck disable=SC2086
"$VENV/bin/python" -m pytest tests/python -q -p no:cacheprovider ${CKPTFS_PYTEST_ARGS:-}

step "real-mount, hostile-source, CLI and write-path tests against the ASan+UBSan daemon"
# The daemon must exit 0 after every clean unmount: a leak or an error report fails the test
# that mounted it. The randomized mount test gets a shorter budget here.
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
  CKPTFS_BIN="$ROOT/build-asan/src/ckptfs" CKPTFS_ASAN=1 \
  CKPTFS_MOUNT_FUZZ_SECONDS="${CKPTFS_ASAN_MOUNT_FUZZ_SECONDS:-30}" \
  CKPTFS_WRITE_FUZZ_SECONDS="${CKPTFS_ASAN_WRITE_FUZZ_SECONDS:-30}" \
  "$VENV/bin/python" -m pytest tests/python/test_mount.py tests/python/test_hostile.py \
  tests/python/test_mount_fuzz.py tests/python/test_cli.py tests/python/test_write.py \
  tests/python/test_trust.py tests/python/test_write_fuzz.py tests/python/test_native.py -q \
  -p no:cacheprovider \
  -k "not shared_mpi and not node_local and not written_through and not every_tool"
# The parallel flush under mpirun: OpenMPI keeps allocations past MPI_Finalize and unloads its
# components (so their frames cannot be named): components stay loaded, and leaks whose stack
# is in the OpenMPI libraries only are suppressed (tests/support/lsan_mpi.supp).
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:fast_unwind_on_malloc=0 \
  UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
  LSAN_OPTIONS="suppressions=$ROOT/tests/support/lsan_mpi.supp" \
  OMPI_MCA_mca_base_component_disable_dlclose=1 \
  CKPTFS_BIN="$ROOT/build-asan/src/ckptfs" CKPTFS_ASAN=1 \
  "$VENV/bin/python" -m pytest tests/python/test_mpi.py tests/python/test_trust.py -q \
  -p no:cacheprovider -k "test_mpi or shared_mpi or node_local"
