"""Planning is pure data: indices, seeds, shape keys and padding checked by equality."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_cli, tiny_config, work_item, write_config

from tpugen.config import load_config
from tpugen.plan import Batch, ShapeKey, plan_run


def _run(tmp_path, **overrides):
    return load_config(write_config(tmp_path / "c.yaml", tiny_config(tmp_path, **overrides)))


def test_indices_seeds_and_padding(tmp_path):
    plan = plan_run(_run(tmp_path, prompts=["a", "b"], images_per_prompt=2, batch_size=3, seed=10))

    def item(index, p, prompt):
        return work_item(index=index, prompt_index=p, prompt=prompt, negative_prompt="blurry", seed=10 + index, steps=3)

    items = (item(0, 0, "a"), item(1, 0, "a"), item(2, 1, "b"), item(3, 1, "b"))
    shape = ShapeKey(height=64, width=64, batch_size=3, cfg=True)
    assert plan.items == items
    assert plan.batches == (
        Batch(number=0, shape=shape, items=items[:3], padding=0),
        Batch(number=1, shape=shape, items=items[3:], padding=2),
    )
    assert plan.batches[1].rows == (items[3], items[3], items[3])  # padding reuses a real prompt
    assert plan.shape_keys == [shape]
    assert plan.padding_rows == 2


def test_per_prompt_seed_steps_and_guidance_group_batches(tmp_path):
    (tmp_path / "p.jsonl").write_text(
        '{"prompt": "a", "seed": 500}\n{"prompt": "b", "steps": 5}\n{"prompt": "c"}\n{"prompt": "d", "guidance_scale": 1.0}\n'
    )
    config = tiny_config(tmp_path, batch_size=2, images_per_prompt=2, seed=0)
    del config["prompts"]
    config["prompts_file"] = "p.jsonl"
    plan = plan_run(load_config(write_config(tmp_path / "c.yaml", config)))
    assert [(i.index, i.seed) for i in plan.items] == [
        (0, 500),
        (1, 501),
        (2, 2),
        (3, 3),
        (4, 4),
        (5, 5),
        (6, 6),
        (7, 7),
    ]
    assert [([i.index for i in b.items], b.padding, b.steps, b.guidance_scale, b.shape) for b in plan.batches] == [
        ([0, 1], 0, 3, 7.5, ShapeKey(height=64, width=64, batch_size=2, cfg=True)),
        ([4, 5], 0, 3, 7.5, ShapeKey(height=64, width=64, batch_size=2, cfg=True)),
        ([2, 3], 0, 5, 7.5, ShapeKey(height=64, width=64, batch_size=2, cfg=True)),
        ([6, 7], 0, 3, 1.0, ShapeKey(height=64, width=64, batch_size=2, cfg=False)),
    ]
    # Step count does not change the compiled shape; switching CFG off does.
    assert plan.shape_keys == [
        ShapeKey(height=64, width=64, batch_size=2, cfg=True),
        ShapeKey(height=64, width=64, batch_size=2, cfg=False),
    ]


def test_batch_larger_than_the_work_pads_one_batch(tmp_path):
    plan = plan_run(_run(tmp_path, prompts=["only"], batch_size=4))
    assert [(len(b.items), b.padding) for b in plan.batches] == [(1, 3)]
    assert str(plan.shape_keys[0]) == "64x64 b4 cfg"


def test_several_sizes_and_per_prompt_sizes(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b", "height": 128, "width": 96}\n{"prompt": "c"}\n')
    config = tiny_config(tmp_path, batch_size=2, seed=0, sizes=[[64, 64], [96, 64]])
    del config["prompts"], config["height"], config["width"]
    config["prompts_file"] = "p.jsonl"
    plan = plan_run(load_config(write_config(tmp_path / "c.yaml", config)))
    assert [(i.index, i.prompt, i.height, i.width, i.seed) for i in plan.items] == [
        (0, "a", 64, 64, 0),
        (1, "a", 96, 64, 1),
        (2, "b", 128, 96, 2),
        (3, "c", 64, 64, 3),
        (4, "c", 96, 64, 4),
    ]
    assert [([i.index for i in b.items], b.padding, str(b.shape)) for b in plan.batches] == [
        ([0, 3], 0, "64x64 b2 cfg"),
        ([1, 4], 0, "96x64 b2 cfg"),
        ([2], 1, "128x96 b2 cfg"),
    ]


def test_ten_prompts_two_sizes_batch_four_compiles_two_shapes(tmp_path):
    config = tiny_config(tmp_path, prompts=[f"p{i}" for i in range(10)], batch_size=4, sizes=[[64, 64], [96, 64]])
    del config["height"], config["width"]
    plan = plan_run(load_config(write_config(tmp_path / "c.yaml", config)))
    assert [str(k) for k in plan.shape_keys] == ["64x64 b4 cfg", "96x64 b4 cfg"]
    assert [(len(b.items), b.padding) for b in plan.batches] == [(4, 0), (4, 0), (2, 2)] * 2


# The shipped configs of the 2026 families: each component's parameters and bfloat16 GB as `tpugen plan` counts them
# on the meta device (no download), and the verdicts (one chip, then the config's way of running) for the chip each
# config names and for a v5e, where FLUX.2 [dev] and Qwen-Image need SPMD.
CONFIGS = Path(__file__).resolve().parent.parent / "configs"
REAL_MODELS = [
    (
        "flux2-klein-4b.yaml",
        {"text_encoder": ("4.022 B", "8.04"), "transformer": ("3.876 B", "7.75"), "vae": ("0.084 B", "0.17")},
        "15.96",
        ("v6e (32 GB per chip): fits", "this config (the whole model on each chip): fits"),
        ("v5e (16 GB per chip): offload", "needs 19.2 GB with headroom, more than one v5e chip (16 GB)"),
    ),
    (
        "z-image-turbo.yaml",
        {"transformer": ("6.155 B", "12.31"), "text_encoder": ("4.022 B", "8.04"), "vae": ("0.084 B", "0.17")},
        "20.52",
        ("v6e (32 GB per chip): fits", "this config (the whole model on each chip): fits"),
        ("v5e (16 GB per chip): offload", "needs 24.6 GB with headroom, more than one v5e chip (16 GB)"),
    ),
    (
        "flux2-dev.yaml",
        {"transformer": ("32.223 B", "64.45"), "text_encoder": ("24.011 B", "48.02"), "vae": ("0.084 B", "0.17")},
        "112.64",
        ("v6e (32 GB per chip): shard -- transformer alone does not fit one v6e chip", "fits a VM of 8 chips or more"),
        ("v5e (16 GB per chip): shard -- transformer alone does not fit one v5e chip", "does not fit 8 chips"),
    ),
    (
        "qwen-image.yaml",
        {"transformer": ("20.430 B", "40.86"), "text_encoder": ("8.292 B", "16.58"), "vae": ("0.127 B", "0.25")},
        "57.70",
        ("v6e (32 GB per chip): shard -- transformer alone does not fit one v6e chip", "fits a VM of 4 chips or more"),
        ("v5e (16 GB per chip): shard -- transformer alone does not fit one v5e chip", "fits a VM of 8 chips or more"),
    ),
    (
        "qwen-image-edit-plus.yaml",
        {"transformer": ("20.430 B", "40.86"), "text_encoder": ("8.292 B", "16.58"), "vae": ("0.127 B", "0.25")},
        "57.70",
        ("v6e (32 GB per chip): shard -- transformer alone does not fit one v6e chip", "fits a VM of 4 chips or more"),
        ("v5e (16 GB per chip): shard -- transformer alone does not fit one v5e chip", "fits a VM of 8 chips or more"),
    ),
]


@pytest.mark.parametrize("name,components,total,own_chip,v5e", REAL_MODELS, ids=[case[0] for case in REAL_MODELS])
def test_plan_sizes_the_real_models_of_the_new_families(known_models_counted, name, components, total, own_chip, v5e):
    for chip, verdicts in ((None, own_chip), ("v5e", v5e)):
        result = run_cli("plan", CONFIGS / name, *(("--chip", chip) if chip else ()))
        assert result.exit_code == 0, result.output
        text = " ".join(result.stdout.split())  # rich wraps long lines
        assert "memory in bfloat16 (configs on the meta device)" in text
        for component, (parameters, gb) in components.items():
            assert f"│ {component} │ {parameters} │ {gb} │" in text, (component, text)
        assert f"│ total │ │ {total} │" in text
        assert all(verdict in text for verdict in verdicts), text
