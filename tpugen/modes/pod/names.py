"""The names pod-run uses and checks first: files on each worker, --remote-dir, the pod (--tpu, --zone, --project)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tpugen.errors import InputError

WORKER_LOG = "worker.log"
WORKER_STATUS = "worker.status"
WORKER_RUN = "run"  # the worker's own run directory, inside its pod-run folder
STAGING = ".pod-staging"
SHIPPED_IMAGES = "images"  # the prompts' input images, shipped in one folder beside the config
# Local model folders (ControlNets, model.annotators_dir's weights the prompts read), shipped beside the config.
SHIPPED_MODELS = "models"
# gcloud scp hands NAME:PATH to a shell on the worker, which no local quoting reaches: remote folders hold
# only characters that shell leaves alone.
REMOTE_DIR_RULE = (
    "use ASCII letters, digits, '.', '_', '-' and '/' (after an optional leading ~/), with no '..' part "
    "and no leading '-'"
)
_REMOTE_DIR = re.compile(r"[A-Za-z0-9._/-]+")


def remote_base(remote_dir: str) -> str:
    """--remote-dir as every ssh command and scp path gives it: both start in the worker's home directory,
    so a leading ~/ is dropped (quoted, or in an scp path, no shell would expand it)."""
    path = (remote_dir[2:].lstrip("/") or ".") if remote_dir.startswith("~/") or remote_dir == "~" else remote_dir
    if not _REMOTE_DIR.fullmatch(path) or path.startswith("-") or ".." in path.split("/"):
        raise InputError(f"--remote-dir: {remote_dir!r} is not allowed: {REMOTE_DIR_RULE}")
    return path


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

    def scp_folder_to_all(self, local: Path, remote: str) -> list[str]:
        """A whole folder, one call: `remote` (which must not exist) becomes its copy on every worker."""
        return self._gcloud("scp", "--recurse", str(local), f"{self.tpu}:{remote}", "--worker=all")

    def scp_from(self, worker: int, remote: str, local: Path) -> list[str]:
        return self._gcloud("scp", "--recurse", f"{self.tpu}:{remote}", str(local), f"--worker={worker}")

    def storage_cp(self, *paths: str, recursive: bool = False) -> list[str]:
        command = ["gcloud", "storage", "cp", *(["-r"] if recursive else []), *paths]
        return command + ([f"--project={self.project}"] if self.project else [])
