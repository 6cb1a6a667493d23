"""Textual-inversion embeddings (model.embeddings, serve.embeddings_dir): files checked at the door, loaded with
diffusers' own loader, named in prompts as the web UI names them, counted at planning as the encoding reads them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import (
    COMPILED_VS_EAGER,
    FIRST_CALL,
    OTHER_GRAPH,
    cold_graphs,
    generate,
    plain_diffusers_images,
    tiny_config,
    write_config,
)
from PIL import Image

from tpugen.config import resolve
from tpugen.config.embeddings import MAX_BYTES, folder_embeddings, read_embedding
from tpugen.errors import InputError
from tpugen.families import FAMILIES
from tpugen.families.parts import clip_tokenizer
from tpugen.families.prompt_syntax import chunk_prompt
from tpugen.models import ModelSource
from tpugen.prompt_reading import PromptReader

WIDTH = 32  # the tiny built-ins' CLIP width
# The tiny built-ins' tokenizer makes every byte of a word a token: 37 words of "ab" are 74 tokens.
TOKENS_74 = " ".join(["ab"] * 37)
PROMPT = "a badhands on a hill"


def make_embedding(path: Path, vectors: int, *, width: int = WIDTH, fmt: str = "safetensors", seed: int = 0) -> Path:
    """An embedding file: the web UI's safetensors (one tensor, emb_params), its .pt (string_to_param), or SDXL's
    (clip_l and clip_g). Values the size of a CLIP token's, so a prompt naming it makes another picture."""
    rng = np.random.default_rng(seed)
    values = rng.normal(0, 0.5, (vectors, width)).astype(np.float32)
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "pt":
        import torch

        torch.save({"string_to_param": {"*": torch.from_numpy(values)}, "name": path.stem, "step": 100}, path)
        return path
    from safetensors.numpy import save_file

    tensors = {"clip_l": values, "clip_g": values.copy()} if fmt == "sdxl" else {"emb_params": values}
    save_file(tensors, str(path))
    return path


def resolved(tmp: Path, embeddings: list[str], model: str = "tiny-sd", **overrides):
    config = tiny_config(tmp, model={"id": model, "embeddings": embeddings}, **overrides)
    return resolve(config, base_dir=tmp)


# ---------------------------------------------------------------- at the door (no device)


def test_bad_embeddings_are_one_line_each_naming_the_key(tmp_path):
    make_embedding(tmp_path / "emb" / "good.safetensors", 2)
    make_embedding(tmp_path / "emb" / "forxl.safetensors", 1, fmt="sdxl")
    (tmp_path / "emb" / "notes.safetensors").write_bytes(b"not a tensor file")
    from safetensors.numpy import save_file

    two = {"a": np.zeros((1, WIDTH), np.float32), "b": np.zeros((1, WIDTH), np.float32)}
    save_file(two, str(tmp_path / "emb" / "lora.safetensors"))
    make_embedding(tmp_path / "other" / "good.safetensors", 1)  # the same name as the first
    given = [
        "emb/good.safetensors",
        "emb/missing.safetensors",
        "emb/notes.safetensors",
        "emb/lora.safetensors",
        "emb/forxl.safetensors",
        "other/good.safetensors",
    ]
    with pytest.raises(InputError) as caught:
        resolved(tmp_path, given)
    lines = caught.value.lines
    assert len(lines) == 5 and all("\n" not in line for line in lines)
    assert lines[0].startswith("model.embeddings[1]: ") and "does not exist" in lines[0]
    assert lines[1].startswith("model.embeddings[2]: 'notes.safetensors' is not a textual-inversion embedding")
    assert lines[2].startswith("model.embeddings[3]: 'lora.safetensors' is not a textual-inversion embedding")
    assert lines[3] == (
        "model.embeddings[4]: 'forxl.safetensors' is an embedding for SDXL (clip_l and clip_g tensors), and the "
        "model tiny-sd is Stable Diffusion 1.x/2.x"
    )
    assert lines[4] == "model.embeddings[5]: model.embeddings[0] is named 'good' too"

    with pytest.raises(InputError) as caught:
        resolved(tmp_path, ["emb/good.safetensors"], model="tiny-flux")
    assert caught.value.lines == [
        "model.embeddings: textual-inversion embeddings are for models whose prompts go through CLIP text encoders "
        "alone (Stable Diffusion 1.x/2.x and SDXL), and the model is Flux.1 (schnell, dev)"
    ]
    with pytest.raises(InputError, match=r"model.embeddings\[0\]: 'good.safetensors' is an embedding for one CLIP"):
        resolved(tmp_path, ["emb/good.safetensors"], model="tiny-sdxl")


def test_embeddings_resolve_to_absolute_files_and_count_in_the_hash_by_name_and_content(tmp_path):
    make_embedding(tmp_path / "emb" / "badhands.safetensors", 2)
    make_embedding(tmp_path / "emb" / "style.pt", 3, fmt="pt")
    make_embedding(tmp_path / "moved" / "badhands.safetensors", 2)  # the same bytes elsewhere
    make_embedding(tmp_path / "emb" / "other.safetensors", 2)  # the same bytes, another name
    run = resolved(tmp_path, ["emb/badhands.safetensors", "emb/style.pt"])
    assert [(e.name, e.vectors, e.widths) for e in run.embeddings] == [
        ("badhands", 2, (WIDTH,)),
        ("style", 3, (WIDTH,)),
    ]
    assert run.config.model.embeddings == [
        str(tmp_path / "emb" / "badhands.safetensors"),
        str(tmp_path / "emb" / "style.pt"),
    ]
    none = resolved(tmp_path, []).config_hash
    assert none == resolve(tiny_config(tmp_path), base_dir=tmp_path).config_hash  # unset: the hash as before
    one = resolved(tmp_path, ["emb/badhands.safetensors"]).config_hash
    assert one != none
    assert resolved(tmp_path, ["moved/badhands.safetensors"]).config_hash == one  # where the file is: no matter
    assert resolved(tmp_path, ["emb/other.safetensors"]).config_hash != one  # its name is the word prompts write
    both = resolved(tmp_path, ["emb/style.pt", "emb/badhands.safetensors"]).config_hash
    assert both == run.config_hash  # in any order


def test_pod_run_ships_each_embedding_file_and_the_workers_config_names_it_beside_itself(tmp_path):
    from tpugen.config.embeddings import shipped_embeddings

    make_embedding(tmp_path / "proj" / "emb" / "badhands.safetensors", 2)
    run = resolved(tmp_path / "proj", ["emb/badhands.safetensors"])
    config = run.config.model_copy(deep=True)  # pod-run's copy, which it ships
    (file,) = shipped_embeddings(config, run.embeddings, {"style.safetensors"})
    assert file == tmp_path / "proj" / "emb" / "badhands.safetensors" and config.model.embeddings == [file.name]
    worker = tmp_path / "worker"
    worker.mkdir()
    (worker / file.name).write_bytes(file.read_bytes())
    assert resolve(config.model_dump(), base_dir=worker).config_hash == run.config_hash
    with pytest.raises(InputError, match="a LoRA file is named 'badhands.safetensors' too"):
        shipped_embeddings(run.config.model_copy(deep=True), run.embeddings, {"badhands.safetensors"})
    assert str(tmp_path / "proj") not in json.dumps(config.model.model_dump())


@pytest.fixture(scope="module")
def local_model(tmp_path_factory):
    """A model folder with the tiny built-ins' CLIP tokenizer and nothing else: all counting needs."""
    folder = tmp_path_factory.mktemp("model")
    clip_tokenizer(folder / "scratch")[0].save_pretrained(folder / "tokenizer")
    return ModelSource("local", str(folder))


def test_a_multi_vector_embedding_counts_a_token_a_vector_at_planning(local_model):
    def chunks(prompt: str, *embeddings: tuple[str, int]) -> int:
        return PromptReader("webui", FAMILIES["sd"], 3, local_model, embeddings=embeddings).chunks(prompt)

    assert chunks(f"{TOKENS_74} badhands", ("badhands", 1)) == 1  # 75 tokens
    assert chunks(f"{TOKENS_74} badhands", ("badhands", 2)) == 2  # 76, as the web UI counts them
    assert chunks(f"{TOKENS_74} BadHands", ("badhands", 2)) == 2  # named in any case, as in the web UI
    # More vectors than its name has letters: a short prompt is counted with the tokenizer, not by its bytes.
    assert chunks(" ".join(["a"] * 70) + " zq", ("zq", 8)) == 2  # 72 bytes, 78 tokens


def test_an_embedding_starts_the_next_chunk_rather_than_split_and_keeps_its_weight(local_model):
    from tpugen.prompt_reading import _tokenizer

    tokenizer = _tokenizer(local_model, None, "tokenizer", (("emb", 3),))
    vectors = tokenizer.convert_tokens_to_ids(["emb", "emb_1", "emb_2"])
    chunks = chunk_prompt(f"{TOKENS_74[:-1]} (emb:1.5)", tokenizer)  # 73 tokens, then 3 vectors
    end = tokenizer.eos_token_id
    assert chunks.chunk_count == 2
    assert chunks.token_ids[0][74:] == (end, end, end)  # the first chunk ends early, padded
    assert chunks.token_ids[1][1:5] == (*vectors, end) and chunks.weights[1][1:5] == (1.5, 1.5, 1.5, 1.0)


def test_an_embeddings_folder_is_read_safely(tmp_path):
    folder = tmp_path / "emb"
    make_embedding(folder / "badhands.safetensors", 2)
    make_embedding(folder / "style.PT", 1, fmt="pt")
    (folder / "broken.safetensors").write_bytes(b"\x00" * 64)
    with open(folder / "huge.safetensors", "wb") as handle:  # 300 MB, sparse: refused by its size, unread
        handle.truncate(300 << 20)
    make_embedding(tmp_path / "elsewhere" / "secret.safetensors", 1)
    os.symlink(tmp_path / "elsewhere" / "secret.safetensors", folder / "outside.safetensors")  # climbs out
    os.symlink(folder / "badhands.safetensors", folder / "alias.safetensors")  # stays in: a file of the folder
    make_embedding(folder / "bad name!.safetensors", 1)
    make_embedding(folder / "new\nline.safetensors", 1)
    os.mkfifo(folder / "pipe.pt")  # reading it would wait forever
    (folder / "readme.txt").write_text("not an embedding")
    (folder / "nothing.bin").symlink_to(folder / "gone.bin")

    loaded, skipped = folder_embeddings(str(folder), FAMILIES["sd"])
    assert [(e.name, e.vectors) for e in loaded] == [("alias", 2), ("badhands", 2), ("style", 1)]
    reasons = {s.name: s.reason for s in skipped}
    assert sorted(reasons) == ["bad name!", "broken", "huge", "new\\nline", "nothing", "pipe"]
    assert "at most 32 MiB (left unread)" in reasons["huge"] and MAX_BYTES == 32 << 20
    assert "not a file" in reasons["pipe"] and "link to nothing" in reasons["nothing"]
    assert "letters, digits" in reasons["bad name!"] and "not a textual-inversion embedding" in reasons["broken"]
    assert all("\n" not in reason for reason in reasons.values())
    with pytest.raises(InputError, match="is an embedding for one CLIP text encoder"):
        read_embedding(folder / "badhands.safetensors", FAMILIES["sdxl"], where="x")
    loaded, skipped = folder_embeddings(str(folder), FAMILIES["flux"])
    assert loaded == [] and all("CLIP text encoders alone" in s.reason for s in skipped if s.name == "badhands")


# ---------------------------------------------------------------- runs and the server on XLA:CPU


@pytest.fixture(scope="module")
def embedding_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("embeddings")
    make_embedding(tmp / "emb" / "badhands.safetensors", 2)
    model = {"id": "tiny-sd", "embeddings": ["emb/badhands.safetensors"]}
    return generate(tmp, model=model, prompts=[PROMPT], batch_size=1, steps=2)


@pytest.mark.xla
def test_a_run_naming_an_embedding_makes_diffusers_image_and_compiles_nothing_after_warmup(embedding_run):
    (record,) = [json.loads(line) for line in (embedding_run / "manifest.jsonl").read_text().splitlines()]
    made = np.asarray(Image.open(embedding_run / record["file"]).convert("RGB"), dtype=np.int16)
    path = str(embedding_run.parents[1] / "emb" / "badhands.safetensors")
    pipes = []

    def load(pipe):
        pipe.load_textual_inversion(path, token="badhands")
        pipes.append(pipe)

    reference = plain_diffusers_images("tiny-sd", embedding_run, prepare=load)[record["file"]]
    assert np.abs(made - reference).max() <= COMPILED_VS_EAGER
    without = plain_diffusers_images("tiny-sd", embedding_run)[record["file"]]
    assert np.abs(made - without).max() > 10  # the embedding is in the picture
    report = json.loads((embedding_run / "report.json").read_text())
    assert report["compiles_after_warmup"] == 0
    (warm,) = report["warmup"]  # the grown token table is in the text-encoding graph warmup compiles
    assert cold_graphs(warm) == FIRST_CALL

    # The planning's tokenizer reads a long prompt as the pipeline's, loaded by diffusers, does: 74 + 2 tokens.
    from tpugen.prompt_reading import _tokenizer

    long_prompt = f"{TOKENS_74} badhands"
    counted = chunk_prompt(
        long_prompt, _tokenizer(ModelSource("builtin", "tiny-sd"), None, "tokenizer", (("badhands", 2),))
    )
    encoded = chunk_prompt(long_prompt, pipes[0].tokenizer)
    assert counted == encoded and counted.chunk_count == 2


@pytest.mark.xla
def test_sdxl_embeddings_go_to_both_encoders_as_diffusers_documents(tmp_path):
    import torch
    from diffusers import StableDiffusionXLPipeline
    from safetensors.torch import load_file

    from tpugen.engine.embeddings import load_embeddings
    from tpugen.tiny import builtin_path

    path = make_embedding(tmp_path / "xl.safetensors", 2, fmt="sdxl", seed=3)
    family = FAMILIES["sdxl"]
    ours = StableDiffusionXLPipeline.from_pretrained(str(builtin_path("tiny-sdxl")))
    embedding = read_embedding(path, family, where="model.embeddings[0]")
    assert load_embeddings(ours, family, (embedding,), None, "tiny-sdxl") == ((embedding,), ())
    theirs = StableDiffusionXLPipeline.from_pretrained(str(builtin_path("tiny-sdxl")))
    tensors = load_file(path)
    theirs.load_textual_inversion(
        tensors["clip_l"], token="xl", text_encoder=theirs.text_encoder, tokenizer=theirs.tokenizer
    )
    theirs.load_textual_inversion(
        tensors["clip_g"], token="xl", text_encoder=theirs.text_encoder_2, tokenizer=theirs.tokenizer_2
    )
    with torch.no_grad():
        made = family.clip_embeddings(ours, ["an xl cat"], None, 1)
        embeds, _, pooled, _ = theirs.encode_prompt("an xl cat", do_classifier_free_guidance=False)
    assert torch.allclose(made["prompt_embeds"], embeds, atol=1e-5)
    assert torch.allclose(made["pooled_prompt_embeds"], pooled, atol=1e-5)


@pytest.mark.xla
def test_a_server_lists_its_folders_embeddings_and_prompts_name_them(embedding_run, tmp_path):
    from serve_support import decode, pixels, running_server, wait_ready

    folder = tmp_path / "emb"
    make_embedding(folder / "badhands.safetensors", 2)  # the run's embedding: the same text-encoding graph
    make_embedding(folder / "wide.safetensors", 1, width=48)  # for another model's encoder
    (folder / "broken.pt").write_bytes(b"PK\x03\x04 not a zip")
    with open(folder / "huge.safetensors", "wb") as handle:
        handle.truncate(300 << 20)
    make_embedding(tmp_path / "elsewhere" / "secret.safetensors", 1)
    os.symlink(tmp_path / "elsewhere" / "secret.safetensors", folder / "outside.safetensors")
    make_embedding(folder / "odd (name).safetensors", 1)
    config = tiny_config(tmp_path, batch_size=1, steps=2, output={"dir": str(tmp_path / "runs")})
    config["serve"] = {"batch_window_ms": 50, "embeddings_dir": "emb"}
    del config["prompts"]
    config["output"].pop("run_id")
    path = write_config(tmp_path / "serve.yaml", config)
    with running_server(path, tmp_path / "runs", "k" * 20) as (url, _service):
        wait_ready(url)  # its socket is up (the engines opened before the server started)
        headers = {"Authorization": f"Bearer {'k' * 20}"}
        listed = httpx.get(f"{url}/sdapi/v1/embeddings", headers=headers).json()
        entry = {"step": None, "sd_checkpoint": None, "sd_checkpoint_name": None}
        assert listed["loaded"] == {"badhands": {**entry, "shape": WIDTH, "vectors": 2}}
        assert sorted(listed["skipped"]) == ["broken", "huge", "odd (name)", "wide"]
        assert listed["skipped"]["wide"] == {**entry, "shape": 48, "vectors": 1}
        body = {"prompt": PROMPT, "negative_prompt": "blurry", "seed": 7, "steps": 2, "cfg_scale": 7.5}
        answer = httpx.post(
            f"{url}/sdapi/v1/txt2img", json={**body, "width": 64, "height": 64}, headers=headers, timeout=300
        )
        assert answer.status_code == 200, answer.text
        (image,) = [decode(b64) for b64 in answer.json()["images"]]
    (record,) = [json.loads(line) for line in (embedding_run / "manifest.jsonl").read_text().splitlines()]
    reference = Image.open(embedding_run / record["file"])
    assert int(np.abs(pixels(image) - pixels(reference)).max()) <= OTHER_GRAPH
