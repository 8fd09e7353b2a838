#!/usr/bin/env bash
# Builds examples/torchscript_cpp against the installed CMake package (build/install),
# the way a C++ project outside this repo would.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
BUILD=${HEADSCOPE_BUILD_DIR:-build}
torch_prefix=$("$PYTHON" -c "import torch.utils; print(torch.utils.cmake_prefix_path)")
cmake -S examples/torchscript_cpp -B "$BUILD/example" \
  -DCMAKE_PREFIX_PATH="$PWD/$BUILD/install;$torch_prefix" -DCMAKE_BUILD_TYPE=Release \
  >"$BUILD/example.configure.log" 2>&1 || { cat "$BUILD/example.configure.log"; exit 1; }
cmake --build "$BUILD/example" --parallel "${MAX_JOBS:-$(nproc)}"
