"""The errors tpugen reports to users: one base class, two exit codes."""

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
