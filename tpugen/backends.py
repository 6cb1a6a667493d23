"""The device seam: the only module that imports torch_xla, and only inside functions."""

from __future__ import annotations

import glob
import os
import threading
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path


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

    def __sub__(self, other: Counters) -> Counters:
        def minus(a, b):
            return None if a is None or b is None else a - b

        return Counters(**{k: minus(v, getattr(other, k)) for k, v in asdict(self).items()})

    def as_dict(self) -> dict:
        return asdict(self)


def versions() -> dict:
    """Versions of the packages that decide what gets compiled and how."""
    out = {}
    for name in ("tpugen", "torch", "torch_xla", "diffusers", "transformers"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def tpu_present() -> bool:
    """A TPU VM exposes its chips as /dev/accel* (v4, v5p) or VFIO devices (v5e, v6e)."""
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


class Backend:
    """Eager PyTorch on the host CPU: the reference every other backend is compared against.

    With torch.compile (`compile.torch_compile`), its compiles are counted through dynamo's counters.
    """

    name = "cpu"

    def __init__(self, torch_compile: bool = False) -> None:
        import torch

        self.device = torch.device("cpu")
        self.torch_compile = torch_compile
        self.cache = {"enabled": False, "dir": None, "note": "eager backend: no XLA compile cache"}

    placing: str | None = None  # the component moving onto the device now, for an out-of-memory message

    def place(self, pipe, offload: bool = False) -> None:
        """Put the pipeline on the device: all of it, or (offload) each component only while it runs."""
        if offload:
            pipe.enable_model_cpu_offload(device=self.device)
        else:
            pipe.to(self.device)

    def device_for(self, component: str):
        """The device a component computes on (under offload too, where it waits on the host between calls)."""
        return self.device

    def split_batch(self, tensor):
        """Lay a batch-first tensor out over the devices' data axis (a no-op without SPMD)."""
        return tensor

    def memory(self) -> dict | None:
        """Device memory in use and its peak (bytes), where the device reports it."""
        return None

    def sync(self) -> None:
        """Cut the lazy graph here (a no-op for eager backends)."""

    def wait(self) -> None:
        """Block until the device has finished everything queued."""

    def counters(self) -> Counters | None:
        if not self.torch_compile:
            return None
        from torch._dynamo.utils import counters

        return Counters(
            compiles=int(counters["stats"]["unique_graphs"]),
            compile_seconds=None,
            executions=None,
            transfers_to_host=None,
        )

    def rank(self) -> int:
        """This replica's global index among all replicas of the run."""
        return 0

    def world_size(self) -> int:
        return 1

    def ranks_in_process(self) -> int:
        """How many replicas this OS process drives (several on XLA:CPU, where ranks are threads)."""
        return 1

    def describe(self) -> dict:
        return {"backend": self.name, "device": str(self.device), "device_kind": "CPU", "world_size": 1}


# The persistent cache belongs to the process (torch_xla allows one per process), not to a rank.
_PROCESS_CACHE: dict = {}
_CACHE_LOCK = threading.Lock()


class XlaBackend(Backend):
    """torch_xla's lazy tensors: traced per step, compiled by XLA, executed on TPU (or XLA:CPU)."""

    name = "xla"

    def __init__(self, cache_enabled: bool | str = "auto", cache_dir: str | None = None) -> None:
        if "PJRT_DEVICE" not in os.environ:
            # Say it ourselves, so torch_xla does not guess (and warn) on a machine without a TPU.
            os.environ["PJRT_DEVICE"] = "TPU" if tpu_present() else "CPU"
        try:
            import torch_xla
            import torch_xla.core.xla_model as xm
            import torch_xla.debug.metrics as met
            import torch_xla.runtime as xr
        except ImportError as exc:
            from tpugen.errors import InputError

            raise InputError(
                f"execution.backend: xla needs torch_xla ({exc}); install tpugen[tpu] on a TPU VM "
                "or tpugen[xla] elsewhere"
            ) from None
        self._torch_xla, self._xm, self._met, self._xr = torch_xla, xm, met, xr
        self.cache = self._start_cache(cache_enabled, cache_dir)
        self.device = torch_xla.device()
        _solve_small_systems_on_xla()

    def _start_cache(self, enabled: bool | str, directory: str | None) -> dict:
        """Point torch_xla's persistent compile cache at one directory per device kind and process.

        It must happen before the first computation; XLA:CPU writes entries but cannot load them back,
        so `auto` leaves it off there rather than pretend.
        """
        pjrt = os.environ["PJRT_DEVICE"].upper()
        if enabled == "auto" and pjrt != "TPU":
            return {
                "enabled": False,
                "dir": None,
                "note": f"off: XLA:{pjrt} cannot load serialized executables, so a persistent cache never hits "
                "across processes (cache.enabled: true tries anyway)",
            }
        if enabled is False:
            return {"enabled": False, "dir": None, "note": "off (cache.enabled: false)"}
        with _CACHE_LOCK:
            if _PROCESS_CACHE:  # another rank of this process set it up already
                return dict(_PROCESS_CACHE)
            if self._torch_xla._XLAC._xla_computation_cache_is_initialized():
                return {
                    "enabled": False,
                    "dir": None,
                    "note": "off: the XLA runtime had already started in this process",
                }
            _PROCESS_CACHE.update(self._open_cache(directory, pjrt))
            return dict(_PROCESS_CACHE)

    def _open_cache(self, directory: str | None, pjrt: str) -> dict:
        from tpugen.models import cache_root

        root = Path(directory) if directory else cache_root() / "xla"
        path = root / f"{pjrt.lower()}-process{self.process_index()}"
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            from tpugen.errors import InputError

            raise InputError(f"cache.dir: cannot create {path}: {exc.strerror}") from None
        self._xr.initialize_cache(str(path), readonly=False)
        return {"enabled": True, "dir": str(path), "note": "on"}

    def process_index(self) -> int:
        """This process's index among the host's XLA processes, read from the environment torch_xla.launch
        sets, so that asking does not start the runtime before the compile cache is set up."""
        return int(os.environ.get("PJRT_LOCAL_PROCESS_RANK", "0"))

    def place(self, pipe, offload: bool = False) -> None:
        if offload:
            _let_diffusers_offload_to_xla()
            super().place(pipe, offload)
            return
        from torch import nn

        for name, component in pipe.components.items():  # one at a time, to name the one that does not fit
            if isinstance(component, nn.Module):
                self.placing = name
                component.to(self.device)
        self.placing = None

    def memory(self) -> dict:
        """Device memory in use and its peak so far (bytes), as the runtime reports it."""
        try:
            info = self._xm.get_memory_info(self.device)
        except RuntimeError as exc:  # XLA:CPU: "GetAllocatorStats is not supported"
            return {"unavailable": (str(exc).splitlines() or ["unsupported"])[0].split(": ")[-1]}
        return {"bytes_in_use": info.get("bytes_used"), "peak_bytes": info.get("peak_bytes_used")}

    def rank(self) -> int:
        return self._xr.global_ordinal()

    def world_size(self) -> int:
        return self._xr.world_size()

    def ranks_in_process(self) -> int:
        return self._xr.addressable_device_count()

    def sync(self) -> None:
        self._torch_xla.sync()

    def wait(self) -> None:
        self._xm.wait_device_ops()

    def counters(self) -> Counters:
        met = self._met

        def count(metric: str) -> int:
            data = met.metric_data(metric)
            return int(data[0]) if data else 0

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
            "world_size": self._xr.world_size(),
            "rank": self._xr.global_ordinal(),
        }


def _let_diffusers_offload_to_xla() -> None:
    """diffusers' model offload empties the device's allocator cache through `torch.xla`, which torch_xla does
    not register, so it fails on XLA. XLA frees a buffer when its last tensor dies: there is nothing to empty."""
    import diffusers.pipelines.pipeline_utils as pipeline_utils

    empty = pipeline_utils.empty_device_cache
    if getattr(empty, "tpugen_xla", False):
        return

    def empty_device_cache(device_type: str | None = None) -> None:
        if device_type != "xla":
            empty(device_type)

    empty_device_cache.tpugen_xla = True
    pipeline_utils.empty_device_cache = empty_device_cache


def solve_small(a, b):
    """torch.linalg.solve for a system of 1 to 3 unknowns, in plain tensor arithmetic (the adjugate).

    XLA has no linear solver of its own: torch_xla runs `torch.linalg.solve` on the host, a read back to the
    host per call. UniPC solves a 2x2 (or 3x3) system every step, so that was 2 host reads per step.
    """
    import torch

    n = a.shape[-1]
    if n == 1:
        inverse = 1 / a
    elif n == 2:
        inverse = torch.stack([torch.stack([a[1, 1], -a[0, 1]]), torch.stack([-a[1, 0], a[0, 0]])])
        inverse = inverse / (a[0, 0] * a[1, 1] - a[0, 1] * a[1, 0])
    else:

        def minor(r0, r1, c0, c1):
            return a[r0, c0] * a[r1, c1] - a[r0, c1] * a[r1, c0]

        cofactors = [
            [minor(1, 2, 1, 2), -minor(1, 2, 0, 2), minor(1, 2, 0, 1)],
            [-minor(0, 2, 1, 2), minor(0, 2, 0, 2), -minor(0, 2, 0, 1)],
            [minor(0, 1, 1, 2), -minor(0, 1, 0, 2), minor(0, 1, 0, 1)],
        ]
        determinant = sum(a[0, j] * cofactors[0][j] for j in range(3))
        adjugate = torch.stack([torch.stack([cofactors[r][c] for r in range(3)]) for c in range(3)])
        inverse = adjugate / determinant
    return inverse @ b


def _solve_small_systems_on_xla() -> None:
    """Route torch.linalg.solve of XLA tensors with up to 3 unknowns through solve_small (once per process).

    Every other call goes to the real solver, so nothing else changes.
    """
    import torch

    real = torch.linalg.solve
    if getattr(real, "tpugen_xla", False):
        return

    def solve(a, b, *args, **kwargs):
        if a.device.type == "xla" and a.dim() == 2 and a.shape[-1] <= 3 and not args and not kwargs:
            return solve_small(a, b)
        return real(a, b, *args, **kwargs)

    solve.tpugen_xla = True
    torch.linalg.solve = solve


def _xla_cpu_devices(cores: int, what: str) -> None:
    """Before the runtime starts: on XLA:CPU, `cores` devices; on a TPU VM every chip, so cores must be 0."""
    if "PJRT_DEVICE" not in os.environ:
        os.environ["PJRT_DEVICE"] = "TPU" if tpu_present() else "CPU"
    if os.environ["PJRT_DEVICE"].upper() == "CPU" and cores > 0:
        os.environ["CPU_NUM_DEVICES"] = str(cores)
    elif cores > 0:
        from tpugen.errors import InputError

        raise InputError(f"execution.cores: on a TPU VM {what} uses every chip; set cores: 0 (got {cores})")


def _move(value, device):
    """Tensors anywhere in an argument or output (tuples, lists, dicts, model outputs) moved to `device`."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):  # transformers' ModelOutput is a dict too, and keeps its type this way
        for key in list(value.keys()):
            value[key] = _move(value[key], device)
        return value
    if isinstance(value, (tuple, list)):
        moved = [_move(v, device) for v in value]
        return type(value)(moved) if not hasattr(value, "_fields") else type(value)(*moved)
    return value


class PlacedBackend(XlaBackend):
    """Whole components on different local devices of one process (execution.placement), no SPMD.

    Each component's inputs move to its device as it is called and its outputs come back to the denoiser's
    device, where the pipeline itself runs; the moves go through the host, once per call of that component.
    """

    def __init__(self, cache_enabled: bool | str, cache_dir: str | None, *, cores: int) -> None:
        _xla_cpu_devices(cores, "placement")
        super().__init__(cache_enabled, cache_dir)
        self.devices = [self._torch_xla.device(i) for i in range(self._xr.addressable_device_count())]
        self.assignment: dict[str, int] = {}

    def rank(self) -> int:
        return 0  # one replica, whatever devices its components sit on

    def world_size(self) -> int:
        return 1

    def ranks_in_process(self) -> int:
        return 1

    def capacities(self, chip_bytes: float) -> list[float]:
        """Memory per device: as the device reports it, or the configured chip's HBM where it cannot."""
        out = []
        for device in self.devices:
            try:
                out.append(float(self._xm.get_memory_info(device)["bytes_limit"]))
            except (RuntimeError, KeyError):
                out.append(chip_bytes)
        return out

    def assign(self, assignment: dict[str, int], denoiser: str) -> None:
        self.assignment = dict(assignment)
        self.device = self.devices[assignment.get(denoiser, 0)]  # the pipeline's own tensors live here

    def device_for(self, component: str):
        return self.devices[self.assignment[component]] if component in self.assignment else self.device

    def place(self, pipe, offload: bool = False) -> None:
        from torch import nn

        main = self.device
        for name, component in pipe.components.items():
            if not isinstance(component, nn.Module):
                continue
            device = self.devices[self.assignment.get(name, self.devices.index(main))]
            component.to(device)
            if device == main:
                continue

            def inputs_here(module, args, kwargs, device=device):
                return _move(args, device), _move(kwargs, device)

            def outputs_back(module, args, kwargs, output):
                return _move(output, main)

            component.register_forward_pre_hook(inputs_here, with_kwargs=True)
            component.register_forward_hook(outputs_back, with_kwargs=True)

    def describe(self) -> dict:
        return {
            **super().describe(),
            "devices": len(self.devices),
            "placement": {name: str(self.devices[i]) for name, i in self.assignment.items()},
        }


def mesh_shape(data: int, model: int, devices: int) -> tuple[int, int]:
    """(data, model) axes of a mesh over `devices`; model 0 means every device the data axis leaves."""
    from tpugen.errors import InputError

    if devices % data:
        raise InputError(f"execution.mesh.data: {data} does not divide the {devices} devices of this machine")
    model = model or devices // data
    if data * model != devices:
        raise InputError(
            f"execution.mesh: data {data} x model {model} = {data * model} devices, but this machine has {devices}; "
            "the mesh must cover every device (model: 0 takes the rest)"
        )
    return data, model


class SpmdBackend(XlaBackend):
    """torch_xla SPMD: one process drives every local device as a (data, model) mesh.

    The denoiser's large linear layers (and big text encoders) are split over the model axis by the rule
    tables in tpugen.sharding; a batch is split over the data axis. XLA inserts the communication, so the
    images are those of one device, up to the order of floating-point sums.
    """

    def __init__(self, cache_enabled: bool | str, cache_dir: str | None, *, data: int, model: int, cores: int) -> None:
        _xla_cpu_devices(cores, "SPMD")
        try:
            import torch_xla.runtime as xr
        except ImportError:
            super().__init__(cache_enabled, cache_dir)  # raises the one-line "needs torch_xla" error
            raise
        # Before the compile cache and the first tensor: SPMD replaces the devices with one virtual device.
        xr.use_spmd()
        super().__init__(cache_enabled, cache_dir)
        if xr.process_count() > 1:
            from tpugen.errors import InputError

            raise InputError(
                "execution.sharding: spmd over a pod's hosts is not built; each pod worker runs its own mesh "
                "only when the runtime is per worker"
            )
        import numpy as np
        import torch_xla.distributed.spmd as xs

        self.devices = xr.global_runtime_device_count()
        self.data, self.model = mesh_shape(data, model, self.devices)
        self._xs = xs
        self.mesh = xs.Mesh(np.arange(self.devices), (self.data, self.model), ("data", "model"))
        self.sharding: dict | None = None

    def place(self, pipe, offload: bool = False) -> None:
        from torch import nn

        from tpugen.sharding import plan_sharding

        plan = plan_sharding(pipe, self.model)  # from names and shapes, while the weights are on the host
        specs = {(p.component, p.parameter): p.spec for p in plan.parameters}
        tensors, moved = [], {}
        for name, component in pipe.components.items():
            if not isinstance(component, nn.Module):
                continue
            self.placing = name
            # Tensor by tensor, each split as soon as it lands: moving a whole model first would put a full
            # copy on every chip, which is what a model too big for one chip cannot afford.
            for module_name, module in component.named_modules():
                prefix = f"{module_name}." if module_name else ""
                for store in (module._parameters, module._buffers):
                    for key, tensor in list(store.items()):
                        if tensor is None:
                            continue
                        if id(tensor) not in moved:  # a tied weight moves once and stays tied
                            data = tensor.data.to(self.device)
                            moved[id(tensor)] = (
                                nn.Parameter(data, requires_grad=False) if isinstance(tensor, nn.Parameter) else data
                            )
                            spec = specs.get((name, prefix + key))
                            if spec is not None:
                                self._xs.mark_sharding(moved[id(tensor)], self.mesh, spec)
                                tensors.append(moved[id(tensor)])
                        store[key] = moved[id(tensor)]
        self.placing = None
        # Read back from the runtime, so the report shows what the device holds, not what was asked.
        verified = sum(1 for t in tensors if self._torch_xla._XLAC._get_xla_sharding_spec(t))
        self.sharding = {
            "mesh": {"data": self.data, "model": self.model},
            "devices": self.devices,
            "split_tensors": len(plan.parameters),
            "split_tensors_verified": verified,
            "components": plan.components,
        }

    def memory(self) -> dict:
        return {"unavailable": "torch_xla reports no memory for the SPMD virtual device"}

    def split_batch(self, tensor):
        if self.data > 1:
            self._xs.mark_sharding(tensor, self.mesh, ("data",) + (None,) * (tensor.dim() - 1))
        return tensor

    def describe(self) -> dict:
        return {**super().describe(), "world_size": 1, "devices": self.devices, "sharding": self.sharding}


def scan_repeated_blocks(transformer) -> int:
    """Run a DiT's repeated blocks through torch_xla's scan, weights stacked once at load time.

    Consecutive blocks of the same structure (same parameter names and shapes) form one stack: Flux.1's
    19 double and 38 single blocks are two stacks; SD3's joint blocks are one stack and its last block, which
    differs (context_pre_only), stays as it is; SD 3.5's blocks with and without dual attention are separate
    stacks. The compiler then sees one block per stack instead of every block unrolled. The stacked weights
    replace the blocks' own, so memory does not grow. Returns how many blocks now run inside a scan.
    """
    import torch
    from torch import nn
    from torch.func import functional_call
    from torch_xla.experimental.scan import scan

    class ScannedBlocks(nn.Module):
        # Called once, like one block; `scan` runs the template block with each block's weights in turn.
        def __init__(self, blocks) -> None:
            super().__init__()
            self.template = blocks[0]
            self.context_pre_only = getattr(blocks[0], "context_pre_only", None)  # SD3's loop reads it
            self.names = [name for name, _ in self.template.named_parameters()]
            params = [dict(block.named_parameters()) for block in blocks]
            for i, name in enumerate(self.names):
                self.register_buffer(f"stacked_{i}", torch.stack([p[name].detach() for p in params]))
            self._steps: dict[bool, object] = {}

        def _step(self, rotary: bool):
            # One long-lived function per call shape, so scan does not trace it again on every call.
            if rotary not in self._steps:
                template, names = self.template, self.names

                def step(carry, weights):
                    # Everything the block reads rides in the carry: scan cannot trace captured tensors.
                    hidden, encoder, temb, *cos_sin = carry
                    inputs = {"hidden_states": hidden, "encoder_hidden_states": encoder, "temb": temb}
                    if rotary:
                        inputs["image_rotary_emb"] = tuple(cos_sin)
                    encoder, hidden = functional_call(template, dict(zip(names, weights, strict=True)), (), inputs)
                    # scan traces a backward pass it never runs, so each step's output must depend on the inputs.
                    return (hidden, encoder, temb, *cos_sin), hidden.sum()

                self._steps[rotary] = step
            return self._steps[rotary]

        def forward(
            self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None, joint_attention_kwargs=None
        ):
            weights = [getattr(self, f"stacked_{i}") for i in range(len(self.names))]
            rotary = image_rotary_emb is not None
            carry = (hidden_states, encoder_hidden_states, temb, *(image_rotary_emb if rotary else ()))
            (hidden, encoder, *_), _ = scan(self._step(rotary), carry, weights, is_fn_pure=True)
            return encoder, hidden

    def structure(block) -> tuple:
        return tuple((name, tuple(p.shape), p.dtype) for name, p in block.named_parameters())

    scanned = 0
    for attribute in ("transformer_blocks", "single_transformer_blocks"):
        blocks = list(getattr(transformer, attribute, None) or [])
        runs: list[list] = []
        for block in blocks:
            if runs and structure(runs[-1][0]) == structure(block):
                runs[-1].append(block)
            else:
                runs.append([block])
        if all(len(run) == 1 for run in runs):
            continue
        setattr(transformer, attribute, nn.ModuleList([ScannedBlocks(r) if len(r) > 1 else r[0] for r in runs]))
        scanned += sum(len(r) for r in runs if len(r) > 1)
    return scanned


def host_index() -> int:
    """This TPU VM's index in its pod, as torch_xla reads it from the TPU environment."""
    import torch_xla.runtime as xr

    return xr.host_index()


def launch_ranks(fn, args: tuple, cores: int) -> None:
    """Run fn(index, *args) once per local XLA device with torch_xla.launch.

    On a TPU VM that is one process per chip; on XLA:CPU, CPU_NUM_DEVICES devices driven by threads of one
    child process. `cores` > 0 sets how many CPU devices; on TPU every chip is used.
    """
    _xla_cpu_devices(cores, "tpugen")
    import torch_xla

    torch_xla.launch(fn, args=args)


class CudaBackend(Backend):
    """Eager PyTorch on an NVIDIA GPU, optionally with torch.compile, for users with GPUs."""

    name = "cuda"

    def __init__(self, torch_compile: bool = False) -> None:
        import torch

        if not torch.cuda.is_available():
            from tpugen.errors import InputError

            raise InputError("execution.backend: cuda: no CUDA GPU is visible (torch.cuda.is_available() is False)")
        super().__init__(torch_compile)
        self.device = torch.device("cuda")
        self._torch = torch

    def wait(self) -> None:
        self._torch.cuda.synchronize()

    def describe(self) -> dict:
        return {**super().describe(), "device_kind": self._torch.cuda.get_device_name(self.device)}


TORCH_TPU_MODES = ("eager", "defer_and_fuse", "compile")
DEFER_AND_FUSE_ENV = "TORCH_TPU_DEFER_AND_FUSE"


def torch_tpu_environment(mode: str) -> dict[str, str]:
    """Variables TorchTPU reads when torch is imported: they must be set before that import."""
    return {DEFER_AND_FUSE_ENV: "1"} if mode == "defer_and_fuse" else {}


class TorchTpuBackend(Backend):
    """TorchTPU (`torch_tpu`): the device "tpu" in strict eager, deferred-and-fused eager, or compiled."""

    name = "torch_tpu"

    def __init__(self, mode: str = "eager") -> None:
        import sys

        for key, value in torch_tpu_environment(mode).items():
            if os.environ.get(key) != value:
                from tpugen.errors import RunError

                loaded = "torch was already imported" if "torch" in sys.modules else "it is not set"
                raise RunError(f"{key}={value} must be set before torch is imported ({loaded})")
        try:
            # With TORCH_DEVICE_BACKEND_AUTOLOAD=0, importing torch no longer registers "tpu": do it here.
            import torch_tpu  # noqa: F401
        except ImportError:
            from tpugen.errors import InputError

            raise InputError(
                "execution.backend: torch_tpu is not installed; install tpugen[torchtpu] in a venv of its own "
                "(TorchTPU needs torch >= 2.11, torch_xla needs 2.9)"
            ) from None
        import torch

        accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        if accelerator is None or accelerator.type != "tpu":
            from tpugen.errors import InputError

            raise InputError("execution.backend: torch_tpu found no TPU on this machine")
        super().__init__(torch_compile=mode == "compile")
        self.mode = mode
        self.device = "tpu"  # as the diffusers guide writes it: pipe.to("tpu")
        self._torch = torch

    def wait(self) -> None:
        self._torch.accelerator.synchronize()

    def describe(self) -> dict:
        return {
            **super().describe(),
            "device": "tpu",
            "device_kind": "TPU (TorchTPU)",
            "torch_tpu_mode": self.mode,
            "environment": torch_tpu_environment(self.mode),
        }


def make_backend(config) -> Backend:
    """The backend a run config names. Importing torch_xla or torch_tpu happens here, never at tpugen import."""
    execution, cache = config.execution, config.cache
    name = execution.backend
    if name == "xla" and execution.sharding == "spmd":
        mesh = execution.mesh
        return SpmdBackend(cache.enabled, cache.dir, data=mesh.data, model=mesh.model, cores=execution.cores)
    if name == "xla" and execution.placement != "none":
        return PlacedBackend(cache.enabled, cache.dir, cores=execution.cores)
    if name == "xla":
        return XlaBackend(cache.enabled, cache.dir)
    if name == "cpu":
        return Backend(torch_compile=config.compile.torch_compile)
    if name == "cuda":
        return CudaBackend(torch_compile=config.compile.torch_compile)
    if name == "torch_tpu":
        return TorchTpuBackend(execution.torch_tpu.mode)
    raise ValueError(f"unknown backend {name!r}")
