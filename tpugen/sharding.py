"""Which weights SPMD splits over the model axis of a device mesh: rule tables per architecture, as data."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from tpugen.errors import InputError

# A linear layer's weight is (out_features, in_features). Column-wise splits the outputs (and the bias with
# them) over the model axis; row-wise splits the inputs. Attention projections and the first MLP layer go
# column-wise, the layer after them row-wise, so each pair needs one reduction instead of a gather per layer.
COLUMN, ROW = "column", "row"

ATTENTION = [
    (r"(^|\.)attn\d?\.(to_q|to_k|to_v|add_q_proj|add_k_proj|add_v_proj)$", COLUMN),
    (r"(^|\.)attn\d?\.(to_out\.0|to_add_out)$", ROW),
]
FEED_FORWARD = [
    (r"(^|\.)ff(_context)?\.net\.0\.proj$", COLUMN),
    (r"(^|\.)ff(_context)?\.net\.2$", ROW),
]
# The adaptive layer norms of the DiT blocks: one wide projection each (6 x width in Flux.1: 113 M weights).
ADALN = [(r"(^|\.)norm1(_context)?\.linear$", COLUMN)]
_CLIP = [
    (r"self_attn\.(q_proj|k_proj|v_proj)$", COLUMN),
    (r"self_attn\.out_proj$", ROW),
    (r"mlp\.fc1$", COLUMN),
    (r"mlp\.fc2$", ROW),
]
_T5 = [
    (r"SelfAttention\.(q|k|v)$", COLUMN),
    (r"SelfAttention\.o$", ROW),
    (r"DenseReluDense\.(wi|wi_0|wi_1)$", COLUMN),
    (r"DenseReluDense\.wo$", ROW),
]
# The decoder language models the 2026 families read text with (Qwen3, Qwen2.5-VL, Mistral 3): the vision towers
# some of them carry have other names, and stay whole.
_DECODER = [
    (r"self_attn\.(q_proj|k_proj|v_proj)$", COLUMN),
    (r"self_attn\.o_proj$", ROW),
    (r"mlp\.(gate_proj|up_proj)$", COLUMN),
    (r"mlp\.down_proj$", ROW),
]
# The text encoders several families share; each family's folder has its denoiser's table.
TEXT_ENCODER_RULES: dict[str, list[tuple[str, str]]] = {
    "CLIPTextModel": _CLIP,
    "CLIPTextModelWithProjection": _CLIP,
    "T5EncoderModel": _T5,
    "Qwen3Model": _DECODER,
    "Qwen3ForCausalLM": _DECODER,
    "Qwen2_5_VLForConditionalGeneration": _DECODER,
    "Mistral3ForConditionalGeneration": _DECODER,
}

DENOISERS = ("unet", "transformer")
# Text encoders below this size are copied whole to every device: splitting a small encoder costs more in
# communication than it saves (T5-XXL, 9.5 GB in bfloat16, is split; CLIP, under 1.4 GB, is not).
TEXT_ENCODER_SHARD_BYTES = 2 << 30


@dataclass(frozen=True)
class ParameterSharding:
    """One weight split over the model axis: its component, its name there, and its partition spec."""

    component: str
    parameter: str
    spec: tuple  # one mesh axis name (or None) per dimension of the tensor


@dataclass
class ShardingPlan:
    model_axis: int
    parameters: list[ParameterSharding] = field(default_factory=list)
    components: dict[str, dict] = field(default_factory=dict)  # what happened to each component, and why


def _rule_for(rules: list[tuple[str, str]], module_name: str) -> str | None:
    for pattern, how in rules:
        if re.search(pattern, module_name):
            return how
    return None


def _linear_specs(how: str, weight_shape: tuple, has_bias: bool, model_axis: int, leading: int) -> dict | None:
    """Partition specs for a linear layer's weight (and bias), or None if the split dimension is uneven."""
    dim = 0 if how == COLUMN else 1
    if weight_shape[leading + dim] % model_axis:
        return None
    lead = (None,) * leading  # stacked block weights (scan_blocks) carry a layer dimension in front
    specs = {"weight": lead + (("model", None) if how == COLUMN else (None, "model"))}
    if has_bias and how == COLUMN:
        specs["bias"] = lead + ("model",)
    return specs


def plan_sharding(
    pipe, model_axis: int, denoiser_rules: dict[str, list], *, text_encoder_shard_bytes: int | None = None
) -> ShardingPlan:
    """Decide, from module names and shapes alone, which weights of a pipeline to split over the model axis.

    Denoisers are split by their architecture's rule table; text encoders only from a size up; the VAE and
    everything else is replicated. A layer whose split dimension does not divide by the axis is replicated.
    """
    from torch import nn

    if text_encoder_shard_bytes is None:
        text_encoder_shard_bytes = TEXT_ENCODER_SHARD_BYTES
    plan = ShardingPlan(model_axis)
    for name, component in sorted(pipe.components.items()):
        if not isinstance(component, nn.Module):
            continue
        size = sum(p.numel() * p.element_size() for p in component.parameters())
        architecture = type(component).__name__
        rules = {**TEXT_ENCODER_RULES, **denoiser_rules}.get(architecture)
        summary = {"architecture": architecture, "bytes": size, "split_layers": 0, "uneven_layers": 0}
        plan.components[name] = summary
        if model_axis <= 1:
            summary["decision"] = "replicated (model axis 1)"
            continue
        if name.startswith("text_encoder") and size < text_encoder_shard_bytes:
            summary["decision"] = f"replicated (under {text_encoder_shard_bytes / 2**30:g} GiB)"
            continue
        if name not in DENOISERS and not name.startswith("text_encoder"):
            summary["decision"] = "replicated"
            continue
        if rules is None:
            summary["decision"] = f"replicated (no rule table for {architecture})"
            continue
        templates: list[str] = []  # the template block of a scanned stack runs with the stacked weights only
        for module_name, module in component.named_modules():
            if any(module_name.startswith(t) for t in templates):
                continue
            if hasattr(module, "stacked_0"):
                templates.append(f"{module_name}.template")
            for parameter_prefix, rule_name, weight, bias, leading in _linear_layers(module_name, module):
                how = _rule_for(rules, rule_name)
                if how is None:
                    continue
                specs = _linear_specs(how, tuple(weight.shape), bias is not None, model_axis, leading)
                if specs is None:
                    summary["uneven_layers"] += 1
                    continue
                summary["split_layers"] += 1
                for kind, spec in specs.items():
                    plan.parameters.append(ParameterSharding(name, parameter_prefix[kind], spec))
        summary["decision"] = f"split over the model axis by the {architecture} rules"
    return plan


def _linear_layers(module_name: str, module):
    """(parameter names, name to match rules against, weight, bias, leading dims) for each linear layer here.

    A plain nn.Linear is itself; a scanned stack of blocks (compile.scan_blocks) holds each block parameter
    stacked, and is matched as if it were block 0, so the same rules apply with a layer dimension in front.
    """
    from torch import nn

    if isinstance(module, nn.Linear):
        prefix = f"{module_name}." if module_name else ""
        names = {"weight": f"{prefix}weight", "bias": f"{prefix}bias"}
        yield names, module_name, module.weight, module.bias, 0
        return
    stacked_names = getattr(module, "names", None)
    if not (isinstance(stacked_names, list) and hasattr(module, "stacked_0")):
        return
    # module_name is e.g. "transformer_blocks.0"; its template's layers are matched as block 0's layers
    owner = module_name.rsplit(".", 1)[0]
    index = {name: i for i, name in enumerate(stacked_names)}
    for parameter in stacked_names:
        layer, kind = parameter.rsplit(".", 1)
        if kind != "weight":
            continue
        weight = getattr(module, f"stacked_{index[parameter]}")
        if weight.dim() != 3:
            continue
        bias_name = f"{layer}.bias"
        bias = getattr(module, f"stacked_{index[bias_name]}") if bias_name in index else None
        names = {
            "weight": f"{module_name}.stacked_{index[parameter]}",
            "bias": f"{module_name}.stacked_{index[bias_name]}" if bias is not None else None,
        }
        yield names, f"{owner}.0.{layer}", weight, bias, 1


def mesh_shape(data: int, model: int, devices: int) -> tuple[int, int]:
    """(data, model) axes of a mesh over `devices`; model 0 means every device the data axis leaves."""
    if devices % data:
        raise InputError(f"execution.mesh.data: {data} does not divide the {devices} devices of this machine")
    model = model or devices // data
    if data * model != devices:
        raise InputError(
            f"execution.mesh: data {data} x model {model} = {data * model} devices, but this machine has {devices}; "
            "the mesh must cover every device (model: 0 takes the rest)"
        )
    return data, model
