#!/usr/bin/env bash
# Installs everything the tests need on a fresh Debian machine: Chromium for the
# browser tests (apt), the package with TensorFlow (CPU build) and the test tools
# (into the active virtual environment or else the project's .venv, see
# scripts/_python.sh), and the frontend's npm packages when npm is there (to check
# that the committed bundle is not stale).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/_python.sh
select_python
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
  echo "Installing Debian's chromium and chromium-driver"
  apt_install chromium chromium-driver
fi
install_package tensorflow-cpu,test
if command -v npm >/dev/null 2>&1 && [ -f frontend/package-lock.json ]; then
  if [ ! -f frontend/node_modules/.package-lock.json ] \
    || [ frontend/package-lock.json -nt frontend/node_modules/.package-lock.json ]; then
    (cd frontend && npm ci --no-audit --no-fund)
  fi
fi
