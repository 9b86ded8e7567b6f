#!/usr/bin/env bash
# The README's test command: installs what the tests need
# (scripts/install_test_deps.sh), then runs them. Extra arguments go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/install_test_deps.sh"
exec "$PYTHON" -m pytest -q tests "$@"
