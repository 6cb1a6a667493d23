"""`tpugen pod-run`: the config shipped, each worker's share run, the folders gathered, merged, reported."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from tpugen.errors import InputError, RunError
from tpugen.modes.pod.gather import adopt_gathered, fold_in, folding_folder, gathering_folder
from tpugen.modes.pod.gcloud import _call, _call_all, _gcloud_path, _last_line, count_workers, step_failure
from tpugen.modes.pod.names import SHIPPED_IMAGES, SHIPPED_MODELS, STAGING, WORKER_RUN, Pod, remote_base
from tpugen.modes.pod.plan import plan_pod
from tpugen.modes.pod.report import merge_workers, pod_report
from tpugen.modes.pod.resume import _already_complete, check_pod_resumable, resume_run_id


def run_pod(
    run,
    pod: Pod,
    *,
    workers: int | None,
    remote_dir: str,
    gather: bool,
    dry_run: bool,
    tpugen: str,
    display,
    print_line=print,
    resume_id: str | None = None,
) -> dict | None:
    """`tpugen pod-run`: ship the resolved config, run every worker's share, gather, merge, report.

    With `resume_id`, the workers continue that run's folders, each keeping the images it finished."""
    from tpugen.config import dump_config
    from tpugen.config.controls import shipped_models
    from tpugen.config.embeddings import shipped_embeddings
    from tpugen.config.loras import shipped_loras
    from tpugen.files import atomic_write_text
    from tpugen.outputs.manifest import rewrite_manifest
    from tpugen.outputs.report import write_report
    from tpugen.outputs.run_dir import make_run_dir, run_id_for
    from tpugen.outputs.run_record import read_run_record, write_run_record

    if dry_run and workers is None:
        raise InputError("--dry-run needs --workers N (without it the count comes from running gcloud describe)")
    remote_dir = remote_base(remote_dir)
    output_dir = run.config.output.dir
    run_id = run_id_for(run) if resume_id is None else resume_run_id(resume_id, output_dir)
    bucket = output_dir if output_dir.startswith("gs://") else None
    if resume_id is not None and not bucket:
        check_pod_resumable(run, Path(output_dir) / run_id)
    if not dry_run:
        _gcloud_path()
        if workers is None:
            described = _call(pod.describe(), display)
            if described.returncode:
                raise RunError(f"gcloud describe failed: {_last_line(described.stderr)}")
            workers = count_workers(described.stdout)

    # With a bucket, the workers' folders are downloaded to a scratch folder to merge the pod report; a dry
    # run shows the folder tempfile.mkdtemp would name, and makes none.
    scratch = None
    if bucket and dry_run:
        scratch = Path(tempfile.gettempdir(), "tpugen-pod-RANDOM")
    elif bucket:
        scratch = Path(tempfile.mkdtemp(prefix="tpugen-pod-"))
    local_run = (scratch or Path(output_dir)) / run_id

    # The shipped config: prompts inside it or in the file shipped beside it, never on a command line.
    config = run.config.model_copy(deep=True)
    staging = local_run / STAGING
    staged = [staging / "config.yaml"]
    if config.prompts_file:
        prompts = Path(config.prompts_file)
        staged.append(staging / f"prompts{prompts.suffix}")
        config.prompts_file = staged[-1].name
    config.output.dir, config.output.run_id = ".", WORKER_RUN
    config.cache.dir = None  # a local path means nothing on the workers
    # Each local LoRA file goes beside the shipped config, which names it by its file name (its sha256 pin stays).
    lora_files = shipped_loras(config, run.loras)
    lora_files += shipped_embeddings(config, run.embeddings, {path.name for path in lora_files})  # named so too
    prompt_lines, image_files = _ship_prompt_images(config, run)
    images_folder = staging / SHIPPED_IMAGES if image_files else None
    models = shipped_models(config, run.prompts, SHIPPED_MODELS)
    plan = plan_pod(
        pod,
        workers=workers,
        remote_dir=remote_dir,
        run_id=run_id,
        local_run=local_run,
        staged=[*staged, *lora_files],
        images=images_folder,
        models=models,
        tpugen=tpugen,
        gather=gather,
        bucket=bucket,
    )
    if dry_run:
        for line in plan.lines():
            print_line(line)
        return None

    if resume_id is not None and not bucket:
        done = _already_complete(run, local_run)
        if done is not None:
            return done

    keep_scratch = staging_made = False
    try:
        if bucket or resume_id:
            local_run.mkdir(parents=True, exist_ok=True)
            if not bucket and read_run_record(local_run) is None:  # a pod run from before run.json, checked
                write_run_record(local_run, run, run_id)
        else:
            make_run_dir(run.config.output.dir, run_id)
            write_run_record(local_run, run, run_id)  # what a later --resume is checked against
        staging_made = True  # past make_run_dir, which refuses a run directory in use without touching it
        staging.mkdir(exist_ok=True)
        atomic_write_text(staged[0], dump_config(config))
        if len(staged) > 1 and prompt_lines is not None:
            atomic_write_text(staged[1], prompt_lines)
        elif len(staged) > 1:
            shutil.copyfile(run.config.prompts_file, staged[1])
        if images_folder is not None:
            shutil.rmtree(images_folder, ignore_errors=True)  # a folder left by an interrupted try
            images_folder.mkdir()
            for name, source in image_files.items():
                _copy_image(source, images_folder / name)
        for command in plan.prepare:
            done = _call(command, display)
            if done.returncode:
                raise RunError(step_failure(command, done))
        display.phase(f"running on {workers} workers")
        ssh_status = max(_call_all(plan.run, display))
        gather_errors = {}  # worker -> why its folder could not be copied this time
        for i, command in enumerate(plan.gather):
            fresh = local_run / f"worker-{i}" if bucket else gathering_folder(local_run, i)
            if not bucket and folding_folder(local_run, i).exists():  # a fold a crash cut short: finish it
                fold_in(folding_folder(local_run, i), local_run / f"worker-{i}")
            shutil.rmtree(fresh, ignore_errors=True)  # a copy left by an interrupted gather
            done = _call(command, display)
            if done.returncode or not fresh.is_dir():
                gather_errors[i] = _last_line(done.stderr) or "nothing was copied"
                shutil.rmtree(fresh, ignore_errors=True)  # maybe partial; any earlier copy stays as it was
            elif not bucket:
                adopt_gathered(fresh, local_run / f"worker-{i}")

        if not gather:
            return {"run_id": run_id, "workers": workers, "gathered": False, "ssh_exit_status": ssh_status}
        records, rows, reports = merge_workers(local_run, workers)
        report = pod_report(
            run=run,
            run_id=run_id,
            run_dir=local_run,
            pod=pod,
            records=records,
            rows=rows,
            reports=reports,
            ssh_exit_status=ssh_status,
            gather_failed_workers=sorted(gather_errors),
        )
        rewrite_manifest(local_run, {r["index"]: r for r in records})
        write_report(local_run, report)
        if bucket:
            destination = f"{bucket.rstrip('/')}/{run_id}"
            (upload,) = plan.finish
            uploaded = _call(upload, display)
            if uploaded.returncode:
                keep_scratch = True  # the only copy of the pod report
                raise RunError(f"uploading the pod report to {destination} failed; it is in {local_run}")
            report = report.but(run_dir=destination)
    finally:
        if staging_made:
            shutil.rmtree(staging, ignore_errors=True)
        if scratch and not keep_scratch:
            shutil.rmtree(scratch, ignore_errors=True)

    failed = [r for r in rows if not r["complete"]]
    kept = [i for i in sorted(gather_errors) if rows[i]["gathered"]]
    if failed or kept or ssh_status:
        lines = []
        for r in failed:
            why = f"exit status {r['exit_status']}"
            if not r["gathered"]:
                why = f"not gathered: {gather_errors[r['worker']]}" if r["worker"] in gather_errors else "not gathered"
            tail = " | ".join(r["last_lines"][-3:])
            lines.append(f"worker {r['worker']} failed ({why}){': ' + tail if tail else ''}")
        for i in kept:
            folder = local_run / f"worker-{i}"
            lines.append(f"worker {i}: gathering failed ({gather_errors[i]}); its earlier copy is kept in {folder}")
        if ssh_status and not failed:
            lines.append(f"gcloud ssh exited with status {ssh_status}")
        where = report["run_dir"]
        raise RunError(*lines, f"{len(records)} images from the other workers and the pod report are in {where}")
    return report


def _ship_prompt_images(config, run) -> tuple[str | None, dict[str, Path]]:
    """Each prompt's input images (init, mask, references, control images) renamed by content in `config` (the
    shipped copy, edited here), in SHIPPED_IMAGES beside it: (the .jsonl prompts file's text rewritten so, or None
    where it is shipped as it is; the images' names with their local files)."""
    from tpugen.config.images import shipped_images
    from tpugen.config.prompts import read_prompt_file

    base_dir = Path(run.base_dir or ".")
    known = {path: sha256 for prompt in run.prompts for _, path, sha256 in prompt.files()}
    if config.prompts is not None:
        config.prompts, files = shipped_images(config.prompts, base_dir, known, SHIPPED_IMAGES)
        return None, files
    if not (run.config.prompts_file and Path(run.config.prompts_file).suffix == ".jsonl"):
        return None, {}  # a .txt file names no image
    entries = [
        {k: v for k, v in entry.items() if k != "_line"}
        for entry in read_prompt_file(Path(run.config.prompts_file), [])  # checked when the config was loaded
    ]
    entries, files = shipped_images(entries, base_dir, known, SHIPPED_IMAGES)
    lines = "".join(json.dumps(entry, ensure_ascii=False) + "\n" for entry in entries) if files else None
    return lines, files


def _copy_image(source: Path, target: Path) -> None:
    """A prompt's input image copied to be shipped, checked against the sha256 its name holds (the one the
    config's check read): an image changed or gone since then is one line, not another image on the workers."""
    from tpugen.config.images import sha256_of

    try:
        shutil.copyfile(source, target)
    except OSError as exc:
        raise InputError(f"cannot read {str(source)!r} to ship it to the workers: {exc.strerror}") from None
    sha256 = sha256_of(str(target))
    if sha256 is None or not target.name.startswith(f"image-{sha256[:16]}"):
        raise InputError(f"{str(source)!r} changed since the config was checked; run pod-run again")
