#!/usr/bin/env bash
# Builds the library and its GoogleTest suite with AddressSanitizer (LeakSanitizer
# included) and UndefinedBehaviorSanitizer in build-sanitize/ (CPU kernels only: the
# sanitizers do not instrument device code), then runs the suite under them. Any report
# fails the run: UBSan does not recover, and LeakSanitizer reports every leak at exit.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
BUILD=${HEADSCOPE_SANITIZE_BUILD_DIR:-build-sanitize}
export CCACHE_BASEDIR=$PWD CCACHE_NOHASHDIR=1
generator=()
command -v ninja >/dev/null && [ ! -f "$BUILD/CMakeCache.txt" ] && generator=(-G Ninja)
mkdir -p "$BUILD"
cmake -S . -B "$BUILD" "${generator[@]}" -DHEADSCOPE_BUILD_TESTS=ON -DHEADSCOPE_SANITIZE=ON \
  -DHEADSCOPE_CUDA=OFF -DPython3_EXECUTABLE="$(command -v "$PYTHON")" >"$BUILD/configure.log" 2>&1 \
  || { cat "$BUILD/configure.log"; exit 1; }
cmake --build "$BUILD" --parallel "${MAX_JOBS:-$(nproc)}" --target headscope_cpp_tests
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0:halt_on_error=1:detect_odr_violation=0
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
ctest --test-dir "$BUILD" --output-on-failure -j "$(nproc)"
