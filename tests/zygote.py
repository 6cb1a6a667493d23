"""A zygote for the tpugen processes the tests start only to have a process of their own: one process per test
worker imports torch, torch_xla, diffusers and tpugen once, without touching a device, and forks a child for each
`tpugen` command, which then runs as a fresh process would (its own XLA runtime and compile cache, its own
counters: exact graph counts whatever the test process compiled) but without a fresh interpreter's ~15 s of
imports. Tests that check how tpugen starts (what is set before torch is imported, how a server binds its
socket first) run the real console script instead.

The client, `tests/fakes/forked/tpugen`, stands where the `tpugen` script would: it hands the zygote its argv,
environment, working directory and its stdin, stdout and stderr (the descriptors themselves), forwards the signals
it gets to the child and exits as the child did (its code, or the signal that ended it). A client that goes away
takes its child with it. A client whose environment differs from the zygote's in what the preloaded modules read
when imported (PYTHONPATH, the hub's cache roots, ...) runs the real console script instead. The zygote starts on
first use (`command()`), with the environment the test process had when this module was imported, and stops with
the test process (`stop()`).

Run as `python tests/zygote.py SOCKET`: serves on the Unix socket SOCKET and prints "ready" when it listens.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

CLIENT = Path(__file__).parent / "fakes" / "forked" / "tpugen"
SOCKET_ENV = "TPUGEN_TEST_ZYGOTE"  # where the client finds the zygote
SCRIPTS_ENV = "TPUGEN_TEST_SCRIPTS"  # where the real scripts are, for a client that finds no zygote
OFF_ENV = "TPUGEN_TEST_FORKED"  # 0: the tests run the console script wherever they would run forked_tpugen
# Variables read when Python starts or when the preloaded modules are imported (the hub's cache roots and offline
# switch, what transformers and accelerate check for torch_xla): a client whose value differs from the zygote's
# runs the real console script, as a child forked after those imports would not see its own.
READ_AT_START = ("PYTHON", "LD_")  # prefixes
# Read when used, not at start: the child has the client's value in os.environ (Ray's init sets PYTHONBREAKPOINT).
READ_WHEN_USED = {"PYTHONBREAKPOINT"}
STARTUP_HOOKS = {"sitecustomize", "usercustomize"}  # modules Python imports as it starts, where it finds them
READ_AT_IMPORT = {
    *("HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_ENDPOINT", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_OFFLINE"),
    *("TRANSFORMERS_CACHE", "TRANSFORMERS_OFFLINE", "DIFFUSERS_CACHE", "TORCH_HOME", "XDG_CACHE_HOME"),
    *("USE_TORCH_XLA", "USE_TORCH", "USE_TF", "USE_JAX", "USE_FLAX"),
}
if __name__ != "__main__":  # in a test process: where its zygote will listen, in every environment it hands on
    _SOCKET_DIR = tempfile.mkdtemp(prefix="tpugen-zygote-")
    os.environ[SOCKET_ENV] = os.path.join(_SOCKET_DIR, "socket")
    os.environ[SCRIPTS_ENV] = str(Path(sys.executable).parent)
BASE_ENV = dict(os.environ)  # the test process's environment before any test changed it
# What a tpugen run on a tiny model imports that takes time (torch_xla brings torch, dynamo and inductor): a
# child finds them in sys.modules. Imports only: nothing here creates a device or runs a torch op.
PRELOAD = (
    "torch_xla",
    "torch_xla.core.xla_model",
    "torch_xla.debug.metrics",
    "torch_xla.runtime",
    "diffusers",
    "transformers",
    "tpugen.cli",
    "tpugen.app",
    "tpugen.engine.engine",
    "tpugen.backends.xla.single",
    "pytest",
    "xdist",
)
PRELOAD_NAMES = {  # lazily exported names, imported by resolving them
    "diffusers": (
        "StableDiffusionPipeline",
        "StableDiffusionXLPipeline",
        "FluxPipeline",
        "Flux2KleinPipeline",
        "QwenImagePipeline",
        "ZImagePipeline",
        "AutoencoderKL",
        "UNet2DConditionModel",
    ),
    "transformers": ("CLIPTextModel", "CLIPTokenizer", "CLIPImageProcessor", "T5EncoderModel"),
}

_server: subprocess.Popen | None = None
_TALLY_PATH = ""  # in the zygote: where it writes down what it did with each request


def command(program: str = "tpugen") -> list[str]:
    """The argv prefix that runs `program` (tpugen, pytest, or python for `-c CODE`) in a child of this process's
    zygote (started now if need be), as the console script of that name would. The child's environment is the one
    the client starts with."""
    global _server
    if os.environ.get(OFF_ENV) == "0":
        return [str(Path(sys.executable).parent / program)]
    if _server is None or _server.poll() is not None:
        path = BASE_ENV[SOCKET_ENV]
        if os.path.exists(path):
            os.unlink(path)  # a zygote that ended before
        _server = subprocess.Popen([sys.executable, __file__, path], stdout=subprocess.PIPE, text=True, env=BASE_ENV)
        line = _server.stdout.readline()  # blocks until it listens, or ends
        if line.strip() != "ready":
            _server.kill()
            raise RuntimeError(f"the tests' tpugen zygote did not start (it said {line!r})")
    return [str(CLIENT.with_name(program))]


def stop() -> None:
    """Stops this process's zygote, if it started one (its children with it)."""
    global _server
    if _server is not None:
        _server.terminate()
        try:
            _server.wait(30)
        except subprocess.TimeoutExpired:
            _server.kill()
            _server.wait()
        _server = None
    shutil.rmtree(_SOCKET_DIR, ignore_errors=True)


def _preload() -> None:
    import importlib

    for name in PRELOAD:
        module = importlib.import_module(name)
        for attribute in PRELOAD_NAMES.get(name, ()):
            getattr(module, attribute, None)


def _serve(path: str) -> None:
    global _TALLY_PATH
    _TALLY_PATH = _tally_path(path)
    _preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    children: dict[int, socket.socket] = {}  # pid: its client's connection

    def stop_all(signum, frame) -> None:
        for pid in children:
            _kill(pid)
        os._exit(0)  # no atexit: nothing of the preload's may start a runtime here

    signal.signal(signal.SIGTERM, stop_all)
    parent = os.getppid()
    print("ready", flush=True)
    while True:
        if os.getppid() != parent:  # the test process is gone (killed): nothing will stop this one
            stop_all(None, None)
        readable, _, _ = select.select([listener, *children.values()], [], [], 0.05)
        for ready in readable:
            if ready is listener:
                connection, _ = listener.accept()
                pid = _fork(listener, connection, children)
                if pid is not None:
                    children[pid] = connection
            else:  # a client's connection: readable only when the client went away
                pid = next(p for p, c in children.items() if c is ready)
                _kill(pid)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            connection = children.pop(pid, None)
            if connection is not None:
                ended = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}"
                try:
                    connection.send(ended.encode())
                except OSError:
                    pass
                connection.close()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _fork(listener: socket.socket, connection: socket.socket, children: dict) -> int | None:
    message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
    if len(fds) != 3:
        connection.close()
        return None
    request = json.loads(message)
    differing = _differing(request["env"], os.environ)
    _tally(request["program"], differing)
    if differing:
        for fd in fds:
            os.close(fd)
        connection.send(f"exec {Path(sys.executable).parent / request['program']}".encode())
        connection.close()
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        for fd in fds:
            os.close(fd)
        connection.send(f"pid {pid}".encode())
        return pid
    try:  # the child: never back into the zygote's loop, whatever fails
        for other in (listener, connection, *children.values()):
            other.close()  # a client sees the zygote go away only once no child holds its end
        _child(request, fds)
    finally:
        os._exit(1)


def _read_at_start(env) -> dict:
    """The variables of `env` a process reads when it starts or imports the preloaded modules, as they act: the
    loader's library path by the folders in it that exist (importing cv2 prepends one that does not, to every
    later child's environment)."""
    read = {
        key: value
        for key, value in env.items()
        if (key.startswith(READ_AT_START) or key in READ_AT_IMPORT) and key not in READ_WHEN_USED
    }
    if "LD_LIBRARY_PATH" in read:
        folders = [folder for folder in read.pop("LD_LIBRARY_PATH").split(":") if folder and os.path.isdir(folder)]
        if folders:
            read["LD_LIBRARY_PATH"] = ":".join(folders)
    return read


def _differing(env, own) -> list[str]:
    """The variables read at start or import whose value in a client's environment differs from the zygote's.
    PYTHONPATH differs only where the folders it adds would change a module the zygote imported (the child puts
    them on its sys.path itself): the tests' Ray cluster adds the worktree, whose tpugen is the one imported."""
    theirs, ours = _read_at_start(env), _read_at_start(own)
    differing = {key for key in theirs.keys() | ours.keys() if theirs.get(key) != ours.get(key)}
    if "PYTHONPATH" in differing and not _shadowed(_path_added(env, own)):
        differing.discard("PYTHONPATH")
    return sorted(differing)


def _path_added(env, own) -> list[str]:
    """The folders a client's PYTHONPATH puts before the zygote's own, or None where it leaves out one of those."""
    theirs, ours = (
        [folder for folder in (environment.get("PYTHONPATH") or "").split(os.pathsep) if folder]
        for environment in (env, own)
    )
    if any(folder not in theirs for folder in ours):
        return None
    return [folder for folder in theirs if folder not in ours]


def _shadowed(folders: list[str] | None) -> bool:
    """Whether a module already imported here (a top-level one) would be found first in one of `folders` by a fresh
    interpreter, and is not the one imported. A folder without __init__.py is a namespace portion, which never
    hides a module found elsewhere."""
    if folders is None:
        return True
    for folder in folders:
        try:
            entries = os.listdir(folder)
        except OSError:
            continue  # a folder that is not there adds nothing
        for entry in entries:
            path = os.path.join(folder, entry)
            name, _, suffix = entry.partition(".")
            if suffix and not (suffix == "py" or suffix.endswith("so")):
                continue
            if not suffix and not os.path.isfile(os.path.join(path, "__init__.py")):
                continue
            if name in STARTUP_HOOKS:  # imported by a fresh interpreter as it starts: never by a forked child
                return True
            module = sys.modules.get(name)
            if module is None:
                continue
            origin = getattr(module, "__file__", None)
            if origin is None or not (
                os.path.realpath(origin) == os.path.realpath(path)
                or os.path.realpath(origin).startswith(os.path.realpath(path) + os.sep)
            ):
                return True
    return False


def drifted() -> list[str]:
    """The variables read at start or import that this (test) process now holds otherwise than when it started its
    zygote's environment: every client it starts with them becomes the console script, ~15 s slower."""
    return _differing(os.environ, BASE_ENV)


def _tally(program: str, differing: list[str]) -> None:
    """One line per request in the zygote's tally (read by `tally()`): forked, or the console script and why."""
    how = "script " + ",".join(differing) if differing else "forked"
    with open(_TALLY_PATH, "a") as out:
        out.write(f"{program} {how}\n")


def tally() -> dict[str, int]:
    """What this process's zygote did so far: {"tpugen forked": n, "pytest script PYTHONPATH": m, ...}."""
    counts: dict[str, int] = {}
    try:
        lines = Path(_tally_path(BASE_ENV[SOCKET_ENV])).read_text().splitlines()
    except OSError:
        return counts
    for line in lines:
        counts[line] = counts.get(line, 0) + 1
    return counts


def _tally_path(socket_path: str) -> str:
    return socket_path + ".tally"


def _python(argv: list[str]) -> int:
    """`python -c CODE ARGS...` or `python SCRIPT ARGS...` (how Ray starts a worker: runtime_env py_executable): the
    code or the script as __main__, sys.argv and sys.path[0] as Python sets them."""
    import runpy

    if argv[:1] == ["-c"]:
        _, source, *rest = argv
        sys.argv = ["-c", *rest]
        sys.path[0] = ""
        exec(compile(source, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        return 0
    assert argv and not argv[0].startswith("-"), f"the forked python runs -c CODE or a script only, not {argv!r}"
    script, *rest = argv
    sys.argv = [script, *rest]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")
    return 0


def _child(request: dict, fds: list[int]) -> None:
    """In the forked child: become the client's process, run tpugen's entry point, exit as its script would."""
    import atexit
    import threading
    import traceback

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if request.get("leader"):
        # Its client leads a process group of its own, so this child does: Ray kills a worker's process group
        # when the worker ends, which would otherwise be the zygote's and the test process's.
        os.setpgid(0, 0)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    added = _path_added(request["env"], os.environ) or []  # folders _differing found harmless
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[1:1] = [folder for folder in added if folder not in sys.path]  # where PYTHONPATH's go, after [0]
    import torch
    import torch_xla

    torch_xla._setup_xla_flags()  # what importing torch_xla adds to a fresh process's environment
    torch_xla._setup_default_env()
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # read by OpenMP when torch loaded it: here, the zygote's
        torch.set_num_threads(int(threads))
    os.chdir(request["cwd"])
    sys.argv = [request["program"], *request["argv"]]
    code = 1
    try:
        if request["program"] == "pytest":
            import pytest

            code = int(pytest.main(request["argv"]))
        elif request["program"] == "python":
            code = _python(request["argv"])
        else:
            from tpugen.cli import main

            main()
            code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


if __name__ == "__main__":
    _serve(sys.argv[1])
