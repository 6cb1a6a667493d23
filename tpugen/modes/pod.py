"""Whole TPU pods: the gcloud commands that ship, run and gather a run on every worker, and the pod report."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tpugen.errors import InputError, RunError
from tpugen.lines import text_lines

WORKER_LOG = "worker.log"
WORKER_STATUS = "worker.status"
WORKER_RUN = "run"  # the worker's own run directory, inside its pod-run folder
STAGING = ".pod-staging"
# gcloud scp hands NAME:PATH to a shell on the worker, which no local quoting reaches: remote folders hold
# only characters that shell leaves alone.
REMOTE_DIR_RULE = (
    "use ASCII letters, digits, '.', '_', '-' and '/' (after an optional leading ~/), with no '..' part "
    "and no leading '-'"
)
_REMOTE_DIR = re.compile(r"[A-Za-z0-9._/-]+")


# ---------------------------------------------------------------- what the options name (checked first)


def remote_base(remote_dir: str) -> str:
    """--remote-dir as every ssh command and scp path gives it: both start in the worker's home directory,
    so a leading ~/ is dropped (quoted, or in an scp path, no shell would expand it)."""
    path = (remote_dir[2:].lstrip("/") or ".") if remote_dir.startswith("~/") or remote_dir == "~" else remote_dir
    if not _REMOTE_DIR.fullmatch(path) or path.startswith("-") or ".." in path.split("/"):
        raise InputError(f"--remote-dir: {remote_dir!r} is not allowed: {REMOTE_DIR_RULE}")
    return path


def is_pod_run(folder: Path) -> bool:
    """Whether pod-run made this folder: it holds worker-N copies, a pod report or the staging folder."""
    if not folder.is_dir():
        return False
    names = {path.name for path in folder.iterdir()}
    if STAGING in names or any(re.fullmatch(r"worker-\d+", name) for name in names):
        return True
    try:
        return "tpugen_pod_report" in json.loads((folder / "report.json").read_text())
    except (OSError, ValueError, TypeError):
        return False


def resume_run_id(value: str, output_dir: str) -> str:
    """--resume's RUN_ID, checked like output.run_id since it names a folder here and on every worker; the
    path of a pod run directly under output.dir also names it. Anything else is refused before gcloud runs."""
    from tpugen.config.schema import RUN_ID_RULE, is_safe_run_id

    local = not output_dir.startswith("gs://")
    if is_safe_run_id(value):
        run_id = value
    elif local and Path(value).is_dir():
        folder = Path(value).resolve()
        if folder.parent != Path(output_dir).resolve() or not is_safe_run_id(folder.name) or not is_pod_run(folder):
            raise InputError(
                f"--resume: {value} is not a pod run directly under output.dir ({output_dir}); give its RUN_ID"
            )
        run_id = folder.name
    else:
        raise InputError(f"--resume: {value!r} is not a run id: {RUN_ID_RULE}")
    existing = Path(output_dir) / run_id
    empty = existing.is_dir() and not any(existing.iterdir())
    # pod-run writes worker-N folders, a manifest and a report into it: never into another kind of run.
    if local and existing.exists() and not empty and not is_pod_run(existing):
        raise InputError(f"--resume: {existing} is not a pod run directory (no pod report.json or worker-N folders)")
    return run_id


# ---------------------------------------------------------------- the commands (pure)


# Google Cloud's own name rules: checked here, since a value that starts with "-" would reach gcloud as a flag
# and a ":" in a TPU name would move where scp splits NAME:PATH.
_TPU_NAME = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")
_ZONE = re.compile(r"[a-z]+-[a-z]+[0-9]+-[a-z]")
_PROJECT = re.compile(r"([a-z][-a-z0-9.]*[a-z0-9]:)?[a-z][-a-z0-9]{4,28}[a-z0-9]")


@dataclass(frozen=True)
class Pod:
    tpu: str
    zone: str
    project: str | None = None

    def __post_init__(self) -> None:
        problems = []
        if not _TPU_NAME.fullmatch(self.tpu):
            problems.append(f"--tpu: {self.tpu!r} is not a TPU name (lowercase letters, digits and '-', 1 to 63)")
        if not _ZONE.fullmatch(self.zone):
            problems.append(f"--zone: {self.zone!r} is not a zone (like us-east5-b)")
        if self.project is not None and not _PROJECT.fullmatch(self.project):
            problems.append(f"--project: {self.project!r} is not a project id (6 to 30 lowercase letters, digits, '-')")
        if problems:
            raise InputError(*problems)

    def _gcloud(self, verb: str, *args: str) -> list[str]:
        command = ["gcloud", "compute", "tpus", "tpu-vm", verb, *args, f"--zone={self.zone}"]
        if self.project:
            command.append(f"--project={self.project}")
        return command

    def describe(self) -> list[str]:
        return self._gcloud("describe", self.tpu, "--format=json")

    def ssh_all(self, command: str) -> list[str]:
        return self._gcloud("ssh", self.tpu, "--worker=all", f"--command={command}")

    def ssh(self, worker: int, command: str) -> list[str]:
        return self._gcloud("ssh", self.tpu, f"--worker={worker}", f"--command={command}")

    def scp_to_all(self, local: Path, remote: str) -> list[str]:
        return self._gcloud("scp", str(local), f"{self.tpu}:{remote}", "--worker=all")

    def scp_from(self, worker: int, remote: str, local: Path) -> list[str]:
        return self._gcloud("scp", "--recurse", f"{self.tpu}:{remote}", str(local), f"--worker={worker}")

    def storage_cp(self, *paths: str, recursive: bool = False) -> list[str]:
        command = ["gcloud", "storage", "cp", *(["-r"] if recursive else []), *paths]
        return command + ([f"--project={self.project}"] if self.project else [])


def count_workers(describe_output: str) -> int:
    """The worker count from `describe --format=json`: one network endpoint per worker."""
    try:
        endpoints = json.loads(describe_output).get("networkEndpoints") or []
    except (json.JSONDecodeError, AttributeError):
        raise RunError("gcloud describe did not print the TPU's JSON description") from None
    if not endpoints:
        raise RunError("gcloud describe lists no workers (networkEndpoints) for this TPU")
    return len(endpoints)


def _command_word(path: str) -> str:
    """A shell-quoted command; a leading ~/ stays the worker's home ("$HOME"/...), which quoting would hide."""
    return '"$HOME"/' + shlex.quote(path[2:]) if path.startswith("~/") else shlex.quote(path)


def worker_command(
    remote_run: str, worker: int, num_workers: int, tpugen: str = "tpugen", upload: str | None = None
) -> str:
    """What worker `worker` runs: its share of the run, its output kept in worker.log, its exit status in
    worker.status (so a failed worker is named after gathering), and the log's last lines echoed.
    With `upload` (gs://bucket/prefix/RUN_ID), the worker then copies its folder to upload/worker-WORKER/.

    pod-run gives every worker its index here, the one it gathers that worker's folder by: a worker never
    guesses it (a TPU VM's ssh session has no TPU_WORKER_ID), so a worker that fails before its report still
    uploads into its own folder. Prompts stay in the shipped config, and every argument is shell-quoted.
    """
    if not 0 <= worker < num_workers:
        raise ValueError(f"worker {worker} is not one of {num_workers} workers")
    q = shlex.quote
    generate = " ".join(
        [
            _command_word(tpugen),
            "generate",
            "config.yaml",
            "--quiet",
            q(f"execution.pod.worker_index={worker}"),
            q(f"execution.pod.num_workers={num_workers}"),
            q("output.dir=."),
            q(f"output.run_id={WORKER_RUN}"),
            # A worker that already has its run folder (pod-run --resume) continues it.
            f"$([ -f {WORKER_RUN}/config.yaml ] && echo --resume {WORKER_RUN})",
        ]
    )
    upload_step = ""
    if upload:
        upload_step = f"gcloud storage cp -r ./* {q(f'{upload}/worker-{worker}/')} > upload.log 2>&1 || status=1; "
    return (
        f"cd {q(remote_run)} && {{ {generate} > {WORKER_LOG} 2>&1; status=$?; echo $status > {WORKER_STATUS}; "
        f"{upload_step}tail -n 5 {WORKER_LOG}; exit $status; }}"
    )


POD_REPORT_FILES = ("report.json", "report.md", "manifest.jsonl")


@dataclass(frozen=True)
class PodPlan:
    """Every gcloud command of a pod run, in order, for --dry-run and for the runner."""

    prepare: list[list[str]]
    run: list[list[str]]  # one ssh per worker, all at once: each is told its own index
    gather: list[list[str]]
    finish: list[list[str]]  # with a bucket: the pod report, merged here, goes up beside the workers' folders

    def lines(self) -> list[str]:
        return [shlex.join(c) for c in [*self.prepare, *self.run, *self.gather, *self.finish]]


def gathering_folder(local_run: Path, worker: int) -> Path:
    """Where worker i's folder is copied before it joins OUTPUT_DIR/RUN_ID/worker-i: a failed copy never
    costs the earlier one."""
    return local_run / f".worker-{worker}.gathering"


def plan_pod(
    pod: Pod,
    *,
    workers: int,
    remote_dir: str,
    run_id: str,
    local_run: Path,
    staged: list[Path],
    tpugen: str = "tpugen",
    gather: bool = True,
    bucket: str | None = None,
) -> PodPlan:
    """`remote_dir` as remote_base gives it. With `bucket` (output.dir: gs://...), workers upload there and
    gathering downloads from there into `local_run`, a scratch folder."""
    remote_run = f"{remote_dir.rstrip('/')}/{run_id}"
    prepare = [pod.ssh_all(f"mkdir -p {shlex.quote(remote_run)}")]
    prepare += [pod.scp_to_all(path, f"{remote_run}/{path.name}") for path in staged]
    upload = f"{bucket.rstrip('/')}/{run_id}" if bucket else None
    if not gather:
        gathers = []
    elif upload:
        gathers = [pod.storage_cp(f"{upload}/worker-{i}", f"{local_run}/", recursive=True) for i in range(workers)]
    else:
        gathers = [pod.scp_from(i, remote_run, gathering_folder(local_run, i)) for i in range(workers)]
    finish = []
    if upload and gather:
        finish = [pod.storage_cp(*(f"{local_run}/{name}" for name in POD_REPORT_FILES), f"{upload}/")]
    runs = [pod.ssh(i, worker_command(remote_run, i, workers, tpugen, upload)) for i in range(workers)]
    return PodPlan(prepare, runs, gathers, finish)


# ---------------------------------------------------------------- merging (pure over files)


def _tail(path: Path, lines: int = 5) -> list[str]:
    if not path.exists():
        return []
    return [line for line in text_lines(path.read_text(errors="replace")) if line.strip()][-lines:]


def folding_folder(local_run: Path, worker: int) -> Path:
    """A whole gathered copy of worker i while it is folded into worker-i: one left behind (a crash mid-fold)
    is folded in before that worker is gathered again; a `.gathering` one may be a torn copy and is dropped."""
    return local_run / f".worker-{worker}.folding"


def adopt_gathered(fresh: Path, folder: Path) -> None:
    """Fold a worker's newly gathered copy into its folder: files only the earlier copy holds stay (a worker
    recreated with a fresh disk has lost the images it made before), every file both hold comes from the
    new copy, and the manifests are joined by image index with the new copy's records winning."""
    if not folder.exists():
        fresh.rename(folder)
        return
    folding = fresh.with_suffix(".folding")  # .worker-i.gathering -> .worker-i.folding: known to be whole
    fresh.rename(folding)
    fold_in(folding, folder)


def fold_in(folding: Path, folder: Path) -> None:
    """Move each file of `folding` into `folder` in whole, then write the joined manifest, then drop
    `folding`: done again after a crash part way, it finishes the same fold, and no image ends up unlisted."""
    from tpugen.outputs.manifest import read_manifest, rewrite_manifest

    manifest = Path(WORKER_RUN, "manifest.jsonl")
    for source in sorted(folding.rglob("*")):
        relative = source.relative_to(folding)
        if source.is_dir() or relative == manifest:
            continue
        target = folder / relative
        if target.is_dir():
            shutil.rmtree(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(source, target)
    if (folding / manifest).exists():
        records = {r["index"]: r for r in read_manifest(folder / manifest)} if (folder / manifest).exists() else {}
        records.update({r["index"]: r for r in read_manifest(folding / manifest)})
        rewrite_manifest(folder / WORKER_RUN, records)
    shutil.rmtree(folding)


def merge_workers(local_run: Path, workers: int) -> tuple[list[dict], list[dict], list[dict]]:
    """(pod manifest records, per-worker rows, the workers' own reports) from the gathered worker-i folders."""
    from tpugen.outputs.manifest import read_manifest

    records, rows, reports = [], [], []
    for i in range(workers):
        folder = local_run / f"worker-{i}"
        status_text = (folder / WORKER_STATUS).read_text().strip() if (folder / WORKER_STATUS).exists() else ""
        status = int(status_text) if status_text.lstrip("-").isdigit() else None
        report_path = folder / WORKER_RUN / "report.json"
        report = json.loads(report_path.read_text()) if report_path.exists() else None
        if report and "timed_phase" in report:
            reports.append({**report, "worker": i})
        manifest = folder / WORKER_RUN / "manifest.jsonl"
        mine = read_manifest(manifest) if manifest.exists() else []
        for record in mine:
            records.append({**record, "file": f"worker-{i}/{WORKER_RUN}/{record['file']}", "worker": i})
        timed = (report or {}).get("timed_phase") or {}
        rows.append(
            {
                "worker": i,
                "gathered": folder.exists(),
                "exit_status": status,
                "complete": bool(report and report.get("complete")) and status == 0,
                "images": len(mine),
                "warmup_seconds": (report or {}).get("warmup_seconds"),
                "timed_wall_seconds": timed.get("wall_seconds"),
                "images_per_second": timed.get("images_per_second"),
                "compiles_after_warmup": (report or {}).get("compiles_after_warmup"),
                "last_lines": _tail(folder / WORKER_LOG) if status != 0 else [],
            }
        )
    return sorted(records, key=lambda r: r["index"]), rows, reports


def pod_report(
    *,
    run,
    run_id: str,
    run_dir,
    pod: Pod,
    records: list[dict],
    rows: list[dict],
    reports: list[dict],
    ssh_exit_status: int | None = None,
    gather_failed_workers: list[int] = (),
):
    """The pod's report, built like every run's (tpugen.outputs.report) from its workers' reports: throughput
    is all images over the slowest worker's timed phase; a table per worker."""
    from tpugen.backends import Counters, versions
    from tpugen.outputs.report import build_report, merge_phases, persistent_cache_summary
    from tpugen.outputs.sections import PodSection
    from tpugen.plan import plan_run

    plan = plan_run(run)
    for report in reports:
        report["written"] = [r["file"] for r in records if r["worker"] == report["worker"]]
    phase = merge_phases(reports, "worker")
    counted = [(r.get("xla_counters") or {}).get("timed_phase") for r in reports]
    if counted and all(counted):
        phase.counters = sum((Counters(**c) for c in counted[1:]), Counters(**counted[0])).as_dict()
    warmup = [{**w, "worker": r["worker"]} for r in reports for w in r["warmup"]]
    first = reports[0] if reports else {}
    failed = [r["worker"] for r in rows if not r["complete"]]
    complete = not failed and len(records) == len(plan.items)
    topology = dict(first.get("topology") or {"rank": 0, "ranks_per_worker": 1})
    ranks = topology.get("ranks_per_worker", 1)
    topology.update(worker_index=0, num_workers=len(rows), world_size=len(rows) * ranks)
    report = build_report(
        run=run,
        run_id=run_id,
        run_dir=run_dir,
        images_planned=len(plan.items),
        batches_planned=sum(r["batches"] for r in reports),
        padding_rows=sum(r["padding_rows"] for r in reports),
        shape_keys=list(dict.fromkeys(k for r in reports for k in r["shape_keys"])),
        device=first.get("device", {"backend": run.config.execution.backend, "device_kind": "unknown"}),
        versions=first.get("versions") or versions(),
        scheduler=(first.get("model") or {}).get("scheduler", "unknown"),
        load_seconds=max((r["model_load_seconds"] or 0.0 for r in reports), default=None),
        warmup=warmup,
        persistent_cache=persistent_cache_summary(
            first.get("persistent_cache") or {"enabled": False, "note": "no worker reported"}, warmup
        ),
        phase=phase,
        topology=topology,
        images_reused=sum(r.get("images_reused", 0) for r in reports),
        error=None if complete else f"failed workers: {failed}" if failed else "images are missing",
        memory=first.get("memory"),
        counters_scope="each worker's own process, summed over the workers",
    )
    slowest = phase.wall_seconds or None
    return report.but(
        images=len(records),
        section=PodSection(
            tpu=pod.tpu,
            zone=pod.zone,
            workers=len(rows),
            failed_workers=failed,
            per_worker=rows,
            slowest_worker_wall_seconds=slowest,
            pod_images_per_second=len(records) / slowest if slowest else None,
            gather_failed_workers=list(gather_failed_workers),
            ssh_exit_status=ssh_exit_status,
        ),
    )


_FAILED_ON_WORKER = re.compile(r"Command execution on worker (\d+) failed")
_GCLOUD_STATUS = re.compile(r"^(SSH|SCP): Attempting to connect to worker \d+\.\.\.$|^#####")


def step_failure(command: list[str], done: subprocess.CompletedProcess) -> str:
    """One line for a gcloud step that failed: the workers gcloud names as failed (with --worker=all it goes on
    to the others and says which failed), and the last lines it printed on either stream."""
    workers = sorted({int(w) for w in _FAILED_ON_WORKER.findall(done.stderr or "")})
    printed = [
        line.strip()
        for line in text_lines((done.stdout or "") + "\n" + (done.stderr or ""))
        if line.strip() and not _GCLOUD_STATUS.match(line.strip())
    ]
    who = f" on worker{'s' if len(workers) > 1 else ''} {', '.join(map(str, workers))}" if workers else ""
    said = " | ".join(printed[-3:]) or f"exit status {done.returncode}"
    return f"{shlex.join(command[:6])} failed{who}: {said}"


# ---------------------------------------------------------------- doing it (thin)


def _gcloud_path() -> str:
    path = shutil.which("gcloud")
    if not path:
        raise InputError("gcloud not found: install the Google Cloud CLI (https://cloud.google.com/sdk) and log in")
    return path


def _call(command: list[str], display, capture: bool = True) -> subprocess.CompletedProcess:
    display.phase("$ " + shlex.join(command))
    return subprocess.run(command, capture_output=capture, text=True)


def _call_all(commands: list[list[str]], display) -> list[int]:
    """Run the workers' ssh commands at once (as gcloud's --worker=all does) and wait for every one; their exit
    statuses, in order. Their output is not needed (each worker keeps its log); none is left running."""
    procs: list[subprocess.Popen] = []
    try:
        for command in commands:
            display.phase("$ " + shlex.join(command))
            procs.append(
                subprocess.Popen(
                    command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
            )
        return [proc.wait() for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:  # pod-run was interrupted: its ssh sessions go with it
                proc.terminate()
                proc.wait()


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
    from tpugen.config.loras import shipped_loras
    from tpugen.engine.session import make_run_dir, read_run_record, run_id_for, write_run_record
    from tpugen.outputs.files import atomic_write_text
    from tpugen.outputs.manifest import rewrite_manifest
    from tpugen.outputs.report import write_report

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
    plan = plan_pod(
        pod,
        workers=workers,
        remote_dir=remote_dir,
        run_id=run_id,
        local_run=local_run,
        staged=[*staged, *lora_files],
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
        if len(staged) > 1:
            shutil.copyfile(run.config.prompts_file, staged[1])
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


def check_pod_resumable(run, local_run: Path) -> None:
    """Refuse, before any gcloud call, a --resume whose config would make other images than the pod run's: a
    worker with its run folder refuses it itself, but one that lost its disk would start afresh with it."""
    from tpugen.engine.session import differences, read_run_record
    from tpugen.outputs.report import read_report

    if not local_run.is_dir():
        return
    record = read_run_record(local_run)
    if record is not None:
        differing = differences(run, record["config"], record["prompts"])
        if differing:
            raise InputError(
                f"--resume: the config differs from the pod run in {local_run} in keys that change images: "
                + ", ".join(differing)
            )
        return
    made_by = (read_report(local_run) or {}).get("config_hash")  # a pod run from before run.json
    if made_by and made_by != run.config_hash:
        raise InputError(
            f"--resume: the pod run in {local_run} was made by config hash {made_by}, and this config resolves to "
            f"{run.config_hash} (was the config or the prompts file edited?)"
        )


def _gathered_image(local_run: Path, name) -> bool:
    """Whether a pod manifest's file (worker-i/run/NAME) is inside the pod run and a whole PNG."""
    from tpugen.outputs.png import is_valid_png

    path = (local_run / str(name)).resolve()
    return path.is_relative_to(local_run.resolve()) and is_valid_png(path)


def _already_complete(run, local_run: Path) -> dict | None:
    """A pod run whose gathered report is complete and whose manifest holds every planned image: nothing to
    resume, so no worker is called and nothing is rewritten."""
    from tpugen.outputs.manifest import read_manifest
    from tpugen.outputs.report import RunReport, read_report
    from tpugen.plan import plan_run

    report = read_report(local_run)
    manifest = local_run / "manifest.jsonl"
    if not report or not report.get("complete") or not manifest.exists():
        return None
    planned = len(plan_run(run).items)
    on_disk = {r["index"] for r in read_manifest(manifest) if _gathered_image(local_run, r.get("file"))}
    if len(on_disk) < planned:
        return None
    return RunReport.from_json(report).but(run_dir=str(local_run), already_complete=True, images_planned=planned)


def _last_line(text: str) -> str:
    return (text_lines(text.strip()) or [""])[-1]
