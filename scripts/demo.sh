#!/usr/bin/env bash
# Installs what is missing, builds, and runs the shapes demo: the embedded model describes
# held-out images while headscope streams which image regions ground each sentence
# (PNGs, report.json and index.html in shapes-demo/; arguments go to the demo).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
bash scripts/setup_env.sh
bash scripts/build.sh
"$PYTHON" -m headscope.shapes demo "$@"
