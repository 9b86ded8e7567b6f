#!/usr/bin/env bash
# Installs tb_nanwatch with TensorFlow (CPU build) for the demo, into the active
# virtual environment or else the project's .venv (see scripts/_python.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/_python.sh
select_python
install_package tensorflow-cpu
