#!/usr/bin/env bash
# Lint, types and the documentation: ruff check, ruff format --check, mypy (configured in
# pyproject.toml) and `mkdocs build --strict` (mkdocs.yml: a broken link or anchor, a page
# missing from the nav or a docstring reference mkdocstrings cannot load fails it; the site
# goes to site/, which git ignores). CI runs it as a step of its own, before the tests. All
# of them run; the exit status is non-zero if any of them failed.
set -uo pipefail
cd "$(dirname "$0")/.."
status=0
for check in "ruff check ." "ruff format --check ." "mypy" "mkdocs build --strict --quiet"; do
    echo "scripts/lint.sh: $check"
    # shellcheck disable=SC2086  # the words of $check are the arguments
    NO_MKDOCS_2_WARNING=1 .venv/bin/python -m $check || status=1
done
exit "$status"
