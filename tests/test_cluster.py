"""execution.mode: ray on a real Ray cluster on this machine: the images of one chip, lost workers survived,
every worker lost and resumed, and bad input refused in one line before any model loads."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import (
    COMPILED_VS_EAGER,
    OTHER_DEVICE_COUNT,
    assert_same_images,
    forked_python,
    forked_tpugen,
    generate,
    run_cli,
    save_disc,
    tiny_config,
    write_config,
)

from tpugen.modes.ray.resources import Node, actor_options, worker_count, worker_resources
from tpugen.outputs.manifest import read_manifest
from tpugen.outputs.png import image_filename

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [f"a small {w}" for w in ["cat", "dog", "owl", "fox", "bee", "elk", "yak", "emu"]]
STEPS = 20  # long enough that a worker can be killed with batches left; steps never recompile
NAMES = [image_filename(i, 7 + i, p) for i, p in enumerate(PROMPTS)]


# ---------------------------------------------------------------- what the driver asks for (pure)


class _Settings:
    def __init__(self, workers="auto", resources_per_worker=None) -> None:
        self.workers, self.resources_per_worker = workers, resources_per_worker


TPU_HOSTS = [Node(f"n{i}", f"10.0.0.{i}", {"CPU": 8.0, "TPU": 4.0}) for i in range(3)]
CPU_NODES = [Node("a", "10.0.1.1", {"CPU": 16.0}), Node("b", "10.0.1.2", {"CPU": 4.0})]


def test_workers_and_resources_follow_the_cluster():
    assert worker_resources(_Settings(), TPU_HOSTS) == {"TPU": 4.0}
    assert worker_count(_Settings(), TPU_HOSTS, {"TPU": 4.0}) == 3  # one per TPU host
    assert worker_count(_Settings(), TPU_HOSTS, {"TPU": 1}) == 12  # one per chip
    # A head node without TPUs takes no worker of a TPU cluster.
    assert worker_count(_Settings(), [Node("h", "", {"CPU": 4.0}), *TPU_HOSTS], {"TPU": 4.0}) == 3
    assert worker_resources(_Settings(), CPU_NODES) == {"CPU": 1}
    assert worker_count(_Settings(), CPU_NODES, {"CPU": 1}) == 2  # one per node
    assert worker_count(_Settings(workers=20), CPU_NODES, {"CPU": 1}) == 20
    assert actor_options({"TPU": 4.0}, 3) == {"max_restarts": 3, "max_task_retries": 0, "resources": {"TPU": 4.0}}
    assert actor_options({"CPU": 2, "GPU": 1, "x": 1}, 0) == {
        "max_restarts": 0,
        "max_task_retries": 0,
        "num_cpus": 2,
        "num_gpus": 1,
        "resources": {"x": 1},
    }


@pytest.mark.parametrize(
    "settings,nodes,expected",
    [
        (
            _Settings(workers=21),
            CPU_NODES,
            "execution.ray.workers: 21 workers of {CPU: 1} asked for, and the cluster has room for 20 "
            "(its nodes: {CPU: 16}, {CPU: 4})",
        ),
        (
            _Settings(resources_per_worker={"TPU": 8}),
            TPU_HOSTS,
            "execution.ray.resources_per_worker: no node of the cluster has {TPU: 8} (its nodes: 3 x {CPU: 8, TPU: 4})",
        ),
        (
            _Settings(),
            [*TPU_HOSTS, Node("big", "", {"TPU": 8.0})],
            "execution.ray.resources_per_worker: the cluster's TPU hosts have 4 and 8 chips; set it (e.g. {TPU: 4}) "
            "to say what one worker takes",
        ),
    ],
    ids=["too many workers", "no node has it", "hosts differ"],
)
def test_what_the_cluster_cannot_give_is_one_line(settings, nodes, expected):
    from tpugen.errors import InputError

    with pytest.raises(InputError) as caught:
        worker_count(settings, nodes, worker_resources(settings, nodes))
    assert caught.value.lines == [expected]


def test_where_the_workers_are_never_changes_the_config_hash(tmp_path):
    from tpugen.config import load_config

    def hash_of(name: str, **execution) -> str:
        return load_config(write_config(tmp_path / name, tiny_config(tmp_path, execution=execution))).config_hash

    ray = hash_of("a.yaml", mode="ray", ray={"address": "auto", "workers": 2})
    assert ray == hash_of("b.yaml", mode="ray", ray={"address": "10.0.0.1:6379", "max_restarts": 0})
    assert ray != hash_of("c.yaml", mode="single")


# ---------------------------------------------------------------- a real cluster on this machine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_env() -> dict[str, str]:
    """The cluster's and the drivers' environment: this worktree's tpugen, XLA:CPU, the tests' model cache, and
    no Ray token (a token file would land in the home directory), and workers at the test processes' priority:
    Ray starts its workers at niceness 15 (RAY_worker_niceness), meant for a node that is Ray's alone; here the
    other test process keeps both cores busy, and a worker at 15 got so little of them that a warm 64x64 batch
    overran a 10 s deadline (a tiny warmup took 75-80 s beside two busy loops, against 13 s at niceness 0)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {
        **os.environ,
        "PYTHONPATH": path,
        "PJRT_DEVICE": "CPU",
        "RAY_AUTH_MODE": "disabled",
        "RAY_worker_niceness": "0",
    }


@pytest.fixture(scope="module")
def ray_cluster():
    """One Ray head node for the session (2 CPUs, a small object store, no dashboard), stopped at the end:
    every process of it is in the session `ray start` leads, so it is stopped by that group alone."""
    port, client_port = _free_port(), _free_port()
    temp = tempfile.mkdtemp(prefix="tpugen-ray-", dir="/tmp")  # short: Ray's socket paths live under it
    ray = str(Path(sys.executable).parent / "ray")
    head = subprocess.Popen(
        [
            ray,
            "start",
            "--head",
            "--block",
            f"--port={port}",
            f"--ray-client-server-port={client_port}",
            "--num-cpus=2",
            "--object-store-memory=100000000",
            "--include-dashboard=false",
            "--disable-usage-stats",
            f"--temp-dir={temp}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=_ray_env(),
        start_new_session=True,
    )
    address = f"127.0.0.1:{port}"
    try:
        # Ready once a node with its CPUs has joined, not merely once the GCS port answers, and once Ray Client
        # opens a session with a runtime_env as the drivers' do: the proxy asks the node's runtime env agent for
        # it, which comes up after the node (on a busy machine, a first client could fail its init on that).
        wait = (
            f"import ray, sys, time; ray.init(address={address!r}, logging_level='ERROR')\n"
            "for _ in range(100):\n"
            "    if any(n['Alive'] and n['Resources'].get('CPU') for n in ray.nodes()): break\n"
            "    time.sleep(0.2)\n"
            "else: sys.exit(1)\n"
            "ray.shutdown()\n"
            f"ray.init(address='ray://127.0.0.1:{client_port}', logging_level='ERROR',\n"
            "         runtime_env={'env_vars': {'PJRT_DEVICE': 'CPU'}})\n"
            "ray.shutdown()\n"
        )
        deadline = time.time() + 120
        while subprocess.run([sys.executable, "-c", wait], env=_ray_env(), capture_output=True).returncode:
            assert head.poll() is None and time.time() < deadline, "ray start --head did not come up"
            time.sleep(0.5)
        yield {"address": address, "client": f"ray://127.0.0.1:{client_port}"}
    finally:
        # SIGKILL: a graceful stop takes Ray over 30 s here, and nothing of a test cluster needs keeping.
        os.killpg(head.pid, signal.SIGKILL)
        head.wait()
        shutil.rmtree(temp, ignore_errors=True)


def ray_config(tmp: Path, address: str, forked_workers: bool = True, **ray) -> dict:
    """A run on the tests' cluster. Its Ray workers are forked from the tests' zygote (tests/zygote.py) through
    Ray's own runtime_env py_executable, which Ray starts each worker process with: ~10 s of imports less each,
    a worker process otherwise as Ray starts it (its argv, environment and descriptors; Ray kills and restarts
    it by its pid). forked_workers=False: the Python Ray starts by default."""
    if forked_workers:
        ray = {"runtime_env": {"py_executable": forked_python()[0]}, **ray}
    return tiny_config(
        tmp,
        prompts=PROMPTS,
        batch_size=1,
        steps=STEPS,
        execution={"mode": "ray", "ray": {"address": address, "workers": 2, **ray}},
    )


def start_driver(tmp: Path, config: dict, *args: str) -> tuple[subprocess.Popen, Path]:
    """`tpugen generate` as a user starts it: the driver in a process of its own."""
    tmp.mkdir(parents=True, exist_ok=True)
    path = write_config(tmp / "ray.yaml", config)
    proc = subprocess.Popen(
        [forked_tpugen(), "generate", str(path), "--quiet", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_ray_env(),
    )
    return proc, Path(config["output"]["dir"]) / config["output"]["run_id"]


def workers_when(proc: subprocess.Popen, run_dir: Path, ready, timeout: float = 300) -> dict:
    """workers.json once `ready(it)` holds, read as the run goes."""
    deadline = time.time() + timeout
    while True:
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "the run never got there"
        try:
            state = json.loads((run_dir / "workers.json").read_text())
        except (OSError, ValueError):
            state = None
        if state and ready(state):
            return state
        time.sleep(0.05)


def errors(stderr: str) -> list[str]:
    """tpugen's own lines (Ray's raylet also prints to the driver's stderr when a worker dies)."""
    return [line for line in stderr.splitlines() if line.startswith("error:")]


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    return generate(tmp_path_factory.mktemp("single"), prompts=PROMPTS, batch_size=1, steps=STEPS)


@pytest.mark.xla
def test_two_workers_make_the_images_of_one_chip(ray_cluster, single, tmp_path):
    # Through Ray Client (ray://): the tests below join by the GCS address.
    proc, run_dir = start_driver(tmp_path, ray_config(tmp_path, ray_cluster["client"], forked_workers=False))
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    assert sorted(p.name for p in run_dir.glob("[0-9]*.png")) == NAMES
    assert [r["index"] for r in read_manifest(run_dir / "manifest.jsonl")] == list(range(len(PROMPTS)))
    assert_same_images(run_dir, single, OTHER_DEVICE_COUNT)
    report = json.loads((run_dir / "report.json").read_text())
    assert report["complete"] and report["mode"] == "ray" and report["images"] == len(PROMPTS)
    assert report["compiles_after_warmup"] == 0
    table = report["ray"]["per_worker"]
    assert [w["index"] for w in table] == [0, 1] and sum(w["batches_done"] for w in table) == len(PROMPTS)
    assert report["ray"]["lost_workers"] == [] and report["ray"]["retried_batches"] == []
    workers = json.loads((run_dir / "workers.json").read_text())["workers"]
    assert all(w["pid"] and w["node"] for w in workers)
    assert "## Ray workers (2)" in (run_dir / "report.md").read_text()


@pytest.mark.xla
def test_two_workers_on_backend_jax_make_the_images_of_one_chip(ray_cluster, single, tmp_path):
    """execution.backend: jax on Ray: each worker a JAX process with an engine of its own, its loop one call a
    batch; the images one chip's on xla (within 2/255), each made once, nothing compiled after warmup."""
    config = ray_config(tmp_path, ray_cluster["address"])
    config["execution"]["backend"] = "jax"
    proc, run_dir = start_driver(tmp_path, config)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    assert [r["index"] for r in read_manifest(run_dir / "manifest.jsonl")] == list(range(len(PROMPTS)))
    assert_same_images(run_dir, single, COMPILED_VS_EAGER)
    report = json.loads((run_dir / "report.json").read_text())
    assert report["complete"] and report["mode"] == "ray" and report["compiles_after_warmup"] == 0
    assert report["device"]["backend"] == "jax"
    assert sum(w["batches_done"] for w in report["ray"]["per_worker"]) == len(PROMPTS)


@pytest.mark.xla
def test_controlnet_units_on_a_ray_worker_make_the_images_of_one_chip(ray_cluster, tmp_path):
    """ControlNet on Ray: the worker loads model.controlnets beside the pipeline and reads the control images, and
    the images are one chip's (one worker: the two-worker split is the tests' above, and each worker compiles)."""
    save_disc(tmp_path / "disc.png")
    prompts = [
        {"prompt": "a small cat", "control_image": str(tmp_path / "disc.png")},
        {"prompt": "a small dog", "control_image": str(tmp_path / "disc.png"), "control_module": "invert"},
    ]
    model = {"id": "tiny-sd", "controlnets": [{"id": "tiny-sd-controlnet"}]}
    one_chip = generate(tmp_path / "single", prompts=prompts, batch_size=1, model=model)
    config = ray_config(tmp_path / "ray", ray_cluster["address"], workers=1)
    config.update(prompts=prompts, model=model, steps=3)
    proc, run_dir = start_driver(tmp_path / "ray", config)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    assert_same_images(run_dir, one_chip, OTHER_DEVICE_COUNT)
    records = read_manifest(run_dir / "manifest.jsonl")
    assert [r["controlnet_units"][0]["module"] for r in records] == ["none", "invert"]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["compiles_after_warmup"] == 0 and [w["batches_done"] for w in report["ray"]["per_worker"]] == [2]


@pytest.mark.xla
def test_a_killed_worker_costs_only_its_batches_in_flight(ray_cluster, single, tmp_path):
    proc, run_dir = start_driver(tmp_path, ray_config(tmp_path, ray_cluster["address"]))
    state = workers_when(
        proc,
        run_dir,
        lambda s: any(w["state"] == "ready" and w["batches_done"] and w["in_flight"] for w in s["workers"]),
    )
    victim = next(w for w in state["workers"] if w["state"] == "ready" and w["batches_done"] and w["in_flight"])
    os.kill(victim["pid"], signal.SIGKILL)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    assert [r["index"] for r in read_manifest(run_dir / "manifest.jsonl")] == list(range(len(PROMPTS)))
    assert_same_images(run_dir, single, OTHER_DEVICE_COUNT)
    report = json.loads((run_dir / "report.json").read_text())
    ray = report["ray"]
    assert report["complete"] and ray["lost_workers"] == [victim["index"]]
    lost = next(w for w in ray["per_worker"] if w["index"] == victim["index"])["lost_batches"]
    assert lost and set(lost) <= set(ray["retried_batches"]) and victim["pid"] in lost_pids(ray)
    markdown = (run_dir / "report.md").read_text()
    assert f"worker {victim['index']} lost (pid {victim['pid']}" in markdown
    assert f"batch {lost[0]} retried on worker" in markdown


def lost_pids(ray: dict) -> list[int]:
    return [e["pid"] for e in ray["events"] if e["event"] == "lost"]


@pytest.mark.xla
def test_every_worker_lost_stops_in_one_line_and_resume_finishes(ray_cluster, single, tmp_path):
    proc, run_dir = start_driver(tmp_path, ray_config(tmp_path, ray_cluster["address"], max_restarts=0))
    state = workers_when(
        proc, run_dir, lambda s: all(w["pid"] for w in s["workers"]) and 1 <= s["images_done"] < s["images_planned"]
    )
    for worker in state["workers"]:
        os.kill(worker["pid"], signal.SIGKILL)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 1, err
    lines = errors(err)
    assert lines[0].startswith(
        "error: every Ray worker is gone (worker 0 lost; worker 1 lost; max_restarts: 0): the run stopped; "
    )
    assert lines[0].endswith(f"of {len(PROMPTS)} images, the manifest and report.json are in {run_dir}")
    assert lines[1:] == [f"error: resume with: tpugen resume {run_dir}"]
    kept = [r["index"] for r in read_manifest(run_dir / "manifest.jsonl")]
    assert 1 <= len(kept) < len(PROMPTS)
    assert json.loads((run_dir / "report.json").read_text())["complete"] is False
    assert {w["state"] for w in json.loads((run_dir / "workers.json").read_text())["workers"]} == {"lost"}

    # A killed driver: its workers go with it (Ray stops the actors a dead driver owned), the run stays resumable.
    # This session runs one worker: execution.ray names where the work runs, so a resume may change it.
    resume = subprocess.Popen(
        [
            forked_tpugen(),
            "generate",
            str(tmp_path / "ray.yaml"),
            "--resume",
            str(run_dir),
            "--quiet",
            "execution.ray.workers=1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_ray_env(),
    )
    workers_when(resume, run_dir, lambda s: s["images_done"] > len(kept) and s["images_done"] < s["images_planned"])
    resume.kill()
    resume.communicate()
    assert json.loads((run_dir / "report.json").read_text())["complete"] is False

    resumed = subprocess.run(
        [forked_tpugen(), "resume", str(run_dir), "--quiet"],
        capture_output=True,
        text=True,
        env=_ray_env(),
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert [r["index"] for r in read_manifest(run_dir / "manifest.jsonl")] == list(range(len(PROMPTS)))
    report = json.loads((run_dir / "report.json").read_text())
    assert report["complete"] and report["images_reused"] > len(kept)
    assert len(report["earlier_sessions"]) == 1  # the killed driver wrote no report of its own
    assert_same_images(run_dir, single, OTHER_DEVICE_COUNT)


@pytest.mark.xla
def test_a_model_no_worker_can_load_leaves_no_run(ray_cluster, tmp_path):
    model = tmp_path / "broken"
    model.mkdir()
    (model / "model_index.json").write_text(
        '{"_class_name": "StableDiffusionPipeline", "unet": ["diffusers", "UNet2DConditionModel"]}'
    )
    config = ray_config(tmp_path, ray_cluster["address"])
    config["model"]["id"] = str(model)
    proc, run_dir = start_driver(tmp_path, config)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode in (1, 2), err
    lines = errors(err)
    assert len(lines) == 1 and lines[0].startswith(f"error: model.id: cannot load '{model}'"), err
    assert not (tmp_path / "outputs").exists()


@pytest.mark.xla
def test_a_batch_that_fails_stops_the_run_and_says_how_to_resume(ray_cluster, tmp_path):
    # No warmup under strict shapes: the first batch a worker makes compiles, which strict shapes refuses.
    config = ray_config(tmp_path, ray_cluster["address"], workers=1)
    config["execution"]["strict_shapes"] = True
    proc, run_dir = start_driver(tmp_path, config, "--skip-warmup")
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 1, err
    lines = errors(err)
    assert lines[0].startswith("error: worker 0: batch 0: strict shapes: batch 0 (64x64 b1 cfg) compiled"), err
    assert lines[-1] == f"error: resume with: tpugen resume {run_dir}"
    report = json.loads((run_dir / "report.json").read_text())
    assert report["complete"] is False and report["error"].startswith("worker 0: batch 0: strict shapes")
    assert 0 not in [r["index"] for r in read_manifest(run_dir / "manifest.jsonl")]


# A driver whose workers misbehave once per run: the driver makes its actors of a subclass defined in its
# __main__, which Ray pickles by value, so the workers run it as defined here (tpugen itself knows nothing of it).
# argv: a marker file (made by the first call that misbehaves, so that a restarted process, or a second call,
# behaves), the fault, then tpugen's own arguments.
FAULTY_DRIVER = """
import sys, time
from pathlib import Path

import ray
from tpugen.modes.ray import worker

Host = worker._RayHost  # left in place (Ray pickles it by name); named here rather than through super()


class Faulty(Host):
    marker, fault = Path(sys.argv[1]), sys.argv[2]

    def _first(self) -> bool:
        try:
            self.marker.open("x").close()
        except FileExistsError:
            return False
        return True

    def start(self):
        # What the driver meets when Ray loses a worker while it starts and restarts it (a preempted node):
        # Ray's ActorDiedError, from the start call.
        if self.fault == "died while starting" and self._first():
            raise ray.exceptions.ActorDiedError()
        return Host.start(self)

    def run_batch(self, batch, run_dir, done):
        if self.fault == "hung batch" and self._first():
            time.sleep(3600)  # hung: never answers, until the driver has it killed
        return Host.run_batch(self, batch, run_dir, done)


real_remote = ray.remote


def remote(*args, **options):
    return real_remote(*(Faulty if a is Host else a for a in args), **options)


ray.remote = remote
sys.argv = ["tpugen", *sys.argv[3:]]
from tpugen.cli import main

main()
"""


def run_faulty_driver(tmp: Path, config: dict, fault: str, timeout: float = 150) -> tuple[int, str, Path]:
    """(exit status, stderr, run directory) of a driver whose worker misbehaves once (FAULTY_DRIVER); a driver
    still running after `timeout` is killed (its workers go with it) and the test fails."""
    tmp.mkdir(parents=True, exist_ok=True)
    path = write_config(tmp / "ray.yaml", config)
    command = [
        *forked_python(),
        "-c",
        FAULTY_DRIVER,
        str(tmp / "fault.marker"),
        fault,
        "generate",
        str(path),
        "--quiet",
    ]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_ray_env())
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    if proc.returncode == -signal.SIGKILL:
        pytest.fail(f"the driver was still running after {timeout:g} s ({fault}); it printed: {err[-2000:]!r}")
    assert (tmp / "fault.marker").exists(), "the fault never happened"
    return proc.returncode, err, Path(config["output"]["dir"]) / config["output"]["run_id"]


@pytest.mark.xla
def test_a_hung_worker_misses_its_batch_deadline_is_killed_and_restarted(ray_cluster, tmp_path):
    # One worker, whose first batch never returns: past the deadline its batches go back to the queue and the
    # driver has Ray kill it; Ray restarts it (max_restarts 3), and the restarted process makes every image.
    # 10 s: the deadline counts only for warm shape keys (the restarted process warms up first, without one), and a
    # warm batch of one 64x64 image took 1.2 s on two cores busy with the other test process.
    deadline = 10
    config = ray_config(tmp_path, ray_cluster["address"], workers=1, batch_timeout_s=deadline)
    status, err, run_dir = run_faulty_driver(tmp_path, config, "hung batch")
    assert status == 0, err
    assert [r["index"] for r in read_manifest(run_dir / "manifest.jsonl")] == list(range(len(PROMPTS)))
    report = json.loads((run_dir / "report.json").read_text())
    ray = report["ray"]
    assert report["complete"] and ray["batch_timeout_s"] == deadline and ray["lost_workers"] == [0]
    # One loss, the deadline's, and one restart: while Ray restarts the killed process it answers the driver's
    # greet with ActorUnavailableError, which is no second loss (a busy full run once counted one).
    losses = [e for e in ray["events"] if e["event"] == "lost"]
    assert len(losses) == 1, (ray["events"], err[-3000:])
    [lost] = losses
    assert lost["reason"] == f"batch {lost['batches'][0]} not done within {deadline} s" and len(lost["batches"]) == 2
    assert ray["restarts"] == 1 and set(lost["batches"]) <= set(ray["retried_batches"])
    [worker] = ray["per_worker"]
    assert len(worker["pids"]) == 2 and worker["losses"] == 1 and worker["state"] == "done"
    assert worker["compiles_after_warmup"] == 0
    assert (
        f"worker 0 lost (pid {lost['pid']}, batch {lost['batches'][0]} not done within {deadline} s)"
        in (run_dir / "report.md").read_text()
    )


@pytest.mark.xla
def test_a_worker_that_dies_while_it_starts_is_greeted_again_while_restarts_remain(ray_cluster, tmp_path):
    # Ray's ActorDiedError from a worker's start, with max_restarts left, is not the end of that worker.
    config = ray_config(tmp_path, ray_cluster["address"], workers=1)
    status, err, run_dir = run_faulty_driver(tmp_path, config, "died while starting")
    assert status == 0, err
    assert [r["index"] for r in read_manifest(run_dir / "manifest.jsonl")] == list(range(len(PROMPTS)))
    report = json.loads((run_dir / "report.json").read_text())
    [worker] = report["ray"]["per_worker"]
    assert report["complete"] and worker["losses"] == 1 and worker["batches_done"] == len(PROMPTS)
    assert [e["event"] for e in report["ray"]["events"] if e["event"] in ("lost", "gone")] == ["lost"]


# ---------------------------------------------------------------- bad input: one line, nothing written


@pytest.mark.parametrize(
    "ray,output,env,expected",
    [
        (
            {"address": "127.0.0.1:{closed}", "connect_timeout_s": 2},
            None,
            {},
            "execution.ray.address: 127.0.0.1:{closed} (127.0.0.1:{closed}) does not answer: Connection refused",
        ),
        (
            {"resources_per_worker": {"TPU": 4}},
            None,
            {},
            "execution.ray.resources_per_worker: no node of the cluster has {TPU: 4} (its nodes: {CPU: 2})",
        ),
        (
            {"workers": 3},
            None,
            {},
            "execution.ray.workers: 3 workers of {CPU: 1} asked for, and the cluster has room for 2 (its nodes: {CPU: 2})",
        ),
        (
            {"address": "auto", "resources_per_worker": {"TPU": 4}},
            None,
            {"RAY_ADDRESS": "{address}"},
            "execution.ray.resources_per_worker: no node of the cluster has {TPU: 4} (its nodes: {CPU: 2})",
        ),
        (
            {"address": "local", "resources_per_worker": {"TPU": 4}},
            None,
            {},
            "execution.ray.resources_per_worker: no node of the cluster has {TPU: 4} (its nodes: {CPU: ",
        ),
        (
            {},
            "gs://bucket/runs",
            {},
            "output.dir: a gs:// run directory for execution.mode: ray is written with google-cloud-storage, which is "
            "not installed; give a path every worker sees (NFS, Filestore, a GCS FUSE mount)",
        ),
    ],
    ids=["address does not answer", "resources it lacks", "more workers than fit", "auto", "local", "gs"],
)
@pytest.mark.xla  # the slow tier: it starts a Ray head, which `pytest -m "not xla"` never does
def test_what_cannot_run_is_one_line_before_any_model_loads(
    ray_cluster, tmp_path, monkeypatch, ray, output, env, expected
):
    closed = _free_port()
    fill = lambda text: text.replace("{closed}", str(closed)).replace("{address}", ray_cluster["address"])  # noqa: E731
    settings = {"address": ray_cluster["address"], **{k: fill(v) if isinstance(v, str) else v for k, v in ray.items()}}
    config = tiny_config(tmp_path, execution={"mode": "ray", "ray": settings})
    if output:
        config["output"]["dir"] = output
    for key, value in {**_ray_env(), **{k: fill(v) for k, v in env.items()}}.items():
        monkeypatch.setenv(key, value)
    result = run_cli("generate", write_config(tmp_path / "c.yaml", config), "--quiet")
    assert result.exit_code == 2, result.output
    lines = errors(result.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: " + fill(expected)), result.stderr
    assert not (tmp_path / "outputs").exists()
    ray_module = sys.modules.get("ray")
    assert ray_module is None or not ray_module.is_initialized()  # left the cluster (and stopped a local one)


def test_ray_not_installed_is_one_line_naming_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` meets without it installed
    path = write_config(tmp_path / "c.yaml", tiny_config(tmp_path, execution={"mode": "ray"}))
    result = run_cli("generate", path, "--quiet")
    assert result.exit_code == 2
    assert result.stderr == "error: execution.mode: ray needs Ray, which is not installed: pip install 'tpugen[ray]'\n"
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize(
    "execution,expected",
    [
        (
            {"mode": "ray", "pod": {"num_workers": 4}},
            "execution.pod: is for tpugen pod-run's workers (a fixed share per pod worker); execution.mode: ray hands "
            "batches to Ray workers, one host each: leave execution.pod unset",
        ),
        ({"mode": "single", "ray": {"workers": 2}}, "execution.ray: is used only with execution.mode: ray"),
        (
            {"mode": "ray", "ray": {"workers": 0}},
            "execution.ray.workers: must be a number of workers (1 or more) or auto, got 0",
        ),
        (
            {"mode": "ray", "ray": {"address": "ray:/host"}},
            "execution.ray.address: must be local, auto, ray://HOST:PORT or HOST:PORT, got 'ray:/host'",
        ),
    ],
    ids=["with a pod", "ray keys without ray", "no workers", "bad address"],
)
def test_ray_keys_are_checked_at_the_door(tmp_path, execution, expected):
    result = run_cli("validate", write_config(tmp_path / "c.yaml", tiny_config(tmp_path, execution=execution)))
    assert result.exit_code == 2
    assert result.stderr == f"error: {expected}\n"


def test_plan_says_what_a_ray_run_asks_for(tmp_path):
    config = tiny_config(tmp_path, execution={"mode": "ray", "ray": {"address": "auto", "workers": 4}})
    result = run_cli("generate", write_config(tmp_path / "c.yaml", config), "--plan")
    assert result.exit_code == 0, result.output
    assert (
        "ray: address auto; workers: 4; each worker asks for {TPU: chips per host} on a cluster with TPUs, else "
        "{CPU: 1}" in result.stdout
    )


def test_a_job_dashboard_ray_address_is_refused_naming_the_variable(monkeypatch):
    from tpugen.errors import InputError
    from tpugen.modes.ray.join import _target

    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:8265")
    with pytest.raises(InputError) as refused:
        _target(None, "auto")  # before ray.init, which would try to resolve a host named "http://127.0.0.1"
    assert refused.value.lines == [
        "RAY_ADDRESS: must be ray://HOST:PORT or HOST:PORT (execution.ray.address: auto reads it), got "
        "'http://127.0.0.1:8265'"
    ]
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.2:6379")
    assert _target(None, "auto") == "10.0.0.2:6379"


def test_a_taken_run_id_is_refused_before_the_cluster_starts(tmp_path, monkeypatch):
    from tpugen.config import load_config
    from tpugen.errors import InputError
    from tpugen.modes.ray import driver

    config = tiny_config(tmp_path, execution={"mode": "ray", "ray": {"address": "local", "workers": 1}})
    run = load_config(write_config(tmp_path / "c.yaml", config))
    taken = tmp_path / "outputs" / "run"
    taken.mkdir(parents=True)
    (taken / "notes.txt").write_text("someone's\n")

    def no_cluster(run):
        raise AssertionError("the cluster was started for a run that cannot be written")

    monkeypatch.setattr(driver, "Cluster", no_cluster)
    with pytest.raises(InputError, match="output.run_id: .* already exists and is not empty"):
        driver.run_cluster(run)


def test_a_local_cluster_that_fails_to_start_is_stopped_and_named_in_one_line(tmp_path, monkeypatch):
    from tpugen.config import load_config
    from tpugen.errors import RunError
    from tpugen.modes.ray import join

    calls = []

    class HalfStartedRay:
        def init(self, **options):
            calls.append("init")
            raise RuntimeError("Failed to start the GCS server.\nsee /tmp/ray/session_latest/logs")

        def is_initialized(self):
            return True  # the node came up before the failure

        def shutdown(self):
            calls.append("shutdown")

    monkeypatch.setattr(join, "import_ray", HalfStartedRay)
    config = tiny_config(tmp_path, execution={"mode": "ray", "ray": {"address": "local", "workers": 1}})
    run = load_config(write_config(tmp_path / "c.yaml", config))
    with pytest.raises(RunError) as failed, join.Cluster(run):
        pass
    assert failed.value.lines == [
        "execution.ray.address: local: could not start a Ray cluster: RuntimeError: Failed to start the GCS server."
    ]
    assert calls == ["init", "shutdown"]


def test_a_ray_client_refused_at_init_is_named_by_the_servers_own_reason(tmp_path, monkeypatch):
    """Ray Client's init failure carries the server's traceback after its first line; the reason is its last."""
    from tpugen.config import load_config
    from tpugen.errors import InputError
    from tpugen.modes.ray import join

    server_traceback = (
        "Initialization failure from server:\n"
        "Traceback (most recent call last):\n"
        '  File "proxier.py", line 770, in Datapath\n'
        "    if not self.proxy_manager.start_specific_server(\n"
        "TimeoutError: GetOrCreateRuntimeEnv request failed after 5 attempts. Last exception: <urlopen error>\n"
    )

    class RefusingRay:
        def init(self, **options):
            raise ConnectionAbortedError(server_traceback)

        def is_initialized(self):
            return False

    listener = socket.create_server(("127.0.0.1", 0))  # the proxy's port answers; its init is what fails
    try:
        address = f"ray://127.0.0.1:{listener.getsockname()[1]}"
        monkeypatch.setattr(join, "import_ray", RefusingRay)
        config = tiny_config(tmp_path, execution={"mode": "ray", "ray": {"address": address, "workers": 1}})
        run = load_config(write_config(tmp_path / "c.yaml", config))
        with pytest.raises(InputError) as failed, join.Cluster(run):
            pass
    finally:
        listener.close()
    assert failed.value.lines == [
        f"execution.ray.address: cannot join the Ray cluster at {address}: ConnectionAbortedError: "
        "Initialization failure from server: TimeoutError: GetOrCreateRuntimeEnv request failed after 5 attempts. "
        "Last exception: <urlopen error>"
    ]
