"""LoRAs fused into the weights with diffusers' own loaders, on the host: the compiled graphs stay the base model's,
and a warm engine switches LoRAs by putting new weight tensors on the device, which compiles nothing."""

from __future__ import annotations

import contextlib
import copy
import io
import json
from collections.abc import Callable, Sequence
from pathlib import Path

from tpugen.config.loras import Lora, safetensors_header
from tpugen.engine.pipeline import LOADER_LOCK
from tpugen.errors import InputError
from tpugen.families import FAMILIES

# Cross-attention widths of the UNet families, which a LoRA's attn2.to_k input width gives away.
_CROSS_ATTENTION = {768: "Stable Diffusion 1.x", 1024: "Stable Diffusion 2.x", 2048: "Stable Diffusion XL"}
# The keys a LoRA's factors end in once diffusers has converted them to PEFT's names.
_FACTORS = (".lora_A.weight", ".lora_B.weight", ".lora_B.bias", ".lora_magnitude_vector")

Shapes = dict[str, dict[str, tuple[int, ...]]]  # component -> parameter name -> shape
Key = tuple[str, str]  # (component, parameter name)


def fusing_order(loras: Sequence[Lora]) -> list[Lora]:
    """The order LoRAs are fused in: by content and scale, so one set gives the same bits in any order."""
    return sorted(loras, key=lambda lora: (lora.sha256, lora.scale))


def loadable_components(pipeline_class) -> list[str]:
    """The components diffusers' loader for this pipeline class puts LoRAs into ([] for a class without one)."""
    if not hasattr(pipeline_class, "load_lora_weights"):
        return []
    return list(getattr(pipeline_class, "_lora_loadable_modules", []))


# ---------------------------------------------------------------- does a LoRA fit the model (no weights read)


def file_shapes(model_dir: Path, components: list[str], variant: str | None) -> Shapes:
    """Each component's parameter shapes, from its safetensors headers alone (a component without them is left out)."""
    from tpugen.memory import component_files

    files = component_files(model_dir, variant)
    shapes: Shapes = {}
    for name in components:
        headers = [safetensors_header(path) for path in files.get(name, [])]
        if headers and all(h is not None for h in headers):
            shapes[name] = {k: tuple(v["shape"]) for h in headers for k, v in h.items() if k != "__metadata__"}
    return shapes


def module_shapes(pipe, components: list[str]) -> Shapes:
    return {
        name: {k: tuple(p.shape) for k, p in getattr(pipe, name).named_parameters()}
        for name in components
        if getattr(pipe, name, None) is not None
    }


def _factors(pipeline_class, lora: Lora, unet_config) -> dict[str, dict[str, object]]:
    """The LoRA's tensors as diffusers' loaders read them, per component prefix, in PEFT's names."""
    import torch
    from diffusers.utils import (
        convert_state_dict_to_diffusers,
        convert_state_dict_to_peft,
        convert_unet_state_dict_to_peft,
    )

    options = (
        {"unet_config": unet_config}
        if unet_config is not None and "unet" in loadable_components(pipeline_class)
        else {}
    )
    with contextlib.redirect_stdout(io.StringIO()), torch.no_grad():
        read = pipeline_class.lora_state_dict(lora.path, **options)
    state = read[0] if isinstance(read, tuple) else read
    parts: dict[str, dict[str, object]] = {"": {}}
    for key, value in state.items():
        prefix = next((p for p in loadable_components(pipeline_class) if key.startswith(p + ".")), "")
        parts.setdefault(prefix, {})[key.removeprefix(prefix + ".") if prefix else key] = value
    for prefix, part in parts.items():
        if not prefix or not part:
            continue
        if prefix.startswith("text_encoder"):
            part = convert_state_dict_to_peft(convert_state_dict_to_diffusers(part))
        elif not any("lora_A" in key for key in part):
            part = convert_unet_state_dict_to_peft(part)
        parts[prefix] = part
    return parts


def check_fit(
    lora: Lora, where: str, pipeline_class, shapes: Shapes, family: str, model: str, unet_config=None
) -> None:
    """Refuse, in one line, a LoRA whose modules are not the model's or have other widths (a LoRA for another
    architecture), or that carries whole weights rather than LoRA factors. Only components in `shapes` are
    checked; the LoRA file is read, the model's weights are not."""
    components = loadable_components(pipeline_class)
    try:
        parts = _factors(pipeline_class, lora, unet_config)
    except Exception as exc:  # diffusers cannot read it: one line naming the LoRA
        message = (str(exc).strip().split("\n") or [type(exc).__name__])[0]
        raise InputError(f"{where}.id: diffusers cannot read {lora.name!r} as a LoRA: {message}") from None
    title = FAMILIES[family].title
    stray = list(parts.get("", {}))
    if stray:
        raise InputError(
            f"{where}.id: {lora.name!r}: {len(stray)} of its tensors are for no component this pipeline loads LoRAs "
            f"into ({', '.join(components)}), e.g. {stray[0]}; it is not a LoRA for {model}"
        )
    if not any(parts.values()):
        # Some converters drop the keys they do not know (FLUX.2's kohya one: a whole SD 1.x file), leaving nothing
        # to load, which diffusers' fuse_lora would only refuse later with a message about its own arguments.
        raise InputError(
            f"{where}.id: {lora.name!r}: diffusers' {pipeline_class.__name__} loader reads none of its tensors as "
            f"LoRA factors for the {' or '.join(components)}; it is not a LoRA for {model} ({title})"
        )
    missing, wrong, whole, total = [], [], [], 0
    for component, part in parts.items():
        if not component or component not in shapes:
            continue
        weights = shapes[component]
        flat = not any(name.startswith("text_model.") for name in weights)  # transformers 5 flattened CLIP
        modules: dict[str, dict[str, tuple]] = {}
        for key, value in part.items():
            key = key.removeprefix("text_model.") if flat else key
            factor = next((f for f in _FACTORS if key.endswith(f)), None)
            if factor is None:
                whole.append(f"{component}.{key}")
                continue
            modules.setdefault(key.removesuffix(factor), {})[factor] = tuple(value.shape)
        for module, factors in modules.items():
            total += 1
            weight = weights.get(f"{module}.weight")
            if weight is None:
                missing.append(f"{component}.{module}")
                continue
            down, up = factors.get(".lora_A.weight"), factors.get(".lora_B.weight")
            if (down and (down[1] != weight[1] or tuple(down[2:]) not in ((), tuple(weight[2:])))) or (
                up and up[0] != weight[0]
            ):
                wrong.append((f"{component}.{module}", down, up, weight))
    if whole:
        raise InputError(
            f"{where}.id: {lora.name!r} carries {len(whole)} whole tensors, not LoRA factors (e.g. {whole[0]}); "
            "tpugen fuses lora_A/lora_B (kohya lora_down/lora_up) factors only"
        )
    if missing:
        raise InputError(
            f"{where}.id: {lora.name!r}: {len(missing)} of its {total} modules match no module of {model} "
            f"(e.g. {missing[0]}); it is a LoRA for another model"
        )
    if wrong:
        name, down, up, weight = next((w for w in wrong if w[0].endswith("attn2.to_k")), wrong[0])
        lora_width = f"{down[1] if down else '?'} -> {up[0] if up else '?'}"
        hint = ""
        if name.endswith("attn2.to_k") and down:
            theirs = _CROSS_ATTENTION.get(down[1], f"a model with cross-attention width {down[1]}")
            hint = f"; its cross-attention width says {theirs}, and {model} is {title} (width {weight[1]})"
        raise InputError(
            f"{where}.id: {lora.name!r} is for another architecture than {model} ({title}): {len(wrong)} of its "
            f"{total} modules have other widths (e.g. {name}: {lora_width} in the LoRA, {weight[1]} -> {weight[0]} "
            f"in the model){hint}"
        )


def unet_config_of(model_dir: Path | None):
    """The UNet's config from its config.json (SDXL's kohya LoRAs name blocks by it), or None."""
    if model_dir is None or not (model_dir / "unet" / "config.json").is_file():
        return None
    from diffusers.configuration_utils import FrozenDict

    return FrozenDict(json.loads((model_dir / "unet" / "config.json").read_text()))


# ---------------------------------------------------------------- fusing


def _stub(tensor):
    """A tensor of `tensor`'s shape, dtype and device (the host) that holds one element: what the loaders need
    of a weight they do not touch."""
    import torch
    from torch import nn

    stub = torch.empty((), dtype=tensor.dtype).expand(tensor.shape)
    return nn.Parameter(stub, requires_grad=False) if isinstance(tensor, nn.Parameter) else stub


class LoraWeights:
    """What LoRAs change in a pipeline, for fusing and switching them.

    diffusers' loaders need the pipeline's modules on the host, and the live ones are on the device. So the
    LoRA-capable components (the denoiser, the text encoders) get a weightless twin at load time: the same
    modules, every tensor a one-element stub. A LoRA is loaded into the twin (load_lora_weights), the modules it
    wraps get real weights (copies of the base weights), it is fused (fuse_lora) and unloaded
    (unload_lora_weights), and what it fused is read out. The base values of every tensor any LoRA has changed
    are kept on the host, and only those: restoring them is a copy, never a subtraction (which drifts).
    """

    def __init__(self, pipe) -> None:
        from torch import nn

        self.pipe = pipe  # the live pipeline, on the host now and on the device once placed
        self.components = [c for c in loadable_components(type(pipe)) if isinstance(getattr(pipe, c, None), nn.Module)]
        self.twins = {}
        for name in self.components:
            module = getattr(pipe, name)
            tensors = [*module.parameters(), *module.buffers()]
            self.twins[name] = copy.deepcopy(module, {id(t): _stub(t) for t in tensors})
        # The twin pipeline the loaders run on: the twins, no other module (nothing of the live pipeline is touched,
        # not even its offload hooks), and the live pipeline's config, which the loaders only read.
        self._view = copy.copy(pipe)
        for name, component in pipe.components.items():
            if isinstance(component, nn.Module):
                self._view.__dict__[name] = self.twins.get(name)
        self.base: dict[Key, object] = {}  # host copies of the base values of every tensor a LoRA has changed
        self.changed: set[Key] = set()  # tensors whose live value is not the base one now

    def host_copy_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.base.values())

    def shapes(self) -> Shapes:
        return module_shapes(self._view, self.components)

    def _live(self) -> dict[str, dict]:
        return {name: dict(getattr(self.pipe, name).named_parameters()) for name in self.components}

    def _base_value(self, key: Key, live: dict):
        """The base value of one tensor, kept from now on: the live tensor itself while it is on the host (it is
        about to be replaced, not changed), else read back from the device (it is still the base value there)."""
        if key not in self.base:
            tensor = live[key[0]][key[1]].detach()
            self.base[key] = tensor if tensor.device.type == "cpu" else tensor.to("cpu")
        return self.base[key]

    def fuse(self, loras: Sequence[Lora]) -> dict[Key, object]:
        """The host values of every tensor `loras` change, each LoRA fused on top of the last at its scale."""
        import torch

        live, working = self._live(), {}
        with LOADER_LOCK, torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
            for number, lora in enumerate(fusing_order(loras)):
                self._fuse_one(lora, f"tpugen_{number}", working, live)
        return {key: value for key, value in working.items() if not torch.equal(value, self._base_value(key, live))}

    def _fuse_one(self, lora: Lora, adapter: str, working: dict, live: dict) -> None:
        """One LoRA through diffusers' loaders on the twins, into `working` (key -> the value fused so far). The
        twins come out as they went in, a failure included: no adapter layer, every weight a stub again."""
        from peft.tuners.tuners_utils import BaseTunerLayer
        from torch import nn

        view = copy.copy(self._view)  # the loaders keep per-pipeline notes (fused adapter names)
        wrapped = []  # (key, the base layer, its parameter name, the stub to put back)
        try:
            try:
                view.load_lora_weights(lora.path, adapter_name=adapter)
            except Exception as exc:  # what check_fit cannot see: one line naming the LoRA
                raise InputError(f"model.loras: diffusers could not load {lora.name!r}: {_first(exc)}") from None
            for component in self.components:
                for module_name, module in self.twins[component].named_modules():
                    if not isinstance(module, BaseTunerLayer):
                        continue
                    layer = module.get_base_layer()
                    for name, stub in list(layer._parameters.items()):
                        if stub is None:
                            continue
                        key = (component, f"{module_name}.{name}")
                        if key not in working:
                            working[key] = self._base_value(key, live).clone()
                        layer._parameters[name] = nn.Parameter(working[key], requires_grad=False)
                        wrapped.append((key, layer, name, stub))
            components = [c for c in self.components if any(k[0] == c for k, *_ in wrapped)]
            if not components:  # what check_fit refuses, should a LoRA reach here without it
                raise InputError(f"model.loras: {lora.name!r} puts LoRA layers on no module of the model")
            try:
                view.fuse_lora(components=components, lora_scale=lora.scale, safe_fusing=True, adapter_names=[adapter])
            except ValueError as exc:  # safe fusing found infinities or NaN
                raise InputError(f"model.loras: fusing {lora.name!r} gives non-finite weights: {_first(exc)}") from None
            for key, layer, name, _ in wrapped:
                working[key] = layer._parameters[name].data  # a safe merge assigns a new tensor
        finally:
            view.unload_lora_weights()
            for _, layer, name, stub in wrapped:
                layer._parameters[name] = stub

    def fuse_on_host(self, loras: Sequence[Lora]) -> None:
        """Fuse `loras` into the live pipeline while it is on the host, before it moves to the device."""
        fused = self.fuse(loras)
        live = self._live()
        for (component, name), value in fused.items():
            live[component][name].data = value
        self.changed = set(fused)

    def switch(self, loras: Sequence[Lora], put: Callable) -> int:
        """The live weights become the base ones with `loras` fused: every tensor the last set or this one
        changes gets a new device tensor, `put(component, name, live tensor, host value)`, assigned as its data
        (in-place arithmetic on the device would be a graph to compile). Returns how many tensors moved."""
        fused = self.fuse(loras)
        live = self._live()
        moved = self.changed | set(fused)
        self.changed = moved  # until every tensor is in place: a switch that fails part way is repaired by the next
        for key in sorted(moved):
            value = fused[key] if key in fused else self._base_value(key, live)
            parameter = live[key[0]][key[1]]
            parameter.data = put(key[0], key[1], parameter, value)
        self.changed = set(fused)
        return len(moved)


def _first(exc: BaseException) -> str:
    return (str(exc).strip().split("\n") or [type(exc).__name__])[0] or type(exc).__name__
