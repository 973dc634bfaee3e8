"""Request limits applied before a handler runs: body size and how long a client may take to send it."""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from exporter.problems import Problem, problem_response


def _closing(problem: Problem) -> Problem:
    """The problem with ``Connection: close``: the rest of that body is never read, so the connection ends."""
    problem.headers["Connection"] = "close"
    return problem


class RequestGuard:
    """ASGI middleware: 413 for bodies over ``max_bytes`` (at once when ``Content-Length`` says so,
    before any body is read), 408 when a body takes longer than ``read_timeout`` seconds to arrive."""

    def __init__(self, app: ASGIApp, max_bytes: int, read_timeout: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout = read_timeout

    def _too_large(self) -> Problem:
        return _closing(
            Problem(
                413,
                "Request body too large",
                f"request bodies are limited to {self.max_bytes} bytes",
                "body",
                "too_large",
            )
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await problem_response(Request(scope), self._too_large())(scope, receive, send)
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
                raise _closing(
                    Problem(
                        408,
                        "Request timeout",
                        f"the body did not arrive within {self.read_timeout} s",
                        "body",
                        "timeout",
                    )
                ) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self._too_large()
                complete = not message.get("more_body", False)
            return message

        await self.app(scope, guarded_receive, send)
