"""The typed run report: each mode's section owns its report.json keys and its lines in report.md; a report read
back from report.json is the report that was written."""

from __future__ import annotations

import json

import pytest

from tpugen.outputs.report import RunReport, read_report, render_markdown, write_report
from tpugen.outputs.sections import SECTIONS, SINGLE, PodSection, RanksSection, RaySection, section_from_json

TIMED = {
    "wall_seconds": 2.0,
    "generate_seconds": 1.5,
    "write_seconds": 0.5,
    "images_per_second": 2.0,
    "per_image_seconds": {"mean": 0.5, "p50": 0.5, "p90": 0.6, "p99": 0.6},
    "seconds_per_step": 0.25,
    "batches": [{"batch": 0, "shape_key": "64x64xb2", "images": 2, "seconds": 1.0, "compiles": 0, "steps": 2}],
}

RANKS = RanksSection(
    launch_wall_seconds=9.5,
    weights_loaded="from disk once per rank process",
    counters_scope="one process per rank: every count is that rank's own",
    ranks=[
        {
            "rank": 0,
            "pid": 11,
            "images": 2,
            "batches": 1,
            "warmup_compiles": 3,
            "warmup_seconds": 4.0,
            "per_image_seconds": 0.5,
            "timed_wall_seconds": 1.0,
            "compiles_after_warmup": 0,
            "error": None,
        }
    ],
    launcher={"tool": "torch_xla.launch", "devices": 2},
)
RAY = RaySection(
    {
        "address": "ray://127.0.0.1:10001",
        "workers": 2,
        "resources_per_worker": {"CPU": 1.0},
        "max_restarts": 1,
        "in_flight_per_worker": 2,
        "batch_timeout_s": 600,
        "timed_wall": "the driver's window",
        "per_worker": [
            {
                "index": 0,
                "node": "abc",
                "pids": [5, 6],
                "state": "done",
                "batches_done": 1,
                "images": 2,
                "warmup_seconds": 3.0,
                "per_image_seconds": 0.5,
                "restarts": 1,
                "lost_batches": [1],
                "compiles_after_warmup": 0,
                "error": None,
            }
        ],
        "events": [{"event": "lost", "worker": 0, "seconds": 1.25, "pid": 5, "reason": "killed", "batches": [1]}],
        "lost_workers": [0],
        "restarts": 1,
        "retried_batches": [1],
    }
)
POD = PodSection(
    tpu="v5litepod-16",
    zone="us-west4-a",
    workers=2,
    failed_workers=[1],
    per_worker=[
        {
            "worker": w,
            "gathered": True,
            "exit_status": w,
            "complete": not w,
            "images": 1,
            "warmup_seconds": 3.0,
            "timed_wall_seconds": 1.0,
            "images_per_second": 1.0,
            "compiles_after_warmup": 0,
            "last_lines": ["Traceback: boom"] if w else [],
        }
        for w in (0, 1)
    ],
    slowest_worker_wall_seconds=1.0,
    pod_images_per_second=2.0,
    gather_failed_workers=[1],
    ssh_exit_status=1,
)


def report_with(section, **changes) -> RunReport:
    return RunReport(
        run_id="r1",
        run_dir="/runs/r1",
        complete=True,
        versions={"torch": "2.9.0"},
        device={"backend": "xla", "device_kind": "CPU"},
        topology={"worker_index": 0, "num_workers": 1, "rank": 0, "ranks_per_worker": 1, "world_size": 2},
        model={"id": "tiny-sd", "dtype": "float32", "scheduler": "EulerDiscreteScheduler", "loras": []},
        images=2,
        images_planned=2,
        batches=1,
        padding_rows=0,
        warmup=[],
        warmup_seconds=0.0,
        timed_phase=TIMED,
        section=section,
    ).but(**changes)


@pytest.mark.parametrize("section", [SINGLE, RANKS, RAY, POD], ids=["single", "multi", "ray", "pod"])
def test_a_report_read_back_from_report_json_is_the_report_written(tmp_path, section):
    made = report_with(section)
    write_report(tmp_path, made)
    stored = read_report(tmp_path)
    back = RunReport.from_json(stored)
    assert back.section == section and back.as_json() == made.as_json() == stored
    assert render_markdown(back) == (tmp_path / "report.md").read_text()


def test_each_section_writes_its_mode_and_is_found_by_it():
    assert set(SECTIONS) == {"multi", "ray", "pod"}
    assert "mode" not in report_with(SINGLE)  # a single run's report.json is as it was
    for section in (RANKS, RAY, POD):
        assert report_with(section)["mode"] == section.mode
        assert section_from_json(report_with(section).as_json()) == section
    # A pod report written before reports carried "mode" is still read as one.
    older = {k: v for k, v in report_with(POD).as_json().items() if k != "mode"}
    assert isinstance(section_from_json(older), PodSection)


def test_the_section_says_its_own_lines_and_no_other_sections():
    texts = {name: render_markdown(report_with(s)) for name, s in (("single", SINGLE), ("multi", RANKS))}
    texts |= {"ray": render_markdown(report_with(RAY)), "pod": render_markdown(report_with(POD, complete=False))}
    assert texts["single"].startswith("# tpugen run r1") and "(world size 2)" in texts["single"]
    assert "## Ranks (1)" in texts["multi"] and "Launched by torch_xla.launch (devices: 2)." in texts["multi"]
    assert texts["ray"].startswith("# tpugen ray run r1") and "(2 Ray workers)" in texts["ray"]
    assert "- 1.2 s: worker 0 lost (pid 5, killed); batches 1 went back to the queue" in texts["ray"]
    pod = texts["pod"]
    assert pod.startswith("# tpugen pod run r1") and "- status: INCOMPLETE (failed workers: [1])" in pod
    assert "- TPU: v5litepod-16 in us-west4-a, 2 workers" in pod
    assert "- gathering failed for workers [1]; earlier copies kept for workers [1]" in pod
    assert "Worker 1, last lines:" in pod and "## Workers (2)" in pod
    only = {"single": (), "multi": ("## Ranks",), "ray": ("## Ray workers",), "pod": ("## Workers", "- TPU:")}
    for name, text in texts.items():
        for other, marks in only.items():
            for mark in marks:
                assert (mark in text) == (other == name), (name, mark)


def test_a_report_without_figures_still_renders_and_keeps_keys_it_does_not_know(tmp_path):
    # What a session whose pipeline broke before any figure existed leaves, with a key from another version.
    stored = {"run_id": "r2", "complete": False, "error": "the run failed: boom", "report_error": "KeyError: 'x'"}
    report = RunReport.from_json(stored)
    assert report.timed_phase is None and report["report_error"] == "KeyError: 'x'"
    text = render_markdown(report)
    assert "- status: INCOMPLETE" in text and "- stopped by: the run failed: boom" in text and "- wall: n/a s" in text
    write_report(tmp_path, report.but(complete=True, error=None))
    assert json.loads((tmp_path / "report.json").read_text())["report_error"] == "KeyError: 'x'"


def test_a_report_is_read_by_key_but_never_edited_in_place():
    report = report_with(RANKS)
    assert report["images"] == 2 and report.get("already_complete") is None and dict(report)["ranks"] == RANKS.ranks
    with pytest.raises(TypeError):
        report["images"] = 3  # a mode once added its keys afterwards; now it hands over its section
    assert report.but(already_complete=True)["already_complete"] is True
