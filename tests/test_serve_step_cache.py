"""`tpugen serve` with compile.step_cache: the server warms every kind of step its cache runs, so requests of any
step count compile nothing, and no request or run switches its one cache."""

from __future__ import annotations

import json

import httpx
import pytest
import yaml
from conftest import one_call, work_item, write_config
from serve_support import (
    AUTH,
    KEY,
    decode,
    metric,
    run_body,
    running_server,
    serve_config,
    txt2img,
    wait_ready,
    wait_run,
)
from test_step_cache import TAYLORSEER

from tpugen.config.schema import StepCacheConfig

FLUX = {"id": "tiny-flux", "dtype": "float32"}


def flux_serve_config(tmp, **serve):
    """A tiny-flux server's config at 4 steps with TaylorSeer (interval 3 from step 2), 80x64: a size of its own,
    so tests/test_step_cache.py's 64x64 graphs are not compiled here first in a whole-suite process."""
    path = serve_config(tmp, **serve)
    config = yaml.safe_load(path.read_text())
    config.update(model=FLUX, steps=4, width=80, compile={**config["compile"], "step_cache": TAYLORSEER})
    return write_config(path, config)


def test_the_warm_plan_runs_the_steps_that_bring_every_kind_of_step(tmp_path):
    from tpugen.config import load_config
    from tpugen.engine import Display
    from tpugen.engine.step_cache import covers, step_graphs, warm_steps
    from tpugen.modes.serve.service import Service

    cache = StepCacheConfig(**TAYLORSEER)
    # At the config's 4 steps one kind is missing (a step predicted 2 steps after a full one, first at step 5),
    # so the server warms at 6: from there on no step count brings a new kind.
    assert not covers(cache, 4, 6) and covers(cache, 6, 1000) and covers(cache, 6, 2)
    assert len(set(step_graphs(cache, 6))) == len(set(step_graphs(cache, 1000))) == 5
    assert warm_steps(cache, 4) == 6 and warm_steps(cache, 28) == 28 and warm_steps(StepCacheConfig(), 4) == 4
    # A full step right after the cool-down starts (divided by 1) comes only at disable_cache_after_step + 1.
    late = StepCacheConfig(**{**TAYLORSEER, "disable_cache_before_step": 1, "disable_cache_after_step": 20})
    assert warm_steps(late, 4) == 22

    run = load_config(flux_serve_config(tmp_path), prompts_required=False)
    service = Service(run, [], output_root=tmp_path / "runs", display=Display())
    assert [batch.steps for batch in service.warm.plan().batches] == [6]

    # PAB: its warmup's stand-in timesteps (one step outside its range, skip-range steps inside) make every kind of
    # step any request makes, so a server of 2 steps warms at 3 and then covers any step count.
    path = flux_serve_config(tmp_path)
    config = yaml.safe_load(path.read_text())
    config.update(steps=2, compile={"step_cache": {"method": "pyramid_attention_broadcast"}})
    run = load_config(write_config(path, config), prompts_required=False)
    service = Service(run, [], output_root=tmp_path / "runs", display=Display())
    assert [batch.steps for batch in service.warm.plan().batches] == [3]
    pab = run.config.compile.step_cache
    assert covers(pab, 3, 1000) and covers(pab, 3, 1) and not covers(pab, 2, 2)


def test_a_run_cannot_switch_the_servers_step_cache(tmp_path):
    from tpugen.config import load_config
    from tpugen.engine import Display
    from tpugen.errors import InputError
    from tpugen.modes.serve.service import Service

    run = load_config(flux_serve_config(tmp_path), prompts_required=False)
    service = Service(run, [], output_root=tmp_path / "runs", display=Display())
    body = yaml.safe_load(run_body("r", model=FLUX))
    # Equal once diffusers' defaults are filled in: fine.
    service.sent_runs.resolve({**body, "compile": {"step_cache": dict(TAYLORSEER)}})
    for other in ({"method": "none"}, {**TAYLORSEER, "cache_interval": 4}, {"method": "magcache"}):
        with pytest.raises(InputError) as refused:
            service.sent_runs.resolve({**body, "compile": {"step_cache": other}})
        (line,) = refused.value.lines
        assert line.startswith("compile.step_cache: the server runs step cache taylorseer with {'cache_interval': 3,")
        assert line.endswith("} for all its requests and runs; leave it out or equal")


@pytest.mark.xla
def test_a_step_cache_server_answers_any_steps_with_no_compile_after_warmup(tmp_path):
    with running_server(flux_serve_config(tmp_path), tmp_path / "runs", KEY) as (url, service):
        wait_ready(url)
        with httpx.Client(base_url=url, headers=AUTH, timeout=180) as client:
            ready = client.get("/readyz").json()
            assert "; step cache taylorseer (cache_interval 3, disable_cache_before_step 2, " in ready["warm"]
            assert ready["warm"].endswith("the server's only one, warm for any steps")
            # Fewer, as many, more steps than the config's 4 (and than the warmup's 6): all warm.
            for steps in (3, 4, 9):
                answer = txt2img(client, prompt="a fox", negative_prompt="", steps=steps, seed=5, width=80)
                (infotext,) = json.loads(answer["info"])["infotexts"]
                assert "Step cache: taylorseer cache_interval=3 disable_cache_before_step=2 " in infotext
                record = json.loads(decode(answer["images"][0]).text["tpugen"])
                assert record["step_cache"] == StepCacheConfig(**TAYLORSEER).record()
            # A run of 12 steps with the server's cache (left out): warm, counted full and cached.
            created = client.post("/v1/runs", content=run_body("cached", model=FLUX, steps=12, width=80))
            assert created.status_code == 201, created.text
            status = wait_run(client, "cached")
            assert status["status"] == "complete" and status["report"]["compiles_after_warmup"] == 0, status
            report = json.loads(client.get("/v1/runs/cached/files/report.json").text)
            assert {(b["steps_full"], b["steps_cached"]) for b in report["timed_phase"]["batches"]} == {(5, 7)}
            # ... and one that asks for another cache is refused, naming the server's.
            other = client.post(
                "/v1/runs", content=run_body("uncached", model=FLUX, compile={"step_cache": {"method": "none"}})
            )
            assert other.status_code == 422 and other.json()["detail"][0].startswith(
                "compile.step_cache: the server runs step cache taylorseer with "
            )
        assert metric(url, "tpugen_compiles_after_warmup_total") == 0
        # Why the server warms at 6, on its engine at a size of its own: warmed at 4 steps, a call of 6 compiles
        # the one step graph step_graphs says 4 lacks (a step predicted 2 steps after a full one), and no other.
        from tpugen.plan import Batch, RunPlan, ShapeKey

        engine = service.engines[0]
        shape = ShapeKey(height=64, width=96, batch_size=2, cfg=False)

        def batch(steps: int) -> Batch:
            return one_call(work_item(prompt="a fox", seed=5, steps=steps, width=96, cfg=False), batch_size=2)

        engine.warmup(RunPlan(batch(4).items, (batch(4),)))
        assert engine.is_warm(shape, None, 4) and not engine.is_warm(shape, None, 6)
        before = engine.backend.counters()
        engine.generate(batch(6))
        assert (engine.backend.counters() - before).compiles == 1
