"""The tests' forked tpugen (tests/zygote.py) answers as the console script does: exit codes, its output, the
environment it was given, a signal's exit, and a fresh interpreter where the environment needs one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zygote
from conftest import TPUGEN, forked_tpugen, tiny_config, write_config

pytestmark = pytest.mark.xla  # the zygote imports torch_xla


def _both(*args: str, **kwargs) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    run = dict(capture_output=True, text=True, timeout=120, **kwargs)
    return subprocess.run([forked_tpugen(), *args], **run), subprocess.run([TPUGEN, *args], **run)


def test_exit_codes_output_and_environment_are_the_scripts(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    forked, real = _both("validate", str(bad))
    assert (forked.returncode, forked.stdout, forked.stderr) == (real.returncode, real.stdout, real.stderr)
    assert forked.returncode == 2 and forked.stderr.startswith("error: ")
    good = write_config(tmp_path / "good.yaml", tiny_config(tmp_path))
    # The working directory and the environment are the client's: a relative path, an override from it.
    env = {**os.environ, "TPUGEN_CACHE": str(tmp_path / "cache")}
    forked, real = _both("validate", "good.yaml", cwd=tmp_path, env=env)
    assert (forked.returncode, forked.stdout) == (real.returncode, real.stdout) and forked.returncode == 0
    assert good.is_file()


def test_a_signal_reaches_the_child_and_a_killed_client_takes_it_along(tmp_path):
    config = tiny_config(tmp_path, prompts=["a cat"] * 3, batch_size=1, steps=20)
    path = write_config(tmp_path / "c.yaml", config)
    manifest = tmp_path / "outputs" / "run" / "manifest.jsonl"
    proc = subprocess.Popen([forked_tpugen(), "generate", str(path), "--quiet"], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not manifest.exists() or not manifest.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(120) == 143  # tpugen's own answer to SIGTERM, passed back
    assert "error: interrupted by SIGTERM" in proc.stderr.read()

    config["output"]["run_id"] = "killed"
    path = write_config(tmp_path / "k.yaml", config)
    # The environment the zygote started with: forked whatever an earlier test left in this process's own.
    env = {**zygote.BASE_ENV, "PJRT_DEVICE": "CPU"}
    proc = subprocess.Popen([forked_tpugen(), "generate", str(path), "--quiet"], stderr=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 60
    while not _children_of_zygote() and time.monotonic() < deadline:  # the one child this test process forks
        time.sleep(0.05)
    assert _children_of_zygote(), "the forked child never showed up"
    proc.kill()
    proc.wait(30)
    deadline = time.monotonic() + 30
    while _children_of_zygote() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _children_of_zygote() == []
    killed = tmp_path / "outputs" / "killed" / "manifest.jsonl"  # killed mid-run, not ended on its own
    assert not killed.exists() or len(killed.read_text().splitlines()) < 3


def test_an_environment_read_at_import_gets_a_fresh_interpreter(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("import sys\nprint('fresh interpreter', file=sys.stderr)\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    forked, real = _both("--help", env=env)
    assert forked.returncode == real.returncode == 0
    assert forked.stderr == real.stderr == "fresh interpreter\n"
    plain = subprocess.run([forked_tpugen(), "--help"], capture_output=True, text=True, timeout=60)
    assert plain.returncode == 0 and plain.stderr == ""


def test_what_libraries_leave_in_the_environment_keeps_the_fork(tmp_path, monkeypatch):
    # cv2's import prepends a folder that does not exist to LD_LIBRARY_PATH, and Ray's init sets PYTHONBREAKPOINT
    # (read when breakpoint() is called): neither changes what a fresh process would do, so both still fork.
    import cv2  # noqa: F401

    missing = str(tmp_path / "no-such-folder")
    monkeypatch.setenv("LD_LIBRARY_PATH", missing + ":" + os.environ.get("LD_LIBRARY_PATH", ""))
    monkeypatch.setenv("PYTHONBREAKPOINT", "ray.util.rpdb._driver_set_trace")
    assert zygote.drifted() == []
    before = zygote.tally().get("tpugen forked", 0)
    done = subprocess.run([forked_tpugen(), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and zygote.tally().get("tpugen forked", 0) == before + 1
    # A folder that exists can change which libraries load: a fresh interpreter, and the suite would say so.
    monkeypatch.setenv("LD_LIBRARY_PATH", f"{tmp_path}:{missing}")
    assert zygote.drifted() == ["LD_LIBRARY_PATH"]
    done = subprocess.run([forked_tpugen(), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and zygote.tally().get("tpugen script LD_LIBRARY_PATH", 0) >= 1


SCRIPT = """
import json, os, sys
import tpugen, yaml
print(json.dumps({
    "name": __name__, "argv": sys.argv, "path0": sys.path[0], "added": sys.argv[1] in sys.path,
    "tpugen": tpugen.__file__, "yaml": yaml.__file__, "own_group": os.getpgid(0) == os.getpid(),
    "threads": __import__("torch").get_num_threads(),
}))
"""


def test_a_script_runs_as_python_would_run_it_and_a_harmless_pythonpath_keeps_the_fork(tmp_path):
    # How Ray starts a worker through runtime_env py_executable: `python SCRIPT ARGS`, in a process group of its
    # own, PYTHONPATH naming the worktree (whose tpugen is the one imported) and OMP_NUM_THREADS set.
    script = tmp_path / "tool.py"
    script.write_text(SCRIPT)
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"}
    python = zygote.command("python")
    before = zygote.tally().get("python forked", 0)
    run = dict(capture_output=True, text=True, timeout=120, env=env, start_new_session=True)
    forked = subprocess.run([*python, str(script), root, "--flag"], **run)
    real = subprocess.run([sys.executable, str(script), root, "--flag"], **run)
    assert forked.returncode == real.returncode == 0, forked.stderr
    assert json.loads(forked.stdout) == json.loads(real.stdout)
    assert json.loads(real.stdout)["own_group"] and json.loads(real.stdout)["threads"] == 1
    assert zygote.tally().get("python forked", 0) == before + 1
    # A folder that would hide a module the zygote imported (another yaml) needs a fresh interpreter.
    (tmp_path / "yaml").mkdir()
    (tmp_path / "yaml" / "__init__.py").write_text("")
    env["PYTHONPATH"] = f"{tmp_path}:{root}"
    forked = subprocess.run([*python, str(script), str(tmp_path)], **run)
    assert forked.returncode == 0 and json.loads(forked.stdout)["yaml"] == str(tmp_path / "yaml" / "__init__.py")
    assert zygote.tally().get("python script PYTHONPATH", 0) >= 1


def _children_of_zygote() -> list[int]:
    """The processes the zygote forked and that still run."""
    server = zygote._server
    assert server is not None
    found = subprocess.run(["pgrep", "-P", str(server.pid)], capture_output=True, text=True).stdout.split()
    return [int(pid) for pid in found]
