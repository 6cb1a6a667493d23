"""compile.scan_blocks: Flux's repeated blocks through torch_xla's scan give the unrolled model's images."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import run_cli, tiny_config, write_config
from PIL import Image


@pytest.mark.xla
def test_scanned_flux_at_real_depth_matches_unrolled_and_never_recompiles(tmp_path):
    runs = {}
    for scan in (False, True):
        (tmp_path / str(scan)).mkdir()
        (tmp_path / str(scan) / "p.jsonl").write_text(
            '{"prompt": "a cat"}\n{"prompt": "a dog"}\n{"prompt": "an owl", "steps": 4}\n'
        )
        config = tiny_config(
            tmp_path / str(scan), model={"id": "tiny-flux-deep"}, steps=2, compile={"scan_blocks": scan}
        )
        del config["prompts"]
        config["prompts_file"] = "p.jsonl"
        result = run_cli("generate", write_config(tmp_path / str(scan) / "c.yaml", config), "--quiet")
        assert result.exit_code == 0, result.output
        runs[scan] = tmp_path / str(scan) / "outputs" / "run"
    report = json.loads((runs[True] / "report.json").read_text())
    assert report["compiles_after_warmup"] == 0 and [b["steps"] for b in report["timed_phase"]["batches"]] == [2, 4]
    assert report["warmup"][0]["graphs_per_phase"]["later denoising steps"] == 0
    names = sorted(p.name for p in runs[False].glob("[0-9]*.png"))
    assert len(names) == 3
    for name in names:
        a = np.asarray(Image.open(runs[False] / name), dtype=np.float64)
        b = np.asarray(Image.open(runs[True] / name), dtype=np.float64)
        assert np.abs(a - b).mean() <= 2.0, name


@pytest.mark.parametrize("model,backend", [("tiny-sd", "xla"), ("tiny-flux", "cpu")])
def test_scan_blocks_is_for_flux_on_xla(tmp_path, model, backend):
    config = tiny_config(tmp_path, model={"id": model}, execution={"backend": backend}, compile={"scan_blocks": True})
    result = run_cli("validate", write_config(tmp_path / "c.yaml", config))
    assert result.exit_code == 2
    assert result.stderr == (
        "error: compile.scan_blocks: is built for Flux models on execution.backend: xla (SD3's blocks are not yet)\n"
    )
