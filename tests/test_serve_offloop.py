"""Nothing a reply costs runs on the server's event loop: the A1111 and OpenAI routes make their images, PNGs,
base64 and JSON in a worker thread, so a big reply never holds up another request (a /healthz among them)."""

from __future__ import annotations

import asyncio

import pytest

pytestmark = pytest.mark.xla


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


@pytest.fixture
def encodings(monkeypatch):
    """Each PNG-and-base64 encoding the routes do, as whether it ran on the event loop's thread."""
    from tpugen.modes.serve import a1111, openai_api, replies

    seen: list[bool] = []
    encode = replies.image_b64

    def recording(*args, **kwargs):
        seen.append(_on_event_loop())
        return encode(*args, **kwargs)

    monkeypatch.setattr(a1111, "image_b64", recording)
    monkeypatch.setattr(openai_api, "image_b64", recording)
    return seen


def test_web_ui_and_openai_replies_are_encoded_off_the_event_loop(client, encodings):
    # Before, both routes were `async def` and encoded each PNG on the event loop: every entry here was True.
    web_ui = {"prompt": "a cat", "negative_prompt": "blurry", "steps": 3, "cfg_scale": 7.5, "width": 64, "height": 64}
    assert client.post("/sdapi/v1/txt2img", json={**web_ui, "batch_size": 2}).status_code == 200
    assert client.post("/v1/images/generations", json={"prompt": "a dog", "size": "64x64"}).status_code == 200
    assert encodings == [False, False, False]
