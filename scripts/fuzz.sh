#!/usr/bin/env bash
# Builds the libFuzzer harnesses (fuzz/fuzz_<family>.cpp) in the sanitized build of
# scripts/sanitized_build.sh (clang, AddressSanitizer, UndefinedBehaviorSanitizer, CPU
# kernels), replays every saved input (fuzz/corpus/<family>/, the seed corpus and every past
# finding), then fuzzes each family. By default (CI) a fixed seed and a fixed number of
# inputs per family, on one thread, with a time cap: a bounded cost, and runs that stay
# close to each other (libFuzzer's choices still differ a little between processes);
# HEADSCOPE_FUZZ_SECONDS=N fuzzes N seconds per family from a random seed, on 1 or 2
# threads as each input says (looking for new findings). New inputs go to
# build-sanitize/corpus/<family>/; a finding is written to build-sanitize/findings/<family>/
# and fails the run.
#   bash scripts/fuzz.sh [family ...]       # default: every family
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${HEADSCOPE_SANITIZE_BUILD_DIR:-build-sanitize}
# inputs per family in the repeatable mode: about 60 s each on a 2-core machine
declare -A RUNS=([vas]=15000 [attribution]=100000 [mixer]=60000)
families=("$@")
((${#families[@]})) || families=(vas attribution mixer)
bash scripts/sanitized_build.sh "${families[@]/#/headscope_fuzz_}"
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
    budget=(-seed=1 -runs="${RUNS[$family]}" -max_total_time=90)
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
