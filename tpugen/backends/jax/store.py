"""Whole compiled programs kept beside JAX's compile cache, so a later process skips tracing them too.

JAX's persistent cache saves the compile, but a process still traces each program to find its cache key: for a
UNet through torchax that is most of a second on tiny-sd and seconds at full size, every process. tpugen keeps its
two biggest programs, the denoising loop and the decode, whole (`jax.experimental.serialize_executable`), under a
key of everything their trace reads:

- the process: tpugen's own source, the versions of the libraries that trace and compile, XLA_FLAGS, the devices;
- the program: what tpugen traces (the loop's body and its fixed arguments, the decode's family, method and size);
- each module it runs: every submodule's class and plain attributes (configs, scales, attention processors,
  methods set on an instance), and the shapes and dtypes of every argument, weights included.

A key that differs is a miss: the program is traced and compiled afresh (not read from JAX's cache: XLA:CPU
cannot serialize again what it read from there) and stored; a file that cannot be read is one warning and a miss. The files are executables for this machine's devices, as JAX's own
cache is: keep the folder as private as that one."""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import threading
import time
from pathlib import Path

log = logging.getLogger("tpugen")

FOLDER = "tpugen-programs"
_LIBRARIES = (
    "jax",
    "jaxlib",
    "torchax",
    "torch",
    "diffusers",
    "transformers",
    "peft",
    "accelerate",
    "numpy",
    "ml_dtypes",
)
_SIMPLE = (bool, int, float, str, bytes, type(None))


def _plain(value, depth: int = 0):
    """A value as a stable, comparable description: plain values as they are, containers item by item, a config
    by its dict, a function by its name, defaults and closure, an object of diffusers, transformers, peft or
    tpugen (an attention processor, a hook) by its class and attributes, anything else by its class. Two runs'
    descriptions match only when what a trace reads of them does."""
    import functools
    import types

    import torch

    if isinstance(value, _SIMPLE):
        return value
    if depth > 6:
        return ("deep", type(value).__qualname__)
    if isinstance(value, torch.nn.Module):  # its own attributes are described where it is a submodule
        return ("module", type(value).__module__, type(value).__qualname__)
    if isinstance(value, torch.dtype | torch.device):
        return str(value)
    if isinstance(value, torch.Tensor):  # a plain tensor attribute (not a weight) is read as a constant
        return ("tensor", tuple(value.shape), str(value.dtype), _tensor_digest(value))
    if isinstance(value, set | frozenset):
        return ("set", tuple(sorted(repr(_plain(v, depth + 1)) for v in value)))
    if isinstance(value, list | tuple):
        return (type(value).__name__, tuple(_plain(v, depth + 1) for v in value))
    if isinstance(value, dict):
        # diffusers' configs list the keys left at their defaults from a set (an order per process): not read by
        # any trace, so left out
        items = ((str(k), v) for k, v in value.items() if k != "_use_default_values")
        return ("dict", tuple(sorted((k, _plain(v, depth + 1)) for k, v in items)))
    if isinstance(value, functools.partial):
        return (
            "partial",
            _plain(value.func, depth + 1),
            _plain(value.args, depth + 1),
            _plain(value.keywords, depth + 1),
        )
    if isinstance(value, types.MethodType):
        return ("method", type(value.__self__).__qualname__, _plain(value.__func__, depth + 1))
    if isinstance(value, types.FunctionType):
        closure = tuple(_plain(cell.cell_contents, depth + 1) for cell in value.__closure__ or ())
        return ("function", value.__module__, value.__qualname__, _plain(value.__defaults__, depth + 1), closure)
    if hasattr(value, "to_dict") and callable(value.to_dict):
        try:
            return (type(value).__qualname__, _plain(value.to_dict(), depth + 1))
        except Exception:  # noqa: BLE001 - a config that cannot say itself is described by its class
            return (type(value).__qualname__, os.urandom(8).hex())  # and never matches
    kind = type(value)
    if getattr(kind, "__module__", "").startswith(("diffusers", "transformers", "peft", "tpugen")):
        attributes = (
            {k: v for k, v in vars(value).items() if not k.startswith("__")} if hasattr(value, "__dict__") else {}
        )
        return (kind.__module__, kind.__qualname__, _plain(attributes, depth + 1))
    if callable(value):
        return ("callable", getattr(value, "__module__", None), getattr(value, "__qualname__", kind.__qualname__))
    return kind.__qualname__


def _tensor_digest(tensor) -> str:
    import torch

    try:
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    except Exception:  # noqa: BLE001 - a tensor that cannot be read (meta) makes a key that never matches
        return os.urandom(8).hex()
    return hashlib.sha256(data).hexdigest()


# A module's own weights are the programs' arguments (their shapes and dtypes in the key); "training" does not
# change an inference trace; tpugen's host-side caches on a module hold what the trace is handed as arguments.
_SKIPPED = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "training", "_tpugen_tables"}


def module_description(module) -> tuple:
    """Every submodule of `module`: its name, class and plain attributes, its hooks in order (not its weights:
    their shapes and dtypes are the programs' arguments)."""
    parts = []
    for name, sub in module.named_modules(remove_duplicate=False):
        attributes = {}
        for key, value in vars(sub).items():
            if key in _SKIPPED:
                continue
            if key.startswith("_") and "hooks" in key and isinstance(value, dict):
                value = list(value.values())  # their handles' numbers differ per process; their order counts
            attributes[key] = value
        parts.append((name, type(sub).__module__, type(sub).__qualname__, _plain(attributes)))
    return tuple(parts)


def pipe_description(pipe) -> tuple:
    """The pipeline's own plain attributes and its image processor's config (what a family's decode reads)."""
    # diffusers keeps each call's settings (_guidance_scale, _num_timesteps, ...) on the pipeline: not the decode's
    plain = {k: v for k, v in vars(pipe).items() if isinstance(v, _SIMPLE) and not k.startswith("_")}
    processor = getattr(pipe, "image_processor", None)
    return (_plain(plain), _plain(getattr(processor, "config", None)))


def _process_description() -> tuple:
    from importlib import metadata

    import jax

    import tpugen

    source = hashlib.sha256()
    root = Path(tpugen.__file__).parent
    for path in sorted(root.rglob("*.py")):
        source.update(str(path.relative_to(root)).encode())
        source.update(path.read_bytes())
    versions = []
    for name in _LIBRARIES:
        try:
            versions.append((name, metadata.version(name)))
        except metadata.PackageNotFoundError:
            versions.append((name, None))
    devices = jax.devices()
    return (
        source.hexdigest(),
        tuple(versions),
        os.environ.get("XLA_FLAGS", ""),
        os.environ.get("LIBTPU_INIT_ARGS", ""),
        bool(jax.config.jax_enable_x64),
        str(jax.config.jax_default_matmul_precision),
        devices[0].platform,
        devices[0].client.platform_version,  # the PJRT plugin's (libtpu's) build
        devices[0].device_kind,
        len(devices),
        jax.process_count(),
    )


class ProgramStore:
    """The store in `directory` (None: off, every program a plain `jax.jit`)."""

    def __init__(self, runtime) -> None:
        self.runtime = runtime
        self.directory: Path | None = None
        self._process: tuple | None = None
        self._warned = False

    def use(self, cache_dir: str | None) -> None:
        """Keep programs under JAX's cache folder `cache_dir`; a remote one (gs://) keeps none (JAX's cache there
        still saves the compiles)."""
        if cache_dir and "://" not in cache_dir:
            self.directory = Path(cache_dir) / FOLDER
        elif cache_dir and cache_dir.startswith("file://"):
            self.directory = Path(cache_dir[len("file://") :]) / FOLDER
        else:
            self.directory = None

    def program(self, function, identity):
        """`function` jitted, found in the store by `identity()` (what its trace reads besides its arguments, as
        it is when the program is traced for a new signature) and its arguments' shapes when it is there."""
        jax = self.runtime.jax
        if self.directory is None:
            return jax.jit(function)
        return _StoredProgram(self, function, identity)

    def process(self) -> tuple:
        if self._process is None:
            self._process = _process_description()
        return self._process

    def warn_once(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning(message)


class _StoredProgram:
    def __init__(self, store: ProgramStore, function, identity) -> None:
        self.store = store
        self.function = function
        self.identity = identity
        self.__name__ = getattr(function, "__name__", "program")
        self._compiled: dict = {}
        self._lock = threading.Lock()
        self._weights: tuple = (None, None)  # (the weights dict last seen, its signature)

    def _signature(self, args: tuple) -> tuple:
        jax = self.store.runtime.jax
        weights, rest = args[0], args[1:]
        seen, signature = self._weights
        if seen is not weights or len(signature) != len(weights):
            signature = tuple(sorted((k, tuple(v.shape), str(v.dtype)) for k, v in weights.items()))
            self._weights = (weights, signature)
        leaves, tree = jax.tree_util.tree_flatten(rest)
        shapes = tuple((tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", type(x).__name__))) for x in leaves)
        # How the arguments lie on the devices (a program split over a mesh is another executable).
        layout = tuple(str(getattr(x, "sharding", None)) for x in (*leaves, *list(weights.values())[:1]))
        return (signature, str(tree), shapes, layout)

    def __call__(self, *args):
        signature = self._signature(args)
        compiled = self._compiled.get(signature)
        if compiled is None:
            with self._lock:
                compiled = self._compiled.get(signature)
                if compiled is None:
                    compiled = self._load_or_compile(signature, args)
                    self._compiled[signature] = compiled
        return compiled(*args)

    def _load_or_compile(self, signature: tuple, args: tuple):
        from jax.experimental import serialize_executable

        store, runtime = self.store, self.store.runtime
        kernel = runtime.kernel.identity() if runtime.kernel is not None else None  # the attention it traces
        digest = hashlib.sha256(repr((store.process(), kernel, self.identity(), signature)).encode()).hexdigest()
        path = store.directory / f"{self.__name__}-{digest[:40]}.bin"
        started = time.perf_counter()
        try:
            compiled = _read(path)
        except Exception as exc:  # noqa: BLE001 - a file that cannot be read is a miss, said once
            runtime.stored_program_unreadable()
            store.warn_once(f"a stored JAX program could not be read ({path.name}: {exc}); compiling it again")
            compiled = None
        if compiled is not None:
            runtime.stored_program_loaded(time.perf_counter() - started)
            return compiled
        before = runtime.reading().cache_hits
        compiled = _compile_fresh(runtime.jax, self.function, args)
        if runtime.reading().cache_hits != before:  # read from JAX's cache after all: not one to store
            return compiled
        try:
            payload = pickle.dumps(serialize_executable.serialize(compiled))
        except Exception as exc:  # noqa: BLE001 - a program JAX cannot serialize is kept by its own cache only
            log.debug("JAX program %s not stored: %s", self.__name__, exc)
            return compiled
        try:
            from tpugen.files import atomic_write_bytes

            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(path, payload)
            runtime.stored_program_written()
        except OSError as exc:
            store.warn_once(f"a JAX program could not be stored in {path.parent}: {exc}")
        return compiled


def _read(path: Path):
    """The program stored at `path`, loaded onto this process's devices; None when there is none."""
    from jax.experimental import serialize_executable

    if not path.is_file():
        return None
    payload, in_tree, out_tree = pickle.loads(path.read_bytes())
    return serialize_executable.deserialize_and_load(payload, in_tree, out_tree)


_FRESH = threading.Lock()


def _compile_fresh(jax, function, args):
    """`function` compiled for `args` without JAX's persistent cache. On XLA:CPU an executable JAX read back from
    its cache holds no kernels of its own: serialized again, the copy fails when run ("Function ... not found").
    JAX decides once per process whether its cache is used (jax._src.compilation_cache), so that decision is set
    aside for this compile (a compile of another thread meanwhile is fresh too: slower, never wrong); the caller
    also checks JAX's hit count, in case a JAX version decides otherwise."""
    from jax._src import compilation_cache

    with _FRESH:
        with compilation_cache._cache_initialized_mutex:
            saved = (compilation_cache._cache_checked, compilation_cache._cache_used)
            compilation_cache._cache_checked, compilation_cache._cache_used = True, False
        try:
            return jax.jit(function).lower(*args).compile()
        finally:
            with compilation_cache._cache_initialized_mutex:
                compilation_cache._cache_checked, compilation_cache._cache_used = saved
