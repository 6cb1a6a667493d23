"""CLIP text encoding as the AUTOMATIC1111 web UI does it, for the pipelines of SD 1.x/2.x and SDXL: each prompt in
75-token chunks (tpugen.families.prompt_syntax), every chunk through the text encoder, its tokens weighted with the
mean-restoring rule, the chunks joined; the pipeline is then called with the embeddings instead of the text.

Runs once per batch, before the denoising loop, on the text encoders' device (lazily under XLA: one text-encoding
graph per shape key, chunk count included). Tokenizing is host work of a millisecond or so per prompt."""

from __future__ import annotations

from tpugen.errors import InputError
from tpugen.families.prompt_syntax import batch_tensors, chunk_prompt, pooled_of_first_chunk, weight_embeddings


def _read(texts: list[str], tokenizer, chunks: int):
    """(token ids, weights) of the texts, each (batch, chunks, 77), every text padded to `chunks` chunks."""
    return batch_tensors([chunk_prompt(text, tokenizer) for text in texts], tokenizer, chunk_count=chunks)


def final_layer_norm(encoder):
    """A CLIP text encoder's final layer norm: transformers 5 keeps it on the model, 4 on its text_model."""
    return getattr(encoder, "text_model", encoder).final_layer_norm


def _hidden(encoder, ids, device, *, layer: int | None, skip: int = 1):
    """The encoder's hidden states of (batch, chunks, 77) ids as (batch, chunks, 77, dim), and its first output
    (SDXL's second encoder: the projected pooled embedding), per chunk. `layer` None: SD's, the layer `skip` from
    the last (the web UI's clip skip; 1: the last hidden state) through the final layer norm; else that index of
    the hidden states (SDXL's -2, the penultimate, no norm)."""
    batch, chunks, tokens = ids.shape
    wanted = layer is not None or skip > 1
    output = encoder(ids.reshape(batch * chunks, tokens).to(device), output_hidden_states=wanted)
    if layer is not None:
        hidden = output.hidden_states[layer]
    elif skip > 1:
        layers = len(output.hidden_states) - 1  # the embeddings' output, then each layer's
        if skip > layers:
            raise InputError(f"clip skip {skip}: the text encoder has {layers} layers; at most {layers}")
        hidden = final_layer_norm(encoder)(output.hidden_states[-skip])
    else:
        hidden = output.last_hidden_state
    return hidden.reshape(batch, chunks, tokens, hidden.shape[-1]), output[0]


def sd_embeddings(pipe, prompts: list[str], negatives: list[str] | None, chunks: int, clip_skip: int = 1) -> dict:
    """prompt_embeds (and negative_prompt_embeds, for CFG) of an SD 1.x/2.x pipeline, (batch, chunks * 77, dim),
    read from the layer `clip_skip` from the last."""
    device = pipe._execution_device

    def embed(texts: list[str]):
        ids, weights = _read(texts, pipe.tokenizer, chunks)
        hidden, _ = _hidden(pipe.text_encoder, ids, device, layer=None, skip=clip_skip)
        return weight_embeddings(hidden, weights)

    arguments = {"prompt_embeds": embed(prompts)}
    if negatives is not None:
        arguments["negative_prompt_embeds"] = embed(negatives)
    return arguments


def sdxl_embeddings(pipe, prompts: list[str], negatives: list[str] | None, chunks: int) -> dict:
    """SDXL's four embeddings, as the web UI makes them: each encoder's penultimate hidden states weighted on their
    own, then joined along the features; the pooled embedding from the second encoder's first chunk, unweighted.
    An empty negative prompt is zeros, embeddings and pooled (the web UI's rule for SDXL)."""
    import torch

    device = pipe._execution_device

    def embed(texts: list[str]):
        parts, pooled = [], None
        for tokenizer, encoder in ((pipe.tokenizer, pipe.text_encoder), (pipe.tokenizer_2, pipe.text_encoder_2)):
            ids, weights = _read(texts, tokenizer, chunks)
            hidden, first = _hidden(encoder, ids, device, layer=-2)
            parts.append(weight_embeddings(hidden, weights))
            pooled = pooled_of_first_chunk(first, chunks)
        return torch.cat(parts, dim=-1), pooled

    embeddings, pooled = embed(prompts)
    arguments = {"prompt_embeds": embeddings, "pooled_prompt_embeds": pooled}
    if negatives is not None:
        embeddings, pooled = embed(negatives)
        # Data, not shape: a row's mask is 0 where its negative prompt is empty, so one graph takes any mix.
        kept = torch.tensor([0.0 if text == "" else 1.0 for text in negatives]).to(device)
        arguments["negative_prompt_embeds"] = embeddings * kept.view(-1, 1, 1).to(embeddings.dtype)
        arguments["negative_pooled_prompt_embeds"] = pooled * kept.view(-1, 1).to(pooled.dtype)
    return arguments
