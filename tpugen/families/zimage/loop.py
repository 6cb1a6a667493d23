"""Z-Image's step for a whole loop run as one call (backend jax): ZImagePipeline's loop body, on the transformer's
fixed-length device part (tpugen.families.zimage.static), its host tables made once from the call the pipeline made
at its first step. Imported only when a Z-Image loop is read (it imports diffusers)."""

from __future__ import annotations

from dataclasses import dataclass

from tpugen.families.zimage import static


@dataclass(frozen=True)
class ZImageLoop:
    """ZImagePipeline's step: the latents cast to the transformer's dtype, doubled for CFG (the negative prompt's
    rows after the prompt's), as one frame each; the timestep (1000 - t) / 1000 per row; the prediction
    pos + g (pos - neg) in float32, negated."""

    cfg: bool
    patch_size: int
    frame_patch_size: int
    method: str = static.DEVICE_FORWARD
    blends: bool = False

    @property
    def key(self) -> tuple:
        return ("zimage", self.cfg, self.patch_size, self.frame_patch_size)

    def model_output(self, denoise, x, t, scale, guidance, inputs: dict, per_call: dict, control=None):
        import torch

        rows = x.shape[0]
        timestep = (1000 - t.to(torch.float32).expand(rows)) / 1000
        latents = x.to(inputs["sample_dtype"])
        if self.cfg:
            latents, timestep = latents.repeat(2, 1, 1, 1), timestep.repeat(2)
        frames = list(latents.unsqueeze(2).unbind(dim=0))
        out = denoise(
            frames, timestep, inputs["captions"], inputs["tables"], None, self.patch_size, self.frame_patch_size
        )
        out = torch.stack([o.float() for o in out], dim=0)
        if self.cfg:
            positive, negative = out[:rows], out[rows:]
            out = positive + guidance.to(torch.float32) * (positive - negative)
        return -out.squeeze(2)


def loop_body(transformer, args: tuple, kwargs: dict, variables: dict) -> tuple[ZImageLoop, dict]:
    """The body and its inputs from the transformer's first call (raises ValueError naming why not one call)."""
    import torch

    pipe = variables.get("self")
    frames, timestep, captions = (list(args) + [None, None, None])[:3]
    if not isinstance(frames, list) or not isinstance(captions, list) or not isinstance(timestep, torch.Tensor):
        raise ValueError("ZImagePipeline's transformer was not called with lists of frames and captions")
    if getattr(pipe, "_cfg_normalization", False):
        raise ValueError("cfg_normalization is not built into the whole loop")
    truncation = getattr(pipe, "_cfg_truncation", 1.0)
    if truncation is not None and float(truncation) < 1.0:
        raise ValueError("cfg_truncation below 1 is not built into the whole loop")
    lengths = static._fixed_lengths(frames, captions)
    if lengths is None:
        raise ValueError("its captions are not of one fixed length")
    patch, frame_patch = kwargs.get("patch_size", 2), kwargs.get("f_patch_size", 1)
    latents = variables.get("latents")
    cfg = len(frames) == 2 * latents.shape[0]
    seen = torch.stack([f.squeeze(1) for f in frames]).double()
    expected = latents.to(frames[0].dtype).double()
    expected = expected.repeat(2, 1, 1, 1) if cfg else expected
    if seen.shape != expected.shape or float((seen - expected).abs().max()) > 1e-5:
        raise ValueError("the pipeline's first frames are not its latents as ZImagePipeline forms them")
    rows = latents.shape[0] * (2 if cfg else 1)
    first = (1000 - variables["timesteps"][0].to(torch.float32).expand(rows)) / 1000
    if timestep.shape != first.shape or not torch.allclose(timestep.double(), first.double(), atol=1e-6):
        raise ValueError("the pipeline's first timestep is not the one ZImagePipeline's loop forms")
    tables = static._tables(transformer, frames, captions, lengths, patch, frame_patch)
    inputs = {
        "captions": [c.detach().clone() for c in captions],
        "tables": tuple(tables),
        "sample_dtype": frames[0].dtype,
    }
    return ZImageLoop(cfg=cfg, patch_size=patch, frame_patch_size=frame_patch), inputs
