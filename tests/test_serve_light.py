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
    assert data["execution"] == {"backend": "xla"} and data["compile"] == {"torch_compile": False}
    assert "cache" not in data and "serve" not in data and "prompts_file" not in data
    assert data["output"] == {"run_id": "r1"} and data["batch_size"] == 2 and data["prompts"][0] == config["prompts"][0]
