#!/usr/bin/env bash
# Installs everything the tests need on a fresh Debian machine: Chromium for the
# browser tests (apt), the package with TensorFlow (CPU build), tf_keras and the test tools
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
# tf_keras (Keras 2), for the tests of NanWatch as a tf_keras callback: the release
# matching the installed TensorFlow, without its dependencies (it names the
# `tensorflow` package, a second TensorFlow beside tensorflow-cpu).
tf_minor="$("$PYTHON" -c 'import tensorflow as tf; print(".".join(tf.__version__.split(".")[:2]))')"
if ! "$PYTHON" -c "import tf_keras, sys; sys.exit(not tf_keras.__version__.startswith('$tf_minor.'))" 2>/dev/null; then
  "$PYTHON" -m pip install --no-deps "tf-keras~=$tf_minor.0"
fi
if command -v npm >/dev/null 2>&1 && [ -f frontend/package-lock.json ]; then
  if [ ! -f frontend/node_modules/.package-lock.json ] \
    || [ frontend/package-lock.json -nt frontend/node_modules/.package-lock.json ]; then
    (cd frontend && npm ci --no-audit --no-fund)
  fi
fi
