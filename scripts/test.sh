#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test: GoogleTest through ctest (also
# under AddressSanitizer, LeakSanitizer and UndefinedBehaviorSanitizer), the libFuzzer
# harnesses on a fixed set of inputs, the TorchScript round trip through the C++ example,
# pytest, and the shapes demo on one image.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
BUILD=${HEADSCOPE_BUILD_DIR:-build}
bash scripts/setup_env.sh
bash scripts/build.sh
bash scripts/build_example.sh

echo "== ctest"
ctest --test-dir "$BUILD" --output-on-failure -j "$(nproc)"

echo "== ctest under ASan + LSan + UBSan (CPU kernels)"
bash scripts/sanitize.sh

echo "== libFuzzer harnesses (the saved corpus and a fixed set of inputs per family)"
bash scripts/fuzz.sh

echo "== pytest"
export HEADSCOPE_EXAMPLE_BIN=$PWD/$BUILD/example/headscope_run_torchscript
# one worker per core (pytest-xdist); every test stays bounded in its worker (pytest.ini,
# conftest.py), and the slowest are listed at the end
"$PYTHON" -m pytest tests/python -q -rs -n "${HEADSCOPE_TEST_WORKERS:-$(nproc)}" --durations=15 "$@"

echo "== the shapes demo, on one image"
demo_out=$(mktemp -d)
"$PYTHON" -m headscope.shapes demo --images 1 --out "$demo_out"
rm -rf "$demo_out"
