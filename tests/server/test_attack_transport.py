"""Attacks on connections themselves: oversized headers, slow headers, a client stalling a large scrape at SIGTERM.

New settings are passed as environment variables, which an exporter without them ignores: the same test
then shows the attack succeeding instead of failing to start.
"""

from __future__ import annotations

import functools
import os
import resource
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from tests.helpers.exposition import samples
from tests.helpers.figures import record
from tests.helpers.health import HealthWatch, recovery_seconds
from tests.helpers.http import MSGPACK, Reply, raw_socket, read_until_closed, request
from tests.helpers.processes import memory_kib
from tests.helpers.ready_responses import BULKY_STATIC_CONFIG, ready_response
from tests.support import ExporterProcess, unavailable, wait_until


def settings_env(**flags: str) -> dict[str, str]:
    """The environment with ``CACHE_CONFIG_EXPORTER_<FLAG>`` variables added."""
    return {**os.environ, **{f"CACHE_CONFIG_EXPORTER_{name.upper()}": value for name, value in flags.items()}}


def header_flood(url: str, limit: int) -> int:
    """Send one never-ending header line, up to ``limit`` bytes; how many bytes the server took before it closed."""
    sent = 0
    chunk = b"a" * (1 << 20)
    with raw_socket(url, timeout=10) as connection:
        try:
            connection.sendall(b"GET /-/healthy HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Filler: ")
            while sent < limit:
                connection.sendall(chunk)
                sent += len(chunk)
        except OSError:  # reset or closed by the server: it stopped reading
            pass
    return sent


def test_oversized_headers_get_431_and_cost_no_memory(
    start_exporter: Callable[..., ExporterProcess], record_property: Callable[[str, object], None]
) -> None:
    exporter = start_exporter()
    assert exporter.process is not None
    before = memory_kib(exporter.process.pid)
    flood = 64 << 20
    taken: list[int] = []
    with HealthWatch(exporter.url) as watch:
        floods = [threading.Thread(target=lambda: taken.append(header_flood(exporter.url, flood))) for _ in range(4)]
        for thread in floods:
            thread.start()
        for thread in floods:
            thread.join(timeout=60)
    after = memory_kib(exporter.process.pid)
    recovery = recovery_seconds(exporter.url)
    growth_mib = (after["VmHWM"] - before["VmRSS"]) / 1024
    record(record_property, "attack_oversized_headers", connections=4, offered_mib=4 * flood >> 20,
           taken_mib=round(sum(taken) / (1 << 20), 1), rss_growth_mib=round(growth_mib, 1),
           healthy_worst_seconds=round(watch.worst, 3), recovery_seconds=round(recovery, 3))  # fmt: skip
    assert len(taken) == 4 and max(taken) <= 4 << 20, f"the server read {taken} bytes of headers"
    assert growth_mib < 32, f"RSS grew by {growth_mib:.0f} MiB"
    assert watch.worst < 1.0, watch.latencies
    # A header just over the default cap fits the socket buffers: the 431 arrives before the close.
    with raw_socket(exporter.url) as connection:
        connection.sendall(b"GET /-/healthy HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Filler: " + b"a" * 32768)
        answer = read_until_closed(connection)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert b"application/problem+json" in answer and b"connection: close" in answer.lower()


def test_the_header_cap_is_exact(start_exporter: Callable[..., ExporterProcess]) -> None:
    exporter = start_exporter(env=settings_env(web_max_header_bytes="4096"))
    for size, status in ((4096, 200), (4097, 431)):
        head = b"GET /-/healthy HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nX-Filler: "
        request = head + b"a" * (size - len(head) - 4) + b"\r\n\r\n"
        assert len(request) == size
        with raw_socket(exporter.url) as connection:
            connection.sendall(request)
            answer = read_until_closed(connection)
        assert answer.startswith(f"HTTP/1.1 {status} ".encode()), (size, answer[:200])


def test_slow_header_clients_are_dropped_after_the_header_timeout(
    start_exporter: Callable[..., ExporterProcess], record_property: Callable[[str, object], None]
) -> None:
    exporter = start_exporter(env=settings_env(web_max_connections="50", web_header_timeout="1"))
    connections = [raw_socket(exporter.url, timeout=10) for _ in range(60)]
    try:
        for connection in connections:
            connection.sendall(b"GET /-/healthy HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Half: ")
        # At the cap, the connection whose head has been incomplete longest makes room: served at once.
        assert request(exporter.url, "GET", "/-/healthy").status == 200
        started = time.monotonic()
        recovered = _served_within(exporter.url, 8.0)
        recovery = time.monotonic() - started
        answers = [read_until_closed(connection) for connection in connections] if recovered else []
    finally:
        for connection in connections:
            connection.close()
    timed_out = sum(answer.startswith(b"HTTP/1.1 408 ") for answer in answers)
    over_the_cap = sum(answer.startswith(b"HTTP/1.1 503 ") for answer in answers)
    record(record_property, "attack_slow_headers", connections=60, max_connections=50, header_timeout=1,
           recovery_seconds=round(recovery, 3) if recovered else "over 8 s", answered_408=timed_out,
           answered_503=over_the_cap)  # fmt: skip
    assert recovered, "the stalled connections kept every slot"
    # The cap holds 50: from the 51st on, each closes the oldest stalled one with a 503 (or is answered 503 itself
    # when every other arrived with it); the rest are answered 408.
    assert timed_out + over_the_cap == 60, [answer[:40] for answer in answers]
    assert over_the_cap >= 10 + 1, [answer[:40] for answer in answers]  # and one for the request served


def _served_within(url: str, seconds: float) -> bool:
    """Whether ``/-/healthy`` answers 200 within ``seconds`` from now (polled)."""
    try:
        wait_until(lambda: request(url, "GET", "/-/healthy").status == 200, timeout=seconds)
    except AssertionError:
        return False
    return True


def stalled_scrape(url: str) -> socket.socket:
    """A connection asking for ``/metrics`` with a 4 KiB receive window that it never reads."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    connection = socket.socket()
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    connection.connect((host, int(port)))
    connection.sendall(f"GET /metrics HTTP/1.1\r\nHost: {host}\r\nAccept-Encoding: identity\r\n\r\n".encode())
    connection.settimeout(5)
    assert connection.recv(1, socket.MSG_PEEK), "the scrape did not start"
    return connection


@pytest.mark.parametrize("workers", [1, 2])
def test_sigterm_ends_in_the_shutdown_timeout_while_a_client_stalls_a_large_scrape(
    start_exporter: Callable[..., ExporterProcess], record_property: Callable[[str, object], None], workers: int
) -> None:
    exporter = start_exporter("--web.workers", str(workers), env=settings_env(web_shutdown_timeout="2"))
    assert exporter.process is not None
    json_type = {"Content-Type": "application/json"}
    assert request(exporter.url, "PUT", "/api/v1/deployments/bulky/cache-config", BULKY_STATIC_CONFIG.encode(),
                   json_type).status == 200  # fmt: skip
    for engine in range(128):  # about 8 MiB of exposition: more than the socket buffers hold
        reply = request(exporter.url, "POST", "/api/v1/deployments/bulky/ready",
                        ready_response(engine, engine + 1, 128, instance_id="bulky"), MSGPACK)  # fmt: skip
        assert reply.status == 200, reply.body[:300]
    acknowledged: list[int] = []
    stop = threading.Event()

    def ingest() -> None:
        for blocks in range(1, 100_000):
            if stop.is_set():
                return
            try:
                reply = request(exporter.url, "POST", "/api/v1/deployments/steady/ready",
                                ready_response(0, blocks, 1), MSGPACK, timeout=5)  # fmt: skip
            except OSError:
                return
            if reply.status == 200:
                acknowledged.append(blocks)

    with stalled_scrape(exporter.url):
        writer = threading.Thread(target=ingest, daemon=True)
        writer.start()
        wait_until(lambda: len(acknowledged) >= 5)
        started = time.monotonic()
        exporter.process.send_signal(signal.SIGTERM)
        try:
            code: Any = exporter.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            code = "still running"
        seconds = time.monotonic() - started
        stop.set()
        writer.join(timeout=10)
    record(record_property, f"attack_stalled_scrape_at_sigterm_workers_{workers}", shutdown_timeout=2, exit_code=code,
           exit_seconds=round(seconds, 2), acknowledged=len(acknowledged))  # fmt: skip
    assert code == 0 and seconds < 5, (code, seconds)
    exporter.start()
    exposition = request(exporter.url, "GET", "/metrics").body.decode()
    (stored,) = [sample.value for sample in samples(exposition, "cache_config_num_gpu_blocks")
                 if sample.labels["deployment"] == "steady"]  # fmt: skip
    assert stored >= max(acknowledged), "an acknowledged ingest was lost"


@pytest.mark.parametrize(("hard", "cap"), [(1024, 480), (4096, 1024)])
def test_idle_connections_past_the_cap_get_503_before_the_descriptors_run_out(
    tmp_path: Path, record_property: Callable[[str, object], None], hard: int, cap: int
) -> None:
    """A soft open-file limit of 1024 and the default --web.max-connections 1024: the exporter raises the soft limit
    to the hard one, or where that is 1024 too keeps its connections within it and says so; of 1,100 connections
    that send nothing, those past the cap each get the documented 503 (the oldest closed to make room for a
    newer one, or the newer one refused), never a reset, and those kept a 408 after --web.header-timeout."""
    own_soft, own_hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if own_hard != resource.RLIM_INFINITY and own_hard < 4096:
        unavailable(f"this test opens 1,100 connections and needs an open-file hard limit of 4096, not {own_hard}")
    exporter = ExporterProcess(tmp_path / "exporter.db", env=settings_env(web_header_timeout="2"))
    limited = functools.partial(subprocess.Popen, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE,
                                                                                         (1024, hard)))  # fmt: skip
    with mock.patch.object(subprocess, "Popen", limited):
        exporter.start()
    connections: list[socket.socket] = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(own_soft, 4096), own_hard))
    try:
        for _ in range(1100):
            connections.append(raw_socket(exporter.url, timeout=10))
        answers = [read_until_closed(connection) for connection in connections]
    finally:
        for connection in connections:
            connection.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (own_soft, own_hard))
    assert exporter.process is not None
    wait_until(lambda: request(exporter.url, "GET", "/-/healthy").status == 200, timeout=10)
    log = exporter.log.read_text()
    refused = [answer for answer in answers if answer.startswith(b"HTTP/1.1 503 ")]
    record(record_property, "attack_idle_connections_fd_limit", nofile=f"1024:{hard}", connections=1100,
           answered_503=len(refused))  # fmt: skip
    exporter.stop()
    assert all(answer.startswith((b"HTTP/1.1 503 ", b"HTTP/1.1 408 ")) for answer in answers), {
        answer[:40] for answer in answers
    }
    assert len(refused) >= 1100 - cap
    problems = [Reply.parse(answer).problem(503) for answer in refused]
    assert {problem["type"] for problem in problems} == {"urn:cache-config-exporter:problem:connections"}
    assert all(Reply.parse(answer).headers["retry-after"] == "1" for answer in refused)
    assert f"At the connection cap of {cap} " in log, log[-2000:]
    assert ("does not fit in the open-file limit of 1024" in log) == (hard == 1024), log[-2000:]
    assert "Traceback" not in log and "Too many open files" not in log, log[-2000:]
