#!/usr/bin/env bash
# Lint and types: ruff check, ruff format --check and mypy (configured in pyproject.toml).
# CI runs it as a step of its own, before the tests. All three run; the exit status is
# non-zero if any of them failed.
set -uo pipefail
cd "$(dirname "$0")/.."
status=0
for check in "ruff check ." "ruff format --check ." "mypy"; do
    echo "scripts/lint.sh: $check"
    # shellcheck disable=SC2086  # the words of $check are the arguments
    .venv/bin/python -m $check || status=1
done
exit "$status"
