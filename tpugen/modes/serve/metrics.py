"""The server's Prometheus metrics, in a registry of its own (so two servers in one process never mix)."""

from __future__ import annotations


class Metrics:
    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter(
            "tpugen_requests", "HTTP requests answered", ["endpoint", "status"], registry=self.registry
        )
        self.images = Counter("tpugen_images", "images made for requests", registry=self.registry)
        self.batch_seconds = Histogram(
            "tpugen_batch_seconds",
            "seconds per pipeline call (one batch)",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
            registry=self.registry,
        )
        self.queue_depth = Gauge("tpugen_queue_depth", "images waiting for a device", registry=self.registry)
        self.requests_open = Gauge(
            "tpugen_requests_open", "image requests waiting or being made (serve.max_queue)", registry=self.registry
        )
        self.padding_rows = Counter(
            "tpugen_padding_rows", "batch rows computed only to keep the compiled batch size", registry=self.registry
        )
        self.compiles_after_warmup = Counter(
            "tpugen_compiles_after_warmup",
            "XLA graphs compiled while serving (each once, where engines share the process's count)",
            registry=self.registry,
        )
        self.host_ms_per_step = Gauge(
            "tpugen_host_ms_per_step",
            "the last batch's host milliseconds per denoising step (median): recording and handing it to the device",
            registry=self.registry,
        )
        self.device_ms_per_step = Gauge(
            "tpugen_device_ms_per_step",
            "the last batch's device milliseconds per denoising step (its graphs' execution, at most the loop's time); "
            "NaN under execution.mode: multi, where the engines' executions share one process-wide count",
            registry=self.registry,
        )
        # A request's own bad input is not counted: only what says the device (or the code driving it) is broken.
        self.device_failures = Counter(
            "tpugen_device_failures",
            "failed batches that were not a request's fault, and device loops that died",
            registry=self.registry,
        )

    def batch(self, seconds: float, images: int, padding: int, step_timing=None) -> None:
        self.batch_seconds.observe(seconds)
        self.images.inc(images)
        self.padding_rows.inc(padding)
        if step_timing is not None and step_timing.host_ms_per_step is not None:
            self.host_ms_per_step.set(step_timing.host_ms_per_step)
        if step_timing is not None and step_timing.device_ms_per_step is not None:
            self.device_ms_per_step.set(step_timing.device_ms_per_step)

    def exposition(self) -> tuple[bytes, str]:
        """(the text format, its content type) for GET /metrics."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
