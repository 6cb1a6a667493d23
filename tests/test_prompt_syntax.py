"""Prompts as the AUTOMATIC1111 web UI reads them: its emphasis syntax, its 75-token CLIP chunks and its weighting
rule, checked against the web UI's documented outputs and against arithmetic done by hand."""

from __future__ import annotations

import pytest
import torch

from tpugen.errors import InputError
from tpugen.families.parts import clip_tokenizer
from tpugen.families.prompt_syntax import (
    CHUNK_BREAK,
    PromptChunks,
    Segment,
    batch_tensors,
    chunk_prompt,
    pad_chunks,
    parse_attention,
    pooled_of_first_chunk,
    strip_syntax,
    weight_embeddings,
)

# The examples in the docstring of the web UI's `parse_prompt_attention` (modules/prompt_parser.py), with its
# outputs to the last bit: they are the behaviour to reproduce.
WEBUI_DOCSTRING = [
    ("normal text", [("normal text", 1.0)]),
    ("an (important) word", [("an ", 1.0), ("important", 1.1), (" word", 1.0)]),
    ("(unbalanced", [("unbalanced", 1.1)]),
    (r"\(literal\]", [("(literal]", 1.0)]),
    ("(unnecessary)(parens)", [("unnecessaryparens", 1.1)]),
    (
        "a (((house:1.3)) [on] a (hill:0.5), sun, (((sky))).",
        [
            ("a ", 1.0),
            ("house", 1.5730000000000004),
            (" ", 1.1),
            ("on", 1.0),
            (" a ", 1.1),
            ("hill", 0.55),
            (", sun, ", 1.1),
            ("sky", 1.4641000000000006),
            (".", 1.1),
        ],
    ),
]

# The web UI wiki's cheat sheet (Features#attention/emphasis) and the edges of its parser.
MORE_SYNTAX = [
    ("a ((word))", [("a ", 1.0), ("word", 1.1 * 1.1)]),
    ("a [word]", [("a ", 1.0), ("word", 1 / 1.1)]),
    ("a [[word]]", [("a ", 1.0), ("word", (1 / 1.1) * (1 / 1.1))]),
    ("a (word:1.5)", [("a ", 1.0), ("word", 1.5)]),
    ("a (word:0.25)", [("a ", 1.0), ("word", 0.25)]),
    ("a (word: 1.5) b", [("a ", 1.0), ("word: 1.5", 1.1), (" b", 1.0)]),  # no space before the number
    (r"anime_\(character\)", [("anime_(character)", 1.0)]),
    (r"a \\ b \[c\]", [("a \\ b [c]", 1.0)]),
    (r"a\b", [("ab", 1.0)]),  # a backslash before anything else is dropped
    ("a) b] c", [("a) b] c", 1.0)]),  # closing brackets with none open are text
    ("a:1.2) b", [("a:1.2) b", 1.0)]),
    ("(a:b)", [("a:b", 1.1)]),  # a colon without a number is text
    ("[a:1.5]", [("a:1.5", 1 / 1.1)]),  # only `(` takes a number
    ("[(a:2)]", [("a", 2 * (1 / 1.1))]),
    ("", [("", 1.0)]),
    ("a BREAK b", [("a", 1.0), CHUNK_BREAK, ("b", 1.0)]),
    ("a\nBREAK\n(b)", [("a", 1.0), CHUNK_BREAK, ("", 1.0), ("b", 1.1)]),
    ("a break b, BREAKfast, A_BREAK", [("a break b, BREAKfast, A_BREAK", 1.0)]),
    # A BREAK inside brackets is multiplied like the words around it and is then the word, as in the web UI.
    ("(a BREAK b)", [("a", 1.1), ("BREAK", -1.1), ("b", 1.1)]),
]


@pytest.mark.parametrize(("prompt", "expected"), WEBUI_DOCSTRING + MORE_SYNTAX)
def test_emphasis_is_read_as_the_web_ui_reads_it(prompt, expected):
    assert parse_attention(prompt) == [Segment(*s) for s in expected]


def test_a_number_that_is_not_one_is_an_input_error():
    with pytest.raises(InputError, match=r"the weight '1\.2\.3' is not a number"):
        parse_attention("a (b:1.2.3)")


@pytest.mark.parametrize(
    ("prompt", "text"),
    [
        ("a (red:1.5) circle on a [blue] background", "a red circle on a blue background"),
        (r"((masterpiece)), anime_\(character\), [[blurry]]", "masterpiece, anime_(character), blurry"),
        ("a BREAK b", "a b"),
        ("BREAK a BREAK BREAK b BREAK", "a b"),
        ("(unbalanced", "unbalanced"),
        ("(a BREAK b)", "a b"),
    ],
)
def test_strip_syntax_keeps_the_words(prompt, text):
    assert strip_syntax(prompt) == text


# The tiny built-ins' tokenizer: every byte a token, so a one-letter word is one token and "ab" two.
@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return clip_tokenizer(tmp_path_factory.mktemp("clip") / "vocab")[0]


@pytest.fixture(scope="module")
def sd2_tokenizer(tokenizer, tmp_path_factory):
    """The same vocabulary with a pad token that is not the end token, as SD 2.x's and SDXL's second encoder's."""
    from transformers import CLIPTokenizer

    folder = tmp_path_factory.mktemp("clip2")
    tokenizer.save_pretrained(folder)
    return CLIPTokenizer.from_pretrained(folder, pad_token="!")


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def test_a_short_prompt_is_one_chunk_of_77_with_its_weights(tokenizer):
    start, end = tokenizer.bos_token_id, tokenizer.eos_token_id
    chunks = chunk_prompt("(ab) c", tokenizer)
    assert chunks.chunk_count == 1
    assert chunks.token_ids == ((start, *ids_of(tokenizer, "ab c"), *[end] * 73),)
    assert chunks.weights == ((1.0, 1.1, 1.1, 1.0, *[1.0] * 73),)


def test_chunks_hold_75_tokens(tokenizer):
    a = ids_of(tokenizer, "a")[0]
    assert chunk_prompt(" ".join(["a"] * 75), tokenizer).chunk_count == 1
    two = chunk_prompt(" ".join(["a"] * 76), tokenizer)
    assert two.chunk_count == 2
    assert two.token_ids[0][1:76] == (a,) * 75
    assert two.token_ids[1][:3] == (tokenizer.bos_token_id, a, tokenizer.eos_token_id)
    assert all(len(ids) == 77 for ids in two.token_ids) and all(len(w) == 77 for w in two.weights)


# Each chunk's first word ("" for a chunk with none): an empty chunk is what BREAK leaves at the start or twice.
@pytest.mark.parametrize(
    ("prompt", "firsts"),
    [("a BREAK b", "ab"), ("a BREAK", "a"), ("BREAK a", ["", "a"]), ("a BREAK BREAK b", ["a", "", "b"])],
)
def test_break_starts_a_chunk(tokenizer, prompt, firsts):
    chunks = chunk_prompt(prompt, tokenizer)
    end = tokenizer.eos_token_id
    assert [ids[1] for ids in chunks.token_ids] == [ids_of(tokenizer, w)[0] if w else end for w in firsts]
    assert all(ids[2:] == (end,) * 75 for ids in chunks.token_ids)


def test_break_in_brackets_is_the_word_with_a_negative_weight(tokenizer):
    chunks = chunk_prompt("(a BREAK b)", tokenizer)
    assert chunks.chunk_count == 1
    assert chunks.token_ids[0][1:8] == tuple(ids_of(tokenizer, "a BREAK b"))  # a, b r e a k, b
    assert chunks.weights[0][1:9] == (1.1, -1.1, -1.1, -1.1, -1.1, -1.1, 1.1, 1.0)


def comma_prompt() -> str:
    # 71 tokens of "a", a comma as the 72nd (index 71), then ten "b": the chunk fills 4 tokens after the comma.
    return " ".join(["a"] * 71) + ", " + " ".join(["b"] * 10)


@pytest.mark.parametrize(("backtrack", "first_chunk_tokens"), [(20, 72), (4, 72), (3, 75), (0, 75)])
def test_the_words_after_a_late_comma_move_to_the_next_chunk(tokenizer, backtrack, first_chunk_tokens):
    end, b = tokenizer.eos_token_id, ids_of(tokenizer, "b")[0]
    chunks = chunk_prompt(comma_prompt(), tokenizer, comma_backtrack=backtrack)
    first, second = chunks.token_ids
    assert first[1 + first_chunk_tokens :] == (end,) * (76 - first_chunk_tokens)
    assert first[first_chunk_tokens] == (ids_of(tokenizer, ",")[0] if first_chunk_tokens == 72 else b)
    assert second[1 : 1 + 82 - first_chunk_tokens] == (b,) * (82 - first_chunk_tokens)
    assert second[1 + 82 - first_chunk_tokens] == end


def test_moved_words_keep_their_weights(tokenizer):
    prompt = " ".join(["a"] * 71) + ", (b b b:1.5) b"
    chunks = chunk_prompt(prompt, tokenizer)
    assert chunks.weights[1][:6] == (1.0, 1.5, 1.5, 1.5, 1.0, 1.0)


def test_padding_after_the_end_token_is_the_pad_token_where_it_differs(sd2_tokenizer):
    start, end, pad = sd2_tokenizer.bos_token_id, sd2_tokenizer.eos_token_id, sd2_tokenizer.pad_token_id
    assert pad != end
    chunks = chunk_prompt("ab", sd2_tokenizer)
    assert chunks.token_ids == ((start, *ids_of(sd2_tokenizer, "ab"), end, *[pad] * 73),)
    full = chunk_prompt(" ".join(["a"] * 75), sd2_tokenizer)
    assert full.token_ids[0][-1] == end


def test_more_chunks_than_max_chunks_is_an_input_error_naming_both(tokenizer):
    prompt = " ".join(["a"] * 76)
    assert chunk_prompt(prompt, tokenizer, max_chunks=2).chunk_count == 2
    with pytest.raises(InputError) as raised:
        chunk_prompt(prompt, tokenizer, max_chunks=1)
    assert raised.value.lines == ["a prompt needs 2 chunks of 75 tokens, more than max_chunks (1)"]


def test_without_emphasis_the_text_is_literal(tokenizer):
    chunks = chunk_prompt("(a) BREAK b", tokenizer, emphasis=False)
    assert chunks.chunk_count == 1
    assert chunks.token_ids[0][1:10] == tuple(ids_of(tokenizer, "(a) BREAK b"))
    assert set(chunks.weights[0]) == {1.0}


def test_a_batch_is_padded_to_its_longest_prompt_with_empty_chunks(tokenizer, sd2_tokenizer):
    for tok in (tokenizer, sd2_tokenizer):
        start, end, pad = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
        short, long = chunk_prompt("(a)", tok), chunk_prompt("a BREAK b", tok)
        ids, weights = batch_tensors([short, long], tok)
        assert ids.shape == weights.shape == (2, 2, 77)
        assert ids.dtype == torch.int64 and weights.dtype == torch.float32
        assert ids[0, 1].tolist() == [start, end, *[pad] * 75]
        assert weights[0, 1].tolist() == [1.0] * 77
        assert weights[0, 0, 1].item() == pytest.approx(1.1)
        assert ids[1].tolist() == [list(c) for c in long.token_ids]
        assert batch_tensors([short], tok, chunk_count=3)[0].shape == (1, 3, 77)
    with pytest.raises(ValueError):
        pad_chunks(chunk_prompt("a BREAK b", tokenizer), 1, tokenizer)


def test_weighting_restores_each_chunks_mean():
    # Worked by hand. Chunk 1: z = [[1,2],[3,4],[5,6]], weights [1,2,1]: mean 21/6; weighted [[1,2],[6,8],[5,6]],
    # mean 28/6; scaled by 21/28 = 0.75. Chunk 2: z = 2 everywhere, weights [1,1,4]: mean 2; weighted mean 24/6 = 4;
    # scaled by 0.5.
    chunk1 = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]])
    chunk2 = torch.full((1, 3, 2), 2.0)
    weights = torch.tensor([[[1.0, 2.0, 1.0], [1.0, 1.0, 4.0]]])
    expected = torch.tensor([[[0.75, 1.5], [4.5, 6.0], [3.75, 4.5], [1.0, 1.0], [1.0, 1.0], [4.0, 4.0]]])
    assert torch.allclose(weight_embeddings(torch.stack([chunk1, chunk2], dim=1), weights), expected)
    assert torch.allclose(weight_embeddings([chunk1, chunk2], weights), expected)


def test_the_web_uis_batch_mean_and_tpugens_per_prompt_mean():
    # Row A as chunk 1 above; row B = [[0,1],[2,0],[4,0]] with weights 1 (sum 7). Over the batch: mean 28/12,
    # weighted 35/12, so both rows are scaled by 0.8. Per prompt: A by 0.75, B left as it is.
    z = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], [[0.0, 1.0], [2.0, 0.0], [4.0, 0.0]]]).unsqueeze(1)
    weights = torch.tensor([[[1.0, 2.0, 1.0]], [[1.0, 1.0, 1.0]]])
    batch = torch.tensor([[[0.8, 1.6], [4.8, 6.4], [4.0, 4.8]], [[0.0, 0.8], [1.6, 0.0], [3.2, 0.0]]])
    per_prompt = torch.tensor([[[0.75, 1.5], [4.5, 6.0], [3.75, 4.5]], [[0.0, 1.0], [2.0, 0.0], [4.0, 0.0]]])
    assert torch.allclose(weight_embeddings(z, weights, mean_over="batch"), batch)
    assert torch.allclose(weight_embeddings(z, weights), per_prompt)


def test_weighting_keeps_the_dtype_and_reads_nothing_back():
    z = torch.ones(2, 3, 77, 8, dtype=torch.bfloat16)
    assert weight_embeddings(z, torch.ones(2, 3, 77)).dtype == torch.bfloat16
    # On the meta device a read to the host (.item(), a branch on a value) raises: there is none.
    out = weight_embeddings(torch.empty(2, 3, 77, 8, device="meta"), torch.empty(2, 3, 77, device="meta"))
    assert out.shape == (2, 3 * 77, 8)


def test_sdxl_pools_each_prompts_first_chunk():
    # Two prompts of three chunks encoded as six rows, in (prompt, chunk) order.
    pooled = torch.arange(12.0).reshape(6, 2)
    assert pooled_of_first_chunk(pooled, 3).tolist() == [[0.0, 1.0], [6.0, 7.0]]


def test_the_record_is_plain_data():
    chunks = PromptChunks(((1, 2),), ((1.0, 1.0),))
    assert chunks.chunk_count == 1 and chunks == PromptChunks(((1, 2),), ((1.0, 1.0),))
