#!/usr/bin/env bash
# Builds the libFuzzer harnesses (fuzz/fuzz_<family>.cpp) with clang, AddressSanitizer and
# UndefinedBehaviorSanitizer in build-fuzz/ (CPU kernels), replays every saved input
# (fuzz/corpus/<family>/, the seed corpus and every past finding), then fuzzes each family.
# By default (CI) a fixed seed and a fixed number of inputs per family, about a minute each
# here, on one thread: a bounded cost, and runs that stay close to each other (libFuzzer's
# choices still differ a little between processes); HEADSCOPE_FUZZ_SECONDS=N fuzzes N
# seconds per family from a random seed, on 1 or 2 threads as each input says (looking for
# new findings). New inputs go to build-fuzz/corpus/<family>/; a finding is written to
# build-fuzz/findings/<family>/ and fails the run.
#   bash scripts/fuzz.sh [family ...]       # default: every family
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
BUILD=${HEADSCOPE_FUZZ_BUILD_DIR:-build-fuzz}
# inputs per family in the repeatable mode: about 60 s each on a 2-core machine
declare -A RUNS=([vas]=15000 [attribution]=100000 [mixer]=60000)
families=("$@")
((${#families[@]})) || families=(vas attribution mixer)
export CCACHE_BASEDIR=$PWD CCACHE_NOHASHDIR=1
generator=()
command -v ninja >/dev/null && [ ! -f "$BUILD/CMakeCache.txt" ] && generator=(-G Ninja)
mkdir -p "$BUILD"
CC=clang CXX=clang++ cmake -S . -B "$BUILD" "${generator[@]}" -DHEADSCOPE_FUZZ=ON \
  -DHEADSCOPE_SANITIZE=ON -DHEADSCOPE_CUDA=OFF -DPython3_EXECUTABLE="$(command -v "$PYTHON")" ${HEADSCOPE_CMAKE_ARGS:-} \
  >"$BUILD/configure.log" 2>&1 || { cat "$BUILD/configure.log"; exit 1; }
cmake --build "$BUILD" --parallel "${MAX_JOBS:-$(nproc)}" \
  --target "${families[@]/#/headscope_fuzz_}"
# libtorch is not instrumented: its one-time caches read as leaks to a per-input leak check
# (the sanitized GoogleTest run checks headscope's own code for leaks at exit instead).
export ASAN_OPTIONS=detect_leaks=0:detect_odr_violation=0:abort_on_error=0
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
for family in "${families[@]}"; do
  fuzzer=$BUILD/headscope_fuzz_$family
  saved=fuzz/corpus/$family
  echo "== fuzz $family: replaying $(ls "$saved" | wc -l) saved inputs"
  replay=$("$fuzzer" -runs=0 "$saved" 2>&1) || { echo "$replay" | tail -60; exit 1; }
  if [ -n "${HEADSCOPE_FUZZ_SECONDS:-}" ]; then
    budget=(-max_total_time="$HEADSCOPE_FUZZ_SECONDS")
    corpus=$BUILD/corpus/$family
  else  # fixed seed, fresh corpus, one thread (threads racing on the coverage counters
        # change what the fuzzer keeps); the time cap guards a slower machine
    budget=(-seed=1 -runs="${RUNS[$family]}" -max_total_time=300)
    export HEADSCOPE_FUZZ_THREADS=1
    corpus=$BUILD/corpus-repeatable/$family
    rm -rf "$corpus"
  fi
  mkdir -p "$corpus" "$BUILD/findings/$family"
  echo "== fuzz $family: ${budget[*]}"
  "$fuzzer" "${budget[@]}" -max_len=512 -print_final_stats=1 \
    -artifact_prefix="$BUILD/findings/$family/" "$corpus" "$saved" 2>"$BUILD/fuzz_$family.log" \
    || { tail -60 "$BUILD/fuzz_$family.log"; exit 1; }
  grep -E "stat::number_of_executed_units|stat::peak_rss_mb" "$BUILD/fuzz_$family.log" | tr '\n' ' '
  echo
done
