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


def unpaired_surrogate(text: str) -> str | None:
    """Why `text` cannot be written as UTF-8 (a PNG text chunk, a manifest line, a tokenizer's input), or None.

    JSON and YAML escapes can carry half of a UTF-16 pair (a client that cut a string inside an emoji sends
    "\\ud83d"); such a string is not Unicode text."""
    for position, character in enumerate(text):
        if "\ud800" <= character <= "\udfff":
            return f"unpaired surrogate U+{ord(character):04X} at character {position} (not valid Unicode text)"
    return None
