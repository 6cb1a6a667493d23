#!/usr/bin/env bash
# Create .venv at the repo root if missing and install tpugen with its xla, dev (jax among them) and docs extras.
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
  echo "setup: installing tpugen[xla,dev,docs] into .venv (torch 2.9.0 + torch_xla 2.9.0, the server, Ray, peft, controlnet_aux and mkdocs: several GB the first time)"
  # uv installs it: its downloads and unpacking run side by side, where pip's run one after another (a fresh
  # .venv, nothing cached, on 2 cores: 1 min 37 s, where pip took 3 min 35 s). It writes the
  # bytecode too (--compile-bytecode, on both cores): where PYTHONDONTWRITEBYTECODE is set (as on the team's
  # machines) nothing else would, and every process the tests start would compile torch's imports again. pip
  # does the install where uv cannot be had.
  if .venv/bin/python -m pip install -q uv 2>&1 | grep -v "^WARNING: Location 'file:"; [ -x .venv/bin/uv ]; then
    .venv/bin/uv pip install -q --python .venv/bin/python --compile-bytecode -e '.[xla,dev,docs]'
  else
    echo "setup: uv could not be installed; pip installs instead (slower)"
    # Some machines' pip configs point at local index folders that do not exist; those warnings are noise.
    .venv/bin/python -m pip install -q -e '.[xla,dev,docs]' 2>&1 | grep -v "^WARNING: Location 'file:" || true
  fi
  # torch_xla's wheel carries an older copy of torchax in the same files: the pinned torchax is written last.
  torchax_pin=$(grep -o '"torchax==[0-9.]*"' pyproject.toml | head -1 | tr -d '"')
  if [ -x .venv/bin/uv ]; then
    .venv/bin/uv pip install -q --python .venv/bin/python --compile-bytecode --reinstall-package torchax "$torchax_pin"
  else
    .venv/bin/python -m pip install -q --force-reinstall --no-deps "$torchax_pin" 2>&1 | grep -v "^WARNING: Location 'file:" || true
  fi
  PJRT_DEVICE=CPU JAX_PLATFORMS=cpu .venv/bin/python -W ignore -c "import torch, torch_xla, torchvision, diffusers, transformers, peft, cv2, fastapi, uvicorn, multipart, ray, httpx, selenium, webuiapi, controlnet_aux, matplotlib, mkdocs, material, jax, torchax, tpugen; assert torchax.__version__ == '${torchax_pin#torchax==}', torchax.__version__" \
    || { echo "setup: the install failed (see above)" >&2; exit 1; }
  echo "$want" > "$stamp"
fi
