"""The LoRAs of serve.lora_dir, named by their file stem: a request's <lora:NAME:SCALE>, a run's model.loras."""

from __future__ import annotations

import re
from pathlib import Path

from tpugen.config.loras import Lora, resolve_lora
from tpugen.config.schema import LORA_SCALE_MAX, LoraConfig
from tpugen.errors import InputError

LORA_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._ -]{0,127}")  # a file stem in serve.lora_dir, no path


def lora_files(lora_dir: str | None) -> list[Path]:
    """The LoRA files of serve.lora_dir (`lora_dir`), by name; none when it is not set."""
    if lora_dir is None:
        return []
    return sorted(Path(lora_dir).glob("*.safetensors"))


def lora_named(
    lora_dir: str | None, name: str, scale: float, *, family: str, model: str, where: str = "prompt"
) -> Lora:
    """The LoRA a request names (<lora:NAME:SCALE>): NAME.safetensors in serve.lora_dir (`lora_dir`), checked for
    the model's `family` (the server's `model`); InputError (422) in one line otherwise."""
    from pydantic import ValidationError

    if lora_dir is None:
        raise InputError(f"{where}: <lora:{name}> needs serve.lora_dir, which this server has not set")
    folder = Path(lora_dir)
    path = folder / f"{name}.safetensors"
    if not LORA_NAME.fullmatch(name) or not path.is_file():
        known = ", ".join(p.stem for p in lora_files(lora_dir)) or "none"
        raise InputError(f"{where}: no LoRA {name!r} in serve.lora_dir (it has: {known})")
    try:
        config = LoraConfig(id=path.name, scale=scale)  # by its name in serve.lora_dir: what replies show
    except ValidationError:
        raise InputError(f"{where}: <lora:{name}:{scale:g}>: the scale must be from 0 to {LORA_SCALE_MAX:g}") from None
    return resolve_lora(config, folder, family=family, model=model, where=where)
