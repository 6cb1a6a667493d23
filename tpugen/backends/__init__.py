"""The device seam: every backend behind one Protocol, made by one factory. Only modules in this package
import torch_xla or torch_tpu, and only inside functions."""

from __future__ import annotations

from tpugen.backends.base import FLASH_ATTENTION_HOOK, Backend, Counters, FlashAttention, versions
from tpugen.backends.compile import compile_spec


def make_backend(execution, compile_config, cache, *, device_index: int | None = None) -> Backend:
    """The backend the config's execution, compile and cache sections name (devices are chosen here).
    `device_index` (xla): one device of several in this process, for a server's engine per device."""
    name = execution.backend
    if name == "xla":
        from tpugen.backends.xla import PlacedBackend, SpmdBackend, XlaBackend

        if execution.sharding == "spmd":
            mesh = execution.mesh
            return SpmdBackend(cache.enabled, cache.dir, data=mesh.data, model=mesh.model, cores=execution.cores)
        if execution.placement != "none":
            return PlacedBackend(cache.enabled, cache.dir, cores=execution.cores)
        return XlaBackend(cache.enabled, cache.dir, device_index=device_index)
    if name == "jax":
        from tpugen.backends.jax import JaxBackend

        if execution.sharding == "spmd":
            return JaxBackend(cache, devices=execution.cores, mesh=(execution.mesh.data, execution.mesh.model))
        return JaxBackend(cache, devices=execution.cores if execution.mode == "multi" else 1)
    spec = compile_spec(
        name,
        torch_compile=compile_config.torch_compile,
        tpu_mode=execution.torch_tpu.mode,
        offload=execution.offload == "model",
    )
    if name == "cpu":
        from tpugen.backends.cpu import CpuBackend

        return CpuBackend(compile_spec=spec)
    if name == "cuda":
        from tpugen.backends.cuda import CudaBackend

        return CudaBackend(compile_spec=spec)
    if name == "torch_tpu":
        from tpugen.backends.torch_tpu import TorchTpuBackend

        return TorchTpuBackend(execution.torch_tpu.mode, compile_spec=spec, cache=cache)
    raise ValueError(f"unknown backend {name!r}")


def backend_environment(execution, cache=None) -> dict[str, str]:
    """Variables a backend reads when torch is imported, which must be set before that import (`cache`: the
    config's cache section, for TorchTPU's persistent cache)."""
    if execution.backend == "torch_tpu":
        from tpugen.backends.torch_tpu import torch_tpu_environment

        return torch_tpu_environment(execution.torch_tpu.mode, cache)
    return {}


def load_device_runtime(execution) -> None:
    """Import what registers the backend's device type with torch ("tpu" for TorchTPU), for a process that
    picks its device before it makes its backend (a torchrun rank choosing its chip)."""
    if execution.backend == "torch_tpu":
        from tpugen.backends.torch_tpu import import_torch_tpu

        import_torch_tpu()


__all__ = [
    "FLASH_ATTENTION_HOOK",
    "Backend",
    "Counters",
    "FlashAttention",
    "backend_environment",
    "load_device_runtime",
    "make_backend",
    "versions",
]
