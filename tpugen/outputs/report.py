"""The report a run leaves: report.json built in one place, report.md rendered from it in one place (a
single run, a run over all chips of a VM, and a pod run alike)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from datetime import datetime, timezone
from functools import cached_property
from pathlib import Path

from tpugen.config.schema import step_cache_options_text
from tpugen.files import atomic_write_text, write_json
from tpugen.outputs.sections import SINGLE, ModeSection, fmt, section_from_json


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100), as numpy's default computes it."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def latency_summary(per_image: list[float]) -> dict:
    if not per_image:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    return {
        "mean": sum(per_image) / len(per_image),
        "p50": percentile(per_image, 50),
        "p90": percentile(per_image, 90),
        "p99": percentile(per_image, 99),
    }


def session_summary(report: dict) -> dict:
    """One session's own figures from the report it left (a resumed run has one session per start)."""
    timed = report.get("timed_phase") or {}
    return {
        "finished_utc": report.get("finished_utc"),
        "complete": report.get("complete"),
        "error": report.get("error"),
        "images": report.get("images_this_session", report.get("images")),
        "device": report.get("device"),
        "model_load_seconds": report.get("model_load_seconds"),
        "warmup_seconds": report.get("warmup_seconds"),
        "warmup": report.get("warmup"),
        "timed_phase": timed,
        "compiles_after_warmup": report.get("compiles_after_warmup"),
        "recompiles": report.get("recompiles"),
    }


# ---------------------------------------------------------------- building report.json


@dataclass(frozen=True, eq=False)
class RunReport(Mapping):
    """A run's report: typed where it is made, written as report.json (`as_json`) and read back (`from_json`);
    `section` is the part the way of running owns. Read by key it is its report.json form, so code that reads
    reports (the CLI, the server, tests) reads a made one and a read-back one alike."""

    run_id: str
    run_dir: str
    complete: bool
    error: str | None = None
    finished_utc: str | None = None
    versions: dict = field(default_factory=dict)
    device: dict = field(default_factory=dict)
    config_hash: str | None = None
    pod: dict = field(default_factory=dict)
    topology: dict = field(default_factory=dict)
    model: dict = field(default_factory=dict)
    images: int = 0
    images_this_session: int = 0
    images_reused: int = 0
    images_planned: int | None = None
    batches: int | None = None
    padding_rows: int | None = None
    shape_keys: list = field(default_factory=list)
    memory: dict | None = None
    model_load_seconds: float | None = None
    warmup: list = field(default_factory=list)
    warmup_seconds: float | None = None
    persistent_cache: dict = field(default_factory=dict)
    timed_phase: dict | None = None  # None: the run stopped before its timed phase could be measured
    compiles_after_warmup: int | None = None
    recompiles: list = field(default_factory=list)
    xla_counters: dict | None = None
    earlier_sessions: list = field(default_factory=list)
    files: dict = field(default_factory=lambda: dict(FILES))
    section: ModeSection = SINGLE
    already_complete: bool = False  # a resume that found nothing to make (returned, never written)
    extra: dict = field(default_factory=dict)  # keys a report read back holds that this version does not know

    def as_json(self) -> dict:
        """report.json's content."""
        data = {"tpugen_report": 1}
        for spec in fields(self):
            if spec.name not in ("section", "already_complete", "extra"):
                data[spec.name] = getattr(self, spec.name)
        data.update(self.section.as_json())
        data.update(self.extra)
        if self.already_complete:
            data["already_complete"] = True
        return data

    @classmethod
    def from_json(cls, data: dict) -> RunReport:
        """A report as report.json holds it (an earlier session's, or a pod worker's); unknown keys are kept."""
        section = section_from_json(data)
        own = {spec.name for spec in fields(cls)} - {"section", "extra"}
        known = own | set(section.as_json()) | {"tpugen_report"}
        values = {name: data[name] for name in own if name in data}
        values.setdefault("run_id", "n/a")
        values.setdefault("run_dir", "")
        values.setdefault("complete", False)
        return cls(**values, section=section, extra={k: v for k, v in data.items() if k not in known})

    def but(self, **changes) -> RunReport:
        """This report with `changes` (a typed record is never edited in place)."""
        return replace(self, **changes)

    @cached_property
    def _json(self) -> dict:
        return self.as_json()

    def __getitem__(self, key: str):
        return self._json[key]

    def __iter__(self):
        return iter(self._json)

    def __len__(self) -> int:
        return len(self._json)


FILES = {"manifest": "manifest.jsonl", "config": "config.yaml", "grid": "grid.png"}


@dataclass
class TimedPhase:
    """What the timed phase has done so far; enough to write a report at any point, even after a failure."""

    batches: list[dict] = field(default_factory=list)
    recompiles: list[dict] = field(default_factory=list)
    written: list[str] = field(default_factory=list)  # file names, in the order they were written
    generate_seconds: float = 0.0
    write_seconds: float = 0.0
    wall_seconds: float = 0.0
    counters: dict | None = None  # the counters' difference over the phase (Counters.as_dict)


def total(values) -> float | None:
    """The sum, or None when any part was not measured."""
    values = list(values)
    return None if any(v is None for v in values) else sum(values)


def step_times(rows: list[dict]) -> dict:
    """The timed phase's host and device milliseconds per denoising step, from its batches': the host's is the
    median of the batches' medians, each counted once per step it stands for; the device's the mean over every
    step. None where no batch measured it."""
    host = [(row["host_ms_per_step"], row.get("steps") or 1) for row in rows if row.get("host_ms_per_step") is not None]
    device = [
        (row["device_ms_per_step"], row.get("steps") or 1) for row in rows if row.get("device_ms_per_step") is not None
    ]
    expanded = [value for value, steps in host for _ in range(steps)]
    steps = sum(count for _, count in device)
    return {
        "host_ms_per_step": percentile(expanded, 50) if expanded else None,
        "device_ms_per_step": sum(value * count for value, count in device) / steps if steps else None,
    }


def host_bound(host_ms: float | None, device_ms: float | None) -> str | None:
    """The warning a report gives when the host, not the device, sets the pace of the steps (None: it does not, or
    one of the two is not known)."""
    if host_ms is None or device_ms is None or host_ms < device_ms:
        return None
    return f"host-bound: the host needs {host_ms:.2f} ms per step, the device {device_ms:.2f} ms"


def plan_counts(plan) -> dict:
    """What build_report takes from a run's plan (tpugen.plan.RunPlan)."""
    return {
        "images_planned": len(plan.items),
        "batches_planned": len(plan.batches),
        "padding_rows": plan.padding_rows,
        "shape_keys": [str(k) for k in plan.shape_keys],
    }


def build_report(
    *,
    run,
    run_id: str,
    run_dir: Path | str,
    images_planned: int,
    batches_planned: int,
    padding_rows: int,
    shape_keys: list[str],
    device: dict,
    versions: dict,
    scheduler: str,
    load_seconds: float | None,
    warmup: list[dict],
    persistent_cache: dict,
    phase: TimedPhase,
    topology: dict,
    images_reused: int = 0,
    error: str | None = None,
    memory: dict | None = None,
    earlier_sessions: list[dict] = (),
    counters_scope: str | None = None,
) -> RunReport:
    """A run's report, the same layout for every mode (a mode adds its section). `error` marks a run that stopped early; what it
    finished is still listed."""
    rows = phase.batches
    per_image = [row["seconds"] / row["images"] for row in rows if row["images"] for _ in range(row["images"])]
    images = len(phase.written)
    wall = phase.wall_seconds
    counters = phase.counters
    if counters_scope is None:
        counters_scope = device.get("counters_scope") or (
            "process-wide, read before and after each phase; one device in this process"
            if device.get("backend") == "xla"
            else "torch.compile graphs counted by dynamo; executions and transfers are not counted here"
        )
    return RunReport(
        complete=error is None,
        error=error,
        run_id=run_id,
        run_dir=str(run_dir),
        finished_utc=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        versions=versions,
        device=device,
        config_hash=run.config_hash,
        pod={"worker_index": topology["worker_index"], "num_workers": topology["num_workers"]},
        topology=topology,
        model={
            "id": run.config.model.id,
            "dtype": run.config.model.dtype,
            "scheduler": scheduler,
            "loras": [lora.record() for lora in run.loras],
        },
        images=images + images_reused,
        images_this_session=images,
        images_reused=images_reused,
        images_planned=images_planned,
        batches=batches_planned,
        padding_rows=padding_rows,
        shape_keys=shape_keys,
        memory=memory,
        model_load_seconds=load_seconds,
        warmup=warmup,
        warmup_seconds=sum(w["seconds"] for w in warmup),
        persistent_cache=persistent_cache,
        timed_phase={
            "wall_seconds": wall,
            "generate_seconds": phase.generate_seconds,
            "write_seconds": phase.write_seconds,
            "images_per_second": images / wall if wall > 0 and images else None,
            "per_image_seconds": latency_summary(per_image),
            "seconds_per_step": sum(r["seconds"] / r["steps"] for r in rows) / len(rows) if rows else None,
            **step_times(rows),
            "batches": rows,
        },
        compiles_after_warmup=counters["compiles"] if counters else None,
        recompiles=phase.recompiles,
        xla_counters=(
            {
                "scope": counters_scope,
                "warmup": {
                    "compiles": total(w["compiles"] for w in warmup),
                    "compile_seconds": total(w["compile_seconds"] for w in warmup),
                },
                "timed_phase": counters,
            }
            if counters
            else None
        ),
        earlier_sessions=list(earlier_sessions),
    )


def persistent_cache_summary(cache: dict, warmup: list[dict]) -> dict:
    """What the persistent compile cache did, as counted; never assumed."""
    summary = dict(cache)
    for key in ("hits", "misses", "load_failures"):
        counts = [w[f"persistent_cache_{key}"] for w in warmup if w.get(f"persistent_cache_{key}") is not None]
        summary[key] = sum(counts) if counts else None
    return summary


def merge_phases(parts: list[dict], label: str) -> TimedPhase:
    """One timed phase from its parts' (ranks' or workers'): throughput is all images over the slowest part."""
    return TimedPhase(
        batches=[{**b, label: p[label]} for p in parts for b in p["timed_phase"]["batches"]],
        recompiles=[{**e, label: p[label]} for p in parts for e in p.get("recompiles", [])],
        written=[name for p in parts for name in p.get("written", [])],
        generate_seconds=sum(p["timed_phase"]["generate_seconds"] for p in parts),
        write_seconds=sum(p["timed_phase"]["write_seconds"] for p in parts),
        wall_seconds=max((p["timed_phase"]["wall_seconds"] for p in parts), default=0.0),
    )


def write_report(run_dir: Path, report: RunReport) -> None:
    write_json(run_dir / "report.json", report.as_json())
    atomic_write_text(run_dir / "report.md", render_markdown(report))


def read_report(run_dir: Path) -> dict | None:
    """The run's report.json as an earlier session left it, or None (none yet, or unreadable)."""
    try:
        report = json.loads((run_dir / "report.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return report if isinstance(report, dict) else None


def earlier_sessions_of(run_dir: Path) -> list[dict]:
    """Every earlier session's figures, from the report the last one left: a resume never drops them."""
    previous = read_report(run_dir)
    if previous is None or "timed_phase" not in previous:
        return []
    return [*previous.get("earlier_sessions", []), session_summary(previous)]


def _step_time_lines(timed: dict, whole_loop: bool = False) -> list[str]:
    """Host and device milliseconds per denoising step, and the warning when the host sets the pace."""
    host, device = timed.get("host_ms_per_step"), timed.get("device_ms_per_step")
    if host is None and device is None:
        return []
    if whole_loop:
        lines = [
            f"- host ms per denoising step (handing the whole loop to the device, over its steps; median): "
            f"{fmt(host, 3)}; device ms per step (from the hand-off to the loop's end, over its steps; mean): "
            f"{fmt(device, 2)}"
        ]
        return lines
    lines = [
        f"- host ms per denoising step (recording and handing it to the device; median): {fmt(host, 2)}; "
        f"device ms per step (its graphs' execution, at most the loop's time; mean): {fmt(device, 2)}"
    ]
    warning = host_bound(host, device)
    return lines + ([f"- **{warning}**"] if warning else [])


def _loop_lines(loop: dict | None) -> list[str]:
    """On a backend that runs whole loops: how many calls ran their loop as one call, and which a step at a time
    and why."""
    if not loop:
        return []
    lines = [f"- denoising loop: {loop['one_call']} calls ran it as one compiled call ({loop['how']})"]
    for entry in loop.get("step_by_step") or ():
        lines.append(
            f"  - {entry['calls']} calls ran it a step at a time, the denoiser on the device: {entry['reason']}"
        )
    return lines


def _trace_lines(trace: dict | None) -> list[str]:
    """Whether the denoiser was traced once per shape key or recorded every step, and if so why."""
    if not trace or not trace.get("setting"):
        return []
    if trace["state"] == "on":
        beside = "".join(f"; {name} too, beside it" for name in trace.get("beside") or ())
        return [f"- trace once: on ({trace['component']}: {trace['how']}{beside})"]
    lines = [f"- trace once: off, the {trace['component']} was recorded every step -- {trace['reason']}"]
    failed = trace.get("failed_attempt")
    if failed:
        lines.append(f"  - the call that failed to trace had input {failed['input']}; warmed up again lazily")
    return lines


def _memory_line(memory: dict | None) -> str:
    if not memory or "verdict" not in memory:
        return "- memory plan: n/a"
    return (
        f"- memory: {memory['total_gb']:.2f} GB of weights ({memory['source']}); "
        f"{memory['chip']} ({memory['chip_gb']:g} GB): {memory['verdict']} -- {memory['advice']}"
    )


def _attention_lines(memory: dict | None) -> list[str]:
    attention = (memory or {}).get("attention")
    return [f"- {attention['note']}"] if attention else []


def _flash_lines(flash: dict | None, attention: dict | None = None) -> list[str]:
    """Whether the denoiser's attention ran on the flash kernel, and how many of its calls per step did at each
    size (the memory plan's count); if not, why, as one line."""
    if not flash:
        return []
    if flash["state"] == "on":
        spec = flash.get("partition_spec")
        where = f"; SPMD partition spec {tuple(spec)}" if spec else ""
        line = f"- flash attention: on ({', '.join(flash['components'])}{where})"
        calls = (attention or {}).get("kernel_calls")
        if calls:
            from tpugen.memory import kernel_calls_text

            counts = [(c["height"], c["width"], c["reach"], c["calls"]) for c in calls]
            line += ", " + kernel_calls_text(counts, attention["kernel_min_tokens"])
        return [line]
    lines = [f"- flash attention: off -- {flash['reason']}"]
    failed = flash.get("failed_attempt")
    if failed:
        lines.append(
            f"  - the warmup call of {failed['shape_key']} with it on failed after {fmt(failed['seconds'], 2)} s "
            f"(graphs compiled: {fmt(failed['compiles'])}); warmed up again with the model's own attention"
        )
    return lines


def _lora_lines(loras: list[dict] | None) -> list[str]:
    if not loras:
        return []
    fused = ", ".join(
        f"{lora['name']} at {lora['scale']:g} (hash {lora['hash']}, sha256 {lora['sha256']})" for lora in loras
    )
    return [f"- LoRAs fused into the weights: {fused}"]


def _step_cache_lines(cache: dict | None, batches: list[dict]) -> list[str]:
    """The step cache's method and options, how many denoising steps of the timed phase ran full and cached, and
    its seconds per step (each batch's seconds over its steps: its text encoding and decoding included)."""
    if not cache:
        return []
    options = step_cache_options_text(cache["options"])
    full = sum(b.get("steps_full") or 0 for b in batches)
    cached = sum(b.get("steps_cached") or 0 for b in batches)
    line = f"- step cache: {cache['method']} ({options}); timed phase: {full} steps ran full and {cached} cached"
    steps = sum(b.get("steps") or 0 for b in batches)
    if steps and all(b.get("seconds") is not None for b in batches):
        line += f", {sum(b['seconds'] for b in batches) / steps:.3f} s per step"
    return [line]


def _placement_lines(placement: dict | None) -> list[str]:
    if not placement:
        return []
    where = ", ".join(f"{name} on {device}" for name, device in placement.items())
    return [f"- placement: {where} (inputs move to each component's device, outputs back, through the host)"]


def _sharding_lines(sharding: dict | None) -> list[str]:
    if not sharding:
        return []
    mesh = sharding["mesh"]
    lines = [
        f"- SPMD: mesh data {mesh['data']} x model {mesh['model']} over {sharding['devices']} devices; "
        f"{sharding['split_tensors']} weight tensors split over the model axis "
        f"({sharding['split_tensors_verified']} carry the split on the device)"
    ]
    for name, component in sharding["components"].items():
        uneven = f", {component['uneven_layers']} uneven layers replicated" if component["uneven_layers"] else ""
        lines.append(
            f"  - {name} ({component['architecture']}): {component['decision']}"
            f" ({component['split_layers']} linear layers split{uneven})"
        )
    return lines


# The components that run in each phase of a pipeline call.
_PHASE_COMPONENTS = {
    "text encoding": "text encoders",
    "first denoising step": "denoiser",
    "later denoising steps": "denoiser",
    "decoding": "VAE",
}


def _device_memory_lines(warmup: list[dict]) -> list[str]:
    """Device memory after each phase of each shape key's warmup call, or why the device cannot say."""
    lines = []
    for entry in warmup:
        phases = entry.get("device_memory_per_phase") or {}
        readings = [(phase, m) for phase, m in phases.items() if m]
        if not readings:
            continue
        missing = {m.get("unavailable") for _, m in readings} - {None}
        if missing:
            lines.append(f"\nDevice memory per phase: n/a ({missing.pop()})")
            return lines
        parts = [
            f"{phase} ({_PHASE_COMPONENTS.get(phase, phase)}): {m['bytes_in_use'] / 1e9:.2f} GB in use, "
            f"peak so far {m['peak_bytes'] / 1e9:.2f} GB"
            for phase, m in readings
        ]
        lines.append(f"\nDevice memory after each phase of {entry['shape_key']}: " + "; ".join(parts))
    return lines


def _part_label(entry: dict) -> str:
    if "worker" in entry and "rank" in entry:
        return f"worker {entry['worker']} rank {entry['rank']}: "
    if "worker" in entry:
        return f"worker {entry['worker']}: "
    return f"rank {entry['rank']}: " if "rank" in entry else ""


def _by_phase(entry: dict) -> str:
    """Graphs compiled in each phase of a warmup call, with the compile seconds they cost (where measured)."""
    graphs = entry.get("graphs_per_phase") or {}
    seconds = entry.get("compile_seconds_per_phase") or {}
    parts = []
    for name, count in graphs.items():
        spent = seconds.get(name)
        parts.append(f"{name} {count}" + (f" ({spent:.2f} s)" if isinstance(spent, (int, float)) else ""))
    return ", ".join(parts) or "n/a"


def render_markdown(report: RunReport) -> str:
    """report.md: the same facts as report.json, laid out for a person; the mode's section says its part."""
    section = report.section
    timed = report.timed_phase or {}
    lat = timed.get("per_image_seconds") or {}
    device = report.device
    memory = report.memory or {}
    status = ("complete" if report.complete else "INCOMPLETE") + section.status_note(report)
    lines = [
        f"# tpugen {section.title} {report.run_id}",
        "",
        f"- status: {status}",
        *([f"- stopped by: {report.error}"] if report.error and not report.complete else []),
        *section.header_lines(report),
        f"- model: {report.model.get('id', 'n/a')} ({report.model.get('dtype', 'n/a')}, "
        f"scheduler {report.model.get('scheduler', 'n/a')})",
        *_lora_lines(report.model.get("loras")),
        f"- backend: {device.get('backend', 'n/a')} on {device.get('device_kind', 'n/a')} ({section.where(report)})",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in report.versions.items() if v),
        f"- config hash: {report.config_hash}",
        f"- images: {report.images} in {fmt(report.batches)} batches ({fmt(report.padding_rows)} padding rows)",
        f"- model load: {fmt(report.model_load_seconds, 2)} s",
        _memory_line(report.memory),
        *_attention_lines(report.memory),
        *_flash_lines(device.get("flash_attention"), memory.get("attention")),
        *_trace_lines(device.get("trace_once")),
        *_loop_lines(device.get("denoising_loop")),
        *_sharding_lines(device.get("sharding")),
        *_placement_lines(device.get("placement")),
        *_step_cache_lines(device.get("step_cache"), (report.timed_phase or {}).get("batches") or []),
        "",
        "## Warmup (compile) per shape key",
        "",
        "| shape key | wall s | graphs compiled | compile s | graphs (compile s) by phase |",
        "| --- | --- | --- | --- | --- |",
    ]
    for entry in report.warmup:
        where = f"{_part_label(entry)}{entry['shape_key']}"
        if entry.get("again_without_flash_attention"):
            where += " (again, without flash attention)"
        if entry.get("again_traced_lazily"):
            where += " (again, recorded every step: the trace failed)"
        if entry.get("already_warm"):
            lines.append(f"| {where} | 0.00 | 0 | 0.00 | already warm on this engine |")
            continue
        lines.append(
            f"| {where} | {fmt(entry['seconds'], 2)} | {fmt(entry['compiles'])} "
            f"| {fmt(entry['compile_seconds'], 2)} | {_by_phase(entry)} |"
        )
    if not report.warmup:
        lines.append("| (skipped) | | | | |")
    lines.extend(_device_memory_lines(report.warmup))
    cache = report.persistent_cache
    if cache:
        counted = (
            f" ({fmt(cache.get('hits'))} hits, {fmt(cache.get('misses'))} misses, " if cache.get("enabled") else ""
        )
        counted += f"{fmt(cache.get('load_failures'))} entries that could not be loaded)" if counted else ""
        lines += [
            "",
            f"Persistent compile cache: {cache['note']}{' in ' + cache['dir'] if cache.get('dir') else ''}{counted}",
        ]
    lines += [
        "",
        "## Timed phase",
        "",
        f"- wall: {fmt(timed.get('wall_seconds'), 2)} s (generation {fmt(timed.get('generate_seconds'), 2)} s, "
        f"writing files {fmt(timed.get('write_seconds'), 2)} s)",
        f"- images per second: {fmt(timed.get('images_per_second'), 2)}",
        f"- seconds per image: mean {fmt(lat.get('mean'))}, p50 {fmt(lat.get('p50'))}, p90 {fmt(lat.get('p90'))}, "
        f"p99 {fmt(lat.get('p99'))}",
        f"- seconds per denoising step (batch latency / steps, incl. text encoding and decoding): "
        f"{fmt(timed.get('seconds_per_step'), 4)}",
        *_step_time_lines(timed, whole_loop=bool((device.get("denoising_loop") or {}).get("one_call"))),
        f"- compiles after warmup: {fmt(report.compiles_after_warmup)}",
    ]
    counters = report.xla_counters
    if counters:
        t = counters["timed_phase"]
        counted = [f"{t['compiles']} compiles"]
        if t["executions"] is not None:
            counted.append(f"{t['executions']} graph executions")
        if t["transfers_to_host"] is not None:
            counted.append(f"{t['transfers_to_host']} device-to-host transfers")
        lines.append(f"- compile counters of the timed phase ({counters['scope']}): {', '.join(counted)}")
    for event in report.recompiles:
        lines.append(f"- recompile: batch {event['batch']} ({event['shape_key']}) compiled {event['compiles']} graphs")
    earlier = report.earlier_sessions
    if earlier:
        lines += [
            "",
            f"## Earlier sessions of this run ({len(earlier)}; the figures above are this session's)",
            "",
            "| session | finished (UTC) | images | load s | warmup s | timed wall s | images/s | s per image "
            "| compiles after warmup | ended |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for number, session in enumerate(earlier, start=1):
            timed_then = session.get("timed_phase") or {}
            per_image = (timed_then.get("per_image_seconds") or {}).get("mean")
            lines.append(
                f"| {number} | {session.get('finished_utc') or 'n/a'} | {fmt(session.get('images'))} "
                f"| {fmt(session.get('model_load_seconds'), 2)} | {fmt(session.get('warmup_seconds'), 2)} "
                f"| {fmt(timed_then.get('wall_seconds'), 2)} | {fmt(timed_then.get('images_per_second'), 2)} "
                f"| {fmt(per_image)} | {fmt(session.get('compiles_after_warmup'))} "
                f"| {session.get('error') or 'complete'} |"
            )
    lines.extend(section.body_lines(report))
    lines += ["", "| batch | shape key | images | seconds | compiles |", "| --- | --- | --- | --- | --- |"]
    for b in timed.get("batches", []):
        where = ".".join(str(b[k]) for k in ("worker", "rank", "batch") if k in b)
        lines.append(f"| {where} | {b['shape_key']} | {b['images']} | {fmt(b['seconds'])} | {fmt(b['compiles'])} |")
    lines.append("")
    return "\n".join(lines)
