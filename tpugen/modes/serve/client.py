"""`tpugen generate CONFIG --server URL`: the run made by a warm server, its run directory copied here.

This side imports no torch and no model code: only the config, HTTP (httpx, its events read by httpx-sse) and
files: both are in the plain install, so this needs no `serve` extra."""

from __future__ import annotations

import base64
import hashlib
import json
import ssl
import time
import urllib.parse
from collections.abc import Iterable, Iterator
from pathlib import Path

import httpx
from httpx_sse import ServerSentEvent, connect_sse

from tpugen.config import ResolvedRun, run_sizes
from tpugen.config.loras import is_hub_lora
from tpugen.errors import InputError, Interrupted, RunError
from tpugen.files import atomic_write_bytes
from tpugen.outputs.run_dir import run_id_for

POLL_SECONDS = 0.5  # between two looks at a run's status, when its event stream cannot be had
STREAM_TRIES = 5  # event streams in a row that drop before an event arrives, before the client polls instead
STREAM_READ_SECONDS = 60  # the server sends a comment every 15 s: this long without a byte, the stream is gone
CALL_SECONDS = 60  # a request's longest wait for the next byte (sending or receiving) before the server is given up
CONNECT_SECONDS = 10  # a server that has not taken the connection by then is not there


class NoStream(Exception):
    """The server has no event stream for the run (a server older than GET /v1/runs/ID/events)."""


def run_payload(run: ResolvedRun, run_id: str) -> dict:
    """The run config as the server takes it: the prompts themselves (a prompts file is read here), their input
    images as the files' own bytes (base64 data: URIs; the server reads no paths), the run id chosen here, no
    local paths."""
    config = run.config
    data = json.loads(config.model_dump_json(exclude={"output", "cache", "serve", "prompts_file"}))
    # Of the model, execution and compile sections, only what the user set: the server compares each key sent
    # with its own, and a default here (model.scheduler unset, say) is not a wish for another setting.
    for section in ("model", "execution", "compile"):
        data[section] = json.loads(getattr(config, section).model_dump_json(exclude_unset=True))
    loras = [lora.model_dump(mode="json") for lora in config.model.loras]
    if loras:
        data["model"]["loras"] = loras
    entries = []
    for number, spec in enumerate(run.prompts):
        entry = {"prompt": spec.prompt}
        if spec.negative_prompt != config.negative_prompt:
            entry["negative_prompt"] = spec.negative_prompt
        if spec.seed is not None:
            entry["seed"] = spec.seed
        if spec.steps != config.steps:
            entry["steps"] = spec.steps
        if spec.guidance_scale != config.guidance_scale:
            entry["guidance_scale"] = spec.guidance_scale
        if spec.sizes != run_sizes(config):
            entry["height"], entry["width"] = spec.sizes[0]
        if spec.source is not None:
            for key, path, sha256 in spec.source.files():
                entry[key] = data_uri(path, sha256, f"prompts[{number}].{key}")
            # Always sent: the server's default is not the client's to guess.
            entry["strength"], entry["resize_mode"] = spec.source.strength, spec.source.resize_mode
        if spec.references is not None:
            where = f"prompts[{number}].reference_images"
            entry["reference_images"] = [
                data_uri(image.path, image.sha256, f"{where}[{n}]") for n, image in enumerate(spec.references.images)
            ]
            entry["resize_mode"] = spec.references.resize_mode
        if spec.controls is not None:
            where = f"prompts[{number}].control_image"
            units = spec.controls.units
            images = [data_uri(u.image.path, u.image.sha256, f"{where}[{n}]") for n, u in enumerate(units)]
            # Always sent, one per ControlNet: the server's defaults are not the client's to guess.
            entry["control_image"] = images
            entry["control_module"] = [u.module for u in units]
            entry["control_scale"] = [u.scale for u in units]
            entry["control_start"] = [u.start for u in units]
            entry["control_end"] = [u.end for u in units]
            for key in ("threshold_a", "threshold_b"):
                if any(getattr(u, key) is not None for u in units):
                    entry[f"control_{key}"] = [getattr(u, key) for u in units]
        entries.append(entry if len(entry) > 1 else spec.prompt)
    data["prompts"] = entries
    # A LoRA file here is named on the server by its file stem (in its serve.lora_dir); its sha256 pins it.
    files = {lora.sha256: Path(lora.path) for lora in run.loras}
    for lora in data["model"].get("loras") or []:
        if not is_hub_lora(lora["id"]) and lora.get("sha256") in files:
            lora["id"] = files[lora["sha256"]].stem
            lora.pop("weight_name", None)
    data["output"] = {"run_id": run_id}
    return data


def data_uri(path: str, sha256: str, where: str) -> str:
    """The image file's own bytes as a data: URI (the server records their sha256, which is the file's); an
    InputError naming `where` if the file is gone or changed since the config was read."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise InputError(f"{where}: cannot read {path!r}: {exc.strerror}") from None
    if hashlib.sha256(data).hexdigest() != sha256:
        raise InputError(f"{where}: {path!r} changed since the config was read; send the run again")
    return "data:application/octet-stream;base64," + base64.b64encode(data).decode("ascii")


class Server:
    """A tpugen server's runs API, over HTTP: one httpx client, its connections kept between calls; close it (or
    use it in a `with`) when done."""

    def __init__(self, url: str, api_key: str | None) -> None:
        self.url = url.rstrip("/")
        self.api_key = api_key
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # The system's CA store, as the standard library's HTTP had it (httpx's own default is certifi's).
        self.http = httpx.Client(
            headers=headers,
            timeout=httpx.Timeout(CALL_SECONDS, connect=CONNECT_SECONDS),
            verify=ssl.create_default_context(),
            follow_redirects=True,
        )

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    def events(self, path: str, last_id: int | None) -> Iterator[tuple[int | None, str, dict]]:
        """(id, name, data) of each server-sent event of `path`, from after `last_id` (None: from the first)
        until the server ends the stream. NoStream when the server has none there; httpx.RequestError when it
        drops or goes STREAM_READ_SECONDS without a byte."""
        headers = {"Last-Event-ID": str(last_id)} if last_id is not None else {}
        timeout = httpx.Timeout(STREAM_READ_SECONDS, connect=CONNECT_SECONDS)
        with connect_sse(self.http, "GET", self.url + path, headers=headers, timeout=timeout) as source:
            response = source.response
            if response.status_code >= 400:
                raise NoStream(f"HTTP {response.status_code}")
            content_type = response.headers.get("Content-Type", "")
            if "text/event-stream" not in content_type:
                raise NoStream(content_type or "no content type")
            yield from server_sent_events(source.iter_sse())

    def call(self, method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
        """The status and body of one request; a RunError naming the server if it cannot be reached (refused,
        unknown host, no answer within CALL_SECONDS)."""
        content, headers = None, {}
        if body is not None:
            # Encoded here, as before: httpx's json= refuses NaN, which json.dumps writes.
            content, headers = json.dumps(body).encode("utf-8"), {"Content-Type": "application/json"}
        try:
            response = self.http.request(method, self.url + path, content=content, headers=headers)
        except httpx.RequestError as exc:
            raise RunError(f"--server {self.url}: cannot reach it ({str(exc) or type(exc).__name__})") from None
        return response.status_code, response.content

    def json(self, method: str, path: str, body: dict | None = None) -> dict:
        status, data = self.call(method, path, body)
        try:
            answer = json.loads(data or b"{}")
        except ValueError:
            answer = {}
        if status >= 400:
            lines = answer.get("detail") if isinstance(answer, dict) else None
            lines = lines if isinstance(lines, list) else [f"HTTP {status}"]
            # 413: the body is over the server's limit (a run's input images travel in it).
            raise (InputError if status in (409, 413, 422) else RunError)(*(f"server: {line}" for line in lines))
        return answer


def submit(run: ResolvedRun, url: str, *, api_key: str | None = None, display=None) -> dict:
    """Send the run, show its progress, and copy its run directory into the local output.dir when it ends."""
    run_id = run_id_for(run)
    local = Path(run.config.output.dir) / run_id
    if local.exists() and any(local.iterdir()):  # refused before anything is sent; nothing is made until files come
        raise InputError(f"output.run_id: {local} already exists and is not empty; choose another run_id")
    with Server(url, api_key) as server:
        started = server.json("POST", "/v1/runs", run_payload(run, run_id))
        if display is not None:
            display.phase(f"running on {server.url} as {started['id']}")
            display.batches_started(started["images_planned"])
        try:
            status = follow(server, run_id, display)
        except KeyboardInterrupt:
            server.json("DELETE", f"/v1/runs/{urllib.parse.quote(run_id)}")
            raise Interrupted(
                2, f"interrupted: the server stops {run_id} after its batch in flight (resumable there)"
            ) from None
        finally:
            if display is not None:
                display.finished()
        download(server, run_id, local)
    if status["status"] != "complete":
        lines = status.get("error") or [f"the run ended {status['status']} on the server"]
        raise RunError(*lines, f"what it made is in {local}")
    return {**status["report"], "run_dir": str(local)}


def follow(server: Server, run_id: str, display=None) -> dict:
    """The run's progress shown from its event stream (reconnecting after a drop, from the last event seen)
    until it ends; its final status. Polls instead where the server has no stream, or after STREAM_TRIES
    streams in a row dropped without an event."""
    path = f"/v1/runs/{urllib.parse.quote(run_id)}"
    last, dropped = None, 0
    while dropped < STREAM_TRIES:
        try:
            for event_id, name, data in server.events(f"{path}/events", last):
                dropped = 0
                last = event_id if event_id is not None else last
                if name == "progress" and display is not None:
                    display.progress(data["images_done"], data["images_planned"])
                elif name == "end":
                    return server.json("GET", path)
        except NoStream:
            break
        except (httpx.RequestError, OSError, ValueError, KeyError, TypeError):
            pass  # dropped, silent too long, or a garbled event: again from the last event seen
        dropped += 1
        time.sleep(POLL_SECONDS)
    while True:  # shown at each look, the last one included: a run that ended while the streams dropped is shown
        status = server.json("GET", path)
        if display is not None:
            display.progress(status["images"], status["images_planned"])
        if status["status"] not in ("queued", "running"):
            return status
        time.sleep(POLL_SECONDS)


def server_sent_events(events: Iterable[ServerSentEvent]) -> Iterator[tuple[int | None, str, dict]]:
    """(id, name, JSON data) of each event httpx-sse read from a text/event-stream. Blocks without data are no
    event of a run's: the stream's opening `retry:` line, and the blank line after a keep-alive comment (which
    httpx-sse hands on with the last id). An id that is not a number is None."""
    for event in events:
        if event.data:
            yield (int(event.id) if event.id.isdigit() else None), event.event, json.loads(event.data)


def download(server: Server, run_id: str, local: Path) -> None:
    """Every file of the run, each written whole or not at all."""
    local.mkdir(parents=True, exist_ok=True)
    listing = server.json("GET", f"/v1/runs/{urllib.parse.quote(run_id)}/files")
    for name in listing["files"]:
        status, data = server.call("GET", f"/v1/runs/{urllib.parse.quote(run_id)}/files/{urllib.parse.quote(name)}")
        if status != 200:
            raise RunError(f"server: cannot fetch {name} of run {run_id} (HTTP {status})")
        atomic_write_bytes(local / Path(name).name, data)
