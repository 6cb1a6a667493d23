"""The server's queue takes clients in turn, without a device: one client's many images never hold back another's
one, same-key images of several clients still share a batch, and each client's images keep their order."""

from __future__ import annotations

import base64
from dataclasses import replace

from tpugen.modes.serve.queue import BatchQueue, ImageJob, Request
from tpugen.modes.serve.request_ids import client_of, request_id_for
from tpugen.plan import ImageWork

# The work of the images a test sends: the queue reads their call key, and a test names them by their prompt.
KEY = ImageWork(prompt="p", negative_prompt="", seed=0, steps=3, guidance_scale=7.5, height=64, width=64)
OTHER = replace(KEY, steps=5)  # another step count: never batched with KEY


def image(prompt: str, seed: int, like: ImageWork = KEY) -> ImageWork:
    return replace(like, prompt=prompt, seed=seed)


def ask(queue: BatchQueue, client: str, images: int, like: ImageWork = KEY) -> Request:
    request = Request(images, client=client)
    queue.submit(request, [ImageJob(request, i, image(f"{client}{i}", i, like)) for i in range(images)])
    return request


def order(queue: BatchQueue, batches: int) -> list[list[str]]:
    """The prompts of the next `batches` batches, as the device loops would take them."""
    taken = []
    for _ in range(batches):
        _, jobs = queue.take(timeout=1)
        taken.append([job.work.prompt for job in jobs])
    assert queue.take(timeout=0) is None
    return taken


def test_one_image_of_another_client_goes_next_not_after_a_thousand():
    queue = BatchQueue(batch_size=1, window_seconds=0.0, max_requests=8)
    ask(queue, "big", 1000)
    ask(queue, "small", 1)
    first, second = queue.take(timeout=1)[1], queue.take(timeout=1)[1]
    assert [first[0].work.prompt, second[0].work.prompt] == ["big0", "small0"]  # (before: small0 after big999)
    assert queue.depth() == 999


def test_clients_take_turns_each_in_the_order_it_sent():
    queue = BatchQueue(batch_size=1, window_seconds=0.0, max_requests=8)
    ask(queue, "a", 3), ask(queue, "b", 2), ask(queue, "c", 1)
    assert order(queue, 6) == [["a0"], ["b0"], ["c0"], ["a1"], ["b1"], ["a2"]]


def test_images_of_one_key_from_several_clients_share_a_batch_one_client_at_a_time():
    queue = BatchQueue(batch_size=4, window_seconds=0.0, max_requests=8)
    ask(queue, "a", 6), ask(queue, "b", 1), ask(queue, "c", 2)
    # a's turn fills the batch a, b, c, a; each client served goes to the back, in the order served: a, c.
    assert order(queue, 3) == [["a0", "b0", "c0", "a1"], ["a2", "c1", "a3", "a4"], ["a5"]]


def test_a_clients_requests_keep_their_order_and_other_keys_are_never_mixed():
    queue = BatchQueue(batch_size=2, window_seconds=0.0, max_requests=8)
    first = Request(2, client="a")
    queue.submit(first, [ImageJob(first, i, image(f"first{i}", i)) for i in range(2)])
    ask(queue, "b", 1, OTHER)
    second = Request(1, client="a")
    queue.submit(second, [ImageJob(second, 0, image("second0", 0))])
    taken = [queue.take(timeout=1) for _ in range(3)]
    assert [(key, [job.work.prompt for job in jobs]) for key, jobs in taken] == [
        (KEY.call_key, ["first0", "first1"]),
        (OTHER.call_key, ["b0"]),
        (KEY.call_key, ["second0"]),
    ]


def test_a_client_whose_batch_is_not_ready_lets_a_ready_one_go_first():
    queue = BatchQueue(batch_size=2, window_seconds=60, max_requests=8)
    ask(queue, "a", 1)  # half a batch: it waits for the window
    ask(queue, "b", 2, OTHER)  # a full batch: ready now
    key, jobs = queue.take(timeout=0)
    assert key == OTHER.call_key and [job.work.prompt for job in jobs] == ["b0", "b1"]
    assert queue.take(timeout=0) is None


def test_a_settled_request_leaves_its_clients_turn_and_starting_is_told_once():
    queue = BatchQueue(batch_size=1, window_seconds=0.0, max_requests=8)
    started = []
    gone = ask(queue, "a", 3)
    gone.on_start = lambda: started.append("a")
    ask(queue, "b", 1)
    assert queue.take(timeout=1)[1][0].work.prompt == "a0" and started == ["a"]
    queue.settle(gone)  # answered (or timed out): a's other images leave, b is next
    assert order(queue, 1) == [["b0"]] and started == ["a"] and queue.depth() == 0


def test_whom_a_request_counts_for():
    bearer = "Bearer k3y"
    keyed = client_of(bearer, "10.0.0.1")
    assert keyed.startswith("key ") and "k3y" not in keyed and keyed.endswith(" peer 10.0.0.1")
    assert client_of(bearer, "10.0.0.1") != client_of(bearer, "10.0.0.2")  # one key, two machines: two clients
    assert client_of(bearer, "10.0.0.1") != client_of("Bearer other", "10.0.0.1")
    assert client_of("Basic " + base64.b64encode(b"u:k3y").decode(), "10.0.0.1") == keyed  # basic auth, same key
    assert client_of(None, "10.0.0.1") == client_of("Bearer ", "10.0.0.1") == "peer 10.0.0.1"
    assert client_of(None, None) == "peer -"


def test_a_request_id_is_the_clients_when_sane_else_made():
    assert request_id_for("req-42.a:b_c") == "req-42.a:b_c"
    made = {request_id_for(given) for given in (None, "", "a b", "x" * 129, "-leading", "new\nline")}
    assert len(made) == 6 and all(len(rid) == 32 and int(rid, 16) >= 0 for rid in made)
