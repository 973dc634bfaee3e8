"""The HTTP routes: thin handlers that turn a request into a change of the state, or a read of it.

Each handler checks access, parses its query into a msgspec Struct (the
schema of its parameters, also the source of the OpenAPI document), hands the
decoded body to the state and awaits the commit. Refusals are raised as errors
and answered by ``exporter/problems.py``'s table. Nothing blocking runs on the
event loop: commits happen on the writer thread, renders in the thread pool.
"""

from __future__ import annotations

import asyncio
import re
import urllib.parse
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future
from contextlib import suppress
from dataclasses import dataclass
from typing import Annotated, Any, NamedTuple, TypeVar

import msgspec
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, Response
from starlette.types import Receive, Scope, Send

from exporter.errors import InvalidRequest, NotFound, StorageUnavailable, UnsupportedMediaType
from exporter.exposition import Exposition, accepts_gzip
from exporter.listing import DeploymentListing
from exporter.probe import Prober
from exporter.probe_targets import MAX_TARGET, Target, TargetForbidden
from exporter.problems import Problem
from exporter.replicas import DEFAULT_REPLICA, Replica, ReplicaKey
from exporter.security import Credentials
from exporter.state import ExporterState
from exporter.status_page import api_reference, status_page
from exporter.telemetry import Telemetry
from exporter.views import encode_view
from protocol import InvalidPayload, check_engine_index, decode_ready_response, decode_static_labels
from protocol.ready_response import JSON, MAX_PARALLEL, MSGPACK

READY_MEDIA_TYPES = {
    "application/vnd.msgpack": MSGPACK,
    "application/msgpack": MSGPACK,
    "application/x-msgpack": MSGPACK,
    "application/json": JSON,
}
LABELS_MEDIA_TYPES = {"application/json": JSON}
# Letters, digits and ``_.:@+-``, in ``/``-separated segments (served model names like ``org/model``).
_DEPLOYMENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:@+-]*(/[A-Za-z0-9_][A-Za-z0-9_.:@+-]*)*")
MAX_DEPLOYMENT_NAME = 200
MAX_PAGE = 1000

ReplicaName = Annotated[
    str,
    msgspec.Meta(
        pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.:@+-]{0,199}\Z",
        description="The vLLM server of the deployment (host:port, pod name, ...).",
    ),
]
# From a second to a day: a sender that promises heartbeats expires after missing several.
Heartbeat = Annotated[
    float, msgspec.Meta(ge=1, le=86400, description="Seconds between the heartbeats the sender promises.")
]
EngineIndex = Annotated[
    int, msgspec.Meta(ge=0, lt=MAX_PARALLEL, description="Engine index for payloads without a rank.")
]
After = Annotated[
    str,
    msgspec.Meta(
        max_length=2 * MAX_DEPLOYMENT_NAME + 1,
        description="Start after this deployment (all its replicas), or after 'DEPLOYMENT REPLICA'.",
    ),
]
PageSize = Annotated[int, msgspec.Meta(ge=1, le=MAX_PAGE, description="Most replicas to return.")]
DeploymentName = Annotated[
    str, msgspec.Meta(max_length=MAX_DEPLOYMENT_NAME, description="Only the replicas of this deployment.")
]


class ReadyQuery(msgspec.Struct, frozen=True):
    engine: EngineIndex | None = None
    replica: ReplicaName = DEFAULT_REPLICA
    heartbeat: Heartbeat | None = None


class LabelsQuery(msgspec.Struct, frozen=True):
    replica: ReplicaName = DEFAULT_REPLICA
    heartbeat: Heartbeat | None = None


class HeartbeatQuery(msgspec.Struct, frozen=True):
    interval: Annotated[float, msgspec.Meta(ge=1, le=86400, description="Seconds until the next heartbeat.")]
    replica: ReplicaName = DEFAULT_REPLICA


class ReplicaQuery(msgspec.Struct, frozen=True):
    replica: ReplicaName = DEFAULT_REPLICA


class GoodbyeQuery(msgspec.Struct, frozen=True):
    """Without ``replica``, the whole deployment."""

    replica: ReplicaName | None = None


class ListQuery(msgspec.Struct, frozen=True):
    after: After | None = None
    limit: PageSize | None = None
    deployment: DeploymentName | None = None


class EnginePath(msgspec.Struct, frozen=True):
    engine: int


class ProbeQuery(msgspec.Struct, frozen=True):
    target: Annotated[
        str,
        msgspec.Meta(
            max_length=MAX_TARGET,
            description="The vLLM server to probe, HOST:PORT; --probe.allowed-targets must permit it.",
        ),
    ]
    deployment: (
        Annotated[
            str,
            msgspec.Meta(
                pattern=rf"^{_DEPLOYMENT.pattern}\Z",
                max_length=MAX_DEPLOYMENT_NAME,
                description="The deployment label; default: the model_name vLLM shows.",
            ),
        ]
        | None
    ) = None
    debug: Annotated[bool, msgspec.Meta(description="Answer the probe's log and its metrics as plain text.")] = False


@dataclass(frozen=True)
class Exporter:
    """What the handlers of one app work with (``app.state.exporter``)."""

    state: ExporterState
    credentials: Credentials
    telemetry: Telemetry
    exposition: Exposition
    listing: DeploymentListing
    telemetry_path: str
    clock: Callable[[], float]
    # Several worker processes share the store: a read first loads what the others committed.
    shared_store: bool
    prober: Prober


Q = TypeVar("Q", bound=msgspec.Struct)


def _exporter(request: Request) -> Exporter:
    exporter: Exporter = request.app.state.exporter
    return exporter


def _parsed(values: dict[str, Any], kind: type[Q], location: str) -> Q:
    """Query or path parameters as their Struct; a value out of its schema is a 422 naming it."""
    try:
        return msgspec.convert(values, kind, strict=False)
    except msgspec.ValidationError as error:
        invalid = InvalidPayload.from_msgspec(error)
        raise InvalidRequest(f"{location}.{invalid.field.removeprefix('$.')}", invalid.reason) from None


def _query(request: Request, kind: type[Q]) -> Q:
    return _parsed(dict(request.query_params), kind, "query")


def _deployment(request: Request) -> str:
    name: str = request.path_params.get("deployment", "default")
    if len(name) > MAX_DEPLOYMENT_NAME or not _DEPLOYMENT.fullmatch(name) or "/engines/" in f"/{name}/":
        raise InvalidRequest(
            "deployment",
            f"a deployment name has 1 to {MAX_DEPLOYMENT_NAME} characters: letters, digits and _.:@+- "
            "in /-separated segments, none of them 'engines'",
        )
    return name


def _wire_format(request: Request, accepted: dict[str, str]) -> str:
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type not in accepted:
        detail = f"Content-Type {media_type or '(none)'!r} is not one of {', '.join(accepted)}"
        raise UnsupportedMediaType("Content-Type", detail)
    return accepted[media_type]


async def _committed(future: Future[Any]) -> Any:
    """Wait for a queued change to be committed (or refused) without blocking the event loop."""
    return await asyncio.wrap_future(future)


def _json(body: bytes, status: int = 200) -> Response:
    return Response(body, status, media_type="application/json")


class ChunkedBody(Response):
    """A response sent as several chunks with one ``Content-Length``: large cached parts are never copied."""

    def __init__(self, chunks: Sequence[bytes], media_type: str, headers: dict[str, str]) -> None:
        super().__init__(b"", media_type=media_type, headers=headers)
        self.chunks = chunks
        self.headers["content-length"] = str(sum(len(chunk) for chunk in chunks))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        last = len(self.chunks) - 1
        for index, chunk in enumerate(self.chunks):
            await send({"type": "http.response.body", "body": chunk, "more_body": index < last})


async def _current(request: Request) -> Exporter:
    """Access check for reads, then catch up with other workers' commits.

    While the store cannot be read (locked), reads serve this worker's last good state.
    """
    exporter = _exporter(request)
    await exporter.credentials.require_reader(request)
    if exporter.shared_store:
        with suppress(StorageUnavailable):
            await asyncio.wrap_future(exporter.state.refresh())
    return exporter


def _unknown_deployment(name: str) -> NotFound:
    return NotFound("deployment", f"no deployment named {name!r}")


# Handlers ----------------------------------------------------------------------------------


async def post_ready(request: Request) -> Response:
    """Ingest one engine's ready response."""
    exporter = _exporter(request)
    exporter.credentials.require_ingest(request)
    query = _query(request, ReadyQuery)
    key = (_deployment(request), query.replica)
    wire_format = _wire_format(request, READY_MEDIA_TYPES)
    payload = await request.body()
    response = decode_ready_response(payload, wire_format)
    rank = response.data_parallel_rank
    index = query.engine if query.engine is not None else rank if isinstance(rank, int) else 0
    check_engine_index(index, response)
    change = exporter.state.apply_ready(key, index, response, payload, wire_format, query.heartbeat)
    return _json(encode_view(await _committed(change)))


async def put_cache_config(request: Request) -> Response:
    """Set a replica's static labels: its frontend's ``CacheConfig.metrics_info()``."""
    exporter = _exporter(request)
    exporter.credentials.require_ingest(request)
    query = _query(request, LabelsQuery)
    key = (_deployment(request), query.replica)
    _wire_format(request, LABELS_MEDIA_TYPES)
    labels = decode_static_labels(await request.body())
    return _json(encode_view(await _committed(exporter.state.set_static_labels(key, labels, query.heartbeat))))


async def post_heartbeat(request: Request) -> Response:
    """A replica is alive: its series stay until it misses several heartbeats."""
    exporter = _exporter(request)
    exporter.credentials.require_ingest(request)
    query = _query(request, HeartbeatQuery)
    await _committed(exporter.state.heartbeat((_deployment(request), query.replica), query.interval))
    return Response(status_code=204)


async def list_deployments(request: Request) -> Response:
    """Every replica's synced state, by deployment; paged with ``limit`` and ``after``."""
    exporter = await _current(request)
    query = _query(request, ListQuery)
    listing = exporter.listing
    if query.deployment is not None:  # at most --limits.replicas-per-deployment of them, each encoded once
        return ChunkedBody([listing.replicas_of(query.deployment)], "application/json", {})
    limit = MAX_PAGE if query.after is not None and query.limit is None else query.limit
    if listing.is_fresh(whole=limit is None):
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
    key = (request.path_params["deployment"], _query(request, ReplicaQuery).replica)
    return _json(encode_view(_found(exporter.state, key)))


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
    engine = _parsed(dict(request.path_params), EnginePath, "path").engine
    deployment, replica = request.path_params["deployment"], _query(request, ReplicaQuery).replica
    result = await _committed(exporter.state.delete_engine((deployment, replica), engine))
    if result is None:
        raise NotFound("engine", f"replica {replica!r} of {deployment!r} has no engine {engine}")
    return _json(encode_view(result))


async def delete_deployment(request: Request) -> Response:
    """Forget a deployment, or with ``?replica=`` one replica (a sender's goodbye)."""
    exporter = _exporter(request)
    exporter.credentials.require_ingest(request)
    deployment, replica = request.path_params["deployment"], _query(request, GoodbyeQuery).replica
    if replica is None:
        if not await _committed(exporter.state.delete_deployment(deployment)):
            raise _unknown_deployment(deployment)
    elif not await _committed(exporter.state.delete_replica((deployment, replica))):
        raise NotFound("replica", f"no replica {replica!r} of {deployment!r}")
    return Response(status_code=204)


async def get_metrics(request: Request) -> Response:
    """The exposition, in the negotiated format, gzip-compressed when the client takes it."""
    exporter = await _current(request)
    accept = request.headers.get("accept", "")
    gzip = accepts_gzip(request.headers.get("accept-encoding", ""))
    exposition = exporter.exposition
    if exposition.is_fresh(gzip):
        chunks, content_type = exposition.render(accept, gzip)
    else:
        chunks, content_type = await run_in_threadpool(exposition.render, accept, gzip)
    headers = {"Vary": "Accept, Accept-Encoding"}
    if gzip:
        headers["Content-Encoding"] = "gzip"
    return ChunkedBody(chunks, content_type, headers)


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
    exporter = _exporter(request)
    await exporter.credentials.require_reader(request)
    query = _query(request, ProbeQuery)
    try:
        target = Target.parse(query.target)
    except ValueError as error:
        raise InvalidRequest("query.target", str(error)) from None
    prober = exporter.prober
    try:
        outcome = await prober.probe(target, query.deployment, prober.timeout(_scrape_timeout(request)))
    except TargetForbidden as error:
        raise Problem(403, "Forbidden", str(error), "query.target", "forbidden") from None
    if query.debug:
        return PlainTextResponse(outcome.debug_text())
    body, content_type = outcome.exposition(request.headers.get("accept", ""))
    return Response(body, media_type=content_type, headers={"Vary": "Accept"})


async def healthy(request: Request) -> Response:
    return PlainTextResponse("Healthy.\n")


async def ready(request: Request) -> Response:
    error = _exporter(request).state.storage_error
    if error is not None:
        return PlainTextResponse(f"Not ready: storage failing: {error}\n", 503)
    return PlainTextResponse("Ready.\n")


async def landing(request: Request) -> Response:
    """The status page; it shows the deployments, so it needs what reading the JSON state needs."""
    exporter = await _current(request)
    state = exporter.state
    return HTMLResponse(status_page(state.snapshot(), exporter.telemetry_path, exporter.clock(), state.storage_error))


async def docs(request: Request) -> Response:
    """The API reference: this document's operations, without Swagger UI's scripts from a CDN."""
    return HTMLResponse(api_reference(request.app.openapi()))


class Endpoint(NamedTuple):
    """A route, and what the OpenAPI document says of it."""

    path: str
    methods: tuple[str, ...]
    handler: Callable[[Request], Awaitable[Response]]
    query: type[msgspec.Struct] | None = None
    body: tuple[str, ...] = ()
    status: int = 200
    documented: bool = True


DEPLOYMENT = "/api/v1/deployments/{deployment:name}"
# In matching order: a deployment name may hold slashes, so its longer paths come first.
ENDPOINTS = (
    Endpoint("/api/v1/ready", ("POST",), post_ready, ReadyQuery, tuple(READY_MEDIA_TYPES)),
    Endpoint(f"{DEPLOYMENT}/ready", ("POST",), post_ready, ReadyQuery, tuple(READY_MEDIA_TYPES)),
    Endpoint(f"{DEPLOYMENT}/cache-config", ("PUT",), put_cache_config, LabelsQuery, tuple(LABELS_MEDIA_TYPES)),
    Endpoint(f"{DEPLOYMENT}/heartbeat", ("POST",), post_heartbeat, HeartbeatQuery, status=204),
    Endpoint(f"{DEPLOYMENT}/engines/{{engine}}", ("DELETE",), delete_engine, ReplicaQuery),
    Endpoint("/api/v1/deployments", ("GET",), list_deployments, ListQuery),
    Endpoint(DEPLOYMENT, ("GET",), get_deployment, ReplicaQuery),
    Endpoint(DEPLOYMENT, ("DELETE",), delete_deployment, GoodbyeQuery, status=204),
    Endpoint("/probe", ("GET",), get_probe, ProbeQuery),
    Endpoint("/-/healthy", ("GET",), healthy, documented=False),
    Endpoint("/-/ready", ("GET",), ready, documented=False),
    Endpoint("/", ("GET",), landing, documented=False),
    Endpoint("/docs", ("GET",), docs, documented=False),
)


def is_ingest(scope: Scope) -> bool:
    """Whether a request sends a ready response: its refusals are counted by reason."""
    path: str = scope["path"]
    return scope["method"] == "POST" and (path == "/api/v1/ready" or (
        path.startswith("/api/v1/deployments/") and path.endswith("/ready")))  # fmt: skip
