#!/usr/bin/env bash
# Installs tb_nanwatch with TensorFlow (CPU build) for the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e ".[tensorflow-cpu]"
