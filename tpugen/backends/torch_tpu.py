"""TorchTPU (`torch_tpu`): the device "tpu" in strict eager, deferred-and-fused eager, or compiled."""

from __future__ import annotations

import os
import sys

from tpugen.backends.base import EagerBackend
from tpugen.errors import InputError, RunError

TORCH_TPU_MODES = ("eager", "defer_and_fuse", "compile")
DEFER_AND_FUSE_ENV = "TORCH_TPU_DEFER_AND_FUSE"
# TorchTPU's persistent compile cache: executables written atomically and read back by later processes (the
# reading back torch_xla 2.9 lacks on a TPU). A local folder or a gs:// prefix.
TIER3_CACHE_ENV = "TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT"


def torch_tpu_environment(mode: str, cache=None) -> dict[str, str]:
    """Variables TorchTPU reads when torch is imported: they must be set before that import. `cache`: the
    config's cache section (None: no persistent cache)."""
    env = {DEFER_AND_FUSE_ENV: "1"} if mode == "defer_and_fuse" else {}
    directory = torch_tpu_cache_dir(cache)
    if directory:
        env[TIER3_CACHE_ENV] = directory
    return env


def torch_tpu_cache_dir(cache) -> str | None:
    """Where TorchTPU keeps its compiled programs: cache.dir, else tpugen's cache; None with cache.enabled: false.
    `auto` is on: TorchTPU reads its cache back on a TPU."""
    if cache is None or cache.enabled is False:
        return None
    from tpugen.settings import cache_root

    return cache.dir or str(cache_root() / "torch_tpu")


def import_torch_tpu() -> None:
    """torch_tpu, or the one-line error that says how to install it."""
    try:
        # With TORCH_DEVICE_BACKEND_AUTOLOAD=0, importing torch no longer registers "tpu": do it here.
        import torch_tpu  # noqa: F401
    except ImportError:
        raise InputError(
            "execution.backend: torch_tpu is not installed; install tpugen[torchtpu] in a venv of its own "
            "(TorchTPU needs torch >= 2.11, torch_xla needs 2.9)"
        ) from None


class TorchTpuBackend(EagerBackend):
    """TorchTPU's "tpu" device, as the diffusers guide drives it (pipe.to("tpu"))."""

    name = "torch_tpu"

    def __init__(self, mode: str = "eager", *, compile_spec=None, cache=None) -> None:
        for key, value in torch_tpu_environment(mode, cache).items():
            if os.environ.get(key) != value:
                loaded = "torch was already imported" if "torch" in sys.modules else "it is not set"
                raise RunError(f"{key}={value} must be set before torch is imported ({loaded})")
        import_torch_tpu()
        import torch

        accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        if accelerator is None or accelerator.type != "tpu":
            raise InputError("execution.backend: torch_tpu found no TPU on this machine")
        super().__init__("tpu", compile_spec=compile_spec)
        self.mode = mode
        self._cache = cache
        self._torch = torch
        self.plain_attention: dict[str, int] = {}

    def prepare_on_device(self, pipe, family, compile_config, hooks) -> None:
        if self.compile_spec is not None:
            # SDPA crashes TorchTPU's fusion emitter under compile (the diffusers TorchTPU guide): swap the
            # SDPA attention processors for diffusers' plain ones first.
            self.plain_attention = use_plain_attention(getattr(pipe, family.denoiser), hooks)
        super().prepare_on_device(pipe, family, compile_config, hooks)

    def wait(self) -> None:
        self._torch.accelerator.synchronize()

    def describe(self) -> dict:
        return {
            **super().describe(),
            "device": "tpu",
            "device_kind": "TPU (TorchTPU)",
            "torch_tpu_mode": self.mode,
            "environment": torch_tpu_environment(self.mode, self._cache),
            "plain_attention": self.plain_attention or None,
            "compile_cache": self.cache_summary(),
        }

    def cache_summary(self) -> dict:
        """The persistent cache's folder and what TorchTPU counted of it (`torch.tpu._get_cache_stats()`, as it
        returns them), or that this torch_tpu counts nothing."""
        directory = torch_tpu_cache_dir(self._cache)
        if directory is None:
            return {"enabled": False, "dir": None, "note": "off (cache.enabled: false)"}
        summary = {"enabled": True, "dir": directory}
        stats = getattr(getattr(self._torch, "tpu", None), "_get_cache_stats", None)
        if not callable(stats):
            return {**summary, "stats": None, "note": "this torch_tpu reports no cache statistics"}
        try:
            counted = stats()
        except Exception as exc:  # the statistics are informational; a failure to read them costs no run
            return {**summary, "stats": None, "note": f"reading the cache statistics failed: {exc}"}
        shown = dict(counted) if isinstance(counted, dict) else {"value": repr(counted)}
        return {**summary, "stats": shown, "note": "on"}


def use_plain_attention(module, hooks) -> dict[str, int]:
    """Every SDPA attention processor (AttnProcessor2_0) of `module` replaced by the plain AttnProcessor, as
    the named hook "plain attention", whose removal puts each module's own processor back. Returns how many
    processors of each class were swapped and kept (processors with no plain twin in diffusers are kept)."""
    from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0

    swapped, counts = [], {}
    for sub in module.modules():
        processor = getattr(sub, "processor", None)
        if processor is None or not hasattr(sub, "set_processor"):
            continue
        if type(processor) is AttnProcessor2_0:
            swapped.append((sub, processor))
            sub.set_processor(AttnProcessor())
            counts["AttnProcessor2_0 -> AttnProcessor"] = counts.get("AttnProcessor2_0 -> AttnProcessor", 0) + 1
        else:
            kept = f"{type(processor).__name__} kept"
            counts[kept] = counts.get(kept, 0) + 1

    def restore() -> None:
        for sub, processor in swapped:
            sub.set_processor(processor)

    hooks.add("plain attention", restore)
    return counts
