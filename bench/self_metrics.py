"""``python -m bench.self_metrics``: what the exporter's own metrics cost a scrape, rendered by prometheus_client.

The exporter's counters, storage health, build info and process metrics are prometheus_client metrics in a
registry (exporter/exposition/telemetry.py), rendered by the library's encoder of the negotiated format. This times
that render, per format, against what a scrape pays when the last rendering is reused (no count changed
within the second): the figures behind caching it in exporter/exposition/rendering.py.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client import CollectorRegistry

from bench.load import percentile
from exporter.exposition.formats import OPENMETRICS, TEXT
from exporter.exposition.lines import ReplicaLines
from exporter.exposition.rendering import Exposition
from exporter.exposition.telemetry import Telemetry
from exporter.state.exporter_state import ExporterState
from exporter.state.storage import SqliteStore

RENDERS = 2000


def _p50_us(action: Callable[[], object]) -> float:
    times = []
    for _ in range(RENDERS):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return percentile(times, 50) * 1e6


def main() -> int:
    with tempfile.TemporaryDirectory() as directory:
        store = SqliteStore(Path(directory) / "exporter.db")
        state = ExporterState(store, {}, time.time)
        registry = CollectorRegistry()
        telemetry = Telemetry(registry, lambda: state.storage_error is None)
        exposition = Exposition(state, ReplicaLines(), registry, telemetry)
        figures = {}
        for served in (TEXT, OPENMETRICS):
            name = served.media_range
            figures[f"{name} render p50 us"] = _p50_us(lambda served=served: served.render(registry))
            accept = served.content_type
            figures[f"{name} reused p50 us"] = _p50_us(lambda accept=accept: exposition.render(accept, False))

            def changed(accept: str = accept) -> None:
                telemetry.reject("malformed")
                exposition.render(accept, False)

            figures[f"{name} after a count changed p50 us"] = _p50_us(changed)
        state.close()
        store.close()
    print(json.dumps({name: round(value, 1) for name, value in figures.items()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
