"""What each command does, above the modes: which mode runs, and the backend's environment for every command."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from tpugen.backends import FlashAttention, backend_environment
from tpugen.backends.xla.flash import planned_flash_attention
from tpugen.backends.xla.trace import TRACEABLE_STEP_CACHES, trace_once_reason
from tpugen.config import ResolvedRun
from tpugen.engine import Display
from tpugen.errors import InputError
from tpugen.families import family
from tpugen.memory import (
    MemoryPlan,
    attention_summary,
    config_fit,
    controlnet_activations,
    denoiser_config,
    how_it_runs,
    largest_attention,
    memory_plan_for,
    weights_per_chip,
)
from tpugen.outputs.report import RunReport
from tpugen.plan import RunPlan, plan_run


def prepare_environment(run: ResolvedRun) -> None:
    """Variables a backend reads when torch is imported (TORCH_TPU_DEFER_AND_FUSE), set before anything in
    this process imports torch: every command that runs a model calls this first, and the report records it."""
    os.environ.update(backend_environment(run.config.execution, run.config.cache))


def generate(
    run: ResolvedRun, *, display: Display | None = None, skip_warmup: bool = False, resume_dir: Path | None = None
) -> RunReport:
    """`tpugen generate`: the config's way of running (tpugen.modes.MODES): one chip, all chips of the VM, or a
    Ray cluster."""
    from tpugen.modes import mode_for

    mode = mode_for(run)
    if run.config.output.dir.startswith("gs://") and not mode.writes_gs:
        raise InputError(
            "output.dir: gs:// destinations are written by tpugen pod-run's workers; give a local directory"
        )
    prepare_environment(run)
    return mode.run(run, display=display, skip_warmup=skip_warmup, resume_dir=resume_dir)


def resume(run_dir: Path, *, display: Display | None = None) -> RunReport:
    """`tpugen resume RUN_DIR`: the run's own config and prompts, its finished images kept."""
    from tpugen.outputs.run_record import load_run

    return generate(load_run(run_dir), display=display, resume_dir=run_dir)


def warmup(run: ResolvedRun, *, display: Display | None = None) -> dict:
    """`tpugen warmup`: every shape key compiled once, no run directory."""
    prepare_environment(run)
    from tpugen.modes.single import warm_up

    return warm_up(run, display=display)


@dataclass(frozen=True)
class PlanView:
    """What `tpugen plan` prints."""

    run_plan: RunPlan
    memory: MemoryPlan | None  # None: the model is neither on disk nor known to tpugen
    how: str  # how the config runs the model
    fit: str | None  # whether that fits the chip
    flash_attention: FlashAttention  # as a run here would start (a failure at warmup can still turn it off)
    attention: dict | None  # the largest attention matrix, or that flash attention holds none
    trace_once: str | None = None  # xla: whether the denoiser is traced once, or why it is recorded every step
    controlnets: dict | None = None  # what the ControlNets hand the denoiser at the largest controlled key


def plan(run: ResolvedRun) -> PlanView:
    """`tpugen plan`: the run as batches, the memory plan, and flash attention. Loads no weights and starts no
    device."""
    config, execution = run.config, run.config.execution
    memory = memory_plan_for(run.model_source, config.model, execution.chip, execution.chip_memory_gb, device_free=True)
    fit = config_fit(memory, execution, config.model.id) if memory else None
    run_plan = plan_run(run)
    family_ = family(run.family)
    route = family_.flash_attention
    flash = planned_flash_attention(
        config.compile.flash_attention, route, backend=execution.backend, spmd=execution.sharding == "spmd"
    )
    attention = controlnets = None
    found = denoiser_config(run.model_source, family_.denoiser)
    if found is not None and config.model.controlnets:
        controlnets = controlnet_activations(
            family_,
            config.model,
            run_plan.shape_keys,
            vae_scale=found[1],
            text_tokens=family_.max_sequence_length or 0,
            denoiser=family_.denoiser,
        )
    if found is not None:
        largest = largest_attention(
            family_,
            found[0],
            run_plan.shape_keys,
            component=family_.denoiser,
            dtype=config.model.dtype,
            vae_scale=found[1],
            text_tokens=family_.max_sequence_length or 0,
        )
        if largest is not None:
            attention = attention_summary(largest, flash_on=flash.on, min_tokens=route.min_tokens)
    held = attention if attention and attention["materialised"] else None
    if fit == "fits" and memory and (held or controlnets):
        fit = attention_fit(memory, held, execution, flash_route=bool(route.components), controlnets=controlnets) or fit
    trace = planned_trace(config, family_)
    return PlanView(run_plan, memory, how_it_runs(execution), fit, flash, attention, trace, controlnets)


def planned_trace(config, family_) -> str | None:
    """What a run would do with compile.trace_once, in a line (None off backend xla, where it does not apply)."""
    execution, compile_config = config.execution, config.compile
    if execution.backend == "jax":
        return "denoising loop: the whole loop as one compiled call per batch (lax.fori_loop on JAX)"
    if execution.backend != "xla":
        return None
    reason = trace_once_reason(
        compile_config.trace_once,
        step_cache=compile_config.step_cache.method not in TRACEABLE_STEP_CACHES,
        offload=execution.offload == "model",
        placed=execution.placement != "none",
        spmd=execution.sharding == "spmd",
        scanned=compile_config.scan_blocks,
    )
    if reason is None:
        count = len(config.model.controlnets)
        beside = " and its ControlNet" if count == 1 else f" and its {count} ControlNets" if count else ""
        return (
            f"trace once: on ({family_.denoiser}{beside} traced by dynamo once per shape key), unless dynamo refuses it"
        )
    return f"trace once: off, the {family_.denoiser} is recorded every step -- {reason}"


def attention_fit(
    memory, attention: dict | None, execution, *, flash_route: bool, controlnets: dict | None = None
) -> str | None:
    """Why weights that fit a chip still do not, once one layer's full attention matrix (None: none is held, the
    kernel's) and what the ControlNets hand the denoiser (`controlnets`) are held beside them (a lower bound on
    what a denoiser call needs), or None. Under SPMD a chip holds its share of the weights and of the matrix (the
    mesh splits rows and heads); ControlNets run on one device."""
    devices = execution.cores or (execution.mesh.data * execution.mesh.model) or 1
    share = devices if execution.sharding == "spmd" else 1
    weights = weights_per_chip(memory, execution, devices) / 1e9
    matrix = attention["gb"] / share if attention else 0.0
    hints = controlnets["bytes"] / 1e9 if controlnets else 0.0
    if weights + matrix + hints <= memory.chip_gb:
        return None
    remedy = "a smaller size or batch" + (
        ", or flash attention (compile.flash_attention)" if flash_route and attention else ""
    )
    held = [f"the largest attention matrix ({matrix:.2f} GB per layer)"] if attention else []
    held += [f"the ControlNets' residuals ({hints:.2f} GB)"] if controlnets else []
    if share > 1:
        held_text = f"a chip's share of the weights ({weights:.2f} GB) and of {' and '.join(held)}"
    else:
        held_text = f"the weights ({weights:.2f} GB) and {' and '.join(held)}"
    return f"does not fit: {held_text} are over the {memory.chip}'s {memory.chip_gb:g} GB; use {remedy}"


def calibration_target(config_path: Path) -> Path:
    """Where `tpugen calibrate` writes by default: the ratios file the config names, else CONFIG.mag_ratios.yaml."""
    from tpugen.config.yamlio import read_yaml

    named = ((read_yaml(config_path).get("compile") or {}).get("step_cache") or {}).get("mag_ratios")
    if isinstance(named, str) and named.endswith((".yaml", ".yml", ".json")):
        path = Path(named).expanduser()
        return path if path.is_absolute() else config_path.resolve().parent / path
    return config_path.resolve().with_name(f"{config_path.stem}.mag_ratios.yaml")


def calibrate(run: ResolvedRun, out: Path, *, display: Display | None = None):
    """`tpugen calibrate`: MagCache's ratios for the config's model, written to `out` (YAML, written whole or not
    at all) for compile.step_cache.mag_ratios to name. Returns the Calibration."""
    prepare_environment(run)
    from tpugen.config.yamlio import dump_yaml
    from tpugen.files import atomic_write_text
    from tpugen.modes.single import calibrate as measure

    result = measure(run, display=display)
    record = {
        "model": result.model,
        "steps": result.steps,
        "height": result.height,
        "width": result.width,
        "scheduler": result.scheduler,
        "mag_ratios": [round(r, 5) for r in result.mag_ratios],
    }
    if out.suffix == ".json":
        text = json.dumps(record, indent=1) + "\n"
    else:
        text = (
            f"# MagCache ratios measured by tpugen calibrate: one call of {result.steps} steps at {result.width}x"
            f"{result.height}. Name this file in compile.step_cache.mag_ratios.\n" + dump_yaml(record)
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, text)
    return result


def serve(run: ResolvedRun, *, host: str, port: int, api_key: str | None, display: Display | None = None) -> None:
    """`tpugen serve`: the config's engines kept warm behind HTTP until SIGTERM or SIGINT."""
    prepare_environment(run)
    from tpugen.modes.serve.server import serve as run_server

    run_server(run, host=host, port=port, api_key=api_key, display=display)


def generate_on(run: ResolvedRun, url: str, *, api_key: str | None, display: Display | None = None) -> dict:
    """`tpugen generate CONFIG --server URL`: the run made by a warm server; imports no torch here."""
    if run.config.output.dir.startswith("gs://"):
        raise InputError("output.dir: the server's run is copied to a local directory; give one")
    from tpugen.modes.serve.client import submit

    return submit(run, url, api_key=api_key, display=display)


def mode_plan(run: ResolvedRun) -> list[str]:
    """What `tpugen plan` says of the config's way of running (a ray run: the workers and resources it would ask
    the cluster for); connects to nothing."""
    from tpugen.modes import mode_for

    return mode_for(run).plan_lines(run)


def pod_run(run: ResolvedRun, pod, **options) -> dict | None:
    """`tpugen pod-run`: every worker of a pod slice through gcloud, gathered and merged."""
    from tpugen.modes.pod import run_pod

    return run_pod(run, pod, **options)
