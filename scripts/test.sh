#!/usr/bin/env bash
# Set up and run the test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
if [ $# -gt 0 ]; then
  python -m pytest -q "$@"
else
  # The layers of docs/architecture.md and no import cycles (pyproject's [tool.importlinter]),
  # then the type checker (pyproject's [tool.mypy]).
  lint-imports --no-cache
  mypy
  # The default suite (tiny models; `pytest` alone runs it) and the real-model smoke tests (`-m slow`) in one
  # run; the rest of the conformance and decoder matrices (`-m matrix`) is run apart. Two workers
  # (pytest-xdist; one compute thread each, tests/conftest.py) that take work from each other: CI's 2 cores.
  python -m pytest -q -n "${EDGEKIT_TEST_WORKERS:-2}" --dist worksteal -m "not matrix"
fi
