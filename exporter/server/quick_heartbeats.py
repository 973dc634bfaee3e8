"""Heartbeats answered in the HTTP protocol, beneath the ASGI app: a fleet's most frequent request; which, and
with what, is decided here; the protocol that answers them is ``HeartbeatAnsweringProtocol``
(``exporter/server/uvicorn_adapter.py``).

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
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import Match
from starlette.types import Scope

from exporter.security.auth import Credentials
from exporter.server.endpoints import Endpoint, admitted_at_once
from exporter.server.queries import parse_query
from exporter.server.request_guard import host_allowed

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
