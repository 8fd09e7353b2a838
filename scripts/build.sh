#!/usr/bin/env bash
# Configures and builds the library and its GoogleTest suite in build/, installs the
# CMake package into build/install, then installs the Python package (reusing the
# same build: nothing is compiled twice).
# HEADSCOPE_CMAKE_ARGS adds CMake options (e.g. -DHEADSCOPE_CUDA=OFF).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
BUILD=${HEADSCOPE_BUILD_DIR:-build}
export CCACHE_BASEDIR=$PWD CCACHE_NOHASHDIR=1  # cache hits across clones
start=$(date +%s)
generator=()
command -v ninja >/dev/null && [ ! -f "$BUILD/CMakeCache.txt" ] && generator=(-G Ninja)
mkdir -p "$BUILD"
cmake -S . -B "$BUILD" "${generator[@]}" -DHEADSCOPE_BUILD_TESTS=ON \
  -DPython3_EXECUTABLE="$(command -v "$PYTHON")" ${HEADSCOPE_CMAKE_ARGS:-} >"$BUILD/configure.log" 2>&1 \
  || { cat "$BUILD/configure.log"; exit 1; }
grep "headscope:" "$BUILD/configure.log" || true
cmake --build "$BUILD" --parallel "${MAX_JOBS:-$(nproc)}"
cmake --install "$BUILD" --prefix "$BUILD/install" >/dev/null
HEADSCOPE_BUILD_DIR=$BUILD "$PYTHON" -m pip install -q --no-build-isolation --no-deps . 2>&1 \
  | { grep -v "Running pip as the 'root' user" || true; }
echo "build: done in $(($(date +%s) - start)) s"
