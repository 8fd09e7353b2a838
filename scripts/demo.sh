#!/usr/bin/env bash
# Installs what is missing, builds, and runs the headscope tour on generated inputs.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
bash scripts/setup_env.sh
bash scripts/build.sh
"$PYTHON" -m headscope.tour "$@"
