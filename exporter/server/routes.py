"""The HTTP routes: the endpoint table, and thin handlers that turn a request into a change of the state, or a
read of it.

Each route's declaration in ``ENDPOINTS`` names its access and its query's msgspec Struct (the schema of its
parameters, also the source of the OpenAPI document); ``exporter/server/endpoints.py`` grants the access and
parses the query before the handler runs, and hands it the typed parts it works with. A handler hands the
decoded body to the state and awaits the commit. Refusals are raised as errors
and answered by ``exporter/server/problems.py``'s table. Nothing blocking runs on the
event loop: commits happen on the writer thread, renders in the thread pool.
"""

from __future__ import annotations

import asyncio
import urllib.parse
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from contextlib import suppress
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, TypeVar

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.types import Scope

from exporter.errors import Forbidden, InvalidRequest, NotFound, StorageUnavailable
from exporter.exposition.formats import OPENMETRICS, TEXT, accepts_gzip
from exporter.exposition.listing import DeploymentListing
from exporter.exposition.rendering import Exposition
from exporter.exposition.telemetry import Telemetry
from exporter.exposition.views import encode_view
from exporter.probe.allowlist import ProbeTarget, TargetForbidden
from exporter.probe.prober import Prober
from exporter.server.chunked import ChunkedBody
from exporter.server.endpoints import Access, Endpoint, departure
from exporter.server.hand_over import handed_over
from exporter.server.ingest_arrays import engine_of, ingest_array, is_array, items_of
from exporter.server.pages import StatusPage, api_reference
from exporter.server.queries import (
    LABELS_MEDIA_TYPES,
    MAX_PAGE,
    READY_MEDIA_TYPES,
    EnginePath,
    GoodbyeQuery,
    HeartbeatQuery,
    LabelsQuery,
    ListQuery,
    MetricsQuery,
    ProbeQuery,
    ReadyQuery,
    ReplicaQuery,
    deployment_of,
    parsed,
    wire_format_of,
)
from exporter.state.exporter_state import ExporterState
from exporter.state.replicas import Replica, ReplicaKey
from protocol import (
    decode_shown_ready_response,
    decode_static_labels,
)


@dataclass(frozen=True)
class Probing:
    """What ``/probe`` and the API's reference work with, in every app, a probe-only one's too."""

    prober: Prober
    # The OpenAPI document of the routes served (``exporter/server/openapi.py``).
    api_document: dict[str, Any]


@dataclass(frozen=True)
class Exporter(Probing):
    """What the handlers of an exporter that ingests and stores work with."""

    state: ExporterState
    telemetry: Telemetry
    exposition: Exposition
    listing: DeploymentListing
    status_page: StatusPage
    telemetry_path: str
    clock: Callable[[], float]
    # Several worker processes share the store: a read first loads what the others committed.
    shared_store: bool


T = TypeVar("T")
R = TypeVar("R")


async def _committed(future: Future[Any]) -> Any:
    """Wait for a queued change to be committed (or refused) without blocking the event loop."""
    return await asyncio.wrap_future(future)


def _json(body: bytes, status: int = 200) -> Response:
    return Response(body, status, media_type="application/json")


# A changed replica of up to this many engines is encoded on the event loop: its view costs less than the thread
# pool's two hand-offs between threads; a larger one is encoded in the pool. tests/server/test_ingest_cost.py holds
# the bound.
INLINE_VIEW_ENGINES = 16


async def _shown(replica: Replica, shown: Mapping[int, bytes] = MappingProxyType({})) -> Response:
    """A changed replica's view: it decodes what each of its engines sent (but those in ``shown``, sent as JSON by
    this request), in the thread pool unless the replica is small."""
    if len(replica.engines) <= INLINE_VIEW_ENGINES:
        return _json(encode_view(replica, shown))
    return _json(await run_in_threadpool(encode_view, replica, shown))


def _catching_up(exporter: Exporter) -> Future[object] | None:
    """Before a read: catch up with other workers' commits, or with the heartbeats answered; ``None`` when there
    is nothing to catch up with."""
    return exporter.state.refresh() if exporter.shared_store else exporter.state.settled()


async def _catch_up(exporter: Exporter) -> None:
    """Wait, on the event loop, for ``_catching_up``."""
    await _caught_up_on_loop(_catching_up(exporter))


async def _caught_up_on_loop(caught_up: Future[object] | None) -> None:
    """Wait, on the event loop, for a catch-up begun, the interpreter's lock handed over to the writer
    (``exporter/server/hand_over.py``).

    While the store cannot be read (locked), reads serve this worker's last good state.
    """
    if caught_up is not None:
        with suppress(StorageUnavailable):
            await handed_over(caught_up)


def _caught_up(caught_up: Future[object] | None, read: Callable[..., R], *arguments: object) -> R:
    """In a worker thread: wait for the catch-up, then read. A read that would render anyway once caught up (the
    catch-up commits a new version) waits there, so that the writer's answer wakes the thread that renders rather
    than the event loop, which would only hand the render to that thread: one hand-off between threads, not three,
    each of which waits for the interpreter's lock while the loop is busy."""
    if caught_up is not None:
        with suppress(StorageUnavailable):
            caught_up.result()
    return read(*arguments)


def _unknown_deployment(name: str) -> NotFound:
    return NotFound("deployment", f"no deployment named {name!r}")


# Handlers ----------------------------------------------------------------------------------


async def post_ready(request: Request, exporter: Exporter, query: ReadyQuery) -> Response:
    """Ingest one engine's ready response, or an array of one replica's engines' responses in one commit."""
    key = (deployment_of(request), query.replica)
    wire_format = wire_format_of(request, READY_MEDIA_TYPES)
    payload = await request.body()
    if is_array(payload, wire_format):
        if query.engine is not None:
            raise InvalidRequest("query.engine", "in an array each ready response's data_parallel_rank is its engine")
        items = items_of(payload, wire_format)
        return await ingest_array(
            request, exporter.state, exporter.telemetry.reject, key, items, wire_format, query.heartbeat
        )
    response, shown = decode_shown_ready_response(payload, wire_format)
    index = engine_of(query.engine, response)
    change = exporter.state.apply_ready(key, index, response, payload, wire_format, query.heartbeat, shown)
    return await _shown(await _committed(change), {index: shown})


async def put_cache_config(request: Request, exporter: Exporter, query: LabelsQuery) -> Response:
    """Set a replica's static labels: its frontend's ``CacheConfig.metrics_info()``."""
    key = (deployment_of(request), query.replica)
    wire_format_of(request, LABELS_MEDIA_TYPES)
    labels = decode_static_labels(await request.body())
    return await _shown(await _committed(exporter.state.set_static_labels(key, labels, query.heartbeat)))


def hear_heartbeat(request: Request, exporter: Exporter, query: HeartbeatQuery) -> Future[object] | None:
    """A heartbeat's change, without waiting for a commit: the route's, and run as it is beneath the app by
    ``exporter/server/quick_heartbeats.py``. ``None`` when heard at once (a single process)."""
    return exporter.state.heartbeat((deployment_of(request), query.replica), query.interval)


async def post_heartbeat(request: Request, exporter: Exporter, query: HeartbeatQuery) -> Response:
    """A replica is alive: its series stay until it misses several heartbeats."""
    committed = hear_heartbeat(request, exporter, query)
    if committed is not None:
        await _committed(committed)
    return Response(status_code=204)


async def list_deployments(request: Request, exporter: Exporter, query: ListQuery) -> Response:
    """Every replica's synced state, by deployment; paged with ``limit`` and ``after``."""
    await _catch_up(exporter)
    listing = exporter.listing
    if query.deployment is not None:  # at most --limits.replicas-per-deployment of them, each encoded once
        part = await _off_the_loop(listing, listing.replicas_of, query.deployment)
        return ChunkedBody([part], "application/json", {})
    limit = MAX_PAGE if query.after is not None and query.limit is None else query.limit
    if listing.is_fresh():
        chunks, last = listing.page(query.after, limit)
    else:
        chunks, last = await run_in_threadpool(listing.page, query.after, limit)
    headers = {}
    if last is not None:
        headers["Link"] = f'</api/v1/deployments?{urllib.parse.urlencode({"limit": limit, "after": last})}>; rel="next"'
    return ChunkedBody(chunks, "application/json", headers)


async def get_deployment(request: Request, exporter: Exporter, query: ReplicaQuery) -> Response:
    """The synced state of one replica of a deployment."""
    await _catch_up(exporter)
    key = (deployment_of(request), query.replica)
    part = await _off_the_loop(exporter.listing, exporter.listing.replica, key)
    if part is None:  # no such replica (NotFound), or one that came after the listing's version
        return await _shown(_found(exporter.state, key))
    return ChunkedBody([part], "application/json", {})


async def _off_the_loop(listing: DeploymentListing, read: Callable[[T], R], argument: T) -> R:
    """A read of the listing: at once when it is of the current state, else in the thread pool (it encodes)."""
    return read(argument) if listing.is_fresh() else await run_in_threadpool(read, argument)


def _found(state: ExporterState, key: ReplicaKey) -> Replica:
    replica = state.snapshot().get(key)
    if replica is None:
        known = [other.name for other in state.replicas_of(key[0])]
        if not known:
            raise _unknown_deployment(key[0])
        raise NotFound("replica", f"no replica {key[1]!r} of {key[0]!r}; its replicas: {', '.join(known)}")
    return replica


async def delete_engine(request: Request, exporter: Exporter, query: ReplicaQuery) -> Response:
    """Forget one engine of a replica."""
    engine = parsed(dict(request.path_params), EnginePath, "path").engine
    deployment, replica = deployment_of(request), query.replica
    result = await _committed(exporter.state.delete_engine((deployment, replica), engine))
    if result is None:
        raise NotFound("engine", f"replica {replica!r} of {deployment!r} has no engine {engine}")
    return await _shown(result)


async def delete_deployment(request: Request, exporter: Exporter, query: GoodbyeQuery) -> Response:
    """Forget a deployment, or with ``?replica=`` one replica (a sender's goodbye)."""
    deployment, replica = deployment_of(request), query.replica
    if replica is None:
        if not await _committed(exporter.state.delete_deployment(deployment)):
            raise _unknown_deployment(deployment)
    elif not await _committed(exporter.state.delete_replica((deployment, replica))):
        raise NotFound("replica", f"no replica {replica!r} of {deployment!r}")
    return Response(status_code=204)


async def get_metrics(request: Request, exporter: Exporter, query: MetricsQuery) -> Response:
    """The exposition, in the negotiated format, gzip-compressed when the client takes it; a shard when asked.

    With `?shard=i&total_shards=n`, the lines of shard i of n of the deployments, and the exporter's own metrics.
    """
    caught_up = _catching_up(exporter)
    accept = request.headers.get("accept", "")
    gzip = accepts_gzip(request.headers.get("accept-encoding", ""))
    shard = query.selected()
    exposition = exporter.exposition
    if exposition.is_small() or (caught_up is None and exposition.is_fresh(gzip, shard)):
        await _caught_up_on_loop(caught_up)
        chunks, length, content_type = exposition.render(accept, gzip, shard)
    else:
        chunks, length, content_type = await run_in_threadpool(
            _caught_up, caught_up, exposition.render, accept, gzip, shard
        )
    headers = {"Vary": "Accept, Accept-Encoding"}
    if gzip:
        headers["Content-Encoding"] = "gzip"
    return ChunkedBody(chunks, content_type, headers, length)


SCRAPE_TIMEOUT_HEADER = "X-Prometheus-Scrape-Timeout-Seconds"


def _scrape_timeout(request: Request) -> float | None:
    """Prometheus' scrape timeout, sent with every scrape; a value that is no positive number is a 422."""
    text = request.headers.get(SCRAPE_TIMEOUT_HEADER)
    if text is None:
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < float("inf"):
        raise InvalidRequest(SCRAPE_TIMEOUT_HEADER, f"{text[:40]!r} is not a positive number of seconds")
    return seconds


async def get_probe(request: Request, exporter: Probing, query: ProbeQuery) -> Response:
    """Probe a stock vLLM server's /metrics and answer its true cache config (Prometheus' multi-target pattern)."""
    try:
        target = ProbeTarget.parse(query.target)
    except ValueError as error:
        raise InvalidRequest("query.target", str(error)) from None
    prober = exporter.prober
    try:
        with departure(request) as departed:
            outcome = await prober.probe(target, query.deployment, prober.timeout(_scrape_timeout(request)), departed)
    except TargetForbidden as error:
        raise Forbidden("query.target", str(error)) from None
    if query.debug:
        return PlainTextResponse(outcome.debug_text())
    body, content_type = outcome.exposition(request.headers.get("accept", ""))
    return Response(body, media_type=content_type, headers={"Vary": "Accept"})


async def healthy(request: Request, exporter: Probing, _: None) -> Response:
    """Liveness: 200 while the process serves HTTP (for probes; no credentials needed)."""
    return PlainTextResponse("Healthy.\n")


async def ready(request: Request, exporter: Exporter, _: None) -> Response:
    """Readiness: 200 while the store commits, else 503 naming why (for probes; no credentials needed)."""
    error = exporter.state.storage_error
    if error is not None:
        return PlainTextResponse(f"Not ready: storage failing: {error}\n", 503)
    return PlainTextResponse("Ready.\n")


async def landing(request: Request, exporter: Exporter, _: None) -> Response:
    """The status page; it shows the deployments, so it needs what reading the JSON state needs."""
    await _catch_up(exporter)
    page = exporter.status_page.fresh()
    if page is None:
        page = await run_in_threadpool(exporter.status_page.current)
    return HTMLResponse(page)


async def openapi_json(request: Request, exporter: Probing, _: None) -> Response:
    """The OpenAPI document (``exporter/server/openapi.py``)."""
    return JSONResponse(exporter.api_document)


async def docs(request: Request, exporter: Probing, _: None) -> Response:
    """The API reference: this document's operations, without Swagger UI's scripts from a CDN."""
    return HTMLResponse(api_reference(exporter.api_document))


DEPLOYMENT = "/api/v1/deployments/{deployment:name}"
# In matching order: a deployment name may hold slashes, so its longer paths come first.
# What /metrics and /probe answer, negotiated by Accept (exporter/exposition/rendering.py).
EXPOSITION_MEDIA_TYPES = (TEXT.content_type, OPENMETRICS.content_type)
OPEN, READ, INGEST = Access.OPEN, Access.READ, Access.INGEST
READY, LABELS = tuple(READY_MEDIA_TYPES), tuple(LABELS_MEDIA_TYPES)
HEARTBEAT = Endpoint(f"{DEPLOYMENT}/heartbeat", ("POST",), INGEST, post_heartbeat, HeartbeatQuery, status=204)
ENDPOINTS = (
    Endpoint("/api/v1/ready", ("POST",), INGEST, post_ready, ReadyQuery, READY),
    Endpoint(f"{DEPLOYMENT}/ready", ("POST",), INGEST, post_ready, ReadyQuery, READY),
    Endpoint(f"{DEPLOYMENT}/cache-config", ("PUT",), INGEST, put_cache_config, LabelsQuery, LABELS),
    HEARTBEAT,
    Endpoint(f"{DEPLOYMENT}/engines/{{engine}}", ("DELETE",), INGEST, delete_engine, ReplicaQuery),
    Endpoint("/api/v1/deployments", ("GET",), READ, list_deployments, ListQuery),
    Endpoint(DEPLOYMENT, ("GET",), READ, get_deployment, ReplicaQuery),
    Endpoint(DEPLOYMENT, ("DELETE",), INGEST, delete_deployment, GoodbyeQuery, status=204),
    Endpoint("/probe", ("GET",), READ, get_probe, ProbeQuery, answers=(*EXPOSITION_MEDIA_TYPES, "text/plain")),
    Endpoint("/-/healthy", ("GET",), OPEN, healthy, answers=("text/plain",)),
    Endpoint("/-/ready", ("GET",), OPEN, ready, answers=("text/plain",)),
    Endpoint("/", ("GET",), READ, landing, documented=False),
    Endpoint("/docs", ("GET",), OPEN, docs, documented=False),
    Endpoint("/openapi.json", ("GET",), OPEN, openapi_json, documented=False),
)


def is_ingest(scope: Scope) -> bool:
    """Whether a request sends a ready response: its refusals are counted by reason."""
    path: str = scope["path"]
    return scope["method"] == "POST" and (path == "/api/v1/ready" or (
        path.startswith("/api/v1/deployments/") and path.endswith("/ready")))  # fmt: skip
