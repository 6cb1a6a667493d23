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
  # pip compiles every file to bytecode here, and that is the only time it is written where PYTHONDONTWRITEBYTECODE
  # is set (as on the team's machines): installed with --no-compile (52 s less), every process the tests start
  # compiled torch's imports again, and the suite took 25 min 57 s instead of 19 min 40 s.
  # Some machines' pip configs point at local index folders that do not exist; those warnings are noise.
  .venv/bin/python -m pip install -q -e '.[xla,dev,docs]' 2>&1 | grep -v "^WARNING: Location 'file:" || true
  PJRT_DEVICE=CPU .venv/bin/python -c "import torch, torch_xla, torchvision, diffusers, transformers, peft, fastapi, uvicorn, multipart, ray, httpx, selenium, webuiapi, mkdocs, material, tpugen" \
    || { echo "setup: the install failed (see above)" >&2; exit 1; }
  echo "$want" > "$stamp"
fi
