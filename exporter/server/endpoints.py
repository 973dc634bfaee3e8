"""An endpoint's declaration (its path, methods, access, handler, query and answers) and the one place that
enforces the declared access and parses the declared query before any handler runs.

A handler never checks credentials itself: ``bound`` makes the route's ASGI endpoint from its declaration, and
``admitted_at_once`` is the same check for the heartbeats answered beneath the app
(``exporter/server/quick_heartbeats.py``). So a route without an access declared cannot be written, and a
handler cannot forget one. ``security/`` decides whether a credential is good; this module serves the decision.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from enum import StrEnum
from typing import Any, NamedTuple

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from exporter.security.auth import Credentials
from exporter.server.queries import parse_query

# A handler: the request, the typed parts it works with (built once by the app factory), its parsed query.
Handler = Callable[[Request, Any, Any], Awaitable[Response]]


class Access(StrEnum):
    """Who may call an endpoint."""

    OPEN = "open"  # anyone: health, readiness, the API reference
    READ = "read"  # a metrics token or a metrics user, when configured
    INGEST = "ingest"  # an ingest token, when configured: ingest and every change


class Endpoint(NamedTuple):
    """A route: where it is, who may call it, what handles it, what it takes and answers (also what the OpenAPI
    document says of it)."""

    path: str
    methods: tuple[str, ...]
    access: Access
    handler: Handler
    query: type[msgspec.Struct] | None = None
    body: tuple[str, ...] = ()
    status: int = 200
    documented: bool = True
    # The media types of its successful answers (none for a 204).
    answers: tuple[str, ...] = ("application/json",)


def _authorization(request: Request) -> str:
    """The first ``Authorization`` header (ASGI's names are lower-case), read off the scope: a heartbeat answered
    beneath the app then builds no Starlette ``Headers``, whether or not a token is configured."""
    headers: list[tuple[bytes, bytes]] = request.scope["headers"]
    return next((value.decode("latin-1") for name, value in headers if name == b"authorization"), "")


def admitted_at_once(credentials: Credentials, access: Access, request: Request) -> bool:
    """Whether ``access`` is granted without waiting (open, or a good ingest token); raises ``Unauthorized`` when
    refused. ``False`` for a read: its check may wait for a password's hash."""
    if access is Access.INGEST:
        credentials.require_ingest(_authorization(request))
    return access is not Access.READ


async def admit(credentials: Credentials, access: Access, request: Request) -> None:
    """Grant ``access`` or raise ``Unauthorized``."""
    if not admitted_at_once(credentials, access, request):
        await credentials.require_reader(_authorization(request), lambda: _hung_up(request))


@contextmanager
def departure(request: Request) -> Iterator[asyncio.Future[Any]]:
    """A future done once the client has hung up: its request's next ASGI messages, awaited aside, so that work
    done for a client (a password check, a probe) ends with it.

    Only for requests whose body nobody reads (the reads): the watch takes the request's body message.
    """

    async def hung_up() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(hung_up())
    try:
        yield watch
    finally:
        watch.cancel()
        if watch.done() and not watch.cancelled():
            watch.exception()  # a hang-up the request guard refuses: retrieved, nobody is left to answer


@contextmanager
def _hung_up(request: Request) -> Iterator[Callable[[], bool]]:
    """Whether the client has hung up, as the password check asks it (``Credentials.require_reader``)."""
    with departure(request) as watch:
        yield watch.done


def bound(endpoint: Endpoint, parts: object, credentials: Credentials) -> Callable[[Request], Awaitable[Response]]:
    """The route's ASGI endpoint: access granted, then the query parsed, then the handler given its parts."""
    access, handler, query = endpoint.access, endpoint.handler, endpoint.query

    async def serve(request: Request) -> Response:
        await admit(credentials, access, request)
        return await handler(request, parts, None if query is None else parse_query(request, query))

    serve.__name__ = serve.__qualname__ = handler.__name__
    serve.__doc__ = handler.__doc__
    serve.declared = endpoint  # type: ignore[attr-defined]  # what the table test reads off every route
    return serve
