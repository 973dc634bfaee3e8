"""The one HTTP client of the tests, and raw sockets for requests no HTTP client would send."""

from __future__ import annotations

import http.client
import json
import socket
import ssl
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

MSGPACK = {"Content-Type": "application/vnd.msgpack"}


@dataclass
class Reply:
    """One HTTP response: status, headers (lower-case names), the whole body, and what ``request``'s ``peer`` said."""

    status: int
    headers: dict[str, str]
    body: bytes
    peer: object = None

    @classmethod
    def of(cls, response: Any) -> Reply:
        """A test client's (httpx) response as a ``Reply``."""
        return cls(
            response.status_code, {name.lower(): value for name, value in response.headers.items()}, response.content
        )

    @classmethod
    def parse(cls, answer: bytes) -> Reply:
        """A raw HTTP/1.1 response as read off a socket (``Content-Length`` framed) as a ``Reply``."""
        header, _, body = answer.partition(b"\r\n\r\n")
        status_line, *fields = header.decode("latin-1").split("\r\n")
        headers = {name.lower(): value.strip() for name, _, value in (field.partition(":") for field in fields)}
        return cls(int(status_line.split()[1]), headers, body)

    @property
    def text(self) -> str:
        return self.body.decode()

    def json(self) -> Any:
        return json.loads(self.body)

    def problem(self, status: int) -> dict[str, Any]:
        """Assert this is an ``application/problem+json`` body of ``status``; the problem as a dict."""
        assert self.status == status, (self.status, self.body[:500])
        assert self.headers["content-type"] == "application/problem+json", self.headers
        problem = self.json()
        assert problem["status"] == status and problem["title"] and problem["detail"]
        return problem


def request(
    url: str,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    tls: ssl.SSLContext | None = None,
    timeout: float = 10.0,
    peer: Callable[[int], object] | None = None,
) -> Reply:
    """One request to ``url`` + ``path`` on a new connection (so that with several workers any of them may answer),
    never through a proxy; ``peer`` is asked about the client's port while the connection is still open."""
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    connection = (
        http.client.HTTPSConnection(parts.hostname, parts.port, timeout=timeout, context=tls)
        if parts.scheme == "https"
        else http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    )
    with closing(connection):
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        reply = Reply(response.status, {name.lower(): value for name, value in response.getheaders()}, response.read())
        if peer and connection.sock:
            reply.peer = peer(connection.sock.getsockname()[1])
    return reply


def raw_socket(url: str, timeout: float = 5.0) -> socket.socket:
    """A plain TCP connection to the exporter, for requests that no HTTP client would send."""
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    return socket.create_connection((parts.hostname, parts.port), timeout=timeout)


def read_until_closed(connection: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (or the socket's timeout passes).

    A server that closes while the client's last bytes are still unread closes with a reset: that ends the
    stream too (what arrived before it was already received).
    """
    received = b""
    try:
        while chunk := connection.recv(65536):
            received += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return received
