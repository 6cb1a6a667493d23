"""The docs site's reference pages are generated from the code (scripts/gen_docs.py) and say something of
everything: a config key, CLI option or HTTP route without a description fails here."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Routes of tpugen/modes/serve/ whose handlers have no docstring (so no OpenAPI description): none now. A route
# not on it must have one, and a route on it that gains one must leave it.
ROUTES_WITHOUT_DESCRIPTION_YET: set[str] = set()


@pytest.fixture(scope="module")
def gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_docs"] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules["gen_docs"]


def test_the_committed_reference_pages_are_what_the_code_generates(gen_docs, tmp_path):
    for fresh in gen_docs.write(tmp_path):
        committed = ROOT / "docs" / "reference" / fresh.name
        assert committed.read_text() == fresh.read_text(), (
            f"docs/reference/{fresh.name} is out of date: run .venv/bin/python scripts/gen_docs.py"
        )


def test_every_config_key_has_a_description_and_a_type(gen_docs):
    assert gen_docs.undescribed_config_keys() == []
    assert gen_docs.untyped_config_keys() == []  # a key checked by a function needs CHECKED_VALUES' words


def test_every_cli_command_argument_and_option_has_help(gen_docs):
    assert gen_docs.undescribed_cli_parameters() == []


def test_every_http_route_has_a_description(gen_docs):
    missing = set(gen_docs.undescribed_routes())
    assert missing - ROUTES_WITHOUT_DESCRIPTION_YET == set(), "give these routes' handlers a docstring"
    assert ROUTES_WITHOUT_DESCRIPTION_YET - missing == set(), "described now: take them off the list"


def test_the_reference_covers_every_key_command_route_and_variable(gen_docs):
    from tpugen.config.schema import all_keys
    from tpugen.settings import VARIABLES

    pages = {name: (ROOT / "docs" / "reference" / name).read_text() for name in gen_docs.PAGES}
    keys = [key for key in all_keys() if key != "model.loras"] + ["model.loras[].id", "model.loras[].sha256"]
    assert [k for k in keys if f"| `{k}` |" not in pages["config.md"]] == []
    _, commands = gen_docs._cli_commands()
    assert [name for name, _ in commands if f"## `tpugen {name}`" not in pages["cli.md"]] == []
    routes = [f"{m} {p}" for p, m, _ in gen_docs._operations(gen_docs.openapi())]
    assert [r for r in routes if f"### `{r}`" not in pages["http.md"]] == []
    assert [v.name for v in VARIABLES if f"| `{v.name}` |" not in pages["environment.md"]] == []


def test_no_doc_page_is_outside_the_nav():
    """mkdocs build --strict in CI checks links and anchors; this checks the nav without mkdocs installed."""
    import re

    nav = (ROOT / "mkdocs.yml").read_text()
    listed = set(re.findall(r"([\w/.-]+\.md)", nav))
    pages = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert pages - listed == set() and listed - pages == set()
