"""The byte budget: what the caps admit cannot make the exposition, the JSON state or the memory grow without bound."""

from __future__ import annotations

import os
from collections.abc import Callable

import msgspec

from tests.helpers.figures import record
from tests.helpers.http import MSGPACK, request
from tests.helpers.processes import memory_kib
from tests.helpers.ready_responses import BULKY_STATIC_CONFIG, ready_response
from tests.support import ExporterProcess, fixture_bytes

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


def shaped_payload() -> bytes:
    """64 KiB of the hybrid fixture whose ``vllm_config`` is 65,000 empty maps: 4.5 MiB once decoded to Python."""
    response = msgspec.msgpack.decode(fixture_bytes("hybrid-tp1-post50809"))
    response["vllm_config"] = {"a": [{}] * 65_000}
    return msgspec.msgpack.encode(response)


def test_a_payload_that_decodes_large_costs_what_its_bytes_cost(
    start_exporter: Callable[..., ExporterProcess], record_property: Callable[[str, object], None]
) -> None:
    """Pushes to new replicas until the 429: the RSS stays within RSS_PER_BUDGET_BYTE of --limits.bytes, also once
    the list and the status page (which show every engine) were read."""
    exporter = start_exporter(env={**os.environ, "CACHE_CONFIG_EXPORTER_LIMITS_BYTES": str(BUDGET)})
    assert exporter.process is not None
    payload = shaped_payload()
    start_rss = memory_kib(exporter.process.pid)["VmRSS"]
    accepted = 0
    for replica in range(2 * BUDGET // len(payload)):
        reply = request(exporter.url, "POST", f"/api/v1/deployments/shaped/ready?replica=r{replica}", payload, MSGPACK)
        if reply.status == 429:
            break
        assert reply.status == 200, reply.body[:300]
        accepted += 1
    else:
        raise AssertionError(f"{accepted} pushes of {len(payload)} bytes, none refused")
    after_pushes = memory_kib(exporter.process.pid)["VmRSS"]
    listing = request(exporter.url, "GET", "/api/v1/deployments")
    assert listing.status == 200 and len(listing.json()) == accepted
    assert request(exporter.url, "GET", "/").status == 200
    after_reads = memory_kib(exporter.process.pid)
    growth = {"pushes": after_pushes - start_rss, "reads": after_reads["VmRSS"] - start_rss}
    record(record_property, "attack_payload_shape", budget_bytes=BUDGET, payload_bytes=len(payload),
           accepted=accepted, rss_growth_after_pushes_mib=round(growth["pushes"] / 1024, 1),
           rss_growth_after_reads_mib=round(growth["reads"] / 1024, 1),
           rss_peak_growth_mib=round((after_reads["VmHWM"] - start_rss) / 1024, 1))  # fmt: skip
    assert max(growth.values()) * 1024 <= RSS_PER_BUDGET_BYTE * BUDGET, f"RSS grew by {growth} KiB"


def test_a_value_json_cannot_show_is_refused_at_the_door_and_never_breaks_the_list(
    start_exporter: Callable[..., ExporterProcess],
) -> None:
    """A msgpack extension under an unknown key: 422 naming its path, nothing stored, the list still 200."""
    exporter = start_exporter()
    assert (
        request(exporter.url, "POST", "/api/v1/deployments/kept/ready", ready_response(0, 1, 1), MSGPACK).status == 200
    )
    response = msgspec.msgpack.decode(fixture_bytes("hybrid-tp1-post50809"))
    response["future"] = {"when": [msgspec.msgpack.Ext(7, b"\x00" * 8)]}
    refused = request(exporter.url, "POST", "/api/v1/deployments/poisoned/ready", msgspec.msgpack.encode(response),
                      MSGPACK)  # fmt: skip
    problem = refused.problem(422)
    assert problem["field"] == "$.future.when[0]" and "msgpack extension" in problem["detail"]
    listing = request(exporter.url, "GET", "/api/v1/deployments")
    assert listing.status == 200 and [replica["deployment"] for replica in listing.json()] == ["kept"]
    assert request(exporter.url, "GET", "/api/v1/deployments/poisoned").status == 404
    assert request(exporter.url, "GET", "/").status == 200


def test_replicas_that_come_and_go_between_scrapes_leave_nothing_behind(
    start_exporter: Callable[..., ExporterProcess], record_property: Callable[[str, object], None]
) -> None:
    """300 rounds of bulky labels, a ready response and a goodbye, with no scrape between: the RSS stays within
    a round's worth of 16 MiB, and the first scrape after sees none of them."""
    exporter = start_exporter(env={**os.environ, "CACHE_CONFIG_EXPORTER_LIMITS_BYTES": str(BUDGET)})
    assert exporter.process is not None
    start_rss = memory_kib(exporter.process.pid)["VmRSS"]
    for round_ in range(300):
        path = f"/api/v1/deployments/churn/cache-config?replica=r{round_}"
        labels = BULKY_STATIC_CONFIG.encode()
        assert request(exporter.url, "PUT", path, labels, {"Content-Type": "application/json"}).status == 200
        path = f"/api/v1/deployments/churn/ready?replica=r{round_}"
        assert request(exporter.url, "POST", path, ready_response(0, 1, 1), MSGPACK).status == 200
        assert request(exporter.url, "DELETE", f"/api/v1/deployments/churn?replica=r{round_}").status == 204
    growth = memory_kib(exporter.process.pid)["VmRSS"] - start_rss
    exposition = request(exporter.url, "GET", "/metrics").body
    record(record_property, "attack_replica_churn", rounds=300, rss_growth_mib=round(growth / 1024, 1))
    assert b'deployment="churn"' not in exposition
    assert growth <= 16 << 10, f"RSS grew {growth / 1024:.0f} MiB"
