"""What the page reads that no other API serves: the server's warm shapes and defaults, a run's images paged."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request

from tpugen.modes.serve.replies import problem_response
from tpugen.modes.serve.service import Service
from tpugen.outputs.manifest import read_manifest
from tpugen.outputs.png import a1111_parameters
from tpugen.schedulers import SCHEDULER_NAMES

router = APIRouter()


@router.get("/v1/server")
def server(request: Request) -> dict:
    """What this server serves: its state, model and device, the sizes and samplers it keeps warm (sizes as
    width and height; sampler null is the model's own), serve.new_shapes (what a cold one gets: reject or
    compile), the defaults a request's unset fields take, the LoRAs of serve.lora_dir, the images waiting
    for a device and the requests open. Read by the page at GET /."""
    service: Service = request.app.state.service
    engine = service.engines[0]
    config = service.run.config
    default = engine.loaded.default_scheduler
    if service.family.flow_matching:
        samplers = ["Euler"]
    else:
        samplers = list(dict.fromkeys([default, *SCHEDULER_NAMES]))
    warm = [name or default for name in service.schedulers]
    return {
        "status": service.state,
        "model": {"id": config.model.id, "label": engine.model_label, "family": service.family.title},
        "device": engine.backend.describe(),
        "engines": len(service.engines),
        "batch_size": service.batch_size,
        "cfg": service.cfg,
        "warm": {
            "sizes": [{"width": width, "height": height} for height, width in service.sizes],
            "samplers": warm,
            "steps": None if config.compile.step_cache.method == "none" else "any",
            "summary": service.warm_summary(),
        },
        "samplers": [{"name": name, "warm": name in warm, "default": name == default} for name in samplers],
        "new_shapes": service.serve.new_shapes,
        "defaults": {
            "width": service.sizes[0][1],
            "height": service.sizes[0][0],
            "steps": config.steps,
            "guidance_scale": config.guidance_scale,
            "negative_prompt": config.negative_prompt,
            "sampler": default,
        },
        "max_images_per_request": service.serve.max_images_per_request,
        "loras": [path.stem for path in service.lora_files()],
        "queue_depth": service.queue.depth(),
        "requests_open": service.queue.open_count(),
        "runs_open": len(service.runs),
    }


@router.get("/v1/runs/{run_id}/images")
def run_images(run_id: str, request: Request, offset: int = Query(0, ge=0), limit: int = Query(24, ge=1, le=200)):
    """A run's images so far in index order, `limit` from `offset`: each its file (GET /v1/runs/ID/files/NAME),
    index, size, seed, prompt and A1111 `parameters` text, from its manifest; `total` made so far, and `next`,
    the offset of the next page (null on the last)."""
    service: Service = request.app.state.service
    handle = service.find_run(run_id)
    if handle is None:
        return problem_response(404, [f"no run {run_id!r} on this server"])
    manifest = handle.run_dir / "manifest.jsonl"
    records = read_manifest(manifest) if manifest.is_file() else []
    by_index = {record["index"]: record for record in records}  # a resumed run may hold an index twice
    ordered = [by_index[index] for index in sorted(by_index)]
    page = ordered[offset : offset + limit]
    images = []
    for record in page:
        try:
            parameters = a1111_parameters(record)
        except (KeyError, TypeError):  # a record of another tpugen version: its image is still shown
            parameters = None
        images.append(
            {
                "index": record["index"],
                "file": record.get("file"),
                # The file's size: a hires fix's record holds the first pass's as its own (the web UI's Size).
                "width": (record.get("hires") or record).get("width"),
                "height": (record.get("hires") or record).get("height"),
                "seed": record.get("seed"),
                "prompt": record.get("prompt"),
                "parameters": parameters,
            }
        )
    after = offset + len(page)
    return {"id": run_id, "images": images, "total": len(ordered), "next": after if after < len(ordered) else None}
