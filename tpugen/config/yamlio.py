"""YAML as tpugen reads and writes it: safe, with YAML 1.2's numbers."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from tpugen.errors import InputError


class _YamlLoader(yaml.SafeLoader):
    """yaml.safe_load with YAML 1.2's numbers instead of YAML 1.1's.

    YAML 1.1 reads `seed: 0042` as octal 34, `steps: 1:30` as 90 (base 60) and `0x10` as 16. Here an
    integer is decimal digits with an optional sign and no leading zero, and a float has a decimal point
    (as in YAML 1.1, so `1e3` stays text); anything else stays a string, which the schema then refuses with
    the key's name.

    A key given twice in one mapping is refused (YAML 1.1 lets the last one win without a word); a key after
    a `<<` merge still overrides the merged one, as it should.
    """

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                if isinstance(key, (str, int, float, bool)) or key is None:
                    if key in seen:
                        raise yaml.constructor.ConstructorError(
                            None,
                            None,
                            f"key {key!r} appears twice in one mapping (first at line {seen[key]})",
                            key_node.start_mark,
                        )
                    seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, pattern) for tag, pattern in resolvers if tag not in (_INT, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_YamlLoader.add_implicit_resolver(_INT, re.compile(r"^[-+]?(0|[1-9][0-9]*)$"), list("-+0123456789"))
_YamlLoader.add_implicit_resolver(
    _FLOAT,
    re.compile(r"^(?:[-+]?(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."),
)


if getattr(yaml, "__with_libyaml__", False):
    from yaml.constructor import SafeConstructor
    from yaml.cyaml import CParser
    from yaml.resolver import Resolver

    class _FastYamlLoader(CParser, _YamlLoader):
        """The same reading with libyaml's C parser underneath: tens of times faster on a big document (a 2 MB
        prompt list: 0.09 s against 1.5 s), the construction and the YAML 1.2 numbers tpugen's own."""

        def __init__(self, stream) -> None:
            CParser.__init__(self, stream)
            SafeConstructor.__init__(self)
            Resolver.__init__(self)

else:  # a PyYAML built without libyaml
    _FastYamlLoader = _YamlLoader


class _YamlDumper(yaml.SafeDumper):
    """Quotes every string that either YAML 1.1 or tpugen's loader would read as something else ("1e3",
    "0042"), so a config written by tpugen reads back the same anywhere."""


_YamlDumper.yaml_implicit_resolvers = {
    first: list(resolvers) + [r for r in _YamlLoader.yaml_implicit_resolvers.get(first, []) if r not in resolvers]
    for first, resolvers in yaml.SafeDumper.yaml_implicit_resolvers.items()
}
for _first, _resolvers in _YamlLoader.yaml_implicit_resolvers.items():
    _YamlDumper.yaml_implicit_resolvers.setdefault(_first, list(_resolvers))

_YAML11_BREAKS = ("\x85", "\u2028", "\u2029")  # line breaks to YAML 1.1 readers, text to tpugen


def _represent_str(dumper: yaml.SafeDumper, value: str):
    # Any other style writes these characters as they are, and a YAML 1.1 reader folds them into spaces;
    # double quotes write them as escapes (\N, \L, \P), which read back as the characters.
    style = '"' if any(ch in value for ch in _YAML11_BREAKS) else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_YamlDumper.add_representer(str, _represent_str)


class _AliasCycle(yaml.YAMLError):
    problem = "an alias refers to a mapping or list it is inside (*NAME within &NAME)"


MAX_EXPANDED_VALUES = 1_000_000  # what a document may stand for once its aliases are expanded


class _AliasBomb(yaml.YAMLError):
    problem = f"aliases expand the document past {MAX_EXPANDED_VALUES} values (aliases of aliases of ...)"


class _TooDeep(yaml.YAMLError):
    problem = "lists or mappings nested too deeply to read"


def _check_aliases(data: Any) -> None:
    """Refuse an alias cycle, and aliases that expand the document past MAX_EXPANDED_VALUES (each alias is one
    shared object here, but what reads the config later walks every copy). Each distinct list or mapping is
    visited once, so this is linear in the text, however far its aliases expand."""
    sizes: dict[int, int] = {}  # id -> values it stands for, once done
    open_now: set[int] = set()
    stack: list[tuple[Any, bool]] = [(data, False)]
    while stack:
        node, finished = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        children = list(node.values()) if isinstance(node, dict) else node
        if finished:
            open_now.discard(id(node))
            sizes[id(node)] = 1 + sum(sizes.get(id(child), 1) for child in children)
            if sizes[id(node)] > MAX_EXPANDED_VALUES:
                raise _AliasBomb(_AliasBomb.problem)
            continue
        if id(node) in open_now:
            raise _AliasCycle(_AliasCycle.problem)
        if id(node) in sizes:
            continue
        open_now.add(id(node))
        stack.append((node, True))
        stack.extend((child, False) for child in children if isinstance(child, (dict, list)))


def yaml_load(text: str) -> Any:
    """A YAML document read safely (no tags, no objects), numbers as YAML 1.2 reads them: by libyaml where
    PyYAML has it; a document it refuses (or cannot take: text with lone surrogates) is read again by the
    pure-Python parser, whose words (and marks) the error then carries, the same wherever PyYAML came from."""
    try:
        try:
            data = yaml.load(text, Loader=_FastYamlLoader)  # noqa: S506 -- a SafeLoader subclass
        except (yaml.YAMLError, UnicodeEncodeError):
            if _FastYamlLoader is _YamlLoader:
                raise
            data = yaml.load(text, Loader=_YamlLoader)  # noqa: S506 -- a SafeLoader subclass
    except RecursionError:
        raise _TooDeep(_TooDeep.problem) from None
    _check_aliases(data)
    return data


def yaml_problem(exc: yaml.YAMLError) -> str:
    """What is wrong with a YAML text, in one line: where, and what."""
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    return f"malformed YAML{where}: {problem}"


def read_yaml(path: Path) -> dict:
    """The config file as a mapping, or an InputError naming what is wrong with it."""
    if not path.exists():
        raise InputError(f"{path}: config file does not exist")
    if not path.is_file():
        raise InputError(f"{path}: is not a file")
    try:
        data = yaml_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise InputError(f"{path}: is not UTF-8 text") from None
    except yaml.YAMLError as exc:
        raise InputError(f"{path}: {yaml_problem(exc)}") from None
    if data is None:
        raise InputError(f"{path}: the config is empty")
    if not isinstance(data, dict):
        raise InputError(f"{path}: the config must be a mapping of keys, got {type(data).__name__}")
    return data


def dump_yaml(data: dict) -> str:
    """A mapping as YAML, keys in the order given, every string quoted where a reader could take it for
    something else."""
    return yaml.dump(data, Dumper=_YamlDumper, sort_keys=False, allow_unicode=True, width=1000)
