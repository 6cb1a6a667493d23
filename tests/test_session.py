"""The run session's files without a device: fake pixels through the real writers, resumes of torn manifests."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import PROMPTS, run_cli, tiny_config, with_prompts_file, write_config

from tpugen.config import load_config
from tpugen.engine.session import RunSession
from tpugen.errors import InputError
from tpugen.files import write_json
from tpugen.outputs.manifest import read_manifest
from tpugen.outputs.report import RunReport
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
def multi_run(tmp_path):
    """A multi-mode run (batch 1: one batch per image) whose rank 0 wrote batch 0 and was killed while it
    appended batch 1's line: what SIGKILL mid-write leaves."""
    config = tiny_config(tmp_path, prompts=list(PROMPTS), batch_size=1, execution={"mode": "multi", "cores": 2})
    run = load_config(write_config(tmp_path / "c.yaml", config))
    session = RunSession.create(run)
    batches = plan_run(run).batches
    write_batch(RunSession.attach(run, session.run_dir, frozenset()), batches[0], "manifest.rank0.jsonl", rank=0)
    with open(session.run_dir / "manifest.rank0.jsonl", "a", encoding="utf-8") as manifest:
        manifest.write('{"index": 1, "fi')
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
    session.finish(RunReport(run_id=session.run_id, run_dir=str(run_dir), complete=True))
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
    session.finish(RunReport(run_id=session.run_id, run_dir=str(run_dir), complete=False, error="killed"))
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
    import tpugen.outputs.run_dir as run_dir_module

    run = load_config(write_config(tmp_path / "c.yaml", tiny_config(tmp_path)))
    first = RunSession.create(run)
    record = (first.run_dir / "run.json").read_bytes()
    # The second passed the emptiness check before the first wrote anything: the race the check alone loses.
    monkeypatch.setattr(run_dir_module, "check_run_dir_free", lambda output_dir, run_id: first.run_dir)
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


@pytest.fixture
def half_done(tmp_path):
    """A run (3 prompts read from a file, batch 2) whose first batch is on disk: (its config file, its directory)."""
    config = with_prompts_file(tmp_path, tiny_config(tmp_path), list(PROMPTS))
    path = write_config(tmp_path / "c.yaml", config)
    run = load_config(path)
    session = RunSession.create(run)
    write_batch(session, plan_run(run).batches[0])
    return path, session.run_dir


def test_a_resume_takes_keys_that_change_no_pixel_and_warns_for_rounding_ones(half_done):
    path, run_dir = half_done
    made = read_manifest(run_dir / "manifest.jsonl")[0]["config_hash"]
    # The chip the memory plan is for changes no pixel: resumed without a word (refused before), and the images
    # made now carry the run's config hash, as an uninterrupted run's would.
    run = load_config(path, ["execution.chip=v4", "execution.chip_memory_gb=8", "execution.strict_shapes=true"])
    assert run.config_hash != made
    session = RunSession.resume(run, run_dir)
    assert session.problems == [] and session.run.config_hash == made
    # Another device count or mode moves pixels by rounding only: one warning line (refused before).
    rounding = load_config(path, ["execution.mode=multi", "execution.cores=2", "compile.flash_attention=false"])
    assert RunSession.resume(rounding, run_dir).problems == [
        f"--resume: the config differs from the run in {run_dir} in compile.flash_attention (auto -> False), "
        "execution.cores (0 -> 2), execution.mode (single -> multi): the images made now may differ from those "
        "already made by rounding (about 1/255)"
    ]
    # What changes pixels more than by rounding is refused as before: the backend is one of those keys.
    with pytest.raises(InputError, match="in keys that change images: execution.backend, seed$"):
        RunSession.resume(load_config(path, ["execution.backend=cpu", "seed=8"]), run_dir)
    write_batch(session, plan_run(run).batches[1])
    assert {r["config_hash"] for r in read_manifest(run_dir / "manifest.jsonl")} == {made}


@pytest.mark.parametrize(
    "key,old,new,effect",
    [
        ("execution.chip", "v5e", "v4", "none"),
        ("output.dir", "/a", "/b", "none"),
        ("serve.max_queue", 64, 8, "none"),
        ("execution.sharding", "none", "spmd", "rounding"),
        ("compile.flash_attention", "auto", False, "rounding"),
        ("execution.backend", "xla", "cpu", "changes"),
        ("model.dtype", "float32", "bfloat16", "changes"),
        ("batch_size", 2, 4, "changes"),
        ("execution.pod.num_workers", None, 2, "changes"),
    ],
)
def test_which_keys_a_resume_refuses(key, old, new, effect):
    from tpugen.outputs.run_record import image_changing_differences, rounding_differences

    def config(value):
        section, _, name = key.rpartition(".")
        data: dict = {"model": {"id": "tiny-sd"}}
        inner = data
        for part in section.split(".") if section else []:
            inner = inner.setdefault(part, {})
        inner[name] = value
        return data

    refused, warned = (
        image_changing_differences(config(old), config(new)),
        rounding_differences(config(old), config(new)),
    )
    assert (refused, warned) == {
        "none": ([], []),
        "rounding": ([], [f"{key} ({old} -> {new})"]),
        "changes": ([key], []),
    }[effect]


def test_with_components_placed_by_chip_memory_a_chip_change_is_rounding():
    from tpugen.outputs.run_record import image_changing_differences, rounding_differences

    old = {"execution": {"placement": "auto", "chip": "v5e"}}
    new = {"execution": {"placement": "auto", "chip": "v5p"}}
    assert image_changing_differences(old, new) == []
    assert rounding_differences(old, new) == ["execution.chip (v5e -> v5p)"]


def test_a_resume_says_the_prompts_file_was_edited_and_its_edits_are_not_used(half_done):
    from tpugen.outputs.run_record import load_run

    path, run_dir = half_done
    prompts_file = path.parent / "p.txt"
    assert RunSession.resume(load_run(run_dir), run_dir).problems == []  # unchanged: nothing to say
    prompts_file.write_text("a lighthouse\na different second line\n")
    resumed = RunSession.resume(load_run(run_dir), run_dir)
    assert [spec.prompt for spec in resumed.run.prompts] == list(PROMPTS)  # the prompts it started with
    assert resumed.problems == [  # said nothing before
        f"prompts_file: {prompts_file} changed since the run started; its edits are not used: the run goes on "
        "with the 3 prompts it started with (kept in run.json)"
    ]
    prompts_file.unlink()
    assert RunSession.resume(load_run(run_dir), run_dir).problems == [
        f"prompts_file: {prompts_file} is gone since the run started: the run goes on with the 3 prompts it "
        "started with (kept in run.json)"
    ]
