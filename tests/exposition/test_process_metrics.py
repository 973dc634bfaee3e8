"""The process_* metrics: what Prometheus' client libraries show, with open descriptors counted cheaply."""

from __future__ import annotations

import os
import types
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, ProcessCollector

from exporter.exposition import process_metrics
from exporter.exposition.process_metrics import ProcessMetrics, open_fds

FD = Path("/proc/self/fd")


def _samples(collector: object) -> dict[str, tuple[str, float]]:
    registry = CollectorRegistry()
    registry.register(collector)  # type: ignore[arg-type]
    return {sample.name: (metric.type, sample.value) for metric in registry.collect() for sample in metric.samples}


def test_the_same_series_as_prometheus_clients_own_collector() -> None:
    """Dashboards and alerts written for any Prometheus client's process metrics keep working."""
    ours = _samples(ProcessMetrics())
    theirs = _samples(ProcessCollector(registry=None))
    assert {name: kind for name, (kind, _) in ours.items()} == {name: kind for name, (kind, _) in theirs.items()}
    for name in ("process_start_time_seconds", "process_max_fds"):
        assert ours[name][1] == pytest.approx(theirs[name][1], abs=0.02)
    # Theirs lists the directory through a descriptor of its own; both read memory and CPU at nearly one time.
    assert theirs["process_open_fds"][1] - ours["process_open_fds"][1] in (0, 1)
    assert ours["process_resident_memory_bytes"][1] == pytest.approx(
        theirs["process_resident_memory_bytes"][1], rel=0.1
    )
    assert ours["process_cpu_seconds_total"][1] == pytest.approx(theirs["process_cpu_seconds_total"][1], abs=0.5)


def _opened(count: int) -> list[int]:
    return [os.open(os.devnull, os.O_RDONLY) for _ in range(count)]


@pytest.mark.parametrize("kernel", ["6.2 or later: the size of the directory", "older: a size of 0, so listed"])
def test_each_open_descriptor_is_counted(kernel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if kernel.startswith("older"):
        real_stat = os.stat
        monkeypatch.setattr(
            process_metrics.os, "stat", lambda path: types.SimpleNamespace(st_size=0) if path == FD else real_stat(path)
        )
    elif os.stat(FD).st_size == 0:
        pytest.skip(f"this kernel ({os.uname().release}) shows no count as the size of {FD}")
    before = open_fds(FD)
    opened = _opened(40)
    try:
        assert open_fds(FD) == before + 40
    finally:
        for descriptor in opened:
            os.close(descriptor)
    assert open_fds(FD) == before


def test_without_proc_no_process_series_and_no_error(tmp_path: Path) -> None:
    assert _samples(ProcessMetrics(proc=tmp_path)) == {}
