"""The timing report: statistics over batches, report.json's layout, and report.md for people."""

from __future__ import annotations

import math


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


def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _memory_line(memory: dict | None) -> str:
    if not memory or "verdict" not in memory:
        return "- memory plan: n/a"
    return (
        f"- memory: {memory['total_gb']:.2f} GB of weights ({memory['source']}); "
        f"{memory['chip']} ({memory['chip_gb']:g} GB): {memory['verdict']} -- {memory['advice']}"
    )


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


def render_markdown(report: dict) -> str:
    """report.md: the same facts as report.json, laid out for a person."""
    timed = report["timed_phase"]
    lat = timed["per_image_seconds"]
    device = report["device"]
    lines = [
        f"# tpugen run {report['run_id']}",
        "",
        f"- status: {'complete' if report['complete'] else 'INCOMPLETE'}",
        f"- model: {report['model']['id']} ({report['model']['dtype']}, scheduler {report['model']['scheduler']})",
        f"- backend: {device['backend']} on {device['device_kind']} (world size {device['world_size']})",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items() if v),
        f"- config hash: {report['config_hash']}",
        f"- images: {report['images']} in {report['batches']} batches ({report['padding_rows']} padding rows)",
        f"- model load: {_fmt(report['model_load_seconds'], 2)} s",
        _memory_line(report.get("memory")),
        *_sharding_lines(device.get("sharding")),
        *_placement_lines(device.get("placement")),
        "",
        "## Warmup (compile) per shape key",
        "",
        "| shape key | wall s | graphs compiled | compile s | graphs by phase |",
        "| --- | --- | --- | --- | --- |",
    ]
    for entry in report["warmup"]:
        phases = entry.get("graphs_per_phase") or {}
        by_phase = ", ".join(f"{name} {count}" for name, count in phases.items()) or "n/a"
        lines.append(
            f"| {entry['shape_key']} | {_fmt(entry['seconds'], 2)} | {_fmt(entry['compiles'])} "
            f"| {_fmt(entry['compile_seconds'], 2)} | {by_phase} |"
        )
    if not report["warmup"]:
        lines.append("| (skipped) | | | | |")
    lines.extend(_device_memory_lines(report["warmup"]))
    cache = report.get("persistent_cache") or {}
    if cache:
        counted = (
            f" ({_fmt(cache.get('hits'))} hits, {_fmt(cache.get('misses'))} misses, " if cache.get("enabled") else ""
        )
        counted += f"{_fmt(cache.get('load_failures'))} entries that could not be loaded)" if counted else ""
        lines += [
            "",
            f"Persistent compile cache: {cache['note']}{' in ' + cache['dir'] if cache.get('dir') else ''}{counted}",
        ]
    lines += [
        "",
        "## Timed phase",
        "",
        f"- wall: {_fmt(timed['wall_seconds'], 2)} s (generation {_fmt(timed['generate_seconds'], 2)} s, "
        f"writing files {_fmt(timed['write_seconds'], 2)} s)",
        f"- images per second: {_fmt(timed['images_per_second'], 2)}",
        f"- seconds per image: mean {_fmt(lat['mean'])}, p50 {_fmt(lat['p50'])}, p90 {_fmt(lat['p90'])}, "
        f"p99 {_fmt(lat['p99'])}",
        f"- seconds per denoising step (batch latency / steps, incl. text encoding and decoding): "
        f"{_fmt(timed['seconds_per_step'], 4)}",
        f"- compiles after warmup: {_fmt(report['compiles_after_warmup'])}",
    ]
    counters = report["xla_counters"]
    if counters:
        t = counters["timed_phase"]
        counted = [f"{t['compiles']} compiles"]
        if t["executions"] is not None:
            counted.append(f"{t['executions']} graph executions")
        if t["transfers_to_host"] is not None:
            counted.append(f"{t['transfers_to_host']} device-to-host transfers")
        lines.append(f"- compile counters of the timed phase ({counters['scope']}): {', '.join(counted)}")
    for event in report["recompiles"]:
        lines.append(f"- recompile: batch {event['batch']} ({event['shape_key']}) compiled {event['compiles']} graphs")
    if report.get("ranks"):
        lines += [
            "",
            f"## Ranks ({len(report['ranks'])})",
            "",
            f"Weights loaded {report['weights_loaded']}. Counters: {report['counters_scope']}.",
            *_launcher_lines(report.get("launcher")),
            "",
            "| rank | images | warmup s | warmup graphs | s per image | timed wall s | compiles after warmup | error |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in report["ranks"]:
            lines.append(
                f"| {r['rank']} | {r['images']} | {_fmt(r['warmup_seconds'], 2)} | {r['warmup_compiles']} "
                f"| {_fmt(r['per_image_seconds'])} | {_fmt(r['timed_wall_seconds'], 2)} "
                f"| {_fmt(r['compiles_after_warmup'])} | {r['error'] or ''} |"
            )
    earlier = report.get("earlier_sessions") or []
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
                f"| {number} | {session.get('finished_utc') or 'n/a'} | {_fmt(session.get('images'))} "
                f"| {_fmt(session.get('model_load_seconds'), 2)} | {_fmt(session.get('warmup_seconds'), 2)} "
                f"| {_fmt(timed_then.get('wall_seconds'), 2)} | {_fmt(timed_then.get('images_per_second'), 2)} "
                f"| {_fmt(per_image)} | {_fmt(session.get('compiles_after_warmup'))} "
                f"| {session.get('error') or 'complete'} |"
            )
    lines += ["", "| batch | shape key | images | seconds | compiles |", "| --- | --- | --- | --- | --- |"]
    for b in timed["batches"]:
        where = f"{b['rank']}.{b['batch']}" if "rank" in b else b["batch"]
        lines.append(f"| {where} | {b['shape_key']} | {b['images']} | {_fmt(b['seconds'])} | {_fmt(b['compiles'])} |")
    lines.append("")
    return "\n".join(lines)
