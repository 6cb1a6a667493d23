"""key=value overrides on the command line, typed by the schema, and the dotted keys the schema accepts."""

from __future__ import annotations

from typing import Any

import yaml

from tpugen.config.messages import suggest
from tpugen.config.schema import all_keys, field_names, is_text_field, model_type, section_at
from tpugen.config.yamlio import yaml_load

EMPTY_ALLOWED = {"negative_prompt"}  # keys whose empty value means something: no negative prompt


def apply_overrides(data: dict, overrides: list[str]) -> list[str]:
    """Set each `key.sub=value` into `data`, typed by the schema. Returns the problems found."""
    problems = []
    for text in overrides:
        key, sep, raw = text.partition("=")
        key = key.strip()
        if not sep or not key:
            problems.append(f"{text}: an override must look like key=value (for example steps=30)")
            continue
        parts = key.split(".")
        section = section_at(parts[:-1])
        if section is None or parts[-1] not in section.model_fields:
            problems.append(f"{key}: unknown key{suggest(key, all_keys())}")
            continue
        field = section.model_fields[parts[-1]]
        if model_type(field.annotation) is not None:
            problems.append(
                f"{key}: is a section; set one of its keys, e.g. {key}.{field_names(model_type(field.annotation))[0]}=..."
            )
            continue
        if not raw.strip() and key not in EMPTY_ALLOWED:
            # `steps=` silently meant the model's default, `output.dir=` the current folder.
            problems.append(f"{key}: the value is empty (an unset shell variable?); give one, or null to unset it")
            continue
        if is_text_field(field.annotation) and raw.strip().lower() not in ("null", "~"):
            value: Any = raw
        else:
            try:
                value = yaml_load(raw) if raw.strip() else None
            except yaml.YAMLError:
                problems.append(f"{key}: cannot read the value {raw!r}")
                continue
        target = data
        for part in parts[:-1]:
            if not isinstance(target.get(part), dict):
                target[part] = {}
            target = target[part]
        target[parts[-1]] = value
        # One prompt source wins: an override of one replaces the other from the file.
        if key == "prompts":
            data.pop("prompts_file", None)
        elif key == "prompts_file":
            data.pop("prompts", None)
    return problems
