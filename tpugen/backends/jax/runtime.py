"""JAX in this process: imported once, its persistent compile cache pointed where the config says, and its
compiles, cache hits and the reads tpugen makes counted exactly (JAX's own monitoring events)."""

from __future__ import annotations

import os
import threading
import warnings
from dataclasses import dataclass

from tpugen.errors import InputError

# JAX's monitoring events (jax._src.dispatch and jax._src.compiler name them; stable across 0.6-0.10).
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # each executable obtained: compiled or read back
TRACE = "/jax/core/compile/jaxpr_trace_duration"
LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
CACHE_HIT = "/jax/compilation_cache/cache_hits"  # an executable read back from the persistent cache
CACHE_WRITE = "/jax/compilation_cache/cache_misses"  # JAX counts a miss when it writes the new executable

INSTALL_HINT = "install tpugen[jax] (or tpugen[jax-tpu] on a TPU VM)"


@dataclass
class Tally:
    """What happened in this process since JAX was imported (read under the lock, subtract two readings)."""

    executables: int = 0  # executables obtained (backend compile events): compiled fresh or read from the cache
    cache_hits: int = 0
    cache_writes: int = 0
    compile_seconds: float = 0.0  # tracing, lowering and compiling (a cache read included)
    executions: int = 0  # calls of tpugen's jitted functions
    reads: int = 0  # device-to-host reads tpugen made
    stored_loads: int = 0  # whole programs read from tpugen's store (tpugen.backends.jax.store): no trace
    load_failures: int = 0  # stored programs that could not be read (compiled again)


class Runtime:
    """The process's JAX: one per process (JAX's cache and listeners are process-wide)."""

    def __init__(self) -> None:
        try:
            import jax
            import torchax
        except ImportError as exc:
            raise InputError(
                f"execution.backend: jax needs jax and torchax ({exc.name} is missing): {INSTALL_HINT}"
            ) from None
        self.jax = jax
        self.torchax = torchax
        self.env = torchax.default_env()
        from tpugen.backends.jax import attention, convolution

        # JAX's Pallas flash-attention kernel where the backend turns it on (attention.FlashKernel; None: plain).
        self.kernel = None
        attention.install(self.env, self)
        if jax.default_backend() == "cpu":
            convolution.install(self.env)
        self.lock = threading.Lock()
        self.tally = Tally()
        self.cache_dir: str | None = None
        from tpugen.backends.jax.store import ProgramStore

        self.store = ProgramStore(self)
        # Without 64-bit types, JAX casts torch's int64 (token ids, timesteps) to int32: said once per cast.
        warnings.filterwarnings("ignore", message="Explicitly requested dtype int64")
        # And float64 as float32 (Flux.1's rotary tables: their images stay within 2/255 of eager PyTorch's).
        warnings.filterwarnings("ignore", message="Explicitly requested dtype float64")
        from jax import monitoring

        monitoring.register_event_listener(self._event)
        monitoring.register_event_duration_secs_listener(self._duration)

    def _event(self, event: str, **_) -> None:
        if event == CACHE_HIT:
            with self.lock:
                self.tally.cache_hits += 1
        elif event == CACHE_WRITE:
            with self.lock:
                self.tally.cache_writes += 1

    def _duration(self, event: str, seconds: float, **_) -> None:
        if event == BACKEND_COMPILE:
            with self.lock:
                self.tally.executables += 1
                self.tally.compile_seconds += seconds
        elif event in (TRACE, LOWER):
            with self.lock:
                self.tally.compile_seconds += seconds

    def stored_program_loaded(self, seconds: float) -> None:
        """A whole program read from tpugen's store: an executable obtained from the cache, nothing traced."""
        with self.lock:
            self.tally.executables += 1
            self.tally.cache_hits += 1
            self.tally.stored_loads += 1
            self.tally.compile_seconds += seconds

    def stored_program_written(self) -> None:
        """A whole program compiled afresh and stored: counted as a cache write, as JAX counts its own."""
        with self.lock:
            self.tally.cache_writes += 1

    def stored_program_unreadable(self) -> None:
        with self.lock:
            self.tally.load_failures += 1

    def executed(self) -> None:
        with self.lock:
            self.tally.executions += 1

    def read(self, count: int = 1) -> None:
        with self.lock:
            self.tally.reads += count

    def reading(self) -> Tally:
        with self.lock:
            return Tally(**vars(self.tally))

    def use_cache(self, directory: str | None) -> None:
        """JAX's persistent compile cache in `directory` (None: off), every executable kept, however quick its
        compile; a second process of the same programs then compiles nothing."""
        if directory == self.cache_dir:
            return
        if directory and "://" in directory and not directory.startswith("file://"):
            try:
                import etils.epath  # noqa: F401
            except ImportError:
                raise InputError(
                    f"cache.dir: {directory} is not a local folder, and JAX reads such caches through etils: "
                    "pip install 'etils[epath,epath-gcs]'"
                ) from None
        elif directory:
            os.makedirs(directory, exist_ok=True)
        from jax._src import compilation_cache

        config = self.jax.config
        config.update("jax_compilation_cache_dir", directory)
        config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        # The cache is read from the folder set when it first initialises: a process that changes folders (tests,
        # two engines with two caches) starts it again.
        compilation_cache.reset_cache()
        self.store.use(directory)
        self.cache_dir = directory

    def mesh(self, devices: int, axes: tuple[int, int] | None = None):
        """A mesh over the first `devices` of JAX's devices (0: all of them): data-parallel (axis "data"), or with
        `axes` (data, model; model 0: the rest) a "data" x "model" one."""
        import numpy as np

        from tpugen.sharding import mesh_shape

        found = self.jax.devices()
        count = devices or len(found)
        if count > len(found):
            raise InputError(
                f"execution.cores: {count} devices asked for, and JAX sees {len(found)} ({found[0].platform}; on the "
                "CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N makes N)"
            )
        chosen = np.array(found[:count])
        if axes is None:
            return self.jax.sharding.Mesh(chosen, ("data",))
        data, model = mesh_shape(*axes, count)
        return self.jax.sharding.Mesh(chosen.reshape(data, model), ("data", "model"))

    def device_kind(self) -> str:
        device = self.jax.devices()[0]
        return f"{device.platform.upper()} ({device.device_kind})"


_RUNTIME: Runtime | None = None
_RUNTIME_LOCK = threading.Lock()


def process_runtime() -> Runtime:
    """This process's JAX runtime (made on first use)."""
    global _RUNTIME
    with _RUNTIME_LOCK:
        if _RUNTIME is None:
            _RUNTIME = Runtime()
        return _RUNTIME
