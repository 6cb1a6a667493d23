"""Z-Image with its text at a fixed length: one step graph for every prompt, nothing read back to the host.

diffusers 0.42 picks each prompt's real tokens out with a boolean mask (a read to the host, and a length that
depends on the prompt), and its transformer pads each caption to a multiple of 32 of its own length and starts the
image's position ids after it: every distinct length was a new step graph. Here each prompt keeps the tokenizer's
padded rows, tagged with its real length (known on the host from the tokenizer's mask); the transformer gives the
padding its learned pad token and masks it as keys, with position ids built on the host. For every real token
the computation is diffusers'. A ZImageControlNetModel runs the same way (its embedders and refiners are the
transformer's, lent by diffusers' from_transformer), its hints added after the main layers they are placed at.
Imported only when a Z-Image pipeline is loaded (it imports diffusers)."""

from __future__ import annotations

import types

import torch
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.transformers.transformer_z_image import SEQ_MULTI_OF
from diffusers.utils.peft_utils import apply_lora_scale

REAL_TOKENS = "_tpugen_real_tokens"  # the attribute of a caption row that holds its real length
# The transformer's method that takes only tensors (the host's tables included): what compile.trace_once traces,
# since the real lengths the tables are made from are Python numbers dynamo would guard on.
DEVICE_FORWARD = "tpugen_device_forward"


def _to_multiple(n: int) -> int:
    return n + (-n) % SEQ_MULTI_OF


def encode_prompt(pipe, prompt, device=None, prompt_embeds=None, max_sequence_length: int = 512):
    """ZImagePipeline._encode_prompt with rows of a fixed length (and the caller's list left as it was). The text
    encoder runs without a mask: it is causal and the padding is on the right, so the real tokens' states are the
    same (and transformers would read the mask on the host)."""
    device = device or pipe._execution_device
    if prompt_embeds is not None:
        return prompt_embeds
    prompt = [prompt] if isinstance(prompt, str) else prompt
    texts = [
        pipe.tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True, enable_thinking=True
        )
        for p in prompt
    ]
    tokens = pipe.tokenizer(
        texts,
        padding="max_length",
        max_length=max_sequence_length,
        truncation=True,
        padding_side="right",
        return_tensors="pt",
    )
    hidden = pipe.text_encoder(input_ids=tokens.input_ids.to(device), output_hidden_states=True).hidden_states[-2]
    rows = []
    for i, real in enumerate(tokens.attention_mask.sum(dim=1).tolist()):  # the host's own mask: no device read
        row = hidden[i]
        setattr(row, REAL_TOKENS, int(real))
        rows.append(row)
    return rows


def _fixed_lengths(x, cap_feats) -> list[int] | None:
    """The captions' real lengths where a call is the basic path at one fixed length (images of one shape, rows of
    encode_prompt's): None for anything else (omni mode, embeddings a caller made, mixed sizes)."""
    lengths = [getattr(c, REAL_TOKENS, None) for c in cap_feats]
    static = (
        not isinstance(x[0], list)
        and None not in lengths
        and len({tuple(c.shape) for c in cap_feats}) == 1
        and len({tuple(i.shape) for i in x}) == 1
    )
    return lengths if static else None


def static_forward(original):
    """ZImageTransformer2DModel.forward for text rows of one fixed length (the basic, text-to-image path, with a
    ControlNet's hints or without); anything else goes to `original`."""

    @apply_lora_scale("joint_attention_kwargs")
    def forward(
        self,
        x,
        t,
        cap_feats,
        return_dict: bool = True,
        controlnet_block_samples=None,
        siglip_feats=None,
        image_noise_mask=None,
        patch_size: int = 2,
        f_patch_size: int = 1,
        joint_attention_kwargs=None,
    ):
        lengths = _fixed_lengths(x, cap_feats)
        if lengths is None:
            return original(
                x,
                t,
                cap_feats,
                return_dict=return_dict,
                controlnet_block_samples=controlnet_block_samples,
                siglip_feats=siglip_feats,
                image_noise_mask=image_noise_mask,
                patch_size=patch_size,
                f_patch_size=f_patch_size,
                joint_attention_kwargs=joint_attention_kwargs,
            )
        tables = _tables(self, x, cap_feats, lengths, patch_size, f_patch_size)
        hints = controlnet_block_samples or None
        out = getattr(self, DEVICE_FORWARD)(x, t, cap_feats, tables, hints, patch_size, f_patch_size)
        return (out,) if not return_dict else Transformer2DModelOutput(sample=out)

    return forward


def static_controlnet_forward(original):
    """ZImageControlNetModel.forward for text rows of one fixed length: its hints, keyed by the main layer each is
    added after, as diffusers returns them; anything else goes to `original`."""

    def forward(self, x, t, cap_feats, control_context, conditioning_scale=1.0, patch_size=2, f_patch_size=1):
        lengths = _fixed_lengths(x, cap_feats)
        if lengths is None:
            return original(x, t, cap_feats, control_context, conditioning_scale, patch_size, f_patch_size)
        tables = _tables(self, x, cap_feats, lengths, patch_size, f_patch_size)
        hints = getattr(self, DEVICE_FORWARD)(
            x, t, cap_feats, control_context, tables, conditioning_scale, patch_size, f_patch_size
        )
        return dict(zip(self.control_layers_places, hints, strict=True))

    return forward


def _tables(self, x, cap_feats, lengths, patch_size, f_patch_size) -> tuple:
    """The step's position ids and masks, built on the host from shapes and the captions' real lengths, kept on
    the device per set of lengths (so a step hands them in as data)."""
    device, rows = x[0].device, len(x)
    _, frames, height, width = x[0].shape
    grid = (frames // f_patch_size, height // patch_size, width // patch_size)
    image_tokens = grid[0] * grid[1] * grid[2]
    image_pad = (-image_tokens) % SEQ_MULTI_OF
    padded_image = image_tokens + image_pad
    text = _to_multiple(cap_feats[0].shape[0])
    caption = [_to_multiple(n) for n in lengths]  # what diffusers would pad each caption to

    def host_tables():
        image_ids = []
        for c in caption:
            grid_ids = self.create_coordinate_grid(size=grid, start=(c + 1, 0, 0), device="cpu").flatten(0, 2)
            if image_pad:
                grid_ids = torch.cat([grid_ids, torch.zeros((image_pad, 3), dtype=grid_ids.dtype)], dim=0)
            image_ids.append(grid_ids)
        text_ids = self.create_coordinate_grid(size=(text, 1, 1), start=(1, 0, 0), device="cpu").flatten(0, 2)
        image_padding = torch.zeros(padded_image, dtype=torch.bool)
        image_padding[image_tokens:] = True
        j = torch.arange(text)
        text_padding = torch.stack([j >= n for n in lengths])  # rows that get the pad token
        text_keys = torch.stack([j < c for c in caption])  # keys attended, as diffusers' own padding would be
        keys = torch.cat([torch.ones((rows, padded_image), dtype=torch.bool), text_keys], dim=1)
        tables = (torch.cat(image_ids), text_ids, image_padding.repeat(rows), text_padding, text_keys, keys)
        return tuple(table.to(device) for table in tables)

    if "jax" in str(device):  # inside a JAX trace (backend jax) the moved tables are that trace's: never kept
        return host_tables()
    cache = self.__dict__.setdefault("_tpugen_tables", {})
    table_key = (tuple(caption), tuple(lengths), text, grid, rows, str(device))
    if table_key not in cache:
        if len(cache) > 64:
            cache.clear()
        cache[table_key] = host_tables()
    return cache[table_key]


def _image_tokens(self, images, embedder, image_padding, patch_size, f_patch_size):
    """Images of one shape as tokens: patches padded to a multiple of 32 as diffusers pads them (the last patch
    repeated), embedded, the padding given the learned pad token; (rows, tokens, dim), and each image's size."""
    patches, sizes = [], []
    for image in images:
        patch, size, _ = self._patchify_image(image, patch_size, f_patch_size)
        patches.append(patch)
        sizes.append(size)
    image_tokens = patches[0].shape[0]
    image_pad = (-image_tokens) % SEQ_MULTI_OF
    if image_pad:
        patches = [torch.cat([p, p[-1:].repeat(image_pad, 1)], dim=0) for p in patches]
    hidden = embedder(torch.cat(patches, dim=0))
    hidden = torch.where(image_padding.unsqueeze(-1), self.x_pad_token, hidden)
    return hidden.view(len(patches), image_tokens + image_pad, -1), sizes


def _text_tokens(self, cap_feats, text_padding, text_keys, text_freqs):
    """The captions embedded at their fixed length (a multiple of 32), the padding given the pad token, refined."""
    rows, text = len(cap_feats), _to_multiple(cap_feats[0].shape[0])
    captions = torch.stack(list(cap_feats), dim=0)
    if captions.shape[1] < text:
        captions = torch.cat([captions, captions[:, -1:].expand(-1, text - captions.shape[1], -1)], dim=1)
    captions = self.cap_embedder(captions.flatten(0, 1)).view(rows, text, -1)
    captions = torch.where(text_padding.unsqueeze(-1), self.cap_pad_token, captions)
    for layer in self.context_refiner:
        captions = layer(captions, text_keys, text_freqs)
    return captions


def _freqs(self, image_ids, text_ids, rows: int, image_tokens: int):
    image_freqs = self.rope_embedder(image_ids).view(rows, image_tokens, -1)
    return image_freqs, self.rope_embedder(text_ids).unsqueeze(0).expand(rows, -1, -1)


def _device_forward(self, x, t, cap_feats, tables, hints, patch_size, f_patch_size):
    """The transformer's computation for one step, from its inputs, the host's tables and a ControlNet's `hints`
    (None, or {main layer: what is added after it}): every number it needs besides them comes from shapes, so
    dynamo traces it once per shape key."""
    key = f"{patch_size}-{f_patch_size}"
    rows = len(x)
    image_ids, text_ids, image_padding, text_padding, text_keys, keys = tables
    adaln = self.t_embedder(t * self.t_scale).type_as(x[0])
    hidden, sizes = _image_tokens(self, x, self.all_x_embedder[key], image_padding, patch_size, f_patch_size)
    image_freqs, text_freqs = _freqs(self, image_ids, text_ids, rows, hidden.shape[1])
    for layer in self.noise_refiner:
        hidden = layer(hidden, None, image_freqs, adaln, None, None, None)
    captions = _text_tokens(self, cap_feats, text_padding, text_keys, text_freqs)

    joint = torch.cat([hidden, captions], dim=1)
    freqs = torch.cat([image_freqs, text_freqs], dim=1)
    for index, layer in enumerate(self.layers):
        joint = layer(joint, keys, freqs, adaln, None, None, None)
        if hints is not None and index in hints:
            joint = joint + hints[index]
    joint = self.all_final_layer[key](joint, c=adaln)
    return self.unpatchify(list(joint.unbind(dim=0)), sizes, patch_size, f_patch_size)


def _controlnet_device_forward(self, x, t, cap_feats, control, tables, scale, patch_size, f_patch_size):
    """A ZImageControlNetModel's computation for one step (diffusers' forward at fixed lengths): the control
    latents as tokens, steered through its refiner-stage blocks where it has them (the published 2.x layout), then
    its blocks beside the main layers; returns the hints, scaled, in the order of control_layers_places."""
    key = f"{patch_size}-{f_patch_size}"
    rows = len(x)
    image_ids, text_ids, image_padding, text_padding, text_keys, keys = tables
    adaln = self.t_embedder(t * self.t_scale).type_as(x[0])
    hidden, _ = _image_tokens(self, x, self.all_x_embedder[key], image_padding, patch_size, f_patch_size)
    controls = list(control.unbind(dim=0))
    control, _ = _image_tokens(
        self, controls, self.control_all_x_embedder[key], image_padding, patch_size, f_patch_size
    )
    image_freqs, text_freqs = _freqs(self, image_ids, text_ids, rows, hidden.shape[1])

    refiner_hints = {}
    if self.add_control_noise_refiner is not None:
        blocks = {"control_layers": self.control_layers, "control_noise_refiner": self.control_noise_refiner}
        for block in blocks[self.add_control_noise_refiner]:
            control = block(control, hidden, None, image_freqs, adaln)
        *found, control = control.unbind(dim=0)
        refiner_hints = {index: found[n] * scale for n, index in enumerate(self.control_refiner_layers_places)}
    for index, layer in enumerate(self.noise_refiner):
        hidden = layer(hidden, None, image_freqs, adaln, None, None, None)
        if index in refiner_hints:
            hidden = hidden + refiner_hints[index]
    captions = _text_tokens(self, cap_feats, text_padding, text_keys, text_freqs)
    if self.add_control_noise_refiner is None:  # the 1.0 layout: plain blocks refine the control alone
        for layer in self.control_noise_refiner:
            control = layer(control, None, image_freqs, adaln)

    joint = torch.cat([hidden, captions], dim=1)
    freqs = torch.cat([image_freqs, text_freqs], dim=1)
    control = torch.cat([control, captions], dim=1)
    for block in self.control_layers:
        control = block(control, joint, keys, freqs, adaln)
    return tuple(hint * scale for hint in control.unbind(dim=0)[:-1])


def install(pipe, hooks) -> None:
    """The fixed-length text path on this pipeline and its transformer, as removable hooks."""
    install_on_pipeline(pipe, hooks)
    _install_on(pipe.transformer, static_forward, _device_forward, "captions of a fixed length", hooks)


def install_on_controlnet(controlnet, hooks, label: str) -> None:
    """The same path on a ZImageControlNetModel (`label`: its name in the hooks)."""
    _install_on(controlnet, static_controlnet_forward, _controlnet_device_forward, f"{label} at fixed lengths", hooks)


def _install_on(module, wrapper, device_forward, name: str, hooks) -> None:
    hooks.wrap(module, "forward", name, lambda original: types.MethodType(wrapper(original), module))
    setattr(module, DEVICE_FORWARD, types.MethodType(device_forward, module))
    hooks.add(f"{name}: the device part", lambda: delattr(module, DEVICE_FORWARD))


def precompute_rope(transformer, device, hooks) -> None:
    """The rotary tables on the device before the first step: diffusers' RopeEmbedder makes them at its first call
    inside a `torch.device("cpu")` block, which dynamo cannot trace (compile.trace_once); the same tables either way.
    Removing the hook leaves them to be made at the first call again."""
    rope = transformer.rope_embedder
    if rope.freqs_cis is None:
        tables = rope.precompute_freqs_cis(rope.axes_dims, rope.axes_lens, theta=rope.theta)
        rope.freqs_cis = [table.to(device) for table in tables]
        hooks.add("rotary tables made ahead", lambda: setattr(rope, "freqs_cis", None))


def install_on_pipeline(pipe, hooks) -> None:
    """The fixed-length text on the pipeline object (each img2img or inpaint one made from its components too)."""
    hooks.wrap(pipe, "_encode_prompt", "text of a fixed length", lambda _: types.MethodType(encode_prompt, pipe))
