"""Stand-ins for whatever may answer at the plugin's URL: real sockets on 127.0.0.1, each behaving as a hostile or
broken server does (withholding, trickling or never ending its answer, asking to be left alone).

The ``stand_in`` fixture starts them for a test. Each ``StandIn`` serves every connection in a thread of its own
with its ``behaviour`` of the moment (which a test may change), one request after another on a kept connection,
until ``stop``. It counts what it sent and records
each request's arrival, so that the tests see what the plugin read and when it asked.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

import pytest

# The longest request head a stand-in reads; the plugin's are far shorter.
_HEAD_BYTES = 64 * 1024
# The chunk an endless answer is written in.
_CHUNK = b"x" * 65536


class Arrival(NamedTuple):
    """A request as it arrived: its request line and the monotonic time it was read."""

    line: str
    at: float


class StandIn:
    """A server on a free loopback port; ``behaviour(stand_in, connection)`` answers each request (``ok`` by default).
    With ``tls`` (a server context), over TLS: its URL is ``https``.

    ``sent`` counts the bytes of answers written, ``arrivals`` the requests read, ``open_connections`` the
    connections not yet closed by the client. A behaviour that returns False leaves the connection open, answered
    or not, until the client closes it or the stand-in stops.
    """

    def __init__(
        self, behaviour: Callable[[StandIn, socket.socket], bool] | None = None, tls: ssl.SSLContext | None = None
    ) -> None:
        self.behaviour = behaviour or ok
        self._tls = tls
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self._listener.getsockname()[1]}"
        self.stopped = threading.Event()
        self._lock = threading.Lock()
        self.sent = 0
        self.arrivals: list[Arrival] = []
        self.accepted = 0
        self.open_connections = 0
        self._connections: list[socket.socket] = []
        threading.Thread(target=self._accept, name=f"stand-in {self.url}", daemon=True).start()

    def _accept(self) -> None:
        while not self.stopped.is_set():
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return  # the listener closed: stopped
            with self._lock:
                self.accepted += 1
                self.open_connections += 1
                self._connections.append(connection)
            threading.Thread(target=self._serve, args=(connection,), daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        """Answer each request of ``connection`` with the behaviour of the moment, until one ends it."""
        try:
            if self._tls is not None:
                connection = self._tls.wrap_socket(connection, server_side=True)
            while self._read_request(connection) and self.behaviour(self, connection):
                pass
            # Until the client closes its end: what the tests see as "the plugin closed the connection".
            with contextlib.suppress(OSError):
                connection.settimeout(None)
                while not self.stopped.is_set() and connection.recv(65536):
                    pass
        except OSError:
            pass
        finally:
            with self._lock:
                self.open_connections -= 1

    def _read_request(self, connection: socket.socket) -> bool:
        """Read one request (head and ``Content-Length`` body); False when the client closed the connection."""
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = connection.recv(4096)
            if not chunk or len(data) > _HEAD_BYTES:
                return False
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        length = next((int(line.split(":", 1)[1]) for line in lines if line.lower().startswith("content-length:")), 0)
        while len(body) < length:
            chunk = connection.recv(65536)
            if not chunk:
                return False
            body += chunk
        with self._lock:
            self.arrivals.append(Arrival(lines[0], time.monotonic()))
        return True

    def write(self, connection: socket.socket, data: bytes) -> None:
        connection.sendall(data)
        with self._lock:
            self.sent += len(data)

    def requests(self, method: str | None = None) -> list[Arrival]:
        """The requests read so far (only ``method``'s when given)."""
        with self._lock:
            return [arrival for arrival in self.arrivals if method is None or arrival.line.startswith(f"{method} ")]

    def stop(self) -> None:
        self.stopped.set()
        # A thread blocked in accept() is not woken by close(), and would hold the listener for the process's life:
        # shutting the listener down wakes it (Linux answers the accept with an error).
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            for connection in self._connections:
                with contextlib.suppress(OSError):
                    connection.shutdown(socket.SHUT_RDWR)
                connection.close()


@pytest.fixture
def stand_in() -> Iterator[Callable[..., StandIn]]:
    """Start stand-ins (``behaviour`` as in ``StandIn``); all stopped after the test."""
    started: list[StandIn] = []

    def start(
        behaviour: Callable[[StandIn, socket.socket], bool] | None = None, tls: ssl.SSLContext | None = None
    ) -> StandIn:
        server = StandIn(behaviour, tls)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def answer(status: str, body: bytes = b"", headers: dict[str, str] | None = None) -> bytes:
    """A whole HTTP/1.1 answer with its ``Content-Length``."""
    fields = {"Content-Length": str(len(body)), **(headers or {})}
    return (
        f"HTTP/1.1 {status}\r\n".encode()
        + b"".join(f"{k}: {v}\r\n".encode() for k, v in fields.items())
        + (b"\r\n" + body)
    )


# Behaviours: each answers the request just read; True keeps the connection for the next request.


def ok(stand_in: StandIn, connection: socket.socket) -> bool:
    """The exporter's way: an empty JSON object (204 to heartbeats and goodbyes would do as well)."""
    stand_in.write(connection, answer("200 OK", b"{}", {"Content-Type": "application/json"}))
    return True


def blackhole(stand_in: StandIn, connection: socket.socket) -> bool:
    """Takes the request and never answers (the connection stays open until the client closes it)."""
    return False


def endless(stand_in: StandIn, connection: socket.socket) -> bool:
    """A 200 without length whose body never ends, written as fast as the client takes it."""
    stand_in.write(connection, b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n")
    while not stand_in.stopped.is_set():
        stand_in.write(connection, _CHUNK)
    return False


def trickle(stand_in: StandIn, connection: socket.socket) -> bool:
    """A 200 without length whose body comes 64 bytes every 20 ms: each read gets bytes well in time, and 50 MB
    would take three days."""
    stand_in.write(connection, b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n")
    while not stand_in.stopped.wait(0.02):
        stand_in.write(connection, b"x" * 64)
    return False


def slow_error(stand_in: StandIn, connection: socket.socket) -> bool:
    """A 500, after 5 s, unless the client closed the connection before."""
    connection.settimeout(5)
    try:
        connection.recv(1)  # the client's end of the connection (nothing else comes)
    except TimeoutError:
        stand_in.write(connection, answer("500 Internal Server Error", b"overloaded"))
    return False


def retry_after(value: str) -> Callable[[StandIn, socket.socket], bool]:
    """A 429 asking to wait ``value`` (delta-seconds or an HTTP date)."""

    def behaviour(stand_in: StandIn, connection: socket.socket) -> bool:
        stand_in.write(connection, answer("429 Too Many Requests", b"", {"Retry-After": value}))
        return True

    return behaviour


HOSTILE = {"endless": endless, "trickle": trickle, "blackhole": blackhole, "slow-error": slow_error}
