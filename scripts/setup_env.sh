#!/usr/bin/env bash
# Installs whatever is missing for building and testing headscope: build tools from
# Debian's packages, then the Python requirements (requirements.txt pins torch). An
# already installed matching torch is reused, never downloaded again.
# HEADSCOPE_SKIP_PIP=1 keeps the Python environment as it is (e.g. another torch).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

missing=()
command -v cmake >/dev/null || missing+=(cmake)
command -v g++ >/dev/null || missing+=(g++)
command -v ninja >/dev/null || missing+=(ninja-build)
command -v ccache >/dev/null || missing+=(ccache)
[ -f /usr/include/gtest/gtest.h ] || missing+=(libgtest-dev)
# clang and libFuzzer's runtime, for the fuzzing harnesses (scripts/fuzz.sh)
command -v clang++ >/dev/null || missing+=(clang)
{ command -v clang++ >/dev/null && [ -f "$(clang++ -print-file-name=libclang_rt.fuzzer-x86_64.a)" ]; } \
  || missing+=(libclang-rt-dev)
# headless Chromium and its WebDriver, for the tests of python -m headscope explain's pages
command -v chromium >/dev/null || missing+=(chromium)
command -v chromedriver >/dev/null || missing+=(chromium-driver)
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if [ "${HEADSCOPE_SKIP_PIP:-0}" != 1 ]; then
  # Only ask pip when something is missing: it then installs just that. The check
  # itself needs 'packaging', which a bare Python lacks.
  "$PYTHON" -c "import packaging" 2>/dev/null || "$PYTHON" -m pip install -q packaging
  if ! "$PYTHON" scripts/check_requirements.py requirements.txt; then
    "$PYTHON" -m pip install -q -r requirements.txt
  fi
  if ! "$PYTHON" scripts/check_requirements.py requirements-nodeps.txt; then
    "$PYTHON" -m pip install -q --no-deps -r requirements-nodeps.txt
  fi
fi
# optimum-quanto compiles its CPU extension (int4 unpacking) at its first use: here, once,
# rather than inside a test (about a minute on two cores)
"$PYTHON" -c "import importlib.util as u
if u.find_spec('optimum') and u.find_spec('optimum.quanto'):
    from optimum.quanto.library.extensions import get_extension
    get_extension('quanto_cpp').lib"
"$PYTHON" -c "import torch; print(f'setup: torch {torch.__version__} (CUDA {torch.version.cuda}), '
              f'GPU available: {torch.cuda.is_available()}')"
