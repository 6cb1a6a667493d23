"""Hires fix as a work item holds it: a first pass at the base size, an upscale, an img2img pass at the larger size."""

from __future__ import annotations

from dataclasses import dataclass

# The upscalers built, by the names the web UI gives them (its hr_upscaler): Latent is the latents scaled
# bilinearly (no antialiasing), as the web UI's own "Latent"; Lanczos is the decoded first pass resized on the
# host with PIL's Lanczos filter, then encoded again at the larger size.
UPSCALERS = {"latent": "Latent", "lanczos": "Lanczos"}
DEFAULT_HIRES_STRENGTH = 0.7  # the web UI's denoising_strength for a hires fix's second pass
MAX_HIRES_SCALE = 4.0


@dataclass(frozen=True, order=True)
class HiresFix:
    """The second pass of a hires fix: `scale` times the base size (each side floored to the family's multiple),
    `steps` of an img2img pass at `strength` (so it runs about steps x strength of them), from the first pass's
    latents scaled up (latent) or from its pixels resized (lanczos)."""

    scale: float
    steps: int
    strength: float
    upscaler: str = "latent"

    def size(self, height: int, width: int, multiple: int) -> tuple[int, int]:
        """(height, width) of the second pass for a first pass of height x width."""
        return _side(height, self.scale, multiple), _side(width, self.scale, multiple)

    @property
    def shape_label(self) -> str:
        """What the compiled graphs depend on (the scale and the upscaler; steps and strength are data)."""
        return f"hires x{self.scale:g} {self.upscaler}"

    def record(self) -> dict:
        """What an image record says of it."""
        return {"scale": self.scale, "steps": self.steps, "strength": self.strength, "upscaler": self.upscaler}

    def parameters(self) -> dict:
        """The web UI's own keys for it in a PNG's parameters text."""
        return {
            "Denoising strength": self.strength,
            "Hires upscale": f"{self.scale:g}",
            "Hires steps": self.steps,
            "Hires upscaler": UPSCALERS[self.upscaler],
        }


def _side(side: int, scale: float, multiple: int) -> int:
    return max(multiple, int(side * scale) // multiple * multiple)
