"""Heartbeats answered beneath the app: a real uvicorn server in this process, driven over raw loopback sockets.

The server runs the exporter's protocol with the app of ``create_app``, so a test can count what the protocol
answered itself (``QuickHeartbeats.answered``) and compare its bytes with the app's own answer.
"""

from __future__ import annotations

import gc
import logging
import pickle
import re
import socket
import subprocess
import sys
import threading
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import uvicorn
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette

from exporter.config.settings import Settings
from exporter.server.app import create_app
from exporter.server.quick_heartbeats import QuickHeartbeats
from exporter.server.uvicorn_adapter import HeartbeatAnsweringProtocol
from tests.helpers.http import MSGPACK, request
from tests.helpers.ready_responses import BULKY_STATIC_CONFIG
from tests.support import fixture_bytes, free_port, wait_until

HEARTBEAT = "POST /api/v1/deployments/qwen/heartbeat?interval=30{query} HTTP/1.1\r\nHost: 127.0.0.1\r\n{headers}\r\n"


class Server:
    """``create_app(settings)`` served by uvicorn with the exporter's protocol on a free loopback port."""

    def __init__(self, settings: Settings, quick: bool = True, access_log: bool = False) -> None:
        self.app: Starlette = create_app(settings, registry=CollectorRegistry())
        self.heartbeats: QuickHeartbeats = self.app.state.quick_heartbeats
        self.port = free_port()
        protocol = HeartbeatAnsweringProtocol.configured(
            max_header_bytes=8192,
            header_timeout=5.0,
            write_timeout=10.0,
            heartbeats=self.heartbeats if quick else None,
        )
        config = uvicorn.Config(
            self.app, host="127.0.0.1", port=self.port, http=protocol,  # type: ignore[arg-type]
            log_level="warning", access_log=access_log, server_header=False,
        )  # fmt: skip
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Server:
        self.thread.start()
        wait_until(lambda: self.server.started)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)

    def exchange(self, requests: bytes, answers: int) -> list[bytes]:
        """Send ``requests`` at once on one connection; the ``answers`` responses, each whole."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=10) as connection:
            connection.sendall(requests)
            received = b""
            while len(_responses(received)) < answers:
                chunk = connection.recv(65536)
                assert chunk, f"closed after {received!r}"
                received += chunk
        return _responses(received)


def _responses(received: bytes) -> list[bytes]:
    """Whole HTTP responses in ``received`` (each with a Content-Length, or none and no body)."""
    responses = []
    while b"\r\n\r\n" in received:
        head, _, rest = received.partition(b"\r\n\r\n")
        length = re.search(rb"content-length: (\d+)", head, re.IGNORECASE)
        size = int(length.group(1)) if length else 0
        if len(rest) < size:
            break
        responses.append(head + b"\r\n\r\n" + rest[:size])
        received = rest[size:]
    return responses


def heartbeat(query: str = "", headers: str = "") -> bytes:
    return HEARTBEAT.format(query=query, headers=headers).encode()


def ready(deployment: str = "qwen") -> bytes:
    body = fixture_bytes("hybrid-tp1-post50809")
    head = (
        f"POST /api/v1/deployments/{deployment}/ready HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/vnd.msgpack\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def status(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., Server]]:
    servers: list[Server] = []

    def start(quick: bool = True, access_log: bool = False, **options: object) -> Server:
        settings = Settings(storage_path=tmp_path / f"exporter-{len(servers)}.db", **options)  # type: ignore[arg-type]
        server = Server(settings, quick, access_log).__enter__()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.__exit__()


def test_heartbeats_on_a_kept_connection_are_answered_by_the_protocol(serve: Callable[..., Server]) -> None:
    server = serve()
    server.exchange(ready(), 1)
    answers = server.exchange(heartbeat() * 3, 3)
    assert [status(answer) for answer in answers] == [204, 204, 204]
    assert server.heartbeats.answered == 3
    state = server.app.state.exporter.state
    settled = state.settled()  # heartbeats heard are folded into the state by the writer
    if settled is not None:
        settled.result(timeout=10)
    assert state.snapshot()[("qwen", "default")].heartbeat_seconds == 30


def test_the_quick_answer_is_the_apps_answer(serve: Callable[..., Server], tmp_path: Path) -> None:
    """Byte for byte, the date aside: with the web config's headers, and with Connection: close."""
    web_config = tmp_path / "web.yml"
    web_config.write_text("http_server_config:\n  headers:\n    X-Frame-Options: deny\n")
    quick, plain = serve(web_config_file=web_config), serve(quick=False, web_config_file=web_config)
    for server in (quick, plain):
        server.exchange(ready(), 1)
    requests = heartbeat() + heartbeat(headers="Connection: close\r\n")
    answers = {server.port: server.exchange(requests, 2) for server in (quick, plain)}
    assert (quick.heartbeats.answered, plain.heartbeats.answered) == (2, 0)

    def undated(response: bytes) -> bytes:
        return re.sub(rb"date: [^\r]+", b"date: -", response)

    assert [undated(answer) for answer in answers[quick.port]] == [undated(answer) for answer in answers[plain.port]]
    assert b"x-frame-options: deny" in answers[quick.port][0]
    assert b"connection: close" in answers[quick.port][1]


@pytest.mark.parametrize(
    ("request_bytes", "expected"),
    [
        pytest.param(heartbeat("&replica=other"), 404, id="unknown replica"),
        pytest.param(heartbeat("&interval=0.5"), 422, id="interval out of range"),
        pytest.param(heartbeat(headers="Host: exporter.example\r\n").replace(b"Host: 127.0.0.1\r\n", b""), 421,
                     id="host not served"),
        pytest.param(b"GET /api/v1/deployments/qwen/heartbeat?interval=30 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", 404,
                     id="GET: the deployment named qwen/heartbeat"),
        pytest.param(heartbeat(headers="Content-Length: 2\r\n") + b"{}", 204, id="a body"),
        pytest.param(heartbeat().replace(b"/qwen/", b"/" + b"q" * 240 + b"/"), 422,
                     id="a deployment name too long: a path past those whose match is kept"),
    ],
)  # fmt: skip
def test_what_the_protocol_does_not_answer_the_app_answers(
    serve: Callable[..., Server], request_bytes: bytes, expected: int
) -> None:
    server = serve(allowed_hosts=("exporter.internal",))
    server.exchange(ready(), 1)
    answers = server.exchange(request_bytes + heartbeat(), 2)
    assert [status(answer) for answer in answers] == [expected, 204]
    assert server.heartbeats.answered == 1  # only the well-formed heartbeat after it
    if expected != 204:
        assert b"application/problem+json" in answers[0]


def test_a_heartbeat_without_the_ingest_token_is_refused_by_the_app(
    serve: Callable[..., Server], tmp_path: Path
) -> None:
    tokens = tmp_path / "ingest-tokens"
    tokens.write_text("s3cret\n")
    tokens.chmod(0o600)
    server = serve(ingest_token_file=tokens)
    authorized = "Authorization: Bearer s3cret\r\n"
    server.exchange(ready().replace(b"\r\n\r\n", f"\r\n{authorized}\r\n".encode(), 1), 1)
    answers = server.exchange(heartbeat() + heartbeat(headers="Authorization: Bearer wrong\r\n")
                              + heartbeat(headers=authorized), 3)  # fmt: skip
    assert [status(answer) for answer in answers] == [401, 401, 204]
    assert server.heartbeats.answered == 1


def test_pipelined_behind_a_ready_response_answers_stay_in_order(serve: Callable[..., Server]) -> None:
    server = serve()
    answers = server.exchange(ready() + heartbeat() + ready("other") + heartbeat(), 4)
    assert [status(answer) for answer in answers] == [200, 204, 200, 204]
    assert server.heartbeats.answered == 2


def test_a_heartbeat_with_a_large_chunked_body_is_answered_at_once(serve: Callable[..., Server]) -> None:
    """A heartbeat needs no body: one sent chunked (no Content-Length says how long) is answered by the app as soon
    as its head is in, and the connection serves the next request once the body has passed."""
    server = serve()
    server.exchange(ready(), 1)
    body = b"x" * (256 << 10)
    chunked = heartbeat(headers="Transfer-Encoding: chunked\r\n") + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    answers = server.exchange(chunked + heartbeat(), 2)
    assert [status(answer) for answer in answers] == [204, 204]


def test_a_heartbeat_behind_an_answer_the_client_has_not_read_yet_is_answered_in_its_turn(
    serve: Callable[..., Server],
) -> None:
    """A client that has not read a large answer yet fills the server's buffers: a heartbeat pipelined behind it is
    heard, and its answer waits its turn (the app answers it) rather than being written over a full buffer."""
    server = serve()
    url = f"http://127.0.0.1:{server.port}"
    for replica in (f"r{number}" for number in range(32)):  # a state of 4 MB: each engine has 60 KB of labels
        labels = request(url, "PUT", f"/api/v1/deployments/qwen/cache-config?replica={replica}",
                         BULKY_STATIC_CONFIG.encode(), {"Content-Type": "application/json"})  # fmt: skip
        pushed = request(url, "POST", f"/api/v1/deployments/qwen/ready?replica={replica}",
                         fixture_bytes("hybrid-tp1-post50809"), MSGPACK)  # fmt: skip
        assert (labels.status, pushed.status) == (200, 200)
    state = server.app.state.exporter.state

    def heard() -> bool:
        settled = state.settled()
        if settled is not None:
            settled.result(timeout=10)
        return state.snapshot()[("qwen", "r0")].heartbeat_seconds == 30

    scrape = b"GET /api/v1/deployments HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept-Encoding: identity\r\n\r\n"
    with socket.socket() as connection:
        # A small receive window: the answer cannot all leave the server's buffers, whatever the kernel's tuning.
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        connection.settimeout(10)
        connection.connect(("127.0.0.1", server.port))
        connection.sendall(scrape + heartbeat("&replica=r0"))
        wait_until(heard)  # the scrape's answer is written (most of it waits in the server), the heartbeat heard
        received = b""
        while len(_responses(received)) < 2:
            chunk = connection.recv(65536)
            assert chunk, f"closed after {len(_responses(received))} answers"
            received += chunk
    answers = _responses(received)
    assert [status(answer) for answer in answers] == [200, 204] and len(answers[0]) > 4_000_000
    assert server.heartbeats.answered == 0, "the protocol did not answer it over a full buffer"


def test_with_the_access_log_on_heartbeats_are_logged_like_every_request(serve: Callable[..., Server]) -> None:
    """``--log.level debug`` turns on uvicorn's access log: the app then answers heartbeats, so they are in it."""
    server = serve(access_log=True)
    access = logging.getLogger("uvicorn.access")
    logged: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    level = access.level
    access.addHandler(handler)
    access.setLevel(logging.INFO)
    try:
        server.exchange(ready(), 1)
        assert [status(answer) for answer in server.exchange(heartbeat(), 1)] == [204]
    finally:
        access.removeHandler(handler)
        access.setLevel(level)
    assert any('"POST /api/v1/deployments/qwen/heartbeat?interval=30 HTTP/1.1" 204' in line for line in logged), logged
    assert server.heartbeats.answered == 0


def test_the_configured_protocol_pickles_for_worker_processes() -> None:
    """uvicorn sends its config, the protocol included, to each worker process of ``--web.workers``."""
    protocol = HeartbeatAnsweringProtocol.configured(
        max_header_bytes=4096, header_timeout=2.0, write_timeout=10.0, heartbeats=None
    )
    again = pickle.loads(pickle.dumps(protocol))
    assert (again.args, again.keywords) == (protocol.args, protocol.keywords)


def test_several_workers_leave_heartbeats_to_the_app(tmp_path: Path) -> None:
    """With a shared store a heartbeat is a commit the app awaits: no quick path is built."""
    app = create_app(Settings(storage_path=tmp_path / "exporter.db", workers=2), registry=CollectorRegistry())
    assert app.state.quick_heartbeats is None


# Holds CONNECTIONS kept connections, each after one heartbeat of its own replica (registered first, on one
# connection); says "registered" and "kept" on stdout and waits for a line on stdin after each.
HOLDER = r"""
import socket, sys
port, count, ready = int(sys.argv[1]), int(sys.argv[2]), open(sys.argv[3], "rb").read()

def ask(connection, data):
    connection.sendall(data)
    received = b""
    while b"\r\n\r\n" not in received:
        received += connection.recv(65536)
    head, _, body = received.partition(b"\r\n\r\n")
    size = int(head.lower().split(b"content-length: ")[1].split(b"\r")[0]) if b"content-length" in head.lower() else 0
    while len(body) < size:
        body += connection.recv(65536)
    assert head.split(b" ")[1] in (b"200", b"204"), received

first = socket.create_connection(("127.0.0.1", port))
for replica in range(count):
    head = b"POST /api/v1/deployments/qwen/ready?replica=r%d HTTP/1.1\r\nHost: 127.0.0.1\r\n" % replica
    ask(first, head + b"Content-Type: application/vnd.msgpack\r\nContent-Length: %d\r\n\r\n" % len(ready) + ready)
print("registered", flush=True)
sys.stdin.readline()
kept = [socket.create_connection(("127.0.0.1", port)) for _ in range(count)]
for replica, connection in enumerate(kept):
    ask(connection, b"POST /api/v1/deployments/qwen/heartbeat?replica=r%d&interval=30 HTTP/1.1\r\n"
                    b"Host: 127.0.0.1\r\n\r\n" % replica)
print("kept", flush=True)
sys.stdin.readline()
"""
CONNECTIONS = 300


def memory_per_kept_connection(server: Server, tmp_path: Path) -> float:
    """Bytes of Python memory the server holds for each idle connection kept after a heartbeat."""
    ready_file = tmp_path / "ready.msgpack"
    ready_file.write_bytes(fixture_bytes("dense-post50809"))
    command = [sys.executable, "-c", HOLDER, str(server.port), str(CONNECTIONS), str(ready_file)]
    with subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as holder:
        assert holder.stdin is not None and holder.stdout is not None
        assert holder.stdout.readline().strip() == "registered"
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.take_snapshot()
            holder.stdin.write("\n")
            holder.stdin.flush()
            assert holder.stdout.readline().strip() == "kept"
            gc.collect()
            grown = tracemalloc.take_snapshot().compare_to(before, "filename")
        finally:
            tracemalloc.stop()
            holder.stdin.write("\n")
            holder.stdin.flush()
    return sum(stat.size_diff for stat in grown) / CONNECTIONS


# What a fleet's idle connections may cost: 10,000 vLLM servers kept connected hold at most 64 MiB of Python memory.
KEPT_CONNECTION_BUDGET = 6.5 * 1024


def test_an_idle_kept_connection_costs_little_and_holds_no_request_after_a_quick_heartbeat(
    serve: Callable[..., Server], tmp_path: Path
) -> None:
    """What a fleet's idle connections cost: the heartbeat's request is not kept until the next one arrives."""
    quick = memory_per_kept_connection(serve(max_connections=1000), tmp_path)
    plain = memory_per_kept_connection(serve(quick=False, max_connections=1000), tmp_path)
    print(f"Python memory an idle kept connection holds: {quick / 1024:.2f} KiB (app-answered: {plain / 1024:.2f})")
    assert quick < KEPT_CONNECTION_BUDGET
    assert quick < 0.8 * plain
