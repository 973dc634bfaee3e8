"""The exporter's own metrics (exporter/exposition/telemetry.py): counted where things happen, shown on the next scrape,
and summed over every worker process."""

from __future__ import annotations

from collections.abc import Callable

from fastapi.testclient import TestClient

from tests.helpers.exposition import samples
from tests.helpers.http import MSGPACK, request
from tests.support import ExporterProcess, fixture_bytes

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


def test_counts_are_summed_over_every_worker_process(start_exporter: Callable[..., ExporterProcess]) -> None:
    """With ``--web.workers 2`` any worker may take a request or answer a scrape: each scrape shows all."""
    exporter = start_exporter("--web.workers", "2")
    accepted, refused = 24, 6
    for engine in range(accepted):  # each on a new connection, so both workers take some
        reply = request(exporter.url, "POST", f"/api/v1/deployments/d{engine}/ready", fixture_bytes("dp2-rank0"),
                        MSGPACK)  # fmt: skip
        assert reply.status == 200, reply.body
    for _ in range(refused):
        assert request(exporter.url, "POST", "/api/v1/deployments/d/ready", b"\xc1", MSGPACK).status == 400
    for _ in range(12):
        exposition = request(exporter.url, "GET", "/metrics").text
        assert samples(exposition, ACCEPTED)[0].value == accepted
        assert _rejected(exposition, "malformed") == refused
