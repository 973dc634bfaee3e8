"""Concurrency against the real server: exact sums under many clients, and read-your-writes across workers."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from tests.helpers.exposition import info_labels, samples, single_value
from tests.helpers.figures import record
from tests.helpers.http import MSGPACK, request
from tests.helpers.processes import children, connection_owner
from tests.helpers.ready_responses import engine_blocks, ready_response
from tests.support import ExporterProcess

CLIENTS = 32
DEPLOYMENTS = 8
ENGINES = 16  # per deployment: 128 engine slots, 4 per client, spread over 4 deployments
ROUNDS = 10


def slots_of(client: int) -> list[tuple[str, int]]:
    """The engine slots one client writes; every deployment gets engines from 16 different clients."""
    return [(f"load-{slot // ENGINES}", slot % ENGINES) for slot in range(client, DEPLOYMENTS * ENGINES, CLIENTS)]


def value_of(client: int, round_: int, index: int) -> int:
    return 1 + client * 10_000 + round_ * 10 + index


def run_client(exporter: ExporterProcess, client: int, statuses: Counter[int], lock: threading.Lock) -> None:
    """Every round, re-report each of this client's engines with a new value."""
    for round_ in range(ROUNDS):
        for index, (deployment, engine) in enumerate(slots_of(client)):
            body = ready_response(engine, value_of(client, round_, index), ENGINES)
            path = f"/api/v1/deployments/{deployment}/ready"
            reply = request(exporter.url, "POST", path, body, MSGPACK, timeout=30)
            with lock:
                statuses[reply.status] += 1


def test_many_concurrent_clients_lose_no_update_and_sum_exactly(
    start_exporter: Callable[..., ExporterProcess], record_property: Callable[[str, object], None]
) -> None:
    exporter = start_exporter()
    statuses: Counter[int] = Counter()
    lock = threading.Lock()
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=CLIENTS) as pool:
        for outcome in [pool.submit(run_client, exporter, client, statuses, lock) for client in range(CLIENTS)]:
            outcome.result(timeout=300)
    seconds = time.monotonic() - started

    final = {
        slot: value_of(client, ROUNDS - 1, index)
        for client in range(CLIENTS)
        for index, slot in enumerate(slots_of(client))
    }
    state = request(exporter.url, "GET", "/api/v1/deployments").json()
    stored = engine_blocks(state)
    exposition = request(exporter.url, "GET", "/metrics").body.decode()
    lost = sum(1 for slot, value in final.items() if stored.get(slot) != value)
    per_engine = {
        (sample.labels["deployment"], int(sample.labels["engine"])): sample.value
        for sample in samples(exposition, "cache_config_num_gpu_blocks")
    }
    sums_wrong = 0
    for deployment in {name for name, _ in final}:
        expected = sum(value for (name, _), value in final.items() if name == deployment)
        synced = {labels["num_gpu_blocks"] for labels in info_labels(exposition, deployment).values()}
        api = next(item["labels"]["num_gpu_blocks"] for item in state if item["deployment"] == deployment)
        sums_wrong += synced != {str(expected)} or api != str(expected)
    accepted = single_value(exposition, "cache_config_exporter_ready_responses_accepted_total")
    figures = {
        "clients": CLIENTS,
        "deployments": DEPLOYMENTS,
        "engines": len(final),
        "requests_sent": sum(statuses.values()),
        "statuses": dict(statuses),
        "server_errors_5xx": sum(count for status, count in statuses.items() if status >= 500),
        "acknowledged_but_lost": lost,
        "wrong_sums": sums_wrong,
        "requests_per_second": round(sum(statuses.values()) / seconds),
    }
    record(record_property, "concurrency_exact_sums", **figures)
    assert statuses == Counter({200: CLIENTS * ROUNDS * len(slots_of(0))}), figures
    assert lost == 0 and sums_wrong == 0, figures
    assert stored == final and {slot: int(value) for slot, value in per_engine.items()} == final
    assert accepted == sum(statuses.values())


# Read-your-writes across worker processes ------------------------------------------------------------------


MIN_ITERATIONS = 100
MAX_ITERATIONS = 400
WANTED_CROSSINGS = 20


def test_a_scrape_on_any_worker_right_after_a_2xx_shows_it(
    start_exporter: Callable[..., ExporterProcess], record_property: Callable[[str, object], None]
) -> None:
    exporter = start_exporter("--web.workers", "2")
    assert exporter.process is not None
    workers = children(exporter.process.pid)

    def owner(client_port: int) -> int | None:
        return connection_owner(exporter.port, client_port, workers)

    served: Counter[str] = Counter()
    crossings = stale = errors = iterations = 0
    started = time.monotonic()
    while iterations < MAX_ITERATIONS and time.monotonic() - started < 120:
        if iterations >= MIN_ITERATIONS and crossings >= WANTED_CROSSINGS and min(served.values(), default=0) >= 10:
            break
        engine, value = iterations % 4, 1000 + iterations
        iterations += 1
        body = ready_response(engine, value, 4)
        ingest = request(exporter.url, "POST", "/api/v1/deployments/ryw/ready", body, MSGPACK, peer=owner)
        scrape = request(exporter.url, "GET", "/metrics", peer=owner)
        state = request(exporter.url, "GET", "/api/v1/deployments/ryw", peer=owner)
        errors += sum(reply.status != 200 for reply in (ingest, scrape, state))
        shown = {
            int(sample.labels["engine"]): sample.value
            for sample in samples(scrape.body.decode(), "cache_config_num_gpu_blocks")
            if sample.labels["deployment"] == "ryw"
        }
        read = {item["engine"]: item["response"]["num_gpu_blocks"] for item in state.json()["engines"]}
        stale += (shown.get(engine) != value) + (read.get(engine) != value)
        for reader in (scrape.peer, state.peer):
            served[str(reader)] += 1
            crossings += reader != ingest.peer
    figures = {
        "workers": len(served),
        "iterations": iterations,
        "requests_sent": iterations * 3,
        "reads_by_worker": sorted(served.values()),
        "reads_on_another_worker_than_the_ingest": crossings,
        "stale_reads": stale,
        "non_200": errors,
    }
    record(record_property, "read_your_writes_two_workers", **figures)
    assert "None" not in served, figures
    assert len(served) == 2, figures
    assert crossings >= WANTED_CROSSINGS, figures
    assert stale == 0 and errors == 0, figures
