"""The app factory: one request flows HTTP -> protocol decode -> sync -> store -> exposition -> /metrics.

``create_app`` wires one exporter's parts (store, state, credentials, telemetry,
exposition) and its routes (``exporter/server/routes.py``); with ``--probe.only``, only what
``/probe`` needs (``exporter/server/routes_probe_only.py``), and no store. Refusals from any layer are
answered here, through ``exporter/server/problems.py``'s table, and counted when they
refuse a ready response.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import msgspec
from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.convertors import PathConvertor, register_url_convertor
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Scope

from exporter import __version__
from exporter.config.settings import Settings
from exporter.errors import Refused, StorageUnavailable
from exporter.exposition.lines import ReplicaLines
from exporter.exposition.listing import DeploymentListing
from exporter.exposition.rendering import Exposition
from exporter.exposition.telemetry import Telemetry, register_own_metrics
from exporter.exposition.views import encode_view
from exporter.probe.prober import Prober
from exporter.security.auth import Credentials
from exporter.security.web_config import response_headers
from exporter.server.endpoints import Access, Endpoint, Handler, bound
from exporter.server.gc_freeze import freeze_survivors
from exporter.server.openapi import openapi_document
from exporter.server.pages import StatusPage
from exporter.server.problems import Problem, problem_for, problem_response
from exporter.server.queries import MetricsQuery
from exporter.server.quick_heartbeats import QuickHeartbeats
from exporter.server.request_guard import RequestGuard
from exporter.server.response_headers import ResponseHeaders
from exporter.server.routes import (
    ENDPOINTS,
    EXPOSITION_MEDIA_TYPES,
    HEARTBEAT,
    Exporter,
    get_metrics,
    hear_heartbeat,
    is_ingest,
)
from exporter.server.routes_probe_only import PROBE_ONLY_ENDPOINTS, ProbeOnly, get_own_metrics
from exporter.state.exporter_state import ExporterState
from exporter.state.replicas import Replica
from exporter.state.storage import SqliteStore
from protocol import InvalidPayload


class _AnyTextConvertor(PathConvertor):
    """Starlette's ``path`` convertor, but matching newlines too, so that such a name gets a 422, not a 404."""

    regex = "(?s:.+)"


register_url_convertor("name", _AnyTextConvertor())


TITLE = "cache-config-exporter"


# FastAPI from 0.165 asks OpenTelemetry on every request whether to trace it, at a cost docs/architecture.md
# ("The HTTP edge") measures; the exporter has its own metrics and no tracing. Older releases (vLLM's venv pins
# one) have no such parameter and do not trace.
_WITHOUT_TELEMETRY: dict[str, Any] = (
    {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters
    else {}
)


def _guarded(
    app: Starlette, settings: Settings, credentials: Credentials, reject: Callable[[str], None] | None
) -> frozenset[str] | None:
    """Every refusal answered through the one table (and counted by ``reject``, for ingest, where there is
    ingest), the request guard at the door and the web config's headers on every answer; returns the Host names
    served besides loopback ones."""

    def answer(scope: Scope, request: Request, problem: Problem) -> Response:
        if reject is not None and is_ingest(scope) and problem.reason != "http":
            reject(problem.reason)
        return problem_response(request, problem)

    async def refuse(request: Request, error: Exception) -> Response:
        return answer(request.scope, request, error if isinstance(error, Problem) else problem_for(error))

    for kind in (Problem, Refused, InvalidPayload, StorageUnavailable, HTTPException):
        app.add_exception_handler(kind, refuse)
    allowed_hosts = None if settings.allowed_hosts is None else frozenset(settings.allowed_hosts)
    app.add_middleware(
        RequestGuard,
        max_bytes=settings.max_request_bytes,
        read_timeout=settings.read_timeout_seconds,
        allowed_hosts=allowed_hosts,
        answer=lambda scope, problem: answer(scope, Request(scope), problem),
    )
    app.add_middleware(ResponseHeaders, web_config=credentials.web_config)
    return allowed_hosts


def _served(
    settings: Settings, endpoints: Sequence[Endpoint], metrics: Handler, query: type[msgspec.Struct] | None = None
) -> tuple[Endpoint, ...]:
    """``endpoints``, then ``metrics`` at ``--web.telemetry-path``, taking ``query``."""
    telemetry = Endpoint(
        settings.telemetry_path, ("GET",), Access.READ, metrics, query=query, answers=EXPOSITION_MEDIA_TYPES
    )
    return (*endpoints, telemetry)


def _serving(
    settings: Settings,
    credentials: Credentials,
    served: Sequence[Endpoint],
    parts: object,
    lifespan: Callable[[Starlette], AbstractAsyncContextManager[None]] | None = None,
    reject: Callable[[str], None] | None = None,
) -> tuple[Starlette, dict[Endpoint, Callable[[Request], Awaitable[Response]]], frozenset[str] | None]:
    """An app serving ``served``, each handler given ``parts`` behind its declared access (``bound``), and
    guarded (``_guarded``); each declaration's ASGI endpoint, and the Host names it serves besides loopback ones.

    A FastAPI app whose routes are the endpoint table's, not FastAPI's: its generated OpenAPI document and docs
    pages are off, since the table writes both from the msgspec Structs (docs/architecture.md, The HTTP edge)."""
    app = FastAPI(lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None, **_WITHOUT_TELEMETRY)
    routes = {endpoint: bound(endpoint, parts, credentials) for endpoint in served}
    for endpoint, route in routes.items():
        app.add_route(endpoint.path, route, list(endpoint.methods), include_in_schema=False)
    return app, routes, _guarded(app, settings, credentials, reject)


def _probe_only_app(settings: Settings, registry: CollectorRegistry, credentials: Credentials) -> Starlette:
    """``serve --probe.only``: /probe, the exporter's own metrics and health; no ingest routes and no store, so
    it needs neither an ingest token nor a writable file system."""
    register_own_metrics(registry)
    registry.register(credentials)  # the reload state of the access files
    served = _served(settings, PROBE_ONLY_ENDPOINTS, get_own_metrics)
    document = openapi_document(TITLE, __version__, served)
    parts = ProbeOnly(Prober(settings, settings.base_labels(), registry), document, registry)
    app, _, _ = _serving(settings, credentials, served, parts)
    app.state.exporter = parts
    app.state.quick_heartbeats = None  # no heartbeats to hear
    return app


def create_app(
    settings: Settings,
    registry: CollectorRegistry | None = None,
    clock: Callable[[], float] = time.time,
) -> Starlette:
    """Build the exporter app with its own store, state, credentials and metrics registry; with ``--probe.only``
    one that opens no store (``_probe_only_app``)."""
    registry = registry if registry is not None else CollectorRegistry()
    credentials = Credentials.from_settings(settings)
    if settings.probe_only:
        return _probe_only_app(settings, registry, credentials)
    store = SqliteStore(settings.storage_path)
    lines = ReplicaLines(settings.metric_prefix, settings.info_labels())

    def storage_healthy() -> bool:
        return state.storage_error is None

    def measure(replica: Replica) -> int:
        """What ``--limits.bytes`` bounds: a replica's bytes in the exposition, and of its ready responses as
        received (what the store holds) and as shown in JSON (what the listing holds)."""
        kept = sum(len(report.payload) + report.shown_bytes for report in replica.engines.values())
        return lines.size(replica) + kept

    telemetry = Telemetry(registry, storage_healthy)
    base_labels = settings.base_labels()
    state = ExporterState(
        store, base_labels, clock, settings.limits(), settings.missed_heartbeats, measure, telemetry.committed,
        shared_store=settings.workers > 1, render_ahead=lines.render_ahead,
    )  # fmt: skip
    registry.register(credentials)  # the reload state of the access files
    exposition = Exposition(state, lines, registry, telemetry)
    listing = DeploymentListing(state, encode_view)
    prober = Prober(settings, base_labels, registry)

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        yield
        await run_in_threadpool(state.close)
        store.close()

    status = StatusPage(state, settings.telemetry_path, clock)
    served = _served(settings, ENDPOINTS, get_metrics, MetricsQuery)
    document = openapi_document(TITLE, __version__, served)
    parts = Exporter(
        prober, document, state, telemetry, exposition, listing, status, settings.telemetry_path, clock,
        settings.workers > 1,
    )  # fmt: skip
    app, routes, allowed_hosts = _serving(settings, credentials, served, parts, lifespan, telemetry.reject)
    app.state.exporter = parts
    # With a shared store a heartbeat is a commit, which only the app awaits.
    quick_heartbeats = None
    if settings.workers == 1:
        headers = functools.partial(response_headers, credentials.web_config)
        quick_heartbeats = QuickHeartbeats(
            app, routes[HEARTBEAT], HEARTBEAT, parts, credentials, hear_heartbeat, allowed_hosts, headers
        )
    app.state.quick_heartbeats = quick_heartbeats
    return app


def create_app_from_environment() -> Starlette:
    """The app of one worker process of ``serve --web.workers N``: settings come from the parent."""
    freeze_survivors()
    return create_app(Settings.from_environment())
