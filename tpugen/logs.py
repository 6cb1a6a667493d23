"""tpugen's own log lines: loggers under "tpugen", which a long-lived process (the server) sends to the console."""

from __future__ import annotations

import logging
import sys

ROOT = "tpugen"


def logger(name: str) -> logging.Logger:
    """The logger of one part of tpugen, e.g. logger("serve"): its lines read "tpugen serve: ..."."""
    return logging.getLogger(f"{ROOT}.{name}")


class _Console(logging.Handler):
    """Info lines to stdout, warnings and errors to stderr, each "tpugen <part>: <message>", flushed at once
    (a supervisor or a test reading the process's output sees each line as it happens)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            part = record.name.removeprefix(f"{ROOT}.").replace(".", " ")
            stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
            stream.write(f"{ROOT} {part}: {record.getMessage()}\n")
            stream.flush()
        except Exception:
            self.handleError(record)


def to_console() -> None:
    """Send tpugen's info lines and above to the console, once per process; other libraries' logging and the
    root logger are left as the process has them."""
    root = logging.getLogger(ROOT)
    if not any(isinstance(h, _Console) for h in root.handlers):
        root.addHandler(_Console())
    root.setLevel(logging.INFO)
    root.propagate = False
