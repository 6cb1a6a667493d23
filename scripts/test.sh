#!/usr/bin/env bash
# Set up .venv if needed, then run the whole test suite on XLA:CPU (no TPU needed). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh

# Two test processes, one a core (pytest-xdist), given tests one at a time, the slowest files first, and the
# tests of a costly shared fixture (a server, a Ray cluster) together (tests/conftest.py: SLOWEST_FILES,
# SHARED_FIXTURES; docs/internals.md). At the end: the slowest files and each process's
# memory maps, against a budget (tests/conftest.py: MAPS_BUDGET), so the suite fails before it grows into a crash.
# TPUGEN_TEST_WORKERS sets how many processes (0: this one alone), over pyproject.toml's addopts.
export PJRT_DEVICE=CPU
exec .venv/bin/python -m pytest -n "${TPUGEN_TEST_WORKERS:-2}" --dist load --slowest-files 12 "$@"
