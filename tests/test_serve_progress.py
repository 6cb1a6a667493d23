"""Progress per job, without a device: counts and numbered events, replay after an event id, bounded memory, and
the event stream as `tpugen generate --server` reads it (with its calls' one-line errors), against a loopback
server that answers as a tpugen server would."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from tpugen.errors import InputError, RunError
from tpugen.modes.serve import client as run_client
from tpugen.modes.serve.client import NoStream, Server
from tpugen.modes.serve.progress import Jobs

EVENTS = "text/event-stream; charset=utf-8"
JSON = "application/json"


def test_a_jobs_events_count_its_images_with_increasing_ids_and_end_once():
    jobs = Jobs()
    job = jobs.open("run", "r1", images_planned=3, steps=4)
    jobs.observe(job, images_done=0, state="queued")  # nothing changed: no event
    jobs.start(job)
    jobs.advance(job, 2)
    jobs.observe(job, images_done=2, state="running")  # the same counts again: no event
    jobs.advance(job, 1)
    jobs.end(job, "complete", summary={"images": 3})
    jobs.end(job, "failed")  # ended already: nothing
    events = jobs.events_after(job, None)
    assert [event.id for event in events] == [1, 2, 3, 4, 5]
    assert [(e.name, e.data["state"], e.data["images_done"], e.data["step"]) for e in events] == [
        ("progress", "queued", 0, 0),
        ("progress", "running", 0, 0),
        ("progress", "running", 2, 4),  # per batch: a batch's images come with every step done
        ("progress", "running", 3, 4),
        ("end", "complete", 3, 4),
    ]
    assert events[-1].data["status"] == "complete" and events[-1].data["summary"] == {"images": 3}
    assert job.fraction == 1.0 and job.eta() == 0.0


def test_events_after_an_id_are_replayed_and_an_id_from_a_forgotten_job_gets_the_latest():
    jobs = Jobs()
    job = jobs.open("run", "r1", images_planned=4, steps=3)
    for _ in range(4):
        jobs.advance(job, 1)
    jobs.end(job, "complete")
    assert [event.id for event in jobs.events_after(job, 3)] == [4, 5, 6]
    assert jobs.events_after(job, 6) == []  # seen to its end
    latest = jobs.events_after(job, 99)  # a client of an earlier job of this name (forgotten since)
    assert [(event.name, event.data["images_done"]) for event in latest] == [("progress", 4), ("end", 4)]


def test_a_jobs_events_and_the_finished_jobs_kept_are_bounded():
    jobs = Jobs(keep_finished=3, keep_seconds=3600, events_per_job=4)
    job = jobs.open("request", "big", images_planned=100, steps=3)
    for _ in range(100):
        jobs.advance(job, 1)
    events = jobs.events_after(job, None)
    assert len(events) == 4 and [event.id for event in events] == [98, 99, 100, 101]  # the last ones only
    assert [event.id for event in jobs.events_after(job, 10)] == [98, 99, 100, 101]  # what is kept after 10
    for number in range(10):
        jobs.end(jobs.open("request", f"t{number}", images_planned=1, steps=3), "complete")
    assert jobs.sizes() == (1, 3)  # the open one, and the last 3 finished
    assert jobs.find("request", "t9") is not None and jobs.find("request", "t0") is None


def test_finished_jobs_are_forgotten_after_a_time():
    jobs = Jobs(keep_finished=100, keep_seconds=0.05)
    jobs.end(jobs.open("request", "old", images_planned=1, steps=3), "complete")
    assert jobs.find("request", "old").state == "complete"
    deadline = time.monotonic() + 5
    while jobs.find("request", "old") is not None:
        assert time.monotonic() < deadline, "a finished job was kept past keep_seconds"
        time.sleep(0.06)
    assert jobs.sizes() == (0, 0)


def test_a_name_used_again_names_the_new_job_and_the_current_one_is_the_one_running():
    jobs = Jobs()
    first = jobs.open("request", "task(a)", images_planned=2, steps=3)
    queued = jobs.open("request", "task(b)", images_planned=1, steps=3)
    assert jobs.current("request").name == "task(b)"  # none running: the one queued last
    jobs.start(first)
    assert jobs.current("request").name == "task(a)"  # the one being worked on
    again = jobs.open("request", "task(a)", images_planned=5, steps=3)
    assert jobs.find("request", "task(a)").images_planned == 5
    for job in (first, queued, again):
        jobs.end(job, "complete")
    assert jobs.current("request") is None and jobs.find("run", "task(a)") is None  # kinds apart


def test_a_jobs_fraction_counts_the_steps_of_its_images_on_a_device():
    jobs = Jobs()
    job = jobs.open("request", "r", images_planned=4, steps=10)
    jobs.stepped(job, 5, images=2)  # half the steps of a batch holding 2 of its 4 images
    assert (job.step, job.state, job.fraction) == (5, "running", 0.25)
    jobs.advance(job, 2)
    assert (job.step, job.images_done, job.fraction) == (10, 2, 0.5)
    jobs.stepped(job, 10, images=2)
    assert job.fraction == 1.0


# ---------------------------------------------------------------- the client, against a loopback server


class Answer(BaseHTTPRequestHandler):
    """Each request answered with its server's next reply: (status, content type, body pieces), a float among the
    pieces a pause (a piece at a time, so a stream arrives cut where the test cuts it); what was asked is kept."""

    def answer(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.asked.append((self.command, self.path, dict(self.headers), body))
        status, content_type, pieces = self.server.replies.pop(0)
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Connection", "close")  # the body ends where the connection does
        self.end_headers()
        for piece in pieces:
            if isinstance(piece, float):
                time.sleep(piece)
            else:
                self.wfile.write(piece)
                self.wfile.flush()

    do_GET = do_POST = do_DELETE = answer

    def log_message(self, *args) -> None: ...


class Scripted(ThreadingHTTPServer):
    daemon_threads = True  # an answer still pausing after its client gave up does not hold the test

    def __init__(self, replies: list) -> None:
        super().__init__(("127.0.0.1", 0), Answer)
        self.replies, self.asked = list(replies), []

    def handle_error(self, request, client_address) -> None: ...  # a client gone mid-answer is what some tests do


@contextlib.contextmanager
def scripted(*replies):
    """A loopback server answering with `replies` in turn: (its URL, the server, to read what it was asked)."""
    server = Scripted(list(replies))
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), name="scripted-server", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def frame(event_id: int, name: str, data: dict) -> bytes:
    return f"id: {event_id}\nevent: {name}\ndata: {json.dumps(data)}\n\n".encode()


class Shown:
    def __init__(self) -> None:
        self.shown: list[tuple[int, int]] = []

    def progress(self, done: int, total: int, across: str = "all ranks") -> None:
        self.shown.append((done, total))


def test_the_clients_reading_of_an_event_stream():
    pieces = [
        b"retry: 2000\n\nid: 1\nevent: prog",  # cut inside a line, as TCP may
        0.02,  # (a pause between two pieces keeps them apart on the wire)
        b'ress\ndata: {"images_done": 0}\n\n: keep-alive\n\n',  # a comment, then a block without data
        0.02,
        b'id: 2\r\nevent: end\r\ndata: {"status":\r',  # CRLF lines, cut between the CR and the LF
        0.02,
        b'\ndata:  "complete"}\n\n',  # one event's data over two lines
    ]
    replies = [(200, EVENTS, pieces), (404, JSON, [b'{"detail": ["no run"]}']), (200, JSON, [b"{}"])]
    with scripted(*replies) as (url, server):
        with Server(url + "/", "k-1") as client:
            assert list(client.events("/v1/runs/r/events", 7)) == [
                (1, "progress", {"images_done": 0}),
                (2, "end", {"status": "complete"}),
            ]
            with pytest.raises(NoStream, match="HTTP 404"):
                list(client.events("/v1/runs/r/events", None))
            with pytest.raises(NoStream, match="application/json"):  # a server older than the stream
                list(client.events("/v1/runs/r/events", None))
    (method, path, headers, _), *rest = server.asked
    assert (method, path) == ("GET", "/v1/runs/r/events")
    assert headers["Authorization"] == "Bearer k-1" and headers["Accept"] == "text/event-stream"
    assert headers["Last-Event-ID"] == "7" and all("Last-Event-ID" not in asked[2] for asked in rest)


def test_a_stream_silent_past_its_read_timeout_is_given_up(monkeypatch):
    monkeypatch.setattr(run_client, "STREAM_READ_SECONDS", 0.3)
    with scripted((200, EVENTS, [b"retry: 2000\n\n", frame(1, "progress", {}), 5.0])) as (url, _):
        with Server(url, None) as client:
            start = time.monotonic()
            events = client.events("/v1/runs/r/events", None)
            assert next(events) == (1, "progress", {})
            with pytest.raises(httpx.ReadTimeout):
                next(events)
            assert time.monotonic() - start < 3


def test_following_a_run_resumes_after_the_last_event_seen_and_polls_where_there_is_no_stream(monkeypatch):
    monkeypatch.setattr(run_client, "POLL_SECONDS", 0.01)
    monkeypatch.setattr(run_client, "STREAM_READ_SECONDS", 0.3)
    done = {"status": "complete", "images": 3, "images_planned": 3}
    closed = [frame(1, "progress", {"images_done": 1, "images_planned": 3}), b"id: 2\nevent: progr"]
    silent = [frame(2, "progress", {"images_done": 2, "images_planned": 3}), 3.0]
    resumed = [frame(3, "progress", {"images_done": 3, "images_planned": 3}), frame(4, "end", {"status": "complete"})]
    replies = [
        (200, EVENTS, closed),
        (200, EVENTS, silent),
        (200, EVENTS, resumed),
        (200, JSON, [json.dumps(done).encode()]),
    ]
    shown = Shown()
    with scripted(*replies) as (url, server), Server(url, "k") as client:
        assert run_client.follow(client, "a run", shown) == done
    assert shown.shown == [(1, 3), (2, 3), (3, 3)]  # the half event is none
    paths = [(path, headers.get("Last-Event-ID")) for _, path, headers, _ in server.asked]
    events = "/v1/runs/a%20run/events"
    assert paths == [(events, None), (events, "1"), (events, "2"), ("/v1/runs/a%20run", None)]

    running = {"status": "running", "images": 1, "images_planned": 3}
    replies = [(404, JSON, [b"{}"]), *((200, JSON, [json.dumps(status).encode()]) for status in (running, done))]
    shown = Shown()
    with scripted(*replies) as (url, server), Server(url, "k") as client:
        assert run_client.follow(client, "r", shown) == done
    assert shown.shown == [(1, 3), (3, 3)] and len(server.asked) == 3


def test_the_clients_calls_say_what_went_wrong_in_one_line(monkeypatch):
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with Server(f"http://127.0.0.1:{port}", None) as client, pytest.raises(RunError) as refused:
        client.json("GET", "/v1/runs/r")
    (line,) = refused.value.lines
    assert re.fullmatch(
        rf"--server http://127\.0\.0\.1:{port}: cannot reach it \(\[Errno \d+\] Connection refused\)", line
    )

    problems = json.dumps({"detail": ["prompts[0].steps: must be at least 1", "batch_size: too big"]}).encode()
    replies = [(422, JSON, [problems]), (500, "text/plain", [b"Internal Server Error"]), (201, JSON, [b'{"id": "r"}'])]
    with scripted(*replies) as (url, server), Server(url, "k") as client:
        with pytest.raises(InputError) as refused:
            client.json("POST", "/v1/runs", {"prompts": ["a cat"], "guidance_scale": 7.5})
        assert refused.value.lines == ["server: prompts[0].steps: must be at least 1", "server: batch_size: too big"]
        with pytest.raises(RunError) as failed:
            client.json("GET", "/v1/runs/r")
        assert failed.value.lines == ["server: HTTP 500"]
        assert client.json("DELETE", "/v1/runs/r") == {"id": "r"}
    (method, path, headers, body), *_ = server.asked
    assert (method, path, headers["Content-Type"], headers["Authorization"]) == ("POST", "/v1/runs", JSON, "Bearer k")
    assert json.loads(body) == {"prompts": ["a cat"], "guidance_scale": 7.5}

    monkeypatch.setattr(run_client, "CALL_SECONDS", 0.3)
    with scripted((200, JSON, [5.0, b"{}"])) as (url, _), Server(url, None) as client:
        start = time.monotonic()
        with pytest.raises(RunError) as silent:
            client.json("GET", "/v1/runs/r")
        assert silent.value.lines == [f"--server {url}: cannot reach it (timed out)"]
        assert time.monotonic() - start < 3
