"""What every backend offers the engine (one Protocol), the exact counters it reads, and eager PyTorch."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from importlib import metadata
from typing import Any, Protocol

from tpugen.errors import one_line


@dataclass(frozen=True)
class Counters:
    """Exact compile counters (process-wide); subtract two readings to get what happened in between.

    XLA counts everything below; torch.compile (dynamo) counts only graphs, and the rest stay None.
    """

    compiles: int
    compile_seconds: float | None
    executions: int | None
    transfers_to_host: int | None
    persistent_cache_hits: int = 0
    persistent_cache_misses: int = 0
    persistent_cache_load_failures: int = 0
    # Seconds the device spent on graph executions, each from its dispatch to its completion (XLA's ExecuteTime):
    # exact while executions do not queue behind each other, more than the device's own time when they do.
    execute_seconds: float | None = None
    # Lazy graphs looked up in the in-memory compile cache, found or not (XLA's UncachedCompile plus CachedCompile):
    # a phase that runs each of its graphs once looks up as many as a fresh process compiles there, whatever
    # this process compiled before.
    graph_lookups: int | None = None

    def __sub__(self, other: Counters) -> Counters:
        def minus(a, b):
            return None if a is None or b is None else a - b

        return Counters(**{k: minus(v, getattr(other, k)) for k, v in asdict(self).items()})

    def __add__(self, other: Counters) -> Counters:
        def plus(a, b):
            return None if a is None or b is None else a + b

        return Counters(**{k: plus(v, getattr(other, k)) for k, v in asdict(self).items()})

    def as_dict(self) -> dict:
        return asdict(self)


FLASH_ATTENTION_HOOK = "flash attention"  # the named hook that puts the denoiser's attention on the kernel
FLASH_ATTENTION_FALSE = "compile.flash_attention: false"
# Why flash attention is simply off (nothing to tell the user beyond the report): auto off a TPU.
NOT_A_TPU = "not a TPU"
XLA_ONLY = "torch_xla's Pallas kernel runs on backend xla only"
# backend jax's attention: torch's own, computed by JAX (its Pallas kernels are the next step).
JAX_PLAIN = (
    "backend jax runs JAX's Pallas flash-attention kernel on a TPU only (TPUGEN_PALLAS_INTERPRET=1 runs it in "
    "Pallas's interpret mode elsewhere); plain attention here"
)


@dataclass(frozen=True)
class FlashAttention:
    """Whether the denoiser's attention runs through torch_xla's Pallas flash-attention kernel, and if not, why."""

    setting: bool | str  # compile.flash_attention: auto, true or false
    components: tuple[str, ...]  # the pipeline components it is (or would be) for
    reason: str | None = None  # why it is off; None while it is on
    partition_spec: tuple | None = None  # SPMD: how q, k and v (batch, heads, tokens, head dim) lie on the mesh
    failed_attempt: dict | None = None  # the warmup call that failed with it on: its error, seconds and compiles

    @property
    def on(self) -> bool:
        return self.reason is None

    def as_dict(self) -> dict:
        return {
            "state": "on" if self.on else "off",
            "setting": self.setting,
            "components": list(self.components),
            "reason": self.reason,
            "partition_spec": list(self.partition_spec) if self.partition_spec is not None else None,
            "failed_attempt": self.failed_attempt,
        }


TRACE_ONCE_HOOK = "trace once"  # the named hook that puts the denoiser's forward under dynamo
TRACE_ONCE_FALSE = "compile.trace_once: false"


@dataclass(frozen=True)
class TraceOnce:
    """Whether the denoiser is traced once per shape key (dynamo, openxla) or recorded again every step, and why."""

    setting: bool  # compile.trace_once
    component: str  # the pipeline component traced once (the family's denoiser)
    reason: str | None = None  # why it is off; None while it is on
    failed_attempt: dict | None = None  # the call whose trace failed: its shape key and error
    beside: tuple[str, ...] = ()  # modules traced once beside it, each step (ControlNets), while their traces hold

    @property
    def on(self) -> bool:
        return self.reason is None

    @property
    def traced(self) -> str:
        """What is traced, in words: the denoiser, and what runs beside it."""
        return " and ".join((self.component, *self.beside))

    def as_dict(self) -> dict:
        return {
            "state": "on" if self.on else "off",
            "setting": self.setting,
            "component": self.component,
            "how": "torch.compile(backend='openxla', fullgraph=True, dynamic=False) of its forward"
            if self.on
            else None,
            "reason": self.reason,
            "failed_attempt": self.failed_attempt,
            "beside": list(self.beside),
        }


def flash_attention_off(setting: bool | str, route, reason: str) -> FlashAttention:
    """Off for `reason`, or because the config says false."""
    return FlashAttention(setting, route.components, FLASH_ATTENTION_FALSE if setting is False else reason)


def flash_failure(exc: BaseException) -> str:
    """Why a call with flash attention on failed, in one line, as raised (a missing jax says what installs it)."""
    reason = one_line(exc)
    if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] in ("jax", "jaxlib"):
        reason += " (torch_xla's Pallas kernels need torch_xla[pallas], which tpugen[tpu] installs)"
    return reason


def versions() -> dict:
    """Versions of the packages that decide what gets compiled and how."""
    out = {}
    for name in ("tpugen", "torch", "torch_xla", "diffusers", "transformers"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


class Backend(Protocol):
    """A device (or a set of them) a pipeline runs on, as the engine uses it."""

    name: str
    device: Any  # where the pipeline's own tensors live
    device_count: int  # physical devices this backend drives
    cache: dict  # the persistent compile cache's state, for the report
    placing: str | None  # the component moving onto the device now, for an out-of-memory message
    flash_attention: FlashAttention | None  # set by prepare_on_device
    # compile.trace_once's state (xla; None on backends it does not apply to: cpu and cuda have torch_compile,
    # torch_tpu its compile mode), set by prepare_on_device and read again after each call (a trace may fail).
    trace_once: TraceOnce | None

    def prepare_on_host(self, pipe, family, compile_config) -> None:
        """Changes made while the weights are still on the host (scan stacks them)."""

    def place(self, pipe, *, offload: bool, family) -> None:
        """Put the pipeline on the device: all of it, or (offload) each component only while it runs."""

    def prepare_on_device(self, pipe, family, compile_config, hooks) -> None:
        """Changes made once the pipeline is on the device (torch.compile, attention swaps, flash attention), as
        named hooks; sets `flash_attention`."""

    def device_for(self, component: str): ...

    def trace_beside(self, module, name: str, hooks, method: str = "forward") -> None:
        """A module that runs beside the denoiser at every step (a ControlNet), its `method` traced as the denoiser
        is (compile.trace_once), as a named hook; nothing where the denoiser is not traced."""

    def bind_thread(self) -> None:
        """Called first in a thread that drives this backend (a server's device loop)."""

    def put_weight(self, component: str, name: str, live, host):
        """A device tensor holding `host`, laid out as the live parameter `live` is (same device, same split):
        the new data of a weight a LoRA changes. A transfer, never a graph."""

    def split_batch(self, tensor): ...

    def splits(self, rows: int) -> str | None:
        """Why a call of `rows` rows cannot be split over the devices, or None."""

    def memory(self) -> dict | None: ...

    def sync(self) -> None: ...

    def wait(self) -> None: ...

    def counters(self) -> Counters | None: ...

    def describe(self) -> dict: ...


class OneDeviceBackend:
    """What every backend whose pipeline lives on one device shares: a component computes where the pipeline
    is, a new weight goes where the live one is, and a batch is not split."""

    device: Any
    device_count = 1
    placing: str | None = None
    flash_attention: FlashAttention | None = None
    trace_once: TraceOnce | None = None

    def device_for(self, component: str):
        """The device a component computes on (under offload too, where it waits on the host between calls)."""
        return self.device

    def trace_beside(self, module, name: str, hooks, method: str = "forward") -> None:
        """Nothing is traced once on this backend (its compile mode, if any, covers the whole pipeline)."""

    def put_weight(self, component: str, name: str, live, host):
        # A transfer to the live weight's device: new device data, which compiled graphs take as an input like
        # the old. Under offload the live weight waits on the host: then this is the host tensor itself.
        return host.to(live.device)

    def split_batch(self, tensor):
        """Lay a batch-first tensor out over the devices' data axis (a no-op without SPMD)."""
        return tensor

    def splits(self, rows: int) -> str | None:
        """Nothing to refuse: a call's rows are not split over devices."""
        return None


class EagerBackend(OneDeviceBackend):
    """Eager PyTorch on one torch device; with torch.compile, its compiles are counted through dynamo."""

    name = "cpu"

    def __init__(self, device, *, compile_spec=None) -> None:
        self.device = device
        self.compile_spec = compile_spec  # tpugen.backends.compile.CompileSpec, or None for eager
        self.cache = {"enabled": False, "dir": None, "note": "eager backend: no XLA compile cache"}

    def prepare_on_host(self, pipe, family, compile_config) -> None:
        """Nothing to do on the host for eager PyTorch."""

    def place(self, pipe, *, offload: bool, family) -> None:
        if offload:
            pipe.enable_model_cpu_offload(device=self.device)
        else:
            pipe.to(self.device)

    def prepare_on_device(self, pipe, family, compile_config, hooks) -> None:
        self.flash_attention = flash_attention_off(compile_config.flash_attention, family.flash_attention, XLA_ONLY)
        if self.compile_spec is not None:
            self.compile_spec.apply(pipe, family, hooks)

    def bind_thread(self) -> None:
        """Eager devices need nothing per thread."""

    def memory(self) -> dict | None:
        """Device memory in use and its peak (bytes), where the device reports it."""
        return None

    def sync(self) -> None:
        """Cut the lazy graph here (a no-op for eager backends)."""

    def wait(self) -> None:
        """Block until the device has finished everything queued."""

    def counters(self) -> Counters | None:
        if self.compile_spec is None:
            return None
        from torch._dynamo.utils import counters

        return Counters(
            compiles=int(counters["stats"]["unique_graphs"]),
            compile_seconds=None,
            executions=None,
            transfers_to_host=None,
        )

    def describe(self) -> dict:
        return {"backend": self.name, "device": str(self.device), "device_kind": "CPU", "world_size": 1}
