"""The flow is one way: the parts are folders, each may import only the parts below it (``ALLOWED``), no
module imports, even lazily, a module that imports it back, and the lower layers stay free of the stacks they
must not need."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WEB_AND_METRICS = {"fastapi", "starlette", "uvicorn", "prometheus_client", "httptools", "uvloop", "h11"}
# Each part and the parts right below it; a part may import those and, through them, all below (``may_import``).
# ``exporter`` is the package's face (its version), nothing more.
BELOW = {
    "protocol": set(),
    "exporter": set(),
    "exporter.errors": set(),
    "exporter.vllm_plugin": {"exporter", "protocol"},
    "exporter.state": {"exporter", "exporter.errors", "exporter.flags", "protocol"},
    "exporter.exposition": {"exporter.state"},
    "exporter.flags": set(),
    "exporter.secret_files": {"exporter.flags", "protocol"},
    "exporter.security": {"exporter", "exporter.errors", "exporter.secret_files", "protocol"},
    "exporter.probe": {"exporter.exposition", "exporter.secret_files"},
    "exporter.config": {"exporter.probe", "exporter.security"},
    "exporter.server": {"exporter.config"},
    "exporter.cli": {"exporter.server", "exporter.vllm_plugin"},
}


def may_import(part: str) -> set[str]:
    return set().union(*({other} | may_import(other) for other in BELOW[part]))


ALLOWED = {part: may_import(part) for part in BELOW}


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


_FILES = {_module(path) for package in ("protocol", "exporter") for path in (ROOT / package).rglob("*.py")}


def _absolute(path: Path, node: ast.ImportFrom) -> str:
    """The module a ``from`` import names, a relative one (``from .x import y``) resolved against ``path``."""
    if node.level == 0:
        return node.module or ""
    package = _module(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in it (functions and ``TYPE_CHECKING`` blocks included), relative
    imports resolved."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(path, node)
            # ``from package import module`` imports the module; the package's face alone is no arrow.
            submodules = {f"{module}.{alias.name}" for alias in node.names} & _FILES
            names.update(submodules or {module})
    return names


def part_of(module: str) -> str:
    """The part a module belongs to: its subpackage of ``exporter``, else its top-level package or module."""
    parts = module.split(".")
    if parts[0] == "exporter" and len(parts) > 1 and f"exporter.{parts[1]}" in ALLOWED:
        return f"exporter.{parts[1]}"
    return parts[0]


MODULES = {
    _module(path): path for package in ("protocol", "exporter") for path in sorted((ROOT / package).rglob("*.py"))
}
GRAPH = {
    name: {imported for imported in _imports(path) if imported in MODULES and imported != name}
    for name, path in MODULES.items()
    if not name.endswith("__main__")
}


def test_every_module_belongs_to_a_declared_part() -> None:
    assert {part_of(name) for name in GRAPH} <= set(ALLOWED)


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


def test_the_parts_import_only_the_parts_below_them() -> None:
    """README, How it works: the map of the parts is the rule the imports keep."""
    wrong = sorted(
        f"{name} -> {imported}"
        for name, imported_names in GRAPH.items()
        for imported in imported_names
        if part_of(imported) != part_of(name) and part_of(imported) not in ALLOWED[part_of(name)]
    )
    assert not wrong


def test_a_relative_import_is_an_arrow_too() -> None:
    """``from . import x`` and ``from ..y import z`` count as the absolute imports they are."""
    server = ROOT / "exporter" / "server" / "app.py"
    assert _absolute(server, ast.parse("from . import routes").body[0]) == "exporter.server"  # type: ignore[arg-type]
    assert _absolute(server, ast.parse("from ..state import x").body[0]) == "exporter.state"  # type: ignore[arg-type]
    package = ROOT / "exporter" / "state" / "__init__.py"
    assert _absolute(package, ast.parse("from .writer import W").body[0]) == "exporter.state.writer"  # type: ignore[arg-type]


def test_the_declared_parts_have_no_cycle() -> None:
    """The table itself is one way: no part may, through others, import itself."""
    assert not [part for part, allowed in ALLOWED.items() if part in allowed]


@pytest.mark.parametrize("part", sorted(part for part in ALLOWED if (ROOT / part.replace(".", "/")).is_dir()))
def test_each_subpackage_says_what_it_owns(part: str) -> None:
    docstring = ast.get_docstring(ast.parse((ROOT / part.replace(".", "/") / "__init__.py").read_text()))
    assert docstring and len(docstring.split()) >= 12, part


@pytest.mark.parametrize("name", sorted(name for name in MODULES if part_of(name) == "protocol"))
def test_the_protocol_imports_no_web_or_metrics_stack_and_nothing_of_the_exporter(name: str) -> None:
    roots = {imported.split(".")[0] for imported in _imports(MODULES[name])}
    assert not roots & (WEB_AND_METRICS | {"exporter"}), name


@pytest.mark.parametrize("name", sorted(name for name in MODULES if part_of(name) == "exporter.vllm_plugin"))
def test_what_runs_inside_vllm_imports_no_web_or_metrics_stack(name: str) -> None:
    roots = {imported.split(".")[0] for imported in _imports(MODULES[name])}
    assert not roots & WEB_AND_METRICS, name


def test_only_the_app_imports_the_route_handlers() -> None:
    """The handlers are imported by no step below them (the OpenAPI document is written from the routes'
    declarations, which its module defines)."""
    importers = {
        name for name, imported in GRAPH.items() if any(i.startswith("exporter.server.routes") for i in imported)
    }
    assert importers <= {"exporter.server.app"} | {
        name for name in MODULES if name.startswith("exporter.server.routes")
    }


def test_only_the_server_and_the_command_line_import_fastapi_and_uvicorn() -> None:
    """And Starlette: ASGI is served by ``exporter/server/``; ``security/`` decides, it does not serve."""
    stacks = {"fastapi", "starlette", "uvicorn", "httptools", "uvloop"}
    importers = {name for name, path in MODULES.items() if {i.split(".")[0] for i in _imports(path)} & stacks}
    assert {part_of(name) for name in importers} <= {"exporter.server", "exporter.cli"}


@pytest.mark.parametrize("name", sorted(name for name in MODULES if part_of(name) == "exporter.state"))
def test_the_state_imports_no_web_or_metrics_stack(name: str) -> None:
    roots = {imported.split(".")[0] for imported in _imports(MODULES[name])}
    assert not roots & WEB_AND_METRICS, name


def readme_map() -> list[str]:
    """The parts README.md's "How it works" lists, in its order (``exporter/server/`` as ``exporter.server``)."""
    section = (ROOT / "README.md").read_text().split("## How it works\n")[1].split("\n## ")[0]
    return [folder.strip("/").replace("/", ".") for folder in re.findall(r"^- `([\w/]+)/`:", section, re.M)]


def test_the_readme_map_lists_every_folder_part() -> None:
    folders = {part for part in ALLOWED if part != "exporter" and (ROOT / part.replace(".", "/")).is_dir()}
    assert sorted(readme_map()) == sorted(folders)


def test_no_part_in_the_readme_map_may_import_one_listed_above_it() -> None:
    """README, How it works: "none importing a part listed above it"."""
    listed = readme_map()
    wrong = [(part, above) for index, part in enumerate(listed) for above in listed[:index] if above in ALLOWED[part]]
    assert not wrong
