"""A probe ends with its client: probes whose clients hung up do not keep ``/probe`` closed for others, and are
counted as such (a real exporter process, raw client sockets, stand-in targets on loopback)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from tests.helpers.exposition import samples, single_value
from tests.helpers.figures import record
from tests.helpers.http import request
from tests.probe import hostile
from tests.probe.test_probe import recorded_line, vllm_metrics
from tests.support import ExporterProcess, wait_until

CLIENTS = 4  # --probe.max-concurrent: every slot taken by a client that then leaves


def silent(connection: socket.socket, stopped: threading.Event) -> None:
    """Takes the request and never answers (until the target is stopped)."""
    stopped.wait(60)


@pytest.fixture
def targets() -> Iterator[tuple[hostile.HostileTarget, hostile.HostileTarget]]:
    never, healthy = (
        hostile.HostileTarget(silent),
        hostile.HostileTarget(hostile.serving(vllm_metrics(recorded_line("qwen3-next")))),
    )
    yield never, healthy
    never.stop()
    healthy.stop()


def hang_up_after_asking(url: str, target: str) -> socket.socket:
    host, _, port = url.removeprefix("http://").rpartition(":")
    client = socket.create_connection((host, int(port)), timeout=5)
    client.sendall(f"GET /probe?target={target} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
    return client


def test_probes_whose_clients_hung_up_end_and_free_their_slots(
    start_exporter: Callable[..., ExporterProcess],
    targets: tuple[hostile.HostileTarget, hostile.HostileTarget],
    record_property: Callable[[str, object], None],
) -> None:
    never, healthy = targets
    exporter = start_exporter(
        "--probe.allowed-targets", "127.0.0.0/8", "--probe.max-concurrent", str(CLIENTS), "--probe.timeout", "30"
    )
    clients = [hang_up_after_asking(exporter.url, never.target) for _ in range(CLIENTS)]
    wait_until(lambda: never.requests == CLIENTS)  # every slot holds a probe waiting for the silent target
    full, _ = hostile.probe(exporter.url, healthy.target)
    assert full.status == 503, "the slots are taken while their clients wait"
    for client in clients:
        client.close()
    hung_up = time.monotonic()
    reply = wait_until(lambda: (answer := hostile.probe(exporter.url, healthy.target)[0]).status == 200 and answer)
    freed = time.monotonic() - hung_up
    assert single_value(reply.body.decode(), "cache_config_probe_success") == 1.0
    record(record_property, "probe_slots_freed_after_hang_ups", clients=CLIENTS, freed_seconds=round(freed, 3))
    assert freed < 2.0, f"/probe stayed closed {freed:.1f} s after the clients left"
    own = request(exporter.url, "GET", "/metrics").text
    counted = {sample.labels["result"]: sample.value for sample in samples(own, "cache_config_exporter_probes_total")}
    assert (counted["client_left"], counted["success"], counted["timeout"]) == (CLIENTS, 1.0, 0.0), counted
