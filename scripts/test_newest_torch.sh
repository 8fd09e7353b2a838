#!/usr/bin/env bash
# Builds headscope against the newest torch on PyPI in a virtual environment of its own
# (build-newest/) and runs the GoogleTest suite and pytest there. Not part of CI: a check
# of what the next torch pin would break. CPU kernels only (the newest torch's CUDA need
# not match the installed nvcc). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${HEADSCOPE_NEWEST_DIR:-build-newest}
[ -x "$DIR/venv/bin/python" ] || python3 -m venv "$DIR/venv"
PY=$PWD/$DIR/venv/bin/python
"$PY" -m pip install -q --upgrade pip
# every requirement but the torch pin, and the newest torch
mapfile -t reqs < <(grep -v -E '^[[:space:]]*(#|$)|^torch==' requirements.txt)
"$PY" -m pip install -q --upgrade torch "${reqs[@]}"
"$PY" -c "import torch; print(f'newest torch: {torch.__version__}')"
# programs linked against torch resolve its CUDA libraries' own dependencies (NCCL, ...)
# in this environment's nvidia/* wheels, not in the ones of the pinned torch
site=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
rpath_link=$(printf -- '-Wl,-rpath-link,%s ' "$site"/nvidia/*/lib "$site"/nvidia/*/*/lib)
export LDFLAGS="${LDFLAGS:-} $rpath_link"
HEADSCOPE_SKIP_PIP=1 PYTHON=$PY HEADSCOPE_BUILD_DIR=$DIR/build \
  HEADSCOPE_CMAKE_ARGS="-DHEADSCOPE_CUDA=OFF" bash scripts/build.sh
ctest --test-dir "$DIR/build" --output-on-failure -j "$(nproc)"
"$PY" -m pytest tests/python -q -rs "$@"
