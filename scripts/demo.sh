#!/usr/bin/env bash
# The README's demo command: installs (scripts/install.sh), writes the demo runs
# into demo_logs/ and serves them in TensorBoard. Extra arguments go to
# demo/run_all.py (e.g. --port 6007, --only healthy).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/install.sh"
exec "$PYTHON" demo/run_all.py --logdir demo_logs --serve "$@"
