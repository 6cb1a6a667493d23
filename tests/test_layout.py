"""The package's shape: imports point one way (cli -> app -> modes -> engine -> backends, outputs -> config ->
families, errors), with no cycle, counting imports placed inside functions. A family sits below the config
because the config's checks (defaults, sizes, LoRAs, scan) ask it."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "tpugen"

# Lower layers never import higher ones. A module may import its own layer and those below.
LAYERS = [
    ["tpugen", "tpugen.errors", "tpugen.files", "tpugen.lines", "tpugen.logs", "tpugen.settings"],
    ["tpugen.families", "tpugen.sharding"],
    ["tpugen.config", "tpugen.models", "tpugen.schedulers", "tpugen.plan", "tpugen.prompt_reading", "tpugen.tiny"],
    ["tpugen.backends", "tpugen.outputs", "tpugen.memory", "tpugen.placement"],
    ["tpugen.engine"],
    ["tpugen.modes"],
    ["tpugen.app"],
    ["tpugen.cli"],
]


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports() -> dict[str, set[str]]:
    """Each tpugen module's imports of tpugen modules, from the source (imports inside functions included)."""
    known = modules()

    def owner(name: str) -> str | None:
        while name:
            if name in known:
                return name
            name = name.rpartition(".")[0]
        return None

    graph = {}
    for module, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
                names = [f"{base}.{alias.name}" for alias in node.names]
                names = [n if owner(n) not in (None, "tpugen") or n == base else base for n in names]
            else:
                continue
            targets |= {owner(n) for n in names if n.startswith("tpugen") and owner(n)} - {module}
        graph[module] = targets
    return graph


def layer(module: str) -> int:
    best = None
    for number, members in enumerate(LAYERS):
        for member in members:
            if module == member or module.startswith(member + "."):
                if best is None or len(member) > best[1]:
                    best = (number, len(member))
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best[0]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                found.append(path[path.index(target) :] + [target])
            elif target not in state:
                visit(target, [*path, target])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_no_import_cycles():
    assert cycles(imports()) == []


def test_the_reader_of_imports_sees_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_imports_point_down_the_layers():
    upward = [
        f"{module} (layer {layer(module)}) imports {target} (layer {layer(target)})"
        for module, targets in sorted(imports().items())
        for target in sorted(targets)
        if layer(target) > layer(module)
    ]
    assert upward == []


def _importers(top: tuple[str, ...]) -> set[str]:
    found = set()
    for module, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n.split(".")[0] in top for n in names):
                found.add(module)
    return found


def test_only_the_cluster_mode_imports_ray():
    # Ray is an extra: every other command (and tpugen.cli's own import) must work without it.
    assert _importers(("ray",)) == {"tpugen.modes.ray.join", "tpugen.modes.ray.worker"}


def test_only_the_backends_import_torch_xla_or_torch_tpu():
    importers = set()
    for module, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n.split(".")[0] in ("torch_xla", "torch_tpu") for n in names):
                importers.add(module)
    assert importers and all(m.startswith("tpugen.backends") for m in importers), importers
