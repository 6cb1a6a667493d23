"""How a family runs ControlNets (model.controlnets, the web UI's units): what its ControlNets are, and how its
pipelines take them, declared as one part of the family (Family.controlnet) rather than as the family's own
attributes. A family that runs none has no part, and Family.controlnet_refusal says why."""

from __future__ import annotations

from dataclasses import dataclass, field

# Why the extension's control modes and per-residual weights do not run for a family whose ControlNets are not UNets.
RESIDUALS_OF_A_UNET = (
    "the control modes but Balanced and per-residual weights (advanced_weighting) weigh a UNet ControlNet's residuals "
    "(SD 1.x/2.x's and SDXL's); this family's ControlNets are built otherwise"
)


@dataclass(frozen=True, kw_only=True)
class ControlNets:
    # The family's built-in ControlNets (tpugen.families.base.Builtin: model.controlnets ids), each built or read
    # offline like a built-in model.
    builtins: tuple = ()
    # The diffusers class of this family's ControlNets: what a local ControlNet folder's config.json must name.
    model_class: str = "ControlNetModel"
    # What this family's ControlNets' config.json says of the added embeddings (SDXL's text-time ones): a local
    # ControlNet folder that says otherwise is another family's, refused at the door.
    addition_embed: str | None = None
    # The argument of the family's txt2img ControlNet pipeline that takes the control images (its img2img and
    # inpainting ones take them as control_image).
    image_argument: str = "image"
    # Whether the family's txt2img ControlNet pipeline samples the control image's VAE latents from the generators
    # before it draws the noise (Flux.1's): a controlled batch then leaves the noise to the pipeline, so that each
    # image's noise is the one diffusers draws for its seed.
    samples_control_first: bool = False
    # The method of this family's ControlNets that compile.trace_once traces (one that takes only tensors).
    traced_method: str = "forward"
    # Where the family's ControlNet pipelines hand the ControlNet the latents and the timestep at each step (a
    # position or a keyword), for a whole loop as one call (backend jax; checked at its first step).
    loop_sample: int | str = 0
    loop_timestep: int | str = 1
    # Why the family's ControlNets cannot run inside a whole loop as one call (backend jax; None: they can).
    loop_refusal: str | None = None
    # Why a controlled prompt cannot start from an image without a mask, and why it cannot inpaint (None: it can,
    # through the family's ControlNet img2img and inpainting pipelines).
    img2img_refusal: str | None = None
    inpaint_refusal: str | None = None
    # Why a controlled inpainting prompt's strength must be 1 (None: any strength runs): a family whose ControlNet
    # inpaints from noise, the masked image given to the ControlNet alone.
    inpaint_strength_refusal: str | None = None
    # The diffusers class of a controlled task's pipeline where AutoPipeline makes none for the family ({task: name}).
    pipelines: dict[str, str] = field(default_factory=dict)
    # Why a unit cannot sit out part of the steps (control_start above 0 or control_end below 1) for this family
    # (None: it can, as the family's ControlNet pipelines take control_guidance_start and _end).
    window_refusal: str | None = None
    # Why two or more ControlNets at once cannot run for this family (None: they can, as diffusers' multi-ControlNet).
    multi_refusal: str | None = None
    # The diffusers class that runs this family's ControlNets two or more at once (its pipelines' `controlnet`).
    multi_class: str = "MultiControlNetModel"
    # How the family's multi-ControlNet txt2img pipeline takes its control images (MULTI_CONTROL_LAYOUTS): "rows",
    # one list per row with an image per ControlNet (SD's, which transposes it); "controlnets", one list per
    # ControlNet with an image per row (Flux.1's); "controlnet batches", one batch tensor per ControlNet (SDXL's,
    # which refuses nested lists: "a single batch of multiple conditionings").
    multi_layout: str = "rows"
    # How its multi-ControlNet img2img and inpaint pipelines take them (SD's and SDXL's: a batch tensor per
    # ControlNet; Flux.1's: a list per ControlNet).
    multi_layout_from_image: str = "controlnet batches"
    # Why a unit's control mode other than Balanced, or its own weight per residual (the web UI extension's
    # control_mode and advanced_weighting, which weigh a UNet ControlNet's residuals), cannot run for this family
    # (None: they can).
    residual_weights_refusal: str | None = None

    def residual_count(self, config: dict) -> int | None:
        """How many residuals one of this family's ControlNets (its config.json) hands the denoiser: the stem's, each
        down block's resnets' and downsampler's, the mid block's (SD 1.5's 13, SDXL's 10). None: not a UNet's."""
        if self.residual_weights_refusal:
            return None
        channels, layers = _unet_levels(config)
        return 1 + len(channels) * layers + len(channels) - 1 + 1

    def unsupported(self, config: dict) -> str | None:
        """Why a ControlNet of this family with this config cannot run on tpugen (None: it can)."""
        return None

    def mixed(self, configs: list[dict]) -> str | None:
        """Why ControlNets with these configs cannot run together for this family (None: they can)."""
        return None

    def refusal(self, task: str, controlnets: list[dict] | tuple = ()) -> str | None:
        """Why a controlled prompt of `task` (img2img, inpaint) cannot run for this family (None: it can), with
        the ControlNets whose configs are known (`controlnets`)."""
        return {"img2img": self.img2img_refusal, "inpaint": self.inpaint_refusal}.get(task)

    def residuals(self, config: dict, height: int, width: int, *, vae_scale: int, text_tokens: int) -> int | None:
        """Elements of what one of this family's ControlNets (its config.json) hands the denoiser per batch row at
        this size, held until the denoiser has added it: a UNet ControlNet's residuals, one per down-block output
        (the stem's, each resnet's, each downsampler's) and the mid block's, at their levels' channels and sizes.
        None: not counted for this family."""
        channels, layers = _unet_levels(config)
        height, width = height // vae_scale, width // vae_scale
        total = channels[0] * height * width  # the stem
        for level, width_ in enumerate(channels):
            total += layers * width_ * height * width
            if level < len(channels) - 1:  # a stride-2 convolution halves the size, rounding up
                height, width = (height + 1) // 2, (width + 1) // 2
                total += width_ * height * width
        return total + channels[-1] * height * width  # the mid block's


@dataclass(frozen=True, kw_only=True)
class TransformerControlNets(ControlNets):
    """A DiT family's ControlNets (Flux.1's and Qwen-Image's): transformer blocks beside the denoiser's."""

    patch: int = 2  # latent pixels per token side of the ControlNet's patches
    loop_sample: int | str = "hidden_states"
    loop_timestep: int | str = "timestep"
    residual_weights_refusal: str | None = RESIDUALS_OF_A_UNET

    def residuals(self, config: dict, height: int, width: int, *, vae_scale: int, text_tokens: int) -> int | None:
        """A transformer ControlNet's hints: one per block of it, over the image's patches at its inner width."""
        if "num_layers" not in config:
            return None
        side = vae_scale * self.patch
        blocks = config["num_layers"] + config.get("num_single_layers", 0)
        return (
            blocks * (height // side) * (width // side) * config["num_attention_heads"] * config["attention_head_dim"]
        )


def _unet_levels(config: dict) -> tuple[tuple[int, ...], int]:
    """A UNet ControlNet's config.json: its levels' channels and resnets per level (diffusers' defaults if unset)."""
    return tuple(config.get("block_out_channels") or (320, 640, 1280, 1280)), config.get("layers_per_block", 2)
