"""The probe counts the workers of a probe-only exporter share in a memory file: none lost when processes count
at once, every process's scrape shows the sums."""

from __future__ import annotations

import subprocess
import sys

from prometheus_client import CollectorRegistry, generate_latest

from exporter.exposition.shared_counts import SharedCounter, create_shared_counts

INCREMENTS = 100_000
COUNT_IN_A_PROCESS = """
import sys
from exporter.exposition.shared_counts import SharedCounter
counter = SharedCounter(sys.argv[1], "probes", "h", "result", ["success", "timeout"])
for _ in range(int(sys.argv[2])):
    counter.inc("success")
counter.inc("timeout", 0.5)
"""


def test_processes_counting_at_once_lose_no_increment_and_each_shows_the_sums() -> None:
    path = create_shared_counts()
    counting = [subprocess.Popen([sys.executable, "-c", COUNT_IN_A_PROCESS, path, str(INCREMENTS)]) for _ in range(3)]
    assert [process.wait(timeout=60) for process in counting] == [0, 0, 0]
    registry = CollectorRegistry()
    registry.register(SharedCounter(path, "probes", "h", "result", ["success", "timeout"]))
    shown = generate_latest(registry).decode()
    assert f'probes_total{{result="success"}} {3.0 * INCREMENTS}' in shown
    assert 'probes_total{result="timeout"} 1.5' in shown
