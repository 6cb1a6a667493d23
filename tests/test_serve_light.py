"""The server's pieces that need no device: what `generate --server` sends."""

from __future__ import annotations

from conftest import tiny_config, write_config

from tpugen.config import load_config
from tpugen.modes.serve.client import run_payload


def test_generate_on_a_server_sends_only_the_settings_the_user_made(tmp_path):
    # The server refuses a key that differs from its own: a default sent here (model.scheduler: null while the
    # server runs DDIM, say) would refuse a run the user never asked to differ.
    config = tiny_config(tmp_path, compile={"torch_compile": False})
    run = load_config(write_config(tmp_path / "c.yaml", config))
    data = run_payload(run, "r1")
    assert data["model"] == {"id": "tiny-sd", "dtype": "float32"}
    assert data["execution"] == {"backend": "xla"} and data["compile"] == {"torch_compile": False, "trace_once": False}
    assert "cache" not in data and "serve" not in data and "prompts_file" not in data
    assert data["output"] == {"run_id": "r1"} and data["batch_size"] == 2 and data["prompts"][0] == config["prompts"][0]


def test_a_request_past_its_timeout_says_how_many_of_its_images_were_made(tmp_path):
    """The 504's words: a request that got part of its images has not been waiting for a device all along."""
    import threading

    import pytest

    from tpugen.engine import Display
    from tpugen.modes.serve.service import Service, TimedOut
    from tpugen.plan import ImageWork

    config = tiny_config(tmp_path, serve={"new_shapes": "compile", "request_timeout_s": 0.5, "batch_window_ms": 0})
    del config["prompts"]
    run = load_config(write_config(tmp_path / "serve.yaml", config), prompts_required=False)
    service = Service(run, [], output_root=tmp_path / "runs", display=Display())  # no engine: this test is the device
    service.state = "ready"
    image = ImageWork(prompt="a cat", negative_prompt="", seed=1, steps=3, guidance_scale=7.5, height=64, width=64)

    def make_one() -> None:  # what a device loop does, for the first image only
        _, jobs = service.queue.take(timeout=5)
        jobs[0].request.deliver(jobs[0].position, "pixels")

    loop = threading.Thread(target=make_one)
    loop.start()
    with pytest.raises(TimedOut) as late:
        service.generate(
            [
                image,
                ImageWork(prompt="a dog", negative_prompt="", seed=2, steps=3, guidance_scale=7.5, height=64, width=64),
            ]
        )
    loop.join(5)
    assert late.value.lines == [
        "the request was not done within 0.5 s (serve.request_timeout_s): 1 of 2 images were made"
    ]
    with pytest.raises(TimedOut) as waited:  # nothing takes this one
        service.generate([image])
    assert waited.value.lines == ["the request waited 0.5 s (serve.request_timeout_s) for a device"]
    assert service.queue.open_count() == 0 and service.queue.depth() == 0  # both slots freed, no image left queued


def test_a_flux_server_refuses_a_size_its_pipeline_would_round_down(tmp_path):
    import pytest

    from tpugen.engine import Display
    from tpugen.errors import InputError
    from tpugen.modes.serve.service import Service
    from tpugen.plan import ImageWork

    config = tiny_config(tmp_path, model={"id": "tiny-flux"}, serve={"new_shapes": "compile"})
    del config["prompts"]
    run = load_config(write_config(tmp_path / "serve.yaml", config), prompts_required=False)
    service = Service(run, [], output_root=tmp_path / "runs", display=Display())
    with pytest.raises(InputError) as refused:
        service.check(
            [ImageWork(prompt="a fox", negative_prompt="", seed=1, steps=4, guidance_scale=0.0, height=72, width=64)]
        )
    assert refused.value.lines == ["size: 64x72: Flux.1 (schnell, dev) models need multiples of 16"]
    service.check(
        [ImageWork(prompt="a fox", negative_prompt="", seed=1, steps=4, guidance_scale=0.0, height=80, width=64)]
    )  # 16 divides both: fine
