"""The flow is one way: no module of the project imports, even lazily, a module that imports it back, and the
lower layers stay free of the stacks they must not need."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("protocol", "exporter")
WEB_AND_METRICS = {"fastapi", "starlette", "uvicorn", "prometheus_client", "httptools", "uvloop"}


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in it (functions and ``TYPE_CHECKING`` blocks included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


MODULES = {_module(path): path for package in PACKAGES for path in sorted((ROOT / package).glob("*.py"))}
GRAPH = {
    name: {imported for imported in _imports(path) if imported in MODULES and imported != name}
    for name, path in MODULES.items()
    if not name.endswith("__main__")
}


def test_the_modules_import_each_other_in_one_direction_only() -> None:
    """A cycle would mean some module calls up into a layer above it."""
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        if name in path:
            pytest.fail("import cycle: " + " -> ".join((*path[path.index(name) :], name)))
        if name in done:
            return
        for imported in sorted(GRAPH.get(name, ())):
            visit(imported, (*path, name))
        done.add(name)

    for name in sorted(GRAPH):
        visit(name, ())


@pytest.mark.parametrize("name", sorted(name for name in MODULES if name.startswith("protocol")))
def test_the_protocol_imports_no_web_or_metrics_stack_and_nothing_of_the_exporter(name: str) -> None:
    roots = {imported.split(".")[0] for imported in _imports(MODULES[name])}
    assert not roots & (WEB_AND_METRICS | {"exporter"}), name


@pytest.mark.parametrize("name", ["exporter.sender", "exporter.vllm_plugin", "exporter.vllm_engine_groups"])
def test_what_runs_inside_vllm_imports_no_web_or_metrics_stack(name: str) -> None:
    roots = {imported.split(".")[0] for imported in _imports(MODULES[name])}
    assert not roots & WEB_AND_METRICS, name


def test_only_the_app_imports_the_route_handlers() -> None:
    """README, How it works: the handlers are imported by no step below them (the OpenAPI document is written
    from the routes' declarations, which its module defines)."""
    assert {name for name, imported in GRAPH.items() if "exporter.routes" in imported} == {"exporter.service"}
