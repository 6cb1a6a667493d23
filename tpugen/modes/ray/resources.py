"""What a ray run asks of the cluster (pure): the resources per worker, how many fit, Ray's actor options, its plan."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tpugen.config import ResolvedRun
from tpugen.errors import InputError

# Batches queued on each worker: one running and one waiting, so a worker never idles while the driver hears of
# its last batch and sends the next. A lost worker costs at most these.
IN_FLIGHT = 2


@dataclass(frozen=True)
class Node:
    """A live node of the cluster, as Ray lists it."""

    node_id: str
    address: str
    resources: dict


def show_resources(resources: dict) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())) + "}"


def _shown_nodes(nodes: list[Node], keys) -> str:
    shown = [show_resources({k: v for k, v in n.resources.items() if k in keys}) for n in nodes]
    counted = {s: shown.count(s) for s in shown}
    return ", ".join(f"{count} x {s}" if count > 1 else s for s, count in counted.items()) or "none"


def worker_resources(settings, nodes: list[Node]) -> dict:
    """execution.ray.resources_per_worker, or the default: every chip of a TPU host on a cluster with TPUs,
    else one CPU."""
    if settings.resources_per_worker:
        return dict(settings.resources_per_worker)
    chips = sorted({n.resources["TPU"] for n in nodes if n.resources.get("TPU", 0) > 0})
    if not chips:
        return {"CPU": 1}
    if len(chips) > 1:
        raise InputError(
            "execution.ray.resources_per_worker: the cluster's TPU hosts have "
            + " and ".join(f"{c:g}" for c in chips)
            + " chips; set it (e.g. {TPU: "
            + f"{chips[0]:g}"
            + "}) to say what one worker takes"
        )
    return {"TPU": chips[0]}


def room(node: Node, resources: dict) -> int:
    """How many workers asking for `resources` fit on `node` (as it is, not counting what others use now)."""
    return min(math.floor(node.resources.get(key, 0) / amount + 1e-9) for key, amount in resources.items())


def worker_count(settings, nodes: list[Node], resources: dict) -> int:
    """execution.ray.workers, checked against the nodes; auto: one per TPU host (as many as fit on the TPU
    nodes, so {TPU: 1} gives one per chip), else one per node."""
    keys = {"CPU", "GPU", "TPU", *resources}
    fits = [room(n, resources) for n in nodes]
    if not any(fits):
        raise InputError(
            f"execution.ray.resources_per_worker: no node of the cluster has {show_resources(resources)} "
            f"(its nodes: {_shown_nodes(nodes, keys)})"
        )
    if settings.workers == "auto":
        return sum(fits) if "TPU" in resources else sum(1 for f in fits if f)
    if settings.workers > sum(fits):
        raise InputError(
            f"execution.ray.workers: {settings.workers} workers of {show_resources(resources)} asked for, and the "
            f"cluster has room for {sum(fits)} (its nodes: {_shown_nodes(nodes, keys)})"
        )
    return settings.workers


def actor_options(resources: dict, max_restarts: int) -> dict:
    """Ray's actor options: CPU and GPU go by their own keywords, every other resource (TPU too) by name.
    Tasks are never retried by Ray: the driver puts a lost batch back in its queue itself."""
    options = {"max_restarts": max_restarts, "max_task_retries": 0}
    rest = {k: v for k, v in resources.items() if k not in ("CPU", "GPU")}
    if "CPU" in resources:
        options["num_cpus"] = resources["CPU"]
    if "GPU" in resources:
        options["num_gpus"] = resources["GPU"]
    if rest:
        options["resources"] = rest
    return options


def plan_lines(run: ResolvedRun) -> list[str]:
    """What `tpugen plan` says a ray run would ask for, without connecting to anything."""
    settings = run.config.execution.ray
    workers = (
        "auto (one per TPU host the cluster has, else one per node)"
        if settings.workers == "auto"
        else str(settings.workers)
    )
    resources = (
        show_resources(settings.resources_per_worker)
        if settings.resources_per_worker
        else "{TPU: chips per host} on a cluster with TPUs, else {CPU: 1}"
    )
    deadline = (
        f"a worker that has not finished a batch {settings.batch_timeout_s:g} s after it could start it is taken "
        "as lost and killed"
        if settings.batch_timeout_s is not None
        else "batches have no deadline"
    )
    return [
        f"ray: address {settings.address}; workers: {workers}; each worker asks for {resources}",
        f"ray: every worker warms up every shape key, then takes batches as it finishes them ({IN_FLIGHT} in "
        f"flight each); a lost worker's batches go back to the queue; Ray restarts it up to {settings.max_restarts} "
        f"times; {deadline}",
    ]
