"""Hires fix as a work item holds it: a first pass at the base size, an upscale, an img2img pass at the larger size."""

from __future__ import annotations

import math
from dataclasses import dataclass

# The upscalers built, by the names the web UI gives them (its hr_upscaler): Latent is the latents scaled
# bilinearly (no antialiasing), as the web UI's own "Latent"; Lanczos is the decoded first pass resized on the
# host with PIL's Lanczos filter, then encoded again at the larger size.
UPSCALERS = {"latent": "Latent", "lanczos": "Lanczos"}
DEFAULT_HIRES_STRENGTH = 0.7  # the web UI's hires fix slider's default (its API's unset denoising_strength: 0.75)
MAX_HIRES_SCALE = 4.0


@dataclass(frozen=True, order=True)
class HiresFix:
    """The second pass of a hires fix: `scale` times the base size (each side floored to the family's multiple),
    `steps` steps of an img2img pass at `strength` (as the web UI runs them: a schedule of steps / strength, of
    which the last `steps` run), from the first pass's latents scaled up (latent) or its pixels resized (lanczos)."""

    scale: float
    steps: int
    strength: float
    upscaler: str = "latent"

    def size(self, height: int, width: int, multiple: int) -> tuple[int, int]:
        """(height, width) of the second pass for a first pass of height x width."""
        return _side(height, self.scale, multiple), _side(width, self.scale, multiple)

    @property
    def schedule_steps(self) -> int:
        """The img2img call's num_inference_steps: diffusers runs `strength` of them (int(n x strength) in the
        Stable Diffusion pipelines), so ceil(steps / strength) runs `steps` (a flow-matching one may run one
        more), as the web UI stretches its schedule to steps / strength. Never 0 steps run; at strength 0 there
        is no second pass (the upscale alone), so no schedule."""
        if self.strength == 0:
            return 0
        return math.ceil(self.steps / self.strength - 1e-9)

    @property
    def shape_label(self) -> str:
        """What the compiled graphs depend on (the scale and the upscaler; steps and strength are data, but for
        strength 0 with the latent upscaler: no second pass, so its scaled latents are decoded in a graph of
        their own, the key's "alone"; the lanczos upscale alone runs the first pass's graphs only)."""
        alone = " alone" if self.strength == 0 and self.upscaler == "latent" else ""
        return f"hires x{self.scale:.10g} {self.upscaler}{alone}"

    def record(self, height: int, width: int, multiple: int) -> dict:
        """What the record of an image whose first pass was height x width says of it: with the size it was made
        at (the record's own height and width are the first pass's, as the web UI's Size is)."""
        to_height, to_width = self.size(height, width, multiple)
        options = {"scale": self.scale, "steps": self.steps, "strength": self.strength, "upscaler": self.upscaler}
        return {**options, "height": to_height, "width": to_width}

    def parameters(self) -> dict:
        """The web UI's own keys for it in a PNG's parameters text."""
        return {
            "Denoising strength": self.strength,
            "Hires upscale": f"{self.scale:g}",
            "Hires steps": self.steps,
            "Hires upscaler": UPSCALERS[self.upscaler],
        }


def hires_problems(upscaler: str, family, step_cache_method: str, keys: dict[str, str]) -> list[str]:
    """Why a hires fix with `upscaler` cannot run for a model of `family` under a step cache of
    `step_cache_method`, one line each after the key that asks for it (`keys`: "hires" and "upscaler", as a
    run config or a request names them)."""
    refused = family.refusals(hires_upscaler=upscaler)
    if "hires" in refused:
        return [f"{keys['hires']}: {refused['hires']}"]
    problems = []
    if "hires.upscaler" in refused:
        problems.append(f"{keys['upscaler']}: {refused['hires.upscaler']}")
    if step_cache_method != "none":
        problems.append(
            f"{keys['hires']}: compile.step_cache.method: {step_cache_method} runs for txt2img only, and a hires "
            "fix's second pass is img2img; leave one of them out"
        )
    return problems


def _side(side: int, scale: float, multiple: int) -> int:
    return max(multiple, int(side * scale) // multiple * multiple)
