"""compile.flash_attention on xla: the denoiser's attention on torch_xla's Pallas flash-attention kernel."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable

from tpugen.backends.base import (
    FLASH_ATTENTION_FALSE,
    FLASH_ATTENTION_HOOK,
    JAX_PLAIN,
    NOT_A_TPU,
    XLA_ONLY,
    FlashAttention,
    flash_attention_off,
)

NO_JAX = "jax is not installed (torch_xla's Pallas kernels need torch_xla[pallas], which tpugen[tpu] installs)"
NO_SPMD_SPEC = (
    "under SPMD, diffusers 0.42 gives Flux's kernel no partition spec, so auto leaves it off "
    "(compile.flash_attention: true tries it without one)"
)


def flash_reason(setting: bool | str, route, *, tpu: bool, jax: bool, spmd: bool) -> str | None:
    """Why flash attention stays off, or None to put it on (pure).

    Under `auto` it goes on only where it can work: a TPU, jax installed, and under SPMD a route that takes a
    partition spec. Under `true` only a family with no route keeps it off: the kernel is tried for real, and a
    failure at warmup brings the model's own attention back (Engine)."""
    if setting is False:
        return FLASH_ATTENTION_FALSE
    if not route.components:
        return route.unsupported
    if setting == "auto":
        if not tpu:
            return NOT_A_TPU
        if not jax:
            return NO_JAX
        if spmd and not route.takes_partition_spec:
            return NO_SPMD_SPEC
    return None


def flash_partition_spec(data: int, model: int, heads: Iterable[int]) -> tuple[str | None, ...]:
    """How q, k and v, laid out (batch, heads, tokens, head dim), lie on a (data, model) mesh (pure).

    tpugen's SPMD splits a batch's rows over the data axis (split_batch) and the attention projections
    column-wise over the model axis, which is by head; the kernel then runs on each chip over its own rows and
    heads. An axis of one device is left out, and heads that do not all divide by the model axis stay whole
    (XLA then gathers them, so the result is still right)."""
    rows = "data" if data > 1 else None
    split = "model" if model > 1 and all(count % model == 0 for count in heads) else None
    return (rows, split, None, None)


def jax_installed() -> bool:
    """Whether jax can be imported here, without importing it (it would grab the TPU before torch_xla)."""
    return importlib.util.find_spec("jax") is not None


def planned_flash_attention(setting: bool | str, route, *, backend: str, spmd: bool) -> FlashAttention:
    """What a run here would start with, for `tpugen plan` (starts no device; a failure at warmup can still
    turn it off)."""
    from tpugen.backends.xla.devices import pjrt_device

    if backend == "jax":  # JAX's Pallas kernel where a TPU is found (or interpret mode is asked for)
        from tpugen.settings import pallas_interpret

        if setting is not False and (pjrt_device() == "TPU" or pallas_interpret()):
            return FlashAttention(setting, route.components)
        return flash_attention_off(setting, route, JAX_PLAIN)
    if backend != "xla":
        return flash_attention_off(setting, route, XLA_ONLY)

    reason = flash_reason(setting, route, tpu=pjrt_device() == "TPU", jax=jax_installed(), spmd=spmd)
    return FlashAttention(setting, route.components, reason)


def attention_heads(module) -> set[int]:
    """The head counts of a model's attention modules."""
    return {
        sub.heads
        for sub in module.modules()
        if hasattr(sub, "set_processor") and isinstance(getattr(sub, "heads", None), int)
    }


_NOT_SET = object()


def install_flash_attention(pipe, route, partition_spec: tuple | None, hooks) -> None:
    """The route's components on the kernel through diffusers' `enable_xla_flash_attention`, as the named hook
    FLASH_ATTENTION_HOOK. Removing it gives every attention module its own processor back, and Flux's processors
    their own attention backend (diffusers' `disable_xla_flash_attention` would put generic processors instead)."""
    saved = []
    for name in route.components:
        for sub in getattr(pipe, name).modules():
            processor = getattr(sub, "processor", None)
            if processor is not None and hasattr(sub, "set_processor"):
                saved.append((sub, processor, vars(processor).get("_attention_backend", _NOT_SET)))

    def restore() -> None:
        for sub, processor, backend in saved:
            sub.set_processor(processor)
            if backend is _NOT_SET:
                vars(processor).pop("_attention_backend", None)  # the class's own default again
            else:
                processor._attention_backend = backend

    try:
        for name in route.components:
            spec = partition_spec if route.takes_partition_spec else None
            getattr(pipe, name).enable_xla_flash_attention(spec, is_flux=route.is_flux)
    except BaseException:
        restore()
        raise
    hooks.add(FLASH_ATTENTION_HOOK, restore)
