#!/usr/bin/env bash
# Set up .venv if needed, then run the whole test suite on XLA:CPU (no TPU needed). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh

export PJRT_DEVICE=CPU
exec .venv/bin/python -m pytest "$@"
