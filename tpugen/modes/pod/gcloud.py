"""Calling gcloud and reading what it prints: the CLI, one step, every worker's ssh at once, a failure in one line."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess

from tpugen.errors import InputError, RunError
from tpugen.lines import text_lines


def count_workers(describe_output: str) -> int:
    """The worker count from `describe --format=json`: one network endpoint per worker."""
    try:
        endpoints = json.loads(describe_output).get("networkEndpoints") or []
    except (json.JSONDecodeError, AttributeError):
        raise RunError("gcloud describe did not print the TPU's JSON description") from None
    if not endpoints:
        raise RunError("gcloud describe lists no workers (networkEndpoints) for this TPU")
    return len(endpoints)


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


def _last_line(text: str) -> str:
    return (text_lines(text.strip()) or [""])[-1]
