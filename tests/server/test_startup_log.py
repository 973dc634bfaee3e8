"""The start-up log lines in the order the README ("Running it") says an operator sees them."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.support import ExporterProcess, wait_until

STARTING = "starting {} worker(s) on "
RUNNING = "Uvicorn running on "
COMPLETE = "Application startup complete"


def lines_once_started(exporter: ExporterProcess, workers: int) -> list[str]:
    """The log's lines once every worker has logged its start-up and the socket is bound."""

    def complete() -> list[str] | None:
        lines = exporter.log.read_text().splitlines()
        done = sum(COMPLETE in line for line in lines) == workers and any(RUNNING in line for line in lines)
        return lines if done else None

    return wait_until(complete, timeout=20)


def order(lines: list[str], workers: int) -> list[str]:
    """Which of the README's lines came, in order."""
    marks = (STARTING.format(workers), RUNNING, COMPLETE)
    return [mark for line in lines for mark in marks if mark in line]


@pytest.mark.parametrize(
    ("workers", "expected"),
    [
        (1, [STARTING.format(1), COMPLETE, RUNNING]),
        (2, [STARTING.format(2), RUNNING, COMPLETE, COMPLETE]),
    ],
)
def test_the_start_up_lines_come_in_the_readme_order(
    start_exporter: Callable[..., ExporterProcess], workers: int, expected: list[str]
) -> None:
    exporter = start_exporter("--web.workers", str(workers))
    assert order(lines_once_started(exporter, workers), workers) == expected


def test_a_start_with_a_flags_former_name_logs_the_name_to_use(
    start_exporter: Callable[..., ExporterProcess],
) -> None:
    exporter = start_exporter("--limits.engines-per-deployment", "64")
    lines = lines_once_started(exporter, 1)
    assert [line.split(": ", 1)[1] for line in lines if "its new name" in line] == [
        "--limits.engines-per-deployment is read as --limits.engines-per-replica, its new name: use that"
    ]
