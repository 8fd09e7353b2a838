#!/usr/bin/env bash
# Configures and builds, in build-sanitize/, the one sanitized CPU build that both the
# GoogleTest run under the sanitizers (scripts/sanitize.sh) and the libFuzzer harnesses
# (scripts/fuzz.sh) use: clang, AddressSanitizer (LeakSanitizer included),
# UndefinedBehaviorSanitizer and libFuzzer's coverage in the library, CPU kernels only (the
# sanitizers do not instrument device code). Building it once keeps CI to one sanitized
# compile.
#   bash scripts/sanitized_build.sh TARGET [TARGET ...]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
BUILD=${HEADSCOPE_SANITIZE_BUILD_DIR:-build-sanitize}
export CCACHE_BASEDIR=$PWD CCACHE_NOHASHDIR=1
generator=()
command -v ninja >/dev/null && [ ! -f "$BUILD/CMakeCache.txt" ] && generator=(-G Ninja)
mkdir -p "$BUILD"
CC=clang CXX=clang++ cmake -S . -B "$BUILD" "${generator[@]}" -DHEADSCOPE_BUILD_TESTS=ON \
  -DHEADSCOPE_SANITIZE=ON -DHEADSCOPE_FUZZ=ON -DHEADSCOPE_CUDA=OFF \
  -DPython3_EXECUTABLE="$(command -v "$PYTHON")" ${HEADSCOPE_CMAKE_ARGS:-} \
  >"$BUILD/configure.log" 2>&1 || { cat "$BUILD/configure.log"; exit 1; }
cmake --build "$BUILD" --parallel "${MAX_JOBS:-$(nproc)}" --target "$@"
