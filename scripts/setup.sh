#!/usr/bin/env bash
# Create .venv at the repo root if missing and install tpugen with its xla, dev and docs extras.
# Idempotent: reinstalls only when pyproject.toml changed since the last successful install.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($PYTHON --version 2>&1)"
  "$PYTHON" -m venv .venv
fi

stamp=.venv/.tpugen-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing tpugen[xla,dev,docs] into .venv (torch 2.9.0 + torch_xla 2.9.0, the server, Ray, peft and mkdocs: several GB the first time)"
  # --no-compile: Python compiles what is imported when it is first imported; compiling every file of torch, Ray
  # and the rest at install took 52 s of a fresh install's 3 min 9 s here (2 min 17 s without).
  # Some machines' pip configs point at local index folders that do not exist; those warnings are noise.
  .venv/bin/python -m pip install -q --no-compile -e '.[xla,dev,docs]' 2>&1 | grep -v "^WARNING: Location 'file:" || true
  PJRT_DEVICE=CPU .venv/bin/python -c "import torch, torch_xla, torchvision, diffusers, transformers, peft, fastapi, uvicorn, multipart, ray, httpx, selenium, webuiapi, mkdocs, material, tpugen" \
    || { echo "setup: the install failed (see above)" >&2; exit 1; }
  echo "$want" > "$stamp"
fi
