"""The rules between keys: which ways of running go together, checked once the schema has passed."""

from __future__ import annotations

from tpugen.config.schema import MeshConfig, RayConfig, RunConfig
from tpugen.families import FAMILIES, Family

# diffusers 0.42's own clip skip reads the encoder's text_model, which transformers 5's CLIP no longer has.
CLIP_SKIP_NEEDS_WEBUI = "a clip skip needs prompt_syntax webui (tpugen's reading of the prompt)"


# What execution.backend: jax does not run yet (each refused in one line naming it): the features that change
# what a denoising step does.
JAX_NOT_YET = "is not built on execution.backend: jax yet; execution.backend: xla runs it"
JAX_WEIGHED = f"a ControlNet unit's control mode but Balanced, or its advanced_weighting, {JAX_NOT_YET}"


def jax_problems(config: RunConfig, family: Family) -> list[str]:
    """What a config asks of backend jax that it does not run yet, one line each (none for another backend)."""
    execution = config.execution
    if execution.backend != "jax":
        return []
    problems = []
    if execution.offload != "none":
        problems.append(f"execution.offload: {execution.offload} {JAX_NOT_YET}")
    if config.compile.step_cache.method == "pyramid_attention_broadcast":
        problems.append(
            "compile.step_cache.method: pyramid_attention_broadcast on execution.backend: jax: its hooks read the "
            "pipeline's current timestep at every call, which the whole loop (one call) does not set; taylorseer and "
            "magcache run there, or execution.backend: xla runs it"
        )
    if config.model.controlnets and family.controlnet is not None and family.controlnet.loop_refusal:
        problems.append(
            f"model.controlnets: {jax_family_refusal('ControlNet', family, family.controlnet.loop_refusal)}"
        )
    for key, tiled in (("tiling", config.tiling), ("serve.tiling", config.serve.tiling)):
        if tiled:
            problems.append(f"{key}: seamless tiling {JAX_NOT_YET}")
    if "edit" in config.serve.tasks and (why := jax_edit_refusal(family)):
        problems.append(f"serve.tasks: {why}")
    return problems


def jax_edit_refusal(family: Family) -> str | None:
    """Why this family's edits by reference cannot run on backend jax (None: they can, each loop one call, the
    references' tokens joined to the latents' as on xla)."""
    if not family.loop_edit_refusal:
        return None
    return jax_family_refusal("edits by reference", family, family.loop_edit_refusal)


def jax_family_refusal(what: str, family: Family, why: str) -> str:
    """One line: `what` does not run on backend jax for this family's models, and why."""
    return f"{what} on execution.backend: jax: {family.title} models: {why}; execution.backend: xla runs them"


def jax_image_problems(family: Family, *, references: bool, tiling: bool, weighed: bool = False) -> list[str]:
    """What one image of a request asks of backend jax that it does not run yet, one line each (`weighed`: its
    ControlNet units ask for a control mode but Balanced or per-residual weights)."""
    problems = [f"seamless tiling {JAX_NOT_YET}"] if tiling else []
    if weighed:
        problems.append(JAX_WEIGHED)
    if references and (why := jax_edit_refusal(family)):
        problems.append(why)
    return problems


def run_problems(config: RunConfig, family: Family) -> list[str]:
    """Every problem between the config's keys, one line each, for a model of `family`."""
    problems = []
    if family.flow_matching and config.model.scheduler:
        problems.append(
            f"model.scheduler: {family.title} models keep their own flow-matching scheduler; leave it unset"
        )
    if config.batch_size > 1 and family.batch_refusal:
        problems.append(f"batch_size: {family.title} models: {family.batch_refusal}; set batch_size: 1")
    refused = family.refusals(clip_skip=config.clip_skip, tiling=config.tiling or config.serve.tiling)
    if "clip_skip" in refused:
        problems.append(f"clip_skip: {refused['clip_skip']}")
    elif config.clip_skip > 1 and config.prompt_syntax != "webui":
        problems.append(f"clip_skip: {CLIP_SKIP_NEEDS_WEBUI}")
    for key, tiled in (("tiling", config.tiling), ("serve.tiling", config.serve.tiling)):
        if tiled and "tiling" in refused:
            problems.append(f"{key}: {refused['tiling']}")
    pod = config.execution.pod
    if pod.worker_index is not None and pod.num_workers is not None and pod.worker_index >= pod.num_workers:
        problems.append(f"execution.pod.worker_index: {pod.worker_index} is not below num_workers ({pod.num_workers})")

    execution = config.execution
    if execution.mode == "multi" and execution.backend == "cpu" and execution.cores == 0:
        problems.append("execution.cores: mode multi on backend cpu starts that many rank processes; set it above 0")
    if config.compile.torch_compile and execution.backend not in ("cpu", "cuda"):
        problems.append(
            "compile.torch_compile: is for the cpu and cuda backends; xla compiles through torch_xla, "
            "and torch_tpu compiles with execution.torch_tpu.mode: compile"
        )
    if config.compile.scan_blocks and (execution.backend != "xla" or not family.scan_attributes):
        titles = [f.title for f in FAMILIES.values() if f.scan_attributes]
        scanned = ", ".join(titles[:-1]) + f" and {titles[-1]}"
        problems.append(f"compile.scan_blocks: is built for {scanned} models on execution.backend: xla")
    if config.compile.flash_attention is True and execution.backend != "xla":
        problems.append(
            f"compile.flash_attention: true is torch_xla's Pallas kernel, for execution.backend: xla, "
            f"not {execution.backend}; use auto or false"
        )
    if execution.offload == "model" and execution.backend == "cpu":
        problems.append("execution.offload: model moves components onto an accelerator; the cpu backend has none")

    if execution.sharding == "spmd":
        problems.extend(_spmd_problems(config))
    elif execution.mesh != MeshConfig():
        problems.append("execution.mesh: is used only with execution.sharding: spmd")

    if execution.placement != "none":
        problems.extend(_placement_problems(config))

    if execution.mode == "ray":
        problems.extend(_ray_problems(config))
    elif execution.ray != RayConfig():
        problems.append("execution.ray: is used only with execution.mode: ray")

    problems.extend(jax_problems(config, family))
    if config.model.custom_pipeline and not config.model.allow_remote_code:
        problems.append(
            "model.custom_pipeline: runs code downloaded with the model; set model.allow_remote_code: true to allow it"
        )
    if config.sizes is not None and (config.height is not None or config.width is not None):
        problems.append("sizes: give either sizes or height/width, not both")
    return problems


def _placement_problems(config: RunConfig) -> list[str]:
    execution, problems = config.execution, []
    if execution.backend != "xla":
        problems.append(f"execution.placement: needs execution.backend: xla, not {execution.backend}")
    for key, active in (
        ("execution.sharding: spmd", execution.sharding == "spmd"),
        ("execution.offload: model", execution.offload == "model"),
        ("execution.mode: multi", execution.mode == "multi"),
    ):
        if active:
            problems.append(f"execution.placement: and {key} exclude each other; choose one way to use the chips")
    return problems


def _spmd_problems(config: RunConfig) -> list[str]:
    execution, problems = config.execution, []
    if execution.backend not in ("xla", "jax"):
        problems.append(f"execution.sharding: spmd needs execution.backend: xla or jax, not {execution.backend}")
    if execution.offload != "none":
        problems.append(
            "execution.offload: model and execution.sharding: spmd exclude each other: split the model over the "
            "chips (spmd) or move it on and off one chip (offload), not both"
        )
    if execution.mode == "multi":
        problems.append(
            "execution.mode: multi runs a replica per chip, and spmd one model over all chips; use mode: single"
        )
    mesh, cores = execution.mesh, execution.cores
    if config.batch_size % mesh.data:
        problems.append(f"execution.mesh.data: {mesh.data} does not divide batch_size {config.batch_size}")
    if cores and (cores % mesh.data or (mesh.model and mesh.data * mesh.model != cores)):
        problems.append(
            f"execution.mesh: data {mesh.data} x model {mesh.model or '(the rest)'} does not cover "
            f"execution.cores: {cores} devices exactly"
        )
    return problems


def _ray_problems(config: RunConfig) -> list[str]:
    execution, problems = config.execution, []
    pod = execution.pod
    if pod.worker_index is not None or pod.num_workers is not None:
        # One model over a whole multi-host slice (spmd over the pod) needs every host in one runtime; a Ray
        # worker is one host that takes batches on its own.
        problems.append(
            "execution.pod: is for tpugen pod-run's workers (a fixed share per pod worker); execution.mode: ray "
            "hands batches to Ray workers, one host each: leave execution.pod unset"
        )
    if execution.cores and execution.sharding == "none" and execution.placement == "none":
        problems.append(
            "execution.cores: with execution.mode: ray each worker runs one engine; cores applies to spmd or "
            "placement over a worker's chips (for one replica per chip, give each worker {TPU: 1})"
        )
    return problems
