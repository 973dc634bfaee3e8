"""A vLLM server of several API servers (``--api-server-count``, by default a dense model's data-parallel size)
says its goodbye from vLLM's main process once they are gone: exactly once per replica, however vLLM stops them,
and never for longer than the plugin's timeout.

With the stand-in vLLM (tests/vllm_standin), whose ``APIServerProcessManager`` starts and stops real processes
as vLLM 0.32.0's does; the real ``vllm serve``: tests/real_vllm/test_api_servers_goodbye.py.
"""

from __future__ import annotations

import argparse
import importlib
import multiprocessing
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from exporter.vllm_plugin import api_servers
from exporter.vllm_plugin.plugin import register
from tests.plugin.test_vllm_plugin import (  # noqa: F401  (pristine, stub, vllm_package: fixtures)
    REAL_VLLM,
    TIMEOUT,
    StubExporter,
    forwarder,
    frontend,
    plugin_on,
    pristine,
    ready_response,
    running,
    stub,
    two_engines,
    vllm_package,
)
from tests.support import wait_until

# The stand-in's APIServerProcessManager and EngineArgs; the real vLLM's need a model: its test starts vllm serve.
STAND_IN_ONLY = pytest.mark.skipif(REAL_VLLM, reason="the real vLLM's: tests/real_vllm/test_api_servers_goodbye.py")

# Served by path: the API servers and the main process both name the deployment after its last folder.
MODEL = "/models/tiny-qwen3-next"
DEPLOYMENT_PATH = "/api/v1/deployments/tiny-qwen3-next"
# A spawned API server imports this module and the plugin before it forwards: seconds on a loaded machine.
START_SECONDS = 60


def api_server(listen_address: str, sock: object, args: argparse.Namespace, client_config: dict[str, Any]) -> None:
    """One API server of vLLM's: loads the plugin, forwards its engines' ready responses and serves until SIGTERM,
    on which it shuts its client down and leaves, as vLLM's API servers do."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    register()
    client = running(frontend(args.model))
    try:
        for payload in two_engines():
            client._apply_ready_response(payload)
        if forwarder().flush(START_SECONDS):
            args.held.release()
        args.leave.wait(START_SECONDS)
    finally:
        client.shutdown()


@pytest.fixture
def main_process() -> Iterator[Callable[[int], Any]]:
    """What vLLM's main process does before it serves: make its config, then start ``count`` API servers
    (``api_server``), each of which has forwarded the replica when this returns. Returns the manager."""
    managers: list[Any] = []

    def start(count: int) -> Any:
        importlib.import_module("vllm.engine.arg_utils").EngineArgs(model=MODEL).create_engine_config()
        context = multiprocessing.get_context("spawn")
        args = argparse.Namespace(model=MODEL, held=context.Semaphore(0), leave=context.Event())
        listeners = [SimpleNamespace(address=f"ipc://api-server-{index}") for index in range(count)]
        manager_class = importlib.import_module("vllm.v1.utils").APIServerProcessManager
        manager = manager_class("127.0.0.1:8000", None, args, count, listeners, listeners, target_server_fn=api_server)
        managers.append(manager)
        for _ in range(count):
            assert args.held.acquire(timeout=START_SECONDS), "an API server did not forward its ready responses"
        return manager

    yield start
    for manager in managers:
        for process in manager.processes:
            process.kill()
            process.join()


def goodbyes(server: StubExporter) -> list[tuple[str, dict[str, str]]]:
    """The path and query of every DELETE the exporter received."""
    return [(r.path, r.query) for r in server.requests if r.method == "DELETE"]


@STAND_IN_ONLY
@pytest.mark.parametrize(
    "shutdown_timeout",
    [
        pytest.param(0, id="killed-at-once"),  # vLLM's default --shutdown-timeout: SIGTERM, then SIGKILL at once
        pytest.param(30, id="leaving-on-their-own"),  # they shut their clients down and exit on SIGTERM
    ],
)
def test_vllm_main_process_says_the_goodbye_of_its_api_servers_once_they_are_gone(
    monkeypatch: pytest.MonkeyPatch,
    stub: Callable[..., StubExporter],  # noqa: F811
    main_process: Callable[[int], Any],
    shutdown_timeout: int,
) -> None:
    server = stub()
    plugin_on(monkeypatch, server.url, replica="r1")
    manager = main_process(2)
    assert {path for _, path in server.routes()} == {f"{DEPLOYMENT_PATH}/cache-config", f"{DEPLOYMENT_PATH}/ready"}

    manager.shutdown(timeout=shutdown_timeout)
    # The one goodbye of the replica its API servers forwarded, before shutdown returned.
    assert goodbyes(server) == [(DEPLOYMENT_PATH, {"replica": "r1"})]
    if shutdown_timeout:
        assert [process.exitcode for process in manager.processes] == [0, 0]


@STAND_IN_ONLY
def test_the_main_process_goodbye_waits_at_most_the_timeout_for_an_exporter_that_hangs(
    monkeypatch: pytest.MonkeyPatch,
    stub: Callable[..., StubExporter],  # noqa: F811
    main_process: Callable[[int], Any],
) -> None:
    server = stub()
    with socket.socket() as hanging:
        # Takes connections (the kernel does) but never answers.
        hanging.bind(("127.0.0.1", 0))
        hanging.listen(8)
        urls = f"http://127.0.0.1:{hanging.getsockname()[1]}, {server.url}"
        plugin_on(monkeypatch, urls, replica="r1", timeout=str(TIMEOUT))
        manager = main_process(0)
        started = time.monotonic()
        manager.shutdown(timeout=0)
        assert time.monotonic() - started < TIMEOUT + 0.2
    assert goodbyes(server) == [(DEPLOYMENT_PATH, {"replica": "r1"})]


@pytest.mark.parametrize(
    ("goodbye_by", "says_goodbye"),
    [
        pytest.param(os.getppid, False, id="its-parent"),
        pytest.param(os.getpid, True, id="not-its-parent"),
    ],
)
def test_an_api_server_leaves_the_goodbye_only_to_the_parent_that_says_it(
    monkeypatch: pytest.MonkeyPatch,
    stub: Callable[..., StubExporter],  # noqa: F811
    goodbye_by: Callable[[], int],
    says_goodbye: bool,
) -> None:
    server = stub()
    monkeypatch.setenv(api_servers.GOODBYE_BY_VARIABLE, str(goodbye_by()))
    plugin_on(monkeypatch, server.url, replica="r1")
    client = running(frontend(MODEL))
    client._apply_ready_response(ready_response())
    assert forwarder().flush(10)

    client.shutdown()
    assert goodbyes(server) == ([(DEPLOYMENT_PATH, {"replica": "r1"})] if says_goodbye else [])
    # Either way, its delivery thread ends: no heartbeat of this process brings the replica back after the goodbye.
    (delivery,) = forwarder().deliveries
    wait_until(lambda: not delivery._thread.is_alive(), timeout=10)
