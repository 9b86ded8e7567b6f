# Sourced by the install scripts (not run on its own): picks the Python that the
# package is installed into and the demo and the tests run with, as $PYTHON.
#
# An active virtual environment ($VIRTUAL_ENV) is used as it is. Otherwise the
# project's own .venv is created (once) and used: Debian's python3 refuses
# `pip install` outside a virtual environment (PEP 668, externally-managed-environment).
# NANWATCH_VENV_ONLY=1 makes the install scripts stop once $PYTHON is chosen.

apt_install() {
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update && $sudo apt-get install -y "$@"
}

create_project_venv() {
  if ! command -v python3 >/dev/null 2>&1; then
    echo "python3 is not installed (on Debian: apt-get install python3 python3-venv)" >&2
    exit 1
  fi
  echo "No virtual environment is active: creating one in $1 (with $(command -v python3))"
  if ! python3 -m venv "$1"; then
    rm -rf "$1"  # Debian ships venv's ensurepip in a package of its own
    echo "python3 cannot create a virtual environment here: installing python3-venv"
    apt_install python3-venv
    python3 -m venv "$1"
  fi
}

select_python() {
  if [ -n "${VIRTUAL_ENV:-}" ]; then
    if [ ! -x "$VIRTUAL_ENV/bin/python" ]; then
      echo "VIRTUAL_ENV is set to $VIRTUAL_ENV, which has no bin/python: deactivate it or fix it" >&2
      exit 1
    fi
    echo "Using the active virtual environment $VIRTUAL_ENV"
  else
    local venv="$PWD/.venv"
    if [ -x "$venv/bin/python" ]; then
      echo "No virtual environment is active: using the project's $venv"
    else
      create_project_venv "$venv"
    fi
    export VIRTUAL_ENV="$venv"
    export PATH="$venv/bin:$PATH"
  fi
  PYTHON="$VIRTUAL_ENV/bin/python"
  echo "Python: $PYTHON"
  if [ "${NANWATCH_VENV_ONLY:-0}" = "1" ]; then
    exit 0
  fi
}

# pip-installs the package (editable) with the given extras, once per version of setup.py.
install_package() {
  local extras="$1"
  local stamp="$VIRTUAL_ENV/.tb_nanwatch-installed-$extras"
  local wanted
  wanted="$(sha256sum setup.py | cut -d' ' -f1) $PWD"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$wanted" ]; then
    echo "tb_nanwatch[$extras] is installed already"
    return
  fi
  echo "Installing tb_nanwatch[$extras] (the first time TensorFlow downloads ~600 MB)"
  "$PYTHON" -m pip install -e ".[$extras]"
  echo "$wanted" >"$stamp"
}
