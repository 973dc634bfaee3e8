"""Request limits applied before a handler runs.

Two layers: ``GuardedHttpToolsProtocol`` (uvicorn's HTTP/1.1 protocol, plus a cap on header bytes and a
header-phase timeout, which uvicorn's httptools parser lacks) refuses a request before it exists;
``RequestGuard`` (ASGI middleware) checks the Host name and the body's size and pace.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from exporter.problems import Problem
from exporter.settings import flag_of, is_loopback

# Answers a refusal made here (and counts it, as the app counts every refusal).
RefusalAnswer = Callable[[Scope, Problem], Response]


# The rest of a refused body is never read, so the connection ends.
_CLOSE = {"Connection": "close"}


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with 431 once a request's line and headers pass ``max_header_bytes``,
    and 408 when they take longer than ``header_timeout`` seconds (counted from the connection's start or
    the request's first byte), so neither a huge header nor a slow-header client can hold memory or a slot."""

    def __init__(self, *args: Any, max_header_bytes: int, header_timeout: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_header_bytes = max_header_bytes
        self.header_timeout = header_timeout
        # Bytes the current request's line and headers may still take; None once they are in.
        self._header_room: int | None = max_header_bytes
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        room = self._header_room
        if room is None or len(data) <= room:
            if room is not None:
                self._header_room = room - len(data)
            super().data_received(data)
            return
        self._header_room = 0
        super().data_received(data[:room])
        if self.transport.is_closing():
            return
        if self._header_room == 0:  # the headers are still not complete, and their room is used up
            self._refuse(431, "Request header fields too large",
                         f"the request line and headers are limited to {self.max_header_bytes} bytes")  # fmt: skip
            return
        self.data_received(data[room:])

    # Parser callbacks
    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._header_timer is None:
            self._arm_header_timer()

    def on_headers_complete(self) -> None:
        self._header_room = None
        self._disarm_header_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._header_room = self.max_header_bytes  # what follows is the next request's head

    def _arm_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout, self._header_timed_out)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:  # answer the request before it first
            self._arm_header_timer()
            return
        detail = f"the request line and headers did not arrive within {self.header_timeout} s"
        self._refuse(408, "Request timeout", detail)

    def _refuse(self, status: int, title: str, detail: str) -> None:
        """Answer with a problem and close: no request exists yet, so this is written by hand."""
        reason = "header_too_large" if status == 431 else "header_timeout"
        body = json.dumps({"type": f"urn:cache-config-exporter:problem:{reason}", "title": title, "status": status,
                           "detail": detail, "field": "headers"}).encode()  # fmt: skip
        head = b"content-type: application/problem+json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body)
        self.logger.warning("Refused a request: %s", detail)
        self.transport.write(STATUS_LINE[status] + head + body)
        self.transport.close()


def host_name(host: str) -> str:
    """The name of a ``Host`` header without its port or trailing dot, lower-case (``[::1]:80`` -> ``::1``)."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return (host.rpartition(":")[0] if ":" in host else host).rstrip(".")


@dataclass(frozen=True)
class RequestGuard:
    """ASGI middleware: 421 for a ``Host`` outside ``allowed_hosts`` (None: any host; loopback names always
    pass), 413 for bodies over ``max_bytes`` (at once when ``Content-Length`` says so, before any body is
    read), 408 when a body takes longer than ``read_timeout`` seconds to arrive, and a quiet refusal (no
    traceback) when the client leaves mid-body. ``answer`` answers the refusals made before the app runs."""

    app: ASGIApp
    max_bytes: int
    read_timeout: float
    allowed_hosts: frozenset[str] | None
    answer: RefusalAnswer

    def _too_large(self) -> Problem:
        detail = f"request bodies are limited to {self.max_bytes} bytes"
        return Problem(413, "Request body too large", detail, "body", "too_large", _CLOSE)

    def _host_allowed(self, headers: dict[bytes, bytes]) -> bool:
        host = headers.get(b"host")
        if self.allowed_hosts is None or host is None:  # HTTP/1.0 without Host: no browser sends that
            return True
        name = host_name(host.decode("latin-1"))
        return is_loopback(name) or name in self.allowed_hosts

    async def _refuse(self, problem: Problem, scope: Scope, receive: Receive, send: Send) -> None:
        await self.answer(scope, problem)(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if not self._host_allowed(headers):
            detail = f"this exporter does not serve that host name; see {flag_of('allowed_hosts')}"
            problem = Problem(421, "Misdirected request", detail, "Host", "host")
            await self._refuse(problem, scope, receive, send)
            return
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await self._refuse(self._too_large(), scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.read_timeout
        received = 0
        complete = False

        async def guarded_receive() -> Message:
            nonlocal received, complete
            if complete:  # the body is in; what follows (a disconnect) may take any time
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
            except TimeoutError:
                detail = f"the body did not arrive within {self.read_timeout} s"
                raise Problem(408, "Request timeout", detail, "body", "timeout", _CLOSE) from None
            if message["type"] == "http.disconnect":  # nobody is left to answer; no traceback for it either
                raise Problem(400, "Client disconnected", "the client left before sending the whole body", "body",
                              "client_disconnected")  # fmt: skip
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise self._too_large()
            complete = not message.get("more_body", False)
            return message

        await self.app(scope, guarded_receive, send)
