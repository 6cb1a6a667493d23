"""The `tpugen` command line: each command converts its options and calls one plain function."""

from __future__ import annotations

import functools
import sys
import traceback
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tpugen import __version__, settings
from tpugen.errors import TpugenError, is_known, one_line

app = typer.Typer(
    help="Text-to-image generation on Cloud TPU VMs through torch_xla: each compile paid once, every second accounted for.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out = Console()
err = Console(stderr=True)

ConfigPath = Annotated[Path, typer.Argument(help="The YAML run config.", show_default=False)]
Overrides = Annotated[
    list[str] | None,
    typer.Argument(
        help="key=value overrides after the config, e.g. steps=30 model.dtype=bfloat16.", show_default=False
    ),
]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar; print only where the results went.")]


def _api_key(help_text: str):
    return Annotated[str | None, typer.Option("--api-key", envvar="TPUGEN_API_KEY", help=help_text, show_default=False)]


ClientApiKey = _api_key("The server's API key (also TPUGEN_API_KEY): sent as Authorization: Bearer KEY.")
ServerApiKey = _api_key(
    "The key every request must bring as Authorization: Bearer KEY (also TPUGEN_API_KEY); needed off loopback."
)


def _boundary(command):
    """The one place errors become messages: one line per problem, no traceback unless TPUGEN_DEBUG=1."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        debug = settings.debug()
        try:
            return command(*args, **kwargs)
        except TpugenError as exc:
            if debug:
                traceback.print_exc()
            for line in exc.lines:
                typer.echo(f"error: {line}", err=True)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            typer.echo("error: interrupted", err=True)
            raise typer.Exit(130) from None
        except (typer.Exit, typer.Abort):
            raise
        except Exception as exc:  # anything unforeseen still gets one line and exit 1
            if debug:
                traceback.print_exc()
            hint = "" if debug or is_known(exc) else " (set TPUGEN_DEBUG=1 for the traceback)"
            typer.echo(f"error: {one_line(exc)}{hint}", err=True)
            raise typer.Exit(1) from None

    return wrapper


def _version(value: bool) -> None:
    if value:
        typer.echo(f"tpugen {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """tpugen: YAML run configs in, images plus a manifest and a timing report out."""


@app.command()
@_boundary
def validate(
    config: ConfigPath,
    overrides: Overrides = None,
    serve: Annotated[
        bool, typer.Option("--serve", help="Check it as `tpugen serve` reads it: prompts are optional.")
    ] = False,
) -> None:
    """Check a config (with overrides) and print it fully resolved as YAML, or every problem found."""
    from tpugen.config import load_config

    run = load_config(config, overrides or [], prompts_required=not serve)
    typer.echo(run.to_yaml(), nl=False)


@app.command()
@_boundary
def plan(
    config: ConfigPath,
    overrides: Overrides = None,
    chip: Annotated[
        str | None, typer.Option("--chip", help="v4, v5e, v5p or v6e: the chip the memory plan is for.")
    ] = None,
) -> None:
    """Print the shape keys, batches and padding, and whether the model fits a chip, loading no weights."""
    from tpugen.config import load_config

    if chip is not None:
        overrides = [*(overrides or []), f"execution.chip={chip}"]
    _show_plan(load_config(config, overrides or []))


def _show_plan(run) -> None:
    """What `tpugen plan` and `generate --plan` print: shapes, batches, attention, the cluster, memory."""
    from tpugen import app

    view = app.plan(run)
    memory = view.memory
    _print_plan(view.run_plan)
    flash = view.flash_attention
    if flash.on:
        out.print(f"flash attention: on ({', '.join(flash.components)}), unless the kernel fails at warmup")
    else:
        out.print(f"flash attention: off -- {flash.reason}", markup=False)  # reasons hold [brackets]
    if view.trace_once:
        out.print(view.trace_once, markup=False)
    if view.attention:
        out.print(view.attention["note"], markup=False)
    if view.controlnets:
        out.print(view.controlnets["note"], markup=False)
    for line in app.mode_plan(run):
        typer.echo(line)
    if memory is None:
        out.print(f"memory: {run.config.model.id} is neither on disk nor known to tpugen; no memory plan")
        return
    table = Table(title=f"memory in {run.config.model.dtype} ({memory.source})")
    for column in ("component", "parameters", "GB"):
        table.add_column(column, justify="right")
    for c in memory.components:
        table.add_row(c.name, f"{c.parameters / 1e9:.3f} B", f"{c.bytes / 1e9:.2f}")
    table.add_row("total", "", f"{memory.total_bytes / 1e9:.2f}")
    out.print(table)
    out.print(f"{memory.chip} ({memory.chip_gb:g} GB per chip): {memory.verdict} -- {memory.advice}")
    out.print(f"this config ({view.how}): {view.fit}")


def _print_plan(run_plan) -> None:
    table = Table(title="shape keys (each one is compiled once)")
    for column in ("shape key", "batches", "images", "padding rows"):
        table.add_column(column)
    for key in run_plan.shape_keys:
        batches = [b for b in run_plan.batches if b.shape == key]
        table.add_row(
            str(key), str(len(batches)), str(sum(len(b.items) for b in batches)), str(sum(b.padding for b in batches))
        )
    out.print(table)
    out.print(f"{len(run_plan.items)} images in {len(run_plan.batches)} batches")


class _RichDisplay:
    """Progress on stderr while the run goes; silent under --quiet."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self._bar = None
        self.task = None

    def phase(self, text: str) -> None:
        if not self.quiet:
            err.print(f"[dim]{escape(text)}[/dim]")  # text can hold brackets: torch_xla[pallas]

    def batches_started(self, total: int) -> None:
        if self.quiet:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._bar = Progress(
            TextColumn("generating"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[unit]}"),
            TimeElapsedColumn(),
            TextColumn("{task.fields[last]}"),
            console=err,
        )
        self._bar.start()
        self.task = self._bar.add_task("generate", total=total, last="", unit="batches")

    def batch_done(self, batch, seconds: float) -> None:
        if self._bar is not None:
            self._bar.update(self.task, advance=1, last=f"last: {batch.shape} {seconds:.2f}s")

    def progress(self, done: int, total: int, across: str = "all ranks") -> None:
        if self._bar is not None:
            self._bar.update(self.task, completed=done, total=total, unit="images", last=across)

    def finished(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def warning(self, text: str) -> None:
        typer.echo(f"warning: {text}", err=True)


def _print_summary(report: dict) -> None:
    timed = report["timed_phase"]
    table = Table(title=f"run {report['run_id']}")
    table.add_column("")
    table.add_column("value", justify="right")
    table.add_row("images", str(report["images"]))
    table.add_row("model load s", f"{report['model_load_seconds']:.2f}")
    for entry in report["warmup"]:
        compiles = "" if entry["compiles"] is None else f", {entry['compiles']} graphs"
        rank = f"rank {entry['rank']} " if "rank" in entry else ""
        rank = f"worker {entry['worker']} " if "worker" in entry else rank
        again = " again, without flash attention" if entry.get("again_without_flash_attention") else ""
        again += " again, recorded every step" if entry.get("again_traced_lazily") else ""
        table.add_row(f"{rank}warmup {entry['shape_key']}{again} s", f"{entry['seconds']:.2f}{compiles}")
    show = lambda v, fmt: "n/a" if v is None else fmt.format(v)  # noqa: E731
    table.add_row("timed phase s", show(timed["wall_seconds"], "{:.2f}"))
    table.add_row("per image s (mean)", show(timed["per_image_seconds"]["mean"], "{:.3f}"))
    table.add_row("images per s", show(timed["images_per_second"], "{:.2f}"))
    table.add_row("host ms per step", show(timed.get("host_ms_per_step"), "{:.2f}"))
    table.add_row("device ms per step", show(timed.get("device_ms_per_step"), "{:.2f}"))
    after = report["compiles_after_warmup"]
    table.add_row("compiles after warmup", "n/a (eager)" if after is None else str(after))
    out.print(table)


def _check_server_options(server: str, resume_dir: Path | None, skip_warmup: bool) -> None:
    """What --server cannot mean, in one line each, before anything is sent."""
    from urllib.parse import urlsplit

    from tpugen.errors import InputError

    problems = []
    try:
        parts = urlsplit(server)
        parts.port  # noqa: B018 -- raises ValueError on a port that is not a number
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        problems.append(f"--server: give the server's URL, like http://HOST:PORT; got {server!r}")
    if resume_dir is not None:
        problems.append("--resume: a server's runs are resumed on the server; leave --resume out with --server")
    if skip_warmup:
        problems.append("--skip-warmup: a server is warm already; leave it out with --server")
    if problems:
        raise InputError(*problems)


@app.command()
@_boundary
def generate(
    config: ConfigPath,
    overrides: Overrides = None,
    quiet: Quiet = False,
    skip_warmup: Annotated[
        bool, typer.Option("--skip-warmup", help="No compile pass before timing (first batches then include compiles).")
    ] = False,
    show_plan: Annotated[bool, typer.Option("--plan", help="Print the plan and exit; loads no model.")] = False,
    strict_shapes: Annotated[
        bool,
        typer.Option(
            "--strict-shapes", help="Stop with exit 1 if any batch compiles after warmup (execution.strict_shapes)."
        ),
    ] = False,
    resume_dir: Annotated[
        Path | None,
        typer.Option("--resume", help="Continue this run directory: keep its finished images, make the rest."),
    ] = None,
    mode: Annotated[
        str | None,
        typer.Option(
            "--mode",
            help="single (one chip), multi (one replica per chip of this VM: torch_xla.launch on xla, torchrun "
            "on torch_tpu, cuda and cpu) or ray (batches handed to the workers of a Ray cluster, execution.ray); "
            "execution.mode.",
        ),
    ] = None,
    server: Annotated[
        str | None,
        typer.Option(
            "--server",
            help="Run it on a warm `tpugen serve` at this URL (http://HOST:PORT) and copy its run directory into "
            "output.dir; this process loads no model (--resume and --skip-warmup do not apply).",
        ),
    ] = None,
    api_key: ClientApiKey = None,
) -> None:
    """Generate the config's images: load, compile each shape once, run timed, write images and a report."""
    from tpugen.config import load_config

    if strict_shapes:
        overrides = [*(overrides or []), "execution.strict_shapes=true"]
    if mode is not None:
        overrides = [*(overrides or []), f"execution.mode={mode}"]
    if server is not None:
        _check_server_options(server, resume_dir, skip_warmup)
    run = load_config(config, overrides or [])
    if show_plan:
        _show_plan(run)
        return
    from tpugen import app

    if server is not None:
        report = app.generate_on(run, server, api_key=api_key, display=_RichDisplay(quiet))
    else:
        report = app.generate(run, display=_RichDisplay(quiet), skip_warmup=skip_warmup, resume_dir=resume_dir)
    _finish(report, quiet)


@app.command()
@_boundary
def serve(
    config: ConfigPath,
    overrides: Overrides = None,
    host: Annotated[
        str, typer.Option("--host", help="The address to listen on; other than loopback needs an API key.")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=1, max=65535, help="The port to listen on.")] = 7860,
    api_key: ServerApiKey = None,
    quiet: Quiet = False,
) -> None:
    """Keep the config's model warm behind HTTP: the A1111 and OpenAI image APIs and tpugen runs (prompts optional)."""
    from tpugen import app as application
    from tpugen.config import load_config

    run = load_config(config, overrides or [], prompts_required=False)
    application.serve(run, host=host, port=port, api_key=api_key, display=_RichDisplay(quiet))


def _finish(report: dict, quiet: bool) -> None:
    run_dir = report["run_dir"]
    if report.get("already_complete"):
        typer.echo(f"{run_dir} is complete: {report['images']} of {report['images_planned']} images; nothing to do")
    elif not quiet:
        _print_summary(report)
    typer.echo(f"images: {run_dir}")
    typer.echo(f"report: {Path(run_dir) / 'report.md'}")


@app.command()
@_boundary
def resume(
    run_dir: Annotated[Path, typer.Argument(help="A run directory left by an interrupted or failed run.")],
    quiet: Quiet = False,
) -> None:
    """Finish an interrupted run from its own config.yaml: finished images are kept, the rest are made."""
    from tpugen import app

    report = app.resume(run_dir, display=_RichDisplay(quiet))
    _finish(report, quiet)


@app.command()
@_boundary
def models() -> None:
    """List the built-in tiny models, the built-in ControlNets and the pipeline families tpugen knows, with their
    defaults."""
    from tpugen.families import BUILTINS, CONTROLNETS, FAMILIES, KNOWN_MODELS
    from tpugen.models import model_defaults

    typer.echo("models (built-in tiny ones build offline; tiny-shapes draws what it is told, the others draw noise):")
    entries = [(name, f, b.description) for name, (b, f) in BUILTINS.items()]
    entries += [(model_id, f, known.note) for model_id, (known, f) in KNOWN_MODELS.items()]
    for model_id, f, note in entries:
        d = model_defaults(model_id, f)
        size = f"{d['height']}x{d['width']}"
        typer.echo(
            f"  {model_id:45} {f.name:12} {size:10} {d['steps']:>3} steps  guidance {d['guidance_scale']:<4}  {note}"
        )
    typer.echo("ControlNets (model.controlnets ids; built-in ones build offline):")
    for name, (builtin, f) in CONTROLNETS.items():
        typer.echo(f"  {name:45} {f.name:12} {builtin.description}")
    typer.echo("families (a pipeline is read by its model_index.json class; a class none of these covers is refused):")
    for f in FAMILIES.values():
        scheduler = "keeps its flow-matching scheduler" if f.flow_matching else "any model.scheduler name"
        size = f"{f.size}x{f.size}"
        typer.echo(
            f"  {f.name:12} {', '.join(f.pipeline_classes):26} {size:10} {f.steps:>3} steps  "
            f"guidance {f.guidance_scale:<4}  {f.guidance_note}; {scheduler}"
        )


@app.command()
@_boundary
def warmup(config: ConfigPath, overrides: Overrides = None, quiet: Quiet = False) -> None:
    """Compile every shape key the config will need, once each, and print what it cost."""
    from tpugen import app
    from tpugen.config import load_config

    result = app.warmup(load_config(config, overrides or []), display=_RichDisplay(quiet))
    table = Table(title=f"warmup on {result['device']['backend']} ({result['device']['device_kind']})")
    for column in ("shape key", "wall s", "compile s", "graphs compiled", "cache hits", "cache misses"):
        table.add_column(column, justify="right")
    show = lambda v, fmt="{}": "n/a" if v is None else fmt.format(v)  # noqa: E731
    cache = result["persistent_cache"]
    for entry in result["warmup"]:
        table.add_row(
            entry["shape_key"],
            show(entry["seconds"], "{:.2f}"),
            show(entry["compile_seconds"], "{:.2f}"),
            show(entry["compiles"]),
            show(entry["persistent_cache_hits"]) if cache["enabled"] else "off",
            show(entry["persistent_cache_misses"]) if cache["enabled"] else "off",
        )
    out.print(table)
    out.print(f"persistent compile cache: {cache['note']}" + (f" ({cache['dir']})" if cache.get("dir") else ""))


@app.command()
@_boundary
def calibrate(
    config: ConfigPath,
    overrides: Overrides = None,
    out_file: Annotated[
        Path | None,
        typer.Option(
            "--out",
            help="Where to write the ratios (YAML). Default: the file the config's compile.step_cache.mag_ratios "
            "names, else CONFIG's name with .mag_ratios.yaml beside it.",
        ),
    ] = None,
    quiet: Quiet = False,
) -> None:
    """Measure MagCache's mag_ratios for the config's model: its first batch once, nothing skipped, the ratio of
    each step's residual to the last one's. compile.step_cache.mag_ratios then names the file."""
    from tpugen import app
    from tpugen.config import load_config

    target = out_file or app.calibration_target(config)
    run = load_config(config, overrides or [], step_cache=False)
    result = app.calibrate(run, target, display=_RichDisplay(quiet))
    shown = ", ".join(f"{r:.4f}" for r in result.mag_ratios)
    out.print(f"mag_ratios ({result.steps} steps at {result.width}x{result.height}, {result.seconds:.1f} s): [{shown}]")
    out.print(f"wrote {target}; set compile.step_cache.mag_ratios: {target.name} (relative to the config)")


@app.command("pod-run")
@_boundary
def pod_run(
    config: ConfigPath,
    overrides: Overrides = None,
    tpu: Annotated[str, typer.Option("--tpu", help="The TPU VM (pod slice) name.", show_default=False)] = ...,
    zone: Annotated[str, typer.Option("--zone", help="Its zone, e.g. us-east5-b.", show_default=False)] = ...,
    project: Annotated[str | None, typer.Option("--project", help="Passed to every gcloud call.")] = None,
    workers: Annotated[
        int | None, typer.Option("--workers", min=1, help="Worker count; default: counted by gcloud describe.")
    ] = None,
    remote_dir: Annotated[
        str,
        typer.Option(
            "--remote-dir",
            help="Folder on every worker, relative to its home directory (~/DIR means the same): ASCII letters, "
            "digits, '.', '_', '-' and '/', no '..'.",
        ),
    ] = "tpugen-pod",
    gather: Annotated[
        str, typer.Option("--gather", help="local: copy every worker's run here and merge; none: leave them there.")
    ] = "local",
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print every gcloud command, one per line; run none.")
    ] = False,
    remote_tpugen: Annotated[
        str, typer.Option("--remote-tpugen", help="The tpugen command on the workers (e.g. ~/venv/bin/tpugen).")
    ] = "tpugen",
    quiet: Quiet = False,
    resume_id: Annotated[
        str | None,
        typer.Option(
            "--resume",
            help="Continue this pod run (its RUN_ID, or its folder directly under output.dir): each worker keeps "
            "what it finished.",
        ),
    ] = None,
) -> None:
    """Run the config on every worker of a TPU pod with gcloud, then gather the images and one pod report."""
    from tpugen import app
    from tpugen.config import load_config
    from tpugen.errors import InputError
    from tpugen.modes.pod import Pod

    if gather not in ("local", "none"):
        raise InputError(f"--gather: must be local or none, got {gather!r}")
    run = load_config(config, overrides or [])
    report = app.pod_run(
        run,
        Pod(tpu, zone, project),
        workers=workers,
        remote_dir=remote_dir,
        gather=gather == "local",
        dry_run=dry_run,
        tpugen=remote_tpugen,
        display=_RichDisplay(quiet),
        print_line=typer.echo,
        resume_id=resume_id,
    )
    if report is None:
        return
    if report.get("already_complete"):
        typer.echo(
            f"{report['run_dir']} is complete: {report['images']} of {report['images_planned']} images; nothing to do"
        )
    elif "run_dir" in report:
        typer.echo(f"pod run: {report['images']} images from {report['workers']} workers")
        typer.echo(f"report: {report['run_dir'].rstrip('/')}/report.md")
    else:
        typer.echo(f"ran on {report['workers']} workers; outputs left on them (--gather none)")


def main() -> None:
    """Console-script entry point."""
    sys.exit(app())
