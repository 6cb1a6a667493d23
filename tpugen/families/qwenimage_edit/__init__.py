"""Qwen-Image-Edit Plus (QwenImageEditPlusPipeline: Qwen-Image-Edit-2509 and -2511) and Qwen-Image-Edit
(QwenImageEditPipeline, one reference): Qwen-Image's transformer, VAE and text encoder editing by reference. Each
reference is read twice: by Qwen2.5-VL's vision tower with the prompt and by the VAE, whose tokens join the
latent's at every step."""

from __future__ import annotations

from tpugen.families.base import Builtin, KnownModel, TransformerFamily
from tpugen.families.qwenimage import QwenImage, components

# diffusers 0.42's areas for a reference (pipeline_qwenimage_edit_plus.py: CONDITION_IMAGE_SIZE, VAE_IMAGE_SIZE),
# each resized to about that many pixels at the reference's aspect ratio.
CONDITION_AREA = 384 * 384
VAE_AREA = 1024 * 1024
# How QwenImageEditPlusPipeline labels each reference in the prompt (a local string of its _get_qwen_prompt_embeds).
PICTURE = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"


def _build(target):
    from tpugen.families.qwenimage_edit.tiny import build

    build(target)


def _build_single(target):
    from tpugen.families.qwenimage_edit.tiny import build

    build(target, plus=False)


class QwenImageEditPlus(QwenImage):
    name = "qwenimage_edit_plus"
    title = "Qwen-Image-Edit Plus"
    pipeline_classes = ("QwenImageEditPlusPipeline",)
    size = 1024  # the pipeline's own default: 1024 x 1024 in the last reference's aspect ratio
    steps = 40  # the model cards' (2509, 2511), with true_cfg_scale 4
    # The model cards recommend 1 to 3 references (the pipeline labels each "Picture n" in the prompt).
    max_references = 3
    txt2img_refusal = "QwenImageEditPlusPipeline only edits, by reference images"
    img2img_refusal = (
        "QwenImageEditPlusPipeline edits by reference images (reference_images), without a strength; Qwen-Image's "
        "img2img is QwenImageImg2ImgPipeline"
    )
    batch_refusal = "diffusers 0.42's QwenImageEditPlusPipeline takes one prompt a call"
    controlnet = None  # Qwen-Image's ControlNet pipelines are txt2img and inpainting ones, not edits
    controlnet_refusal = "diffusers 0.42 has no ControlNet pipeline for Qwen-Image-Edit"
    # compile.scan_blocks: Qwen-Image's rule (scan_attributes, inherited). The references' tokens join the latent's
    # in hidden_states, so each block gets the same arguments as Qwen-Image's; 2511's zero_cond_t adds a per-call
    # modulation index (an int tensor: which tokens are the references') and a temb of twice the batch, both
    # carried through the scan as any other tensor argument (tests/test_scan.py checks both).
    # compile.step_cache: diffusers' hooks would run, but tpugen has not checked them against diffusers' own
    # cached edits.
    step_cache_refusal = TransformerFamily.step_cache_refusal
    builtins = (
        Builtin(
            "tiny-qwen-image-edit-plus",
            "Qwen-Image-Edit Plus architecture (Qwen2.5-VL text encoder and vision tower, MMDiT, 5-D VAE) with tiny "
            "random weights; edits by 1 to 3 references; noise",
            1,
            _build,
        ),
    )
    known_models = (
        KnownModel(
            "Qwen/Qwen-Image-Edit-2509",
            note=(
                "edits by 1-3 references; 57.7 GB in bfloat16 (20.4B transformer 40.9 GB, 8.29B Qwen2.5-VL 16.6 GB): "
                "fits one v5p chip; SPMD over 4+ v6e chips or 8 v5e chips"
            ),
            components=components(),
        ),
        KnownModel(
            "Qwen/Qwen-Image-Edit-2511",
            note=(
                "edits by 1-3 references (the references' tokens modulated as at time 0: zero_cond_t); 57.7 GB in "
                "bfloat16, as 2509: fits one v5p chip; SPMD over 4+ v6e chips or 8 v5e chips"
            ),
            components=components(zero_cond_t=True),
        ),
    )

    def reference_areas(self, pipe) -> tuple[int, int]:
        """(condition area, VAE area): the pixels each reference is resized to for the vision tower and for the
        VAE. diffusers' 384 x 384 and 1024 x 1024, each at most what the model's vision processor takes (its
        longest_edge, 12.8 M pixels in the real models): the tiny built-in's processor takes 64 x 64, so its
        references stay the size of its images."""
        size = pipe.processor.image_processor.size
        most = size["longest_edge"] if isinstance(size, dict) else size.longest_edge
        return min(CONDITION_AREA, most), min(VAE_AREA, most)

    def pipeline_hooks(self, pipe, hooks) -> None:
        """The text and references read with static shapes and no read to the host (measured on XLA:CPU,
        diffusers 0.42.1, transformers 5.25), and the model's reference areas:

        - the prompt and the references' vision tokens, padded on the host to a fixed length (the template's
          dropped prefix, the references' tokens, max_sequence_length) with the mask kept, as Qwen-Image's text;
          the vision tower's indices (positions, windows, segment lengths) computed from image_grid_thw on the
          host, and the vision tokens put in place by indices found on the host (transformers finds them on the
          device and checks their count there);
        - the call's reference areas (reference_areas) in a copy of the pipeline's __call__ of its own: diffusers
          reads them from its module's globals, which this leaves as they are for every other pipeline."""
        import types

        hooks.wrap(
            pipe,
            "encode_prompt",
            "text and references of a fixed length",
            lambda _: types.MethodType(_encode_prompt, pipe),
        )
        hooks.add("reference areas of the model", _areas_in_call(pipe, self.call_globals(pipe), self.max_references))

    def call_globals(self, pipe) -> dict:
        """The names of the pipeline module's globals its __call__ reads the reference areas from, with the
        model's values (reference_areas)."""
        condition, vae = self.reference_areas(pipe)
        return {"CONDITION_IMAGE_SIZE": condition, "VAE_IMAGE_SIZE": vae}


class QwenImageEdit(QwenImageEditPlus):
    name = "qwenimage_edit"
    title = "Qwen-Image-Edit"
    pipeline_classes = ("QwenImageEditPipeline",)
    size = 1024  # the pipeline's own default: 1024 x 1024 in the reference's aspect ratio
    steps = 50  # the model card's, with true_cfg_scale 4
    max_references = 1  # its template holds one picture
    txt2img_refusal = "QwenImageEditPipeline only edits, by a reference image"
    img2img_refusal = (
        "QwenImageEditPipeline edits by a reference image (reference_images), without a strength; Qwen-Image's "
        "img2img is QwenImageImg2ImgPipeline"
    )
    batch_refusal = "diffusers 0.42's QwenImageEditPipeline reads its reference with one prompt a call"
    # compile.scan_blocks: the transformer is called as Qwen-Image-Edit Plus's with one reference (inherited).
    builtins = (
        Builtin(
            "tiny-qwen-image-edit",
            "Qwen-Image-Edit architecture (tiny-qwen-image-edit-plus's weights and processor in "
            "QwenImageEditPipeline); edits by 1 reference; noise",
            1,
            _build_single,
        ),
    )
    known_models = (
        KnownModel(
            "Qwen/Qwen-Image-Edit",
            note=(
                "edits by 1 reference (read at about 1024x1024 by the VAE and the vision tower alike); 57.7 GB in "
                "bfloat16, as Qwen-Image: fits one v5p chip; SPMD over 4+ v6e chips or 8 v5e chips"
            ),
            components=components(),
        ),
    )

    def reference_areas(self, pipe) -> tuple[int, int]:
        """(condition area, VAE area): one area for both, QwenImageEditPipeline's 1024 x 1024 (written in its
        __call__), at most what the model's vision processor takes (as Plus's: the tiny built-in's 64 x 64)."""
        _, vae = super().reference_areas(pipe)
        return vae, vae

    def call_globals(self, pipe) -> dict:
        """QwenImageEditPipeline.__call__ writes its area (1024 * 1024) in its code: the module's
        calculate_dimensions it calls, given the model's area instead."""
        import inspect

        calculate = inspect.unwrap(type(pipe).__call__).__globals__["calculate_dimensions"]
        area = self.reference_areas(pipe)[1]

        def calculate_dimensions(target_area, ratio):
            return calculate(area, ratio)

        return {"calculate_dimensions": calculate_dimensions}


def _areas_in_call(pipe, names: dict, references: int):
    """`pipe` given a class of its own whose __call__ is diffusers' with these globals of its module (`names`:
    the reference areas, Family.call_globals) replaced; a pipeline of one reference (`references` 1) is given
    tpugen's list of one as its image. Returns what puts its class back."""
    import inspect
    import types

    import torch

    base = type(pipe)
    call = inspect.unwrap(base.__call__)  # under torch.no_grad and the docstring decorator
    missing = [name for name in names if name not in call.__globals__]
    if missing:
        raise RuntimeError(f"{base.__name__}.__call__ reads no {', '.join(missing)}: diffusers changed")
    scoped = types.FunctionType(
        call.__code__, {**call.__globals__, **names}, call.__name__, call.__defaults__, call.__closure__
    )
    scoped.__kwdefaults__ = call.__kwdefaults__
    scoped.__doc__, scoped.__qualname__, scoped.__module__ = call.__doc__, call.__qualname__, call.__module__
    if references == 1:  # QwenImageEditPipeline resizes its image as one picture, not a list
        whole = scoped

        def scoped(self, *args, image=None, **kwargs):
            return whole(self, *args, image=image[0] if isinstance(image, list) else image, **kwargs)

    pipe.__class__ = type(base.__name__, (base,), {"__call__": torch.no_grad()(scoped)})

    def restore() -> None:
        pipe.__class__ = base

    return restore


def _edit_text(pipe, prompts: list[str], images: list, device, dtype, max_sequence_length: int):
    """The text encoder's last hidden state for each prompt with the references, after the template's dropped
    prefix, padded to (the references' vision tokens + max_sequence_length) tokens, and its mask.

    As diffusers' _get_qwen_prompt_embeds, whose text encoder call gives Qwen2.5-VL no mm_token_type_ids, so that
    transformers 5 numbers the tokens 0, 1, 2, ... (no 3-D positions for the images): the same positions are
    given here. The encoder runs without the mask: it is causal and the padding is on the right."""
    import torch
    from transformers.vision_utils import get_vision_attention_seqlens, get_vision_position_ids, get_vision_window_index

    drop = pipe.prompt_template_encode_start_idx
    # The Plus pipelines label each reference ("Picture n: ..."); QwenImageEditPipeline's template holds its one.
    labelled = "<|image_pad|>" not in pipe.prompt_template_encode
    pictures = "".join(PICTURE.format(n + 1) for n in range(len(images))) if labelled else ""
    encoder = pipe.text_encoder
    pad = pipe.tokenizer.pad_token_id
    rows = [
        pipe.processor(
            text=[pipe.prompt_template_encode.format(pictures + p)], images=images or None, return_tensors="pt"
        )
        for p in prompts
    ]
    first = rows[0]
    visual = encoder.model.visual
    grid = first.get("image_grid_thw")
    vision_tokens = int((grid.prod(-1) // visual.spatial_merge_size**2).sum()) if grid is not None else 0
    length = drop + vision_tokens + max_sequence_length
    ids = torch.full((len(rows), length), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for n, row in enumerate(rows):
        real = min(row.input_ids.shape[1], length)  # an over-long prompt loses its end, as Qwen-Image's
        ids[n, :real], mask[n, :real] = row.input_ids[0, :real], row.attention_mask[0, :real]
    embeds = encoder.get_input_embeddings()(ids.to(device))
    if grid is not None:
        # The vision tower's data-dependent indices from image_grid_thw, on the host (transformers' vision_utils
        # take them precomputed): its segment lengths stay host tensors, read only to split the attention.
        window_index, cu_window_seqlens = get_vision_window_index(
            grid,
            spatial_merge_size=visual.spatial_merge_size,
            window_size=visual.window_size,
            patch_size=visual.patch_size,
        )
        cu_seqlens, _ = get_vision_attention_seqlens(grid, visual.config)
        features = visual(
            first.pixel_values.to(device, visual.dtype),
            grid_thw=grid,
            position_ids=get_vision_position_ids(grid, visual.spatial_merge_size).to(device),
            cu_seqlens=cu_seqlens,
            window_index=window_index.to(device),
            cu_window_seqlens=cu_window_seqlens,
        ).pooler_output
        where = torch.nonzero(ids == encoder.config.image_token_id, as_tuple=True)  # row-major, as masked_scatter
        features = torch.cat([features] * len(rows)).to(embeds.dtype)
        embeds = embeds.index_put(tuple(index.to(device) for index in where), features)
    positions = torch.arange(length).expand(len(rows), length).to(device)
    output = encoder(inputs_embeds=embeds, position_ids=positions, output_hidden_states=True, use_cache=False)
    hidden = output.hidden_states[-1][:, drop:]
    kept = mask[:, drop:].to(device)
    hidden = hidden * kept.unsqueeze(-1).to(hidden.dtype)  # padded rows are zeros, as diffusers'
    return hidden.to(dtype=dtype), kept


def _encode_prompt(
    pipe,
    prompt,
    image=None,
    device=None,
    num_images_per_prompt: int = 1,
    prompt_embeds=None,
    prompt_embeds_mask=None,
    max_sequence_length: int = 1024,
):
    """QwenImageEditPlusPipeline.encode_prompt with the text and references of a fixed length (_edit_text), whose
    mask is always kept (diffusers drops it when every token is real, a read to the host)."""
    device = device or pipe._execution_device
    prompt = [prompt] if isinstance(prompt, str) else prompt
    if prompt_embeds is None:
        images = image if isinstance(image, list) else [image] if image is not None else []
        prompt_embeds, prompt_embeds_mask = _edit_text(
            pipe, prompt, images, device, pipe.text_encoder.dtype, max_sequence_length
        )
    batch, length = prompt_embeds.shape[:2]
    prompt_embeds = prompt_embeds.repeat(1, num_images_per_prompt, 1).view(batch * num_images_per_prompt, length, -1)
    if prompt_embeds_mask is not None:
        prompt_embeds_mask = prompt_embeds_mask.repeat(1, num_images_per_prompt)
        prompt_embeds_mask = prompt_embeds_mask.view(batch * num_images_per_prompt, length)
    return prompt_embeds, prompt_embeds_mask


FAMILY = QwenImageEditPlus()
SINGLE = QwenImageEdit()
