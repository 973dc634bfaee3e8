from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from starlette.testclient import TestClient

from exporter.config.settings import Settings
from exporter.server.app import create_app
from tests.helpers.figures import pytest_terminal_summary  # noqa: F401  (prints the figures tests record)
from tests.helpers.progress import (  # noqa: F401  (the run shown on the terminal as it goes)
    pytest_configure,
    pytest_runtest_protocol,
    pytest_unconfigure,
)
from tests.helpers.slow_group import (  # noqa: F401  (the slow tests on one pytest-xdist worker)
    put_slow_tests_in_the_group,
    pytest_configure_node,
    pytest_xdist_make_scheduler,
)
from tests.real_vllm.session import tiny_models, vllm_venv  # noqa: F401  (one of each for the whole run)
from tests.support import ExporterProcess, is_slow_file


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by mark, and before pytest-xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if is_slow_file(item.path):
            item.add_marker(pytest.mark.slow)
    put_slow_tests_in_the_group(config, items)


@pytest.fixture
def make_client(tmp_path: Path) -> Iterator[Callable[..., TestClient]]:
    """Build the real ASGI app on a fresh SQLite file and registry; keyword arguments go to ``Settings``."""
    clients: list[TestClient] = []

    def make(**settings: object) -> TestClient:
        settings.setdefault("storage_path", tmp_path / "exporter.db")
        client = TestClient(create_app(Settings(**settings), registry=CollectorRegistry()))
        client.__enter__()
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)


@pytest.fixture
def client(make_client: Callable[..., TestClient]) -> TestClient:
    return make_client()


@pytest.fixture
def start_exporter(tmp_path: Path) -> Iterator[Callable[..., ExporterProcess]]:
    """Start real exporter processes (``storage`` defaults to a file in this test's temp dir)."""
    processes: list[ExporterProcess] = []

    def start(
        *args: str, storage: Path | None = None, env: dict[str, str] | None = None, **options: Any
    ) -> ExporterProcess:
        process = ExporterProcess(storage or tmp_path / "exporter.db", *args, env=env, **options).start()
        processes.append(process)
        return process

    yield start
    for process in processes:
        process.stop()
