"""A batch's whole denoising loop as one call, on a backend that runs loops (JAX).

diffusers' pipeline runs as written up to its loop: prompts encoded (the text encoders on the device), latents
and timesteps set up, an init image encoded and noised. At the denoiser's first call the pipeline is stopped, and
what it was about to do is read off that call and the pipeline's own variables: the latents, the timesteps, the
scheduler as it stands, the text embeddings and every other argument the denoiser takes. The family says how its
pipeline calls the denoiser at each step (Family.loop_call); that is checked against the call seen. The
scheduler's steps become a linear recurrence (tpugen.engine.linear_schedule), and the backend runs all of it,
every step, as one compiled call. Where any of that cannot hold, the pipeline runs again step by step with the
denoiser on the device, and the reason is said once.
"""

from __future__ import annotations

import copy
import json
import math
import sys
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from tpugen.engine.linear_schedule import DRAW_SLOTS, LinearSchedule, NotLinear, derive, noise_like

NOISING = ("add_noise", "scale_noise")  # how a scheduler noises an image: DDPM-style, or flow matching's


class FirstCall(Exception):
    """The pipeline reached its denoiser: the call's arguments and the pipeline's own variables at that point, and
    the call it made of its ControlNet before (`control`: (args, kwargs, output), or None)."""

    def __init__(self, args: tuple, kwargs: dict, variables: dict, control: tuple | None = None) -> None:
        super().__init__("the denoising loop was reached")
        self.args, self.kwargs, self.variables, self.control = args, kwargs, variables, control


@contextmanager
def stopped_at_first_call(pipe, denoiser):
    """Calling `pipe` raises FirstCall where it first calls `denoiser`, with the first call it made of its
    `controlnet` (a ControlNet pipeline's, one or several) before that."""
    import torch

    control: list = []

    def hook(module, args, kwargs):
        raise FirstCall(args, kwargs, _pipeline_variables(pipe), control[0] if control else None)

    def control_seen(module, args, kwargs, output):
        if not control:
            control.append((args, kwargs, output))

    handles = [denoiser.register_forward_pre_hook(hook, with_kwargs=True)]
    controlnet = getattr(pipe, "controlnet", None)
    if isinstance(controlnet, torch.nn.Module):
        handles.append(controlnet.register_forward_hook(control_seen, with_kwargs=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _pipeline_variables(pipe) -> dict:
    """The local variables of `pipe.__call__` as it calls its denoiser (the frame whose `self` is the pipeline)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "__call__" and frame.f_locals.get("self") is pipe:
            return dict(frame.f_locals)
        frame = frame.f_back
    return {}


@dataclass(frozen=True)
class ControlCall:
    """How the pipeline calls its ControlNet (one, or several as diffusers' multi-ControlNet) before the denoiser at
    each step, read off its first step: the latents the loop forms and the denoiser's timestep (where the
    ControlNet takes them), each ControlNet's conditioning scale for the call (the unit's scale, or 0 outside its
    start and end: numbers per call), and which of the denoiser's arguments take which of its outputs."""

    sample: int | str
    timestep: int | str
    scales: int  # how many ControlNets (conditioning_scale a list of that many where the pipeline gave a list)
    listed: bool
    # (the denoiser's keyword, the index of the ControlNet's output it takes; None: the whole output)
    outputs: tuple[tuple[str, int | None], ...]

    def residuals(self, control, rows, timestep, per_call: dict, inputs: dict) -> dict:
        """The denoiser's keyword arguments the ControlNet gives at this call."""
        args, kwargs = list(inputs["control_args"]), dict(inputs["control_kwargs"])
        _put(args, kwargs, self.sample, rows)
        _put(args, kwargs, self.timestep, timestep)
        scales = [per_call[f"control_scale_{n}"].to(rows.dtype) for n in range(self.scales)]
        kwargs["conditioning_scale"] = scales if self.listed else scales[0]
        out = control(*args, **kwargs)
        return {name: out if index is None else out[index] for name, index in self.outputs}


@dataclass(frozen=True)
class DenoiserLoop:
    """One step's model call as the pipeline makes it (the family's LoopCall, read against the call seen), in
    torch code the backend traces: the latents doubled for CFG and scaled as the scheduler scales them, cast as
    the pipeline casts them, what the pipeline joins to them (an inpainting model's mask and masked image), the
    timestep in the form the denoiser takes, CFG's second half or second call combined with the first; and, for a
    model that inpaints by blending, the blend after each update."""

    sample: int | str
    timestep: int | str
    timestep_rows: bool
    timestep_divisor: float
    scales_input: bool
    cfg: str  # "batch", "calls" or "none": how this batch runs CFG (none where the pipeline does not)
    cfg_by_call: tuple[str, ...]  # the arguments CFG's second call takes from inputs["negative"]
    cfg_rescale: str | None
    appendix_dim: int | None
    blends: bool
    method: str = "forward"  # the denoiser's method each step calls
    control: ControlCall | None = None  # the ControlNet's call before the denoiser's (None: no ControlNet)

    @property
    def key(self) -> tuple:
        return ("denoiser", *(getattr(self, name) for name in self.__dataclass_fields__))

    def model_output(self, denoise, x, t, scale, guidance, inputs: dict, per_call: dict, control=None):
        """The step's model output at the latents `x` and timestep `t`; `control` calls the pipeline's ControlNet
        (traced beside the denoiser) where the body has one."""
        import torch

        rows = torch.cat([x, x]) if self.cfg == "batch" else x
        if self.scales_input:
            rows = rows * scale.to(rows.dtype)
        rows = rows.to(inputs["sample_dtype"])
        timestep = self.timestep_of(t, rows.shape[0], inputs["timestep_dtype"])
        args, kwargs = list(inputs["args"]), dict(inputs["kwargs"])
        if self.control is not None:  # the ControlNet takes the latents before an inpainting UNet's appendix
            kwargs.update(self.control.residuals(control, rows, timestep, per_call, inputs))
        if self.appendix_dim is not None:
            rows = torch.cat([rows, inputs["appendix"]], dim=self.appendix_dim)
        _put(args, kwargs, self.sample, rows)
        _put(args, kwargs, self.timestep, timestep)
        out = self._trimmed(denoise(*args, **kwargs), x)
        if self.cfg == "batch":
            uncond, out = out.chunk(2)
        elif self.cfg == "calls":
            uncond = self._trimmed(denoise(*args, **{**kwargs, **inputs["negative"]}), x)
        else:
            return out
        combined = uncond + guidance.to(out.dtype) * (out - uncond)
        if self.cfg_rescale == "norm":
            combined = combined * (torch.norm(out, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True))
        return combined

    def _trimmed(self, out, x):
        """The denoiser's prediction for the latents alone (a model given more tokens than the latents, its
        references', answers for them too)."""
        out = out[0] if isinstance(out, (tuple, list)) else out.sample
        dim = self.appendix_dim
        if dim is not None and dim != 0 and out.shape[dim] > x.shape[dim]:
            out = out.narrow(dim, 0, x.shape[dim])
        return out

    def timestep_of(self, t, rows: int, dtype):
        """The denoiser's timestep argument at timestep `t`, as the pipeline forms it."""
        t = t.to(dtype)
        if self.timestep_rows:
            t = t.expand(rows)
        return t / self.timestep_divisor if self.timestep_divisor != 1.0 else t

    def after_update(self, x, per_call: dict, inputs: dict):
        """An inpainting pipeline's blend: outside the mask, the init image noised to the next step's level."""
        image = inputs["image_latents"]
        noise = inputs["noise"].to(image.dtype)
        proper = per_call["image_level"].to(image.dtype) * image + per_call["noise_level"].to(image.dtype) * noise
        mask = inputs["mask"]
        return (1 - mask) * proper + mask * x


def _put(args: list, kwargs: dict, where: int | str, value) -> None:
    if isinstance(where, int):
        args[where] = value
    else:
        kwargs[where] = value


def _take(args: tuple, kwargs: dict, where: int | str):
    if isinstance(where, int):
        return args[where] if where < len(args) else None
    return kwargs.get(where)


@dataclass(frozen=True, kw_only=True)
class LoopWork:
    """Everything a backend needs to run one batch's loop: the starting latents, the schedule, the noise an
    ancestral sampler adds (drawn on the host from each image's generator, as diffusers draws it), the body and its
    inputs (host tensors and plain values), numbers the body reads per call beyond the schedule's, guidance."""

    latents: Any
    schedule: LinearSchedule
    noise: Any | None
    body: DenoiserLoop
    inputs: dict
    per_call: dict = field(default_factory=dict)
    guidance: float = 1.0
    control: Any | None = None  # the pipeline's ControlNet module (one, or diffusers' multi-ControlNet) the body calls
    # Whether diffusers' step-cache hooks are on the denoiser (compile.step_cache): which of its blocks run at a
    # call depends on the call's index, so the loop is traced call by call (its calls fixed in the program).
    step_cache: bool = False


class NoWholeLoop(Exception):
    """Why this batch's loop runs step by step (one line)."""


def no_whole_loop(family) -> str | None:
    """Why a family's loop cannot be one call, known before the pipeline runs (None: it may be, once its first
    call is seen)."""
    if family.loop_call is None:
        return f"tpugen has no whole loop for {family.title} yet"
    return None


def loop_work(family, call: FirstCall, task: str, buckets) -> LoopWork:
    """The batch's LoopWork from what the pipeline showed at its denoiser's first call. `buckets(calls)`: how many
    calls of noise the backend's program takes. Raises NoWholeLoop naming why it cannot be one call."""
    import torch

    spec = family.loop_call
    variables = call.variables
    pipe = variables.get("self")
    latents, timesteps = variables.get("latents"), variables.get("timesteps")
    if pipe is None or not isinstance(latents, torch.Tensor) or timesteps is None:
        raise NoWholeLoop("the pipeline's loop did not show its latents and timesteps")
    if getattr(pipe, "guidance_rescale", 0.0):
        raise NoWholeLoop("guidance_rescale is not built into the whole loop")
    cfg = spec.cfg if spec.cfg != "none" and bool(_variable(variables, pipe, spec.cfg_flag, False)) else "none"
    guidance = float(_variable(variables, pipe, spec.cfg_scale, 1.0) or 1.0)
    try:
        custom = family.loop_body(getattr(pipe, family.denoiser), call.args, call.kwargs, variables)
    except ValueError as exc:
        raise NoWholeLoop(str(exc)) from None
    if custom is not None:
        if getattr(getattr(pipe, family.denoiser, None), "is_cache_enabled", False):
            raise NoWholeLoop(f"a step cache is not built into {family.title}'s whole loop")
        if task == "inpaint":
            raise NoWholeLoop(f"{family.title}'s inpainting is not built into the whole loop")
        if call.control is not None:
            raise NoWholeLoop(f"a ControlNet is not built into {family.title}'s whole loop")
        body, inputs = custom
        schedule = schedule_of(pipe.scheduler, timesteps)
        noise = _drawn_noise(schedule, variables.get("generator"), latents, buckets)
        return LoopWork(latents=latents, schedule=schedule, noise=noise, body=body, inputs=inputs, guidance=guidance)
    sample = _take(call.args, call.kwargs, spec.sample)
    timestep = _take(call.args, call.kwargs, spec.timestep)
    if not isinstance(sample, torch.Tensor) or not isinstance(timestep, torch.Tensor):
        raise NoWholeLoop(f"{family.title}'s denoiser was not called as tpugen's loop for it expects")
    channel = 1 if spec.sample == 0 else -1
    blends = task == "inpaint" and sample.shape[channel] == latents.shape[channel]
    schedule = schedule_of(pipe.scheduler, timesteps, spec.noising if blends else None)
    rows = torch.cat([latents, latents]) if cfg == "batch" else latents
    appendix_dim, appendix = _appendix(sample, rows)
    negative = {}
    if cfg == "calls":
        for argument, name in spec.cfg_by_call:
            negative[argument] = variables.get(name)
        if any(value is None for value in negative.values()):
            raise NoWholeLoop(f"the pipeline's loop did not show {', '.join(n for _, n in spec.cfg_by_call)}")
    body = DenoiserLoop(
        sample=spec.sample,
        timestep=spec.timestep,
        timestep_rows=spec.timestep_rows,
        timestep_divisor=spec.timestep_divisor,
        scales_input=spec.scales_input,
        cfg=cfg,
        cfg_by_call=tuple(negative),
        cfg_rescale=spec.cfg_rescale if cfg != "none" else None,
        appendix_dim=appendix_dim,
        blends=blends,
    )
    _check_first_call(body, sample, timestep, rows, schedule, appendix_dim)
    if call.control is None and isinstance(getattr(pipe, "controlnet", None), torch.nn.Module):
        raise NoWholeLoop("the ControlNet pipeline did not call its ControlNet before its denoiser")
    control = None
    if call.control is not None:
        # CFG as a second call (Qwen-Image's true CFG): its pipeline hands the conditional call's residuals to both.
        expected = rows.double() * schedule.input_scales[0] if spec.scales_input else rows.double()
        formed = body.timestep_of(torch.tensor(schedule.timesteps[0]), rows.shape[0], timestep.dtype)
        control, control_inputs, control_numbers = _control_call(family, call, variables, expected, formed, schedule)
        body = replace(body, control=control)
    args = tuple(None if i == spec.sample or i == spec.timestep else a for i, a in enumerate(call.args))
    outputs = {name for name, _ in control.outputs} if control is not None else set()
    kwargs = {k: v for k, v in call.kwargs.items() if k not in (spec.sample, spec.timestep, *outputs)}
    inputs = {
        "args": args,
        "kwargs": kwargs,
        "negative": negative,
        "timestep_dtype": timestep.dtype,
        "sample_dtype": sample.dtype,
        "appendix": appendix,
    }
    per_call = {}
    if control is not None:
        inputs.update(control_inputs)
        per_call.update(control_numbers)
    if blends:
        mask = variables.get("mask")
        if cfg and isinstance(mask, torch.Tensor) and mask.shape[0] == 2 * latents.shape[0]:
            mask = mask.chunk(2)[0]
        image_latents, noise = variables.get("image_latents"), variables.get("noise")
        if not all(isinstance(v, torch.Tensor) for v in (mask, image_latents, noise)):
            raise NoWholeLoop("the inpainting pipeline's loop did not show its mask, image latents and noise")
        inputs.update(mask=mask, image_latents=image_latents, noise=noise)
        per_call.update(image_level=schedule.image_levels, noise_level=schedule.noise_levels)
    noise = _drawn_noise(schedule, variables.get("generator"), latents, buckets)
    return LoopWork(
        latents=latents,
        schedule=schedule,
        noise=noise,
        body=body,
        inputs=inputs,
        per_call=per_call,
        guidance=guidance,
        control=variables["self"].controlnet if control is not None else None,
        step_cache=bool(getattr(getattr(pipe, family.denoiser, None), "is_cache_enabled", False)),
    )


def _control_call(family, call: FirstCall, variables: dict, expected, formed, schedule: LinearSchedule):
    """The ControlCall, its inputs and its per-call scales from the ControlNet's first call (`call.control`),
    checked against what the loop forms: its latents (`expected`, before any inpainting appendix), its timestep
    (the denoiser's, `formed`), its conditioning scale (the pipeline's scale times controlnet_keep, per call),
    and its outputs handed to the denoiser as they are. Raises NoWholeLoop naming what differs."""
    import torch

    args, kwargs, output = call.control
    parts = family.controlnet
    where_sample, where_timestep = parts.loop_sample, parts.loop_timestep
    sample, timestep = _take(args, kwargs, where_sample), _take(args, kwargs, where_timestep)
    if not isinstance(sample, torch.Tensor) or not isinstance(timestep, torch.Tensor):
        raise NoWholeLoop(f"{family.title}'s ControlNet was not called as tpugen's loop for it expects")
    scale = max(1.0, float(expected.abs().max()))
    if sample.shape != expected.shape or float((sample.double() - expected).abs().max()) > 1e-4 * scale:
        raise NoWholeLoop("the ControlNet's first input is not the latents as tpugen's loop forms them")
    if formed.shape != timestep.shape or not torch.allclose(formed.double(), timestep.double(), rtol=1e-5, atol=1e-6):
        raise NoWholeLoop("the ControlNet's first timestep is not the denoiser's")
    keep, scales = variables.get("controlnet_keep"), variables.get("controlnet_conditioning_scale")
    if not isinstance(keep, list) or len(keep) < schedule.calls or scales is None:
        raise NoWholeLoop("the ControlNet pipeline's loop did not show its controlnet_keep for every call")
    per_call = [_scales_at(keep[j], scales) for j in range(schedule.calls)]
    given = kwargs.get("conditioning_scale")
    listed = isinstance(given, (list, tuple))
    first = [float(s) for s in (given if listed else [given])]
    if len(first) != len(per_call[0]) or not all(
        math.isclose(a, b, abs_tol=1e-7) for a, b in zip(first, per_call[0], strict=True)
    ):
        raise NoWholeLoop("the ControlNet's first conditioning scale is not the pipeline's scale times its keep")
    found = {}
    outputs = output if isinstance(output, (tuple, list)) else (output,)
    for name, value in call.kwargs.items():
        if value is output:  # the whole answer (Qwen-Image's ControlNet answers its blocks' samples as a tuple)
            found[name] = None
        for index, out in enumerate(outputs):
            if out is not None and value is out:
                found[name] = index
    if None not in found.values() and len(found) != sum(out is not None for out in outputs):
        raise NoWholeLoop("the ControlNet's outputs do not reach the denoiser as they are (guess mode)")
    control = ControlCall(
        sample=where_sample,
        timestep=where_timestep,
        scales=len(per_call[0]),
        listed=listed,
        outputs=tuple(sorted(found.items(), key=lambda item: item[0])),
    )
    taken = (where_sample, where_timestep, "conditioning_scale")
    inputs = {
        "control_args": tuple(None if i in taken else a for i, a in enumerate(args)),
        "control_kwargs": {k: v for k, v in kwargs.items() if k not in taken},
    }
    numbers = {f"control_scale_{n}": tuple(call_scales[n] for call_scales in per_call) for n in range(control.scales)}
    return control, inputs, numbers


def _scales_at(keep, scales) -> list[float]:
    """Each ControlNet's conditioning scale at one call, as diffusers' ControlNet pipelines form it: the scale times
    the step's keep (0 outside a unit's start and end); one ControlNet's scale given as a list is its first."""
    if isinstance(keep, list):
        return [float(c) * float(s) for c, s in zip(scales, keep, strict=False)]
    scale = scales[0] if isinstance(scales, (list, tuple)) else scales
    return [float(scale) * float(keep)]


def _variable(variables: dict, pipe, name: str, default):
    """A pipeline's variable of its call (do_true_cfg), else its attribute (do_classifier_free_guidance)."""
    if name in variables:
        return variables[name]
    return getattr(pipe, name, default)


def _appendix(sample, rows) -> tuple[int | None, Any]:
    """What the pipeline joins to the latents before its denoiser (a 9-channel inpainting UNet's mask and
    masked image): the dimension and the joined part, or (None, None)."""
    if tuple(sample.shape) == tuple(rows.shape):
        return None, None
    for dim in range(sample.ndim):
        others = [d for d in range(sample.ndim) if d != dim]
        if sample.shape[dim] > rows.shape[dim] and all(sample.shape[d] == rows.shape[d] for d in others):
            return dim, sample.narrow(dim, rows.shape[dim], sample.shape[dim] - rows.shape[dim]).clone()
    raise NoWholeLoop(f"the denoiser was given {tuple(sample.shape)} for latents of {tuple(rows.shape)}")


def _check_first_call(body: DenoiserLoop, sample, timestep, rows, schedule: LinearSchedule, appendix_dim) -> None:
    """The family's loop, at step 0, gives the denoiser what the pipeline gave it: else a NoWholeLoop (a family
    whose LoopCall disagrees with its pipeline never runs a wrong loop)."""
    import torch

    expected = rows.double() * schedule.input_scales[0] if body.scales_input else rows.double()
    seen = sample if appendix_dim is None else sample.narrow(appendix_dim, 0, rows.shape[appendix_dim])
    scale = max(1.0, float(expected.abs().max()))
    if seen.shape != expected.shape or float((seen.double() - expected).abs().max()) > 1e-4 * scale:
        raise NoWholeLoop("the pipeline's first model input is not the latents as tpugen's loop forms it")
    t = torch.tensor(schedule.timesteps[0], dtype=torch.float32)
    formed = body.timestep_of(t, sample.shape[0] if body.timestep_rows else 1, timestep.dtype)
    if formed.shape != timestep.shape or not torch.allclose(formed.double(), timestep.double(), rtol=1e-5, atol=1e-6):
        raise NoWholeLoop("the pipeline's first timestep is not the one tpugen's loop forms")


def _drawn_noise(schedule: LinearSchedule, generators, latents, buckets):
    """The noise an ancestral sampler draws at every call, drawn now from each image's generator in diffusers'
    order (None for a sampler that draws none)."""
    import torch

    if not any(schedule.draws):
        return None
    if not isinstance(generators, list):
        generators = [generators]
    noise = torch.zeros((buckets(schedule.calls), DRAW_SLOTS, *latents.shape), dtype=latents.dtype)
    for j, count in enumerate(schedule.draws):
        for d in range(count):
            noise[j, d] = noise_like(latents.shape, generators, latents.dtype)
    return noise


_SCHEDULES: OrderedDict = OrderedDict()
_KEPT = 64


def schedule_of(scheduler, timesteps, noising: str | None = None) -> LinearSchedule:
    """derive, remembered for the schedulers and step counts seen lately (a NotLinear as a NoWholeLoop)."""
    values = tuple(float(t) for t in timesteps)
    sigmas = getattr(scheduler, "sigmas", None)
    key = (
        type(scheduler).__name__,
        json.dumps(dict(scheduler.config), sort_keys=True, default=str),
        values,
        tuple(float(s) for s in sigmas) if sigmas is not None else None,
        getattr(scheduler, "begin_index", None),
        noising,
    )
    if key not in _SCHEDULES:
        try:
            _SCHEDULES[key] = derive(_own_methods(scheduler), list(timesteps), noising=noising)
        except NotLinear as exc:
            raise NoWholeLoop(f"the {type(scheduler).__name__} sampler: {exc}") from None
        while len(_SCHEDULES) > _KEPT:
            _SCHEDULES.popitem(last=False)
    _SCHEDULES.move_to_end(key)
    return _SCHEDULES[key]


def _own_methods(scheduler):
    """A copy of the scheduler without the methods tpugen wrapped on the instance (hooks for XLA that close over
    the live scheduler): the copy runs its class's own code on its own state."""
    twin = copy.deepcopy(scheduler)
    for name in list(vars(twin)):
        if callable(vars(twin)[name]) and callable(getattr(type(twin), name, None)):
            del vars(twin)[name]
    return twin
