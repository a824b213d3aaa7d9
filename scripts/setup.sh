#!/usr/bin/env bash
# Set up a fresh checkout: a virtual environment in .venv with rlnb (editable) and
# everything its tests and demo need. Safe to run again; it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
fi
# The constraints file pins the CPU build of torch for this machine (and CI) without
# narrowing what users of the package may install.
.venv/bin/python -m pip install --quiet --disable-pip-version-check \
    -c .ci/constraints.txt -e ".[dev,ray,notebook]" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import rlnb, torch; print(f'rlnb {rlnb.__version__} ready (torch {torch.__version__})')"
