"""Clients that send without reading, against a real ``cache-config-exporter serve``: heartbeats to a reader slower
than the exporter's answers each get their 204, and pipelined requests never read hold a bounded amount of memory,
which the exporter gives back once the clients leave."""

from __future__ import annotations

import asyncio
import gc
import re
import socket
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import uvicorn
from prometheus_client import CollectorRegistry
from uvicorn.server import ServerState

from exporter.config.settings import Settings
from exporter.server.app import create_app
from exporter.server.uvicorn_adapter import HeartbeatAnsweringProtocol
from protocol import decode_ready_response
from tests.helpers.figures import record
from tests.helpers.health import health_latency
from tests.helpers.http import MSGPACK, request
from tests.helpers.processes import memory_kib
from tests.helpers.ready_responses import ready_response
from tests.support import ExporterProcess

HEARTBEAT = b"POST /api/v1/deployments/slow/heartbeat?replica=r&interval=30 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
# 6 MB of answers: more than the kernel's buffers take (4 MiB at most here), so they back up into the exporter's.
HEARTBEATS = 80_000
# What a slow reader's kernel offers to receive.
RECEIVE_BUFFER = 4096
# The slow reader reads nothing for this long, then a receive buffer's worth each READ_PAUSE seconds.
FIRST_READ_AFTER = 1.0
READ_PAUSE = 0.005


STATUS_LINE = b"HTTP/1.1 "


def statuses(received: bytes) -> Counter[int]:
    """The status of each answer in a stream of them (no body here holds a status line)."""
    return Counter(int(code) for code in re.findall(rb"HTTP/1\.1 (\d{3}) ", received))


def slow_reader(port: int) -> socket.socket:
    connection = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
    connection.settimeout(30)
    connection.connect(("127.0.0.1", port))
    return connection


def test_a_slow_reader_gets_a_204_for_every_heartbeat_and_nothing_else(
    start_exporter: Callable[..., ExporterProcess], record_property: Callable[[str, object], None]
) -> None:
    exporter = start_exporter()
    pushed = request(exporter.url, "POST", "/api/v1/deployments/slow/ready?replica=r&heartbeat=30",
                     ready_response(0, 1, 1), MSGPACK)  # fmt: skip
    assert pushed.status == 200
    received = bytearray()
    started = time.monotonic()
    with slow_reader(exporter.port) as connection:

        def send() -> None:
            for _ in range(HEARTBEATS // 100):
                connection.sendall(HEARTBEAT * 100)

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        time.sleep(FIRST_READ_AFTER)
        answers = 0
        while answers < HEARTBEATS and time.monotonic() - started < 120:
            try:
                chunk = connection.recv(RECEIVE_BUFFER)
            except ConnectionResetError:
                break
            if not chunk:
                break
            # Status lines ending in this chunk: one that began in the last chunk has its first bytes there.
            answers += (received[-len(STATUS_LINE) + 1 :] + chunk).count(STATUS_LINE)
            received += chunk
            time.sleep(READ_PAUSE)
        sender.join(timeout=30)
    answered = statuses(bytes(received))
    record(record_property, "slow_reader_heartbeats", heartbeats=HEARTBEATS, answers=dict(answered),
           seconds=round(time.monotonic() - started, 2))  # fmt: skip
    assert answered == {204: HEARTBEATS}


class BackedUpTransport(asyncio.Transport):
    """A transport to a peer that does not read: what is written stays pending and, past ``high`` bytes, the
    protocol is told to pause writing (as asyncio's and uvloop's transports tell it) until ``drain``."""

    def __init__(self, high: int) -> None:
        super().__init__()
        self.high = high
        self.written = bytearray()
        self.pending = 0
        self.paused = False
        self.closed = False
        self.aborted = False
        self.protocol: asyncio.Protocol | None = None

    def write(self, data: Any) -> None:
        self.written += data
        self.pending += len(data)
        if self.pending > self.high and not self.paused and self.protocol is not None:
            self.paused = True
            self.protocol.pause_writing()

    def drain(self, left: int = 0) -> None:
        """The peer read everything but ``left`` bytes (writing resumes once nothing is left)."""
        self.pending = left
        if left:
            return
        if self.paused and self.protocol is not None:
            self.paused = False
            self.protocol.resume_writing()

    def lose(self, exc: Exception | None) -> None:
        """The peer is gone: closed, the protocol told, and forgotten (as a real transport does)."""
        self.closed = True
        protocol, self.protocol = self.protocol, None
        if protocol is not None:
            protocol.connection_lost(exc)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = self.closed = True

    def get_write_buffer_size(self) -> int:
        return self.pending

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 10987) if name in ("peername", "sockname") else default


class InProcess:
    """The exporter's app in this process, with a replica that sends heartbeats, and its protocol over
    ``BackedUpTransport`` connections (made within a running event loop)."""

    def __init__(self, tmp_path: Path, **settings: object) -> None:
        app = create_app(Settings(storage_path=tmp_path / "exporter.db"), registry=CollectorRegistry())
        payload = ready_response(0, 1, 1)
        self.state = app.state.exporter.state
        # Committed from a thread of its own: made within a running event loop, a change reaches the writer only at
        # the end of the loop's turn, which waiting for it here would never let come.
        with ThreadPoolExecutor(1) as thread:
            response = decode_ready_response(payload)
            change = thread.submit(self.state.apply_ready, ("slow", "r"), 0, response, payload, "msgpack", 30.0)
            change.result(10).result(10)
        self.config = uvicorn.Config(app, access_log=False, log_level="warning")
        self.config.load()
        self.protocol = HeartbeatAnsweringProtocol.configured(
            **{"max_header_bytes": 8192, "header_timeout": 5.0, "write_timeout": 10.0, **settings},
            heartbeats=app.state.quick_heartbeats,
        )
        # One server's: its connections are counted together.
        self.server_state = ServerState()

    def connect(self, high: int) -> tuple[HeartbeatAnsweringProtocol, BackedUpTransport]:
        protocol = self.protocol(config=self.config, server_state=self.server_state, app_state={})
        transport = BackedUpTransport(high)
        transport.protocol = protocol
        protocol.connection_made(transport)
        return protocol, transport


async def answered_while_backed_up(
    tmp_path: Path, sent: list[bytes], answers_before_the_mark: int
) -> tuple[bytes, bool]:
    """Heartbeats sent to the exporter's protocol over a ``BackedUpTransport`` whose mark is crossed by the head
    of an answer, each read of ``sent`` once the ones before are answered as far as they can be (the peer reading
    whenever writing is paused): what was written, and whether the exporter closed the connection."""
    exporter = InProcess(tmp_path)
    protocol, one = exporter.connect(high=1 << 30)
    protocol.data_received(HEARTBEAT)
    protocol.connection_lost(None)
    answer = len(one.written)
    protocol, transport = exporter.connect(high=answers_before_the_mark * answer + answer // 2)
    heartbeats = b"".join(sent).count(HEARTBEAT[:20])
    for data in sent:
        protocol.data_received(data)
        for _ in range(100 * heartbeats):
            if transport.closed or transport.written.count(STATUS_LINE) >= heartbeats:
                break
            await asyncio.sleep(0)
            if transport.paused:
                transport.drain()
    answered = bytes(transport.written), transport.closed
    protocol.connection_lost(None)
    exporter.state.close()
    return answered


def test_a_heartbeat_whose_answer_crosses_the_write_mark_is_answered_once_it_drains(tmp_path: Path) -> None:
    """The eleventh answer's head crosses the transport's mark: its end waits for the peer to read, and every
    heartbeat sent after it is answered in turn, each a 204 and nothing else."""
    written, closed = asyncio.run(answered_while_backed_up(tmp_path, [HEARTBEAT * 200], answers_before_the_mark=10))
    assert statuses(written) == {204: 200}
    assert not closed


def test_a_head_begun_as_an_answer_ends_late_is_parsed_whole(tmp_path: Path) -> None:
    """The eleventh answer ends once the peer reads; the twelfth heartbeat waits behind it, and half the
    thirteenth's head is in: the twelfth's answer, then, leaves that half as it is."""
    half = len(HEARTBEAT) // 2
    sent = [HEARTBEAT * 12 + HEARTBEAT[:half], HEARTBEAT[half:]]
    written, closed = asyncio.run(answered_while_backed_up(tmp_path, sent, answers_before_the_mark=10))
    assert statuses(written) == {204: 13}
    assert not closed


HEALTHY = b"GET /-/healthy HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
FLOODERS = 4
FLOOD_SECONDS = 5.0
# RSS the flood may add to the exporter's, in MiB: without the bound, 4 connections took 1.2 GB in 20 s.
FLOOD_RSS_MIB = 32
# Once the flooders left, RSS is back within this many MiB of its baseline within RECOVERY_SECONDS.
BACK_WITHIN_MIB = 8
RECOVERY_SECONDS = 30.0


def seconds_until(condition: Callable[[], bool], timeout: float) -> float | None:
    """Seconds until ``condition`` holds, polled; ``None`` if it did not within ``timeout``."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            return None
        time.sleep(0.1)
    return time.monotonic() - started


def flood(port: int, until: float, sent_request: bytes = HEALTHY) -> int:
    """Requests pipelined in batches of 100 on one connection that never reads, until ``until`` or the exporter
    drops it; how many sent."""
    sent = 0
    with socket.create_connection(("127.0.0.1", port)) as connection:
        connection.settimeout(0.2)
        while time.monotonic() < until:
            try:
                connection.sendall(sent_request * 100)
            except TimeoutError:  # the exporter stopped reading: its buffers and ours are full
                continue
            except OSError:  # dropped past the write deadline
                break
            sent += 100
    return sent


def test_pipelined_requests_never_read_hold_bounded_memory_given_back_when_their_clients_leave(
    start_exporter: Callable[..., ExporterProcess], record_property: Callable[[str, object], None]
) -> None:
    exporter = start_exporter()
    assert exporter.process is not None
    pid = exporter.process.pid
    baseline = memory_kib(pid)["VmRSS"]
    until = time.monotonic() + FLOOD_SECONDS
    with ThreadPoolExecutor(FLOODERS) as pool:
        flooding = [pool.submit(flood, exporter.port, until) for _ in range(FLOODERS)]
        healthy_worst = max(health_latency(exporter.url, 5.0) for _ in range(20))
        sent = sum(future.result(timeout=FLOOD_SECONDS + 30) for future in flooding)
    peak = memory_kib(pid)["VmHWM"]
    back_after = seconds_until(lambda: memory_kib(pid)["VmRSS"] - baseline <= BACK_WITHIN_MIB << 10, RECOVERY_SECONDS)
    record(record_property, "pipelined_flood", connections=FLOODERS, seconds=FLOOD_SECONDS, requests_sent=sent,
           rss_baseline_mib=round(baseline / 1024, 1), rss_peak_growth_mib=round((peak - baseline) / 1024, 1),
           back_within_8_mib_seconds=back_after and round(back_after, 2),
           healthy_worst_seconds=round(healthy_worst, 3))  # fmt: skip
    assert (peak - baseline) / 1024 <= FLOOD_RSS_MIB
    assert back_after is not None, f"RSS {BACK_WITHIN_MIB} MiB above its baseline {RECOVERY_SECONDS} s after"
    assert healthy_worst < 1.0


async def left_with_requests_queued(tmp_path: Path) -> weakref.ref[HeartbeatAnsweringProtocol]:
    """A connection that sent 100 requests and read nothing, then left: its protocol, weakly."""
    exporter = InProcess(tmp_path)
    protocol, transport = exporter.connect(high=0)  # the peer reads nothing: every answer waits
    protocol.data_received(HEALTHY * 100)
    for _ in range(100):  # the app takes the first request and waits to write its answer
        await asyncio.sleep(0)
    transport.lose(ConnectionResetError())
    for _ in range(100):  # the app's task hears of it and ends
        await asyncio.sleep(0)
    exporter.state.close()
    return weakref.ref(protocol)


def test_a_connection_that_left_with_requests_queued_is_freed_without_the_collector(tmp_path: Path) -> None:
    """Its garbage is freed by reference counting: frozen (``gc_freeze``), cycles would stay out of the collector's
    reach (each queued request refers back to the protocol)."""
    gc.collect()
    gc.disable()
    try:
        protocol = asyncio.run(left_with_requests_queued(tmp_path))
        assert protocol() is None, "kept alive by a reference cycle"
    finally:
        gc.enable()
