"""Stable Diffusion XL: SD's UNet layout at a larger size, two CLIP encoders and text-time embeddings."""

from __future__ import annotations

from tpugen.families.base import FamilyCode


class StableDiffusionXL(FamilyCode):
    name = "sdxl"

    def load_options(self, model) -> dict:
        # The invisible watermark runs on the host and is not saved in model_index.json: off unless asked.
        return {"add_watermarker": model.watermark}
