"""The byte budget: what the caps admit cannot make the exposition, the JSON state or the memory grow without bound."""

from __future__ import annotations

import os
from collections.abc import Callable

from tests.helpers.figures import record
from tests.helpers.http import MSGPACK, request
from tests.helpers.processes import memory_kib
from tests.helpers.ready_responses import BULKY_STATIC_CONFIG, ready_response
from tests.support import ExporterProcess

BUDGET = 16 << 20
# The documented worst case: RSS above its start-up figure, as a multiple of --limits.bytes.
RSS_PER_BUDGET_BYTE = 10


def test_label_amplification_stops_at_the_byte_budget(
    start_exporter: Callable[..., ExporterProcess], record_property: Callable[[str, object], None]
) -> None:
    exporter = start_exporter(env={**os.environ, "CACHE_CONFIG_EXPORTER_LIMITS_BYTES": str(BUDGET)})
    assert exporter.process is not None
    start_rss = memory_kib(exporter.process.pid)["VmRSS"]
    names = [f"amplified-{index}" for index in range(4)]
    for name in names:
        reply = request(exporter.url, "PUT", f"/api/v1/deployments/{name}/cache-config", BULKY_STATIC_CONFIG.encode(),
                        {"Content-Type": "application/json"})  # fmt: skip
        assert reply.status == 200, reply.body[:300]
    sent = refused = 0
    refusal = None
    for engine in range(256):
        for name in names:
            reply = request(exporter.url, "POST", f"/api/v1/deployments/{name}/ready",
                            ready_response(engine, engine + 1, 256, instance_id=name), MSGPACK)  # fmt: skip
            sent += 1
            if reply.status != 200:
                refused += 1
                refusal = refusal or reply
        if refusal:
            break
        # Scrapes and list reads in between build every cache, as Prometheus and dashboards would.
        assert request(exporter.url, "GET", "/metrics").status == 200
    if refusal is None:
        exposition = request(exporter.url, "GET", "/metrics", headers={"Accept-Encoding": "identity"}).body
        record(record_property, "attack_label_amplification", budget_bytes=BUDGET, ingests=sent, refused=0,
               exposition_bytes=len(exposition), rss_peak_growth_mib=round(
                   (memory_kib(exporter.process.pid)["VmHWM"] - start_rss) / 1024, 1))  # fmt: skip
    assert refusal is not None, f"{sent} ingests, none refused"
    problem = refusal.problem(429)
    assert problem["field"] == "bytes" and str(BUDGET) in problem["detail"] and "--limits.bytes" in problem["detail"]
    exposition = request(exporter.url, "GET", "/metrics", headers={"Accept-Encoding": "identity"}).body
    listing = request(exporter.url, "GET", "/api/v1/deployments").body
    assert len(exposition) <= BUDGET + (64 << 10)  # the exporter's own metrics come on top
    assert len(listing) < BUDGET
    # A refused change leaves the series as they were; a small deployment elsewhere is refused too, until room is made.
    assert request(exporter.url, "GET", "/metrics").body.count(b"cache_config_info{") == exposition.count(
        b"cache_config_info{"
    )
    assert request(exporter.url, "DELETE", f"/api/v1/deployments/{names[0]}").status == 204
    assert request(exporter.url, "POST", "/api/v1/deployments/small/ready", ready_response(0, 1, 1),
                   MSGPACK).status == 200  # fmt: skip
    peak_growth = memory_kib(exporter.process.pid)["VmHWM"] - start_rss
    record(record_property, "attack_label_amplification", budget_bytes=BUDGET, ingests=sent, refused=refused,
           exposition_bytes=len(exposition), list_bytes=len(listing),
           rss_peak_growth_mib=round(peak_growth / 1024, 1))  # fmt: skip
    assert peak_growth * 1024 <= RSS_PER_BUDGET_BYTE * BUDGET, f"RSS grew {peak_growth / 1024:.0f} MiB"
