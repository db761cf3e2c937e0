#!/usr/bin/env bash
# Idempotent set-up on a fresh Debian 12 machine (run as root): Debian packages and the
# Python venv used by tests, tools and the demo. Prints the venv path on the last line.
#   CKPTFS_CACHE  where the venv lives (default: ~/.cache/ckptfs)
#   CKPTFS_NO_VENV=1  skip the venv (C++ build only)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${CKPTFS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ckptfs}
VENV=$CACHE/venv

pkgs=(meson ninja-build pkg-config g++ clang clang-format libclang-rt-14-dev
      libfuse3-dev fuse3 nlohmann-json3-dev libspdlog-dev libfmt-dev libgtest-dev
      libopenmpi-dev openmpi-bin python3-venv psmisc procps time ccache rsync)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [[ "${CKPTFS_NO_VENV:-0}" != 1 ]]; then
  req="$ROOT/tools/requirements.txt"
  fw="$ROOT/tools/requirements-frameworks.txt"
  stamp="$VENV/.ckptfs-requirements"
  if [[ ! -x "$VENV/bin/python" ]] || ! cat "$req" "$fw" | cmp -s - "$stamp"; then
    echo "setup: creating Python venv in $VENV (torch, transformers, safetensors)" >&2
    mkdir -p "$CACHE"
    py=${PYTHON:-python3}
    if ! "$py" -m venv --help >/dev/null 2>&1; then py=/usr/bin/python3; fi
    [[ -x "$VENV/bin/python" ]] || "$py" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r "$req"
    # The frameworks' own writers, for the tests (their dependency pins are not ours).
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -r "$fw"
    cat "$req" "$fw" > "$stamp"
  fi
fi
echo "$VENV"
