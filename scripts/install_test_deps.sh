#!/usr/bin/env bash
# Installs everything the tests need on a fresh Debian machine: the package with
# TensorFlow (CPU build) and test tools, Chromium for the browser tests, and the
# frontend's npm dependencies (to check the committed bundle is not stale).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v chromium >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update && $SUDO apt-get install -y chromium chromium-driver
fi
python -m pip install -q -e ".[tensorflow-cpu,test]"
if command -v npm >/dev/null 2>&1 && [ -f frontend/package-lock.json ]; then
  (cd frontend && npm ci --no-audit --no-fund)
fi
