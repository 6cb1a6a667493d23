"""The session's server (tests/conftest.py's `server`) against hostile requests, over HTTP: a request's own bad
input is a 4xx naming it, checked before any work, never a 5xx, never a device failure and never a server path;
browsers and rebound DNS names are kept off; bodies are counted as they arrive; big bodies are parsed off the
event loop; generated run ids are unique."""

from __future__ import annotations

import base64
import io
import json
import re
import select
import socket
import threading
import time

import httpx
import numpy as np
import pytest
from conftest import SAME_SETUP
from PIL import Image
from serve_support import AUTH, BASE, metric, run_body, wait_run

pytestmark = pytest.mark.xla


def _png(seed: int = 3) -> str:
    pixels = (np.random.default_rng(seed).random((64, 64, 3)) * 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


def _pixels(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"), dtype=np.int16)


def _no_server_path(server, response: httpx.Response) -> None:
    url, service = server
    assert response.status_code < 500, response.text[:300]
    for path in (str(service.output_root), "/tmp/", "/work/", ".inputs"):
        assert path not in response.text, (path, response.text[:300])


def test_an_img2img_whose_steps_round_below_one_runs_one_step_and_never_breaks_the_server(server, client):
    """The probe's three requests that stopped the server: steps x denoising strength below one step. Each now
    runs one step, as the web UI does (the image of the strength that runs exactly one), past
    serve.max_failed_batches of them, and the server stays ready with no device failure counted."""
    url, service = server
    failures = metric(url, "tpugen_device_failures_total")
    init = _png()
    asked = [(2, 0.4), (10, 0.05), (2, 0.4), (10, 0.05)]  # one more than serve.max_failed_batches (3)
    assert len(asked) > service.serve.max_failed_batches
    made = []
    for steps, strength in asked:
        body = {**BASE, "prompt": "a cat", "seed": 11, "steps": steps, "denoising_strength": strength}
        response = client.post("/sdapi/v1/img2img", json={**body, "init_images": [init]})
        assert response.status_code == 200, response.text[:300]
        made.append(_pixels(response.json()["images"][0]))
    one_step = {**BASE, "prompt": "a cat", "seed": 11, "steps": 2, "denoising_strength": 0.5, "init_images": [init]}
    exact = client.post("/sdapi/v1/img2img", json=one_step)
    assert exact.status_code == 200, exact.text[:300]
    assert int(np.abs(made[0] - _pixels(exact.json()["images"][0])).max()) <= SAME_SETUP
    assert client.get("/readyz").status_code == 200 and service.state == "ready"
    assert metric(url, "tpugen_device_failures_total") == failures


@pytest.mark.parametrize(
    "route,fields,line",
    [
        (
            "/sdapi/v1/img2img",
            {"init_images": ["data:image/png;base64"]},
            "init_images[0]: a data: URL with no data after its header (data:image/png;base64,DATA)",
        ),
        (
            "/sdapi/v1/img2img",
            {"init_images": ["INIT"], "mask": "data:x"},
            "mask: a data: URL with no data after its header (data:image/png;base64,DATA)",
        ),
        (
            "/sdapi/v1/img2img",
            {"init_images": ["INIT"], "mask": "INIT", "inpaint_full_res_padding": -1},
            "inpaint_full_res_padding: must be from 0 to 256 pixels, got -1",
        ),
        ("/sdapi/v1/txt2img", {"steps": 1000}, "steps: 1000; sampler DDIM runs at most 999 on this model"),
        (
            "/sdapi/v1/txt2img",
            {"enable_hr": True, "hr_scale": 2, "hr_second_pass_steps": 999, "denoising_strength": 0.5},
            "hires fix: 999 steps at denoising strength 0.5 take a schedule of 1998 steps; sampler DDIM runs at "
            "most 999 on this model",
        ),
    ],
    ids=["data URL without data", "mask data URL", "negative padding", "steps 1000", "hires schedule past 999"],
)
def test_bad_input_that_was_a_500_is_a_422_naming_it_before_any_work(server, client, route, fields, line):
    url, _ = server
    batches = metric(url, "tpugen_batch_seconds_count")
    init = _png()
    body = {
        **BASE,
        "prompt": "a cat",
        **{k: [init] if v == ["INIT"] else init if v == "INIT" else v for k, v in fields.items()},
    }
    response = client.post(route, json=body)
    _no_server_path(server, response)
    assert response.status_code == 422 and response.json()["detail"] == [line], response.text[:300]
    assert metric(url, "tpugen_batch_seconds_count") == batches  # refused at the door: no batch ran


def test_openai_edits_with_a_text_field_sent_as_a_file_or_two_images_is_a_422(server, client):
    image = base64.b64decode(_png())
    files = [("image", ("a.png", image, "image/png")), ("size", ("size.txt", b"64x64", "text/plain"))]
    response = client.post("/v1/images/edits", data={"prompt": "a cat"}, files=files)
    _no_server_path(server, response)
    assert response.status_code == 422 and response.json()["detail"] == ["size: must be a form field, not a file"]
    files = [("image[]", ("a.png", image, "image/png")), ("image[]", ("b.png", image, "image/png"))]
    response = client.post("/v1/images/edits", data={"prompt": "a cat", "size": "64x64"}, files=files)
    assert response.status_code == 422 and response.json()["detail"] == ["image: sent twice; an edit takes one"]


def test_names_too_long_for_a_folder_are_404s_that_show_no_path(server, client):
    for path in (f"/v1/runs/{'a' * 300}", f"/v1/runs/{'a' * 300}/files", f"/v1/runs/{'a' * 300}/events"):
        response = client.get(path)
        _no_server_path(server, response)
        assert response.status_code == 404, (path, response.text[:200])
    created = client.post("/v1/runs", content=run_body("hardened-names", prompts=["a cat"], steps=2))
    assert created.status_code == 201, created.text
    response = client.get(f"/v1/runs/hardened-names/files/{'b' * 300}")
    _no_server_path(server, response)
    assert response.status_code == 404 and response.json()["detail"][0].startswith("no file 'bbbb")
    wait_run(client, "hardened-names")


def test_a_run_is_refused_at_the_door_for_what_its_batches_cannot_run_and_a_tiny_strength_runs(server, client):
    refused = client.post("/v1/runs", content=run_body("hardened-steps", prompts=["a cat"], steps=1000))
    _no_server_path(server, refused)
    assert refused.status_code == 422
    assert refused.json()["detail"] == ["batch 0: steps: 1000; sampler DDIM runs at most 999 on this model"]
    assert client.get("/v1/runs/hardened-steps").status_code == 404  # nothing was made of it
    init = f"data:image/png;base64,{_png()}"
    prompts = [{"prompt": "a cat", "init_image": init, "strength": 0.01}]
    created = client.post("/v1/runs", content=run_body("hardened-strength", prompts=prompts, steps=3))
    assert created.status_code == 201, created.text
    status = wait_run(client, "hardened-strength")
    assert status["status"] == "complete", status


def test_the_same_run_sent_twice_at_once_gets_two_run_ids(server, client):
    body = run_body("unused", prompts=["a cat"], steps=2).replace("run_id: unused", "run_id: null")
    answers: list[httpx.Response] = []

    def send() -> None:
        answers.append(httpx.post(f"{server[0]}/v1/runs", content=body, headers=AUTH, timeout=60))

    threads = [threading.Thread(target=send) for _ in range(server[1].serve.max_runs)]  # 2 at once: room for both
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    assert [a.status_code for a in answers] == [201, 201], [a.text[:200] for a in answers]
    ids = [a.json()["id"] for a in answers]
    # Run ids are the second and the config hash: in one second the later one gets "-2"; a second apart (a busy
    # machine) each its own second.
    digest = ids[0].split("-")[2]
    assert len(set(ids)) == 2 and all(re.fullmatch(rf"\d{{8}}-\d{{6}}-{digest}(-2)?", run_id) for run_id in ids)
    for run_id in ids:
        assert wait_run(client, run_id)["status"] == "complete"


def test_a_page_on_another_origin_and_a_rebound_host_are_refused(server, client):
    url, _ = server
    batches = metric(url, "tpugen_batch_seconds_count")
    port = url.rsplit(":", 1)[1]
    evil = {"Origin": "https://attacker.example"}
    # What a cross-site page can send without a preflight: a text/plain POST.
    text = client.post("/v1/runs", content=run_body("cross-site"), headers={**evil, "Content-Type": "text/plain"})
    assert text.status_code == 403 and text.json()["detail"] == [
        "Origin: 'https://attacker.example' may not call this server (serve.allowed_origins lists the pages that may)"
    ]
    assert client.post("/sdapi/v1/txt2img", json={**BASE, "prompt": "a cat"}, headers=evil).status_code == 403
    assert client.get("/v1/runs/cross-site").status_code == 404
    assert metric(url, "tpugen_batch_seconds_count") == batches
    # The server's own page (its origin) may.
    assert client.get("/sdapi/v1/options", headers={"Origin": url}).status_code == 200
    # DNS rebinding: a name that resolves to 127.0.0.1 brings its own Host.
    rebound = client.get("/sdapi/v1/options", headers={"Host": f"attacker.example:{port}"})
    assert rebound.status_code == 400 and rebound.json()["detail"][0].startswith("Host: 'attacker.example:")
    assert client.get("/sdapi/v1/options", headers={"Host": f"localhost:{port}"}).status_code == 200


def test_every_reply_keeps_out_of_frames_and_sniffing(server, client):
    url, _ = server
    replies = [client.get("/healthz"), client.get("/nowhere"), httpx.get(f"{url}/sdapi/v1/options"), client.get("/")]
    assert [r.status_code for r in replies] == [200, 404, 401, 200]
    for reply in replies:
        assert reply.headers["x-frame-options"] == "DENY" and reply.headers["x-content-type-options"] == "nosniff"


def test_a_chunked_body_past_the_limit_is_cut_off_while_it_arrives(server):
    """No Content-Length: the server counts the chunks and answers 413 once they pass the route's limit (1 MiB
    for a text route), long before the 64 MiB this client would send."""
    url, _ = server
    host, port = url.removeprefix("http://").split(":")
    head = (
        f"POST /sdapi/v1/txt2img HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: {AUTH['Authorization']}\r\n"
        "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    ).encode()
    chunk = b"%x\r\n%s\r\n" % (64 * 1024, b" " * (64 * 1024))
    sent, reply = 0, b""
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head + b"1\r\n{\r\n")
        deadline = time.monotonic() + 60
        while sent < 64 * 1024 * 1024 and time.monotonic() < deadline:
            readable, _, _ = select.select([sock], [], [], 0)
            if readable:
                break
            try:
                sock.sendall(chunk)
            except OSError:  # the server answered and closed while this was sending
                break
            sent += 64 * 1024
        sock.settimeout(30)
        while b"\r\n\r\n" not in reply:
            data = sock.recv(65536)
            if not data:
                break
            reply += data
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert sent < 8 * 1024 * 1024, sent  # cut off near the 1 MiB limit, not read whole


def _until_closed(sock: socket.socket, seconds: float) -> tuple[bytes, float | None]:
    """What the server sent before it closed `sock`, and when it closed it (None: still open after `seconds`)."""
    got, deadline = b"", time.monotonic() + seconds
    while time.monotonic() < deadline:
        readable, _, _ = select.select([sock], [], [], max(0.0, deadline - time.monotonic()))
        if readable:
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                data = b""
            if not data:
                return got, time.monotonic()
            got += data
    return got, None


def test_silent_half_sent_and_idle_connections_are_closed_after_their_deadlines(server, client):
    """A connection that never speaks, a request head sent in part, a body that stops half-way (by length and
    chunked), and a kept-alive connection left idle: none holds the server. The session's server has
    read_timeout_s 3 and idle_timeout_s 3. Before: the first two stayed open for as long as the client liked."""
    url, service = server
    read_s, idle_s = service.serve.read_timeout_s, service.serve.idle_timeout_s
    host, port = url.removeprefix("http://").split(":")
    head = f"POST /sdapi/v1/txt2img HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: {AUTH['Authorization']}\r\n"
    sends = {
        "silent": b"",
        "half head": head.encode(),
        "half body": (head + 'Content-Type: application/json\r\nContent-Length: 500\r\n\r\n{"pro').encode(),
        "half chunked": (
            head + 'Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{"pro'
        ).encode(),
        "idle": f"GET /healthz HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode(),
    }
    sockets = {name: socket.create_connection((host, int(port)), timeout=30) for name in sends}
    started = time.monotonic()
    for name, data in sends.items():
        if data:
            sockets[name].sendall(data)
    results = {}
    for name, sock in sockets.items():
        with sock:
            got, closed = _until_closed(sock, read_s + 15)
            results[name] = (got, None if closed is None else closed - started)
    for name in ("silent", "half head"):
        assert results[name][0] == b"" and results[name][1] is not None, (name, results[name])
        assert read_s - 0.5 <= results[name][1] <= read_s + 10, (name, results[name][1])
    for name in ("half body", "half chunked"):
        reply, closed = results[name]
        assert reply.startswith(b"HTTP/1.1 408"), (name, reply[:200])
        assert b"the body stopped arriving" in reply and b"connection: close" in reply.lower(), reply
        assert closed is not None and read_s - 0.5 <= closed <= read_s + 10, (name, closed)
    reply, closed = results["idle"]
    assert reply.startswith(b"HTTP/1.1 200") and closed is not None and idle_s - 0.5 <= closed <= idle_s + 10
    assert client.get("/readyz").status_code == 200


def test_healthz_answers_at_once_while_a_large_run_body_is_parsed(server, client):
    """2 MB of YAML, malformed at its very end: libyaml refuses it at once, and the pure-Python loader then reads
    it all again for its words (seconds: the slowest path a body can take). Parsed in a worker thread, the event
    loop answers /healthz meanwhile."""
    url, _ = server
    prompt = "a lighthouse on a cliff at dawn, oil on canvas, " * 40  # 1,960 characters
    body = "model: {id: not-the-servers}\nprompts:\n" + "".join(f"  - {prompt}{i}\n" for i in range(1050))
    body += "  - [unclosed\n"
    assert len(body) > 2_000_000
    answer: list[httpx.Response] = []
    sender = threading.Thread(
        target=lambda: answer.append(httpx.post(f"{url}/v1/runs", content=body, headers=AUTH, timeout=120))
    )
    sender.start()
    times: list[float] = []
    while sender.is_alive() and len(times) < 3000:
        start = time.perf_counter()
        assert client.get("/healthz").status_code == 200
        times.append(time.perf_counter() - start)
        time.sleep(0.01)
    sender.join(120)
    assert answer and answer[0].status_code == 422, answer
    assert answer[0].json()["detail"][0].startswith("body: malformed YAML at line 1054"), answer[0].json()
    # Parsed on the event loop, the loop would stop for the whole parse (1 s here): one poll of a second, no
    # others. On two busy cores a poll can still wait a scheduler's turn, so: nine in ten under 100 ms, none near
    # the parse's length.
    assert len(times) >= 10, times  # the parse took long enough to be measured
    ranked = sorted(times)
    assert ranked[int(len(ranked) * 0.9)] < 0.1 and ranked[-1] < 0.5, ranked[-5:]


def test_bodies_of_the_types_any_page_may_send_unasked_are_415(server, client):
    url, _ = server
    batches = metric(url, "tpugen_batch_seconds_count")
    body = json.dumps({**BASE, "prompt": "a cat"})
    for media in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        refused = client.post("/sdapi/v1/txt2img", content=body, headers={"Content-Type": media})
        assert refused.status_code == 415, refused.text[:200]
        kind = media.split(";")[0]
        assert refused.json()["detail"] == [f"Content-Type: {kind}; this endpoint reads application/json"]
        run = client.post("/v1/runs", content=run_body("page-typed"), headers={"Content-Type": media})
        assert run.status_code == 415 and run.json()["detail"] == [
            f"Content-Type: {kind}; a run is sent as application/json or application/yaml"
        ]
    assert client.get("/v1/runs/page-typed").status_code == 404
    assert metric(url, "tpugen_batch_seconds_count") == batches


def test_good_requests_among_hostile_ones_are_all_answered_and_the_server_stays_ready(server):
    """A bounded mix, four clients at once: every good request gets its image, every hostile one a 4xx, and
    /readyz says ready throughout and after."""
    url, service = server
    init = _png()
    good = {**BASE, "prompt": "a lighthouse", "seed": 5}
    hostile = [
        ("/sdapi/v1/txt2img", {"content": b"{not json", "headers": {"Content-Type": "application/json"}}, 422),
        ("/sdapi/v1/txt2img", {"json": {**good, "steps": 1000}}, 422),
        ("/sdapi/v1/txt2img", {"json": good, "headers": {"Origin": "https://attacker.example"}}, 403),
        ("/sdapi/v1/txt2img", {"content": json.dumps(good), "headers": {"Content-Type": "text/plain"}}, 415),
        ("/sdapi/v1/img2img", {"json": {**good, "init_images": ["data:image/png;base64"]}}, 422),
        ("/sdapi/v1/img2img", {"json": {**good, "init_images": [init], "steps": 2, "denoising_strength": 0.1}}, 200),
        ("/v1/runs", {"content": "prompts: [a cat\n"}, 422),
        ("/v1/images/generations", {"json": {"prompt": "a cat", "size": "64x64", "n": 10**9}}, 422),
    ]
    work = [("/sdapi/v1/txt2img", {"json": good}, 200)] * 8 + hostile * 2
    answers: list[tuple[int, int]] = []
    ready: list[int] = []
    lock = threading.Lock()

    def client_loop(share: list) -> None:
        with httpx.Client(base_url=url, headers=AUTH, timeout=120) as http:
            for path, arguments, expected in share:
                status = http.post(path, **arguments).status_code
                with lock:
                    answers.append((expected, status))
                    ready.append(http.get("/readyz").status_code)

    threads = [threading.Thread(target=client_loop, args=(work[i::4],)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert len(answers) == len(work)
    assert [status for expected, status in answers if expected != status] == []
    assert set(ready) == {200} and service.state == "ready"
