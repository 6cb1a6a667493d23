"""The part of a run's report that belongs to the way it was made: each mode's typed section, its report.json keys
and its own lines in report.md. The renderer asks the section; it never looks for a mode's keys itself."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar


def fmt(value, digits: int = 3) -> str:
    """A report figure as text: n/a where it was not measured."""
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


class ModeSection:
    """A single run's section, and what every mode's section answers: its title, what it adds to the status and
    header lines, where it ran, its own tables, and its report.json keys."""

    mode: ClassVar[str | None] = None  # report.json's "mode" (None: a single run, which writes no key)
    title: ClassVar[str] = "run"

    def as_json(self) -> dict:
        return {}

    @classmethod
    def from_json(cls, data: dict) -> ModeSection:
        return cls()

    def status_note(self, report) -> str:
        return ""

    def header_lines(self, report) -> list[str]:
        return []

    def where(self, report) -> str:
        """The backend line's parenthesis: how many took part, and which worker of a pod this was."""
        topology = report.topology or {}
        worker = (
            f"; worker {topology['worker_index']} of {topology['num_workers']}"
            if topology.get("num_workers", 1) > 1
            else ""
        )
        return f"world size {topology.get('world_size', 1)}{worker}"

    def body_lines(self, report) -> list[str]:
        return []


SINGLE = ModeSection()


@dataclass(frozen=True)
class RanksSection(ModeSection):
    """execution.mode: multi: one replica per chip; a row per rank, and how the ranks were launched."""

    mode: ClassVar[str] = "multi"

    launch_wall_seconds: float
    weights_loaded: str
    counters_scope: str
    ranks: list[dict]
    launcher: dict | None = None

    def as_json(self) -> dict:
        data = {
            "mode": self.mode,
            "launch_wall_seconds": self.launch_wall_seconds,
            "weights_loaded": self.weights_loaded,
            "counters_scope": self.counters_scope,
            "ranks": self.ranks,
        }
        return {**data, "launcher": self.launcher} if self.launcher else data

    @classmethod
    def from_json(cls, data: dict) -> RanksSection:
        return cls(
            launch_wall_seconds=data.get("launch_wall_seconds"),
            weights_loaded=data.get("weights_loaded", "n/a"),
            counters_scope=data.get("counters_scope", "n/a"),
            ranks=data.get("ranks", []),
            launcher=data.get("launcher"),
        )

    def body_lines(self, report) -> list[str]:
        lines = [
            "",
            f"## Ranks ({len(self.ranks)})",
            "",
            f"Weights loaded {self.weights_loaded}. Counters: {self.counters_scope}.",
            *_launcher_lines(self.launcher),
            "",
            "| rank | images | warmup s | warmup graphs | s per image | timed wall s | compiles after warmup | error |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in self.ranks:
            lines.append(
                f"| {r['rank']} | {r['images']} | {fmt(r['warmup_seconds'], 2)} | {r['warmup_compiles']} "
                f"| {fmt(r['per_image_seconds'])} | {fmt(r['timed_wall_seconds'], 2)} "
                f"| {fmt(r['compiles_after_warmup'])} | {r['error'] or ''} |"
            )
        return lines


def _launcher_lines(launcher: dict | None) -> list[str]:
    if not launcher:
        return []
    if launcher.get("tool") != "torchrun":
        return [f"Launched by {launcher.get('tool')} (devices: {launcher.get('devices')})."]
    env = " ".join(f"{k}={v}" for k, v in (launcher.get("environment") or {}).items())
    return [
        f"Launched by torchrun: {launcher['processes']} processes in a {launcher['process_group']} process group"
        + (f", with {env}" if env else "")
        + f": `{' '.join(launcher['command'])}`."
    ]


@dataclass(frozen=True)
class RaySection(ModeSection):
    """execution.mode: ray: the cluster's workers, their faults and restarts (report.json's `ray`)."""

    mode: ClassVar[str] = "ray"
    title: ClassVar[str] = "ray run"

    ray: dict

    def as_json(self) -> dict:
        return {"mode": self.mode, "ray": self.ray}

    @classmethod
    def from_json(cls, data: dict) -> RaySection:
        return cls(ray=data.get("ray") or {})

    def where(self, report) -> str:
        return f"{self.ray['workers']} Ray workers"

    def body_lines(self, report) -> list[str]:
        ray = self.ray
        resources = ", ".join(f"{k}: {v:g}" for k, v in sorted(ray["resources_per_worker"].items()))
        lost_workers = ", ".join(f"worker {i}" for i in ray["lost_workers"]) or "none"
        lines = [
            "",
            f"## Ray workers ({ray['workers']})",
            "",
            f"Address {ray['address']}; each worker asked for {{{resources}}}; max_restarts {ray['max_restarts']}; "
            f"{ray['in_flight_per_worker']} batches in flight per worker. Timed phase wall: {ray['timed_wall']}. "
            f"Lost workers: {lost_workers}; restarts: {ray['restarts']}; "
            f"retried batches: {', '.join(map(str, ray['retried_batches'])) or 'none'}.",
            "",
            "| worker | node | pids | state | batches | images | warmup s | s per image | restarts | batches lost "
            "| compiles after warmup | error |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for w in ray["per_worker"]:
            node = (w["node"] or "n/a")[:12]
            lost = ", ".join(map(str, sorted(w["lost_batches"])))
            lines.append(
                f"| {w['index']} | {node} | {', '.join(map(str, w['pids'])) or 'n/a'} | {w['state']} "
                f"| {w['batches_done']} | {w['images']} | {fmt(w['warmup_seconds'], 2)} "
                f"| {fmt(w['per_image_seconds'])} | {w['restarts']} | {lost} | {fmt(w['compiles_after_warmup'])} "
                f"| {w['error'] or ''} |"
            )
        faults = [_ray_event(e) for e in ray["events"] if e["event"] != "warm"]
        if faults:
            lines += ["", "Faults and restarts:", "", *faults]
        return lines


def _ray_event(event: dict) -> str:
    at, who = f"{event['seconds']:.1f} s", f"worker {event['worker']}"
    kind = event["event"]
    if kind == "lost":
        batches = event.get("batches") or []
        back = f"; batches {', '.join(map(str, batches))} went back to the queue" if batches else "; no batch in flight"
        return f"- {at}: {who} lost (pid {event.get('pid')}, {event.get('reason')}){back}"
    if kind == "restarted":
        return f"- {at}: {who} restarted by Ray (pid {event.get('pid')}), warming up again"
    if kind == "retried":
        return f"- {at}: batch {event['batch']} retried on {who}"
    if kind == "gone":
        return f"- {at}: {who} gone: {event.get('reason')}"
    if kind == "failed":
        where = f" batch {event['batch']}" if "batch" in event else " to start"
        return f"- {at}: {who} failed{where}: {event.get('error')}"
    if kind == "back":
        return f"- {at}: {who} answered again (pid {event.get('pid')}, never died)"
    return f"- {at}: {who} {kind}"


@dataclass(frozen=True)
class PodSection(ModeSection):
    """tpugen pod-run: the TPU, a row per worker, what could not be gathered, the pod's throughput."""

    mode: ClassVar[str] = "pod"
    title: ClassVar[str] = "pod run"

    tpu: str
    zone: str
    workers: int
    failed_workers: list[int]
    per_worker: list[dict]
    slowest_worker_wall_seconds: float | None
    pod_images_per_second: float | None  # every image over the slowest worker's timed phase
    gather_failed_workers: list[int] = field(default_factory=list)
    ssh_exit_status: int | None = None

    def as_json(self) -> dict:
        return {
            "mode": self.mode,
            "tpugen_pod_report": 1,
            "failed_workers": self.failed_workers,
            "tpu": self.tpu,
            "zone": self.zone,
            "workers": self.workers,
            "slowest_worker_wall_seconds": self.slowest_worker_wall_seconds,
            "pod_images_per_second": self.pod_images_per_second,
            "per_worker": self.per_worker,
            "ssh_exit_status": self.ssh_exit_status,
            "gather_failed_workers": self.gather_failed_workers,
        }

    @classmethod
    def from_json(cls, data: dict) -> PodSection:
        return cls(
            tpu=data.get("tpu", "n/a"),
            zone=data.get("zone", "n/a"),
            workers=data.get("workers", 0),
            failed_workers=data.get("failed_workers", []),
            per_worker=data.get("per_worker", []),
            slowest_worker_wall_seconds=data.get("slowest_worker_wall_seconds"),
            pod_images_per_second=data.get("pod_images_per_second"),
            gather_failed_workers=data.get("gather_failed_workers") or [],
            ssh_exit_status=data.get("ssh_exit_status"),
        )

    def status_note(self, report) -> str:
        return "" if report.complete else f" (failed workers: {self.failed_workers})"

    def header_lines(self, report) -> list[str]:
        failed = self.gather_failed_workers
        kept = [r["worker"] for r in self.per_worker if r["worker"] in failed and r["gathered"]]
        gathered = (
            [f"- gathering failed for workers {failed}" + (f"; earlier copies kept for workers {kept}" if kept else "")]
            if failed
            else []
        )
        return [
            f"- TPU: {self.tpu} in {self.zone}, {self.workers} workers",
            *gathered,
            f"- pod images per second: {fmt(self.pod_images_per_second, 2)} "
            f"(all images / the slowest worker's timed phase, {fmt(self.slowest_worker_wall_seconds, 2)} s)",
        ]

    def where(self, report) -> str:
        return f"world size {(report.topology or {}).get('world_size', 1)}"

    def body_lines(self, report) -> list[str]:
        lines = [
            "",
            f"## Workers ({len(self.per_worker)})",
            "",
            "| worker | exit | images | warmup s | timed wall s | images/s | compiles after warmup |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in self.per_worker:
            lines.append(
                f"| {r['worker']} | {fmt(r['exit_status'])} | {r['images']} | {fmt(r['warmup_seconds'], 2)} "
                f"| {fmt(r['timed_wall_seconds'], 2)} | {fmt(r['images_per_second'], 2)} "
                f"| {fmt(r['compiles_after_warmup'])} |"
            )
        for r in self.per_worker:
            if r["last_lines"]:
                lines += ["", f"Worker {r['worker']}, last lines:", "", *[f"    {line}" for line in r["last_lines"]]]
        return lines


# report.json's "mode" -> its section; a new mode's section is a class and a line here.
SECTIONS: dict[str, type[ModeSection]] = {section.mode: section for section in (RanksSection, RaySection, PodSection)}


def section_from_json(data: dict) -> ModeSection:
    """The section of a report read back from report.json (a pod report from before the "mode" key included)."""
    mode = data.get("mode") or ("pod" if "tpugen_pod_report" in data else None)
    section = SECTIONS.get(mode)
    return section.from_json(data) if section else SINGLE
