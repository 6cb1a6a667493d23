"""Jobs on `tpugen serve` (the session's server): every response's request id, a run's progress as server-sent
events (resumable by Last-Event-ID, kept alive, bounded), `generate --server` following them, the web UI's task
progress, and clients taking turns in the queue."""

from __future__ import annotations

import logging
import threading
import time

import httpx
import pytest
from conftest import tiny_config, write_config
from httpx_sse import EventSource
from serve_support import AUTH, BASE, KEY, run_body, wait_run

from tpugen.config import load_config
from tpugen.modes.serve import client as run_client
from tpugen.modes.serve import runs_api
from tpugen.modes.serve.client import server_sent_events
from tpugen.modes.serve.run_handles import RunHandle

pytestmark = pytest.mark.xla

MADE_ID = 32  # a made request id: 32 hex digits


def read_events(client, run_id: str, last_id: int | None = None, seconds: float = 120) -> tuple[list, list[str]]:
    """The (id, name, data) events of a run's stream until the server closes it, as `generate --server` reads them
    (httpx-sse), and its comment lines (which httpx-sse drops, so the stream's lines are kept and read after)."""
    headers = {"Last-Event-ID": str(last_id)} if last_id is not None else {}
    events, comments = [], []
    deadline = time.monotonic() + seconds
    with client.stream("GET", f"/v1/runs/{run_id}/events", headers=headers) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        assert len(response.headers["x-request-id"]) == MADE_ID
        lines = []
        for line in response.iter_lines():
            assert time.monotonic() < deadline, f"the stream of {run_id} did not end within {seconds} s"
            if line.startswith(":"):
                comments.append(line)
            lines.append(line.encode() + b"\n")
    recorded = httpx.Response(200, headers={"Content-Type": "text/event-stream"}, content=b"".join(lines))
    events.extend(server_sent_events(EventSource(recorded).iter_sse()))
    return events, comments


def count(client, line_start: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.split()[-1])
    return 0.0


class Lines(logging.Handler):
    """The server's log lines, kept (tpugen.serve logs at info)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def server_lines():
    log = logging.getLogger("tpugen.serve")
    handler, level = Lines(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    yield handler.lines
    log.removeHandler(handler)
    log.setLevel(level)


def test_every_response_carries_a_request_id_echoed_when_sane(server, client):
    url, _ = server
    assert (
        client.get("/sdapi/v1/options", headers={"X-Request-Id": "req-42.a:b"}).headers["x-request-id"] == "req-42.a:b"
    )
    made = [client.get("/sdapi/v1/options").headers["x-request-id"] for _ in range(2)]
    assert len(set(made)) == 2 and all(len(rid) == MADE_ID for rid in made)
    for bad in ("has space", "x" * 129, "-leading"):
        answered = client.get("/sdapi/v1/options", headers={"X-Request-Id": bad}).headers["x-request-id"]
        assert answered != bad and len(answered) == MADE_ID
    # Errors and the open endpoints carry one too: a 404, a 422, a 401, /healthz.
    assert client.get("/nowhere", headers={"X-Request-Id": "r404"}).headers["x-request-id"] == "r404"
    bad_body = client.post("/sdapi/v1/txt2img", json={**BASE, "steps": 0}, headers={"X-Request-Id": "r422"})
    assert (bad_body.status_code, bad_body.headers["x-request-id"]) == (422, "r422")
    unkeyed = httpx.get(f"{url}/sdapi/v1/options", headers={"X-Request-Id": "r401"}, timeout=30)
    assert (unkeyed.status_code, unkeyed.headers["x-request-id"]) == (401, "r401")
    assert len(httpx.get(f"{url}/healthz", timeout=30).headers["x-request-id"]) == MADE_ID


def test_the_servers_log_lines_name_the_request(server, client, server_lines, monkeypatch):
    answer = client.post("/sdapi/v1/txt2img", json={**BASE, "prompt": "a logged cat"}, headers={"X-Request-Id": "rq-7"})
    assert answer.status_code == 200
    assert any(line.startswith("batch ") and "requests rq-7" in line for line in server_lines), server_lines

    def broken() -> int:
        raise RuntimeError("the interrupt broke")

    monkeypatch.setattr(server[1], "interrupt", broken)
    assert client.post("/sdapi/v1/interrupt", headers={"X-Request-Id": "rq-8"}).status_code == 500
    assert "request rq-8: POST /sdapi/v1/interrupt answered 500" in server_lines


def test_a_runs_events_stream_its_progress_then_its_end_and_resume_after_an_id(client):
    assert client.post("/v1/runs", content=run_body("evented")).status_code == 201
    events, _ = read_events(client, "evented")
    ids = [event_id for event_id, _, _ in events]
    assert ids == sorted(set(ids)) and len(ids) >= 2  # increasing
    *progress, (end_id, end, final) = events
    assert end == "end" and {name for _, name, _ in progress} == {"progress"}
    done = [data["images_done"] for _, _, data in progress]
    assert done == sorted(done) and done[-1] == 3
    assert all((data["images_planned"], data["steps"]) == (3, 3) for _, _, data in progress)
    assert progress[-1][2]["step"] == 3  # steps count per batch: a finished batch has all of them
    assert (final["status"], final["images_done"], final["images_planned"], final["error"]) == ("complete", 3, 3, None)
    summary = final["summary"]
    assert (summary["complete"], summary["images"], summary["compiles_after_warmup"]) == (True, 3, 0)
    assert wait_run(client, "evented")["status"] == "complete"
    # Reconnecting after an event gets the ones after it, the end last; after the end, nothing, at once.
    resumed, _ = read_events(client, "evented", last_id=ids[0])
    assert resumed == events[1:]
    assert read_events(client, "evented", last_id=end_id, seconds=10)[0] == []
    missing = client.get("/v1/runs/nope/events")
    assert missing.status_code == 404 and missing.json()["detail"] == ["no run 'nope' on this server"]


def test_a_stream_is_kept_alive_and_ends_at_its_bound(server, client, tmp_path, monkeypatch):
    service = server[1]
    handle = RunHandle("held", service.run, tmp_path / "held", 5, state="running")  # a run that makes nothing
    monkeypatch.setitem(service.runs, "held", handle)
    monkeypatch.setattr(runs_api, "KEEPALIVE_SECONDS", 0.1)
    monkeypatch.setattr(runs_api, "STREAM_SECONDS", 0.8)
    start = time.monotonic()
    events, comments = read_events(client, "held", seconds=30)
    assert time.monotonic() - start < 20
    assert [(name, data["state"], data["images_done"]) for _, name, data in events] == [("progress", "running", 0)]
    assert ": keep-alive" in comments and comments[-1].startswith(": this stream has lasted its time")
    handle.state, handle.error = "stopped", ["interrupted by SIGTERM"]
    events, _ = read_events(client, "held", last_id=events[-1][0], seconds=30)
    assert [(name, data["status"], data["error"]) for _, name, data in events] == [
        ("end", "stopped", "interrupted by SIGTERM")
    ]


class Progress:
    """What `generate --server` shows: the images done of planned, in order."""

    def __init__(self) -> None:
        self.shown: list[tuple[int, int]] = []

    def phase(self, text: str) -> None: ...

    def batches_started(self, total: int) -> None: ...

    def progress(self, done: int, total: int, across: str = "all ranks") -> None:
        self.shown.append((done, total))

    def finished(self) -> None: ...


def local_run(tmp_path, run_id: str):
    config = tiny_config(tmp_path, output={"dir": str(tmp_path / "local"), "run_id": run_id})
    return load_config(write_config(tmp_path / f"{run_id}.yaml", config))


def test_generate_on_a_server_shows_progress_from_the_runs_event_stream(server, client, tmp_path):
    streams = 'tpugen_requests_total{endpoint="/v1/runs/{run_id}/events",status="200"}'
    statuses = 'tpugen_requests_total{endpoint="/v1/runs/{run_id}",status="200"}'
    before = count(client, streams), count(client, statuses)
    shown = Progress()
    report = run_client.submit(local_run(tmp_path, "followed"), server[0], api_key=KEY, display=shown)
    assert report["complete"] is True and report["images"] == 3
    assert count(client, streams) - before[0] == 1  # one stream (before: none, it polled)
    assert count(client, statuses) - before[1] == 1  # and one look at the status, when it ended
    assert shown.shown and shown.shown[-1] == (3, 3) and shown.shown == sorted(shown.shown)
    assert len(list((tmp_path / "local" / "followed").glob("[0-9]*.png"))) == 3


def test_generate_on_a_server_polls_when_the_stream_keeps_dropping(server, tmp_path, monkeypatch):
    tries = []

    def dropping(self, path, last_id):
        tries.append(last_id)
        raise ConnectionResetError("dropped")
        yield  # a generator, as the real one

    monkeypatch.setattr(run_client.Server, "events", dropping)
    monkeypatch.setattr(run_client, "POLL_SECONDS", 0.05)
    shown = Progress()
    report = run_client.submit(local_run(tmp_path, "polled"), server[0], api_key=KEY, display=shown)
    assert report["complete"] is True and len(tries) == run_client.STREAM_TRIES
    assert shown.shown[-1] == (3, 3)


def test_a_web_ui_task_has_its_progress_by_its_id(client):
    def task(id_task: str) -> dict:
        answer = client.post("/internal/progress", json={"id_task": id_task, "id_live_preview": -1})
        assert answer.status_code == 200
        return answer.json()

    assert task("task(never)") == {
        "active": False,
        "queued": False,
        "completed": False,
        "progress": None,
        "eta": None,
        "live_preview": None,
        "id_live_preview": -1,
        "textinfo": "Waiting...",
    }
    results = {}
    body = {**BASE, "prompt": "a tracked cat", "force_task_id": "task(tracked1)"}
    asking = threading.Thread(target=lambda: results.update(answer=client.post("/sdapi/v1/txt2img", json=body)))
    asking.start()
    seen, current = [], set()
    deadline = time.monotonic() + 120
    while not seen or not seen[-1]["completed"]:
        assert time.monotonic() < deadline, seen[-3:]
        seen.append(task("task(tracked1)"))
        current.add(client.get("/sdapi/v1/progress").json()["current_task"])
        time.sleep(0.01)
    asking.join(120)
    assert results["answer"].status_code == 200 and len(results["answer"].json()["images"]) == 1
    states = [(s["queued"], s["active"], s["completed"]) for s in seen if s["textinfo"] != "Waiting..."]
    assert states[-1] == (False, False, True) and any(s != states[-1] for s in states)  # seen before it was done
    assert all(0.0 <= s["progress"] <= 1.0 for s in seen if s["progress"] is not None) and seen[-1]["progress"] == 1.0
    assert seen[-1]["id_live_preview"] == -1 and seen[-1]["live_preview"] is None
    assert "task(tracked1)" in current  # /sdapi/v1/progress answers for the task while it is open
    idle = client.get("/sdapi/v1/progress").json()
    assert (idle["progress"], idle["current_task"], idle["state"]["job_count"]) == (0.0, None, 0)
    refused = client.post("/sdapi/v1/txt2img", json={**BASE, "force_task_id": "task <1>"})
    assert refused.status_code == 422 and refused.json()["detail"][0].startswith("force_task_id: ")


def test_one_clients_single_image_is_not_held_behind_anothers_many(server):
    # Two clients are two machines (here two loopback addresses); an X-Client-Id of one's choosing counts for
    # nothing (it would win a client as many turns as it names).
    url, service = server
    done = {}

    def ask(name: str, address: str, images: int) -> None:
        body = {**BASE, "prompt": f"{name}'s painting", "batch_size": images, "steps": 10}
        transport = httpx.HTTPTransport(local_address=address)
        with httpx.Client(base_url=url, headers=AUTH, timeout=120, transport=transport) as http:
            answer = http.post("/sdapi/v1/txt2img", json=body, headers={"X-Client-Id": name})
        when = time.monotonic()
        others = [len(r.pixels) for r in service.queue.open_requests() if r.images == 8]
        done[name] = (answer.status_code, len(answer.json()["images"]), when, others)

    big = threading.Thread(target=ask, args=("big", "127.0.0.2", 8))  # 4 batches of the server's 2
    big.start()
    deadline = time.monotonic() + 60
    while not service.queue.open_requests():
        assert time.monotonic() < deadline, "the big request never reached the queue"
        time.sleep(0.005)
    small = threading.Thread(target=ask, args=("small", "127.0.0.3", 1))
    small.start()
    for thread in (big, small):
        thread.join(180)
    assert done["big"][:2] == (200, 8) and done["small"][:2] == (200, 1)
    # Served in turn, the small request's image goes in the first or second batch (before: after all of big's):
    # when it is answered, big has at most its first two batches' images.
    assert done["small"][2] < done["big"][2] and done["small"][3] and done["small"][3][0] <= 4


def test_a_requests_progress_counts_each_step_as_it_reaches_the_device(server, client):
    # Before, a request's step went from 0 to `steps` when its batch was done: a one-batch request's progress
    # was 0 until it was 1.
    _, service = server
    body = {**BASE, "prompt": "a stepping cat", "force_task_id": "task(steps1)"}
    assert client.post("/sdapi/v1/txt2img", json=body).status_code == 200
    job = service.progress.live("request", "task(steps1)")
    running = [(e.data["step"], e.data["images_done"]) for e in job.events if e.data.get("state") == "running"]
    # Its start (step 0) when the queue took it, then steps 1..3 of its batch, then its image made.
    assert [step for step, _ in running if step] == [1, 2, 3, 3] and running[-1] == (3, 1)
    assert job.events[-1].name == "end" and job.fraction == 1.0
