"""Prompts read as the web UI reads them, through whole runs and the server: chunk counts are shape keys, weights
are in the images (checked against diffusers' pipeline fed embeddings this file works out by hand)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import COMPILED_VS_EAGER, FIRST_CALL, cold_graphs, generate, plain_diffusers_images
from PIL import Image

from tpugen.errors import InputError
from tpugen.families import FAMILIES
from tpugen.families.clip_text import final_layer_norm
from tpugen.families.parts import clip_tokenizer
from tpugen.families.prompt_syntax import surely_one_chunk
from tpugen.models import ModelSource
from tpugen.prompt_reading import PromptReader

# The tiny built-ins' tokenizer makes every byte of a word a token: "ab" is two tokens.
WEIGHTED = "a (red:1.5) circle on a [blue] background"
LONG = " ".join(["ab"] * 45)  # 90 tokens: two chunks, 75 and 15
# tiny-shapes' tokenizer makes each of its words one token: 91 tokens, two chunks of 75 and 16.
LONG_SHAPES = " ".join(["a red circle on a blue background"] * 13)


# ---------------------------------------------------------------- counting chunks (no device)


@pytest.mark.parametrize(
    ("prompt", "one"),
    [
        ("a" * 75, True),
        ("a" * 76, False),
        (" ".join(["abc"] * 25), True),  # 75 letters, the spaces are no tokens
        ("(" + "a" * 75 + ":1.3)", True),  # brackets and weights are no tokens either
        ("\u00e9" * 3, False),  # not ASCII: the tokenizer's to count (its normalizing can lengthen text)
        ("a photo of " + "\u023a" * 30, False),  # 69 bytes, 93 tokens of CLIP's vocabulary once lowercased
        ("a BREAK b", False),
        ("", True),
    ],
)
def test_a_prompt_is_surely_one_chunk_only_when_no_tokenizer_could_make_two(prompt, one):
    assert surely_one_chunk(prompt) is one


@pytest.fixture(scope="module")
def local_model(tmp_path_factory):
    """A model folder with the tiny built-ins' CLIP tokenizer and nothing else: all counting needs."""
    folder = tmp_path_factory.mktemp("model")
    clip_tokenizer(folder / "scratch")[0].save_pretrained(folder / "tokenizer")
    return ModelSource("local", str(folder))


def reader(source, family="sd", syntax="webui", max_chunks=3) -> PromptReader:
    return PromptReader(syntax, FAMILIES[family], max_chunks, source)


def test_chunks_are_counted_with_the_models_tokenizer(local_model):
    sd = reader(local_model)
    assert sd.chunks(WEIGHTED) == 1
    assert sd.chunks(LONG) == 2
    assert sd.chunks("a cat", negative_prompt=LONG) == 2  # the longer of the two
    assert sd.chunks(" ".join(["ab"] * 70)) == 2  # 140 tokens
    assert sd.chunks("a BREAK b BREAK c") == 3
    assert reader(local_model, family="sdxl").chunks(LONG) == 2


def test_without_cfg_the_negative_prompt_is_not_read_and_does_not_count(local_model):
    assert reader(local_model).chunks("a cat", negative_prompt=LONG, cfg=False) == 1
    assert reader(local_model, max_chunks=1).chunks("a cat", negative_prompt=LONG * 3, cfg=False) == 1


def test_a_bad_weight_is_refused_at_the_door_for_every_family():
    missing = ModelSource("local", "/nonexistent")
    for family in ("sd", "flux"):  # flux: the syntax is taken out later, but read now
        with pytest.raises(InputError, match=r"^prompt 'a cat \(cute:1\.2\.3\)': the weight '1\.2\.3' is not a number"):
            reader(missing, family=family).chunks("a cat (cute:1.2.3)")
    assert reader(missing, family="flux", syntax="plain").chunks("a cat (cute:1.2.3)") == 1  # text, as written


@pytest.mark.xla  # transformers' CLIP model imports torch_xla where it is installed
def test_a_clip_skip_past_the_encoders_layers_is_one_line():
    import torch
    from transformers import CLIPTextConfig, CLIPTextModel

    from tpugen.families.clip_text import _hidden

    encoder = CLIPTextModel(
        CLIPTextConfig(
            hidden_size=8,
            intermediate_size=16,
            num_attention_heads=2,
            num_hidden_layers=2,
            vocab_size=50,
            eos_token_id=1,
            bos_token_id=0,
        )
    )
    ids = torch.zeros(1, 1, 77, dtype=torch.int64)
    assert _hidden(encoder, ids, "cpu", layer=None, skip=2)[0].shape == (1, 1, 77, 8)
    with pytest.raises(InputError, match="clip skip 3: the text encoder has 2 layers; at most 2"):
        _hidden(encoder, ids, "cpu", layer=None, skip=3)


def test_more_chunks_than_max_chunks_names_the_prompt_and_the_bound(local_model):
    with pytest.raises(InputError) as caught:
        reader(local_model, max_chunks=1).chunks("a cat", negative_prompt=LONG)
    (line,) = caught.value.lines
    assert line.startswith("negative_prompt 'ab ab ab") and "2 chunks" in line and "max_chunks (1)" in line


def test_plain_prompts_and_families_without_clip_are_one_chunk_and_read_no_tokenizer():
    missing = ModelSource("local", "/nonexistent")  # reading a tokenizer from here would fail
    for family in [name for name, family in FAMILIES.items() if name not in ("sd", "sdxl")]:
        assert reader(missing, family=family).chunks(LONG * 3) == 1
    assert reader(missing, syntax="plain").chunks(LONG * 3) == 1
    assert reader(missing).chunks(WEIGHTED) == 1  # short: no tokenizer needed
    with pytest.raises(InputError, match="tokenizer"):
        reader(missing).chunks(LONG)


# ---------------------------------------------------------------- whole runs on XLA:CPU


def _hand_embeddings(pipe, chunks: list[list[tuple[int, float]]], skip: int = 1):
    """The web UI's reading worked out here, apart from tpugen's code: each chunk framed by the start token and
    end tokens to 77, through the text encoder (with a clip skip: the layer `skip` from the last, through the
    final layer norm), multiplied by its weights, scaled back to its mean; joined."""
    import torch

    tokenizer = pipe.tokenizer
    start, end = tokenizer.bos_token_id, tokenizer.eos_token_id
    assert tokenizer.pad_token_id in (None, end)  # it pads with the end token, so no pad rule applies
    joined = []
    for tokens in chunks:
        filler = 76 - len(tokens)
        ids = torch.tensor([[start, *(t for t, _ in tokens), *[end] * filler]])
        weights = torch.tensor([1.0, *(w for _, w in tokens), *[1.0] * filler]).view(1, 77, 1)
        with torch.no_grad():
            if skip == 1:
                z = pipe.text_encoder(ids)[0]
            else:
                hidden = pipe.text_encoder(ids, output_hidden_states=True).hidden_states[-skip]
                z = final_layer_norm(pipe.text_encoder)(hidden)
        joined.append(z * weights * (z.mean() / (z * weights).mean()))
    return torch.cat(joined, dim=1)


def _tokens(pipe, *pieces: tuple[str, float]) -> list[tuple[int, float]]:
    return [(t, w) for text, w in pieces for t in pipe.tokenizer(text, add_special_tokens=False).input_ids]


def _diffusers_image(pipe, record: dict, prompt_embeds, negative_prompt_embeds) -> np.ndarray:
    import torch

    generator = torch.Generator("cpu").manual_seed(record["seed"])
    (noise,) = FAMILIES["sd"].noise(pipe, [generator], record["height"], record["width"])
    with torch.no_grad():
        image = pipe(
            prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds,
            height=record["height"],
            width=record["width"],
            num_inference_steps=record["steps"],
            guidance_scale=record["guidance_scale"],
            latents=noise,
            generator=generator,
            output_type="np",
        ).images[0]
    return (image * 255).round().clip(0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def webui_run(tmp_path_factory):
    # tiny-shapes: its text encoder's output has a mean well away from 0 (a trained final layer norm), as CLIP's
    # has, so the web UI's rule of restoring it is well conditioned (tiny-sd's random one has a mean of 1e-8).
    model = {"id": "tiny-shapes"}
    return generate(
        tmp_path_factory.mktemp("webui"), model=model, prompts=[WEIGHTED, LONG_SHAPES], batch_size=1, steps=2
    )


@pytest.mark.xla
def test_weights_and_chunks_are_the_web_uis_in_the_images(webui_run):
    from diffusers import StableDiffusionPipeline

    from tpugen.tiny import builtin_path

    pipe = StableDiffusionPipeline.from_pretrained(str(builtin_path("tiny-shapes")))
    pipe.set_progress_bar_config(disable=True)
    records = [json.loads(line) for line in (webui_run / "manifest.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in records] == [WEIGHTED, LONG_SHAPES]  # as written, in the manifest and the PNGs
    assert "(red:1.5)" in Image.open(webui_run / records[0]["file"]).text["parameters"]
    weighted = _tokens(pipe, ("a ", 1.0), ("red", 1.5), (" circle on a ", 1.0), ("blue", 1 / 1.1), (" background", 1.0))
    long_tokens = _tokens(pipe, (LONG_SHAPES, 1.0))
    assert len(long_tokens) == 91
    negative = _tokens(pipe, (records[0]["negative_prompt"], 1.0))
    expected = {
        # One chunk each.
        records[0]["file"]: (_hand_embeddings(pipe, [weighted]), _hand_embeddings(pipe, [negative])),
        # 75 tokens and 16; the negative prompt padded to two chunks with an empty one.
        records[1]["file"]: (
            _hand_embeddings(pipe, [long_tokens[:75], long_tokens[75:]]),
            _hand_embeddings(pipe, [negative, []]),
        ),
    }
    for record in records:
        made = np.asarray(Image.open(webui_run / record["file"]).convert("RGB"), dtype=np.int16)
        reference = _diffusers_image(pipe, record, *expected[record["file"]])
        assert np.abs(made - reference).max() <= COMPILED_VS_EAGER, record["prompt"]


@pytest.mark.xla
def test_each_chunk_count_is_a_shape_key_compiled_once_in_warmup(webui_run):
    report = json.loads((webui_run / "report.json").read_text())
    warmed = {entry["shape_key"]: entry for entry in report["warmup"]}
    assert sorted(warmed) == ["64x64 b1 cfg", "64x64 b1 cfg 2 chunks"]
    assert all(cold_graphs(entry) == FIRST_CALL for entry in warmed.values())
    assert report["compiles_after_warmup"] == 0


@pytest.mark.xla
def test_plain_syntax_gives_the_pipeline_the_text_as_written(webui_run, tmp_path):
    model = {"id": "tiny-shapes"}
    run_dir = generate(tmp_path, model=model, prompts=[WEIGHTED], batch_size=1, steps=2, prompt_syntax="plain")
    (record,) = [json.loads(line) for line in (run_dir / "manifest.jsonl").read_text().splitlines()]
    made = np.asarray(Image.open(run_dir / record["file"]).convert("RGB"), dtype=np.int16)
    # diffusers' pipeline reading the brackets and the number as text.
    reference = plain_diffusers_images("tiny-shapes", run_dir)[record["file"]]
    assert np.abs(made - reference).max() <= COMPILED_VS_EAGER
    webui = np.asarray(Image.open(webui_run / record["file"]).convert("RGB"), dtype=np.int16)
    assert np.abs(made - webui).max() > 10  # the same seed read the web UI's way is another picture


@pytest.mark.xla
def test_clip_skip_reads_the_layer_before_the_last_for_prompt_and_negative(tmp_path):
    from diffusers import StableDiffusionPipeline

    from tpugen.tiny import builtin_path

    prompt = "a red circle on a blue background"
    model = {"id": "tiny-shapes"}
    run_dir = generate(tmp_path, model=model, prompts=[prompt], batch_size=1, steps=2, clip_skip=2)
    (record,) = [json.loads(line) for line in (run_dir / "manifest.jsonl").read_text().splitlines()]
    assert record["clip_skip"] == 2
    assert "Clip skip: 2" in Image.open(run_dir / record["file"]).text["parameters"]
    report = json.loads((run_dir / "report.json").read_text())
    assert [entry["shape_key"] for entry in report["warmup"]] == ["64x64 b1 cfg clip skip 2"]
    pipe = StableDiffusionPipeline.from_pretrained(str(builtin_path("tiny-shapes")))
    pipe.set_progress_bar_config(disable=True)
    embeddings = [
        _hand_embeddings(pipe, [_tokens(pipe, (text, 1.0))], skip=2) for text in (prompt, record["negative_prompt"])
    ]
    made = np.asarray(Image.open(run_dir / record["file"]).convert("RGB"), dtype=np.int16)
    assert np.abs(made - _diffusers_image(pipe, record, *embeddings)).max() <= COMPILED_VS_EAGER
    last_layer = _diffusers_image(
        pipe, record, *(_hand_embeddings(pipe, [_tokens(pipe, (t, 1.0))]) for t in (prompt, "blurry"))
    )
    assert np.abs(made - last_layer).max() > 10


def test_clip_skip_is_refused_in_one_line_where_the_family_has_no_single_clip_encoder(tmp_path):
    from conftest import run_cli, tiny_config, write_config

    config = tiny_config(tmp_path, model={"id": "tiny-sdxl"}, clip_skip=2)
    result = run_cli("validate", write_config(tmp_path / "c.yaml", config))
    assert result.exit_code != 0
    assert "clip_skip: Stable Diffusion XL models: SDXL reads both encoders' penultimate layers" in result.output
    plain = tiny_config(tmp_path, clip_skip=2, prompt_syntax="plain")
    result = run_cli("validate", write_config(tmp_path / "p.yaml", plain))
    assert result.exit_code != 0 and "clip_skip: a clip skip needs prompt_syntax webui" in result.output


def test_a_family_without_clip_encoders_says_once_that_the_syntax_is_taken_out():
    from conftest import work_item

    from tpugen.engine.engine import syntax_note

    def item(prompt, syntax="webui", negative=""):
        return work_item(prompt=prompt, negative_prompt=negative, prompt_syntax=syntax)

    items = [item(WEIGHTED), item(WEIGHTED), item("a cat", negative="[blurry]"), item("a dog")]
    note = syntax_note(FAMILIES["flux"], items)
    assert note.startswith("prompts: Flux.1") and "taken out of 2 prompt(s)" in note
    assert syntax_note(FAMILIES["sd"], items) is None  # read, not taken out
    assert syntax_note(FAMILIES["flux"], [item(WEIGHTED, syntax="plain")]) is None
    assert syntax_note(FAMILIES["flux"], [item("a dog")]) is None


@pytest.mark.parametrize(
    ("keys", "line"),
    [
        ({"prompt_syntax": "fancy"}, "prompt_syntax"),
        ({"max_chunks": 0}, "max_chunks"),
        ({"max_chunks": 10**12}, "max_chunks"),
        ({"clip_skip": 13}, "clip_skip"),
        ({"clip_skip": "two"}, "clip_skip"),
        ({"serve": {"prompt_chunks": []}}, "serve.prompt_chunks"),
        ({"serve": {"prompt_chunks": [9]}}, "serve.prompt_chunks"),
        ({"serve": {"prompt_chunks": [1] * 9}}, "serve.prompt_chunks"),
        ({"max_chunks": 2, "serve": {"prompt_chunks": [1, 3]}}, "serve.prompt_chunks: 3 is more than max_chunks (2)"),
    ],
)
def test_the_new_keys_worst_values_are_one_line_naming_the_key(tmp_path, keys, line):
    from conftest import run_cli, tiny_config, write_config

    result = run_cli("validate", write_config(tmp_path / "c.yaml", tiny_config(tmp_path, **keys)))
    assert result.exit_code == 2
    assert line in result.output and "Traceback" not in result.output
