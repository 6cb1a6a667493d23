#!/usr/bin/env bash
# Set up .venv if needed, then run the whole test suite on XLA:CPU (no TPU needed). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh

# Two test processes, one a core (pytest-xdist): tests that share a module's or the session's fixtures run in the
# same process (tests/conftest.py's groups, docs/internals.md). At the end: the slowest files and each process's
# memory maps, against a budget (tests/conftest.py: MAPS_BUDGET), so the suite fails before it grows into a crash.
# TPUGEN_TEST_WORKERS sets how many processes (0: this one alone), over pyproject.toml's addopts.
export PJRT_DEVICE=CPU
exec .venv/bin/python -m pytest -n "${TPUGEN_TEST_WORKERS:-2}" --dist loadgroup --no-loadscope-reorder --slowest-files 12 "$@"
