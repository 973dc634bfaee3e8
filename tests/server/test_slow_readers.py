"""Clients that send without reading, against a real ``cache-config-exporter serve``: heartbeats to a reader slower
than the exporter's answers each get their 204, and pipelined requests never read hold a bounded amount of memory,
which the exporter gives back once the clients leave."""

from __future__ import annotations

import re
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable

from tests.helpers.figures import record
from tests.helpers.http import MSGPACK, request
from tests.helpers.ready_responses import ready_response
from tests.support import ExporterProcess

HEARTBEAT = b"POST /api/v1/deployments/slow/heartbeat?replica=r&interval=30 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
# 6 MB of answers: more than the kernel's buffers take (4 MiB at most here), so they back up into the exporter's.
HEARTBEATS = 80_000
# What a slow reader's kernel offers to receive.
RECEIVE_BUFFER = 4096
# The slow reader reads nothing for this long, then a receive buffer's worth each READ_PAUSE seconds.
FIRST_READ_AFTER = 1.0
READ_PAUSE = 0.001


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
