"""The exporter's own metrics (exporter/exposition/telemetry.py): counted where things happen, shown on the next scrape,
and summed over every worker process."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector
from starlette.testclient import TestClient

from tests.helpers.exposition import samples
from tests.helpers.http import MSGPACK, request
from tests.support import ExporterProcess, fixture_bytes, wait_until

ACCEPTED = "cache_config_exporter_ready_responses_accepted_total"
REJECTED = "cache_config_exporter_ready_responses_rejected_total"


def _rejected(exposition: str, reason: str) -> float:
    return next(sample.value for sample in samples(exposition, REJECTED) if sample.labels["reason"] == reason)


def test_every_count_shows_on_the_very_next_scrape(client: TestClient) -> None:
    """The rendering of the exporter's own metrics is reused between scrapes, but never past a change."""
    for expected in (1.0, 2.0, 3.0):
        client.post("/api/v1/deployments/d/ready", content=b"\xc1", headers=MSGPACK)
        assert _rejected(client.get("/metrics").text, "malformed") == expected
        client.post("/api/v1/deployments/d/ready", content=fixture_bytes("dp2-rank0"), headers=MSGPACK)
        assert samples(client.get("/metrics").text, ACCEPTED)[0].value == expected


def test_refused_responses_are_not_accepted_ones(client: TestClient) -> None:
    refused = client.post("/api/v1/deployments/d/ready?engine=9", content=fixture_bytes("dp2-rank0"), headers=MSGPACK)
    assert refused.status_code == 422
    exposition = client.get("/metrics").text
    assert samples(exposition, ACCEPTED)[0].value == 0
    assert _rejected(exposition, "invalid") == 1


def accepted_by_each_worker(tmp_path: Path) -> list[float]:
    """What each worker process counted itself: its own file of the multiprocess counters ``serve`` keeps under
    ``$TMPDIR``, read alone."""
    counted = []
    for file in sorted(tmp_path.glob("tmp/cache-config-exporter-*/counter_*.db")):
        alone = tmp_path / "alone" / file.stem
        alone.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(file, alone / file.name)
        registry = CollectorRegistry()
        MultiProcessCollector(registry, str(alone))
        counted.append(registry.get_sample_value(ACCEPTED) or 0.0)
    return counted


def test_counts_are_summed_over_every_worker_process(
    start_exporter: Callable[..., ExporterProcess], tmp_path: Path
) -> None:
    """With ``--web.workers 2`` any worker may take a request or answer a scrape: each scrape shows all."""
    (tmp_path / "tmp").mkdir()
    exporter = start_exporter("--web.workers", "2", env={**os.environ, "TMPDIR": str(tmp_path / "tmp")})
    accepted, refused = 0, 6

    def both_workers_took_some() -> bool:
        """One more ready response, on a new connection (which either worker may take)."""
        nonlocal accepted
        path = f"/api/v1/deployments/d{accepted}/ready"
        assert request(exporter.url, "POST", path, fixture_bytes("dp2-rank0"), MSGPACK).status == 200
        accepted += 1
        return len([count for count in accepted_by_each_worker(tmp_path) if count > 0]) == 2

    wait_until(both_workers_took_some, timeout=60, interval=0)
    for _ in range(refused):
        assert request(exporter.url, "POST", "/api/v1/deployments/d/ready", b"\xc1", MSGPACK).status == 400
    assert sum(accepted_by_each_worker(tmp_path)) == accepted
    for _ in range(12):
        exposition = request(exporter.url, "GET", "/metrics").text
        assert samples(exposition, ACCEPTED)[0].value == accepted
        assert _rejected(exposition, "malformed") == refused
