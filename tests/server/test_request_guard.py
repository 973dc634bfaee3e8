"""The request guard on a raw socket: what an HTTP client library would never send, on keep-alive connections.

The header cap and timer must hold for every request of a connection, not only its first; the header timer and the
body's time limit are for the whole head and body, however they are trickled; a Host name with the trailing dot of
a fully qualified name is the same name.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from starlette.types import Message, Receive, Scope, Send

from exporter.server.problems import Problem
from exporter.server.request_guard import RequestGuard
from tests.helpers.http import MSGPACK, raw_socket, read_until_closed, request
from tests.helpers.ready_responses import ready_response
from tests.server.test_attack_transport import settings_env
from tests.support import ExporterProcess

HEADER_TIMEOUT = 1.0
READ_TIMEOUT = 1.0
MAX_HEADER_BYTES = 4096
HEALTHY = b"GET /-/healthy HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


@pytest.fixture(scope="module")
def exporter(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ExporterProcess]:
    env = settings_env(web_header_timeout=str(HEADER_TIMEOUT), web_read_timeout=str(READ_TIMEOUT),
                       web_max_header_bytes=str(MAX_HEADER_BYTES), web_allowed_hosts="exporter.internal")  # fmt: skip
    process = ExporterProcess(tmp_path_factory.mktemp("guard") / "exporter.db", env=env).start()
    yield process
    process.stop()


def first_answered(connection: socket.socket) -> None:
    """Send a whole request on ``connection`` and read its whole answer: the connection is then kept alive."""
    connection.sendall(HEALTHY)
    answer = b""
    while not answer.endswith(b"Healthy.\n"):
        chunk = connection.recv(4096)
        assert chunk, answer
        answer += chunk
    assert answer.startswith(b"HTTP/1.1 200 "), answer


def problem(answer: bytes, status: int) -> dict[str, object]:
    """The problem document of a refusal written before any request existed, checked against its status line."""
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status} ".encode()), answer[:200]
    assert b"content-type: application/problem+json" in head.lower()
    document: dict[str, object] = json.loads(body)
    assert document["status"] == status
    return document


def test_the_header_timer_holds_for_a_kept_alive_connections_second_request(exporter: ExporterProcess) -> None:
    with raw_socket(exporter.url, timeout=10) as connection:
        first_answered(connection)
        connection.sendall(b"GET /-/healthy HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Half: ")
        started = time.monotonic()
        answer = read_until_closed(connection)
        waited = time.monotonic() - started
    assert problem(answer, 408)["field"] == "headers"
    assert HEADER_TIMEOUT * 0.9 <= waited < HEADER_TIMEOUT + 2.0, waited


def test_the_header_cap_holds_for_a_kept_alive_connections_second_request(exporter: ExporterProcess) -> None:
    with raw_socket(exporter.url, timeout=10) as connection:
        first_answered(connection)
        first_answered(connection)  # a third request still has the whole room, not what the first two left
        filler = b"a" * MAX_HEADER_BYTES
        connection.sendall(b"GET /-/healthy HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Filler: " + filler + b"\r\n\r\n")
        answer = read_until_closed(connection)
    assert problem(answer, 431)["field"] == "headers"


def test_a_head_sent_in_pieces_leaves_no_timer_to_close_its_connection_once_idle(exporter: ExporterProcess) -> None:
    """A head that takes several reads is timed once: answered, its kept-alive connection stays open and quiet past
    the header timeout, and serves the next request."""
    with raw_socket(exporter.url, timeout=10) as connection:
        middle = len(HEALTHY) // 2
        connection.sendall(HEALTHY[:middle])
        time.sleep(0.2)  # the client's pace: the second piece is a read of its own
        connection.sendall(HEALTHY[middle:])
        answer = b""
        while not answer.endswith(b"Healthy.\n"):
            chunk = connection.recv(4096)
            assert chunk, answer
            answer += chunk
        connection.settimeout(1.5 * HEADER_TIMEOUT)
        try:
            unexpected: bytes | None = connection.recv(4096)
        except TimeoutError:
            unexpected = None
        assert unexpected is None, f"the idle connection got {unexpected!r}"
        connection.settimeout(10)
        first_answered(connection)


def test_a_body_arriving_in_parts_is_limited_as_a_whole() -> None:
    """Each part within --web.max-request-bytes, together past it: refused (413) once the whole passes the limit."""
    parts: list[Message] = [
        {"type": "http.request", "body": b"x" * 6, "more_body": True},
        {"type": "http.request", "body": b"x" * 6, "more_body": False},
    ]
    read: list[bytes] = []

    async def reading_app(scope: Scope, receive: Receive, send: Send) -> None:
        while (message := await receive())["more_body"]:
            read.append(message["body"])

    async def client() -> Message:
        return parts.pop(0)

    def never(scope: Scope, problem: Problem) -> None:
        raise AssertionError(f"refused before the body: {problem.detail}")

    guard = RequestGuard(reading_app, max_bytes=10, read_timeout=10.0, allowed_hosts=None, answer=never)  # type: ignore[arg-type]
    with pytest.raises(Problem) as refused:
        asyncio.run(guard({"type": "http", "headers": []}, client, None))  # type: ignore[arg-type]
    assert refused.value.status == 413 and read == [b"x" * 6]


def trickled(connection: socket.socket, data: bytes) -> tuple[bytes, float]:
    """Send ``data`` a byte every 0.2 s (each wait short) until the exporter answers; its answer, and the seconds
    from the first byte to the connection's close."""
    answered = threading.Event()

    def trickle() -> None:
        for byte in data[1:]:
            if answered.wait(0.2):  # the attack's pace, not a synchronisation: stop once answered
                return
            try:
                connection.sendall(bytes([byte]))
            except OSError:
                return

    connection.sendall(data[:1])
    started = time.monotonic()
    sender = threading.Thread(target=trickle)
    sender.start()
    try:
        answer = read_until_closed(connection)
    finally:
        answered.set()
        sender.join(timeout=10)
    return answer, time.monotonic() - started


def test_a_head_trickled_within_each_wait_still_ends_at_the_header_timeout(exporter: ExporterProcess) -> None:
    """The header timer runs from a head's first byte, on a kept-alive connection too: however its bytes come."""
    with raw_socket(exporter.url, timeout=10) as connection:
        first_answered(connection)
        answer, waited = trickled(connection, b"GET /-/healthy HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Trickled: " + b"a" * 64)
    assert problem(answer, 408)["field"] == "headers"
    assert HEADER_TIMEOUT * 0.9 <= waited < HEADER_TIMEOUT + 2.0, waited


def test_a_body_trickled_within_each_wait_still_ends_at_the_read_timeout(exporter: ExporterProcess) -> None:
    """A byte every 0.2 s keeps each wait short, but the whole body must arrive within --web.read-timeout."""
    body = ready_response(0, 1, 1)
    head = (f"POST /api/v1/deployments/trickled/ready HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: {MSGPACK['Content-Type']}\r\nContent-Length: {len(body)}\r\n\r\n").encode()  # fmt: skip
    with raw_socket(exporter.url, timeout=10) as connection:
        connection.sendall(head)
        answer, waited = trickled(connection, body)
    assert problem(answer, 408)["field"] == "body"
    assert waited < READ_TIMEOUT + 2.0, waited
    assert request(exporter.url, "GET", "/api/v1/deployments/trickled").status == 404


@pytest.mark.parametrize(("host", "status"), [("localhost.", 200), ("localhost.:{port}", 200),
                                              ("exporter.internal.", 200), ("attacker.example.", 421)])  # fmt: skip
def test_a_host_name_with_its_trailing_dot_is_the_same_name(exporter: ExporterProcess, host: str, status: int) -> None:
    reply = request(exporter.url, "GET", "/metrics", headers={"Host": host.format(port=exporter.port)})
    assert reply.status == status, reply.body[:200]
