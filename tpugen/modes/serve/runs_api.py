"""tpugen runs on the server: a run config in, the run directory `tpugen generate` writes, out."""

from __future__ import annotations

import json

import anyio.to_thread
import yaml
from fastapi import APIRouter, Request
from fastapi.responses import FileResponse

from tpugen.config.yamlio import yaml_load, yaml_problem
from tpugen.errors import InputError
from tpugen.modes.serve.replies import json_response, problem_response, read_body
from tpugen.modes.serve.service import RunHandle, Service
from tpugen.outputs.files import inside
from tpugen.outputs.manifest import read_manifest

router = APIRouter(prefix="/v1/runs")


def status_of(handle: RunHandle) -> dict:
    manifest = handle.run_dir / "manifest.jsonl"
    made = len({r["index"] for r in read_manifest(manifest)}) if manifest.exists() else 0
    body = {
        "id": handle.id,
        "status": handle.state,
        "images": made,
        "images_planned": handle.planned,
        "error": handle.error,
    }
    if handle.state in ("complete", "stopped", "failed") and (handle.run_dir / "report.json").is_file():
        body["report"] = json.loads((handle.run_dir / "report.json").read_text())
    return body


@router.post("")
async def submit(request: Request):
    """A run config, as YAML or JSON (the schema `tpugen generate` reads), run on the warm engine."""
    service: Service = request.app.state.service
    text = (await read_body(request)).decode("utf-8", errors="replace")
    try:
        data = json.loads(text) if "json" in request.headers.get("content-type", "") else yaml_load(text)
    except ValueError as exc:
        raise InputError(f"body: not a JSON run config ({exc})") from None
    except yaml.YAMLError as exc:
        raise InputError(f"body: {yaml_problem(exc)}") from None
    handle = await anyio.to_thread.run_sync(service.start_run, data)
    return json_response(status_of(handle), 201, {"Location": f"/v1/runs/{handle.id}"})


def _handle(service: Service, run_id: str) -> RunHandle | None:
    return service.runs.get(run_id)


@router.get("/{run_id}")
def get_run(run_id: str, request: Request):
    handle = _handle(request.app.state.service, run_id)
    if handle is None:
        return problem_response(404, [f"no run {run_id!r} on this server"])
    return status_of(handle)


@router.get("/{run_id}/files")
def list_files(run_id: str, request: Request):
    handle = _handle(request.app.state.service, run_id)
    if handle is None:
        return problem_response(404, [f"no run {run_id!r} on this server"])
    if not handle.run_dir.is_dir():  # queued: its directory is made once the run starts
        return {"id": run_id, "files": []}
    names = sorted(p.name for p in handle.run_dir.iterdir() if p.is_file() and not p.name.startswith("."))
    return {"id": run_id, "files": names}


@router.get("/{run_id}/files/{name}")
def get_file(run_id: str, name: str, request: Request):
    handle = _handle(request.app.state.service, run_id)
    if handle is None:
        return problem_response(404, [f"no run {run_id!r} on this server"])
    try:
        path = inside(handle.run_dir, name)
    except ValueError:
        return problem_response(404, [f"no file {name!r} in run {run_id!r}"])
    if name.startswith(".") or not path.is_file():
        return problem_response(404, [f"no file {name!r} in run {run_id!r}"])
    return FileResponse(path)


@router.delete("/{run_id}")
def stop_run(run_id: str, request: Request):
    """Stop after the batch in flight; the run stays resumable (`tpugen resume` on the server's disk)."""
    service: Service = request.app.state.service
    handle = _handle(service, run_id)
    if handle is None:
        return problem_response(404, [f"no run {run_id!r} on this server"])
    if handle.state in ("queued", "running"):
        service.stop_run(run_id)
    return json_response({**status_of(handle), "stopping": handle.state in ("queued", "running")}, 202)
