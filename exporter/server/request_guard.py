"""Request limits applied before a handler runs.

Two layers: ``GuardedHttpToolsProtocol`` (uvicorn's HTTP/1.1 protocol, plus a cap on header bytes and a
header-phase timeout, which uvicorn's httptools parser lacks) refuses a request before it exists;
``RequestGuard`` (ASGI middleware) checks the Host name and the body's size and pace. Each refusal is an
error of ``exporter/errors.py`` whose status, title and headers come from ``exporter/server/problems.py``'s table.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from exporter.config.addresses import is_loopback
from exporter.config.settings import flag_of
from exporter.errors import (
    BodyTimeout,
    BodyTooLarge,
    ClientDisconnected,
    HeadersTooLarge,
    HeaderTimeout,
    HostNotServed,
    Refused,
    TooManyConnections,
)
from exporter.server import gc_freeze
from exporter.server.pipelining import PipelineBoundProtocol, PipelineState
from exporter.server.problems import PROBLEM_JSON, Problem, problem_document, problem_for

# Answers a refusal made here (and counts it, as the app counts every refusal).
RefusalAnswer = Callable[[Scope, Problem], Response]
# At the connection cap, one warning per this many seconds at most, with the count refused since the last one.
CAP_LOG_SECONDS = 10.0


class ConnectionState(PipelineState):
    """What the exporter's protocol keeps per connection beyond uvicorn's, in one attribute with slots.

    uvicorn's protocol has 28 attributes; CPython keeps an instance's ``__dict__`` as a small table of values
    (its keys shared by every instance) only up to 29 keys. Each attribute more would cost every connection a
    dict of its own, 1.2 KiB more for each idle connection a fleet keeps.
    """

    __slots__ = ("head_begun", "header_room", "header_timer")

    def __init__(self, header_room: int) -> None:
        super().__init__()
        # Bytes the current request's line and headers may still take; None once they are in.
        self.header_room: int | None = header_room
        self.header_timer: asyncio.TimerHandle | None = None
        # A request's first bytes are in and its headers are not yet complete.
        self.head_begun = False


class GuardedHttpToolsProtocol(PipelineBoundProtocol):
    """uvicorn's httptools protocol (its pipelining bounded) with 431 once a request's line and headers pass
    ``max_header_bytes``, and 408 when they take longer than ``header_timeout`` seconds (counted from the
    connection's start or the request's first byte), so neither a huge header nor a slow-header client can hold
    memory or a slot.
    A connection past the cap (``limit_concurrency``) closes a kept-alive connection that waits idle for its
    next request (a client reconnects to send it), or, when none is idle, is answered 503 and closed at once,
    before it sends anything: idle connections cannot take every file descriptor, and kept-alive ones
    (the plugin's, between heartbeats) never keep a scrape out."""

    # When the last warning of the cap was logged, and the connections refused since (one event loop per process).
    _cap_logged: ClassVar[float] = float("-inf")
    _cap_refused: ClassVar[int] = 0
    # The server's settings, the same for each connection: class attributes (see ``ConnectionState``).
    max_header_bytes: ClassVar[int]
    header_timeout: ClassVar[float]
    connection_state: ClassVar[type[ConnectionState]] = ConnectionState

    @classmethod
    def configured(cls, **settings: object) -> Callable[..., Self]:
        """This protocol with a server's settings (``max_header_bytes``, ``header_timeout``, a subclass's), for
        uvicorn's ``http``, which makes one per connection. A partial of a module-level function: it pickles, as
        uvicorn's worker processes (``--web.workers``) need."""
        return functools.partial(_configured_protocol, cls, tuple(sorted(settings.items())))

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._connection = self.connection_state(self.max_header_bytes)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        gc_freeze.connection_opened()
        limit = self.limit_concurrency
        if limit is not None and len(self.connections) >= limit and not self._close_an_idle_connection():
            self._at_cap(limit)
            return
        self._arm_header_timer()

    def _close_an_idle_connection(self) -> bool:
        """Close one connection that waits for its next request (its keep-alive timer runs); False if none does.
        It leaves the count at once, so that this connection's request is not refused by uvicorn's own cap."""
        for connection in self.connections:
            if getattr(connection, "timeout_keep_alive_task", None) is not None:
                connection.timeout_keep_alive_handler()
                self.connections.discard(connection)
                return True
        return False

    def _at_cap(self, limit: int) -> None:
        cls = GuardedHttpToolsProtocol
        cls._cap_refused += 1
        now = time.monotonic()
        if now - cls._cap_logged >= CAP_LOG_SECONDS:
            self.logger.warning("At the connection cap of %d (--web.max-connections): refused %d connection(s) with "
                                "503 since the last such warning", limit, cls._cap_refused)  # fmt: skip
            cls._cap_logged, cls._cap_refused = now, 0
        detail = f"the exporter serves at most {limit} connections at once; retry later"
        self._refuse(TooManyConnections(None, detail), log=False)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)
        gc_freeze.connection_closed()

    def _fed(self) -> None:
        """A head still incomplete after a read is timed from now on.

        Timed here rather than as the head begins: a request whose head comes in one read (a heartbeat, most
        requests) then arms and cancels no timer."""
        connection = self._connection
        if connection.head_begun and connection.header_timer is None and not self.transport.is_closing():
            self._arm_header_timer()

    def _parse(self, data: bytes) -> None:
        """Parse ``data`` within the header room."""
        connection = self._connection
        room = connection.header_room
        if room is None or len(data) <= room:
            if room is not None:
                connection.header_room = room - len(data)
            super()._parse(data)
            return
        connection.header_room = 0
        super()._parse(data[:room])
        if self.transport.is_closing():
            return
        if connection.header_room == 0:  # the headers are still not complete, and their room is used up
            detail = f"the request line and headers are limited to {self.max_header_bytes} bytes"
            self._refuse(HeadersTooLarge("headers", detail))
            return
        self._parse(data[room:])

    # Parser callbacks
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._connection.head_begun = True

    def on_headers_complete(self) -> None:
        connection = self._connection
        connection.header_room = None
        connection.head_begun = False
        self._disarm_header_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._connection.header_room = self.max_header_bytes  # what follows is the next request's head

    def _arm_header_timer(self) -> None:
        self._connection.header_timer = self.loop.call_later(self.header_timeout, self._header_timed_out)

    def _disarm_header_timer(self) -> None:
        connection = self._connection
        if connection.header_timer is not None:
            connection.header_timer.cancel()
            connection.header_timer = None

    def _header_timed_out(self) -> None:
        self._connection.header_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:  # answer the request before it first
            self._arm_header_timer()
            return
        self._refuse(
            HeaderTimeout("headers", f"the request line and headers did not arrive within {self.header_timeout} s")
        )

    def _refuse(self, error: Refused, log: bool = True) -> None:
        """Answer with the error's problem and close: no request exists yet, so the answer is written here."""
        problem = problem_for(error)
        body = problem_document(problem)
        headers = {"content-type": PROBLEM_JSON, "content-length": str(len(body)), **problem.headers}
        head = "".join(f"{name.lower()}: {value}\r\n" for name, value in headers.items()).encode("latin-1")
        if log:
            self.logger.warning("Refused a request: %s", problem.detail)
        self.transport.write(STATUS_LINE[problem.status] + head + b"\r\n" + body)
        self.transport.close()


def _configured_protocol(
    protocol: type[GuardedHttpToolsProtocol], settings: tuple[tuple[str, object], ...], *args: Any, **kwargs: Any
) -> GuardedHttpToolsProtocol:
    return _configured_class(protocol, settings)(*args, **kwargs)


@functools.cache
def _configured_class(
    protocol: type[GuardedHttpToolsProtocol], settings: tuple[tuple[str, object], ...]
) -> type[GuardedHttpToolsProtocol]:
    """The protocol with the settings as class attributes: one class per server."""
    return type(protocol.__name__, (protocol,), dict(settings))


def host_name(host: str) -> str:
    """The name of a ``Host`` header without its port or trailing dot, lower-case (``[::1]:80`` -> ``::1``)."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return (host.rpartition(":")[0] if ":" in host else host).rstrip(".")


def host_allowed(allowed_hosts: frozenset[str] | None, headers: dict[bytes, bytes]) -> bool:
    """Whether a request's ``Host`` is served: any with ``allowed_hosts`` None, else loopback names and those."""
    host = headers.get(b"host")
    if allowed_hosts is None or host is None:  # HTTP/1.0 without Host: no browser sends that
        return True
    name = host_name(host.decode("latin-1"))
    return is_loopback(name) or name in allowed_hosts


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
        return problem_for(BodyTooLarge("body", f"request bodies are limited to {self.max_bytes} bytes"))

    async def _refuse(self, problem: Problem, scope: Scope, receive: Receive, send: Send) -> None:
        await self.answer(scope, problem)(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if not host_allowed(self.allowed_hosts, headers):
            detail = f"this exporter does not serve that host name; see {flag_of('allowed_hosts')}"
            await self._refuse(problem_for(HostNotServed("Host", detail)), scope, receive, send)
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
                raise problem_for(
                    BodyTimeout("body", f"the body did not arrive within {self.read_timeout} s")
                ) from None
            if message["type"] == "http.disconnect":  # nobody is left to answer; no traceback for it either
                raise problem_for(ClientDisconnected("body", "the client left before sending the whole body"))
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise self._too_large()
            complete = not message.get("more_body", False)
            return message

        await self.app(scope, guarded_receive, send)
