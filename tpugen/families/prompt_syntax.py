"""Prompts as the AUTOMATIC1111 web UI reads them: emphasis, BREAK, 75-token CLIP chunks and token weights."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NamedTuple

from tpugen.errors import InputError

if TYPE_CHECKING:
    import torch

# The web UI's chunk: 75 prompt tokens between a start and an end token, 77 in all (CLIP's context).
CHUNK_TOKENS = 75
# Its "comma_padding_backtrack" setting's default: a chunk that fills up within this many tokens of its last
# comma ends at the comma, and the words after it start the next chunk.
COMMA_BACKTRACK = 20

ROUND = 1.1  # `(a)` multiplies by this, `[a]` by its inverse
SQUARE = 1 / ROUND


class Segment(NamedTuple):
    """A run of prompt text and the weight its tokens get."""

    text: str
    weight: float


# The web UI marks a BREAK with the weight -1 and ends a chunk only where the mark still weighs -1: a BREAK inside
# brackets is multiplied like the text around it and reaches the tokenizer as the word, with a negative weight.
# tpugen keeps that, so a prompt means what it means there.
CHUNK_BREAK = Segment("BREAK", -1.0)

# Each match is one thing the scanner acts on, tried in this order at every position: an escape (a backslash and
# one of ()[]\, or a lone backslash, which the web UI drops), an opening bracket, `:weight)` closing a `(`, a
# closing bracket, then text (a run without brackets, backslashes or colons, or one colon).
_PIECE = re.compile(
    r"""
    \\(?P<escaped>[()\[\]\\]?)
    | (?P<open>[(\[])
    | :(?P<weight>[+-]?[.\d]+)\)
    | (?P<close>[)\]])
    | (?P<text>[^\\()\[\]:]+|:)
    """,
    re.X,
)
_BREAK = re.compile(r"\s*\bBREAK\b\s*")


def parse_attention(text: str) -> list[Segment]:
    """The prompt's text runs and their weights, as the web UI's `parse_prompt_attention` reads them.

    `(a)` multiplies a's weight by 1.1, `[a]` by 1/1.1, `(a:w)` by w (a number right after the colon), nested
    brackets multiply; `\\(`, `\\)`, `\\[`, `\\]` and `\\\\` are the characters themselves. A bracket left open weighs on
    the rest of the prompt; a closing bracket with none open is text. BREAK (uppercase, a word of its own) is
    CHUNK_BREAK. Neighbouring runs of equal weight are merged.
    """
    segments: list[list] = []  # [text, weight], weights multiplied in place as brackets close
    round_opened: list[int] = []  # where each open `(` started, as an index into segments
    square_opened: list[int] = []

    def multiply_from(start: int, factor: float) -> None:
        for segment in segments[start:]:
            segment[1] *= factor

    for match in _PIECE.finditer(text):
        piece, weight = match.group(0), match.group("weight")
        if match.group("escaped") is not None:
            segments.append([match.group("escaped"), 1.0])
        elif piece == "(":
            round_opened.append(len(segments))
        elif piece == "[":
            square_opened.append(len(segments))
        elif weight is not None and round_opened:
            multiply_from(round_opened.pop(), _number(weight))
        elif piece == ")" and round_opened:
            multiply_from(round_opened.pop(), ROUND)
        elif piece == "]" and square_opened:
            multiply_from(square_opened.pop(), SQUARE)
        else:
            for number, part in enumerate(_BREAK.split(piece)):
                if number:
                    segments.append(list(CHUNK_BREAK))
                segments.append([part, 1.0])

    # Unclosed brackets weigh on everything after them: every `(` in the order they opened, then every `[`
    # (the web UI's order, which decides the last bits of the weights).
    for start in round_opened:
        multiply_from(start, ROUND)
    for start in square_opened:
        multiply_from(start, SQUARE)

    merged: list[Segment] = []
    for piece, weight in segments or [["", 1.0]]:
        if merged and merged[-1].weight == weight:
            merged[-1] = Segment(merged[-1].text + piece, weight)
        else:
            merged.append(Segment(piece, weight))
    return merged


def _number(weight: str) -> float:
    """The weight's number; an InputError naming it (the caller names the prompt: tpugen.prompt_reading)."""
    try:
        return float(weight)
    except ValueError:
        raise InputError(f"the weight {weight!r} is not a number") from None


def strip_syntax(text: str) -> str:
    """The prompt's words without the emphasis syntax, for text encoders that are not CLIP (T5, Qwen, Mistral):
    brackets and weights dropped, escapes as their characters, each BREAK a space (inside brackets too: there
    the web UI's CLIP reading keeps the word, which means nothing to another encoder)."""
    parts, current = [], []
    for segment in parse_attention(text):
        if segment.text == CHUNK_BREAK.text and segment.weight < 0:  # the mark, multiplied or not
            parts.append("".join(current))
            current = []
        else:
            current.append(segment.text)
    parts.append("".join(current))
    return " ".join(part for part in parts if part)


def surely_one_chunk(text: str) -> bool:
    """Whether the prompt takes one chunk whatever the tokenizer, read without one: ASCII text, no BREAK, and at
    most 75 characters outside brackets and spaces (CLIP's byte-level BPE: a token spans at least one byte, and
    spaces are none). Other text is the tokenizer's to count: its normalizing and lowercasing can lengthen it
    (U+023A is 2 bytes of UTF-8, its lower case 3)."""
    if not text.isascii():
        return False
    segments = parse_attention(text)
    if any(segment.text == CHUNK_BREAK.text and segment.weight < 0 for segment in segments):
        return False
    return (
        sum(len("".join(segment.text.split()).encode(errors="surrogatepass")) for segment in segments) <= CHUNK_TOKENS
    )


@dataclass(frozen=True)
class PromptChunks:
    """One prompt as a CLIP text encoder takes it: chunks of 77 token ids (start, 75 tokens, end), each token's
    weight beside it (1.0 for the start, end and padding tokens)."""

    token_ids: tuple[tuple[int, ...], ...]
    weights: tuple[tuple[float, ...], ...]

    @property
    def chunk_count(self) -> int:
        return len(self.token_ids)


def chunk_prompt(
    text: str,
    tokenizer,
    *,
    max_chunks: int | None = None,
    emphasis: bool = True,
    comma_backtrack: int = COMMA_BACKTRACK,
) -> PromptChunks:
    """The prompt in chunks of 75 tokens, as the web UI's CLIP text processing makes them.

    `tokenizer` has the interface of transformers' CLIPTokenizer (its bos, eos and pad ids, token lookups, calls).
    A chunk ends when it holds 75 tokens, at a BREAK, or at its last comma when that comma is within
    `comma_backtrack` tokens of the 75th (0: never); it is padded to 75 with the end token, and every token after
    its first end token becomes the pad token where the tokenizer's differs (SD 2.x, SDXL's second encoder).
    `emphasis=False` reads the text literally (the web UI's emphasis "None": no brackets, no BREAK), still in
    chunks. More chunks than `max_chunks` is an InputError naming both.

    A textual-inversion embedding the tokenizer holds (tpugen.config.embeddings) takes a token per vector, as
    diffusers' maybe_convert_prompt expands its name, with the weight of the text around it; as in the web UI, an
    embedding that does not fit in what is left of a chunk starts the next one.
    """
    segments = parse_attention(text) if emphasis else [Segment(text, 1.0)]
    tokens = tokenizer([s.text for s in segments], add_special_tokens=False, truncation=False, verbose=False)
    comma = tokenizer.convert_tokens_to_ids(",</w>")
    if tokenizer.convert_ids_to_tokens(comma) != ",</w>":  # not in the vocabulary: no comma rule
        comma = None
    special = _SpecialTokens.of(tokenizer)
    vectors_of = embedding_vectors(tokenizer)

    chunks: list[tuple[list[int], list[float]]] = []
    ids: list[int] = []
    weights: list[float] = []
    last_comma = -1  # where in `ids` the chunk's last comma is

    def close() -> None:
        nonlocal ids, weights, last_comma
        chunks.append(special.frame(ids, weights))
        ids, weights, last_comma = [], [], -1

    for segment, segment_ids in zip(segments, tokens["input_ids"], strict=True):
        if segment == CHUNK_BREAK:
            close()
            continue
        for token in segment_ids:
            if token == comma:
                last_comma = len(ids)
            elif len(ids) == CHUNK_TOKENS and last_comma != -1 and CHUNK_TOKENS - last_comma <= comma_backtrack:
                moved = ids[last_comma + 1 :], weights[last_comma + 1 :]
                del ids[last_comma + 1 :], weights[last_comma + 1 :]
                close()
                ids, weights = moved
            if len(ids) == CHUNK_TOKENS:
                close()
            vectors = vectors_of.get(token, (token,))
            if len(ids) + len(vectors) > CHUNK_TOKENS:
                close()
            ids.extend(vectors)
            weights.extend([segment.weight] * len(vectors))
    if ids or not chunks:
        close()

    if max_chunks is not None and len(chunks) > max_chunks:
        raise InputError(
            f"a prompt needs {len(chunks)} chunks of {CHUNK_TOKENS} tokens, more than max_chunks ({max_chunks})"
        )
    return PromptChunks(tuple(tuple(c[0]) for c in chunks), tuple(tuple(c[1]) for c in chunks))


def embedding_vectors(tokenizer) -> dict[int, tuple[int, ...]]:
    """The multi-vector textual-inversion embeddings a tokenizer holds, as diffusers' loader adds them (tokens NAME,
    NAME_1, ... NAME_{n-1}): NAME's id -> the ids of all n, which a prompt's NAME stands for."""
    added = getattr(tokenizer, "added_tokens_encoder", None) or {}
    found = {}
    for token, first in added.items():
        ids, number = [first], 1
        while f"{token}_{number}" in added:
            ids.append(added[f"{token}_{number}"])
            number += 1
        if number > 1:
            found[first] = tuple(ids)
    return found


@dataclass(frozen=True)
class _SpecialTokens:
    start: int
    end: int
    pad: int

    @classmethod
    def of(cls, tokenizer) -> _SpecialTokens:
        end = tokenizer.eos_token_id
        return cls(tokenizer.bos_token_id, end, end if tokenizer.pad_token_id is None else tokenizer.pad_token_id)

    def frame(self, ids: list[int], weights: list[float]) -> tuple[list[int], list[float]]:
        """A chunk of 77 from up to 75 tokens: start, the tokens, end tokens to fill it, then the pad rule."""
        filler = CHUNK_TOKENS - len(ids)
        chunk = [self.start, *ids] + [self.end] * (filler + 1)
        if self.pad != self.end:
            first_end = chunk.index(self.end)
            chunk[first_end + 1 :] = [self.pad] * (len(chunk) - first_end - 1)
        return chunk, [1.0, *weights] + [1.0] * (filler + 1)


def pad_chunks(prompt: PromptChunks, count: int, tokenizer) -> PromptChunks:
    """The prompt with empty chunks (start, end, padding; weights 1.0) added up to `count` chunks, as the web UI
    fills the shorter prompts of a batch."""
    if count < prompt.chunk_count:
        raise ValueError(f"a prompt of {prompt.chunk_count} chunks cannot be padded to {count}")
    empty_ids, empty_weights = _SpecialTokens.of(tokenizer).frame([], [])
    extra = count - prompt.chunk_count
    return PromptChunks(
        prompt.token_ids + (tuple(empty_ids),) * extra, prompt.weights + (tuple(empty_weights),) * extra
    )


def batch_tensors(
    prompts: Sequence[PromptChunks], tokenizer, *, chunk_count: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's token ids (int64) and weights (float32), each (batch, chunks, 77): every prompt padded to
    `chunk_count` (default: the longest prompt's count)."""
    import torch

    count = chunk_count if chunk_count is not None else max(p.chunk_count for p in prompts)
    padded = [pad_chunks(p, count, tokenizer) for p in prompts]
    ids = torch.tensor([p.token_ids for p in padded], dtype=torch.int64)
    weights = torch.tensor([p.weights for p in padded], dtype=torch.float32)
    return ids, weights


def weight_embeddings(
    hidden_states: torch.Tensor | Sequence[torch.Tensor],
    weights: torch.Tensor,
    *,
    mean_over: Literal["prompt", "batch"] = "prompt",
) -> torch.Tensor:
    """The web UI's emphasis ("Original") on a text encoder's output, chunks concatenated: (batch, chunks*77, dim).

    `hidden_states` is (batch, chunks, 77, dim), or one (batch, 77, dim) tensor a chunk; `weights` is
    (batch, chunks, 77). Each chunk is multiplied token by token by its weights, then scaled so its mean is what it
    was. The web UI takes that mean over the whole batch's chunk (`mean_over="batch"`); tpugen's default takes it
    over each prompt's chunk, so an image does not depend on what else is in its batch (padding rows included).
    The two agree whenever a batch holds one prompt, as every web UI API request does. Torch operations only,
    no reads to the host: it runs inside a compiled graph. Computed in float32, returned in the input's dtype.
    """
    import torch

    if mean_over not in ("prompt", "batch"):
        raise ValueError(f"mean_over is 'prompt' or 'batch', not {mean_over!r}")
    if not isinstance(hidden_states, torch.Tensor):
        hidden_states = torch.stack(list(hidden_states), dim=1)
    z = hidden_states.float()
    dims = (0, 2, 3) if mean_over == "batch" else (2, 3)
    weights = weights.to(device=z.device, dtype=z.dtype)
    weighted = z * weights.unsqueeze(-1)
    weighted = weighted * (z.mean(dim=dims, keepdim=True) / weighted.mean(dim=dims, keepdim=True))
    # A chunk whose weights are all 1 is left as it is, exactly: the web UI's arithmetic gives it back unchanged
    # too (its two means are one computation), but two reductions of a mean near 0 (a text encoder whose final
    # layer norm has no bias) can differ in their last bits, and their ratio would then scale the whole chunk.
    # A select on data, not a branch: the same graph for any weights.
    plain = (weights == 1).all(dim=dims[:-1], keepdim=True).unsqueeze(-1)
    z = torch.where(plain, z, weighted)
    batch, chunks, tokens, dim = z.shape
    return z.reshape(batch, chunks * tokens, dim).to(hidden_states.dtype)


def pooled_of_first_chunk(pooled: torch.Tensor, chunk_count: int) -> torch.Tensor:
    """SDXL's pooled text embedding as the web UI takes it: the second encoder's pooled output of each prompt's
    first chunk, unweighted. `pooled` is (batch*chunks, dim), rows in (prompt, chunk) order, as an encoder run on
    the ids reshaped to (batch*chunks, 77) gives it; the result is (batch, dim)."""
    return pooled.reshape(-1, chunk_count, pooled.shape[-1])[:, 0]
