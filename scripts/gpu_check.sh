#!/usr/bin/env bash
# The GPU machine's check, in one call (see README "GPU check"): builds against that
# machine's own torch with all its cores, runs every test (CUDA ones included) and the
# benchmarks on the GPU, and writes logs and results under $OUT. Budget: < 8 minutes.
#
#   device run:  bash scripts/gpu_check.sh        (with OUT set by the device tool)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_results}
mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}
export MAX_JOBS=$(nproc) PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export HEADSCOPE_BUILD_DIR=build-gpu
status=0
step() { echo "== $1 ($(date +%T))" | tee -a "$OUT/summary.txt"; }

step "environment"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  "$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  nvcc --version | tail -1; } 2>&1 | tee "$OUT/environment.txt"

step "build (CUDA on, tests when GoogleTest is installed)"
tests=OFF; [ -f /usr/include/gtest/gtest.h ] && tests=ON
cmake -S . -B "$HEADSCOPE_BUILD_DIR" -G Ninja -DHEADSCOPE_CUDA=ON -DHEADSCOPE_BUILD_TESTS=$tests \
  -DPython3_EXECUTABLE="$(command -v "$PYTHON")" >"$OUT/build.log" 2>&1 &&
  cmake --build "$HEADSCOPE_BUILD_DIR" --parallel "$MAX_JOBS" >>"$OUT/build.log" 2>&1 &&
  "$PYTHON" -m pip install -q --no-build-isolation --no-deps . >>"$OUT/build.log" 2>&1 ||
  { echo "BUILD FAILED" | tee -a "$OUT/summary.txt"; tail -50 "$OUT/build.log"; exit 1; }
tail -1 "$OUT/build.log"

if [ "$tests" = ON ]; then
  step "ctest"
  ctest --test-dir "$HEADSCOPE_BUILD_DIR" --output-on-failure 2>&1 | tail -20 | tee -a "$OUT/summary.txt" || status=1
fi

step "pytest (CPU and CUDA parametrisations)"
"$PYTHON" -m pytest tests/python -q -rs -x --timeout=600 -p no:cacheprovider \
  --junitxml="$OUT/pytest.xml" >"$OUT/pytest.log" 2>&1 || status=1
tail -15 "$OUT/pytest.log" | tee -a "$OUT/summary.txt"

step "benchmarks on the GPU"
"$PYTHON" -m headscope.bench --device cuda --json "$OUT/bench_cuda.json" >"$OUT/bench.log" 2>&1 || status=1
cat "$OUT/bench.log"

step "done (status $status)"
exit $status
