"""A fleet: replicas of one deployment, each synced on its own, and expiry of replicas whose heartbeats stop.

Everything runs against a real exporter process over HTTP on loopback.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec

from protocol import releases
from tests.helpers.exposition import samples, scrape
from tests.helpers.http import MSGPACK, request
from tests.helpers.ready_responses import push_ready
from tests.helpers.release_payloads import ready_payload
from tests.support import ExporterProcess, wait_until

NEWEST = releases()[-1]


def push(exporter: ExporterProcess, replica: str, rank: int, *, instance: str = "run-1", heartbeat: float | None = None,
         blocks: int = 1000) -> dict:  # fmt: skip
    payload = ready_payload(
        NEWEST, data_parallel_size=2, data_parallel_rank=rank, instance_id=instance, num_gpu_blocks=blocks
    )
    query = f"?replica={replica}" + (f"&heartbeat={heartbeat}" if heartbeat else "")
    return push_ready(exporter.url, "qwen", payload, query)


def by_replica(exposition: str, name: str) -> dict[tuple[str, str], float]:
    """``name``'s samples of deployment qwen by (replica, engine)."""
    return {
        (s.labels["replica"], s.labels.get("engine", "")): s.value
        for s in samples(exposition, name)
        if s.labels["deployment"] == "qwen"
    }


def replicas_shown(exporter: ExporterProcess) -> set[str]:
    return {replica for replica, _ in by_replica(scrape(exporter.url), "cache_config_last_seen_timestamp_seconds")}


def test_replicas_sync_on_their_own_and_a_restart_replaces_only_its_own_engines(
    start_exporter: Callable[..., ExporterProcess],
) -> None:
    exporter = start_exporter()
    for number, replica in enumerate(("a", "b", "c")):
        for rank in (0, 1):
            push(exporter, replica, rank, blocks=1000 * (number + 1) + rank)
    info = scrape(exporter.url)
    totals = {
        (s.labels["replica"], s.labels["engine"]): s.labels["num_gpu_blocks"]
        for s in samples(info, "cache_config_info")
        if s.labels["deployment"] == "qwen"
    }
    # Each replica's frontend sums its own engines, exactly as vLLM does, and only its own.
    assert totals == {(r, e): str(2 * base + 1) for r, base in (("a", 1000), ("b", 2000), ("c", 3000)) for e in "01"}
    blocks = by_replica(info, "cache_config_num_gpu_blocks")
    assert sum(blocks.values()) == sum(int(total) for (r, e), total in totals.items() if e == "0")

    push(exporter, "b", 0, instance="run-2", blocks=7)
    after = by_replica(scrape(exporter.url), "cache_config_num_gpu_blocks")
    assert after == {**{key: value for key, value in blocks.items() if key[0] != "b"}, ("b", "0"): 7.0}


def test_a_replica_without_heartbeats_expires_and_is_counted(start_exporter: Callable[..., ExporterProcess]) -> None:
    exporter = start_exporter("--expiry.missed-heartbeats", "2")
    push(exporter, "silent", 0, heartbeat=1)
    push(exporter, "one-off", 0)
    started = time.monotonic()
    wait_until(lambda: replicas_shown(exporter) == {"one-off"}, timeout=10)
    assert time.monotonic() - started >= 1.5  # two missed intervals of 1 s, not before
    exposition = scrape(exporter.url)
    assert samples(exposition, "cache_config_exporter_replicas_expired_total")[0].value == 1
    assert not [s for s in samples(exposition, "cache_config_info") if s.labels["replica"] == "silent"]


def test_heartbeats_keep_a_replica_and_a_goodbye_removes_it_at_once(
    start_exporter: Callable[..., ExporterProcess],
) -> None:
    exporter = start_exporter("--expiry.missed-heartbeats", "2")
    push(exporter, "alive", 0, heartbeat=1)
    heartbeat = "/api/v1/deployments/qwen/heartbeat?replica=alive&interval=1"
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline:  # heartbeats every 0.5 s for twice the expiry period
        assert request(exporter.url, "POST", heartbeat, b"").status == 204
        time.sleep(0.5)
        assert "alive" in replicas_shown(exporter)
    assert request(exporter.url, "DELETE", "/api/v1/deployments/qwen?replica=alive").status == 204
    assert replicas_shown(exporter) == set()
    assert samples(scrape(exporter.url), "cache_config_exporter_replicas_expired_total")[0].value == 0


def test_a_heartbeat_for_an_unknown_replica_asks_for_its_state(start_exporter: Callable[..., ExporterProcess]) -> None:
    exporter = start_exporter()
    reply = request(exporter.url, "POST", "/api/v1/deployments/qwen/heartbeat?replica=new&interval=30", b"")
    assert reply.status == 404
    assert reply.json()["field"] == "replica"


def test_expiry_survives_a_restart_with_a_full_grace_period(start_exporter: Callable[..., ExporterProcess]) -> None:
    exporter = start_exporter("--expiry.missed-heartbeats", "2")
    push(exporter, "kept", 0, heartbeat=2)
    push(exporter, "dropped", 0, heartbeat=2)
    exporter.stop()
    time.sleep(5)  # longer than the expiry period (2 x 2 s): both were silent while the exporter was down
    exporter.start()
    restarted = time.monotonic()
    assert replicas_shown(exporter) == {"kept", "dropped"}  # a full period of grace after start-up
    heartbeat = "/api/v1/deployments/qwen/heartbeat?replica=kept&interval=2"
    while time.monotonic() - restarted < 7:
        assert request(exporter.url, "POST", heartbeat, b"").status == 204
        time.sleep(0.5)
    assert replicas_shown(exporter) == {"kept"}


def test_replica_names_are_checked(start_exporter: Callable[..., ExporterProcess]) -> None:
    exporter = start_exporter()
    payload = ready_payload(NEWEST)
    reply = request(exporter.url, "POST", "/api/v1/deployments/qwen/ready?replica=a%22b", payload, MSGPACK)
    assert reply.status == 422
    assert msgspec.json.decode(reply.body)["field"] == "query.replica"
