"""The errors tpugen reports to users: one base class, two exit codes, and the one table of one-line messages."""

from __future__ import annotations


class TpugenError(Exception):
    """A problem tpugen can explain in a line; main() prints it without a traceback."""

    exit_code = 1

    def __init__(self, *lines: str) -> None:
        self.lines = [line for line in lines if line]
        super().__init__("\n".join(self.lines))


class InputError(TpugenError):
    """Bad input: a config, a prompts file, a model path or an output dir. Nothing was written."""

    exit_code = 2


class RunError(TpugenError):
    """A failure while the run was under way (loading, compiling, generating, writing)."""

    exit_code = 1


class Interrupted(TpugenError):
    """SIGINT or SIGTERM stopped the run; the exit code is 128 + the signal number (130, 143)."""

    def __init__(self, signum: int, *lines: str) -> None:
        super().__init__(*lines)
        self.signum = signum
        self.exit_code = 128 + signum


def first_line(text: str, default: str = "") -> str:
    return (text.strip().split("\n") or [default])[0] or default


def one_line(exc: BaseException) -> str:
    """What a user reads for an exception, in one line: tpugen's own errors as they are worded, a failed file
    operation with its path, anything else with its type (a bug to report, not a message to act on)."""
    if isinstance(exc, TpugenError):
        return exc.lines[0] if exc.lines else type(exc).__name__
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror
    return first_line(f"{type(exc).__name__}: {exc}", type(exc).__name__)


def is_known(exc: BaseException) -> bool:
    """Whether one_line's message is meant for the user as it is (no traceback hint needed)."""
    return isinstance(exc, (TpugenError, KeyboardInterrupt)) or (isinstance(exc, OSError) and bool(exc.strerror))
