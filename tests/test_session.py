"""The run session's files without a device: fake pixels through the real writers, resumes of torn manifests."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import PROMPTS, run_cli, tiny_config, write_config

from tpugen.config import load_config
from tpugen.engine.session import RunSession
from tpugen.errors import InputError
from tpugen.outputs.files import write_json
from tpugen.outputs.manifest import read_manifest
from tpugen.plan import plan_run


class FakeEngine:
    """What a writer asks of an engine: the names it records."""

    scheduler_name = "DDIM"
    model_label = "tiny-sd"


def write_batch(session: RunSession, batch, manifest: str = "manifest.jsonl", rank: int | None = None) -> None:
    extra = {} if rank is None else {"rank": rank}
    writer = session.writer(FakeEngine(), manifest=manifest, extra=extra)
    pixels = [np.full((64, 64, 3), 40 * item.index, np.uint8) for item in batch.items]
    writer(batch, pixels, 0.5)
    writer.close()


@pytest.fixture
def multi_run(tmp_path, monkeypatch):
    """A multi-mode run (batch 1: one batch per image) whose rank 0 wrote batch 0 and was killed while it
    appended batch 1's line: what SIGKILL mid-write leaves."""
    config = tiny_config(tmp_path, prompts=list(PROMPTS), batch_size=1, execution={"mode": "multi", "cores": 2})
    run = load_config(write_config(tmp_path / "c.yaml", config))
    session = RunSession.create(run)
    batches = plan_run(run).batches
    write_batch(RunSession.attach(run, session.run_dir, frozenset()), batches[0], "manifest.rank0.jsonl", rank=0)
    with open(session.run_dir / "manifest.rank0.jsonl", "a", encoding="utf-8") as manifest:
        manifest.write('{"index": 1, "fi')
    # finish() writes its report with the one report builder's renderer, which wants a real run's timings.
    monkeypatch.setattr("tpugen.engine.session.write_report", lambda run_dir, report: None)
    return run, session.run_dir, batches


def test_a_resumed_rank_never_appends_to_a_torn_line(multi_run):
    run, run_dir, batches = multi_run
    session = RunSession.resume(run, run_dir)
    assert sorted(session.finished) == [0] and session.problems == []
    session.settle()  # run_multi's parent, before it launches the ranks
    assert not list(run_dir.glob("manifest.rank*.jsonl"))
    assert [r["index"] for r in read_manifest(run_dir / "manifest.jsonl")] == [0]

    rank = RunSession.attach(run, run_dir, frozenset(session.finished))
    for batch in batches[1:]:
        write_batch(rank, batch, "manifest.rank0.jsonl", rank=0)
    session.finish({"run_id": session.run_id, "complete": True})
    records = read_manifest(run_dir / "manifest.jsonl")
    assert [r["index"] for r in records] == list(range(len(batches)))  # batch 1's line was lost before
    assert sorted(p.name[:5] for p in run_dir.glob("[0-9]*.png")) == [f"{i:05d}" for i in range(len(batches))]


def test_a_resume_drops_records_it_ignored_and_images_gone_from_disk(multi_run):
    run, run_dir, _ = multi_run
    first = read_manifest(run_dir / "manifest.rank0.jsonl")[0]
    with open(run_dir / "manifest.rank1.jsonl", "w", encoding="utf-8") as manifest:
        manifest.write(json.dumps({**first, "index": 99}) + "\n")
    session = RunSession.resume(run, run_dir)
    assert session.problems == ["manifest.rank1.jsonl line 1: image 99 is not in this run's plan (3 images); ignored"]
    (run_dir / first["file"]).unlink()
    session = RunSession.resume(run, run_dir)
    session.settle()
    session.finish({"run_id": session.run_id, "complete": False})
    assert read_manifest(run_dir / "manifest.jsonl") == []  # before: [0, 99], naming a missing file and no image


def test_a_tear_inside_a_character_costs_only_the_torn_line(tmp_path):
    config = tiny_config(tmp_path, prompts=["a dog", "東京の夜景"], batch_size=1, execution={"backend": "cpu"})
    run = load_config(write_config(tmp_path / "c.yaml", config))
    session = RunSession.create(run)
    first, second = plan_run(run).batches
    write_batch(session, first)
    write_batch(session, second)
    manifest = session.run_dir / "manifest.jsonl"
    data = manifest.read_bytes()
    cut = data.rindex("東".encode()) + 1  # one byte into the last line's first 東
    manifest.write_bytes(data[:cut])
    resumed = RunSession.resume(run, session.run_dir)
    assert sorted(resumed.finished) == [0] and resumed.problems == []  # a UnicodeDecodeError before


def test_resuming_a_complete_multi_run_counts_no_device(tmp_path):
    # A finished cuda run resumed on a machine with no GPU: nothing to make, so no device is looked for.
    config = tiny_config(tmp_path, batch_size=1, execution={"backend": "cuda", "mode": "multi"})
    path = write_config(tmp_path / "c.yaml", config)
    run = load_config(path)
    session = RunSession.create(run)
    for batch in plan_run(run).batches:
        write_batch(session, batch)
    write_json(session.run_dir / "report.json", {"run_id": "run", "complete": True, "error": None})
    result = run_cli("resume", session.run_dir, "--quiet")
    assert result.exit_code == 0, result.output  # before: "execution.backend: cuda: no CUDA GPU is visible"
    assert "nothing to do" in result.stdout + result.stderr


def test_run_json_is_written_before_config_yaml(tmp_path, monkeypatch):
    # A directory with config.yaml and no run.json reads as a run from before run.json: its prompts file would
    # be read again on resume. So a crash between the two must leave run.json, not config.yaml.
    import tpugen.engine.session as session_module

    run = load_config(write_config(tmp_path / "c.yaml", tiny_config(tmp_path)))

    def crash(path, text):
        raise KeyboardInterrupt

    monkeypatch.setattr(session_module, "atomic_write_text", crash)
    with pytest.raises(KeyboardInterrupt):
        RunSession.create(run)
    assert sorted(p.name for p in (tmp_path / "outputs" / "run").iterdir()) == ["run.json"]


def test_of_two_runs_started_at_once_with_one_run_id_the_second_is_refused(tmp_path, monkeypatch):
    import tpugen.engine.session as session_module

    run = load_config(write_config(tmp_path / "c.yaml", tiny_config(tmp_path)))
    first = RunSession.create(run)
    record = (first.run_dir / "run.json").read_bytes()
    # The second passed the emptiness check before the first wrote anything: the race the check alone loses.
    monkeypatch.setattr(session_module, "check_run_dir_free", lambda output_dir, run_id: first.run_dir)
    with pytest.raises(InputError, match="is being used by another run that started at the same time"):
        RunSession.create(run)
    assert (first.run_dir / "run.json").read_bytes() == record
    assert sorted(p.name for p in first.run_dir.iterdir()) == ["config.yaml", "run.json"]  # no temporary left


def test_a_taken_run_id_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    """On a TPU the load takes minutes: what make_run_dir would refuse afterwards is refused first."""
    from tpugen.engine import Engine

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded for a run that cannot be written")

    monkeypatch.setattr(Engine, "open", no_loading)
    taken = tmp_path / "outputs" / "run"
    taken.mkdir(parents=True)
    (taken / "notes.txt").write_text("someone's\n")
    path = write_config(tmp_path / "c.yaml", tiny_config(tmp_path, execution={"backend": "cpu"}))
    result = run_cli("generate", path, "--quiet")
    assert result.exit_code == 2, result.output
    assert result.stderr == f"error: output.run_id: {taken} already exists and is not empty; choose another run_id\n"
    assert sorted(p.name for p in taken.iterdir()) == ["notes.txt"]
