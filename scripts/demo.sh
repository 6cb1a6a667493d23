#!/usr/bin/env bash
# Set up .venv if needed, then generate the tiny-shapes built-in model's images (configs/shapes.yaml) through torch_xla.
# On a machine without a TPU, torch_xla runs on the CPU (PJRT_DEVICE=CPU): real XLA compiles, slowly.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh

if [ -z "${PJRT_DEVICE:-}" ]; then
  if compgen -G "/dev/accel*" >/dev/null || compgen -G "/dev/vfio/[0-9]*" >/dev/null; then
    export PJRT_DEVICE=TPU
  else
    export PJRT_DEVICE=CPU
    echo "demo: no TPU found, running torch_xla on the CPU (PJRT_DEVICE=CPU)"
  fi
fi
exec .venv/bin/tpugen generate configs/shapes.yaml "$@"
