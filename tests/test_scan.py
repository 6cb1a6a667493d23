"""compile.scan_blocks: each family's repeated blocks through torch_xla's scan give the unrolled model's images."""

from __future__ import annotations

import json

import pytest
from conftest import OTHER_GRAPH, assert_same_images, run_cli, tiny_config, with_prompts_file, write_config


@pytest.mark.xla
def test_scanned_flux_at_real_depth_matches_unrolled_and_never_recompiles(tmp_path):
    runs = {}
    for scan in (False, True):
        lines = ['{"prompt": "a cat"}', '{"prompt": "a dog"}', '{"prompt": "an owl", "steps": 4}']
        base = tiny_config(tmp_path / str(scan), model={"id": "tiny-flux-deep"}, steps=2, compile={"scan_blocks": scan})
        config = with_prompts_file(tmp_path / str(scan), base, lines, "p.jsonl")
        result = run_cli("generate", write_config(tmp_path / str(scan) / "c.yaml", config), "--quiet")
        assert result.exit_code == 0, result.output
        runs[scan] = tmp_path / str(scan) / "outputs" / "run"
    report = json.loads((runs[True] / "report.json").read_text())
    assert report["compiles_after_warmup"] == 0 and [b["steps"] for b in report["timed_phase"]["batches"]] == [2, 4]
    assert report["warmup"][0]["graphs_per_phase"]["later denoising steps"] == 0
    assert len(list(runs[False].glob("[0-9]*.png"))) == 3
    assert_same_images(runs[True], runs[False], OTHER_GRAPH)


@pytest.mark.parametrize("model,backend", [("tiny-sd", "xla"), ("tiny-flux", "cpu"), ("tiny-sd3", "cpu")])
def test_scan_blocks_is_for_flux_on_xla(tmp_path, model, backend):
    config = tiny_config(tmp_path, model={"id": model}, execution={"backend": backend}, compile={"scan_blocks": True})
    result = run_cli("validate", write_config(tmp_path / "c.yaml", config))
    assert result.exit_code == 2
    assert result.stderr == (
        "error: compile.scan_blocks: is built for Stable Diffusion 3 / 3.5, Flux.1 (schnell, dev), FLUX.2 [klein], "
        "FLUX.2 [klein] distilled, FLUX.2 [dev], Z-Image, Qwen-Image, Qwen-Image-Edit Plus and Qwen-Image-Edit "
        "models on execution.backend: xla\n"
    )


# Each 2026 family's built-in, its blocks scanned: (model, blocks in a scan). Z-Image's tiny refiners have one
# block each (nothing to stack), its two main layers are one stack.
NEW_FAMILY_SCANS = [
    ("tiny-flux2-klein", 4),
    ("tiny-flux2", 4),
    ("tiny-z-image", 2),
    ("tiny-qwen-image", 2),
    ("tiny-qwen-image-edit-plus", 2),
]
# The edit-only built-in's prompts (one a batch), each editing two references whose tokens join the latent's.
EDITS = ['{"prompt": "a cat", "reference_images": ["a.png", "b.png"]}']
EDITS.append('{"prompt": "an owl on picture 2", "steps": 3, "reference_images": ["b.png", "a.png"]}')


@pytest.mark.xla
@pytest.mark.parametrize("model,blocks", NEW_FAMILY_SCANS)
def test_each_new_family_scans_its_blocks_with_the_unrolled_images(tmp_path, model, blocks):
    from tpugen.families import BUILTINS

    edits = BUILTINS[model][1].txt2img_refusal is not None
    runs = {}
    for scan in (False, True):
        lines = ['{"prompt": "a cat"}', '{"prompt": "a long prompt about a dog on a skateboard"}']
        lines.append('{"prompt": "an owl", "steps": 3}')
        base = tiny_config(tmp_path / str(scan), model={"id": model}, steps=2, compile={"scan_blocks": scan})
        if edits:
            lines, base["batch_size"] = EDITS, 1
            _noise_images(tmp_path / str(scan), "ab")
        config = with_prompts_file(tmp_path / str(scan), base, lines, "p.jsonl")
        result = run_cli("generate", write_config(tmp_path / str(scan) / "c.yaml", config), "--quiet")
        assert result.exit_code == 0, result.output
        runs[scan] = tmp_path / str(scan) / "outputs" / "run"
    report = json.loads((runs[True] / "report.json").read_text())
    assert report["device"]["scanned_blocks"] == blocks
    assert report["compiles_after_warmup"] == 0 and [b["steps"] for b in report["timed_phase"]["batches"]] == [2, 3]
    assert report["warmup"][0]["graphs_per_phase"]["later denoising steps"] == 0
    assert len(list(runs[False].glob("[0-9]*.png"))) == len(lines)
    assert_same_images(runs[True], runs[False], OTHER_GRAPH)


def _noise_images(folder, names: str) -> None:
    """64x64 noise PNGs in `folder`, one per letter of `names` (a.png, b.png, ...)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(3)
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(folder / f"{name}.png")


@pytest.mark.xla
def test_sd35_style_blocks_scan_in_stacks_of_equal_structure():
    """SD 3.5's first blocks have dual attention, and SD3's last block differs: three runs, two of them scanned."""
    import torch
    import torch_xla
    import torch_xla.debug.metrics as met

    from tpugen.backends.xla.scan import scan_repeated_blocks
    from tpugen.families import family as family_code
    from tpugen.families.sd3.tiny import tiny_transformer as tiny_sd3_transformer

    torch.manual_seed(0)
    device = torch_xla.device()
    unrolled = tiny_sd3_transformer(6, dual_attention_layers=(0, 1)).eval()
    scanned = tiny_sd3_transformer(6, dual_attention_layers=(0, 1)).eval()
    scanned.load_state_dict(unrolled.state_dict())
    assert (
        scan_repeated_blocks(scanned, family_code("sd3").scan_attributes) == 5
    )  # blocks 0-1 and 2-4 scanned, block 5 (context_pre_only) as is
    kinds = [type(b).__name__ for b in scanned.transformer_blocks]
    assert kinds == ["ScannedBlocks", "ScannedBlocks", "JointTransformerBlock"]
    unrolled.to(device)
    scanned.to(device)

    def inputs(seed):
        g = torch.Generator().manual_seed(seed)
        return {
            "hidden_states": torch.randn(1, 4, 8, 8, generator=g).to(device),
            "encoder_hidden_states": torch.randn(1, 6, 32, generator=g).to(device),
            "pooled_projections": torch.randn(1, 64, generator=g).to(device),
            "timestep": torch.tensor([500.0]).to(device),
            "return_dict": False,
        }

    with torch.no_grad():
        for seed in (1, 2):
            feed = inputs(seed)
            expected = unrolled(**feed)[0].cpu()
            compiles = met.metric_data("CompileTime")[0] if met.metric_data("CompileTime") else 0
            got = scanned(**feed)[0].cpu()
            after = met.metric_data("CompileTime")[0]
            assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()
            if seed == 2:  # same shapes again: the scanned graph is replayed, not compiled
                assert after == compiles


@pytest.mark.xla
def test_qwen_image_edit_2511_blocks_scan_with_their_modulation_index():
    """Qwen-Image-Edit-2511's transformer (zero_cond_t: the references' tokens modulated as at time 0, by a
    per-call index of which tokens are the references') scanned on XLA gives the unrolled outputs (eager, on the
    CPU), a latent and a reference of 4x4 tokens each; the same shapes again compile nothing."""
    import torch
    import torch_xla
    import torch_xla.debug.metrics as met

    from tpugen.backends.xla.scan import scan_repeated_blocks
    from tpugen.families import family as family_code
    from tpugen.families.qwenimage.tiny import tiny_transformer

    torch.manual_seed(0)
    device = torch_xla.device()
    unrolled = tiny_transformer(zero_cond_t=True).eval()
    scanned = tiny_transformer(zero_cond_t=True).eval()
    scanned.load_state_dict(unrolled.state_dict())
    assert scan_repeated_blocks(scanned, family_code("qwenimage_edit_plus").scan_attributes) == 2
    assert [type(b).__name__ for b in scanned.transformer_blocks] == ["ScannedBlocks"]
    scanned.to(device)

    def inputs(seed, where):
        g = torch.Generator().manual_seed(seed)
        return {
            "hidden_states": torch.randn(1, 32, 16, generator=g).to(where),  # the latent's 16 tokens, the reference's
            "encoder_hidden_states": torch.randn(1, 6, 16, generator=g).to(where),
            "encoder_hidden_states_mask": torch.tensor([[1, 1, 1, 1, 0, 0]]).to(where),
            "timestep": torch.tensor([0.6]).to(where),
            "img_shapes": [[(1, 4, 4), (1, 4, 4)]],
            "return_dict": False,
        }

    with torch.no_grad():
        for seed in (1, 2):
            expected = unrolled(**inputs(seed, "cpu"))[0]
            compiles = met.metric_data("CompileTime")[0] if met.metric_data("CompileTime") else 0
            got = scanned(**inputs(seed, device))[0].cpu()
            after = met.metric_data("CompileTime")[0]
            assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()
            if seed == 2:  # same shapes again: the scanned graph is replayed, not compiled
                assert after == compiles
