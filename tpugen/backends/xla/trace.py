"""compile.trace_once: the denoiser traced once per shape key by dynamo (torch.compile, openxla), then launched from
its cache every step, instead of being recorded again in Python by lazy tensors at every step."""

from __future__ import annotations

from tpugen.backends.base import TRACE_ONCE_FALSE, TRACE_ONCE_HOOK, TraceOnce
from tpugen.errors import one_line

# Why a run records the denoiser lazily every step instead, by what the config asks for.
STEP_CACHE = (
    "compile.step_cache: MagCache's and PAB's hooks decide on the host, step by step, from tensors and the pipeline's "
    "timestep, which blocks run (dynamo would break its graph there); TaylorSeer's is traced once per step"
)
# The step caches whose hooks dynamo traces (tpugen.engine.step_cache.traceable_step_cache): their decisions are
# Python numbers of the step's index, guarded per step.
TRACEABLE_STEP_CACHES = ("none", "taylorseer")
OFFLOAD = "execution.offload: the denoiser's weights leave the device between calls; dynamo traced them on it"
PLACEMENT = (
    "execution.placement: components on several devices; torch_xla's dynamo bridge clears pending work on the "
    "thread's default device only"
)
SPMD = "execution.sharding: spmd: not combined with dynamo in tpugen yet (the bridge re-traces when a sharding moves)"
SCAN = "compile.scan_blocks: torch_xla's scan traces the stacked blocks itself, inside the step dynamo would trace"

# Shape keys a process may trace before dynamo stops tracing a new one (its default, 8, is a server's few hours).
RECOMPILE_LIMIT = 1024


def trace_once_reason(setting: bool, *, step_cache: bool, offload: bool, placed: bool, spmd: bool, scanned: bool):
    """Why the denoiser is recorded every step instead of traced once (None: it is traced once). Pure."""
    if not setting:
        return TRACE_ONCE_FALSE
    for applies, reason in ((step_cache, STEP_CACHE), (offload, OFFLOAD), (placed, PLACEMENT), (spmd, SPMD)):
        if applies:
            return reason
    return SCAN if scanned else None


class TracedDenoiser:
    """The denoiser's forward under dynamo, with its own forward kept: a trace that dynamo refuses (a graph break,
    an op the bridge cannot take) turns tracing off for the rest of the engine's life, and the call that failed
    runs on the recorded path, so a run never fails for it."""

    def __init__(self, module, device, component: str, method: str = "forward") -> None:
        import torch

        raise_recompile_limit()
        self.module = module
        self.component = component
        self.method = method
        self.own = method in vars(module)  # an instance attribute (a hook's), or the class's method
        self.original = getattr(module, method)  # bound
        self.compiled = torch.compile(self.original, backend="openxla", fullgraph=True, dynamic=False)
        self.failure: str | None = None
        self.failed_shape: str | None = None
        self._device = device
        self._handle = module.register_forward_pre_hook(self._inputs_ready, with_kwargs=True)
        setattr(module, method, self._forward)

    def _inputs_ready(self, module, args, kwargs):
        """The inputs as data on the device before dynamo sees them: host tensors (a timestep on the CPU) moved over
        as data, and what the step computed before the denoiser (the CFG batch, the scheduler's input scaling) cut
        as a graph of its own, handed off without waiting. Left pending, torch_xla's bridge would run that graph
        and wait for the device at every step."""
        if self.failure is not None:
            return args, kwargs
        import torch
        import torch_xla
        from torch.utils import _pytree

        device = self._device

        def to_device(tensor):
            return tensor.to(device) if tensor.device.type == "cpu" else tensor

        args, kwargs = _pytree.tree_map_only(torch.Tensor, to_device, (args, kwargs))
        torch_xla.sync()
        return args, kwargs

    def _forward(self, *args, **kwargs):
        if self.failure is None:
            import torch._dynamo
            import torch_xla

            counted = _kept_counters(torch_xla._XLAC)
            try:
                return self.compiled(*args, **kwargs)
            except torch._dynamo.exc.TorchDynamoException as exc:
                self.failure = one_line(exc)
                self.failed_shape = _shape_of(args, kwargs)
            finally:
                _put_back(torch_xla._XLAC, counted)
        return self.original(*args, **kwargs)

    def state(self, setting: bool) -> TraceOnce:
        if self.failure is None:
            return TraceOnce(setting, self.component)
        failed = {"input": self.failed_shape, "error": self.failure}
        return TraceOnce(
            setting, self.component, f"dynamo could not trace the {self.component}: {self.failure}", failed
        )

    def remove(self) -> None:
        self._handle.remove()
        if self.own:
            setattr(self.module, self.method, self.original)
        else:
            delattr(self.module, self.method)  # the class's own method again


# torch_xla's dynamo bridge clears every counter while it traces a new shape (at each FX node, restoring only two
# of its own), and the census and the report read these: a call that traced puts them back (four reads a step).
KEPT_COUNTERS = ("CachedCompile", "PersistentCacheHit", "PersistentCacheMiss", "PersistentCacheDeserializeFailure")


def _kept_counters(xlac) -> list[int]:
    return [xlac._xla_counter_value(name) or 0 for name in KEPT_COUNTERS]


def _put_back(xlac, before: list[int]) -> None:
    if any(now < then for now, then in zip(_kept_counters(xlac), before, strict=True)):
        for name, then in zip(KEPT_COUNTERS, before, strict=True):
            if then:
                xlac._xla_increment_counter(name, then)


def _shape_of(args, kwargs) -> str | None:
    """The shape of the denoiser's first tensor input (its latents), to say which call failed."""
    import torch

    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return "x".join(str(side) for side in value.shape)
    return None


def raise_recompile_limit() -> None:
    """Let dynamo keep a graph per shape key (and per engine) of a long-lived process: past its limit it would stop
    tracing new shapes and record them lazily again, silently."""
    import torch._dynamo

    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(config, name) and getattr(config, name) < RECOMPILE_LIMIT:
            setattr(config, name, RECOMPILE_LIMIT)


def install_trace_once(pipe, family, device, hooks) -> TracedDenoiser:
    """The family's denoiser traced once per shape key from now on, as the named hook TRACE_ONCE_HOOK."""
    traced = TracedDenoiser(getattr(pipe, family.denoiser), device, family.denoiser, family.traced_method)
    hooks.add(TRACE_ONCE_HOOK, traced.remove)
    return traced
