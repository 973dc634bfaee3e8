"""Heartbeats answered in the HTTP protocol, beneath the ASGI app: a fleet's most frequent request.

10,000 vLLM servers send a heartbeat every 30 s each: 333 a second, each changing only "last seen" in
memory. Through uvicorn's ASGI task, the middleware and the router, each costs more than the change itself.
Here a heartbeat that the app would answer 204 is answered from the protocol callback that completes it:
the router's own match picks the route (kept per path), the route's declared access is granted by the same
check (``admitted_at_once``, ``exporter/server/endpoints.py``), its query parsed by the same Struct, and its
change run as it is (its ``hear``, ``hear_heartbeat`` of ``exporter/server/routes.py``) behind the same Host
check, and the 204 goes out through uvicorn's own ``send`` with the web config's headers, as the app's would:
when its head takes the transport past its high-water mark (a client slower to read than the exporter answers),
its end is sent as the app's would be, once the transport drains. Anything else (a refusal, a body, a paused
transport, several workers sharing a store) is left to the app, which answers it exactly as it answers any
request: the checks change nothing when they refuse, so the app's run of them refuses it again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any, ClassVar

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Scope
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from exporter.security.auth import Credentials
from exporter.server.endpoints import Endpoint, admitted_at_once
from exporter.server.queries import parse_query
from exporter.server.request_guard import ConnectionState, GuardedHttpToolsProtocol, host_allowed

Headers = tuple[tuple[bytes, bytes], ...]
# A heartbeat's change, as its route runs it (the request, the route's parts, its query): ``None`` when heard at once.
Hear = Callable[[Request, Any, Any], "Future[object] | None"]
# The router's match of paths lately heard, each up to a heartbeat path's length with the longest deployment name:
# a fleet's heartbeats go to the paths of its deployments, a few hundred, each matched once rather than each time.
PATHS_KEPT = 4096
LONGEST_PATH = 256


class QuickHeartbeats:
    """The app's side: whether a request is a heartbeat the app would answer 204, heard if so.

    ``endpoint`` is the heartbeat route's ASGI endpoint (what the router matches), ``declared`` its declaration,
    ``parts`` what its handler works with and ``hear`` what that handler runs before answering. Only for a single
    process: with a shared store a heartbeat is a commit, which the app awaits. ``answered`` counts the
    heartbeats answered here.
    """

    def __init__(
        self,
        app: Starlette,
        endpoint: Callable[..., Any],
        declared: Endpoint,
        parts: object,
        credentials: Credentials,
        hear: Hear,
        allowed_hosts: frozenset[str] | None,
        response_headers: Callable[[], Headers],
    ) -> None:
        self.app = app
        self.endpoint = endpoint
        self.declared = declared
        self.parts = parts
        self.credentials = credentials
        self.hear = hear
        self.allowed_hosts = allowed_hosts
        self.response_headers = response_headers
        self.answered = 0
        self._kept_match = functools.lru_cache(maxsize=PATHS_KEPT)(self._heartbeat_path_params)

    @staticmethod
    def may_answer(scope: Scope) -> bool:
        """A cheap first look at a request's head: a POST to a heartbeat path, with no body."""
        if scope["method"] != "POST" or not scope["path"].endswith("/heartbeat"):
            return False
        headers = dict(scope["headers"])
        return headers.get(b"content-length", b"0") == b"0" and b"transfer-encoding" not in headers

    def answer(self, scope: Scope) -> Headers | None:
        """Hear the heartbeat and return the 204's headers, or ``None`` (nothing heard) to leave it to the app."""
        if not host_allowed(self.allowed_hosts, dict(scope["headers"])):
            return None
        path, root_path = scope["path"], scope.get("root_path", "")
        match = self._kept_match if len(path) <= LONGEST_PATH else self._heartbeat_path_params
        path_params = match(scope["method"], root_path, path)
        if path_params is None:
            return None
        try:
            request = Request({**scope, "endpoint": self.endpoint, "path_params": dict(path_params), "app": self.app})
            if not admitted_at_once(self.credentials, self.declared.access, request):
                return None
            query = None if self.declared.query is None else parse_query(request, self.declared.query)
            committed = self.hear(request, self.parts, query)
        except Exception:  # a refusal (or a fault): the app's run of the same checks answers it
            return None
        if committed is not None:  # a shared store: never built so, see the class
            raise RuntimeError("a quick heartbeat was committed to a shared store")
        self.answered += 1
        return self.response_headers()

    def _heartbeat_path_params(self, method: str, root_path: str, path: str) -> dict[str, Any] | None:
        """The path's parameters if the router's first full match (in its order) is the heartbeat route; else
        ``None``. What a route matches is a function of these three alone."""
        scope = {"type": "http", "method": method, "root_path": root_path, "path": path}
        for route in self.app.router.routes:
            match, child_scope = route.matches(scope)
            if match is Match.FULL:
                return child_scope["path_params"] if getattr(route, "endpoint", None) is self.endpoint else None
        return None


class _HeartbeatConnectionState(ConnectionState):
    __slots__ = ("waiting",)

    def __init__(self, header_room: int) -> None:
        super().__init__(header_room)
        # A heartbeat whose head is in, answered when its message completes (at once: it has no body).
        self.waiting: tuple[RequestResponseCycle, ASGIApp] | None = None


class HeartbeatAnsweringProtocol(GuardedHttpToolsProtocol):
    """The guarded protocol, answering the heartbeats that ``heartbeats`` hears without starting the app
    (``None``: none; set by ``configured``)."""

    heartbeats: ClassVar[QuickHeartbeats | None] = None
    connection_state = _HeartbeatConnectionState
    _connection: _HeartbeatConnectionState

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: ASGIApp) -> None:  # type: ignore[override]
        heartbeats = self.heartbeats
        if heartbeats is None or app is not self.app or self.access_log or not heartbeats.may_answer(cycle.scope):
            super()._start_asgi_task(cycle, app)  # type: ignore[arg-type]
        elif cycle.more_body:
            self._connection.waiting = (cycle, app)
        else:  # a pipelined heartbeat, started after the request before it
            self._answer(cycle, app)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        connection = self._connection
        waiting = connection.waiting
        if waiting is not None and waiting[0] is self.cycle:
            connection.waiting = None
            self._answer(*waiting)

    def _answer(self, cycle: RequestResponseCycle, app: ASGIApp) -> None:
        assert self.heartbeats is not None
        headers = None if cycle.disconnected or self.flow.write_paused else self.heartbeats.answer(cycle.scope)
        if headers is None:
            super()._start_asgi_task(cycle, app)  # type: ignore[arg-type]
            return
        # uvicorn's send, which awaits only a paused transport: it completes at once here.
        _complete_at_once(cycle.send({"type": "http.response.start", "status": 204, "headers": headers}))
        if self.flow.write_paused:  # the head took the transport past its mark: the end waits for it to drain
            ending = self.loop.create_task(cycle.send(_END))
            ending.add_done_callback(self.tasks.discard)
            self.tasks.add(ending)
            return
        _complete_at_once(cycle.send(_END))
        # Nothing reads it again (it had no body): an idle connection holds 2 KiB less. Unless the next request's
        # head is begun: its scope and headers are being parsed.
        if cycle is self.cycle and not self._connection.head_begun:
            self.cycle = self.scope = self.headers = None  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._connection.waiting = None  # it refers back to this protocol: a cycle


# The end of a 204: no body.
_END: Message = {"type": "http.response.body", "body": b"", "more_body": False}


def _complete_at_once(coroutine: Coroutine[Any, Any, None]) -> None:
    """Run a coroutine that never suspends to its end."""
    try:
        coroutine.send(None)
    except StopIteration:
        return
    coroutine.close()
    raise RuntimeError("a send that was to complete at once suspended")
