"""Scheduler names users know (A1111 style) mapped to diffusers classes and options."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SchedulerChoice:
    name: str  # what the PNG "Sampler:" field and the report show
    class_name: str  # the diffusers class
    options: dict = field(default_factory=dict)  # passed to from_config()


_BY_NAME = [
    SchedulerChoice("DPM++ 2M", "DPMSolverMultistepScheduler"),
    SchedulerChoice("DPM++ 2M Karras", "DPMSolverMultistepScheduler", {"use_karras_sigmas": True}),
    SchedulerChoice("DPM++ 2M SDE", "DPMSolverMultistepScheduler", {"algorithm_type": "sde-dpmsolver++"}),
    SchedulerChoice("Euler", "EulerDiscreteScheduler"),
    SchedulerChoice("Euler a", "EulerAncestralDiscreteScheduler"),
    SchedulerChoice("Heun", "HeunDiscreteScheduler"),
    SchedulerChoice("LMS", "LMSDiscreteScheduler"),
    SchedulerChoice("DDIM", "DDIMScheduler"),
    SchedulerChoice("PNDM", "PNDMScheduler", {"skip_prk_steps": True}),  # as SD 1.x ships it
    SchedulerChoice("UniPC", "UniPCMultistepScheduler"),
    SchedulerChoice("DEIS", "DEISMultistepScheduler"),
    SchedulerChoice("LCM", "LCMScheduler"),
]
# Flow-matching models (SD3, Flux) keep their own scheduler; it is known by name but not selectable.
_FLOW_MATCH = {"FlowMatchEulerDiscreteScheduler": "Flow Euler"}

SCHEDULER_NAMES = [choice.name for choice in _BY_NAME]


def _key(text: str) -> str:
    return "".join(ch for ch in text.lower() if ch.isalnum() or ch == "+")


_LOOKUP = {_key(c.name): c for c in _BY_NAME}
# A diffusers class name selects that class with its default options.
for _choice in _BY_NAME:
    _LOOKUP.setdefault(_key(_choice.class_name), SchedulerChoice(_choice.name, _choice.class_name))


def find_scheduler(name: str) -> SchedulerChoice | None:
    """The scheduler a user means by `name` (common or class name, case and spacing ignored)."""
    return _LOOKUP.get(_key(name))


def display_name(class_name: str, options: dict | None = None) -> str:
    """The user-facing name of a diffusers scheduler class and its options, for the PNG `Sampler:` field."""
    options = options or {}
    # Variants with options (Karras, SDE) first, so they win over the plain class.
    for choice in sorted(_BY_NAME, key=lambda c: -len(c.options)):
        if choice.class_name == class_name and all(options.get(k) == v for k, v in choice.options.items()):
            return choice.name
    return _FLOW_MATCH.get(class_name, class_name)
