"""Textual-inversion embeddings loaded into a pipeline's CLIP text encoders with diffusers' own loader, on the host
before the pipeline moves to its device: new rows of each encoder's token table and new tokens of its tokenizer.
No shape the denoiser sees changes; the text-encoding graph (the table is one of its inputs) compiles at warmup."""

from __future__ import annotations

from tpugen.config.embeddings import SDXL_KEYS, Embedding, SkippedEmbedding, folder_embeddings, name_clashes
from tpugen.errors import InputError, one_line
from tpugen.families import Family


def _encoders(pipe, family: Family) -> list[tuple[object, object, str, str | None]]:
    """(tokenizer, text encoder, the encoder's attribute, the tensor of an SDXL file) for each CLIP encoder."""
    keys = SDXL_KEYS if len(family.clip_tokenizers) == 2 else (None,)
    parts = []
    for attribute, key in zip(family.clip_tokenizers, keys, strict=True):
        encoder = attribute.replace("tokenizer", "text_encoder")
        parts.append((getattr(pipe, attribute), getattr(pipe, encoder), encoder, key))
    return parts


def _check(pipe, family: Family, embedding: Embedding, where: str) -> None:
    """What diffusers' loader would refuse halfway, refused before anything changes: vectors of another width than
    an encoder's, or a token the tokenizer has already (a word of its vocabulary, or an embedding loaded before)."""
    if not hasattr(pipe, "load_textual_inversion"):
        raise InputError(f"{where}: {type(pipe).__name__} has no textual-inversion loader in diffusers")
    for (tokenizer, encoder, name, _), width in zip(_encoders(pipe, family), embedding.widths, strict=True):
        own = encoder.get_input_embeddings().weight.shape[-1]
        if width != own:
            raise InputError(
                f"{where}: {embedding.name!r} has vectors of {width} values and the model's {name} takes {own} "
                "(an embedding for another model)"
            )
        vocabulary = tokenizer.get_vocab()
        taken = [token for token in embedding.token_names() if token in vocabulary]
        if taken:
            raise InputError(
                f"{where}: {embedding.name!r}: the model's tokenizer has the token {taken[0]!r} already; rename the file"
            )


def _load(pipe, family: Family, embedding: Embedding) -> None:
    parts = _encoders(pipe, family)
    if len(parts) == 1:  # diffusers reads the file itself, in any format its loader knows
        tokenizer, encoder, _, _ = parts[0]
        pipe.load_textual_inversion(embedding.path, token=embedding.name, tokenizer=tokenizer, text_encoder=encoder)
        return
    # SDXL: a tensor for each encoder, as diffusers' documentation loads them.
    tensors = _read_tensors(embedding.path)
    for tokenizer, encoder, _, key in parts:
        pipe.load_textual_inversion(tensors[key], token=embedding.name, tokenizer=tokenizer, text_encoder=encoder)


def _read_tensors(path: str) -> dict:
    if path.lower().endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path, device="cpu")
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)


def load_embeddings(
    pipe, family: Family, embeddings: tuple[Embedding, ...], embeddings_dir: str | None, model: str
) -> tuple[tuple[Embedding, ...], tuple[SkippedEmbedding, ...]]:
    """model.embeddings (`embeddings`: each loads or it is an InputError naming it), then the files of a server's
    serve.embeddings_dir (each loads or is skipped, saying why). Returns (loaded, skipped)."""
    loaded: list[Embedding] = []
    for number, embedding in enumerate(embeddings):
        where = f"model.embeddings[{number}]"
        _check(pipe, family, embedding, where)
        try:
            _load(pipe, family, embedding)
        except Exception as exc:  # whatever diffusers' loader raises of a file is one line naming it
            raise InputError(f"{where}: {embedding.name!r}: diffusers' loader failed: {one_line(exc)}") from None
        loaded.append(embedding)
    skipped: list[SkippedEmbedding] = []
    if embeddings_dir is not None:
        found, skipped = folder_embeddings(embeddings_dir, family, model)
        given = {e.name for e in embeddings}
        for embedding in found:
            clash = name_clashes([*loaded, embedding], lambda i: "model.embeddings")
            if embedding.name in given or clash:
                why = "model.embeddings has one of this name" if embedding.name in given else clash[0][1]
                skipped.append(SkippedEmbedding(embedding.name, why, embedding.shape, embedding.vectors))
                continue
            try:
                _check(pipe, family, embedding, "serve.embeddings_dir")
                _load(pipe, family, embedding)
            except InputError as exc:
                why = exc.lines[0].removeprefix("serve.embeddings_dir: ")
                skipped.append(SkippedEmbedding(embedding.name, why, embedding.shape, embedding.vectors))
                continue
            except Exception as exc:  # a file that fails is skipped: the server starts without it
                why = f"diffusers' loader failed: {one_line(exc)}"
                skipped.append(SkippedEmbedding(embedding.name, why, embedding.shape, embedding.vectors))
                continue
            loaded.append(embedding)
    return tuple(loaded), tuple(skipped)
