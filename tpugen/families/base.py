"""What every family shares, with Stable Diffusion 1.x/2.x's behaviour as the default."""

from __future__ import annotations

from dataclasses import dataclass

from tpugen.models import FAMILIES, Family
from tpugen.sharding import ATTENTION, FEED_FORWARD


@dataclass(frozen=True)
class FlashRoute:
    """How diffusers 0.42 puts a family's attention on torch_xla's Pallas flash-attention kernel
    (`ModelMixin.enable_xla_flash_attention`), or why it cannot."""

    components: tuple[str, ...]  # the pipeline components whose attention goes through the kernel (none: no route)
    # Flux: its own processors switched to diffusers' "_native_xla" attention backend; else every `Attention`
    # module gets XLAFlashAttnProcessor2_0.
    is_flux: bool = False
    # Whether diffusers hands an SPMD partition spec to the kernel (its Flux backend passes none).
    takes_partition_spec: bool = True
    # diffusers calls the kernel only where q, k and v all have this many tokens; below, plain SDPA.
    min_tokens: int = 0
    unsupported: str | None = None  # why there is no route


class FamilyCode:
    """How tpugen drives one family's diffusers pipelines: the noise it starts from, what its pipeline call
    needs, how its latents are decoded, which patches it needs on XLA, and how its denoiser is split or
    scanned. Subclasses change what their family does differently."""

    name = "sd"
    denoiser = "unet"  # the pipeline component that runs every denoising step
    # The denoiser's blocks that compile.scan_blocks runs through torch_xla's scan (none: not built).
    scan_attributes: tuple[str, ...] = ()
    # SPMD: how the denoiser's linear layers are split over the model axis, by architecture (tpugen.sharding).
    denoiser_rules: dict[str, list[tuple[str, str]]] = {"UNet2DConditionModel": ATTENTION + FEED_FORWARD}
    # Timesteps computed on the host and moved to the device at the denoiser's door (see install_hooks).
    timesteps_on_host = False
    # compile.flash_attention: XLAFlashAttnProcessor2_0 on every attention of the UNet, which runs the kernel
    # only from 4096 tokens (SD 1.5 at 512x512, SDXL at 1024x1024: the largest self-attentions).
    flash_attention = FlashRoute(("unet",), min_tokens=4096)

    @property
    def info(self) -> Family:
        return FAMILIES[self.name]

    def load_options(self, model) -> dict:
        """Extra from_pretrained arguments for this family (model: the config's model section)."""
        return {}

    def noise(self, pipe, generators, height: int, width: int) -> list:
        """One latent per generator, drawn on the CPU: the same seed gives the same noise everywhere."""
        import torch

        scale = pipe.vae_scale_factor
        shape = (1, getattr(pipe, self.denoiser).config.in_channels, height // scale, width // scale)
        return [torch.randn(shape, generator=g, dtype=torch.float32) for g in generators]

    def call_arguments(self, pipe, rows, max_sequence_length: int | None) -> dict:
        """Arguments this family's pipeline call takes beyond the common ones."""
        arguments = {}
        if self.info.negative_prompt:
            arguments["negative_prompt"] = [row.negative_prompt for row in rows]
        if max_sequence_length:
            arguments["max_sequence_length"] = max_sequence_length
        return arguments

    def vae_latents(self, pipe, latents, height: int, width: int):
        """The denoiser's latents as the VAE decodes them (unscaled, unshifted; Flux: unpacked)."""
        import torch

        config = pipe.vae.config
        if getattr(config, "latents_mean", None) is not None and getattr(config, "latents_std", None) is not None:
            mean = torch.tensor(config.latents_mean).view(1, -1, 1, 1).to(latents.device, latents.dtype)
            std = torch.tensor(config.latents_std).view(1, -1, 1, 1).to(latents.device, latents.dtype)
            return latents * std / config.scaling_factor + mean
        return latents / config.scaling_factor + (getattr(config, "shift_factor", None) or 0.0)

    def install_hooks(self, pipe, device, hooks) -> None:
        """This family's patches on the pipeline, each added to `hooks` under a name so it can be removed.

        Timesteps on the host: SD3 in diffusers 0.42 keeps timesteps on the CPU under XLA and passes them to
        the transformer as they are, which fails ("Expected XLA tensor"); Flux keeps them on the device, so
        each step's value is baked into its graph and every step compiles anew. Timesteps computed on the
        CPU (scheduler_hooks) and moved to the device at the transformer's door fix both: one step graph.
        """
        if not self.timesteps_on_host:
            return

        def to_device(module, args, kwargs):
            for key in ("timestep", "guidance"):
                value = kwargs.get(key)
                if value is not None and str(value.device) != str(device):
                    kwargs[key] = value.to(device)
            return args, kwargs

        handle = getattr(pipe, self.denoiser).register_forward_pre_hook(to_device, with_kwargs=True)
        hooks.add("timesteps at the denoiser's door", handle.remove)

    def scheduler_hooks(self, scheduler, hooks) -> None:
        """This family's patches on a scheduler (installed again whenever the scheduler changes)."""
        if self.timesteps_on_host:
            hooks.wrap(scheduler, "set_timesteps", "timesteps on the host", _on_host)


def _on_host(set_timesteps):
    import functools

    @functools.wraps(set_timesteps)  # diffusers inspects its signature (sigmas, mu)
    def set_timesteps_on_host(*args, **kwargs):
        kwargs["device"] = "cpu"
        return set_timesteps(*args, **kwargs)

    return set_timesteps_on_host
