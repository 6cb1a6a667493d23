"""Validation errors in the words tpugen uses everywhere: `dotted.key: what is wrong, got what`."""

from __future__ import annotations

import difflib
import re
from typing import Any

from tpugen.config.schema import RunConfig, field_names, section_at


def suggest(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _dotted(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "config"


_TYPE_NAMES = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_parsing": "a number",
    "bool_parsing": "true or false",
    "dict_attributes_type": "a mapping of keys",
    "float_type": "a number",
    "string_type": "a string",
    "bool_type": "true or false",
    "list_type": "a list",
    "model_type": "a mapping of keys",
    "dict_type": "a mapping of keys",
}


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return f"{value!r}"


# What YAML 1.1 would have read as an integer and tpugen reads as text: octal, hex, base 60.
_YAML11_INTEGER = re.compile(r"[-+]?(0[0-9_]+|0[xXoObB][0-9a-fA-F_]+|[0-9]+(:[0-5]?[0-9])+)")


def format_error(err: dict) -> str:
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
    where = _dotted(loc)
    kind = err["type"]
    if kind == "extra_forbidden":
        section = section_at([p for p in loc[:-1] if isinstance(p, str)]) or RunConfig
        return f"{where}: unknown key{suggest(str(loc[-1]), field_names(section))}"
    if kind == "missing":
        return f"{where}: required key is missing"
    if kind == "int_type" and isinstance(err.get("input"), str) and _YAML11_INTEGER.fullmatch(err["input"]):
        return f"{where}: expected a decimal integer without leading zeros or ':', got {err['input']!r}"
    if kind in _TYPE_NAMES:
        return f"{where}: expected {_TYPE_NAMES[kind]}, got {_describe(err.get('input'))}"
    if kind == "finite_number":
        return f"{where}: must be a finite number, got {_describe(err.get('input'))}"
    if kind == "literal_error":
        return f"{where}: {err['msg'].replace('Input should be', 'must be')}, got {_describe(err.get('input'))}"
    if kind == "value_error":
        return f"{where}: {err['msg'].removeprefix('Value error, ')}"
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        return f"{where}: {err['msg'].replace('Input should be', 'must be')}, got {_describe(err.get('input'))}"
    return f"{where}: {err['msg']}"
