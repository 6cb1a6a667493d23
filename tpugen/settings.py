"""Every environment variable tpugen reads, in one place: its name, default and meaning, and the functions that
read tpugen's own. The device's variables (PJRT_DEVICE, CPU_NUM_DEVICES, TorchTPU's) are set and read behind
the device seam (tpugen.backends); the others are read here."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Variable:
    name: str
    default: str
    meaning: str


VARIABLES = (
    Variable("TPUGEN_CACHE", "~/.cache/tpugen", "tpugen's cache (built-in models, counted parameters, compile caches)"),
    Variable("TPUGEN_DEBUG", "unset", "1: print tracebacks"),
    Variable("TPUGEN_API_KEY", "unset", "the API key of `tpugen serve` and of `generate --server` (as `--api-key`)"),
    Variable("PJRT_DEVICE", "TPU where TPU devices are found, else CPU", "the device torch_xla runs on"),
    Variable("CPU_NUM_DEVICES", "1", "XLA:CPU devices (for `mode: multi` or `spmd` on a machine without a TPU)"),
    Variable(
        "JAX_PLATFORMS", "unset (a TPU where JAX finds one)", "the platform `backend: jax` runs on (`cpu` off a TPU)"
    ),
    Variable(
        "XLA_FLAGS",
        "unset",
        "XLA's flags, read by torch_xla and JAX alike; part of the key of a program `backend: jax` keeps whole",
    ),
    Variable(
        "TPUGEN_PALLAS_INTERPRET",
        "unset",
        "1: off a TPU, `backend: jax` runs JAX's Pallas flash-attention kernel in Pallas's TPU interpret mode (slow; "
        "how the kernel is checked on the CPU)",
    ),
    Variable("RAY_ADDRESS", "unset", "the cluster `execution.ray.address: auto` joins, as Ray reads it"),
    Variable("HF_HOME", "~/.cache/huggingface", "the Hugging Face cache, as diffusers reads it"),
    Variable("HF_TOKEN", "the token `hf auth login` saved", "the token for gated models, as diffusers reads it"),
    Variable("HF_HUB_OFFLINE", "unset", "1: never reach the hub (model_index.json and weights from the cache only)"),
)


def cache_root() -> Path:
    """tpugen's cache directory: TPUGEN_CACHE, else ~/.cache/tpugen."""
    return Path(os.environ.get("TPUGEN_CACHE") or Path.home() / ".cache" / "tpugen").expanduser()


def debug() -> bool:
    """TPUGEN_DEBUG=1: errors are shown with their tracebacks."""
    return os.environ.get("TPUGEN_DEBUG") == "1"


def pallas_interpret() -> bool:
    """TPUGEN_PALLAS_INTERPRET=1: backend jax's Pallas kernels in interpret mode off a TPU."""
    return os.environ.get("TPUGEN_PALLAS_INTERPRET") == "1"


def hub_offline() -> bool:
    """HF_HUB_OFFLINE set (to anything but 0), as huggingface_hub reads it."""
    return os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")


def offline_environment() -> dict[str, str]:
    """This process's environment for a child that must not reach the hub (HF_HUB_OFFLINE=1)."""
    return {**os.environ, "HF_HUB_OFFLINE": "1"}


def hub_token() -> str | None:
    """The token huggingface_hub would send: HF_TOKEN, else the one `hf auth login` saved."""
    try:
        from huggingface_hub import get_token

        return get_token()
    except Exception:  # an unreadable token file counts as none
        return os.environ.get("HF_TOKEN")
