"""Request limits applied before a handler runs.

Two layers: ``GuardedHttpToolsProtocol`` (``exporter/server/uvicorn_adapter.py``: uvicorn's HTTP/1.1 protocol,
plus a cap on header bytes and a header-phase timeout, which uvicorn's httptools parser lacks) refuses a request
before it exists; ``RequestGuard`` (ASGI middleware, here) checks the Host name and the body's size and pace.
Each refusal is an error of ``exporter/errors.py`` whose status, title and headers come from
``exporter/server/problems.py``'s table.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from exporter.errors import (
    BodyTimeout,
    BodyTooLarge,
    ClientDisconnected,
    HostNotServed,
)
from exporter.security.addresses import is_loopback
from exporter.security.options import web_flag
from exporter.server.problems import Problem, problem_for

# Answers a refusal made here (and counts it, as the app counts every refusal).
RefusalAnswer = Callable[[Scope, Problem], Response]
# At the connection cap, one warning per this many seconds at most, with the count refused since the last one.
CAP_LOG_SECONDS = 10.0


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
            detail = f"this exporter does not serve that host name; see {web_flag('allowed_hosts')}"
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
