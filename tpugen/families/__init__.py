"""Each model family's code in a module of its own; `family_code(name)` gives the one a run needs."""

from tpugen.families.base import FamilyCode, FlashRoute
from tpugen.families.flux import Flux
from tpugen.families.sd import StableDiffusion
from tpugen.families.sd3 import StableDiffusion3
from tpugen.families.sdxl import StableDiffusionXL

_CODE: dict[str, FamilyCode] = {c.name: c for c in (StableDiffusion(), StableDiffusionXL(), StableDiffusion3(), Flux())}


def family_code(name: str) -> FamilyCode:
    """The code for a family named in tpugen.models.FAMILIES."""
    return _CODE[name]


__all__ = ["FamilyCode", "FlashRoute", "family_code"]
