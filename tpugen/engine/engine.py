"""The engine: a loaded, warmed pipeline on its backend, that any number of runs use."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from tpugen.backends import FLASH_ATTENTION_HOOK, make_backend
from tpugen.backends.base import JAX_PLAIN, NOT_A_TPU, XLA_ONLY, flash_failure
from tpugen.config import CacheConfig, CompileConfig, ExecutionConfig, ModelConfig, ResolvedRun
from tpugen.config.embeddings import Embedding, SkippedEmbedding
from tpugen.config.loras import Lora, loras_key
from tpugen.config.schema import StepCacheConfig
from tpugen.engine.controls import read_controlnets
from tpugen.engine.embeddings import load_embeddings
from tpugen.engine.loras import LoraWeights, check_fit, file_shapes, loadable_components, unet_config_of
from tpugen.engine.pipeline import ONE_CALL, LoadedPipeline, quiet_libraries, read_shared
from tpugen.engine.step_cache import (
    calibrating,
    call_step_counts,
    covers,
    step_cache_problem,
    warm_call_steps,
    warming,
)
from tpugen.errors import InputError, RunError, TpugenError
from tpugen.families import family as family_named
from tpugen.memory import (
    attention_summary,
    fit_problem,
    is_out_of_memory,
    largest_attention,
    memory_plan_for,
    out_of_memory_advice,
)
from tpugen.models import ModelSource, not_covered
from tpugen.outputs.records import WarmupEntry
from tpugen.outputs.report import TimedPhase
from tpugen.plan import Batch, RunPlan
from tpugen.schedulers import find_scheduler


class Display:
    """What the engine and the modes tell the user as they go; the CLI shows it with rich, tests keep it quiet."""

    def phase(self, text: str) -> None: ...

    def batches_started(self, total: int) -> None: ...

    def batch_done(self, batch: Batch, seconds: float) -> None: ...

    def progress(self, done: int, total: int, across: str = "all ranks") -> None:
        """Images done over every part of the run (`across`: all ranks, all workers), as its parent counts them."""

    def finished(self) -> None: ...

    def warning(self, text: str) -> None:
        """Something the user should know even under --quiet (a damaged manifest line, say)."""


@dataclass(frozen=True)
class EngineSpec:
    """What an engine is opened from: a config's model, execution, compile and cache sections (not its
    prompts, sizes or outputs). Two runs whose specs are equal can share one engine."""

    model: ModelConfig
    execution: ExecutionConfig
    compile: CompileConfig
    cache: CacheConfig
    source: ModelSource
    family: str
    batch_size: int  # only for the out-of-memory advice
    loras: tuple[Lora, ...] = ()  # fused when the engine opens
    embeddings: tuple[Embedding, ...] = ()  # model.embeddings, loaded when the engine opens
    embeddings_dir: str | None = None  # a server's serve.embeddings_dir: its files load, or are skipped, at opening

    @classmethod
    def of(cls, run: ResolvedRun) -> EngineSpec:
        c = run.config
        return cls(
            c.model,
            c.execution,
            c.compile,
            c.cache,
            run.model_source,
            run.family,
            c.batch_size,
            run.loras,
            run.embeddings,
        )

    def key(self) -> str:
        """Equal for two runs that can share this engine. LoRAs do not count: an engine switches them (use_loras)."""
        sections = (
            self.model.model_copy(update={"loras": []}),
            self.execution.model_copy(update={"strict_shapes": False}),
            self.compile,
            self.cache,
        )
        return "|".join(s.model_dump_json() for s in sections)


Checkpoint = Callable[[], None]


def _no_checkpoint() -> None:
    """Nothing asks the work to stop."""


class Engine:
    """A pipeline loaded once onto its backend. It knows which shape keys it has compiled: `warmup` compiles
    only the ones it lacks, and `run` executes any plan's batches into a run session."""

    def __init__(
        self, spec: EngineSpec, backend, loaded: LoadedPipeline, load_seconds: float, memory, weights=None
    ) -> None:
        self.spec = spec
        self.backend = backend
        self.loaded = loaded
        self.load_seconds = load_seconds
        self.memory = memory  # the memory plan (tpugen.memory.MemoryPlan) where the model's size is known
        self.warm: dict[tuple[str, str], dict] = {}  # (shape key, scheduler) -> its warmup entry
        # (shape key, scheduler) -> the most steps it was warmed at: under a step cache, which kinds of step
        # (graphs of their own) are compiled; without one, steps compile nothing and this is not read.
        self._warm_steps: dict[tuple[str, str], int] = {}
        # (shape key, scheduler) -> every step count it was warmed at: what a backend that runs whole loops compiled
        # under a step cache, where each count is a loop program of its own (`per_step_count`).
        self._warm_counts: dict[tuple[str, str], set[int]] = {}
        # One batch at a time on the device: a server's device loop and a run on the same engine take turns.
        self.lock = threading.RLock()
        self._weights = weights  # tpugen.engine.loras.LoraWeights; None for a pipeline without a LoRA loader
        # The textual-inversion embeddings its text encoders hold, and the files of serve.embeddings_dir that failed.
        self.embeddings: tuple[Embedding, ...] = ()
        self.skipped_embeddings: tuple[SkippedEmbedding, ...] = ()
        self._loras: tuple[Lora, ...] = spec.loras if weights is not None else ()
        self._key = loras_key(self._loras)
        self.flash_attention = backend.flash_attention  # tpugen.backends.FlashAttention; off after a fallback
        # Keys warmed with graphs the engine no longer uses (the denoiser traced once, before a trace failed and it
        # went back to being recorded every step; flash attention's processors, before a call failed with them and
        # they came off): still warm for a server, which keeps serving them (each compiles once more, counted as a
        # compile after warmup, rather than being refused), and warmed again by the next warmup.
        self._warmed_stale: set[tuple[str, str]] = set()
        self._said_loops: set[str] = set()  # reasons a loop ran a step at a time, said once each

    # ---------------------------------------------------------------- opening

    @classmethod
    def open(
        cls,
        spec: EngineSpec,
        *,
        display: Display | None = None,
        ranks_in_process: int = 1,
        device_index: int | None = None,
        neighbours: int = 0,
    ) -> Engine:
        """The backend (with its compile cache started) and the pipeline on it. `device_index` (xla): which of
        this process's devices, for a server that runs one engine per device; `neighbours`: the other engines of
        such a server, running at the same time in this process, whose work the backend's process-wide counters
        count too (so a call's device time per step is not measured: StepTiming's device_ms_per_step is None)."""
        display = display or Display()
        execution = spec.execution
        backend = make_backend(execution, spec.compile, spec.cache, device_index=device_index)
        if why := backend.splits(spec.batch_size):
            raise InputError(why)
        memory = _memory_plan(spec)
        _check_fit(spec, backend, memory)
        family = family_named(spec.family)
        problem = step_cache_problem(spec.compile.step_cache, family, scan_blocks=spec.compile.scan_blocks)
        if problem:
            raise InputError(problem)
        if execution.placement != "none":
            _assign_components(spec, backend, memory, family.denoiser)
        checked = _check_loras_before_loading(spec)

        display.phase(f"loading {spec.model.id} onto {backend.name}")
        start = time.perf_counter()
        pipe, label, scheduler_name = read_shared(spec.model, spec.source, family, ranks_in_process=ranks_in_process)
        pipe.set_progress_bar_config(disable=True)
        _check_class(spec, pipe, family)
        # Before the LoRA twins are copied from the text encoders: their token tables grow here.
        embeddings, skipped = load_embeddings(pipe, family, spec.embeddings, spec.embeddings_dir, spec.model.id)
        for entry in skipped:
            display.warning(f"serve.embeddings_dir: skipped {entry.name!r}: {entry.reason}")
        weights = LoraWeights(pipe) if loadable_components(type(pipe)) else None
        if spec.loras:
            if weights is None:
                raise InputError(f"model.loras: {type(pipe).__name__} has no LoRA loader in diffusers")
            if not checked:  # the model's files were not on disk to check against: check against its modules
                _check_loras(spec, spec.loras, type(pipe), weights.shapes(), getattr(pipe, "unet", None))
            display.phase(f"fusing {len(spec.loras)} LoRA(s) into the weights on the host")
            weights.fuse_on_host(spec.loras)
        backend.prepare_on_host(pipe, family, spec.compile)
        offload = execution.offload == "model"
        advice = out_of_memory_advice(execution, spec.batch_size, spec.model.dtype)
        try:
            backend.place(pipe, offload=offload, family=family)
        except RuntimeError as exc:
            if not is_out_of_memory(exc):
                raise
            raise RunError(
                f"out of memory on the device while {backend.placing or 'the model'} moved onto it: {advice}"
            ) from exc
        controlnets = read_controlnets(spec.model, family)
        for controlnet in controlnets:
            controlnet.to(backend.device)
        loaded = LoadedPipeline(pipe, backend, family, label, scheduler_name, controlnets)
        loaded.neighbours = neighbours
        loaded.annotators = spec.model.annotators_dir
        backend.prepare_on_device(pipe, family, spec.compile, loaded.hooks)
        loaded.controlnet_hooks()
        loaded.use_step_cache(spec.compile.step_cache)
        loaded.out_of_memory_advice = advice
        # Whatever moving the weights left pending (FLUX.2's VAE has an int64 BatchNorm counter) is run now; left
        # lazy, it joined the first call's text graph, and every later call compiled that graph again.
        backend.sync()
        backend.wait()
        engine = cls(spec, backend, loaded, time.perf_counter() - start, memory, weights)
        engine.embeddings, engine.skipped_embeddings = embeddings, skipped
        engine._say_flash_attention(display)
        engine._say_trace_once(display)
        if getattr(backend, "whole_loop", False):
            display.phase("denoising loop: each batch's whole loop as one compiled call (lax.fori_loop on JAX)")
        return engine

    def accepts(self, run: ResolvedRun) -> bool:
        """Whether `run` can use this engine as it is (same model, way of running, compile and cache)."""
        return EngineSpec.of(run).key() == self.spec.key()

    @property
    def scheduler_name(self) -> str:
        """The scheduler runs use: the one loaded (a server's request may switch another in for its own batch)."""
        return self.loaded.default_scheduler

    @property
    def model_label(self) -> str:
        return self.loaded.model_label

    def describe(self) -> dict:
        described = {**self.backend.describe(), "flash_attention": self.flash_attention.as_dict()}
        trace = self.backend.trace_once
        if trace is not None:
            described["trace_once"] = trace.as_dict()
        cache = self.spec.compile.step_cache
        if cache.method != "none":
            described["step_cache"] = {"method": cache.method, "options": cache.options()}
        if getattr(self.backend, "whole_loop", False):
            described["denoising_loop"] = self.loop_summary()
        return described

    def loop_summary(self) -> dict:
        """On a backend that runs whole loops: how this engine's calls ran their denoising loops (one call, or a
        step at a time and why), warmups included."""
        calls = dict(self.loaded.loop_calls)
        whole = calls.pop(ONE_CALL, 0)
        return {
            "one_call": whole,
            "step_by_step": [{"reason": reason, "calls": count} for reason, count in calls.items()],
            "how": "the whole denoising loop as one compiled call (lax.fori_loop), the sampler's steps a linear "
            "recurrence read off diffusers' scheduler",
        }

    def memory_summary(self, plan: RunPlan) -> dict | None:
        """The memory plan's dict, with the largest attention matrix of `plan`'s shape keys (or that flash
        attention holds none)."""
        summary = self.memory.as_dict() if self.memory else {}
        pipe, family = self.loaded.pipe, self.loaded.family
        route = family.flash_attention
        attention = largest_attention(
            family,
            dict(getattr(pipe, family.denoiser).config),
            plan.shape_keys,
            component=family.denoiser,
            dtype=self.spec.model.dtype,
            vae_scale=pipe.vae_scale_factor,
            text_tokens=family.text_length(pipe) or 0,
        )
        if attention is not None:
            summary["attention"] = attention_summary(
                attention, flash_on=self.flash_attention.on, min_tokens=route.min_tokens
            )
        return summary or None

    def _say_flash_attention(self, display: Display) -> None:
        """Flash attention's state, once: a warning when `true` could not have it; nothing when it is simply
        off (false, or auto off a TPU)."""
        flash = self.flash_attention
        if flash.on:
            display.phase(f"flash attention: on ({', '.join(flash.components)}){self._kernel_route()}")
        elif flash.setting is True:
            display.warning(f"flash attention: off -- {flash.reason}")
        elif flash.setting == "auto" and flash.reason not in (NOT_A_TPU, XLA_ONLY, JAX_PLAIN):
            display.phase(f"flash attention: off -- {flash.reason}")

    def _say_trace_once(self, display: Display) -> None:
        """Whether the denoiser is traced once per shape key, once, in a line: when the config asked for it and
        this run falls back to recording it every step, why (a warning where dynamo refused the trace; the way
        the config runs, a step cache say, is no surprise); nothing where trace_once is false or does not apply."""
        trace = self.backend.trace_once
        if trace is None or not trace.setting:
            return
        if trace.on:
            display.phase(f"trace once: on ({trace.traced} traced by dynamo once per shape key)")
            return
        line = f"trace once: off, the {trace.component} is recorded every step -- {trace.reason}"
        (display.warning if trace.failed_attempt else display.phase)(line)

    def _kernel_route(self) -> str:
        """Which of the denoiser's attention calls the kernel takes, counted from its config (any size has as many
        calls; which of them reach the kernel's threshold depends on the size, which the report gives)."""
        from tpugen.memory import attention_calls, kernel_route_text

        pipe, family = self.loaded.pipe, self.loaded.family
        config = dict(getattr(pipe, family.denoiser).config)
        size, text = family.size, family.text_length(pipe) or 0
        calls = attention_calls(family, config, size, size, vae_scale=pipe.vae_scale_factor, text_tokens=text)
        return kernel_route_text(None if calls is None else len(calls), family.flash_attention.min_tokens)

    def _call(self, batch: Batch, display: Display, census: bool = False):
        """One pipeline call. A trace that dynamo refused falls back to recording the denoiser every step inside
        the call (TracedDenoiser), said once; the keys warmed until then were warmed traced, so a warmup warms
        them again lazily, while a server keeps serving them (each then compiles its lazy step graph once, counted
        as a compile after warmup, rather than being refused). If the call fails while flash attention is on, the model's own
        attention processors come back (the hook is removed) and the call is made again: the fallback never
        costs a run, and happens at most once per engine. A failure the kernel did not cause fails the second
        call the same way."""
        trace = self.backend.trace_once
        try:
            return self._call_with_flash(batch, display, census)
        finally:
            if trace is not None and trace.on and not self.backend.trace_once.on:
                self._warmed_stale.update(self.warm)
                self._say_trace_once(display)
            self._say_step_by_step(display)

    def _say_step_by_step(self, display: Display) -> None:
        """Once per reason: a batch whose loop could not run as one call on a backend that runs whole loops."""
        reason = self.loaded.step_by_step
        if reason is not None and reason not in self._said_loops:
            self._said_loops.add(reason)
            display.warning(f"denoising loop: a step at a time, the denoiser on the device -- {reason}")

    def _call_with_flash(self, batch: Batch, display: Display, census: bool = False):
        if not self.flash_attention.on:
            return self.loaded.generate(batch, census=census)
        before, start = self.backend.counters(), time.perf_counter()
        try:
            return self.loaded.generate(batch, census=census)
        except TpugenError:
            raise  # out of memory, named as such: not the kernel's doing
        except Exception as exc:
            reason = flash_failure(exc)
        seconds, delta = time.perf_counter() - start, _delta(self.backend, before)
        # Here, after the except block, the failed call's frames and the half-traced lazy tensors they held are
        # released, so nothing of that call is pending when the retry syncs.
        self.loaded.hooks.remove(FLASH_ATTENTION_HOOK)
        failed = {"shape_key": str(batch.shape), "seconds": seconds, "compiles": delta.compiles if delta else None}
        self.flash_attention = replace(self.flash_attention, reason=reason, partition_spec=None, failed_attempt=failed)
        self._warmed_stale.update(self.warm)  # compiled with the kernel's processors: not the graphs used from now
        self._say_flash_attention(display)
        return self.loaded.generate(batch, census=census)

    def close(self) -> None:
        """Take the patches off the pipeline and let it go (its device memory is freed with it)."""
        self.loaded.hooks.remove_all()
        self.loaded = None
        self._weights = None

    # ---------------------------------------------------------------- LoRAs

    @property
    def loras(self) -> tuple[Lora, ...]:
        """The LoRAs fused into the weights now (name, scale, short hash, sha256 each), as last given."""
        return self._loras

    @property
    def loras_key(self) -> tuple:
        """Hashable, equal for two LoRA sets that give the same weights: work for different keys never shares a
        batch (a batch runs on one set of weights)."""
        return self._key

    def use_loras(self, loras: Sequence[Lora]) -> dict:
        """Fuse `loras` (tpugen.config.loras.Lora, from resolve_lora) instead of the LoRAs fused now; [] for none.

        Between batches, on a warm engine: the base weights come back from the host copy and the new set is
        fused into them on the host (diffusers' loaders), then each changed weight gets a new device tensor.
        Nothing compiles: the graphs take weights as inputs. Returns {"seconds", "tensors" moved,
        "host_copy_bytes"}. A LoRA that does not fit the model is refused (InputError) and nothing changes.
        """
        loras = tuple(loras)
        with self.lock:  # never while a batch runs on these weights (a server's device loop), nor two at once
            if loras_key(loras) == self.loras_key:
                self._loras = loras  # the same weights; names and ids as now given
                return {"seconds": 0.0, "tensors": 0, "host_copy_bytes": self._host_copy_bytes()}
            if self._weights is None:
                raise InputError(f"model.loras: {type(self.loaded.pipe).__name__} has no LoRA loader in diffusers")
            if self.spec.compile.scan_blocks:
                raise InputError(
                    "model.loras: compile.scan_blocks stacks the blocks' weights, so LoRAs cannot be switched on "
                    "this engine; open one with the LoRAs in model.loras"
                )
            weights = self._weights
            _check_loras(self.spec, loras, type(self.loaded.pipe), weights.shapes(), weights.twins.get("unet"))
            start = time.perf_counter()
            try:
                moved = weights.switch(loras, self.backend.put_weight)
                self.backend.wait()
            except InputError:  # refused while fusing on the host: the live weights were not touched
                raise
            except BaseException:
                # Weights may be left between two sets: a key no set has, so the next use_loras puts them all again.
                self._key = ("weights between two LoRA sets",)
                raise
            self._loras, self._key = loras, loras_key(loras)
            return {
                "seconds": time.perf_counter() - start,
                "tensors": moved,
                "host_copy_bytes": self._host_copy_bytes(),
            }

    def _host_copy_bytes(self) -> int:
        return self._weights.host_copy_bytes() if self._weights is not None else 0

    # ---------------------------------------------------------------- compiling

    def warmup(
        self,
        plan: RunPlan,
        display: Display | None = None,
        checkpoint: Checkpoint = _no_checkpoint,
        scheduler: str | None = None,
    ):
        """One full pipeline call per shape key this engine has not compiled yet, at the plan's step count,
        with `scheduler` (None: the loaded one): its wall time is the compile time. Keys already warm are listed
        as such and cost nothing. If flash attention falls back at a later key, or dynamo refuses to trace the
        denoiser (compile.trace_once), the keys warmed before it are warmed again without it (listed twice)."""
        display = display or Display()
        flash_on, traced = self.flash_attention.on, self._traced_once()
        results = self._warm_keys(plan, display, checkpoint, scheduler)
        if (flash_on and not self.flash_attention.on) or (traced and not self._traced_once()):
            again = [e for e in self._warm_keys(plan, display, checkpoint, scheduler) if not e.get("already_warm")]
            flag = (
                "again_without_flash_attention" if flash_on and not self.flash_attention.on else "again_traced_lazily"
            )
            results += [{**e, flag: True} for e in again]
        return results

    def _traced_once(self) -> bool:
        trace = self.backend.trace_once
        return trace is not None and trace.on

    @property
    def per_step_count(self) -> bool:
        """Whether each step count is a program of its own: a step cache on a backend that runs whole loops, which
        traces the loop call by call (its hooks decide at each call which blocks run)."""
        return self.spec.compile.step_cache.method != "none" and getattr(self.backend, "whole_loop", False)

    def program_key(self, shape, steps: int) -> str:
        """What a call of this shape key and step count compiles as: its shape key, or under `per_step_count` the
        shape key at that many steps (a server's cap on warm shapes counts these)."""
        return f"{shape} at {steps} steps" if self.per_step_count else str(shape)

    def warm_counts(self, shape, scheduler: str | None = None) -> list[int]:
        """The step counts this shape key and scheduler were warmed at, under `per_step_count` (else [])."""
        choice = find_scheduler(scheduler).name if scheduler else self.loaded.default_scheduler
        return sorted(self._warm_counts.get((str(shape), choice), ()))

    def warm_programs(self) -> set[str]:
        """The program_key of everything warm."""
        if self.per_step_count:
            return {f"{shape} at {n} steps" for (shape, _), counts in self._warm_counts.items() for n in counts}
        return {shape for shape, _ in self.warm}

    def _warm_keys(self, plan: RunPlan, display: Display, checkpoint: Checkpoint, scheduler: str | None) -> list[dict]:
        first_batch: dict = {}
        cache = self.spec.compile.step_cache
        counts: dict = {}
        for batch in plan.batches:
            if self.per_step_count:  # a warmup call for each shape key and step count
                first_batch.setdefault((batch.shape, batch.steps), batch)
                continue
            known = first_batch.setdefault(batch.shape, batch)
            counts.setdefault(batch.shape, set()).add(batch.steps)
            if cache.method != "none" and batch.steps > known.steps:
                first_batch[batch.shape] = batch
        if cache.method != "none" and not self.per_step_count:
            # A step cache's kinds of step are graphs of their own: each shape key's warmup call runs the steps
            # that compile every kind its batches use (under TaylorSeer, those of its batch with the most steps).
            for shape, batch in first_batch.items():
                steps = warm_call_steps(cache, counts[shape])
                if steps != batch.steps:
                    first_batch[shape] = replace(batch, items=tuple(replace(i, steps=steps) for i in batch.items))
        choice = find_scheduler(scheduler).name if scheduler else self.loaded.default_scheduler
        results = []
        for batch in first_batch.values():
            shape = batch.shape
            key = (str(shape), choice)
            if self.is_warm(shape, scheduler, batch.steps) and key not in self._warmed_stale:
                results.append(WarmupEntry.warm_already(shape).as_dict())
                continue
            warmed_steps = self._warm_steps.get(key, 0) if key in self.warm else 0
            checkpoint()
            display.phase(f"warmup: compiling {shape} (on a TPU the first compile can take many minutes)")
            with self.lock:
                self.loaded.use_scheduler(scheduler)
                try:
                    before = self.backend.counters()
                    start = time.perf_counter()
                    with warming(self.loaded.pipe, self.loaded.family, cache, batch.steps):
                        _, census = self._call(batch, display, census=True)
                    self.backend.wait()
                    seconds = time.perf_counter() - start
                    delta = _delta(self.backend, before)
                finally:
                    self.loaded.use_scheduler(None)  # at rest, an engine has the scheduler it was loaded with
            entry = WarmupEntry.measured(shape, seconds, delta, census, dict(self.loaded.phase_memory)).as_dict()
            self.warm[key] = entry
            stale = key in self._warmed_stale
            self._warmed_stale.discard(key)
            self._warm_steps[key] = max(warmed_steps, batch.steps)
            # A stale key's other counts were compiled with what is gone (flash attention's kernel): not warm now.
            counts = self._warm_counts.setdefault(key, set())
            if stale:
                counts.clear()
            counts.add(batch.steps)
            results.append(entry)
        return results

    # ---------------------------------------------------------------- the timed phase

    def run(
        self,
        plan: RunPlan,
        write_batch: Callable[[Batch, list, float], list],
        *,
        display: Display | None = None,
        checkpoint: Checkpoint = _no_checkpoint,
        strict_shapes: bool = False,
        phase: TimedPhase | None = None,
        loras: Sequence[Lora] | None = None,
    ) -> TimedPhase:
        """The timed phase: each batch generated, then handed to `write_batch(batch, pixels, seconds)`, which
        writes its images and returns their names. Strict shapes: a batch that compiles stops the run. The
        phase's figures are in `phase` whatever happens, so a report can be written after a failure.

        Each batch runs with the loaded scheduler and with `loras` (None: whatever is fused now): a server's
        requests may switch either between this run's batches."""
        display = display or Display()
        phase = phase if phase is not None else TimedPhase()
        backend = self.backend
        phase_before = backend.counters()
        phase_start = time.perf_counter()
        display.batches_started(len(plan.batches))
        if note := syntax_note(self.loaded.family, plan.items):
            display.warning(note)
        try:
            for batch in plan.batches:
                checkpoint()
                with self.lock:
                    self.loaded.use_scheduler(None)
                    if loras is not None:
                        self.use_loras(loras)
                    before = backend.counters()
                    start = time.perf_counter()
                    pixels = self._call(batch, display)
                    backend.wait()  # the clock is read only after the device has finished
                    seconds = time.perf_counter() - start
                    delta = _delta(backend, before)
                phase.generate_seconds += seconds
                if delta and delta.compiles:
                    phase.recompiles.append(
                        {"batch": batch.number, "shape_key": str(batch.shape), "compiles": delta.compiles}
                    )
                    if strict_shapes:
                        raise RunError(
                            f"strict shapes: batch {batch.number} ({batch.shape}) compiled {delta.compiles} "
                            "graphs after warmup; its images were not written"
                        )
                start = time.perf_counter()
                names = write_batch(batch, pixels, seconds)
                phase.written.extend(names)
                phase.write_seconds += time.perf_counter() - start
                phase.batches.append(
                    {
                        "batch": batch.number,
                        "shape_key": str(batch.shape),
                        "images": len(names),
                        "padding": batch.padding,
                        "steps": batch.steps,
                        "seconds": seconds,
                        "compiles": delta.compiles if delta else None,
                        "executions": delta.executions if delta else None,
                        "transfers_to_host": delta.transfers_to_host if delta else None,
                        **self._step_timing_row(),
                        **self._step_counts(batch),
                    }
                )
                display.batch_done(batch, seconds)
        finally:
            display.finished()
            phase.wall_seconds = time.perf_counter() - phase_start
            counters = _delta(backend, phase_before)
            phase.counters = counters.as_dict() if counters else None
        return phase

    def generate(
        self,
        batch: Batch,
        scheduler: str | None = None,
        loras: Sequence[Lora] | None = None,
        on_step: Callable[[int], None] | None = None,
    ) -> list:
        """One batch's pixels, outside any run (a server's requests): uint8 HxWx3 arrays of its real rows, with
        `scheduler` (None: the loaded one) and `loras` fused (None: whatever is fused now). `on_step(n)` is told
        each denoising step as it is handed to the device (no step is read back to the host for it)."""
        with self.lock:
            if loras is not None:
                self.use_loras(loras)
            self.loaded.use_scheduler(scheduler)
            self.loaded.on_step = on_step
            try:
                pixels = self._call(batch, Display())
                self.backend.wait()
            finally:
                self.loaded.on_step = None
                self.loaded.use_scheduler(None)  # at rest, an engine has the scheduler it was loaded with
            return pixels

    def calibrate_mag_ratios(self, batch: Batch, display: Display) -> list[float]:
        """`tpugen calibrate`: one call of `batch` under diffusers' MagCache calibration, its ratios (one per step).
        Each ratio is read back to the host as its step ends, so the call is slower than a run's."""
        problem = step_cache_problem(
            StepCacheConfig(method="magcache", mag_ratios="flux"),
            self.loaded.family,
            scan_blocks=self.spec.compile.scan_blocks,
        )
        if problem:
            raise InputError(problem)
        with self.lock, calibrating(self.loaded.pipe, self.loaded.family, batch.steps) as ratios:
            self._call(batch, display)
            self.backend.wait()
        return ratios

    @property
    def step_timing(self):
        """The last call's host and device milliseconds per denoising step (tpugen.engine.step_clock.StepTiming)."""
        return self.loaded.step_timing

    def _step_timing_row(self) -> dict:
        timing = self.loaded.step_timing
        return timing.as_dict() if timing is not None else {"host_ms_per_step": None, "device_ms_per_step": None}

    def _step_counts(self, batch: Batch) -> dict:
        """How many of the call's steps just made ran full and how many cached ({} without a step cache)."""
        return call_step_counts(self.loaded.pipe, self.loaded.family, self.spec.compile.step_cache, batch)

    def is_warm(self, shape, scheduler: str | None = None, steps: int | None = None) -> bool:
        """Whether a call of this shape key and scheduler (None: the loaded one) would compile nothing. `steps`:
        the call's, which matter under a step cache (each kind of step is a graph: tpugen.engine.step_cache);
        None asks about the shape key and scheduler alone."""
        choice = find_scheduler(scheduler).name if scheduler else self.loaded.default_scheduler
        key = (str(shape), choice)
        if key not in self.warm:
            return False
        cache = self.spec.compile.step_cache
        if steps is None or cache.method == "none":
            return True
        if self.per_step_count:
            return steps in self._warm_counts.get(key, ())
        return covers(cache, self._warm_steps.get(key, 0), steps)

    def warm_steps(self, shape, scheduler: str | None = None) -> int | None:
        """The most steps this shape key and scheduler were warmed at (None: not warm)."""
        choice = find_scheduler(scheduler).name if scheduler else self.loaded.default_scheduler
        key = (str(shape), choice)
        return self._warm_steps.get(key) if key in self.warm else None


def _check_loras(spec: EngineSpec, loras, pipeline_class, shapes, unet) -> None:
    """Each LoRA checked against the model's modules and widths (tpugen.engine.loras.check_fit)."""
    unet_config = getattr(unet, "config", None) if unet is not None else None
    for number, lora in enumerate(loras):
        where = f"model.loras[{number}]"
        check_fit(lora, where, pipeline_class, shapes, spec.family, spec.model.id, unet_config)


def _check_class(spec: EngineSpec, pipe, family) -> None:
    """The loaded pipeline is of a class its family covers (the family was read from model_index.json before
    loading, or from tpugen's table of hub ids): a RunError in one line otherwise, before anything compiles."""
    class_name = type(pipe).__name__
    if spec.model.custom_pipeline or class_name in family.pipeline_classes:
        return
    raise RunError(f"model.id: {not_covered(spec.model.id, class_name)}")


def _check_loras_before_loading(spec: EngineSpec) -> bool:
    """model.loras checked against the model's safetensors headers before any weights are read; False when the
    model's files are not on this machine yet (a hub model not downloaded), to be checked once it is loaded."""
    if not spec.loras:
        return True
    quiet_libraries()
    import diffusers

    model_dir = _model_dir(spec)
    class_name = family_named(spec.family).pipeline_classes[0]
    if model_dir is not None:
        class_name = json.loads((model_dir / "model_index.json").read_text()).get("_class_name", class_name)
    pipeline_class = getattr(diffusers, class_name, None)
    components = loadable_components(pipeline_class)
    if not components:
        raise InputError(f"model.loras: {class_name} has no LoRA loader in diffusers")
    if model_dir is None:
        return False
    shapes = file_shapes(model_dir, components, spec.model.variant)
    if not shapes or set(shapes) != {c for c in components if (model_dir / c).is_dir()}:
        return False  # weights in another format than safetensors: no headers to read
    unet_config = unet_config_of(model_dir)
    for number, lora in enumerate(spec.loras):
        check_fit(lora, f"model.loras[{number}]", pipeline_class, shapes, spec.family, spec.model.id, unet_config)
    return True


def _model_dir(spec: EngineSpec) -> Path | None:
    """The model's diffusers directory on this machine: a built-in's, a local one, or a hub model's cached snapshot."""
    source = spec.source
    if source.kind == "builtin":
        from tpugen.tiny import builtin_path

        return builtin_path(source.ref)
    if source.kind == "local":
        return Path(source.ref)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(source.ref, revision=spec.model.revision, local_files_only=True))
    except Exception:  # not downloaded yet: checked against the loaded modules instead
        return None


def _delta(backend, before):
    after = backend.counters()
    return after - before if after is not None and before is not None else None


def _memory_plan(spec: EngineSpec):
    """The memory plan for the chip kind the config names; a model tpugen cannot size has none."""
    execution = spec.execution
    try:
        return memory_plan_for(spec.source, spec.model, execution.chip, execution.chip_memory_gb)
    except Exception:  # informational, and for the fit check; a model tpugen cannot size is not refused for that
        return None


def _check_fit(spec: EngineSpec, backend, memory) -> None:
    """Refuse, before any weights load, a model that cannot fit the chips the way the config runs it.

    Only where the chip is known: on a TPU, or when the config names the chip (execution.chip or
    chip_memory_gb); elsewhere (XLA:CPU, GPUs) the chip in the config is a planning assumption only.
    """
    execution = spec.execution
    named = {"chip", "chip_memory_gb"} & execution.model_fields_set
    if backend.name not in ("xla", "torch_tpu") or not (named or os.environ.get("PJRT_DEVICE", "").upper() == "TPU"):
        return
    if execution.placement != "none" or memory is None:
        return  # the placement itself is checked chip by chip
    devices = backend.device_count if execution.sharding == "spmd" else 1
    problem = fit_problem(memory, execution, devices, spec.model.id)
    if problem:
        hint = "" if named else f" (if these chips are not {execution.chip}, set execution.chip)"
        raise InputError(problem + hint)


def _assign_components(spec: EngineSpec, backend, memory, denoiser: str) -> None:
    """execution.placement, decided from the component sizes on disk before any weights load."""
    from tpugen.placement import assign_components

    execution = spec.execution
    if memory is None:
        raise InputError(
            f"execution.placement: the component sizes of {spec.model.id} are not known without its files; "
            "download it first (its safetensors headers give the sizes)"
        )
    sizes = {c.name: c.bytes for c in memory.components}
    explicit = execution.placement if isinstance(execution.placement, dict) else None
    backend.assign(assign_components(sizes, backend.capacities(memory.chip_gb * 1e9), explicit), denoiser)


def syntax_note(family, items) -> str | None:
    """Once per run: the prompts whose web UI syntax a family without CLIP-only encoders leaves out (they reach
    its encoders as plain words), or None."""
    from tpugen.families.prompt_syntax import strip_syntax

    prompts = {text for item in items if item.prompt_syntax == "webui" for text in (item.prompt, item.negative_prompt)}
    changed = sum(1 for text in prompts if strip_syntax(text) != text)
    if family.clip_tokenizers or not changed:
        return None
    return (
        f"prompts: {family.title} models do not read the web UI's emphasis syntax; it is taken out of {changed} "
        "prompt(s), which reach the text encoders as plain words (prompt_syntax: plain keeps it as text)"
    )
