"""Lines as tpugen reads them, from files it wrote or was given."""

from __future__ import annotations


def text_lines(text: str) -> list[str]:
    """Lines as tpugen writes and reads them: ended by \\n (or \\r\\n) only.

    str.splitlines() also breaks at U+2028, U+0085, form feed and other characters that may sit inside a
    prompt or a JSON string."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]
