"""Attacks by reads: bursts on the deployments list, and reads while another process holds SQLite's write lock."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

from tests.helpers.exposition import samples, single_value
from tests.helpers.figures import record
from tests.helpers.health import HealthWatch, recovery_seconds
from tests.helpers.http import MSGPACK, raw_socket, request
from tests.helpers.ready_responses import ready_response
from tests.server.test_attack_budget import shaped_payload
from tests.support import ExporterProcess, wait_until


def populate(exporter: ExporterProcess, deployments: int) -> None:
    def ingest(index: int) -> int:
        path = f"/api/v1/deployments/fleet-{index:05d}/ready"
        return request(exporter.url, "POST", path, ready_response(0, index + 1, 1), MSGPACK).status

    with ThreadPoolExecutor(4) as pool:
        assert set(pool.map(ingest, range(deployments))) == {200}


def hang_up_requests(url: str, count: int) -> int:
    """Ask for the whole list ``count`` times, each time hanging up at once; how many were sent."""
    parts = urlsplit(url)
    request = f"GET /api/v1/deployments HTTP/1.1\r\nHost: {parts.hostname}\r\n\r\n".encode()
    sent = 0
    for _ in range(count):
        try:
            with raw_socket(url) as connection:
                connection.sendall(request)
        except OSError:
            continue
        sent += 1
    return sent


def test_a_burst_on_the_deployments_list_leaves_the_exporter_responsive(
    start_exporter: Callable[..., ExporterProcess], record_property: Callable[[str, object], None]
) -> None:
    exporter = start_exporter()
    populate(exporter, 1000)
    size = len(request(exporter.url, "GET", "/api/v1/deployments").body)
    sent: list[int] = []
    with HealthWatch(exporter.url) as watch:
        burst = [threading.Thread(target=lambda: sent.append(hang_up_requests(exporter.url, 1000))) for _ in range(2)]
        for thread in burst:
            thread.start()
        for thread in burst:
            thread.join(timeout=120)
        ingest_started = time.monotonic()
        try:
            ingested = request(exporter.url, "POST", "/api/v1/deployments/fleet-00000/ready", ready_response(0, 7, 1),
                               MSGPACK).status  # fmt: skip
        except TimeoutError:
            ingested = 0
        ingest_seconds = time.monotonic() - ingest_started
    recovery = recovery_seconds(exporter.url, bound=60)
    record(record_property, "attack_deployments_list_burst", deployments=1000, list_bytes=size,
           requests=sum(sent), healthy_worst_seconds=round(watch.worst, 3),
           ingest_after_burst_seconds=round(ingest_seconds, 3), recovery_seconds=round(recovery, 3))  # fmt: skip
    assert ingested == 200 and watch.worst < 2.0 and ingest_seconds < 2.0 and recovery < 1.0


def test_the_deployments_list_pages_by_name(start_exporter: Callable[..., ExporterProcess]) -> None:
    exporter = start_exporter()
    populate(exporter, 30)
    everything = request(exporter.url, "GET", "/api/v1/deployments").json()
    assert "link" not in request(exporter.url, "GET", "/api/v1/deployments").headers
    pages, path = [], "/api/v1/deployments?limit=7"
    while path:
        reply = request(exporter.url, "GET", path)
        assert reply.status == 200
        pages.append(reply.json())
        link = reply.headers.get("link", "")
        path = link.removeprefix("<").partition(">")[0] if 'rel="next"' in link else ""
    assert [len(page) for page in pages] == [7, 7, 7, 7, 2]
    assert [deployment for page in pages for deployment in page] == everything
    after = request(exporter.url, "GET", "/api/v1/deployments?after=fleet-00027").json()
    assert [deployment["deployment"] for deployment in after] == ["fleet-00028", "fleet-00029"]
    for bad in ("limit=0", "limit=abc", "limit=100000"):
        assert request(exporter.url, "GET", f"/api/v1/deployments?{bad}").status == 422


def test_reads_with_several_workers_take_no_write_lock(
    start_exporter: Callable[..., ExporterProcess], record_property: Callable[[str, object], None]
) -> None:
    exporter = start_exporter("--web.workers", "2")
    blocker = sqlite3.connect(exporter.storage, isolation_level=None, timeout=5)
    latencies: list[float] = []
    statuses: list[int] = []
    healthy: list[float] = []
    stale = 0
    try:
        for blocks in (1, 2, 3):
            assert request(exporter.url, "POST", "/api/v1/deployments/shared/ready", ready_response(0, blocks, 1),
                           MSGPACK).status == 200  # fmt: skip
            blocker.execute("BEGIN IMMEDIATE")  # another process writing, for as long as the reads below take
            for path in ("/metrics", "/api/v1/deployments/shared", "/-/ready", "/metrics"):
                started = time.monotonic()
                reply = request(exporter.url, "GET", path)
                latencies.append(time.monotonic() - started)
                statuses.append(reply.status)
                if path == "/metrics":
                    healthy.append(single_value(reply.body.decode(), "cache_config_exporter_storage_healthy"))
                    shown = [sample.value for sample in samples(reply.body.decode(), "cache_config_num_gpu_blocks")]
                    stale += shown != [blocks]
            blocker.execute("ROLLBACK")
    finally:
        blocker.close()
    record(record_property, "attack_reads_under_a_foreign_write_lock", workers=2, reads=len(statuses),
           worst_seconds=round(max(latencies), 3), not_200=sum(status != 200 for status in statuses),
           storage_unhealthy=healthy.count(0.0), stale=stale)  # fmt: skip
    assert set(statuses) == {200} and set(healthy) == {1.0} and stale == 0
    assert max(latencies) < 0.5, latencies


# /metrics and /-/healthy under a flood of GET /: their p99 stays within this of the idle p99 (same test, same host).
FLOOD_P99_FACTOR = 3.0
FLOOD_P99_SLACK_SECONDS = 0.25


def p99(latencies: list[float]) -> float:
    ordered = sorted(latencies)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def timed_reads(url: str, rounds: int, seconds: float = 20.0) -> dict[str, list[float]]:
    """``rounds`` scrapes of /metrics and /-/healthy (fewer once ``seconds`` passed), each timed on a new
    connection; 5 s, the timeout, for one that failed."""
    latencies: dict[str, list[float]] = {"/metrics": [], "/-/healthy": []}
    deadline = time.monotonic() + seconds
    for _ in range(rounds):
        if time.monotonic() > deadline:
            break
        for path, taken in latencies.items():
            started = time.monotonic()
            try:
                ok = request(url, "GET", path, timeout=5.0).status == 200
            except OSError:
                ok = False
            taken.append(time.monotonic() - started if ok else 5.0)
    return latencies


def test_a_flood_of_status_page_reads_leaves_scrapes_and_health_checks_fast(
    start_exporter: Callable[..., ExporterProcess], record_property: Callable[[str, object], None]
) -> None:
    """Two clients loop on GET / over 100 replicas whose ready responses are 64 KiB of nested maps while a scraper
    reads /metrics and /-/healthy: their p99 stays within FLOOD_P99_FACTOR of the idle p99 plus 250 ms."""
    exporter = start_exporter()
    payload = shaped_payload()
    for replica in range(100):
        path = f"/api/v1/deployments/shaped/ready?replica=r{replica}"
        assert request(exporter.url, "POST", path, payload, MSGPACK).status == 200
    idle = timed_reads(exporter.url, 50)
    stop = threading.Event()
    pages: list[int] = []

    def flood() -> None:
        while not stop.is_set():
            try:
                pages.append(request(exporter.url, "GET", "/", timeout=30.0).status)
            except OSError:
                pages.append(0)

    clients = [threading.Thread(target=flood) for _ in range(2)]
    for client in clients:
        client.start()
    try:
        wait_until(lambda: len(pages) >= 2, timeout=60)
        flooded = timed_reads(exporter.url, 100)
    finally:
        stop.set()
        for client in clients:
            client.join(timeout=60)
    figures: dict[str, object] = {
        f"{phase}_{path.strip('/-').replace('/', '')}_p99_ms": round(p99(latencies[path]) * 1000, 1)
        for phase, latencies in (("idle", idle), ("flood", flooded))
        for path in latencies
    }
    record(record_property, "attack_status_page_flood", replicas=100, payload_bytes=len(payload),
           status_pages=len(pages), **figures)  # fmt: skip
    assert set(pages) == {200}
    for path in idle:
        bound = FLOOD_P99_FACTOR * p99(idle[path]) + FLOOD_P99_SLACK_SECONDS
        assert p99(flooded[path]) <= bound, f"{path}: p99 {p99(flooded[path]):.3f} s under the flood, bound {bound:.3f}"
