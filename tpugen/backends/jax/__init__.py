"""JAX through torchax: diffusers' own modules run as JAX functions of their weights on `jax.devices()[0]` (a
TPU on a TPU VM, the CPU here), the whole denoising loop as one compiled call, and JAX's persistent compile cache,
which a later process reads back (on a TPU too, where torch_xla 2.9 cannot)."""

from __future__ import annotations

from contextlib import contextmanager

from tpugen.backends.base import (
    FLASH_ATTENTION_HOOK,
    JAX_PLAIN,
    Counters,
    FlashAttention,
    OneDeviceBackend,
    flash_attention_off,
)
from tpugen.backends.jax.runtime import process_runtime

# Measured here (jax 0.10.2, 4 CPU devices): the kernel under shard_map in interpret mode crashed the process.
JAX_INTERPRET_ONE_DEVICE = (
    "Pallas's interpret mode runs the kernel on one device only off a TPU (on a mesh of CPU devices it crashed "
    "the process); plain attention here"
)


def jax_cache_dir(cache) -> str | None:
    """Where JAX keeps its compiled programs: cache.dir, else tpugen's cache; None with cache.enabled: false.
    `auto` is on: JAX reads its cache back on a TPU and on the CPU alike."""
    if cache is None or cache.enabled is False:
        return None
    from tpugen.settings import cache_root

    return cache.dir or str(cache_root() / "jax")


class JaxBackend(OneDeviceBackend):
    """The pipeline's modules as JAX functions on one device; its Python glue (tokenizing, the schedulers'
    set-up, image preprocessing) on the host, as diffusers wrote it."""

    name = "jax"
    whole_loop = True  # the engine hands this backend whole denoising loops (run_loop)

    def __init__(self, cache=None, devices: int = 1, mesh: tuple[int, int] | None = None) -> None:
        """One device; or (`devices` above 1 or 0, execution.mode: multi; 0: every device JAX sees) a data-parallel
        mesh over that many, the weights copied on each and each call's rows split over them; or (`mesh`, the
        (data, model) axes of execution.sharding: spmd, model 0 the rest) a mesh whose model axis splits the big
        weights by the families' rule tables (tpugen.sharding), so a model bigger than a chip runs on several."""
        import torch

        self.runtime = process_runtime()
        self.mesh = None
        self.sharding: dict | None = None  # spmd's: what was split, for the report
        if mesh is not None:
            self.mesh = self.runtime.mesh(devices, mesh)
        elif devices != 1:
            self.mesh = self.runtime.mesh(devices)
        self.device_count = self.mesh.devices.size if self.mesh is not None else 1
        self.data = self.mesh.shape["data"] if self.mesh is not None else 1
        directory = jax_cache_dir(cache)
        self.runtime.use_cache(directory)
        whole = self.runtime.store.directory is not None
        if directory is None:
            note = "off (cache.enabled: false)"
        elif whole:
            note = (
                "JAX's persistent compilation cache, the denoising loop and decode kept whole beside it "
                "(tpugen-programs: a later process neither traces nor compiles them): read back by every later process"
            )
        else:
            note = "JAX's persistent compilation cache (no whole programs on a remote folder): read back by every later process"
        self.cache = {"enabled": directory is not None, "dir": directory, "whole_programs": whole, "note": note}
        self.device = torch.device("cpu")  # where the pipeline's own (glue) tensors live
        self.modules: dict = {}  # component -> JaxModule
        self.beside: dict = {}  # id of a module run beside the denoiser (a ControlNet) -> its JaxModule
        self._loops = None
        self._decoders: dict = {}
        self._pending = None  # the last array handed to the device, for wait()
        self.flash_attention = None

    # ---------------------------------------------------------------- loading

    def prepare_on_host(self, pipe, family, compile_config) -> None:
        """Nothing: the weights go to the device as they are."""

    def place(self, pipe, *, offload: bool, family) -> None:
        """Every module of the pipeline as a JaxModule: its weights on the device, read once from the host copy."""
        from torch import nn

        from tpugen.backends.jax.loop import LoopPrograms
        from tpugen.backends.jax.modules import JaxModule

        layouts = self._layouts(pipe, family)
        for name, component in pipe.components.items():
            if isinstance(component, nn.Module):
                self.placing = name
                self.modules[name] = JaxModule(self.runtime, component, name, layouts(name))
        self.placing = None
        if self.sharding is not None:  # read back from the arrays, so the report shows what the devices hold
            self.sharding["split_tensors_verified"] = sum(
                "model" in str(getattr(array.sharding, "spec", ""))
                for module in self.modules.values()
                for array in module.weights.values()
            )
        self._loops = LoopPrograms(self.runtime, self.modules[family.denoiser], self.mesh, self.beside)
        self._family, self._pipe = family, pipe

    def prepare_on_device(self, pipe, family, compile_config, hooks) -> None:
        """The modules' calls from diffusers' glue go to JAX: the text encoders' forward, the denoiser's (for a
        loop that runs a step at a time), and the VAE's encoder (img2img and inpainting), each a named hook."""
        self.flash_attention = self._attention(compile_config.flash_attention, family.flash_attention)
        if self.runtime.kernel is not None:  # what a failed call with the kernel takes off (Engine._call_with_flash)
            hooks.add(FLASH_ATTENTION_HOOK, self._kernel_off)
        for name, jax_module in self.modules.items():
            if name == family.denoiser:
                method = family.traced_method
            elif name == "vae":
                method = "_encode"
            else:
                method = "forward"
            if callable(getattr(jax_module.module, method, None)):
                jax_module.patch(method, hooks)

    def _attention(self, setting, route) -> FlashAttention:
        """compile.flash_attention on jax: JAX's Pallas flash-attention kernel (attention.FlashKernel) for the
        attention calls it takes, on a TPU (auto or true), or off one in Pallas's interpret mode
        (TPUGEN_PALLAS_INTERPRET=1); else plain attention, and why."""
        from tpugen.backends.jax.attention import FlashKernel
        from tpugen.settings import pallas_interpret

        self.runtime.kernel = None
        on_tpu = self.runtime.jax.default_backend() == "tpu"
        # Every call of torch's scaled_dot_product_attention is the kernel's to take, whatever processors the
        # family's modules run (route.unsupported names diffusers' XLA processors, which backend jax does not use).
        if setting is False or not (on_tpu or pallas_interpret()):
            return flash_attention_off(setting, route, JAX_PLAIN)
        if not on_tpu and self.mesh is not None:
            return flash_attention_off(setting, route, JAX_INTERPRET_ONE_DEVICE)
        self.runtime.kernel = FlashKernel(self.mesh, interpret=not on_tpu)
        return FlashAttention(setting, route.components)

    def trace_beside(self, module, name: str, hooks, method: str = "forward") -> None:
        """A ControlNet: its weights on the device (copied on every device of a mesh), called inside each whole
        loop beside the denoiser; a call from diffusers' glue (a loop run a step at a time) goes to JAX too."""
        from tpugen.backends.jax.modules import JaxModule

        layout = None
        if self.mesh is not None:
            from jax.sharding import NamedSharding, PartitionSpec

            copied = NamedSharding(self.mesh, PartitionSpec())
            layout = lambda weight: copied  # noqa: E731
        self.placing = name
        beside = JaxModule(self.runtime, module, name, layout)
        self.placing = None
        beside.patch("forward", hooks)
        self.beside[id(module)] = beside
        hooks.add(f"{name} weights on JAX", lambda: self.beside.pop(id(module), None))

    @contextmanager
    def shapes_beside(self):
        """Inside: the modules beside the denoiser (ControlNets) answer diffusers' glue with zeros of their outputs'
        shapes and compute nothing: the pipeline's call up to its denoiser's first call, after which the whole loop
        calls them itself at every step (the first's answer is only read for which argument takes what)."""
        for module in self.beside.values():
            module.shapes_only = True
        try:
            yield
        finally:
            for module in self.beside.values():
                module.shapes_only = False

    def _layouts(self, pipe, family):
        """layout(component) -> (weight name -> its sharding): None on one device; on a mesh, copied on every
        device, but under spmd the weights the rule tables split, split over the model axis (decided from names
        and shapes while the weights are on the host, as backend xla's spmd decides)."""
        if self.mesh is None:
            return lambda component: None
        from jax.sharding import NamedSharding, PartitionSpec

        copied = NamedSharding(self.mesh, PartitionSpec())
        split: dict = {}
        if "model" in self.mesh.shape:
            from tpugen.sharding import plan_sharding

            rules = {**family.text_encoder_rules, **family.denoiser_rules}
            plan = plan_sharding(pipe, self.mesh.shape["model"], rules)
            split = {
                (p.component, p.parameter): NamedSharding(self.mesh, PartitionSpec(*p.spec)) for p in plan.parameters
            }
            self.sharding = {
                "mesh": dict(self.mesh.shape),
                "devices": self.device_count,
                "split_tensors": len(plan.parameters),
                "components": plan.components,
            }
        return lambda component: lambda name: split.get((component, name), copied)

    # ---------------------------------------------------------------- running

    def run_loop(self, work):
        """The whole loop of `work` (tpugen.engine.whole_loop.LoopWork) started on the device; returns its final
        latents, still there."""
        self._pending = self._loops.run(work)
        return self._pending

    @staticmethod
    def noise_bucket(calls: int) -> int:
        from tpugen.backends.jax.loop import noise_bucket

        return noise_bucket(calls)

    def decode(self, family, pipe, latents, height: int, width: int, method: str = "decode"):
        """Latents (a device array, or host torch) decoded by the family's own code (its `method`: decode, or
        decode_loop_latents for a whole loop's) as one JAX program, the pixels in [0, 1] read back to the host."""
        import torch

        from tpugen.backends.jax.modules import to_jax, to_torch
        from tpugen.backends.jax.store import pipe_description

        vae = self.modules["vae"]
        key = (method, tuple(latents.shape), str(latents.dtype), height, width)
        if key not in self._decoders:
            env = self.runtime.env

            def decode(weights, latents):
                with env:
                    image = vae.traced(
                        weights,
                        lambda z: getattr(family, method)(pipe, z, height, width, torch.device("jax")),
                        env.j2t_iso(latents),
                    )
                return env.t2j_iso(image)

            decode.__name__ = f"{family.name}_decode"

            def identity() -> tuple:
                return (
                    "decode",
                    family.name,
                    method,
                    height,
                    width,
                    type(pipe).__qualname__,
                    pipe_description(pipe),
                    vae.description(),
                )

            self._decoders[key] = self.runtime.store.program(decode, identity)
        if isinstance(latents, torch.Tensor):
            latents = to_jax(latents)
        pixels = self._decoders[key](vae.weights, latents)
        self.runtime.executed()
        (host,) = to_torch([pixels])
        self.runtime.read()
        return host

    def read_latents(self, latents):
        """A whole loop's final latents (a device array) read back to the host as torch: what a hires fix's latent
        upscale starts from (one read)."""
        from tpugen.backends.jax.modules import to_torch

        (host,) = to_torch([latents])
        self.runtime.read()
        return host

    def put_weight(self, component: str, name: str, live, host):
        """A weight a LoRA changes: new device data for the JAX copy (a transfer), and the host value for the
        module's own (the host copy diffusers' loaders read)."""
        self.modules[component].put(name, host)
        return host

    def wait(self) -> None:
        if self._pending is not None:
            self._pending.block_until_ready()
            self._pending = None

    def counters(self) -> Counters:
        tally = self.runtime.reading()
        return Counters(
            compiles=tally.executables - tally.cache_hits,
            compile_seconds=tally.compile_seconds,
            executions=tally.executions,
            transfers_to_host=tally.reads,
            persistent_cache_hits=tally.cache_hits,
            persistent_cache_misses=tally.cache_writes,
            persistent_cache_load_failures=tally.load_failures,
            graph_lookups=tally.executables,
        )

    def splits(self, rows: int) -> str | None:
        """Why a call of `rows` rows cannot be split over this backend's data axis, or None."""
        if rows % self.data == 0:
            return None
        return (
            f"batch_size: {rows} rows a call cannot be split over {self.data} devices (backend jax splits each "
            f"call's rows over the mesh's data axis); set it to a multiple of {self.data}"
        )

    def memory(self) -> dict | None:
        stats = self.runtime.jax.devices()[0].memory_stats()
        if not stats:
            return None
        return {"bytes_in_use": stats.get("bytes_in_use"), "peak_bytes_in_use": stats.get("peak_bytes_in_use")}

    def describe(self) -> dict:
        jax = self.runtime.jax
        tally = self.runtime.reading()
        return {
            "backend": self.name,
            "device": str(jax.devices()[0]),
            "device_kind": self.runtime.device_kind(),
            "world_size": 1,
            "devices": self.device_count,
            **({"mesh": dict(self.mesh.shape)} if self.mesh is not None else {}),
            **({"sharding": self.sharding} if self.sharding is not None else {}),
            "attention": self._attention_summary(),
            "jax": jax.__version__,
            "torchax": getattr(self.runtime.torchax, "__version__", None),
            "compile_cache": {
                **self.cache,
                # this process's, warmup's among them: programs read whole from the store (neither traced nor
                # compiled), and stored ones that could not be read (traced and compiled again)
                "whole_programs_read_back": tally.stored_loads if self.cache["whole_programs"] else None,
                "whole_programs_unreadable": tally.load_failures if self.cache["whole_programs"] else None,
            },
            "weights_on_device_bytes": sum(m.bytes for m in [*self.modules.values(), *self.beside.values()]),
            "counters_scope": "JAX's own compile and persistent-cache events, the whole programs tpugen read from its "
            "store (counted as cache hits), tpugen's calls and reads of its JAX programs; process-wide"
            + (
                f": one program over the {self.device_count} devices of a mesh, counted once"
                if self.mesh is not None
                else ", one device in this process"
            ),
        }

    def _kernel_off(self) -> None:
        """Plain attention from now on: the kernel gone, and every program traced with it forgotten."""
        self.runtime.kernel = None
        self._loops._programs.clear()
        self._decoders.clear()
        for module in [*self.modules.values(), *self.beside.values()]:
            module._jitted.clear()

    def _attention_summary(self) -> dict:
        """Which attention the programs traced: JAX's Pallas flash-attention kernel (how many attention calls took
        it, how many ran plain), or plain attention alone."""
        kernel = self.runtime.kernel
        if kernel is None:
            return {"kernel": None}
        return {
            "kernel": "pallas flash_attention" + (" (interpret mode)" if kernel.interpret else ""),
            "calls_traced_with_kernel": kernel.traced_kernel,
            "calls_traced_plain": kernel.traced_plain,
        }

    def bind_thread(self) -> None:
        """JAX needs nothing per thread."""

    def sync(self) -> None:
        """Nothing to cut: JAX runs what it is handed."""
