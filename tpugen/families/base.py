"""What a family is: its models' defaults and built-ins, and how tpugen drives its pipelines, with Stable
Diffusion 1.x/2.x's behaviour as the default that each family's folder changes where it differs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tpugen.families.controlnets import ControlNets
from tpugen.sharding import ATTENTION, FEED_FORWARD

# The scheduler hooks a family installs under these names (LoadedPipeline moves them when it switches schedulers).
TIMESTEPS_ON_HOST = "timesteps on the host"


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


@dataclass(frozen=True)
class Builtin:
    """A tiny built-in model: a real architecture with small random weights, built offline by `build`."""

    name: str
    description: str
    build_version: int  # bumped whenever the builder changes, so stale caches are rebuilt
    build: Callable[[Path], None]  # saves the pipeline to the folder it is given (imports model code itself)
    size: int = 64
    steps: int | None = None  # where it differs from its family's default
    guidance_scale: float | None = None


@dataclass(frozen=True)
class KnownModel:
    """A hub model tpugen knows by id: where it differs from its family's defaults, what it needs, and its
    components' configs for planning memory without a download."""

    id: str
    steps: int | None = None
    guidance_scale: float | None = None
    size: int | None = None
    note: str = ""
    # component -> (class name, config): built on the meta device to count parameters (tpugen.memory).
    components: dict[str, tuple[str, dict]] = field(default_factory=dict, compare=False, hash=False)


@dataclass(frozen=True)
class LoraSign:
    """Something a LoRA file's keys may show about the model it was trained for. A family lists the signs its
    LoRAs can carry; a file showing a sign a family does not list is not for that family."""

    evidence: str  # how the keys show it, in a user's words
    test: Callable[[str], bool]  # whether one key shows it
    implies: tuple[str, ...] = ()  # weaker signs' evidence it makes redundant in a message


def keys_start(*prefixes: str) -> Callable[[str], bool]:
    return lambda key: key.startswith(prefixes)


def keys_contain(*markers: str) -> Callable[[str], bool]:
    return lambda key: any(marker in key for marker in markers)


UNET_KEYS = LoraSign("UNet block names", keys_start("unet.", "lora_unet_"))
TRANSFORMER_KEYS = LoraSign("transformer block names", keys_start("transformer.", "lora_transformer_"))
SECOND_TEXT_ENCODER = LoraSign(
    "keys for a second text encoder (lora_te2_ or text_encoder_2)", keys_start("lora_te2_", "text_encoder_2.")
)
THIRD_TEXT_ENCODER = LoraSign("keys for a third text encoder", keys_start("lora_te3_", "text_encoder_3."))


@dataclass(frozen=True, kw_only=True)
class LoopCall:
    """How a family's pipeline calls its denoiser at every step, for a backend that runs the whole denoising loop
    as one call (JAX): where the latents and the timestep go (a position or a keyword), the timestep's form (the
    step's t in the dtype the pipeline gave it, expanded to the model's rows or not, divided by a number or not),
    whether the scheduler scales the model's input (scale_model_input), whether classifier-free guidance doubles
    the rows and combines the halves, and how the scheduler noises an init image (an inpainting blend). Checked at
    every batch against the call the pipeline makes at its first step."""

    sample: int | str = 0
    timestep: int | str = 1
    timestep_rows: bool = False
    timestep_divisor: float = 1.0
    scales_input: bool = True
    # "batch": CFG doubles the rows and combines the halves (uncond + g (text - uncond)); "calls": a second call
    # with the arguments of cfg_by_call taken from the pipeline's variables of those names, combined the same way;
    # "none": no CFG.
    cfg: str = "batch"
    cfg_by_call: tuple[tuple[str, str], ...] = ()
    # Where the pipeline keeps whether CFG runs and its scale: its variables of these names, else its attributes.
    cfg_flag: str = "do_classifier_free_guidance"
    cfg_scale: str = "guidance_scale"
    # "norm": the combined prediction rescaled to the conditional one's norm over the channels (Qwen-Image's).
    cfg_rescale: str | None = None
    noising: str = "add_noise"


def flow_transformer_call(**cfg) -> LoopCall:
    """How a flow-matching transformer's pipeline (Flux.1, FLUX.2, Qwen-Image) calls it: the latents as
    hidden_states, the step's timestep one per row over 1000, the input unscaled, an init image noised by the
    scheduler's scale_noise; `cfg` the LoopCall fields of its guidance (none by default)."""
    return LoopCall(
        **{
            "sample": "hidden_states",
            "timestep": "timestep",
            "timestep_rows": True,
            "timestep_divisor": 1000.0,
            "scales_input": False,
            "cfg": "none",
            "noising": "scale_noise",
            **cfg,
        }
    )


class Family:
    """One model family: the pipeline classes it covers and their defaults, its built-ins and known hub models,
    and how tpugen drives its pipelines (the noise they start from, what their call needs, how their latents
    are decoded, the patches they need on XLA, how the denoiser is split, scanned or put on flash attention,
    and how big its attention gets). Stable Diffusion 1.x/2.x's behaviour is the default."""

    name = "sd"
    title = "Stable Diffusion 1.x/2.x"
    pipeline_classes: tuple[str, ...] = ("StableDiffusionPipeline",)  # the diffusers classes of model_index.json
    size = 512  # default height and width
    steps = 30
    guidance_scale = 7.5
    cfg = True  # classifier-free guidance above guidance 1 (it doubles the denoiser's batch: another shape)
    negative_prompt = True
    flow_matching = False  # keeps its own flow-matching scheduler
    max_sequence_length: int | None = None  # text tokens the pipeline is called with, for families that take it
    # The pipeline's CLIP tokenizers (attribute names, in the order of its text encoders): under prompt_syntax webui
    # their prompts are read as the web UI reads them (clip_embeddings). None: the encoders are not CLIP, and the
    # prompt is given to the pipeline with the syntax taken out.
    clip_tokenizers: tuple[str, ...] = ("tokenizer",)
    # Height and width must be multiples of this: the VAE's 8, times the 2x2 patches of a DiT's latents.
    size_multiple = 8
    builtins: tuple[Builtin, ...] = ()
    known_models: tuple[KnownModel, ...] = ()
    lora_signs: tuple[LoraSign, ...] = (UNET_KEYS,)

    denoiser = "unet"  # the pipeline component that runs every denoising step
    # How the pipeline calls the denoiser at each step, for a whole loop as one call (backend jax); None: its loop
    # runs a step at a time there.
    loop_call: LoopCall | None = LoopCall()
    # The denoiser's method compile.trace_once traces: one that takes only tensors and shapes (a family whose
    # forward reads Python numbers from its inputs splits off the part that does not).
    traced_method = "forward"
    # The denoiser's block lists that compile.scan_blocks runs through torch_xla's scan (none: not built), each
    # with the arguments its blocks return new values of, in their order.
    scan_attributes: dict[str, tuple[str, ...]] = {}
    # SPMD: how the denoiser's linear layers are split over the model axis, by architecture (tpugen.sharding).
    denoiser_rules: dict[str, list[tuple[str, str]]] = {"UNet2DConditionModel": ATTENTION + FEED_FORWARD}
    # SPMD: text encoders of this family that tpugen.sharding.TEXT_ENCODER_RULES lacks.
    text_encoder_rules: dict[str, list[tuple[str, str]]] = {}
    # Timesteps computed on the host and moved to the device at the denoiser's door (see install_hooks).
    timesteps_on_host = False
    # compile.flash_attention: XLAFlashAttnProcessor2_0 on every attention of the UNet, which runs the kernel
    # only from 4096 tokens (SD 1.5 at 512x512, SDXL at 1024x1024: the largest self-attentions).
    flash_attention = FlashRoute(("unet",), min_tokens=4096)
    # Why compile.step_cache cannot run for this family's models (None: it can). diffusers' cache hooks need the
    # denoiser's enable_cache (CacheMixin) and a pipeline that names each call's cache context.
    step_cache_refusal: str | None = (
        "diffusers 0.42 has no step cache for a UNet: UNet2DConditionModel has no enable_cache, and TaylorSeer "
        "hooks attention under transformer_blocks, which a UNet does not have"
    )

    # Why hires fix's latent upscaler cannot run for this family (None: it can): its img2img pipeline must take
    # the first pass's latents, scaled up, as its image (upscale_latents).
    latent_upscale_refusal: str | None = None
    # Why img2img and inpainting (init_image, serve.tasks) and so hires fix, whose second pass is img2img, cannot
    # run for this family (None: they can).
    img2img_refusal: str | None = None
    # Reference images a prompt may give to edit by reference (a prompt's reference_images, the edit task: the
    # pipeline's `image` list, encoded once before the loop and joined to the latent's tokens): 0, none.
    max_references = 0
    # Why an edit by reference cannot run as a whole loop as one call (backend jax; None: it can, the references'
    # tokens joined to the latents' at every step, as the loop joins an inpainting UNet's mask).
    loop_edit_refusal: str | None = None
    # Why a prompt without reference images cannot run (None: it can): an edit-only pipeline's.
    txt2img_refusal: str | None = None
    # Why a batch of more than one prompt cannot run (None: it can): a pipeline that takes one prompt a call.
    batch_refusal: str | None = None
    # Arguments of tpugen's txt2img call the family's pipeline does not take (left out; any other it lacks fails).
    arguments_not_taken: tuple[str, ...] = ()
    # Why seamless tiling (tiling, the web UI's tiling) cannot run for this family (None: it can): it makes every
    # padded Conv2d of the denoiser and the VAE pad circularly, so a denoiser without padded convolutions leaves
    # the image's edges as they were.
    tiling_refusal: str | None = None
    # Why clip skip (clip_skip above 1, the web UI's CLIP_stop_at_last_layers) cannot run for this family (None:
    # it can: its one CLIP encoder's hidden states of that layer, through the final layer norm).
    clip_skip_refusal: str | None = None

    # How the family runs ControlNets (tpugen.families.controlnets.ControlNets); None: it runs none, and
    # controlnet_refusal says why.
    controlnet: ControlNets | None = None
    # Why model.controlnets cannot run for this family, which has no `controlnet` part (a family with one runs
    # them through diffusers' ControlNet pipelines made from the loaded components: AutoPipelineFor*.from_pipe).
    controlnet_refusal: str = (
        "tpugen drives ControlNets for Stable Diffusion 1.x/2.x, SDXL, Flux.1, Qwen-Image and Z-Image models"
    )

    def covers(self, index: dict) -> bool:
        """Whether a pipeline of one of this family's classes, with this model_index.json, is this family's (two
        families may share a class and differ by a flag of the pipeline's config)."""
        return True

    # ---------------------------------------------------------------- planning (pure)

    def attention_geometry(
        self, config: dict, height: int, width: int, *, vae_scale: int, text_tokens: int
    ) -> tuple[int, int]:
        """(tokens, heads) of the denoiser's largest attention for one image size, from its config.

        A UNet: the self-attention of the first down block that has attention, at the latent size halved once
        per block before it; its heads are `attention_head_dim` (diffusers' old name for the head count)
        unless `num_attention_heads` is set."""
        blocks = config.get("down_block_types") or _UNET_DOWN_BLOCKS
        level = next((i for i, block in enumerate(blocks) if "Attn" in block), 0)
        heads = config.get("num_attention_heads") or config.get("attention_head_dim") or 8
        heads = heads[level] if isinstance(heads, (list, tuple)) else heads
        side = vae_scale * 2**level
        return (height // side) * (width // side), heads

    def refusals(
        self,
        *,
        image: bool = False,
        edit: bool = False,
        tiling: bool = False,
        clip_skip: int = 1,
        hires_upscaler: str | None = None,
    ) -> dict[str, str]:
        """What this family cannot do of what an image's work asks (tpugen.plan.ImageWork.refusals reads a
        record's), each as "<title> models: why" under the part of the work it refuses: "image" (an init image:
        img2img or inpainting), "txt2img" (no references, where the family only edits), "tiling", "clip_skip",
        "hires" (a hires fix, whose second pass is img2img) and "hires.upscaler". Run configs, a server's
        admission and hires fix ask here; each puts its own key before the words."""
        title = f"{self.title} models"
        asked = {
            "image": (image, self.img2img_refusal),
            "txt2img": (not image and not edit, self.txt2img_refusal),
            "tiling": (tiling, self.tiling_refusal),
            "clip_skip": (clip_skip > 1, self.clip_skip_refusal),
            "hires": (hires_upscaler is not None, self.img2img_refusal),
        }
        found = {part: f"{title}: {why}" for part, (on, why) in asked.items() if on and why}
        if hires_upscaler == "latent" and "hires" not in found and self.latent_upscale_refusal:
            found["hires.upscaler"] = f"latent for {title}: {self.latent_upscale_refusal}"
        return found

    def uses_cfg(self, guidance_scale: float) -> bool:
        """Whether a call at this guidance runs classifier-free guidance (a second pass, another shape key)."""
        return self.cfg and guidance_scale > 1.0

    @property
    def guidance_note(self) -> str:
        """What guidance does for this family, for `tpugen models`."""
        return "CFG above guidance 1" if self.cfg else "no CFG"

    # ---------------------------------------------------------------- loading and calling (import torch lazily)

    def load_options(self, model) -> dict:
        """Extra from_pretrained arguments for this family (model: the config's model section)."""
        return {}

    def noise(self, pipe, generators, height: int, width: int) -> list:
        """One latent per generator, drawn on the CPU: the same seed gives the same noise everywhere."""
        import torch

        scale = pipe.vae_scale_factor
        shape = (1, getattr(pipe, self.denoiser).config.in_channels, height // scale, width // scale)
        return [torch.randn(shape, generator=g, dtype=torch.float32) for g in generators]

    def text_length(self, pipe) -> int | None:
        """The text tokens the pipeline is called with: the family's, capped by what a second or third tokenizer
        (SD3's and Flux.1's T5) takes (None: the pipeline's own fixed length)."""
        wanted = self.max_sequence_length
        if not wanted:
            return None
        tokenizer = getattr(pipe, "tokenizer_3", None) or getattr(pipe, "tokenizer_2", None)
        limit = getattr(tokenizer, "model_max_length", None) or wanted
        return min(wanted, limit)

    def text_arguments(self, pipe, rows, *, chunks: int, syntax: str, cfg: bool, clip_skip: int = 1) -> dict:
        """The prompts of a call's rows as the pipeline takes them. prompt_syntax webui (`syntax`): a CLIP family's
        embeddings in `chunks` chunks (clip_embeddings); another family's text without the syntax. plain: the
        text as written, for the pipeline to encode. `clip_skip`: the web UI's (1: the last layer), read with its
        syntax only (tpugen.config.rules.CLIP_SKIP_NEEDS_WEBUI)."""
        prompts = [row.prompt for row in rows]
        negatives = [row.negative_prompt for row in rows] if self.negative_prompt else None
        if syntax == "webui" and self.clip_tokenizers:
            return self.clip_embeddings(pipe, prompts, negatives if cfg else None, chunks, clip_skip)
        if syntax == "webui":
            from tpugen.families.prompt_syntax import strip_syntax

            prompts = [strip_syntax(text) for text in prompts]
            negatives = [strip_syntax(text) for text in negatives] if negatives is not None else None
        return {"prompt": prompts} | ({"negative_prompt": negatives} if negatives is not None else {})

    def clip_embeddings(
        self, pipe, prompts: list[str], negatives: list[str] | None, chunks: int, clip_skip: int = 1
    ) -> dict:
        """The call's embedding arguments for prompts read as the web UI reads them (negatives: None without CFG)."""
        from tpugen.families.clip_text import sd_embeddings

        return sd_embeddings(pipe, prompts, negatives, chunks, clip_skip)

    def call_arguments(self, pipe, rows, guidance_scale: float) -> dict:
        """Arguments this family's pipeline call takes beyond the common ones and the prompts (text_arguments)."""
        arguments = {}
        length = self.text_length(pipe)
        if length:
            arguments["max_sequence_length"] = length
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

    def upscale_latents(self, pipe, latents, height: int, width: int, to_height: int, to_width: int):
        """A first pass's latents (height x width pixels) scaled bilinearly to to_height x to_width, as the
        family's img2img pipeline takes them for its `image` (the web UI's Latent upscaler: no antialiasing)."""
        import torch

        scale = pipe.vae_scale_factor
        size = (to_height // scale, to_width // scale)
        return torch.nn.functional.interpolate(latents, size=size, mode="bilinear", antialias=False)

    def decode_upscaled(self, pipe, latents, height: int, width: int, device):
        """Latents as upscale_latents gives them, decoded: a hires fix's upscale alone (denoising strength 0)."""
        return self.decode(pipe, latents, height, width, device)

    def loop_body(self, denoiser, args: tuple, kwargs: dict, variables: dict):
        """A whole loop's step (tpugen.engine.whole_loop) for a family whose step its LoopCall cannot say, read off
        the denoiser's first call (its arguments, the pipeline's variables): (body, inputs); None: the LoopCall's.
        Raises ValueError naming why the loop cannot be one call."""
        return None

    def decode_loop_latents(self, pipe, latents, height: int, width: int, device):
        """The denoising loop's own final latents to pixels (a whole loop run as one call: tpugen.engine.whole_loop),
        where decode takes what the pipeline returns; the same for a pipeline that returns its loop's latents."""
        return self.decode(pipe, latents, height, width, device)

    def decode(self, pipe, latents, height: int, width: int, device):
        """Latents to pixels in [0, 1], as the family's pipeline would (`device`: where the VAE is)."""
        vae = pipe.vae
        latents = self.vae_latents(pipe, latents, height, width)
        image = vae.decode(latents.to(device=device, dtype=vae.dtype), return_dict=False)[0]
        return (image / 2 + 0.5).clamp(0, 1)

    def install_hooks(self, pipe, device, hooks) -> None:
        """This family's patches on the pipeline, each added to `hooks` under a name so it can be removed.

        Timesteps on the host: SD3 in diffusers 0.42 keeps timesteps on the CPU under XLA and passes them to
        the transformer as they are, which fails ("Expected XLA tensor"); Flux keeps them on the device, so
        each step's value is baked into its graph and every step compiles anew. Timesteps computed on the
        CPU (scheduler_hooks) and moved to the device at the transformer's door fix both: one step graph.
        """
        if self.timesteps_on_host:
            _timesteps_at_the_door(getattr(pipe, self.denoiser), device, hooks, "the denoiser's")

    def controlnet_hooks(self, controlnet, device, hooks, label: str) -> None:
        """This family's patches on one of its ControlNets (`label`: its name in the hooks): what the denoiser
        is given at its door, the ControlNet is given too (Flux.1's takes the step's timestep as its transformer
        does)."""
        if self.timesteps_on_host:
            _timesteps_at_the_door(controlnet, device, hooks, f"the {label}'s")

    def pipeline_hooks(self, pipe, hooks) -> None:
        """This family's patches on the pipeline object itself, not on its components: install_hooks makes them
        on the loaded pipeline, and each img2img or inpaint pipeline made from its components gets them too
        (the components, and their patches, it shares)."""

    def scheduler_hooks(self, scheduler, hooks) -> None:
        """This family's patches on a scheduler (installed again whenever the scheduler changes)."""
        if self.timesteps_on_host:
            hooks.wrap(scheduler, "set_timesteps", TIMESTEPS_ON_HOST, timesteps_set_on_host)


# diffusers' UNet2DConditionModel default, for configs that leave it out (tpugen's own SD 1.5 config does).
_UNET_DOWN_BLOCKS = ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"]


class TransformerFamily(Family):
    """A DiT family: a transformer over patches of a flow-matching latent, no scheduler choice."""

    denoiser = "transformer"
    loop_call = None
    clip_tokenizers = ()  # SD3's and Flux.1's CLIP encoders share the prompt with a T5 one: plain text for all
    flow_matching = True
    size = 1024
    size_multiple = 16
    lora_signs = (TRANSFORMER_KEYS,)
    timesteps_on_host = True
    patch: int | None = None  # latent pixels per token side (None: the denoiser config's patch_size, else 2)
    extra_text_tokens = 0  # text tokens joined to the latent tokens beyond text_tokens (SD3's CLIP tokens)
    step_cache_refusal = "is not checked against diffusers' own cached images on tpugen yet"
    clip_skip_refusal = "its text encoders are not one CLIP encoder; clip skip is built for SD 1.x/2.x"
    tiling_refusal = (
        "the transformer has no padded convolution (its patch embedding pads nothing), so only the VAE would wrap "
        "round and the image would not tile; tiling is built for UNet models (SD 1.x/2.x, SDXL)"
    )

    def attention_geometry(
        self, config: dict, height: int, width: int, *, vae_scale: int, text_tokens: int
    ) -> tuple[int, int]:
        """(tokens, heads): the latent's patches joined by the text tokens in one joint attention."""
        side = vae_scale * (self.patch or config.get("patch_size") or 2)
        return (height // side) * (width // side) + text_tokens + self.extra_text_tokens, config["num_attention_heads"]


def _timesteps_at_the_door(module, device, hooks, whose: str) -> None:
    """The timestep and guidance a pipeline keeps on the host moved to the device as `module` is called."""

    def to_device(module, args, kwargs):
        for key in ("timestep", "guidance"):
            value = kwargs.get(key)
            if value is not None and str(value.device) != str(device):
                kwargs[key] = value.to(device)
        return args, kwargs

    handle = module.register_forward_pre_hook(to_device, with_kwargs=True)
    hooks.add(f"timesteps at {whose} door", handle.remove)


def timesteps_set_on_host(set_timesteps):
    """A scheduler's set_timesteps that keeps them on the host, whatever device its pipeline asks for."""
    import functools

    @functools.wraps(set_timesteps)  # diffusers inspects its signature (sigmas, mu)
    def set_timesteps_on_host(*args, **kwargs):
        kwargs["device"] = "cpu"
        return set_timesteps(*args, **kwargs)

    return set_timesteps_on_host
