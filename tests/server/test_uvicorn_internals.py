"""The uvicorn internals the server builds on, checked against the installed uvicorn.

``exporter/server/uvicorn_adapter.py`` alone reaches into uvicorn's non-public code (it subclasses its httptools
protocol and flow control, and answers heartbeats on its ``RequestResponseCycle``), and its docstring lists each
name it relies on; ``cli.py`` passes ``uvicorn.run`` its settings. None of the adapter's names are uvicorn's public
API, so pyproject.toml pins the releases tested; a release that changes a method, its parameters or an attribute
relied on fails here, naming itself, rather than in a fleet; and a name the adapter uses without listing it fails
here too.
"""

from __future__ import annotations

import ast
import inspect
import re
import socket
import threading
import tomllib
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle

from exporter.server.problems import REFUSALS
from tests.support import free_port, wait_until

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
README = PYPROJECT.with_name("README.md")
EXPORTER = PYPROJECT.with_name("exporter")
ADAPTER = EXPORTER / "server" / "uvicorn_adapter.py"
OWNERS: dict[str, type] = {
    "HttpToolsProtocol": HttpToolsProtocol, "RequestResponseCycle": RequestResponseCycle, "FlowControl": FlowControl,
}  # fmt: skip
# Methods overridden or called, and their parameters after ``self`` (``async``: awaited, so a coroutine function).
METHODS: dict[type, dict[str, tuple[str, ...]]] = {
    HttpToolsProtocol: {
        "__init__": ("config", "server_state", "app_state", "_loop"),
        "connection_made": ("transport",),
        "connection_lost": ("exc",),
        "data_received": ("data",),
        "on_message_begin": (),
        "on_headers_complete": (),
        "on_message_complete": (),
        "on_response_complete": (),
        "pause_writing": (),
        "resume_writing": (),
        "_start_asgi_task": ("cycle", "app"),
        "timeout_keep_alive_handler": (),
    },
    RequestResponseCycle: {"send": ("message",)},
    FlowControl: {"__init__": ("transport",), "pause_reading": (), "resume_reading": (), "drain": ()},
}
AWAITED = {(RequestResponseCycle, "send"), (FlowControl, "drain")}
# Attributes read or set on a connection's protocol and on its request's cycle and flow control.
PROTOCOL_ATTRIBUTES = (
    "access_log", "app", "connections", "cycle", "flow", "headers", "logger", "loop",
    "pipeline", "scope", "tasks", "timeout_keep_alive_task", "transport",
)  # fmt: skip
CYCLE_ATTRIBUTES = ("disconnected", "more_body", "response_complete", "scope")
# The settings ``serve`` gives ``uvicorn.run`` (which hands them to ``uvicorn.Config``).
CONFIG_PARAMETERS = (
    "http", "factory", "workers", "host", "port", "log_level", "access_log", "server_header",
    "timeout_keep_alive", "timeout_graceful_shutdown", "ssl_context_factory",
)  # fmt: skip


def pinned() -> Requirement:
    dependencies = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    (uvicorn_pin,) = [Requirement(dependency) for dependency in dependencies if dependency.startswith("uvicorn")]
    return uvicorn_pin


def fail_naming_the_release(problems: list[str]) -> None:
    if problems:
        pytest.fail(
            f"uvicorn {uvicorn.__version__} is installed (pyproject.toml: {pinned()}), and it changed what "
            f"exporter/server relies on: {'; '.join(problems)}"
        )


def test_the_pin_has_an_upper_bound_and_the_installed_release_is_within_it() -> None:
    """A release above the tested ones is a choice to make: run this file with it, then raise the bound."""
    specifier = pinned().specifier
    assert {spec.operator for spec in specifier} == {">=", "<"}, specifier
    assert specifier.contains(uvicorn.__version__), f"uvicorn {uvicorn.__version__} is outside {specifier}"


def test_the_readme_names_the_pinned_range() -> None:
    (named,) = re.findall(r"pinned to\s+the releases tested \(`([^`]+)`\)", README.read_text())
    assert SpecifierSet(named) == pinned().specifier


def test_the_methods_the_server_overrides_or_calls_keep_their_parameters() -> None:
    problems = []
    for owner, methods in METHODS.items():
        for name, parameters in methods.items():
            method = getattr(owner, name, None)
            if method is None:
                problems.append(f"{owner.__name__}.{name} is gone")
                continue
            found = tuple(parameter for parameter in inspect.signature(method).parameters if parameter != "self")
            if found != parameters:
                problems.append(f"{owner.__name__}.{name} takes {found}, not {parameters}")
            if ((owner, name) in AWAITED) != inspect.iscoroutinefunction(method):
                problems.append(
                    f"{owner.__name__}.{name} is {'no longer' if (owner, name) in AWAITED else 'now'} async"
                )
    fail_naming_the_release(problems)


def test_the_status_lines_of_the_refusals_written_before_a_request_exists() -> None:
    problems = [
        f"STATUS_LINE[{status}] is {STATUS_LINE.get(status)!r}"
        for status in sorted({refusal.status for refusal in REFUSALS.values()})
        if not STATUS_LINE.get(status, b"").startswith(f"HTTP/1.1 {status} ".encode())
    ]
    fail_naming_the_release(problems)


def test_serves_settings_are_uvicorn_config_parameters() -> None:
    accepted = inspect.signature(uvicorn.Config).parameters
    fail_naming_the_release([f"uvicorn.Config takes no {name}" for name in CONFIG_PARAMETERS if name not in accepted])


@pytest.fixture
def kept_connection() -> Iterator[Callable[[], Any]]:
    """Plain uvicorn with its httptools protocol on a free port, and one connection kept after a request; yields
    a function returning that connection's protocol."""

    async def app(scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 204, "headers": []})
            await send({"type": "http.response.body", "body": b""})

    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, http="httptools", log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
            connection.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert connection.recv(4096).startswith(b"HTTP/1.1 204 ")
            yield lambda: next(iter(server.server_state.connections))
    finally:
        server.should_exit = True
        thread.join(timeout=20)


def test_a_connection_has_the_attributes_the_server_reads(kept_connection: Callable[[], Any]) -> None:
    protocol = kept_connection()
    problems = []
    if type(protocol) is not HttpToolsProtocol:
        problems.append(f"http='httptools' serves with {type(protocol).__name__}, not HttpToolsProtocol")
    problems += [f"the protocol has no {name}" for name in PROTOCOL_ATTRIBUTES if not hasattr(protocol, name)]
    problems += [f"the cycle has no {name}" for name in CYCLE_ATTRIBUTES if not hasattr(protocol.cycle, name)]
    if not isinstance(getattr(protocol, "pipeline", None), deque):
        problems.append("the protocol's pipeline is no deque")
    if not isinstance(getattr(getattr(protocol, "flow", None), "write_paused", None), bool):
        problems.append("the flow control has no write_paused flag")
    fail_naming_the_release(problems)


def listed() -> set[str]:
    """The names the adapter's docstring lists as relied on: ``Owner.name``, or a name of a uvicorn module."""
    docstring = ast.get_docstring(ast.parse(ADAPTER.read_text())) or ""
    return set(re.findall(r"^- ``([\w.]+)``:", docstring, re.M))


def _uvicorn_imports(tree: ast.AST) -> set[str]:
    """The modules of uvicorn's below its top level that ``tree`` imports from, and the names it takes."""
    taken = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("uvicorn."):
            taken |= {f"{node.module}:{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            taken |= {alias.name for alias in node.names if alias.name.startswith("uvicorn.")}
    return taken


def test_only_the_adapter_reaches_below_uvicorns_top_level() -> None:
    reaching = sorted(
        str(path.relative_to(EXPORTER.parent))
        for path in EXPORTER.rglob("*.py")
        if path != ADAPTER and _uvicorn_imports(ast.parse(path.read_text()))
    )
    assert not reaching, "only exporter/server/uvicorn_adapter.py may import uvicorn's modules"


def test_every_uvicorn_name_the_adapter_uses_is_listed_in_its_docstring(
    kept_connection: Callable[[], Any],
) -> None:
    """The names it imports from uvicorn's modules, and every attribute or method it reads, sets, calls or
    overrides that uvicorn's protocol, cycle or flow control has (dunders aside), each under an owner that has it."""
    protocol = kept_connection()
    has = {
        "HttpToolsProtocol": set(dir(HttpToolsProtocol)) | set(vars(protocol)),
        "RequestResponseCycle": set(dir(RequestResponseCycle)) | set(vars(protocol.cycle)),
        "FlowControl": set(dir(FlowControl)) | set(vars(protocol.flow)),
    }
    names = listed()
    tree = ast.parse(ADAPTER.read_text())
    missing = {taken.partition(":")[2] for taken in _uvicorn_imports(tree)} - names
    used = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    used |= {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
    for name in sorted(name for name in used if not name.startswith("__")):
        owners = [owner for owner, names_of in has.items() if name in names_of]
        if owners and not any(f"{owner}.{name}" in names for owner in owners):
            missing.add(f"{'/'.join(owners)}.{name}")
    assert not missing, f"exporter/server/uvicorn_adapter.py relies on names its docstring does not list: {missing}"


def test_every_name_the_adapter_lists_is_in_the_installed_uvicorn(kept_connection: Callable[[], Any]) -> None:
    protocol = kept_connection()
    instances = {"HttpToolsProtocol": protocol, "RequestResponseCycle": protocol.cycle, "FlowControl": protocol.flow}
    modules = (inspect.getmodule(HttpToolsProtocol), inspect.getmodule(FlowControl))
    problems = []
    for name in sorted(listed()):
        owner, _, attribute = name.rpartition(".")
        if not owner:
            if not any(hasattr(module, attribute) for module in modules):
                problems.append(f"{attribute} is gone")
        elif not (hasattr(OWNERS[owner], attribute) or hasattr(instances[owner], attribute)):
            problems.append(f"{name} is gone")
    fail_naming_the_release(problems)


def test_the_parameters_of_every_method_listed_are_checked() -> None:
    methods = {
        name
        for name in listed()
        if "." in name and inspect.isfunction(getattr(OWNERS[name.partition(".")[0]], name.partition(".")[2], None))
    }
    checked = {f"{owner.__name__}.{method}" for owner, names in METHODS.items() for method in names}
    assert methods <= checked, methods - checked
