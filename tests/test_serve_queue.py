"""The server's queue, without a device: images coalesce into static batches by key, within the window."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest

from tpugen.modes.serve.queue import BatchQueue, ImageJob, QueueFull, Request
from tpugen.plan import ImageWork

# The work of the images a test sends: the queue reads their call key, and a test names them by their prompt.
KEY = ImageWork(prompt="p", negative_prompt="", seed=0, steps=3, guidance_scale=7.5, height=64, width=64)
OTHER = replace(KEY, steps=5)  # another step count: never batched with KEY


def image(prompt: str, seed: int, like: ImageWork = KEY) -> ImageWork:
    return replace(like, prompt=prompt, seed=seed)


def ask(queue: BatchQueue, images: int, like: ImageWork = KEY, interruptible: bool = False) -> Request:
    request = Request(images, interruptible)
    queue.submit(request, [ImageJob(request, i, image(f"p{i}", i, like)) for i in range(images)])
    return request


def test_a_full_batch_goes_at_once_and_a_partial_one_after_the_window():
    queue = BatchQueue(batch_size=2, window_seconds=0.2, max_requests=8)
    first, second, third = ask(queue, 1), ask(queue, 1), ask(queue, 1)
    key, jobs = queue.take(timeout=0)  # a full batch leaves without waiting at all
    assert key == KEY.call_key and [job.request for job in jobs] == [first, second]  # two requests, one batch
    # The partial one waits for companions: made to arrive just now, whatever time a slow machine took so far.
    third.created = time.monotonic() + 60
    assert queue.take(timeout=0) is None
    third.created = time.monotonic()
    key, jobs = queue.take(timeout=1)
    assert [job.request for job in jobs] == [third] and time.monotonic() - third.created >= 0.2  # ...the window
    assert queue.take(timeout=0.05) is None


def test_images_of_other_keys_are_never_batched_together():
    queue = BatchQueue(batch_size=4, window_seconds=0.0, max_requests=8)
    ask(queue, 1, KEY), ask(queue, 1, OTHER), ask(queue, 1, KEY)
    taken = [queue.take(timeout=1), queue.take(timeout=1)]
    assert [(key, len(jobs)) for key, jobs in taken] == [(KEY.call_key, 2), (OTHER.call_key, 1)]


def test_a_big_request_is_split_into_batches_of_the_compiled_size():
    queue = BatchQueue(batch_size=2, window_seconds=0.0, max_requests=8)
    request = ask(queue, 5)
    sizes = [len(queue.take(timeout=1)[1]) for _ in range(3)]
    assert sizes == [2, 2, 1] and queue.depth() == 0 and not request.done


def test_a_full_queue_refuses_and_a_settled_request_frees_its_slot():
    queue = BatchQueue(batch_size=2, window_seconds=10, max_requests=2)
    first, _ = ask(queue, 3), ask(queue, 1)
    with pytest.raises(QueueFull):
        ask(queue, 1)
    queue.settle(first)  # answered or timed out: its images still waiting are dropped
    assert queue.depth() == 1 and first not in queue.open_requests()
    ask(queue, 1)


def test_a_busy_key_does_not_starve_an_older_partial_batch():
    queue = BatchQueue(batch_size=2, window_seconds=0.05, max_requests=8)
    first, quiet, later = ask(queue, 2, KEY), ask(queue, 1, OTHER), ask(queue, 2, KEY)
    for request in (first, quiet, later):  # all due, in the order they came; KEY still has a full batch after
        request.created -= 1.0  # the first is taken
    assert [queue.take(timeout=1)[1][0].request for _ in range(3)] == [first, quiet, later]


def test_an_interrupt_finishes_only_interruptible_requests_with_what_they_have():
    queue = BatchQueue(batch_size=1, window_seconds=0.0, max_requests=8)
    web_ui, openai = ask(queue, 3, interruptible=True), ask(queue, 2)
    _, (job,) = queue.take(timeout=1)
    web_ui.deliver(job.position, "pixels")
    assert queue.interrupt() == 1
    assert web_ui.done and web_ui.pixels == {0: "pixels"} and not openai.done
    queue.settle(web_ui)  # its images not started are dropped; the other request's stay
    assert queue.depth() == 2 and queue.interrupt() == 0


def test_delivery_completes_a_request_and_closing_releases_the_loops():
    queue = BatchQueue(batch_size=2, window_seconds=0.0, max_requests=4)
    request = ask(queue, 2)
    _, jobs = queue.take(timeout=1)
    for job in jobs:
        request.deliver(job.position, f"pixels {job.position}")
    assert request.wait(0) and request.pixels == {0: "pixels 0", 1: "pixels 1"}
    got = []
    waiter = threading.Thread(target=lambda: got.append(queue.take(timeout=10)))
    waiter.start()
    queue.close()
    waiter.join(2)
    assert got == [None] and not waiter.is_alive()
