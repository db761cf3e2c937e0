#!/usr/bin/env bash
# Runs every test of ckptfs on a fresh Debian 12 machine (as root), installing what it needs:
#   1. set-up (apt packages, Python venv)            tools/setup.sh
#   2. build and unit tests                           build/, meson's unit suite
#      the release build a packager makes            build-release/ (-O1: the ASan build)
#   3. unit tests under AddressSanitizer + UBSan      build-asan/, unit suite
#   4. formatting (clang-format --dry-run -Werror)
#   5. bounded libFuzzer runs of the parsers (clang)  build-fuzz/
#   6. real-mount, hostile-source, CLI, write-path and ecosystem tests, then the parallel-flush
#      (mpirun) tests: meson's mount and mpi suites in build/ (pytest through
#      tests/python/run_suite.sh)
#   7. the real-mount, hostile-source, CLI and write-path tests, then the parallel-flush tests,
#      against the ASan+UBSan binary: the mount and mpi suites in build-asan/ (run_suite.sh
#      picks that tier's files, filters and sanitizer options there)
# The mount and mpi suites also run alone: `meson test -C build --suite mount -v` (root, /dev/fuse
# and the venv, else they report SKIP).
# Environment: CKPTFS_FUZZ_SECONDS (default 30 per target; 6 targets), CKPTFS_MOUNT_FUZZ_SECONDS (default
# 35 here, the randomized mount test), CKPTFS_WRITE_FUZZ_SECONDS (default 35 here, the write-path fuzz
# through a mount), CKPTFS_ASAN_MOUNT_FUZZ_SECONDS and CKPTFS_ASAN_WRITE_FUZZ_SECONDS (default
# 30, the same in step 7), CKPTFS_PYTEST_ARGS (more pytest arguments for step 6),
# CKPTFS_TEST_WORKERS (pytest-xdist workers of the mount tiers in steps 6 and 7; default 2, 1 for
# one process).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
# Each step prints its start and the minutes since the run began, and the last line the total:
# CI time is a budget (35 minutes on the 2-core CI machine), and the log shows where it goes.
T0=$SECONDS
LAST=$SECONDS
step() {
  printf '\n=== %s   (previous step %d s; %d s so far)\n' "$*" $((SECONDS - LAST)) $((SECONDS - T0))
  LAST=$SECONDS
}
trap 'printf "\n=== tools/test.sh: exit %d after %d s (last step %d s)\n" $? $((SECONDS - T0)) $((SECONDS - LAST))' EXIT

step "set-up"
VENV=$(tools/setup.sh | tail -n 1)
# ccache (installed by setup.sh; meson finds it): the four builds below recompile the same
# sources on every fresh clone. Paths inside the clone and the clone's own location are left out
# of the hash, so a clone elsewhere hits the same cache.
export CCACHE_BASEDIR=$ROOT CCACHE_NOHASHDIR=1

step "build and unit tests"
[[ -f build/build.ninja ]] || meson setup build >/dev/null
flock /tmp/ckptfs-build.lock ninja -C build
meson test -C build --suite unit --print-errorlogs --no-rebuild

# Warnings are errors in every build type: -O2 -g above, -O3 in the release build here (its
# inlining brings its own warnings), -O1 in the ASan build below.
step "the release build (as packagers build; warnings are errors there too)"
for bt in release; do
  [[ -f build-$bt/build.ninja ]] ||
    meson setup build-$bt -Dbuildtype=$bt -Dtests=disabled >/dev/null
  flock /tmp/ckptfs-build.lock ninja -C build-$bt src/ckptfs src/libckptfs_load.so >/dev/null
  echo "build-$bt: ok"
done

step "unit tests under ASan + UBSan"
[[ -f build-asan/build.ninja ]] ||
  meson setup build-asan -Db_sanitize=address,undefined -Db_lundef=false -Dbuildtype=debug \
    -Doptimization=1 >/dev/null  # -O1, as ASan advises: the sanitized daemon's CPU-bound tests
                                 # (big headers, 60,000 chunks) ran 2.5x longer at -O0
flock /tmp/ckptfs-build.lock ninja -C build-asan
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
  meson test -C build-asan --suite unit --print-errorlogs --no-rebuild

step "formatting"
mapfile -t sources < <(git ls-files '*.cpp' '*.hpp')
clang-format --dry-run -Werror "${sources[@]}"
echo "clang-format: ${#sources[@]} files clean"

step "fuzzing (${CKPTFS_FUZZ_SECONDS:-30}s per target)"
[[ -f build-fuzz/build.ninja ]] ||
  CXX=clang++ meson setup build-fuzz -Dfuzz=enabled -Dtests=disabled -Db_sanitize=address,undefined \
    -Db_lundef=false >/dev/null
flock /tmp/ckptfs-build.lock ninja -C build-fuzz tests/fuzz_header tests/fuzz_checkpoint \
  tests/fuzz_side_files tests/fuzz_torch tests/fuzz_model_map tests/fuzz_megatron_args
# Each target is one process on one core: they run two at a time (this machine's cores), each
# for its whole time, and each prints its own result when the pair is done.
fuzz() {  # target, seed directories...
  local target=$1 work=build-fuzz/corpus-$1
  shift
  mkdir -p "$work"
  build-fuzz/tests/$target -max_total_time="${CKPTFS_FUZZ_SECONDS:-30}" -max_len=65536 -timeout=10 \
    -print_final_stats=1 "$work" "$@" >"build-fuzz/$target.log" 2>&1
}
fuzz_pair() {  # "target seeds..." "target seeds..."
  local rc=0 a b
  read -ra a <<<"$1"
  read -ra b <<<"$2"
  fuzz "${a[@]}" &
  local pa=$!
  fuzz "${b[@]}" &
  local pb=$!
  wait "$pa" || rc=1
  wait "$pb" || rc=1
  for t in "${a[0]}" "${b[0]}"; do
    echo "--- $t"
    tail -n 4 "build-fuzz/$t.log"
  done
  if ((rc)); then
    echo "tools/test.sh: a fuzzer failed; its log:" >&2
    cat "build-fuzz/${a[0]}.log" "build-fuzz/${b[0]}.log" | tail -n 80 >&2
    return 1
  fi
}
fuzz_pair "fuzz_header tests/fuzz/seeds tests/data/bad/headers" \
  "fuzz_checkpoint tests/fuzz/seeds tests/data/bad/headers"
fuzz_pair "fuzz_side_files tests/fuzz/seeds-json" "fuzz_torch tests/fuzz/seeds-torch"
fuzz_pair "fuzz_model_map tests/fuzz/seeds-maps" "fuzz_megatron_args tests/fuzz/seeds-args tests/fuzz/seeds-yaml"

# Steps 6 and 7: meson's mount and mpi suites (tests/meson.build), pytest over real mounts of
# the ckptfs the build made; --verbose streams pytest's output (its progress, and on a failure
# the failure itself). `--test-args ''` adds nothing.
# A suite that cannot run exits 77 and meson counts it a skip, not a failure. Here the venv,
# root and /dev/fuse are all set up above, so a skip means something is missing: it fails.
suite() {  # build dir, suite, meson test options...
  local dir=$1 name=$2
  shift 2
  CKPTFS_VENV="$VENV" meson test -C "$dir" --suite "$name" --no-rebuild --verbose "$@"
  if grep -q '"result": "SKIP"' "$dir/meson-logs/testlog.json"; then
    echo "tools/test.sh: the $name suite in $dir was skipped (exit 77); see its log" >&2
    return 1
  fi
}

step "real-mount, hostile-source, CLI and ecosystem tests; the parallel flush under mpirun"
export CKPTFS_MOUNT_FUZZ_SECONDS=${CKPTFS_MOUNT_FUZZ_SECONDS:-35}
export CKPTFS_WRITE_FUZZ_SECONDS=${CKPTFS_WRITE_FUZZ_SECONDS:-35}
suite build mount --test-args "${CKPTFS_PYTEST_ARGS:-}"
suite build mpi --test-args "${CKPTFS_PYTEST_ARGS:-}"

step "real-mount, hostile-source, CLI and write-path tests against the ASan+UBSan daemon"
# In build-asan the suites are that tier (tests/python/run_suite.sh): the daemon must exit 0
# after every clean unmount, so a leak or an error report fails the test that mounted it; the
# randomized mount and write tests get CKPTFS_ASAN_{MOUNT,WRITE}_FUZZ_SECONDS (default 30);
# under mpirun, OpenMPI's own leaks are suppressed (tests/support/lsan_mpi.supp).
suite build-asan mount
suite build-asan mpi
