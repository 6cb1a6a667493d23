"""The tiny Qwen-Image-Edit built-ins: tiny-qwen-image's transformer, VAE and Qwen2.5-VL text encoder (whose vision
tower reads the references), with the Qwen2-VL processor the edit pipelines run it through."""

from __future__ import annotations

from pathlib import Path

from tpugen.families.qwenimage.tiny import components, template_tokenizer

# The system prompt QwenImageEditPlusPipeline wraps every prompt in, up to the user's text
# (prompt_template_encode), and the tokens it drops (prompt_template_encode_start_idx). The prefix is 74 pieces
# of Qwen's pre-tokenizer, so at least 74 tokens in any Qwen tokenizer: the pipeline keeps its last ones.
TEMPLATE_PREFIX = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
    "image that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n"
)
TEMPLATE_TOKENS = 64
# The most pixels the vision tower is given (the image processor's longest_edge; the real one's is 12.8 M):
# 64 x 64 becomes 56 x 56 after its 28-pixel rounding, 4 tokens a reference. The family gives no reference more
# pixels than this (QwenImageEditPlus.reference_areas), so the tiny model's references stay tiny too.
MAX_PIXELS = 64 * 64


def build(target: Path, *, plus: bool = True) -> None:
    """tiny-qwen-image-edit-plus (QwenImageEditPlusPipeline), or with `plus` False tiny-qwen-image-edit: the same
    components in QwenImageEditPipeline (whose template holds its one picture after the same prefix)."""
    from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    name = "tiny-qwen-image-edit-plus" if plus else "tiny-qwen-image-edit"
    tokenizer = template_tokenizer(name, TEMPLATE_PREFIX, TEMPLATE_TOKENS, exact=False)
    images = Qwen2VLImageProcessor(min_pixels=28 * 28, max_pixels=MAX_PIXELS)
    # The processor must have a video processor too (the pipelines give it none to run).
    videos = Qwen2VLVideoProcessor(min_pixels=28 * 28, max_pixels=MAX_PIXELS)
    processor = Qwen2VLProcessor(image_processor=images, tokenizer=tokenizer, video_processor=videos)
    pipeline = QwenImageEditPlusPipeline if plus else QwenImageEditPipeline
    pipeline(**components(tokenizer), tokenizer=tokenizer, processor=processor).save_pretrained(target)
