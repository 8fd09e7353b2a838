#!/usr/bin/env bash
# Builds the libFuzzer harnesses (fuzz/fuzz_<family>.cpp) in the sanitized build of
# scripts/sanitized_build.sh (clang, AddressSanitizer, UndefinedBehaviorSanitizer, CPU
# kernels) and runs them, in one of two modes:
# - repeatable (default, CI): every saved input (fuzz/corpus/<family>/: the seed corpus and
#   every past finding) and a fixed set of generated inputs (scripts/fuzz_inputs.py, the same
#   bytes on every machine), each run once (-runs=0) on one thread. No clock decides how
#   many: a slow machine runs the same inputs as a fast one, only for longer. Each family
#   prints how many inputs it ran and their digest, equal from run to run.
# - exploring (HEADSCOPE_FUZZ_SECONDS=N): the saved inputs, then N seconds per family of
#   libFuzzer's own search from a random seed, on 1 or 2 threads as each input says. New
#   inputs collect in build-sanitize/corpus/<family>/; a finding is written to
#   build-sanitize/findings/<family>/ and copied into fuzz/corpus/<family>/, where every
#   later run replays it (rename it to say what it found, fix it, commit both).
# Any finding fails the run.
#   bash scripts/fuzz.sh [family ...]       # default: every family
#   HEADSCOPE_FUZZ_INPUTS=N                 # repeatable mode: N generated inputs per family
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
BUILD=${HEADSCOPE_SANITIZE_BUILD_DIR:-build-sanitize}
# generated inputs per family in the repeatable mode: about 30 s of one core each here
declare -A INPUTS=([vas]=7000 [attribution]=35000 [mixer]=24000)
families=("$@")
((${#families[@]})) || families=(vas attribution mixer)
bash scripts/sanitized_build.sh "${families[@]/#/headscope_fuzz_}"
# libtorch is not instrumented: its one-time caches read as leaks to a per-input leak check
# (the sanitized GoogleTest run checks headscope's own code for leaks at exit instead), and
# libFuzzer would run an input a second time to look for one.
export ASAN_OPTIONS=detect_leaks=0:detect_odr_violation=0:abort_on_error=0
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
common=(-detect_leaks=0 -max_len=512 -print_final_stats=1)
for family in "${families[@]}"; do
  fuzzer=$BUILD/headscope_fuzz_$family
  saved=fuzz/corpus/$family
  findings=$BUILD/findings/$family
  log=$BUILD/fuzz_$family.log
  rm -rf "$findings"
  mkdir -p "$findings"
  start=$SECONDS
  if [ -n "${HEADSCOPE_FUZZ_SECONDS:-}" ]; then
    echo "== fuzz $family: replaying $(ls "$saved" | wc -l) saved inputs"
    replay=$("$fuzzer" -runs=0 -detect_leaks=0 "$saved" 2>&1) || { echo "$replay" | tail -60; exit 1; }
    corpus=$BUILD/corpus/$family
    mkdir -p "$corpus"
    echo "== fuzz $family: exploring for $HEADSCOPE_FUZZ_SECONDS s"
    if ! "$fuzzer" "${common[@]}" -max_total_time="$HEADSCOPE_FUZZ_SECONDS" \
        -artifact_prefix="$findings/" "$corpus" "$saved" 2>"$log"; then
      tail -60 "$log"
      for found in "$findings"/*; do
        [ -e "$found" ] && cp "$found" "$saved/" && echo "== added $saved/$(basename "$found")"
      done
      exit 1
    fi
    grep -E "stat::number_of_executed_units|stat::peak_rss_mb" "$log" | tr '\n' ' '
    echo
  else
    generated=$BUILD/fuzz-inputs/$family
    count=${HEADSCOPE_FUZZ_INPUTS:-${INPUTS[$family]}}
    sha=$("$PYTHON" scripts/fuzz_inputs.py "$family" "$count" "$generated")
    echo "== fuzz $family: $(ls "$saved" | wc -l) saved and $count generated inputs (sha256 ${sha:0:16})"
    # one thread: the inputs alone decide each call
    if ! HEADSCOPE_FUZZ_THREADS=1 HEADSCOPE_FUZZ_TALLY=1 "$fuzzer" "${common[@]}" -runs=0 \
        -artifact_prefix="$findings/" "$saved" "$generated" 2>"$log"; then
      tail -60 "$log"
      exit 1
    fi
    rm -rf "$generated"
    # the harness's own count (the saved and generated inputs and libFuzzer's empty one)
    grep -E "^headscope fuzz tally:" "$log" | tr '\n' ' '
    grep -E "stat::peak_rss_mb" "$log" | tr '\n' ' '
    echo "($((SECONDS - start)) s)"
  fi
done
