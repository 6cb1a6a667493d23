"""Records that cross a boundary (engine to report, rank or worker to driver), typed where they are made and
written as the JSON the report and report.json read."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class WarmupEntry:
    """One shape key's warmup: what compiling it cost, per phase where the backend counts graphs."""

    shape_key: str
    height: int
    width: int
    batch_size: int
    cfg: bool
    seconds: float
    compiles: int | None  # None where the backend counts no compiles
    compile_seconds: float | None
    graphs_per_phase: dict | None = None
    # Lazy graphs each phase looked up in the compile cache, compiled or found there: in a phase that runs each
    # of its graphs once (the first denoising step), as many as a fresh process compiles, whatever ran before.
    graphs_run_per_phase: dict | None = None
    compile_seconds_per_phase: dict | None = None
    device_memory_per_phase: dict | None = None
    persistent_cache_hits: int | None = None
    persistent_cache_misses: int | None = None
    persistent_cache_load_failures: int | None = None
    already_warm: bool = False  # the engine had compiled it for an earlier run: nothing was done

    @classmethod
    def warm_already(cls, shape) -> WarmupEntry:
        return cls(
            **_shape(shape),
            seconds=0.0,
            compiles=0,
            compile_seconds=0.0,
            persistent_cache_hits=0,
            persistent_cache_misses=0,
            persistent_cache_load_failures=0,
            already_warm=True,
        )

    @classmethod
    def measured(cls, shape, seconds: float, delta, census: dict | None, memory: dict | None) -> WarmupEntry:
        """`delta`: the backend's counters over the call (None where it counts nothing); `census`: graphs and
        compile seconds per phase."""
        return cls(
            **_shape(shape),
            seconds=seconds,
            compiles=delta.compiles if delta else None,
            compile_seconds=delta.compile_seconds if delta else None,
            graphs_per_phase=census["graphs"] if census else None,
            graphs_run_per_phase=census["graphs_run"] if census else None,
            compile_seconds_per_phase=census["compile_seconds"] if census else None,
            device_memory_per_phase=memory or None,
            persistent_cache_hits=delta.persistent_cache_hits if delta else None,
            persistent_cache_misses=delta.persistent_cache_misses if delta else None,
            persistent_cache_load_failures=delta.persistent_cache_load_failures if delta else None,
        )

    def as_dict(self) -> dict:
        """The report.json form (an entry that was warm already says so; the others leave the flag out)."""
        data = asdict(self)
        if not self.already_warm:
            del data["already_warm"]
        return data


def _shape(shape) -> dict:
    return {
        "shape_key": str(shape),
        "height": shape.height,
        "width": shape.width,
        "batch_size": shape.batch_size,
        "cfg": shape.cfg,
    }
