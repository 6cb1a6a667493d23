"""tpugen runs on the server: a run config in, the run directory `tpugen generate` writes, out."""

from __future__ import annotations

import json
import threading
import time

import anyio
import anyio.to_thread
import yaml
from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, StreamingResponse

from tpugen.config.yamlio import yaml_load, yaml_problem
from tpugen.errors import InputError
from tpugen.files import inside
from tpugen.modes.serve.progress import Event, Job
from tpugen.modes.serve.replies import WrongType, json_response, problem_response
from tpugen.modes.serve.run_handles import RunHandle
from tpugen.modes.serve.service import Service
from tpugen.outputs.manifest import read_manifest
from tpugen.outputs.run_dir import RUN_RECORD

router = APIRouter(prefix="/v1/runs")


def status_of(handle: RunHandle, *, report: bool = True) -> dict:
    """A run's status as GET /v1/runs/ID answers it; with its report.json once it has ended (`report`)."""
    manifest = handle.run_dir / "manifest.jsonl"
    made = len({r["index"] for r in read_manifest(manifest)}) if manifest.exists() else 0
    body = {
        "id": handle.id,
        "status": handle.state,
        "images": made,
        "images_planned": handle.planned,
        "error": handle.error,
    }
    if report and handle.state in ("complete", "stopped", "failed") and (handle.run_dir / "report.json").is_file():
        body["report"] = json.loads((handle.run_dir / "report.json").read_text())
    return body


@router.post("")
async def submit(request: Request):
    """A run config, as YAML or JSON (the schema `tpugen generate` reads), run on the warm engine. A prompt's
    init_image, mask_image and reference_images are the images themselves, as base64 data: URIs: the server
    reads no paths."""
    service: Service = request.app.state.service
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media in PAGE_TYPES:
        raise WrongType(f"Content-Type: {media}; a run is sent as application/json or application/yaml")
    body = await request.body()  # over its route's limit, chunked or not, http.Guarded has refused it (413)
    as_json = "json" in media
    # Parsed in a worker thread, as the run is checked and started: a large body never holds up the event loop.
    handle = await anyio.to_thread.run_sync(lambda: service.start_run(run_config(body, as_json)))
    return json_response(status_of(handle), 201, {"Location": f"/v1/runs/{handle.id}"})


def run_config(body: bytes, as_json: bool):
    """A run body as data: JSON when its Content-Type says so, else YAML (a superset of JSON)."""
    text = body.decode("utf-8", errors="replace")
    try:
        return json.loads(text) if as_json else yaml_load(text)
    except ValueError as exc:
        raise InputError(f"body: not a JSON run config ({exc})") from None
    except yaml.YAMLError as exc:
        raise InputError(f"body: {yaml_problem(exc)}") from None


@router.get("")
def list_runs(request: Request, limit: int = Query(20, ge=1, le=100), after: str | None = Query(None, max_length=200)):
    """This server's runs, newest first, `limit` at a time (each as GET /v1/runs/ID answers, without its
    report); `next` is the `after` of the next page, null on the last. Read from the server's output
    directory, so runs of earlier server processes are listed too."""
    handles, after_this = request.app.state.service.list_runs(limit, after)
    return {"runs": [status_of(handle, report=False) for handle in handles], "next": after_this}


# The types any web page may POST without asking the server first (a CORS "simple" request): never a run's.
PAGE_TYPES = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data")
MAX_NAME = 255  # a file name's longest on Linux file systems


def _handle(service: Service, run_id: str) -> RunHandle | None:
    return service.find_run(run_id)


@router.get("/{run_id}")
def get_run(run_id: str, request: Request):
    """A run's status (queued, running, complete, stopped, failed), its error lines, and its report once it ended."""
    handle = _handle(request.app.state.service, run_id)
    if handle is None:
        return problem_response(404, [f"no run {run_id!r} on this server"])
    return status_of(handle)


@router.get("/{run_id}/files")
def list_files(run_id: str, request: Request):
    """The files a run has written so far (images, manifest, report)."""
    handle = _handle(request.app.state.service, run_id)
    if handle is None:
        return problem_response(404, [f"no run {run_id!r} on this server"])
    if not handle.run_dir.is_dir():  # queued: its directory is made once the run starts
        return {"id": run_id, "files": []}
    names = sorted(p.name for p in handle.run_dir.iterdir() if p.is_file() and not p.name.startswith("."))
    return {"id": run_id, "files": names}


@router.get("/{run_id}/files/{name}")
def get_file(run_id: str, name: str, request: Request):
    """One file a run wrote, by name."""
    handle = _handle(request.app.state.service, run_id)
    if handle is None:
        return problem_response(404, [f"no run {run_id!r} on this server"])
    missing = problem_response(404, [f"no file {name[:MAX_NAME]!r} in run {run_id!r}"])
    if name.startswith(".") or len(name.encode()) > MAX_NAME:  # no file of a run has such a name
        return missing
    try:
        path = inside(handle.run_dir, name)
        if not path.is_file():
            return missing
    except (ValueError, OSError):
        return missing
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


# ---------------------------------------------------------------- GET /v1/runs/ID/events

EVENTS_POLL_SECONDS = 0.25  # how often a stream looks for news of its run
KEEPALIVE_SECONDS = 15.0  # a comment line after this long without an event, so clients and proxies keep the stream
STREAM_SECONDS = 3600.0  # a stream's longest life; the client then reconnects with Last-Event-ID and goes on
RETRY_MS = 2000  # what an EventSource waits before it reconnects


class RunWatch:
    """Where a run's progress is read: its handle's state, and the lines its manifest gained since the last look
    (never the whole file again)."""

    def __init__(self, handle: RunHandle) -> None:
        self.handle = handle
        self._offset = 0
        self._indexes: set[int] = set()
        self._lock = threading.Lock()

    def images_done(self) -> int:
        with self._lock:
            try:
                with (self.handle.run_dir / "manifest.jsonl").open("rb") as manifest:
                    manifest.seek(self._offset)
                    data = manifest.read()
            except FileNotFoundError:
                return len(self._indexes)
            whole = data[: data.rfind(b"\n") + 1]  # a line still being written is read next time
            self._offset += len(whole)
            for line in whole.splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a torn line is no image's, as read_manifest has it
                if isinstance(record, dict) and type(record.get("index")) is int:
                    self._indexes.add(record["index"])
            return len(self._indexes)


_watching = threading.Lock()


def run_job(service: Service, run_id: str) -> Job | None:
    """The run's job in service.progress, opened on first asking and brought up to date; None if there is no
    such run. Reads files: called in a worker thread.

    A run's job is only read when asked about, so every open one is brought up to date here too: one whose
    watchers left ends with its run, and the jobs left open are never more than the runs still going."""
    with _watching:
        job = service.progress.live("run", run_id)
        if job is None:
            handle = _handle(service, run_id)
            if handle is None:
                return None
            job = service.progress.open(
                "run",
                run_id,
                images_planned=handle.planned,
                steps=_steps(handle),
                state="queued" if handle.state == "queued" else "running",
                watch=RunWatch(handle),
            )
    for other in service.progress.open_jobs("run"):
        observe(service, other)
    observe(service, job)
    return job


def observe(service: Service, job: Job) -> None:
    """The job's counts from its run's handle and manifest; its end, with the report in brief, once it ended."""
    watch = job.watch
    if not isinstance(watch, RunWatch):
        return  # ended: nothing more to read
    state = watch.handle.state  # read before the manifest: an ended run's manifest is whole
    done = watch.images_done()
    service.progress.observe(job, images_done=done, state="queued" if state == "queued" else "running")
    if state not in ("queued", "running"):
        error = "; ".join(watch.handle.error) if watch.handle.error else None
        service.progress.end(job, state, error=error, summary=report_summary(watch.handle))


def report_summary(handle: RunHandle) -> dict | None:
    """An ended run's report.json in brief; None if it left none."""
    path = handle.run_dir / "report.json"
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    timed = report.get("timed_phase") or {}
    return {
        "complete": report.get("complete"),
        "error": report.get("error"),
        "images": report.get("images"),
        "images_planned": report.get("images_planned"),
        "compiles_after_warmup": report.get("compiles_after_warmup"),
        "wall_seconds": timed.get("wall_seconds"),
        "images_per_second": timed.get("images_per_second"),
    }


def _steps(handle: RunHandle) -> int:
    if handle.run is not None:
        return handle.run.config.steps
    try:  # an ended run read back from disk: its run.json has the config
        return int(json.loads((handle.run_dir / RUN_RECORD).read_text())["config"]["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def _last_event_id(header: str | None) -> int | None:
    return int(header) if header is not None and header.strip().isdigit() and len(header.strip()) < 19 else None


def _frame(event: Event) -> str:
    return f"id: {event.id}\nevent: {event.name}\ndata: {json.dumps(event.data)}\n\n"


@router.get("/{run_id}/events")
async def run_events(run_id: str, request: Request):
    """The run's progress as server-sent events: `progress` (state, images_done, images_planned, step, steps;
    steps count per batch) whenever it changes, then `end` (status, error, the report in brief), after which
    the stream closes. Each event has an id: a client that reconnects with `Last-Event-ID` gets the events
    after it (the first ones of a long run may have been let go: each progress event holds every count). A
    comment every KEEPALIVE_SECONDS without news; a stream lasts at most STREAM_SECONDS."""
    service: Service = request.app.state.service
    job = await anyio.to_thread.run_sync(run_job, service, run_id)
    if job is None:
        return problem_response(404, [f"no run {run_id!r} on this server"])
    last = _last_event_id(request.headers.get("last-event-id"))
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(_stream(service, job, last), media_type="text/event-stream", headers=headers)


async def _stream(service: Service, job: Job, last: int | None):
    yield f"retry: {RETRY_MS}\n\n"
    began = heard = time.monotonic()
    while True:
        ended = job.done  # before the events: an ended job's events hold its end
        for event in service.progress.events_after(job, last):
            yield _frame(event)
            last, heard = event.id, time.monotonic()
            if event.name == "end":
                return
        if ended:
            return  # the client has seen its end already
        now = time.monotonic()
        if now - began >= STREAM_SECONDS:
            yield ": this stream has lasted its time; reconnect with Last-Event-ID to go on\n\n"
            return
        if now - heard >= KEEPALIVE_SECONDS:
            yield ": keep-alive\n\n"
            heard = now
        await anyio.sleep(EVENTS_POLL_SECONDS)
        await anyio.to_thread.run_sync(observe, service, job)
