#!/usr/bin/env bash
# Runs the GoogleTest suite under AddressSanitizer (LeakSanitizer included) and
# UndefinedBehaviorSanitizer, built by scripts/sanitized_build.sh (CPU kernels only). Any
# report fails the run: UBSan does not recover, and LeakSanitizer reports every leak at exit.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${HEADSCOPE_SANITIZE_BUILD_DIR:-build-sanitize}
bash scripts/sanitized_build.sh headscope_cpp_tests
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0:halt_on_error=1:detect_odr_violation=0
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
ctest --test-dir "$BUILD" --output-on-failure -j "$(nproc)"
