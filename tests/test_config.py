"""Config validation at the door: every bad input gets its exact one-line message and exit code 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import PROMPTS, run_cli, tiny_config, write_config

from tpugen.config import all_keys, load_config

_DECIMAL = "error: {key}: expected a decimal integer without leading zeros or ':', got '{value}'"
# (case id, changes to the tiny config (None deletes a key), overrides, expected stderr lines)
BAD_CONFIGS = [
    ("unknown key", {"stpes": 3}, [], ["error: stpes: unknown key (did you mean 'steps'?)"]),
    (
        "unknown nested key",
        {"model": {"id": "tiny-sd", "dtyp": "float32"}},
        [],
        ["error: model.dtyp: unknown key (did you mean 'dtype'?)"],
    ),
    ("wrong type", {"steps": "ten"}, [], ["error: steps: expected an integer, got 'ten'"]),
    ("string number", {"height": "64"}, [], ["error: height: expected an integer, got '64'"]),
    (
        "infinite guidance",
        {},
        ["guidance_scale=.inf"],
        ["error: guidance_scale: must be a finite number, got inf"],
    ),
    (
        "infinite chip memory",
        {"execution": {"backend": "xla", "chip_memory_gb": float("inf")}},
        [],
        ["error: execution.chip_memory_gb: must be a finite number, got inf"],
    ),
    ("octal-looking seed override", {}, ["seed=0042"], [_DECIMAL.format(key="seed", value="0042")]),
    ("base-60 steps override", {}, ["steps=1:30"], [_DECIMAL.format(key="steps", value="1:30")]),
    ("hex seed override", {}, ["seed=0x10"], [_DECIMAL.format(key="seed", value="0x10")]),
    (
        "height 65",
        {"height": 65},
        [],
        ["error: height: must be a positive multiple of 8 (the VAE downsamples by 8), got 65"],
    ),
    ("negative width", {"width": -64}, [], ["error: width: must be greater than 0, got -64"]),
    ("steps 0", {"steps": 0}, [], ["error: steps: must be greater than or equal to 1, got 0"]),
    ("batch 0", {"batch_size": 0}, [], ["error: batch_size: must be greater than or equal to 1, got 0"]),
    ("empty prompt list", {"prompts": []}, [], ["error: prompts: the list is empty; give at least one prompt"]),
    ("blank prompt", {"prompts": ["a cat", "   "]}, [], ["error: prompts[1]: prompt is empty"]),
    (
        "half a UTF-16 pair",  # JSON and YAML escapes can carry one; no PNG chunk or tokenizer takes it
        {"prompts": ["a cat", "a \ud83d dog"], "negative_prompt": "\udc00"},
        [],
        [
            "error: prompts[1]: unpaired surrogate U+D83D at character 2 (not valid Unicode text)",
            "error: negative_prompt: unpaired surrogate U+DC00 at character 0 (not valid Unicode text)",
        ],
    ),
    (
        "no prompts",
        {"prompts": None},
        [],
        ["error: prompts: no prompts given; set prompts (a list) or prompts_file (.txt or .jsonl)"],
    ),
    (
        "missing prompts file",
        {"prompts": None, "prompts_file": "nope.txt"},
        [],
        ["error: prompts_file: '{tmp}/nope.txt' does not exist"],
    ),
    (
        "unknown scheduler",
        {"model": {"id": "tiny-sd", "scheduler": "Eulr"}},
        [],
        [
            "error: model.scheduler: unknown scheduler 'Eulr'; valid names: DPM++ 2M, DPM++ 2M Karras, DPM++ 2M SDE, "
            "Euler, Euler a, Heun, LMS, DDIM, PNDM, UniPC, DEIS, LCM"
        ],
    ),
    (
        "bad dtype",
        {"model": {"id": "tiny-sd", "dtype": "fp8"}},
        [],
        ["error: model.dtype: must be 'float32', 'bfloat16' or 'float16', got 'fp8'"],
    ),
    (
        "bad backend",
        {"execution": {"backend": "gpu"}},
        [],
        ["error: execution.backend: must be 'xla', 'jax', 'cpu', 'cuda' or 'torch_tpu', got 'gpu'"],
    ),
    ("missing model", {"model": None}, [], ["error: model: required key is missing"]),
    (
        "model dir missing",
        {"model": {"id": "./models/none"}},
        [],
        ["error: model.id: model directory '{tmp}/models/none' does not exist"],
    ),
    (
        "model dir without model_index.json",
        {"model": {"id": "{tmp}"}},
        [],
        ["error: model.id: '{tmp}' has no model_index.json (not a diffusers pipeline directory)"],
    ),
    (
        "remote code not allowed",
        {"model": {"id": "tiny-sd", "custom_pipeline": "lpw_stable_diffusion"}},
        [],
        [
            "error: model.custom_pipeline: runs code downloaded with the model; "
            "set model.allow_remote_code: true to allow it"
        ],
    ),
    (
        "not a model id",
        {"model": {"id": "sd15"}},
        [],
        [
            "error: model.id: 'sd15' is not a built-in (tiny-sd, tiny-shapes, tiny-sdxl, tiny-sd3, tiny-flux, tiny-flux-deep, tiny-flux2-klein, tiny-flux2-klein-distilled, tiny-flux2-klein-kv, tiny-flux2, tiny-z-image, tiny-qwen-image, tiny-qwen-image-edit-plus, tiny-qwen-image-edit), an existing directory, or a hub id of the form org/name"
        ],
    ),
    (
        "output dir is a file",
        {"output": {"dir": "{tmp}/afile/out"}},
        [],
        ["error: output.dir: '{tmp}/afile' is a file, not a directory"],
    ),
    (
        "run id with a slash",
        {"output": {"dir": "{tmp}/out", "run_id": "../up"}},
        [],
        ["error: output.run_id: use 1 to 128 ASCII letters, digits, '.', '_' or '-', not starting with '.' or '-'"],
    ),
    ("sizes and height", {"sizes": [[64, 64]]}, [], ["error: sizes: give either sizes or height/width, not both"]),
    (
        "size not a pair",
        {"sizes": [[64]], "height": None, "width": None},
        [],
        ["error: sizes[0]: a size is a [height, width] pair, got [64]"],
    ),
    (
        "size not multiple of 8",
        {"sizes": [[64, 60]], "height": None, "width": None},
        [],
        ["error: sizes[0]: must be a positive multiple of 8 (the VAE downsamples by 8), got 60"],
    ),
    (
        "cache dir under a file",
        {"cache": {"dir": "{tmp}/afile/cache"}},
        [],
        ["error: cache.dir: '{tmp}/afile' is a file, not a directory"],
    ),
    ("override unknown key", {}, ["guidance=3"], ["error: guidance: unknown key (did you mean 'guidance_scale'?)"]),
    (
        "override without =",
        {},
        ["steps"],
        ["error: steps: an override must look like key=value (for example steps=30)"],
    ),
    ("override wrong type", {}, ["batch_size=two"], ["error: batch_size: expected an integer, got 'two'"]),
    (
        "empty overrides",  # steps= silently meant the model's default, output.dir= the current folder
        {},
        ["steps=", "output.dir= ", "negative_prompt="],
        [
            "error: steps: the value is empty (an unset shell variable?); give one, or null to unset it",
            "error: output.dir: the value is empty (an unset shell variable?); give one, or null to unset it",
        ],
    ),
    (
        "flash attention neither auto nor a boolean",
        {"compile": {"flash_attention": "yes"}},
        [],
        ["error: compile.flash_attention: must be auto, true or false, got 'yes'"],
    ),
    (
        "flash attention forced on a backend without torch_xla",
        {"execution": {"backend": "cpu"}, "compile": {"flash_attention": True}},
        [],
        [
            "error: compile.flash_attention: true is torch_xla's Pallas kernel, for execution.backend: xla, "
            "not cpu; use auto or false"
        ],
    ),
    (
        # Flux's pipeline would round 72 down to 64 and every record would claim 72.
        "a Flux height of 8 but not 16",
        {"model": {"id": "tiny-flux"}, "height": 72, "prompts": ["a fox", {"prompt": "an owl", "width": 40}]},
        [],
        [
            "error: height: Flux.1 (schnell, dev) models need a multiple of 16 (the VAE's 8 times 2x2 patches), got 72",
            "error: prompts: a prompt's own 72x40 (height x width): Flux.1 (schnell, dev) models need a multiple of 16 "
            "(the VAE's 8 times 2x2 patches)",
        ],
    ),
    (
        "more images than a run plans",
        {"images_per_prompt": 500_000},
        [],
        [
            f"error: images_per_prompt: the run would plan {500_000 * len(PROMPTS)} images; at most 1000000 per run "
            "(split it into several runs)"
        ],
    ),
    (
        "several problems at once",
        {"steps": 0, "height": 12, "seeds": 1},
        [],
        [
            "error: height: must be a positive multiple of 8 (the VAE downsamples by 8), got 12",
            "error: steps: must be greater than or equal to 1, got 0",
            "error: seeds: unknown key (did you mean 'seed'?)",
        ],
    ),
]


def _apply(config: dict, changes: dict, tmp: Path) -> dict:
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        elif isinstance(value, dict):
            config[key] = {k: (v.replace("{tmp}", str(tmp)) if isinstance(v, str) else v) for k, v in value.items()}
        else:
            config[key] = value
    return config


@pytest.mark.parametrize("changes,overrides,expected", [c[1:] for c in BAD_CONFIGS], ids=[c[0] for c in BAD_CONFIGS])
@pytest.mark.parametrize("command", ["validate", "generate"])
def test_bad_config_is_reported_in_one_line_per_problem(tmp_path, command, changes, overrides, expected):
    (tmp_path / "afile").write_text("x")
    config = _apply(tiny_config(tmp_path), changes, tmp_path)
    config["output"]["dir"] = config["output"]["dir"].replace("{tmp}", str(tmp_path))
    path = write_config(tmp_path / "bad.yaml", config)
    before = sorted(p.name for p in tmp_path.iterdir())

    result = run_cli(command, path, *overrides)

    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [line.replace("{tmp}", str(tmp_path)) for line in expected]
    assert result.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written, no output dir


@pytest.mark.parametrize(
    "text,expected",
    [
        ("model: [unclosed\n", "malformed YAML at line 2, column 1: expected ',' or ']', but got '<stream end>'"),
        ("- a\n- b\n", "the config must be a mapping of keys, got list"),
        ("just words\n", "the config must be a mapping of keys, got str"),
        ("", "the config is empty"),
        (
            "steps: 3\nseed: 1\nsteps: 30\n",
            "malformed YAML at line 3, column 1: key 'steps' appears twice in one mapping (first at line 1)",
        ),
        (
            "prompts: &p [a cat, *p]\n",
            "malformed YAML: an alias refers to a mapping or list it is inside (*NAME within &NAME)",
        ),
        (
            # Nine levels of ten aliases: one shared list to PyYAML, 10**9 values to whatever walks it later.
            "\n".join(
                ["l0: &l0 [a, a, a, a, a, a, a, a, a, a]"]
                + [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 10)]
            )
            + "\n",
            "malformed YAML: aliases expand the document past 1000000 values (aliases of aliases of ...)",
        ),
        (
            "prompts: " + "[" * 50_000 + "]" * 50_000 + "\n",
            "malformed YAML: lists or mappings nested too deeply to read",
        ),
    ],
    ids=["malformed", "list", "scalar", "empty", "duplicate-key", "alias-cycle", "alias-bomb", "nested-too-deep"],
)
def test_unreadable_yaml(tmp_path, text, expected):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    result = run_cli("validate", path)
    assert result.exit_code == 2
    assert result.stderr == f"error: {path}: {expected}\n"


def test_a_merged_key_may_be_overridden_and_an_alias_shared():
    from tpugen.config.yamlio import yaml_load

    text = "size: &s {height: 64, width: 80}\nbig: {<<: *s, height: 128}\nsame: *s\n"
    assert yaml_load(text) == {
        "size": {"height": 64, "width": 80},
        "big": {"height": 128, "width": 80},
        "same": {"height": 64, "width": 80},
    }


@pytest.mark.parametrize(
    "text",
    [
        "prompts:\n"
        + "".join(f"  - 'a cat {i}'\n" for i in range(500))
        + "seed: 0042\nsteps: 0x10\nscale: 1.5\nx: 1e3\n",
        'a: &x [1, 2]\nb: {<<: {c: 1}, c: 2}\nd: *x\ne: "\\N\\u00e9"\n',
        "a: [1, 2\n",  # refused: the same words as the pure-Python reader's, whichever parser read it first
        "a: 1\na: 2\n",
        "a: \x07\n",
        "a: '\ud800'\n",  # a lone surrogate, which libyaml cannot take
        "[" * 2000 + "]" * 2000,  # past libyaml's nesting limit
    ],
)
def test_yaml_is_read_by_libyaml_as_tpugens_own_reader_reads_it(text):
    from tpugen.config import yamlio

    assert yamlio._FastYamlLoader is not yamlio._YamlLoader or not yaml.__with_libyaml__

    def read(loader):
        try:
            return ("read", yaml.load(text, Loader=loader))  # noqa: S506 -- SafeLoader subclasses
        except yaml.YAMLError as exc:
            return ("refused", yamlio.yaml_problem(exc))
        except RecursionError:
            return ("refused", "too deep")

    try:
        got = ("read", yamlio.yaml_load(text))
    except yaml.YAMLError as exc:
        got = ("refused", "too deep" if isinstance(exc, yamlio._TooDeep) else yamlio.yaml_problem(exc))
    assert got == read(yamlio._YamlLoader)


@pytest.mark.parametrize("text", ["a\x85b", "line\u2028separator", "para\u2029graph", "0042", "yes", "two\nlines"])
def test_tpugens_yaml_reads_back_the_same_in_yaml_1_1_too(text):
    # YAML 1.1 readers (PyYAML, and tpugen's own loader) fold an unescaped NEL, LS or PS into a space: a
    # resume then saw a negative prompt with U+0085 as changed.
    import yaml

    from tpugen.config.yamlio import dump_yaml, yaml_load

    written = dump_yaml({"negative_prompt": text})
    assert yaml_load(written) == {"negative_prompt": text} == yaml.safe_load(written)


def test_validate_serve_checks_a_server_config_without_prompts(tmp_path):
    config = tiny_config(tmp_path)
    del config["prompts"]
    path = write_config(tmp_path / "c.yaml", config)
    refused = run_cli("validate", path)
    assert refused.exit_code == 2 and refused.stderr.startswith("error: prompts: no prompts given")
    result = run_cli("validate", path, "--serve")
    assert result.exit_code == 0, result.output
    assert "prompts: null" in result.stdout


def test_missing_config_file(tmp_path):
    result = run_cli("validate", tmp_path / "none.yaml")
    assert result.exit_code == 2
    assert result.stderr == f"error: {tmp_path / 'none.yaml'}: config file does not exist\n"


@pytest.mark.parametrize(
    "name,content,expected",
    [
        ("p.txt", b"", "prompts_file: '{path}' has no prompts"),
        ("p.txt", b"\n  \n", "prompts_file: '{path}' has no prompts"),
        ("p.txt", b"a cat\x00\x01", "prompts_file: '{path}' is binary, not a text file"),
        ("p.txt", b"caf\xe9\n", "prompts_file: '{path}' is not UTF-8 (bad byte at offset 3)"),
        ("p.csv", b"a cat\n", "prompts_file: 'p.csv' must end in .txt (one prompt per line) or .jsonl"),
        (
            "p.jsonl",
            b'{"prompt": "a"}\n{"prompt": "b",}\n',
            "prompts_file:2: not valid JSON (Expecting property name enclosed in double quotes)",
        ),
        ("p.jsonl", b'{"prompt": "a", "sede": 3}\n', "prompts_file:1: unknown key 'sede' (did you mean 'seed'?)"),
        ("p.jsonl", b'"a cat"\n', "prompts_file:1: expected a JSON object with a 'prompt' key"),
        ("p.jsonl", b'{"negative_prompt": "x"}\n', "prompts_file:1: 'prompt' is missing"),
        ("p.jsonl", b'{"prompt": "a", "steps": 0}\n', "prompts_file:1: steps must be an integer from 1 to 1000, got 0"),
        ("p.jsonl", b'{"prompt": " "}\n', "prompts_file:1: prompt is empty"),
        (
            "p.jsonl",
            b'{"prompt": "a", "negative_prompt": "x\\ud83d"}\n',
            "prompts_file:1: negative_prompt: unpaired surrogate U+D83D at character 1 (not valid Unicode text)",
        ),
        (
            "p.jsonl",
            b'{"prompt": "a", "guidance_scale": Infinity}\n',
            "prompts_file:1: Infinity is not a number JSON allows (give a finite number)",
        ),
        (
            "p.jsonl",
            b'{"prompt": "a", "height": 65}\n',
            "prompts_file:1: height must be a positive multiple of 8, got 65",
        ),
    ],
    ids=[
        "empty",
        "blank",
        "binary",
        "latin1",
        "suffix",
        "bad-json",
        "unknown-key",
        "not-object",
        "no-prompt",
        "bad-steps",
        "blank-prompt",
        "half-a-utf16-pair",
        "infinite-guidance",
        "bad-height",
    ],
)
def test_bad_prompt_files(tmp_path, name, content, expected):
    prompts = tmp_path / name
    prompts.write_bytes(content)
    config = tiny_config(tmp_path, prompts=None)
    config.pop("prompts")
    config["prompts_file"] = name
    result = run_cli("validate", write_config(tmp_path / "c.yaml", config))
    assert result.exit_code == 2
    assert result.stderr == f"error: {expected.replace('{path}', str(prompts))}\n"


def test_prompt_files_resolve_with_per_prompt_overrides(tmp_path):
    (tmp_path / "p.jsonl").write_text(
        '{"prompt": "a cat", "seed": 100, "steps": 5, "guidance_scale": 1.0}\n\n{"prompt": "a dog", "negative_prompt": "cats"}\n'
    )
    config = tiny_config(tmp_path, prompts=None)
    config.pop("prompts")
    config["prompts_file"] = "p.jsonl"
    run = load_config(write_config(tmp_path / "c.yaml", config))
    assert [(p.prompt, p.negative_prompt, p.seed, p.steps, p.guidance_scale) for p in run.prompts] == [
        ("a cat", "blurry", 100, 5, 1.0),
        ("a dog", "cats", None, 3, 7.5),
    ]
    assert run.config.prompts_file == str(tmp_path / "p.jsonl")


def test_validate_prints_the_resolved_config(tmp_path):
    config = tiny_config(tmp_path)
    del config["height"], config["width"]
    path = write_config(tmp_path / "c.yaml", config)
    result = run_cli("validate", path, "steps=30", "model.scheduler=DPM++ 2M Karras", "negative_prompt=yes")
    assert result.exit_code == 0, result.output
    resolved = yaml.safe_load(result.stdout)
    assert resolved["steps"] == 30
    assert resolved["model"]["scheduler"] == "DPM++ 2M Karras"
    assert resolved["negative_prompt"] == "yes"  # typed by the schema: a str field keeps the text
    assert (resolved["height"], resolved["width"]) == (64, 64)  # tiny-sd's own size filled in
    assert resolved["output"]["dir"] == str(tmp_path / "outputs")
    # Every key, an unset optional section (hires: null) as its one key.
    assert resolved["hires"] is None
    assert sorted(_flatten(resolved)) == sorted(
        {key.split(".")[0] if key.startswith("hires.") else key for key in all_keys()}
    )


def test_override_replaces_the_other_prompt_source(tmp_path):
    config = tiny_config(tmp_path, prompts=None)
    config.pop("prompts")
    config["prompts_file"] = "missing.txt"
    path = write_config(tmp_path / "c.yaml", config)
    result = run_cli("validate", path, "prompts=[a cat, a dog]")
    assert result.exit_code == 0, result.output
    assert yaml.safe_load(result.stdout)["prompts"] == ["a cat", "a dog"]


def test_config_hash_ignores_output_but_not_prompts(tmp_path):
    base = load_config(write_config(tmp_path / "a.yaml", tiny_config(tmp_path)))
    moved = load_config(write_config(tmp_path / "b.yaml", tiny_config(tmp_path, output={"dir": str(tmp_path / "x")})))
    other = load_config(write_config(tmp_path / "c.yaml", tiny_config(tmp_path, prompts=["something else"])))
    assert base.config_hash == moved.config_hash != other.config_hash


def test_every_shipped_config_validates_and_comments_every_key():
    root = Path(__file__).resolve().parent.parent / "configs"
    for path in sorted(root.glob("*.yaml")):
        load_config(path, prompts_required=path.name != "serve.yaml")  # a server's config needs no prompts
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            stripped = line.strip()
            if stripped and not stripped.startswith(("#", "-")) and ":" in stripped:
                assert lines[i - 1].strip().startswith("#"), (
                    f"{path.name}:{i + 1}: key {stripped!r} has no comment above it"
                )


def test_console_script_reports_bad_input_without_traceback(tmp_path):
    path = write_config(tmp_path / "c.yaml", tiny_config(tmp_path, steps=0))
    tpugen = Path(sys.executable).parent / "tpugen"
    proc = subprocess.run([str(tpugen), "generate", str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr == "error: steps: must be greater than or equal to 1, got 0\n"
    assert not (tmp_path / "outputs").exists()


def _flatten(data: dict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in data.items():
        if isinstance(value, dict):
            keys.extend(_flatten(value, f"{prefix}{key}."))
        else:
            keys.append(f"{prefix}{key}")
    return keys


@pytest.mark.parametrize(
    "text,expected",
    [
        ("seed: 0042\n", "seed: expected a decimal integer without leading zeros or ':', got '0042'"),
        ("steps: 1:30\n", "steps: expected a decimal integer without leading zeros or ':', got '1:30'"),
        ("seed: 0x10\n", "seed: expected a decimal integer without leading zeros or ':', got '0x10'"),
        ("seed: 08\n", "seed: expected a decimal integer without leading zeros or ':', got '08'"),
        ("guidance_scale: .inf\n", "guidance_scale: must be a finite number, got inf"),
    ],
    ids=["octal", "base-60", "hex", "leading-zero", "infinity"],
)
def test_numbers_in_the_config_file_are_read_as_written(tmp_path, text, expected):
    config = write_config(tmp_path / "c.yaml", tiny_config(tmp_path))
    for line in ("seed: 7\n", "steps: 3\n", "guidance_scale: 7.5\n"):  # each key once: a second is refused
        config.write_text(config.read_text().replace(line, ""))
    config.write_text(config.read_text() + text)
    result = run_cli("validate", config)
    assert result.exit_code == 2
    assert result.stderr == f"error: {expected}\n"


def test_decimal_numbers_and_strings_that_look_like_numbers_round_trip(tmp_path):
    config = tiny_config(tmp_path, seed=42, guidance_scale=1000.5, prompts=["1e3", "0042", "1:30", "yes"])
    run = load_config(write_config(tmp_path / "c.yaml", config), ["steps=25"])
    assert (run.config.seed, run.config.steps, run.config.guidance_scale) == (42, 25, 1000.5)
    assert run.config.prompts == ["1e3", "0042", "1:30", "yes"]
    # tpugen's own YAML reads back as the same config (the run directory's config.yaml, a resume).
    (tmp_path / "again.yaml").write_text(run.to_yaml())
    again = load_config(tmp_path / "again.yaml")
    assert again.config == run.config and again.config_hash == run.config_hash


@pytest.mark.parametrize("separator", ["\u2028", "\u2029", "\x85", "\x0c", "\x0b", "\x1c", "\x1d", "\x1e"])
def test_prompt_files_break_lines_at_newlines_only(tmp_path, separator):
    (tmp_path / "p.txt").write_text(f"a cat{separator}on a mat\r\na dog\n", encoding="utf-8", newline="")
    (tmp_path / "p.jsonl").write_text(
        f'{{"prompt": "an owl{separator}at night"}}\n{{"prompt": "a fox"}}\n', encoding="utf-8", newline=""
    )
    # JSON allows these characters raw in a string except the control characters (below U+0020).
    names = ("p.txt", "p.jsonl") if ord(separator) >= 0x20 else ("p.txt",)
    for name in names:
        first = f"a cat{separator}on a mat" if name == "p.txt" else f"an owl{separator}at night"
        config = tiny_config(tmp_path, prompts=None)
        config.pop("prompts")
        config["prompts_file"] = name
        run = load_config(write_config(tmp_path / "c.yaml", config))
        assert [p.prompt for p in run.prompts] == [first, "a dog" if name == "p.txt" else "a fox"]


def test_inline_prompts_may_be_mappings_like_jsonl_lines(tmp_path):
    config = tiny_config(tmp_path, prompts=["a cat", {"prompt": "a dog", "seed": 5, "steps": 9, "height": 96}])
    run = load_config(write_config(tmp_path / "c.yaml", config))
    assert [(p.prompt, p.seed, p.steps, p.sizes) for p in run.prompts] == [
        ("a cat", None, 3, ((64, 64),)),
        ("a dog", 5, 9, ((96, 64),)),
    ]
    bad = tiny_config(
        tmp_path, prompts=[{"prompt": "a dog", "sede": 5}, {"prompt": "x", "guidance_scale": float("inf")}, 7]
    )
    result = run_cli("validate", write_config(tmp_path / "bad.yaml", bad))
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        "error: prompts[2]: a prompt is a string, or a mapping like a .jsonl line, got 7",
    ]
    bad["prompts"] = bad["prompts"][:2]
    result = run_cli("validate", write_config(tmp_path / "bad.yaml", bad))
    assert result.stderr.splitlines() == [
        "error: prompts[0]: unknown key 'sede' (did you mean 'seed'?)",
        "error: prompts[1]: guidance_scale must be a finite number >= 0, got inf",
    ]


def test_model_file_digests_are_cached_per_file_version_and_survive_threads_and_a_broken_cache(tmp_path, monkeypatch):
    import hashlib
    import json
    import os
    import threading

    from tpugen.config import digests

    monkeypatch.setenv("TPUGEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(digests, "_KNOWN", {})
    files = []
    for n in range(12):
        path = tmp_path / f"w{n}.safetensors"
        path.write_bytes(bytes([n]) * 1000)
        os.utime(path, (1_000_000_000, 1_000_000_000))  # settled: its digest is kept
        files.append(path)
    want = {path: hashlib.sha256(path.read_bytes()).hexdigest() for path in files}
    found, threads = {}, []
    for part in range(4):  # four threads of one process, as a server's request threads, writing the one cache
        threads.append(
            threading.Thread(target=lambda p=part: found.update({f: digests.file_sha256(f) for f in files[p::4]}))
        )
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert found == want
    cached = json.loads((tmp_path / "cache" / "file-sha256.json").read_text())
    assert sorted(cached.values()) == sorted(want.values()) and not list((tmp_path / "cache").glob(".*"))
    # Another version of a file (same size, another content) is read again; a file changed just now is not kept.
    files[0].write_bytes(bytes([99]) * 1000)
    assert digests.file_sha256(files[0]) == hashlib.sha256(bytes([99]) * 1000).hexdigest()
    assert len(json.loads((tmp_path / "cache" / "file-sha256.json").read_text())) == 12
    # A broken cache file, or a cache that cannot be written, only means reading the file again.
    (tmp_path / "cache" / "file-sha256.json").write_text("{not json")
    monkeypatch.setattr(digests, "_KNOWN", {})
    assert digests.file_sha256(files[1]) == want[files[1]]
    monkeypatch.setenv("TPUGEN_CACHE", str(files[2]))  # a file where the folder would be
    assert digests.file_sha256(files[3]) == want[files[3]] and digests.file_sha256(tmp_path / "gone") is None
