"""torch_xla SPMD: one process drives every local device as a (data, model) mesh, big weights split over it."""

from __future__ import annotations

from tpugen.backends.xla.devices import import_torch_xla, use_devices
from tpugen.backends.xla.single import XlaBackend
from tpugen.errors import InputError
from tpugen.sharding import mesh_shape, plan_sharding


class SpmdBackend(XlaBackend):
    """torch_xla SPMD: one process drives every local device as a (data, model) mesh.

    The denoiser's large linear layers (and big text encoders) are split over the model axis by the rule
    tables in tpugen.sharding; a batch is split over the data axis. XLA inserts the communication, so the
    images are those of one device, up to the order of floating-point sums.
    """

    spmd = True

    def __init__(self, cache_enabled: bool | str, cache_dir: str | None, *, data: int, model: int, cores: int) -> None:
        use_devices(cores, "SPMD")
        # Before the compile cache and the first tensor: SPMD replaces the devices with one virtual device.
        import_torch_xla().runtime.use_spmd()
        super().__init__(cache_enabled, cache_dir)
        xr = self._xr
        if xr.process_count() > 1:
            raise InputError(
                "execution.sharding: spmd over a pod's hosts is not built; each pod worker runs its own mesh "
                "only when the runtime is per worker"
            )
        import numpy as np
        import torch_xla.distributed.spmd as xs

        self.device_count = xr.global_runtime_device_count()
        self.data, self.model = mesh_shape(data, model, self.device_count)
        self._xs = xs
        self.mesh = xs.Mesh(np.arange(self.device_count), (self.data, self.model), ("data", "model"))
        self.sharding: dict | None = None

    def place(self, pipe, *, offload: bool, family) -> None:
        from torch import nn

        # From names and shapes, while the weights are on the host.
        plan = plan_sharding(pipe, self.model, {**family.text_encoder_rules, **family.denoiser_rules})
        specs = {(p.component, p.parameter): p.spec for p in plan.parameters}
        self._specs = specs  # a weight replaced later (a LoRA switch) is split the same way
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
            "devices": self.device_count,
            "split_tensors": len(plan.parameters),
            "split_tensors_verified": verified,
            "components": plan.components,
        }

    def flash_partition_spec(self, pipe, route) -> tuple | None:
        """Each chip attends over its own batch rows (data axis) and heads (model axis)."""
        if not route.takes_partition_spec:
            return None
        from tpugen.backends.xla.flash import attention_heads, flash_partition_spec

        # The kernel's shard_map takes its mesh from here (diffusers passes it none).
        self._xs.set_global_mesh(self.mesh)
        heads = set().union(*(attention_heads(getattr(pipe, name)) for name in route.components))
        return flash_partition_spec(self.data, self.model, heads)

    def memory(self) -> dict:
        return {"unavailable": "torch_xla reports no memory for the SPMD virtual device"}

    def put_weight(self, component: str, name: str, live, host):
        tensor = host.to(self.device)
        spec = self._specs.get((component, name))
        if spec is not None:
            self._xs.mark_sharding(tensor, self.mesh, spec)
        return tensor

    def split_batch(self, tensor):
        if self.data > 1:
            self._xs.mark_sharding(tensor, self.mesh, ("data",) + (None,) * (tensor.dim() - 1))
        return tensor

    def describe(self) -> dict:
        return {**super().describe(), "devices": self.device_count, "sharding": self.sharding}
