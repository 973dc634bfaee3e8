"""Hostile probe targets on loopback, and what a fleet's clients see of the exporter while it probes them.

Each target is a raw TCP server on 127.0.0.1 answering every connection with one of the answers below, which
stop by themselves: when the exporter hangs up, when the target is stopped, or after a bounded amount sent.
``Beside`` times what must stay fast during hostile probes: a plugin's heartbeat and a Prometheus scrape.
Used by ``test_probe_hostile.py`` (bounded) and ``reproduce_hostile.py`` (the reviewer's scale).
"""

from __future__ import annotations

import gzip
import os
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

from tests.helpers.http import MSGPACK, Reply, request
from tests.helpers.ready_responses import ready_response

Answer = Callable[[socket.socket, threading.Event], None]
# What an endless answer sends at most, so that a target the exporter never hangs up on still stops.
MOST_SENT = 256 << 20
SECRET = "SECRET_API_KEY=sk-live-4f9c2a7be1d04c55"
HEARTBEAT_TIMEOUT = 2.0  # the plugin's
SCRAPE_TIMEOUT = 10.0  # Prometheus' default


class _Handler(socketserver.BaseRequestHandler):
    server: HostileTarget

    def handle(self) -> None:
        self.request.settimeout(5)
        try:
            self.request.recv(65536)  # the probe's request, in one segment on loopback
            self.server.requests += 1
            self.server.answer(self.request, self.server.stopped)
        except OSError:
            pass  # the exporter hung up: what it should do


class HostileTarget(socketserver.ThreadingTCPServer):
    """A raw TCP server on a free loopback port answering every connection with ``answer``."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, answer: Answer) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.answer = answer
        self.stopped = threading.Event()
        self.requests = 0  # answered or being answered
        self.target = f"127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.stopped.set()
        self.shutdown()
        self.server_close()


def _head(*headers: str) -> bytes:
    return ("HTTP/1.1 200 OK\r\n" + "".join(f"{header}\r\n" for header in headers) + "\r\n").encode()


def tiny_chunks(connection: socket.socket, stopped: threading.Event) -> None:
    """Endless 1-byte chunks of valid samples (``a 1``): six bytes on the wire for each byte of body."""
    connection.sendall(_head("Content-Type: text/plain; version=0.0.4", "Transfer-Encoding: chunked"))
    block = b"".join(b"1\r\n%c\r\n" % byte for byte in b"a 1\n") * 2_500
    for _ in range(MOST_SENT // len(block)):
        if stopped.is_set():
            return
        connection.sendall(block)


def serving(body: bytes, *headers: str) -> Answer:
    """A whole body with its ``Content-Length`` (and ``headers``), then the connection closed."""

    return answering(_head(f"Content-Length: {len(body)}", *headers) + body)


def answering(answer: bytes) -> Answer:
    """``answer`` as it is (head and all), then the connection closed."""

    def send(connection: socket.socket, stopped: threading.Event) -> None:
        connection.sendall(answer)

    return send


def chunked(body: bytes, size: int = 1) -> Answer:
    """``body`` in chunks of ``size`` bytes, then its end."""
    framed = b"".join(
        b"%x\r\n%s\r\n" % (len(part), part) for part in (body[i : i + size] for i in range(0, len(body), size))
    )
    return answering(_head("Transfer-Encoding: chunked") + framed + b"0\r\n\r\n")


def many_samples(count: int) -> bytes:
    """``count`` tiny samples (four bytes each): the most samples a body under the cap can hold."""
    return b"a 1\n" * count


def trickle(connection: socket.socket, stopped: threading.Event) -> None:
    """A valid head, then one byte of body every 10 ms."""
    connection.sendall(_head("Content-Length: 1048576"))
    for _ in range(100_000):
        if stopped.wait(0.01):
            return
        connection.sendall(b"#")


def gzip_bomb(inflated: int = 256 << 20) -> bytes:
    """A gzip body that inflates to ``inflated`` bytes (256 MiB: about 250 KiB on the wire)."""
    return gzip.compress(bytes(inflated), compresslevel=9)


@dataclass
class Beside:
    """Heartbeats and scrapes timed back to back, each on a new connection, while the ``with`` block runs, and
    probes of ``healthy`` (a vLLM target) when given; a request that failed or timed out counts as its timeout."""

    url: str
    healthy: str | None = None
    latencies: dict[str, list[float]] = field(default_factory=lambda: {"heartbeat": [], "scrape": [], "probe": []})
    failed: dict[str, int] = field(default_factory=lambda: {"heartbeat": 0, "scrape": 0, "probe": 0})

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._time, daemon=True)

    def _timed(self, kind: str, method: str, path: str, timeout: float, ok: Callable[[Reply], bool]) -> None:
        started = time.monotonic()
        try:
            answered = ok(request(self.url, method, path, timeout=timeout))
        except OSError:
            answered = False
        self.failed[kind] += not answered
        self.latencies[kind].append(time.monotonic() - started if answered else timeout)

    def _time(self) -> None:
        while not self._stop.is_set():
            path = "/api/v1/deployments/fleet/heartbeat?interval=30"
            self._timed("heartbeat", "POST", path, HEARTBEAT_TIMEOUT, lambda reply: reply.status == 204)
            self._timed("scrape", "GET", "/metrics", SCRAPE_TIMEOUT, lambda reply: reply.status == 200)
            if self.healthy is not None:
                self._timed("probe", "GET", f"/probe?target={self.healthy}", SCRAPE_TIMEOUT,
                            lambda reply: b"\ncache_config_probe_success 1.0\n" in reply.body)  # fmt: skip
            self._stop.wait(0.05)

    def __enter__(self) -> Beside:
        assert request(self.url, "POST", "/api/v1/deployments/fleet/ready", ready_response(0, 64, 1),
                       MSGPACK).status == 200  # fmt: skip
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * SCRAPE_TIMEOUT + 5)


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * fraction))] if ordered else 0.0


def probe(url: str, target: str, debug: bool = False, timeout: float = 30.0) -> tuple[Reply, float]:
    """One ``/probe`` of ``target`` and the seconds its answer took (``status`` 0 when there was none)."""
    path = f"/probe?target={quote(target)}" + ("&debug=true" if debug else "")
    started = time.monotonic()
    try:
        reply = request(url, "GET", path, timeout=timeout)
    except OSError:
        reply = Reply(0, {}, b"")
    return reply, time.monotonic() - started


def probing(url: str, target: str, clients: int, seconds: float) -> list[tuple[Reply, float]]:
    """``clients`` threads each probing ``target`` back to back, at least once and until ``seconds`` passed."""
    answers: list[tuple[Reply, float]] = []
    deadline = time.monotonic() + seconds

    def loop() -> None:
        answers.append(probe(url, target))
        while time.monotonic() < deadline:
            answers.append(probe(url, target))

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=seconds + 60)
    return answers


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds a process has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_after(pid: int, settle: float = 1.0, window: float = 1.0) -> float:
    """CPU seconds the process uses in the ``window`` seconds that begin ``settle`` seconds from now."""
    time.sleep(settle)  # the time the work is allowed to take to end, not a stand-in for synchronisation
    before = cpu_seconds(pid)
    time.sleep(window)
    return cpu_seconds(pid) - before


@contextmanager
def hostile(answer: Answer) -> Iterator[HostileTarget]:
    target = HostileTarget(answer)
    try:
        yield target
    finally:
        target.stop()
