"""How many 75-token chunks an image's prompts take, as the web UI reads them: found when a run is planned, since
the chunk count is part of its shape keys (tpugen.plan). Short prompts are counted without a tokenizer; a long one
reads the model's first CLIP tokenizer from disk (a built-in's folder, a local folder, or the hub's tokenizer files
alone), once per model, with the run's textual-inversion embeddings added to it as diffusers' loader adds them."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from tpugen.errors import InputError, one_line
from tpugen.families import FAMILIES, Family
from tpugen.families.prompt_syntax import chunk_prompt, parse_attention, surely_one_chunk
from tpugen.models import ModelSource


@dataclass(frozen=True)
class PromptReader:
    """A run's (or a server's) reading of prompts: its syntax, its family's encoders, its bound and its model."""

    syntax: str  # "webui" | "plain" (RunConfig.prompt_syntax)
    family: Family
    max_chunks: int
    source: ModelSource | None = None
    revision: str | None = None
    # (name, vectors) of each textual-inversion embedding the text encoders hold: a prompt's NAME is that many tokens
    embeddings: tuple[tuple[str, int], ...] = ()

    @classmethod
    def of(cls, run, embeddings=None) -> PromptReader:
        """The reader of a resolved run (tpugen.config.ResolvedRun), with its embeddings or, where given, the
        `embeddings` (tpugen.config.embeddings.Embedding) an engine holds."""
        config = run.config
        held = run.embeddings if embeddings is None else embeddings
        return cls(
            config.prompt_syntax,
            FAMILIES[run.family],
            config.max_chunks,
            run.model_source,
            config.model.revision,
            tuple(sorted((e.name, e.vectors) for e in held)),
        )

    @property
    def chunked(self) -> bool:
        """Whether prompts are read in chunks with the web UI's syntax (CLIP families under prompt_syntax webui)."""
        return self.syntax == "webui" and bool(self.family.clip_tokenizers)

    def chunks(self, prompt: str, negative_prompt: str = "", *, cfg: bool = True) -> int:
        """The chunks the longer of the two takes (the prompt's alone without CFG, which reads no negative
        prompt; 1 where prompts are not chunked); more than max_chunks, or a weight that is no number, is an
        InputError naming the prompt, so a bad prompt is refused at the door, never in its batch."""
        texts = [(prompt, "prompt")] + ([(negative_prompt, "negative_prompt")] if cfg else [])
        if not self.chunked:
            if self.syntax == "webui":  # the syntax is taken out later: read now, so a bad weight is a 422
                for text, what in texts:
                    _named(parse_attention, text, what)
            return 1
        return max(self._count(text, what) for text, what in texts)

    @property
    def _short_prompts_need_no_tokenizer(self) -> bool:
        # surely_one_chunk counts a prompt's bytes, and a token spans at least one: an embedding's name does too
        # unless it has more vectors than its name has bytes.
        return all(vectors <= len("".join(name.split()).encode()) for name, vectors in self.embeddings)

    def _count(self, text: str, what: str) -> int:
        if self._short_prompts_need_no_tokenizer and _named(surely_one_chunk, text, what):
            return 1
        tokenizer = _tokenizer(self.source, self.revision, self.family.clip_tokenizers[0], self.embeddings)
        return _named(lambda t: chunk_prompt(t, tokenizer, max_chunks=self.max_chunks), text, what).chunk_count


def _named(read, text: str, what: str):
    """read(text), its InputError's line led by which prompt it was."""
    try:
        return read(text)
    except InputError as exc:
        shown = text if len(text) <= 60 else text[:57] + "..."
        raise InputError(f"{what} {shown!r}: {exc.lines[0]}") from None


@functools.lru_cache(maxsize=8)
def _tokenizer(source: ModelSource | None, revision: str | None, folder: str, embeddings: tuple = ()):
    from transformers import CLIPTokenizer

    try:
        tokenizer = CLIPTokenizer.from_pretrained(str(_model_folder(source, revision, folder) / folder))
    except (OSError, ValueError) as exc:
        where = source.ref if source else "the model"
        raise InputError(f"a long prompt needs {where}'s {folder} to count its tokens: {one_line(exc)}") from None
    for name, vectors in embeddings:  # the tokens diffusers' load_textual_inversion adds: NAME, NAME_1, ...
        tokenizer.add_tokens([name, *(f"{name}_{i}" for i in range(1, vectors))])
    return tokenizer


def _model_folder(source: ModelSource | None, revision: str | None, folder: str) -> Path:
    if source is None:
        raise InputError("a long prompt needs the model's tokenizer to count its tokens, and no model is named")
    if source.kind == "builtin":
        from tpugen.tiny import builtin_path

        return builtin_path(source.ref)
    if source.kind == "local":
        return Path(source.ref)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(source.ref, revision=revision, allow_patterns=[f"{folder}/*"]))
