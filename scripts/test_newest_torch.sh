#!/usr/bin/env bash
# Builds headscope against the newest torch release on PyPI and the torchvision release
# built for it, in a virtual environment of its own (build-newest/), and runs the
# GoogleTest suite and pytest there. Not part of CI: a check of what the next torch pin
# would break. CPU kernels only (the newest torch's CUDA need not match the installed nvcc).
#
# It fails, saying why, when PyPI has no torchvision for that torch yet, and when the torch
# it got is not newer than the pin of requirements.txt (then it would test the pin again).
# HEADSCOPE_NEWEST_TORCH=X.Y.Z tests that release instead of the newest (for a newest one
# whose torchvision is not out yet). HEADSCOPE_NEWEST_TESTS: pytest's paths (default
# tests/python); extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=$(realpath -m "${HEADSCOPE_NEWEST_DIR:-build-newest}")
fail() { echo "test_newest_torch: FAILED: $*" >&2; exit 1; }
PY=python3  # until the environment exists: the versions are checked first

pin=$(sed -n 's/^torch==\([^[:space:]#;]*\).*/\1/p' requirements.txt)
[ -n "$pin" ] || fail "requirements.txt pins no torch (torch==X.Y.Z)"
# What `pip install torch` would pick, without installing anything.
newest=${HEADSCOPE_NEWEST_TORCH:-$("$PY" -m pip install -q --dry-run --ignore-installed \
  --no-deps --report - torch | "$PY" -c \
  'import json, sys; print(json.load(sys.stdin)["install"][0]["metadata"]["version"])')}
release() { "$PY" -c 'import sys; print(".".join(sys.argv[1].split("+")[0].split(".")[:3]))' "$1"; }
newer() {  # whether release $1 is newer than release $2
  "$PY" -c 'import sys; v = [tuple(map(int, a.split("."))) for a in sys.argv[1:]]; sys.exit(v[0] <= v[1])' \
    "$(release "$1")" "$(release "$2")"
}
newer "$newest" "$pin" || fail "torch $newest is not newer than the pin torch==$pin: nothing new to test"
# torchvision 0.N is built for torch 2.(N-15) (torchvision's compatibility table), and
# pins it exactly; a later patch release may only ask for >=, so the minor says which.
minor=$(release "$newest" | cut -d. -f2)
[ "$(release "$newest" | cut -d. -f1)" = 2 ] || fail "torch $newest: no known torchvision release line"
vision="torchvision==0.$((minor + 15)).*"
"$PY" -m pip install -q --dry-run --ignore-installed --no-deps "$vision" >/dev/null 2>&1 \
  || fail "PyPI has no $vision, the torchvision built for torch $newest (the newest" \
          "on PyPI is built for an older torch); HEADSCOPE_NEWEST_TORCH=X.Y.Z tests an older release"

[ -x "$DIR/venv/bin/python" ] || python3 -m venv "$DIR/venv"
PY=$DIR/venv/bin/python
"$PY" -m pip install -q --upgrade pip
# every requirement but the torch and torchvision pins, then the newest torch and its torchvision
mapfile -t reqs < <(grep -v -E '^[[:space:]]*(#|$)|^(torch|torchvision)==' requirements.txt)
"$PY" -m pip install -q --upgrade "torch==$newest" "$vision" "${reqs[@]}"
got=$("$PY" -c 'import torch; print(torch.__version__)')
newer "$got" "$pin" || fail "installed torch $got is not newer than the pin torch==$pin"
[ "$(release "$got")" = "$(release "$newest")" ] || fail "asked for torch $newest, got $got"
"$PY" -c 'import torch, torchvision; torch.ops.torchvision.nms  # its C++ ops load against this torch
print(f"newest torch: {torch.__version__}, torchvision {torchvision.__version__} (pin: torch=='"$pin"')")'
# programs linked against torch resolve its CUDA libraries' own dependencies (NCCL, ...)
# in this environment's nvidia/* wheels, not in the ones of the pinned torch
site=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
rpath_link=$(printf -- '-Wl,-rpath-link,%s ' "$site"/nvidia/*/lib "$site"/nvidia/*/*/lib)
export LDFLAGS="${LDFLAGS:-} $rpath_link"
PYTHON=$PY HEADSCOPE_BUILD_DIR=$DIR/build HEADSCOPE_CMAKE_ARGS="-DHEADSCOPE_CUDA=OFF" \
  bash scripts/build.sh
ctest --test-dir "$DIR/build" --output-on-failure -j "${MAX_JOBS:-$(nproc)}"
read -r -a tests <<<"${HEADSCOPE_NEWEST_TESTS:-tests/python}"
"$PY" -m pytest "${tests[@]}" -q -rs "$@"
