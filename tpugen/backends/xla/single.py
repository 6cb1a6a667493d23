"""torch_xla on one device: lazy tensors traced per step, compiled by XLA, executed on a TPU (or XLA:CPU)."""

from __future__ import annotations

import dataclasses
import os

from tpugen.backends.base import TRACE_ONCE_HOOK, Counters, FlashAttention, OneDeviceBackend, TraceOnce
from tpugen.backends.xla.cache import start_cache
from tpugen.backends.xla.devices import import_torch_xla
from tpugen.backends.xla.flash import flash_reason, install_flash_attention, jax_installed
from tpugen.backends.xla.patches import let_diffusers_offload_to_xla, solve_small_systems_on_xla
from tpugen.backends.xla.trace import TRACEABLE_STEP_CACHES, TracedDenoiser, install_trace_once, trace_once_reason
from tpugen.errors import one_line


class XlaBackend(OneDeviceBackend):
    """The pipeline on `torch_xla.device()`; every count is read from torch_xla's own metrics."""

    name = "xla"
    spmd = False
    placed = False  # components on several devices (PlacedBackend)
    offloaded = False  # execution.offload: model
    _traced = None  # the denoiser under dynamo (compile.trace_once), once prepare_on_device installed it
    _beside: tuple = ()  # modules traced beside it (trace_beside: ControlNets)

    def __init__(
        self, cache_enabled: bool | str = "auto", cache_dir: str | None = None, *, device_index: int | None = None
    ) -> None:
        torch_xla = import_torch_xla()
        import torch_xla.core.xla_model as xm
        import torch_xla.debug.metrics as met
        import torch_xla.runtime as xr

        self._torch_xla, self._xm, self._met, self._xr = torch_xla, xm, met, xr
        self.cache = start_cache(torch_xla, cache_enabled, cache_dir)
        self.device = torch_xla.device() if device_index is None else torch_xla.device(device_index)
        solve_small_systems_on_xla()

    scanned_blocks = 0  # blocks that run inside a scan (compile.scan_blocks)

    def prepare_on_host(self, pipe, family, compile_config) -> None:
        if compile_config.scan_blocks:
            from tpugen.backends.xla.scan import scan_repeated_blocks

            # Weights are stacked on the host, before they move to the device.
            self.scanned_blocks = scan_repeated_blocks(getattr(pipe, family.denoiser), family.scan_attributes)

    def place(self, pipe, *, offload: bool, family) -> None:
        self.offloaded = offload
        if offload:
            let_diffusers_offload_to_xla()
            pipe.enable_model_cpu_offload(device=self.device)
            return
        from torch import nn

        for name, component in pipe.components.items():  # one at a time, to name the one that does not fit
            if isinstance(component, nn.Module):
                self.placing = name
                component.to(self.device)
        self.placing = None

    def prepare_on_device(self, pipe, family, compile_config, hooks) -> None:
        """XLA compiles the graphs itself; what is added is flash attention, where it goes on."""
        setting, route = compile_config.flash_attention, family.flash_attention
        on_tpu = self._xm.xla_device_hw(self.device) == "TPU"
        reason = flash_reason(setting, route, tpu=on_tpu, jax=jax_installed(), spmd=self.spmd)
        spec = None
        if reason is None:
            spec = self.flash_partition_spec(pipe, route)
            try:
                install_flash_attention(pipe, route, spec, hooks)
            except Exception as exc:  # diffusers refused to switch: the model keeps its own attention
                reason = one_line(exc)
        self.flash_attention = FlashAttention(setting, route.components, reason, None if reason else spec)
        self._prepare_trace_once(pipe, family, compile_config, hooks)

    def _prepare_trace_once(self, pipe, family, compile_config, hooks) -> None:
        """compile.trace_once: the denoiser under dynamo, or why it is recorded lazily every step."""
        self._trace_setting = compile_config.trace_once
        reason = trace_once_reason(
            compile_config.trace_once,
            step_cache=compile_config.step_cache.method not in TRACEABLE_STEP_CACHES,
            offload=self.offloaded,
            placed=self.placed,
            spmd=self.spmd,
            scanned=bool(self.scanned_blocks),
        )
        self._trace_reason = reason
        if reason is None:
            self._traced = install_trace_once(pipe, family, self.device, hooks)
        else:
            self._traced = None
        self._trace_component = family.denoiser

    def trace_beside(self, module, name: str, hooks, method: str = "forward") -> None:
        """Traced once per shape key as the denoiser is, where it is (a trace dynamo refuses records that module
        every step again, on its own)."""
        if self._traced is not None:
            beside = TracedDenoiser(module, self.device, name, method)
            hooks.add(f"{TRACE_ONCE_HOOK} ({name})", beside.remove)
            self._beside = (*self._beside, beside)

    @property
    def trace_once(self) -> TraceOnce | None:
        """Whether the denoiser is traced once now (a trace that failed turned it off), and if not, why."""
        if not hasattr(self, "_trace_setting"):
            return None
        if self._traced is not None:
            state = self._traced.state(self._trace_setting)
            beside = tuple(traced.component for traced in self._beside if traced.failure is None)
            return dataclasses.replace(state, beside=beside) if state.on else state
        return TraceOnce(self._trace_setting, self._trace_component, self._trace_reason)

    def flash_partition_spec(self, pipe, route) -> tuple | None:
        """The kernel's SPMD partition spec: none on one device."""
        return None

    def bind_thread(self) -> None:
        """Make this backend's device the current thread's default: torch_xla keeps one per thread, and a
        thread driving another device of this process (a server's engine per device) needs its own."""
        self._torch_xla._XLAC._xla_set_default_device(str(self.device))

    def memory(self) -> dict:
        """Device memory in use and its peak so far (bytes), as the runtime reports it."""
        try:
            info = self._xm.get_memory_info(self.device)
        except RuntimeError as exc:  # XLA:CPU: "GetAllocatorStats is not supported"
            return {"unavailable": (str(exc).split("\n") or ["unsupported"])[0].split(": ")[-1]}
        return {"bytes_in_use": info.get("bytes_used"), "peak_bytes": info.get("peak_bytes_used")}

    def sync(self) -> None:
        self._torch_xla.sync()

    def wait(self) -> None:
        self._xm.wait_device_ops()

    def counters(self) -> Counters:
        met = self._met

        def count(metric: str) -> int:
            data = met.metric_data(metric)
            return int(data[0]) if data else 0

        def seconds(metric: str) -> float:
            data = met.metric_data(metric)
            return data[1] / 1e9 if data else 0.0

        compile_data = met.metric_data("CompileTime")
        return Counters(
            compiles=count("CompileTime"),
            compile_seconds=(compile_data[1] / 1e9) if compile_data else 0.0,
            # SPMD runs are counted under ExecuteReplicatedTime, so both are summed.
            executions=count("ExecuteTime") + count("ExecuteReplicatedTime"),
            transfers_to_host=count("TransferFromDeviceTime"),
            persistent_cache_hits=int(met.counter_value("PersistentCacheHit") or 0),
            persistent_cache_misses=int(met.counter_value("PersistentCacheMiss") or 0),
            persistent_cache_load_failures=int(met.counter_value("PersistentCacheDeserializeFailure") or 0),
            execute_seconds=seconds("ExecuteTime") + seconds("ExecuteReplicatedTime"),
            graph_lookups=int(met.counter_value("UncachedCompile") or 0) + int(met.counter_value("CachedCompile") or 0),
        )

    def describe(self) -> dict:
        kind = self._xm.xla_device_hw(self.device)
        if kind == "TPU":
            try:
                kind = f"TPU v{self._torch_xla.tpu.version()}"
            except Exception:  # the version probe is informational only
                pass
        return {
            "backend": self.name,
            "device": str(self.device),
            "device_kind": kind,
            "pjrt_device": os.environ.get("PJRT_DEVICE"),
            **({"scanned_blocks": self.scanned_blocks} if self.scanned_blocks else {}),
        }
