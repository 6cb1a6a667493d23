"""Every gcloud step of a pod run, planned (pure): the command each worker runs; prepare, run, gather, finish."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from tpugen.modes.pod.gather import gathering_folder
from tpugen.modes.pod.names import SHIPPED_IMAGES, SHIPPED_MODELS, WORKER_LOG, WORKER_RUN, WORKER_STATUS, Pod


def _command_word(path: str) -> str:
    """A shell-quoted command; a leading ~/ stays the worker's home ("$HOME"/...), which quoting would hide."""
    return '"$HOME"/' + shlex.quote(path[2:]) if path.startswith("~/") else shlex.quote(path)


def worker_command(
    remote_run: str,
    worker: int,
    num_workers: int,
    tpugen: str = "tpugen",
    upload: str | None = None,
    images: bool = False,
    models: bool = False,
) -> str:
    """What worker `worker` runs: its share of the run, its output kept in worker.log, its exit status in
    worker.status (so a failed worker is named after gathering), and the log's last lines echoed.
    With `upload` (gs://bucket/prefix/RUN_ID), the worker then copies its folder to upload/worker-WORKER/.
    With `images` (the prompts' input images shipped in SHIPPED_IMAGES) and `models` (local model folders in
    SHIPPED_MODELS), those folders are removed once the run ends, so that no gathering or upload copies every
    input back from every worker (a resume ships them again).

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
    shipped = [name for name, sent in ((SHIPPED_IMAGES, images), (SHIPPED_MODELS, models)) if sent]
    after_run = f"rm -rf {' '.join(shipped)}; " if shipped else ""
    if upload:
        after_run += f"gcloud storage cp -r ./* {q(f'{upload}/worker-{worker}/')} > upload.log 2>&1 || status=1; "
    return (
        f"cd {q(remote_run)} && {{ {generate} > {WORKER_LOG} 2>&1; status=$?; echo $status > {WORKER_STATUS}; "
        f"{after_run}tail -n 5 {WORKER_LOG}; exit $status; }}"
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
    images: Path | None = None,
    models: list[tuple[Path, str]] | None = None,
) -> PodPlan:
    """`remote_dir` as remote_base gives it. With `bucket` (output.dir: gs://...), workers upload there and
    gathering downloads from there into `local_run`, a scratch folder. With `images`, the local folder of the
    prompts' input images, shipped whole in one copy (one left by an earlier try is removed first). With `models`,
    local model folders and files (tpugen.config.controls.shipped_models: (local path, path beside the config)),
    each copied once into SHIPPED_MODELS, made anew."""
    remote_run = f"{remote_dir.rstrip('/')}/{run_id}"
    q = shlex.quote
    make = f"mkdir -p {q(remote_run)}" + (f" && rm -rf {q(f'{remote_run}/{SHIPPED_IMAGES}')}" if images else "")
    if models:
        parents = sorted({f"{remote_run}/{Path(target).parent}" for _, target in models})
        make += f" && rm -rf {q(f'{remote_run}/{SHIPPED_MODELS}')} && mkdir -p {' '.join(q(p) for p in parents)}"
    prepare = [pod.ssh_all(make)]
    prepare += [pod.scp_to_all(path, f"{remote_run}/{path.name}") for path in staged]
    if images:
        prepare.append(pod.scp_folder_to_all(images, f"{remote_run}/{SHIPPED_IMAGES}"))
    for source, target in models or []:
        copy = pod.scp_folder_to_all if source.is_dir() else pod.scp_to_all
        prepare.append(copy(source, f"{remote_run}/{target}"))
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
    runs = [
        pod.ssh(
            i, worker_command(remote_run, i, workers, tpugen, upload, images=images is not None, models=bool(models))
        )
        for i in range(workers)
    ]
    return PodPlan(prepare, runs, gathers, finish)
