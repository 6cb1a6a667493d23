"""`tpugen serve`'s OpenAI images API, /v1/images/generations, spoken to by the official `openai` client."""

from __future__ import annotations

import numpy as np
import pytest
from serve_support import KEY, decode, pixels

pytestmark = pytest.mark.xla


def test_the_official_openai_client_gets_its_images(server):
    import openai

    url, _ = server
    ai = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    result = ai.images.generate(prompt="a lighthouse", n=2, size="64x64", response_format="b64_json", model="tiny-sd")
    images = [decode(item.b64_json) for item in result.data]
    assert [image.size for image in images] == [(64, 64), (64, 64)] and result.created > 0
    assert not np.array_equal(pixels(images[0]), pixels(images[1]))  # seed, then seed + 1
    with pytest.raises(openai.BadRequestError, match="response_format: url is not served; use b64_json"):
        ai.images.generate(prompt="a lighthouse", size="64x64", response_format="url")
    with pytest.raises(openai.BadRequestError, match="model: this server serves 'tiny-sd', not 'dall-e-3'"):
        ai.images.generate(prompt="a lighthouse", size="64x64", model="dall-e-3")
