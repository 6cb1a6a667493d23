"""Whole components on different local devices of one process (execution.placement), no SPMD."""

from __future__ import annotations

from tpugen.backends.xla.devices import use_devices
from tpugen.backends.xla.single import XlaBackend


def move(value, device):
    """Tensors anywhere in an argument or output (tuples, lists, dicts, model outputs) moved to `device`."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):  # transformers' ModelOutput is a dict too, and keeps its type this way
        for key in list(value.keys()):
            value[key] = move(value[key], device)
        return value
    if isinstance(value, (tuple, list)):
        moved = [move(v, device) for v in value]
        return type(value)(moved) if not hasattr(value, "_fields") else type(value)(*moved)
    return value


class PlacedBackend(XlaBackend):
    """Each component's inputs move to its device as it is called and its outputs come back to the denoiser's
    device, where the pipeline itself runs; the moves go through the host, once per call of that component.
    """

    placed = True

    def __init__(self, cache_enabled: bool | str, cache_dir: str | None, *, cores: int) -> None:
        use_devices(cores, "placement")
        super().__init__(cache_enabled, cache_dir)
        self.devices = [self._torch_xla.device(i) for i in range(self._xr.addressable_device_count())]
        self.device_count = len(self.devices)
        self.assignment: dict[str, int] = {}

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

    def place(self, pipe, *, offload: bool, family) -> None:
        from torch import nn

        main = self.device
        self._moves = []
        for name, component in pipe.components.items():
            if not isinstance(component, nn.Module):
                continue
            device = self.devices[self.assignment.get(name, self.devices.index(main))]
            component.to(device)
            if device == main:
                continue

            def inputs_here(module, args, kwargs, device=device):
                return move(args, device), move(kwargs, device)

            def outputs_back(module, args, kwargs, output):
                return move(output, main)

            self._moves.append(component.register_forward_pre_hook(inputs_here, with_kwargs=True))
            self._moves.append(component.register_forward_hook(outputs_back, with_kwargs=True))

    def prepare_on_device(self, pipe, family, compile_config, hooks) -> None:
        moves = self._moves
        hooks.add("inputs to each component's device", lambda: [handle.remove() for handle in moves])
        super().prepare_on_device(pipe, family, compile_config, hooks)

    def describe(self) -> dict:
        return {
            **super().describe(),
            "devices": len(self.devices),
            "placement": {name: str(self.devices[i]) for name, i in self.assignment.items()},
        }
