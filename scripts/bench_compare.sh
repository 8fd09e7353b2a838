#!/usr/bin/env bash
# Compares the kernels of this checkout's build with those of another revision: builds
# REV's library (CPU kernels) in a temporary worktree, then runs `python -m headscope.bench`
# with each library in alternating rounds (the Python benchmark code is this checkout's for
# both) and prints every timing's ratio, this build over REV's, as the median over rounds.
#
#   bash scripts/bench_compare.sh REV [bench args]     e.g. REV=HEAD~3 --family mixer --quick
#
# HEADSCOPE_COMPARE_ROUNDS (default 3) rounds; HEADSCOPE_LIBRARY: this side's library
# (default build/libheadscope.so); HEADSCOPE_COMPARE_FAMILIES: the op families REV's build
# compiles (default all). Run it before landing a kernel change.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ $# -ge 1 ] || { echo "usage: bash scripts/bench_compare.sh REV [bench args]" >&2; exit 2; }
rev=$1
shift
commit=$(git rev-parse --verify -q "$rev^{commit}") || { echo "bench_compare: no revision $rev" >&2; exit 2; }
rounds=${HEADSCOPE_COMPARE_ROUNDS:-3}
here=${HEADSCOPE_LIBRARY:-$PWD/build/libheadscope.so}
[ -f "$here" ] || { echo "bench_compare: no library at $here (bash scripts/build.sh)" >&2; exit 2; }
families=${HEADSCOPE_COMPARE_FAMILIES:-mixer;vas;attribution}

work=$(mktemp -d)
cleanup() { git worktree remove --force "$work/src" 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
git worktree add --detach -q "$work/src" "$commit"
echo "== building $rev ($(git log -1 --format='%h %s' "$commit" | cut -c1-70)) in $work/build"
export CCACHE_BASEDIR=$work/src CCACHE_NOHASHDIR=1
cmake -S "$work/src" -B "$work/build" -G Ninja -DHEADSCOPE_CUDA=OFF \
  "-DHEADSCOPE_FAMILIES=$families" -DPython3_EXECUTABLE="$(command -v "$PYTHON")" \
  >"$work/configure.log" 2>&1 || { cat "$work/configure.log"; exit 1; }
cmake --build "$work/build" --target headscope --parallel "${MAX_JOBS:-$(nproc)}" >"$work/build.log" 2>&1 \
  || { tail -40 "$work/build.log"; exit 1; }

for i in $(seq "$rounds"); do
  for side in rev here; do
    lib=$here
    [ "$side" = rev ] && lib=$work/build/libheadscope.so
    echo "== round $i/$rounds: $side"
    HEADSCOPE_LIBRARY=$lib "$PYTHON" -m headscope.bench "$@" --json "$work/$side-$i.json" \
      >"$work/$side-$i.log" 2>&1 || { tail -30 "$work/$side-$i.log"; exit 1; }
  done
done
"$PYTHON" scripts/bench_compare.py "$work" "$rounds" "$rev"
