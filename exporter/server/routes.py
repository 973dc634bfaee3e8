"""The HTTP routes: thin handlers that turn a request into a change of the state, or a read of it.

Each handler checks access, parses its query into a msgspec Struct (the
schema of its parameters, also the source of the OpenAPI document), hands the
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

import msgspec
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, Response
from starlette.types import Scope

from exporter.config.allowlist import Target, TargetForbidden
from exporter.errors import Forbidden, InvalidRequest, NotFound, StorageUnavailable
from exporter.exposition.formats import OPENMETRICS, TEXT, accepts_gzip
from exporter.exposition.listing import DeploymentListing
from exporter.exposition.rendering import Exposition
from exporter.exposition.telemetry import Telemetry
from exporter.exposition.views import ReplicaView, encode_view, view
from exporter.probe.prober import Prober
from exporter.security.auth import Credentials
from exporter.server.chunked import ChunkedBody
from exporter.server.openapi import Endpoint
from exporter.server.pages import StatusPage, api_reference
from exporter.server.problems import Problem, problem_for, problem_response
from exporter.server.queries import (
    LABELS_MEDIA_TYPES,
    MAX_PAGE,
    MAX_READY_BATCH,
    MSGPACK_ARRAY,
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
    item_decoders,
    parse_query,
    parsed,
    wire_format_of,
)
from exporter.state.changes import EngineReady, ReadyOutcome
from exporter.state.exporter_state import ExporterState
from exporter.state.replicas import Replica, ReplicaKey
from protocol import (
    EngineCoreReadyResponse,
    InvalidPayload,
    MalformedPayload,
    check_engine_index,
    decode_shown_ready_response,
    decode_static_labels,
)
from protocol.ready_response import MSGPACK


@dataclass(frozen=True)
class Probing:
    """What ``/probe`` works with, in every app (``app.state.exporter``), a probe-only one's too."""

    credentials: Credentials
    prober: Prober


@dataclass(frozen=True)
class Exporter(Probing):
    """What the handlers of an exporter that ingests and stores work with (``app.state.exporter``)."""

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


def _probing(request: Request) -> Probing:
    probing: Probing = request.app.state.exporter
    return probing


def _exporter(request: Request) -> Exporter:
    exporter: Exporter = request.app.state.exporter
    return exporter


async def _committed(future: Future[Any]) -> Any:
    """Wait for a queued change to be committed (or refused) without blocking the event loop."""
    return await asyncio.wrap_future(future)


def _json(body: bytes, status: int = 200) -> Response:
    return Response(body, status, media_type="application/json")


# A changed replica of up to this many engines is encoded on the event loop: its view costs less than the thread
# pool's two hand-offs between threads (docs/PERFORMANCE.md, run M); a larger one is encoded in the pool.
INLINE_VIEW_ENGINES = 16


async def _shown(replica: Replica, shown: Mapping[int, bytes] = MappingProxyType({})) -> Response:
    """A changed replica's view: it decodes what each of its engines sent (but those in ``shown``, sent as JSON by
    this request), in the thread pool unless the replica is small."""
    if len(replica.engines) <= INLINE_VIEW_ENGINES:
        return _json(encode_view(replica, shown))
    return _json(await run_in_threadpool(encode_view, replica, shown))


async def _current(request: Request) -> Exporter:
    """Access check for reads, then catch up with other workers' commits, or with the heartbeats answered.

    While the store cannot be read (locked), reads serve this worker's last good state.
    """
    exporter = _exporter(request)
    await exporter.credentials.require_reader(request)
    caught_up = exporter.state.refresh() if exporter.shared_store else exporter.state.settled()
    if caught_up is not None:
        with suppress(StorageUnavailable):
            await asyncio.wrap_future(caught_up)
    return exporter


def _unknown_deployment(name: str) -> NotFound:
    return NotFound("deployment", f"no deployment named {name!r}")


# Handlers ----------------------------------------------------------------------------------


async def post_ready(request: Request) -> Response:
    """Ingest one engine's ready response, or an array of one replica's engines' responses in one commit."""
    exporter = _exporter(request)
    exporter.credentials.require_ingest(request)
    query = parse_query(request, ReadyQuery)
    key = (deployment_of(request), query.replica)
    wire_format = wire_format_of(request, READY_MEDIA_TYPES)
    payload = await request.body()
    if _is_array(payload, wire_format):
        if query.engine is not None:
            raise InvalidRequest("query.engine", "in an array each ready response's data_parallel_rank is its engine")
        return await _post_ready_many(request, exporter, key, _items(payload, wire_format), wire_format, query)
    response, shown = decode_shown_ready_response(payload, wire_format)
    index = _engine(query.engine, response)
    change = exporter.state.apply_ready(key, index, response, payload, wire_format, query.heartbeat, shown)
    return await _shown(await _committed(change), {index: shown})


def _engine(given: int | None, response: EngineCoreReadyResponse) -> int:
    """The engine index of a response: ``?engine=``, else its ``data_parallel_rank``, else 0; checked against it."""
    rank = response.data_parallel_rank
    index = given if given is not None else rank if isinstance(rank, int) else 0
    check_engine_index(index, response)
    return index


def _is_array(payload: bytes, wire_format: str) -> bool:
    if wire_format == MSGPACK:
        return payload[:1] != b"" and payload[0] in MSGPACK_ARRAY
    return payload.lstrip(b" \t\r\n")[:1] == b"["


def _items(payload: bytes, wire_format: str) -> list[bytes]:
    """The ready responses of an array, each as its own bytes (checked one by one afterwards)."""
    try:
        items = item_decoders[wire_format].decode(payload)
    except msgspec.DecodeError as error:
        raise InvalidPayload.from_msgspec(error) from None
    except RecursionError:
        raise MalformedPayload("$", "nested too deeply") from None
    if not 1 <= len(items) <= MAX_READY_BATCH:
        raise InvalidPayload("$", f"an array holds 1 to {MAX_READY_BATCH} ready responses, not {len(items)}")
    return [bytes(item) for item in items]


class ReadyManyAnswer(msgspec.Struct):
    """The answer to several ready responses of which some were taken: the replica as committed, and each
    refused response's problem, with its ``index`` in the array."""

    replica: ReplicaView
    refused: list[dict[str, Any]]


async def _post_ready_many(
    request: Request, exporter: Exporter, key: ReplicaKey, items: list[bytes], wire_format: str, query: ReadyQuery
) -> Response:
    """Each response checked alone, the accepted ones committed together; a refused one is named by its ``index``.

    Some taken: 200 with the replica and the refusals. None taken: the first refusal's problem, with all of them.
    """
    reports, refused, places = [], {}, {}
    for index, item in enumerate(items):
        try:
            response, shown = decode_shown_ready_response(item, wire_format)
            report = EngineReady(_engine(None, response), response, item, wire_format, shown)
        except InvalidPayload as error:
            refused[index] = error
            continue
        reports.append(report)
        places[report.engine] = index
    outcome = ReadyOutcome(None, {})
    if reports:
        outcome = await _committed(exporter.state.apply_ready_many(key, reports, query.heartbeat))
    refused.update((places[engine], error) for engine, error in outcome.refused.items())
    problems = [_item_problem(request, index, error) for index, error in sorted(refused.items())]
    for problem in problems:
        exporter.telemetry.reject(problem["reason"])
        del problem["reason"]
    if len(refused) < len(items) and outcome.replica is not None:
        return _json(msgspec.json.encode(ReadyManyAnswer(view(outcome.replica), problems)))
    first = problems[0]
    body = msgspec.json.encode(
        {**{name: value for name, value in first.items() if name != "index"}, "refused": problems}
    )
    return Response(body, first["status"], media_type="application/problem+json")


def _item_problem(request: Request, index: int, error: Exception) -> dict[str, Any]:
    """The problem of the ``index``-th response of an array, its field as a path into the array."""
    problem = problem_for(error)
    field = problem.field
    if field is not None and field.startswith("$"):
        field = f"$[{index}]{field[1:]}"
    named = Problem(problem.status, problem.title, problem.detail, field, problem.reason)
    return {**msgspec.json.decode(problem_response(request, named).body), "index": index, "reason": problem.reason}


async def put_cache_config(request: Request) -> Response:
    """Set a replica's static labels: its frontend's ``CacheConfig.metrics_info()``."""
    exporter = _exporter(request)
    exporter.credentials.require_ingest(request)
    query = parse_query(request, LabelsQuery)
    key = (deployment_of(request), query.replica)
    wire_format_of(request, LABELS_MEDIA_TYPES)
    labels = decode_static_labels(await request.body())
    return await _shown(await _committed(exporter.state.set_static_labels(key, labels, query.heartbeat)))


def hear_heartbeat(request: Request) -> Future[object] | None:
    """A heartbeat's checks and its change, without waiting for a commit: the route's, and run as they are
    beneath the app by ``exporter/server/quick_heartbeats.py``. ``None`` when heard at once (a single process)."""
    exporter = _exporter(request)
    exporter.credentials.require_ingest(request)
    query = parse_query(request, HeartbeatQuery)
    return exporter.state.heartbeat((deployment_of(request), query.replica), query.interval)


async def post_heartbeat(request: Request) -> Response:
    """A replica is alive: its series stay until it misses several heartbeats."""
    committed = hear_heartbeat(request)
    if committed is not None:
        await _committed(committed)
    return Response(status_code=204)


async def list_deployments(request: Request) -> Response:
    """Every replica's synced state, by deployment; paged with ``limit`` and ``after``."""
    exporter = await _current(request)
    query = parse_query(request, ListQuery)
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


async def get_deployment(request: Request) -> Response:
    """The synced state of one replica of a deployment."""
    exporter = await _current(request)
    key = (deployment_of(request), parse_query(request, ReplicaQuery).replica)
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


async def delete_engine(request: Request) -> Response:
    """Forget one engine of a replica."""
    exporter = _exporter(request)
    exporter.credentials.require_ingest(request)
    engine = parsed(dict(request.path_params), EnginePath, "path").engine
    deployment, replica = deployment_of(request), parse_query(request, ReplicaQuery).replica
    result = await _committed(exporter.state.delete_engine((deployment, replica), engine))
    if result is None:
        raise NotFound("engine", f"replica {replica!r} of {deployment!r} has no engine {engine}")
    return await _shown(result)


async def delete_deployment(request: Request) -> Response:
    """Forget a deployment, or with ``?replica=`` one replica (a sender's goodbye)."""
    exporter = _exporter(request)
    exporter.credentials.require_ingest(request)
    deployment, replica = deployment_of(request), parse_query(request, GoodbyeQuery).replica
    if replica is None:
        if not await _committed(exporter.state.delete_deployment(deployment)):
            raise _unknown_deployment(deployment)
    elif not await _committed(exporter.state.delete_replica((deployment, replica))):
        raise NotFound("replica", f"no replica {replica!r} of {deployment!r}")
    return Response(status_code=204)


async def get_metrics(request: Request) -> Response:
    """The exposition, in the negotiated format, gzip-compressed when the client takes it; a shard when asked.

    With `?shard=i&total_shards=n`, the lines of shard i of n of the deployments, and the exporter's own metrics.
    """
    exporter = await _current(request)
    accept = request.headers.get("accept", "")
    gzip = accepts_gzip(request.headers.get("accept-encoding", ""))
    shard = parse_query(request, MetricsQuery).selected()
    exposition = exporter.exposition
    if exposition.is_fresh(gzip, shard):
        chunks, length, content_type = exposition.render(accept, gzip, shard)
    else:
        chunks, length, content_type = await run_in_threadpool(exposition.render, accept, gzip, shard)
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


async def get_probe(request: Request) -> Response:
    """Probe a stock vLLM server's /metrics and answer its true cache config (Prometheus' multi-target pattern)."""
    exporter = _probing(request)
    await exporter.credentials.require_reader(request)
    query = parse_query(request, ProbeQuery)
    try:
        target = Target.parse(query.target)
    except ValueError as error:
        raise InvalidRequest("query.target", str(error)) from None
    prober = exporter.prober
    try:
        outcome = await prober.probe(target, query.deployment, prober.timeout(_scrape_timeout(request)))
    except TargetForbidden as error:
        raise Forbidden("query.target", str(error)) from None
    if query.debug:
        return PlainTextResponse(outcome.debug_text())
    body, content_type = outcome.exposition(request.headers.get("accept", ""))
    return Response(body, media_type=content_type, headers={"Vary": "Accept"})


async def healthy(request: Request) -> Response:
    """Liveness: 200 while the process serves HTTP (for probes; no credentials needed)."""
    return PlainTextResponse("Healthy.\n")


async def ready(request: Request) -> Response:
    """Readiness: 200 while the store commits, else 503 naming why (for probes; no credentials needed)."""
    error = _exporter(request).state.storage_error
    if error is not None:
        return PlainTextResponse(f"Not ready: storage failing: {error}\n", 503)
    return PlainTextResponse("Ready.\n")


async def landing(request: Request) -> Response:
    """The status page; it shows the deployments, so it needs what reading the JSON state needs."""
    exporter = await _current(request)
    page = exporter.status_page.fresh()
    if page is None:
        page = await run_in_threadpool(exporter.status_page.current)
    return HTMLResponse(page)


async def docs(request: Request) -> Response:
    """The API reference: this document's operations, without Swagger UI's scripts from a CDN."""
    return HTMLResponse(api_reference(request.app.openapi()))


DEPLOYMENT = "/api/v1/deployments/{deployment:name}"
# In matching order: a deployment name may hold slashes, so its longer paths come first.
# What /metrics and /probe answer, negotiated by Accept (exporter/exposition/rendering.py).
EXPOSITION_MEDIA_TYPES = (TEXT.content_type, OPENMETRICS.content_type)
ENDPOINTS = (
    Endpoint("/api/v1/ready", ("POST",), post_ready, ReadyQuery, tuple(READY_MEDIA_TYPES)),
    Endpoint(f"{DEPLOYMENT}/ready", ("POST",), post_ready, ReadyQuery, tuple(READY_MEDIA_TYPES)),
    Endpoint(f"{DEPLOYMENT}/cache-config", ("PUT",), put_cache_config, LabelsQuery, tuple(LABELS_MEDIA_TYPES)),
    Endpoint(f"{DEPLOYMENT}/heartbeat", ("POST",), post_heartbeat, HeartbeatQuery, status=204),
    Endpoint(f"{DEPLOYMENT}/engines/{{engine}}", ("DELETE",), delete_engine, ReplicaQuery),
    Endpoint("/api/v1/deployments", ("GET",), list_deployments, ListQuery),
    Endpoint(DEPLOYMENT, ("GET",), get_deployment, ReplicaQuery),
    Endpoint(DEPLOYMENT, ("DELETE",), delete_deployment, GoodbyeQuery, status=204),
    Endpoint("/probe", ("GET",), get_probe, ProbeQuery, answers=(*EXPOSITION_MEDIA_TYPES, "text/plain")),
    Endpoint("/-/healthy", ("GET",), healthy, answers=("text/plain",)),
    Endpoint("/-/ready", ("GET",), ready, answers=("text/plain",)),
    Endpoint("/", ("GET",), landing, documented=False),
    Endpoint("/docs", ("GET",), docs, documented=False),
)


def is_ingest(scope: Scope) -> bool:
    """Whether a request sends a ready response: its refusals are counted by reason."""
    path: str = scope["path"]
    return scope["method"] == "POST" and (path == "/api/v1/ready" or (
        path.startswith("/api/v1/deployments/") and path.endswith("/ready")))  # fmt: skip
