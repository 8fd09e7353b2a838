#!/usr/bin/env bash
# The GPU machine's check, in one call (docs/DEVELOPING.md, "The GPU check"): every CUDA test and the
# benchmarks on the GPU, logs and results under $OUT (8 files by default, the most the device
# tool returns). Budget: about 5 minutes on a 16-core H200 machine.
#
#   device run:  bash scripts/gpu_check.sh
#   (optional)   HEADSCOPE_PREBUILT=build-carry: a library built elsewhere against the same
#                torch, used when it loads and passes a smoke check; otherwise, or when it is
#                absent, the library is built here against this machine's own torch.
#   (optional)   HEADSCOPE_GPU_BENCH="vas:100 cost:180:big" picks the benchmark families, each
#                family:seconds[:big] (default: vas, attribution, mixer, cost and hf).
#   (optional)   HEADSCOPE_GPU_STEPS="tests memcheck profile bench" (the default) picks the
#                steps; "ncu" adds Nsight Compute's stall and memory sections for the vas
#                kernels of one layer (about a minute; one file more: leave "bench" out).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-$REPO/gpu_results}
mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
STEPS=" ${HEADSCOPE_GPU_STEPS:-tests memcheck profile bench} "
status=0
step() { echo "== $1 ($(date +%T))" | tee -a "$OUT/summary.txt"; }
want() { [[ "$STEPS" == *" $1 "* ]]; }

step "environment"
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
  "$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  nvcc --version | tail -1; nproc; } 2>&1 | tee -a "$OUT/summary.txt"

# The package is imported from the source tree (ops/ is the package `headscope`).
SHIM=$(mktemp -d)
ln -s "$REPO/ops" "$SHIM/headscope"
export PYTHONPATH=$SHIM${PYTHONPATH:+:$PYTHONPATH}
smoke() {  # loads the library and runs a CPU and a CUDA kernel (correctness is pytest's job)
  HEADSCOPE_LIBRARY=$1 "$PYTHON" - <<'EOF'
import torch, headscope  # noqa: F401
assert torch._C._dispatch_has_kernel_for_dispatch_key("headscope::vas_head_stats", "CUDA")
g = torch.Generator().manual_seed(0)
A = torch.softmax(torch.randn(2, 3, 70, 70, generator=g), -1); V = torch.randn(2, 3, 70, 16, generator=g)
n = torch.tensor([70, 50])
cpu = torch.ops.headscope.vas_head_stats(A, V, n)
print("smoke: the library loads and its CPU kernel runs")
try:
    gpu = torch.ops.headscope.vas_head_stats(A.cuda(), V.cuda(), n.cuda()).cpu()
    print("smoke: vas_head_stats max |cpu - cuda| =", (cpu - gpu).abs().max().item())
except Exception as e:  # reported; the tests below say more
    print("smoke: CUDA vas_head_stats raised", repr(e)[:300])
EOF
}

step "library"
LIB=""
if [ -n "${HEADSCOPE_PREBUILT:-}" ] && [ -f "$HEADSCOPE_PREBUILT/libheadscope.so" ]; then
  if smoke "$REPO/$HEADSCOPE_PREBUILT/libheadscope.so" >>"$OUT/build.log" 2>&1; then
    LIB=$REPO/$HEADSCOPE_PREBUILT/libheadscope.so
    echo "using the carried $HEADSCOPE_PREBUILT/libheadscope.so" | tee -a "$OUT/summary.txt"
  else
    echo "the carried library failed its smoke check (build.log); building here" | tee -a "$OUT/summary.txt"
  fi
fi
if [ -z "$LIB" ]; then
  BUILD=build-gpu
  cmake -S . -B $BUILD -G Ninja -DHEADSCOPE_CUDA=ON -DHEADSCOPE_BUILD_TESTS=OFF \
    -DPython3_EXECUTABLE="$(command -v "$PYTHON")" >>"$OUT/build.log" 2>&1 &&
    cmake --build $BUILD --parallel "$(nproc)" >>"$OUT/build.log" 2>&1 ||
    { echo "BUILD FAILED" | tee -a "$OUT/summary.txt"; tail -40 "$OUT/build.log"; exit 1; }
  LIB=$REPO/$BUILD/libheadscope.so
  smoke "$LIB" 2>&1 | tail -5 | tee -a "$OUT/summary.txt"
fi
export HEADSCOPE_LIBRARY=$LIB

if want tests; then
step "pytest, CUDA parametrisations (one process per file, in parallel)"
# One process per file: a kernel fault poisons its CUDA context, and only that file's later
# tests should see it. CUDA_LAUNCH_BLOCKING pins a fault on the launch that made it.
timeout_arg=""
"$PYTHON" -c "import pytest_timeout" 2>/dev/null && timeout_arg="--timeout=180"
pids=()
for f in tests/python/test_*.py; do
  name=$(basename "$f" .py)
  OMP_NUM_THREADS=2 CUDA_LAUNCH_BLOCKING=1 "$PYTHON" -m pytest "$f" -q -rfEs -k cuda \
    $timeout_arg -p no:cacheprovider >"$SHIM/$name.log" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; rc=$?; [ $rc -eq 0 ] || [ $rc -eq 5 ] || status=1; done  # 5: none selected
for f in "$SHIM"/test_*.log; do echo "### $(basename "$f")"; cat "$f"; done >"$OUT/pytest.log"
for f in "$SHIM"/test_*.log; do echo "$(basename "$f" .log): $(tail -n1 "$f")"; done | tee -a "$OUT/summary.txt"
grep -hE "^(FAILED|ERROR)" "$SHIM"/test_*.log | head -40 | tee -a "$OUT/summary.txt"
fi

if want memcheck; then
step "compute-sanitizer memcheck: every CUDA op once on small ragged inputs"
cat >"$SHIM/memcheck_ops.py" <<'EOF'
import torch, headscope  # noqa: F401
ops, d = torch.ops.headscope, "cuda"
g = torch.Generator().manual_seed(0)
for T, Dh in [(70, 8), (70, 40), (130, 130)]:
    A = torch.softmax(torch.randn(2, 3, T, T, generator=g), -1).to(d)
    V = torch.randn(2, 3, T, Dh, generator=g).to(d)
    n = torch.tensor([T, T // 2 + 3], device=d)
    ops.vas_head_stats(A, V, n)
    ops.vas_head_stats(A, V, n, torch.tensor([0, 5], device=d))
    q, k = torch.randn(2, 3, T, 24, generator=g).to(d), torch.randn(2, 1, T, 24, generator=g).to(d)
    ops.vas_head_stats_qk(q, k, V, n, 0.2, True)
    ops.vas_head_stats_qk(q, k, V, n, 0.2, False)
rid = torch.randint(-1, 8, (2, 300), generator=g).to(d)
q, k = torch.randn(2, 4, 3, 32, generator=g).to(d), torch.randn(2, 2, 300, 32, generator=g).to(d)
for w in (torch.rand(2, 1, generator=g).to(d) + 0.1, torch.rand(2, 3, generator=g).to(d)):
    Tq = w.shape[1]
    ops.region_pool_qk(q[:, :, :Tq], k, w, rid, 8, 0.2, True, None, "mean")
    ops.region_pool(torch.softmax(torch.randn(2, 4, Tq, 300, generator=g), -1).to(d), w, rid, 8, "sum")
torch.cuda.synchronize()
print("memcheck script done")
EOF
if command -v compute-sanitizer >/dev/null; then
  timeout 150 compute-sanitizer --tool memcheck --print-limit 20 "$PYTHON" "$SHIM/memcheck_ops.py" 2>&1 |
    grep -E "ERROR SUMMARY|Invalid|memcheck script|Error" | head -30 | tee -a "$OUT/summary.txt"
else
  echo "compute-sanitizer not found" | tee -a "$OUT/summary.txt"
fi
fi

# One Qwen2.5-VL-7B-sized layer through both vas ops (the profiler and ncu steps).
cat >"$SHIM/vas_layer.py" <<'EOF'
import sys
import torch, headscope  # noqa: F401
ops = torch.ops.headscope
B, H, T, Dh = 1, 28, 4096, 128
A = torch.softmax(torch.randn(B, H, T, T, device="cuda"), -1)
V = torch.randn(B, H, T, Dh, device="cuda")
q, k = torch.randn(B, H, T, Dh, device="cuda"), torch.randn(B, 4, T, Dh, device="cuda")
n = torch.full((B,), T, device="cuda")
run = lambda: (ops.vas_head_stats(A, V, n), ops.vas_head_stats_qk(q, k, V, n, Dh ** -0.5, True))
for _ in range(2):
    run()
torch.cuda.synchronize()
if "--profile" in sys.argv:
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            run()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=60))
EOF
if want profile; then
  step "kernel times of one vas layer (torch.profiler)"
  timeout 60 "$PYTHON" "$SHIM/vas_layer.py" --profile 2>&1 | grep -v Warning | tee -a "$OUT/summary.txt" || status=1
fi

if want ncu; then
  step "Nsight Compute: the vas kernels of one layer"
  timeout 240 ncu --clock-control none -k regex:"attn_pass|qk_rows|qk_pass|prep_kernel" -c 4 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    "$PYTHON" "$SHIM/vas_layer.py" >"$OUT/ncu.txt" 2>&1 || status=1
  grep -E "==PROF==|attn_pass|qk_rows|qk_pass|prep_kernel|Duration|Throughput|Stall|Warp Cycles|Issued|Eligible|Achieved Occupancy|Registers|Block Limit|L1/TEX Hit|L2 Hit|Mem Busy|Max Bandwidth|Executed Ipc" \
    "$OUT/ncu.txt" | head -150
fi

if want bench; then
step "benchmarks on the GPU (each family under its own time limit)"
# family:seconds[:big]; big: the sizes a CPU cannot run in reasonable time or memory (cost:
# all 28 layers of the 2B shape in float32 and bfloat16; hf: the tracer on them in bfloat16)
for fam_limit in ${HEADSCOPE_GPU_BENCH:-vas:100 attribution:60 mixer:80 cost:180:big hf:150:big}; do
  IFS=: read -r fam limit big <<<"$fam_limit"
  timeout "$limit" "$PYTHON" -m headscope.bench --device cuda --family "$fam" ${big:+--big} \
    --json "$OUT/bench_$fam.json" >>"$OUT/bench.log" 2>&1 ||
    { echo "bench $fam: exit $?" | tee -a "$OUT/summary.txt"; status=1; }
done
cat "$OUT/bench.log"
fi

step "done (status $status)"
exit $status
