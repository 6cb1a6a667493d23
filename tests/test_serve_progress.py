"""Progress per job, without a device: counts and numbered events, replay after an event id, bounded memory, and
the event stream as `tpugen generate --server` reads it."""

from __future__ import annotations

import time

from tpugen.modes.serve.client import server_sent_events
from tpugen.modes.serve.progress import Jobs


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


def test_the_clients_reading_of_an_event_stream():
    stream = [
        b"retry: 2000\n",
        b"\n",
        b"id: 1\n",
        b"event: progress\n",
        b'data: {"images_done": 0}\n',
        b"\n",
        b": keep-alive\n",
        b"\n",
        b"id: 2\r\n",
        b"event: end\r\n",
        b'data: {"status":\n',
        b'data:  "complete"}\n',
        b"\n",
    ]
    assert list(server_sent_events(stream)) == [(1, "progress", {"images_done": 0}), (2, "end", {"status": "complete"})]


def test_a_jobs_fraction_counts_the_steps_of_its_images_on_a_device():
    jobs = Jobs()
    job = jobs.open("request", "r", images_planned=4, steps=10)
    jobs.stepped(job, 5, images=2)  # half the steps of a batch holding 2 of its 4 images
    assert (job.step, job.state, job.fraction) == (5, "running", 0.25)
    jobs.advance(job, 2)
    assert (job.step, job.images_done, job.fraction) == (10, 2, 0.5)
    jobs.stepped(job, 10, images=2)
    assert job.fraction == 1.0
