"""The HTTP service: an app factory wiring request -> protocol decode -> sync -> store -> /metrics.

Every handler is thin: it checks access, turns HTTP into a change queued on
``ExporterState`` and awaits its commit, and turns the protocol's errors into
problem details. Nothing blocking runs on the event loop: commits happen on
the state's writer thread, and re-rendering the exposition in the thread pool.
"""

from __future__ import annotations

import asyncio
import re
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from contextlib import asynccontextmanager, suppress
from typing import Annotated, Any

import msgspec
from fastapi import FastAPI, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse
from prometheus_client import CollectorRegistry
from starlette.concurrency import run_in_threadpool
from starlette.convertors import PathConvertor, register_url_convertor
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send

from exporter import __version__
from exporter.collector import CacheConfigCollector
from exporter.exposition import Exposition, accepts_gzip
from exporter.limits import Limits
from exporter.listing import DeploymentListing
from exporter.problems import Problem, handle_http_exception, handle_problem, handle_validation_error
from exporter.request_guard import RequestGuard
from exporter.security import Credentials, ResponseHeaders
from exporter.settings import Settings
from exporter.state import (
    DEFAULT_REPLICA,
    ExporterState,
    LimitExceeded,
    Replica,
    ReplicaKey,
    StorageUnavailable,
    UnknownReplica,
    view,
)
from exporter.status_page import api_reference, status_page
from exporter.storage import Store
from exporter.telemetry import ExporterMetrics
from protocol import (
    EngineCoreReadyResponse,
    InvalidPayload,
    SyncConflict,
    check_engine_index,
    decode_ready_response,
    decode_static_labels,
)
from protocol.ready_response import JSON, MAX_PARALLEL, MSGPACK

READY_MEDIA_TYPES = {
    "application/vnd.msgpack": MSGPACK,
    "application/msgpack": MSGPACK,
    "application/x-msgpack": MSGPACK,
    "application/json": JSON,
}
# Letters, digits and ``_.:@+-``, in ``/``-separated segments (served model names like ``org/model``).
_DEPLOYMENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:@+-]*(/[A-Za-z0-9_][A-Za-z0-9_.:@+-]*)*")
MAX_DEPLOYMENT_NAME = 200
MAX_PAGE = 1000
AFTER = "Start after this deployment (all its replicas), or after 'DEPLOYMENT REPLICA'."
EngineIndex = Annotated[int, Query(ge=0, lt=MAX_PARALLEL, description="Engine index for payloads without a rank.")]
_REPLICA_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.:@+-]{0,199}$"
ReplicaName = Annotated[
    str, Query(pattern=_REPLICA_PATTERN, description="The vLLM server of the deployment (host:port, pod name, ...).")
]
OptionalReplica = Annotated[str | None, Query(pattern=_REPLICA_PATTERN, description="Only this replica.")]
# From a second to a day: a sender that promises heartbeats expires after missing several.
Heartbeat = Annotated[
    float | None, Query(ge=1, le=86400, description="Seconds between the heartbeats the sender promises to send.")
]
HeartbeatInterval = Annotated[float, Query(ge=1, le=86400, description="Seconds until the next heartbeat.")]

_json = msgspec.json.Encoder()


class _AnyTextConvertor(PathConvertor):
    """Starlette's ``path`` convertor, but matching newlines too, so that such a name gets a 422, not a 404."""

    regex = "(?s:.+)"


register_url_convertor("name", _AnyTextConvertor())


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


def _json_response(value: object) -> Response:
    return Response(_json.encode(value), media_type="application/json")


def _unknown_deployment(name: str) -> Problem:
    return Problem(404, "Unknown deployment", f"no deployment named {name!r}", "deployment", "not_found")


def _check_deployment_name(name: str) -> None:
    if len(name) > MAX_DEPLOYMENT_NAME or not _DEPLOYMENT.fullmatch(name) or "/engines/" in f"/{name}/":
        raise Problem(
            422,
            "Invalid deployment name",
            f"a deployment name has 1 to {MAX_DEPLOYMENT_NAME} characters: letters, digits and _.:@+- "
            "in /-separated segments, none of them 'engines'",
            "deployment",
            "invalid_request",
        )


def _replica_key(deployment: str, replica: str) -> ReplicaKey:
    _check_deployment_name(deployment)
    return (deployment, replica)


def _wire_format(request: Request, accepted: dict[str, str]) -> str:
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type not in accepted:
        raise Problem(
            415,
            "Unsupported media type",
            f"Content-Type {media_type or '(none)'!r} is not one of {', '.join(accepted)}",
            "Content-Type",
            "unsupported_media_type",
        )
    return accepted[media_type]


def _refusal(error: Exception, title: str) -> Problem:
    """The problem an error of the protocol, the limits or the store stands for."""
    if isinstance(error, StorageUnavailable):
        problem = Problem(503, "Storage unavailable", f"nothing was changed: {error}", None, "storage_unavailable")
        problem.headers["Retry-After"] = "1"
        return problem
    assert isinstance(error, InvalidPayload)
    if isinstance(error, SyncConflict):
        return Problem(409, "Conflicting engines", error.reason, error.field, "conflict")
    if isinstance(error, LimitExceeded):
        return Problem(429, "Limit reached", error.reason, error.field, "limit")
    if error.malformed:
        return Problem(400, title, error.reason, error.field, "malformed")
    return Problem(422, title, error.reason, error.field, "invalid")


async def _committed(future: Future[Any], title: str) -> Any:
    """Wait for a queued change to be committed (or refused) without blocking the event loop."""
    try:
        return await asyncio.wrap_future(future)
    except (InvalidPayload, StorageUnavailable) as error:
        raise _refusal(error, title) from None


def _is_ingest(scope: Scope) -> bool:
    """Whether a request sends a ready response: its refusals are counted by reason."""
    path = scope["path"]
    return scope["method"] == "POST" and (path == "/api/v1/ready" or (
        path.startswith("/api/v1/deployments/") and path.endswith("/ready")))  # fmt: skip


def create_app(
    settings: Settings,
    registry: CollectorRegistry | None = None,
    clock: Callable[[], float] = time.time,
) -> FastAPI:
    """Build the exporter app with its own store, state, credentials and metrics registry."""
    registry = registry if registry is not None else CollectorRegistry()
    credentials = Credentials.from_settings(settings)
    store = Store(settings.storage_path)
    limits = Limits(
        settings.max_deployments,
        settings.max_replicas_per_deployment,
        settings.max_engines_per_deployment,
        settings.max_bytes,
    )

    collector = CacheConfigCollector(settings.metric_prefix)

    def measure(replica: Replica) -> int:
        """What ``--limits.bytes`` bounds: a replica's bytes in the exposition, and of its ready responses as
        received (what the store and the JSON state hold of it)."""
        exposition = sum(len(family) for family in collector.lines(replica))
        return exposition + sum(len(report.payload) for report in replica.engines.values())

    state = ExporterState(store, settings.base_labels(), clock, limits, settings.missed_heartbeats, measure)
    metrics = ExporterMetrics(registry, lambda: state.storage_error is None, lambda: state.expired_total)
    registry.register(credentials)  # the reload state of the access files
    exposition = Exposition(state, collector, metrics)
    listing = DeploymentListing(state, lambda deployment: _json.encode(view(deployment)))
    # Several worker processes share the file: load what the others committed before answering a read.
    shared_store = settings.workers > 1

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await run_in_threadpool(state.close)
        store.close()

    # /docs is rendered here (exporter/status_page.py): Swagger UI would load its scripts from a CDN.
    app = FastAPI(title="cache-config-exporter", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.exporter = state

    def count_refusal(scope: Scope, reason: str) -> None:
        if _is_ingest(scope):
            metrics.reject(reason)

    async def refuse_invalid_request(request: Request, error: Exception) -> Response:
        count_refusal(request.scope, "invalid_request")
        return await handle_validation_error(request, error)

    app.add_middleware(
        RequestGuard,
        max_bytes=settings.max_request_bytes,
        read_timeout=settings.read_timeout_seconds,
        allowed_hosts=None if settings.allowed_hosts is None else frozenset(settings.allowed_hosts),
        count_refusal=count_refusal,
    )
    app.add_middleware(ResponseHeaders, credentials=credentials)
    app.add_exception_handler(Problem, handle_problem)
    app.add_exception_handler(HTTPException, handle_http_exception)
    app.add_exception_handler(RequestValidationError, refuse_invalid_request)

    async def current(request: Request) -> None:
        """Access check for reads, then catch up with other workers' commits.

        While the store cannot be read (locked), reads serve this worker's last good state.
        """
        await credentials.require_reader(request)
        if shared_store:
            with suppress(StorageUnavailable):
                await asyncio.wrap_future(state.refresh())

    async def found(request: Request, key: ReplicaKey) -> Replica:
        await current(request)
        replica = state.snapshot().get(key)
        if replica is None:
            known = [other.name for other in state.replicas_of(key[0])]
            if not known:
                raise _unknown_deployment(key[0])
            detail = f"no replica {key[1]!r} of {key[0]!r}; its replicas: {', '.join(known)}"
            raise Problem(404, "Unknown replica", detail, "replica", "not_found")
        return replica

    async def ingest(
        name: str, replica: str, request: Request, engine: int | None, heartbeat: float | None
    ) -> Response:
        try:
            credentials.require_ingest(request)
            key = _replica_key(name, replica)
            wire_format = _wire_format(request, READY_MEDIA_TYPES)
            payload = await request.body()
            if not payload:
                raise Problem(400, "Invalid ready response", "the request body is empty", None, "malformed")
            try:
                response = decode_ready_response(payload, wire_format)
                index = engine if engine is not None else _rank(response)
                check_engine_index(index, response)
            except InvalidPayload as error:
                raise _refusal(error, "Invalid ready response") from None
            updated = await _committed(
                state.apply_ready(key, index, response, payload, wire_format, heartbeat), "Invalid ready response"
            )
        except Problem as problem:
            metrics.reject(problem.reason)
            raise
        metrics.accepted += 1
        return _json_response(view(updated))

    @app.post("/api/v1/ready", summary="Ingest a ready response for the deployment 'default'")
    async def post_default_ready(
        request: Request,
        engine: EngineIndex = None,
        replica: ReplicaName = DEFAULT_REPLICA,
        heartbeat: Heartbeat = None,
    ) -> Response:
        return await ingest("default", replica, request, engine, heartbeat)

    @app.post("/api/v1/deployments/{deployment:name}/ready", summary="Ingest one engine's ready response")
    async def post_ready(
        deployment: str,
        request: Request,
        engine: EngineIndex = None,
        replica: ReplicaName = DEFAULT_REPLICA,
        heartbeat: Heartbeat = None,
    ) -> Response:
        return await ingest(deployment, replica, request, engine, heartbeat)

    @app.put(
        "/api/v1/deployments/{deployment:name}/cache-config",
        summary="Set a replica's static labels: its frontend's CacheConfig.metrics_info()",
    )
    async def put_cache_config(
        deployment: str, request: Request, replica: ReplicaName = DEFAULT_REPLICA, heartbeat: Heartbeat = None
    ) -> Response:
        credentials.require_ingest(request)
        key = _replica_key(deployment, replica)
        _wire_format(request, {"application/json": JSON})
        try:
            labels = decode_static_labels(await request.body())
        except InvalidPayload as error:
            raise _refusal(error, "Invalid cache config") from None
        updated = await _committed(state.set_static_labels(key, labels, heartbeat), "Invalid cache config")
        return _json_response(view(updated))

    @app.post(
        "/api/v1/deployments/{deployment:name}/heartbeat",
        summary="A replica is alive: its series stay until it misses several heartbeats",
        status_code=204,
    )
    async def post_heartbeat(
        deployment: str, request: Request, interval: HeartbeatInterval, replica: ReplicaName = DEFAULT_REPLICA
    ) -> Response:
        credentials.require_ingest(request)
        key = _replica_key(deployment, replica)
        try:
            await _committed(state.heartbeat(key, interval), "Invalid heartbeat")
        except UnknownReplica:
            raise Problem(
                404,
                "Unknown replica",
                f"no replica {replica!r} of {deployment!r}: send its state",
                "replica",
                "not_found",
            ) from None
        return Response(status_code=204)

    @app.api_route(
        "/api/v1/deployments", methods=["GET", "HEAD"], summary="Every replica's synced state, by deployment"
    )
    async def list_deployments(
        request: Request,
        after: Annotated[str | None, Query(max_length=2 * MAX_DEPLOYMENT_NAME + 1, description=AFTER)] = None,
        limit: Annotated[int | None, Query(ge=1, le=MAX_PAGE, description="Most replicas to return.")] = None,
        deployment: Annotated[
            str | None, Query(max_length=MAX_DEPLOYMENT_NAME, description="Only the replicas of this deployment.")
        ] = None,
    ) -> Response:
        await current(request)
        if deployment is not None:  # at most --limits.replicas-per-deployment of them, each encoded once per change
            return ChunkedBody([listing.replicas_of(deployment)], "application/json", {})
        if after is not None and limit is None:
            limit = MAX_PAGE
        if listing.is_fresh(whole=limit is None):
            chunks, last = listing.page(after, limit)
        else:
            chunks, last = await run_in_threadpool(listing.page, after, limit)
        headers = {}
        if last is not None:
            query = urllib.parse.urlencode({"limit": limit, "after": last})
            headers["Link"] = f'</api/v1/deployments?{query}>; rel="next"'
        return ChunkedBody(chunks, "application/json", headers)

    @app.delete("/api/v1/deployments/{deployment:name}/engines/{engine}", summary="Forget one engine")
    async def delete_engine(
        deployment: str, engine: int, request: Request, replica: ReplicaName = DEFAULT_REPLICA
    ) -> Response:
        credentials.require_ingest(request)
        result = await _committed(state.delete_engine((deployment, replica), engine), "Invalid request")
        if result is None:
            detail = f"replica {replica!r} of {deployment!r} has no engine {engine}"
            raise Problem(404, "Unknown engine", detail, "engine", "not_found")
        return _json_response(view(result))

    @app.api_route("/api/v1/deployments/{deployment:name}", methods=["GET", "HEAD"],
                   summary="The synced state of one replica of a deployment")  # fmt: skip
    async def get_deployment(deployment: str, request: Request, replica: ReplicaName = DEFAULT_REPLICA) -> Response:
        return _json_response(view(await found(request, (deployment, replica))))

    @app.delete(
        "/api/v1/deployments/{deployment:name}",
        summary="Forget a deployment, or with ?replica= one replica (a sender's goodbye)",
        status_code=204,
    )
    async def delete_deployment(deployment: str, request: Request, replica: OptionalReplica = None) -> Response:
        credentials.require_ingest(request)
        if replica is None:
            if not await _committed(state.delete_deployment(deployment), "Invalid request"):
                raise _unknown_deployment(deployment)
        elif not await _committed(state.delete_replica((deployment, replica)), "Invalid request"):
            raise Problem(404, "Unknown replica", f"no replica {replica!r} of {deployment!r}", "replica", "not_found")
        return Response(status_code=204)

    @app.api_route(settings.telemetry_path, methods=["GET", "HEAD"], include_in_schema=False)
    async def get_metrics(request: Request) -> Response:
        await current(request)
        accept = request.headers.get("accept", "")
        gzip = accepts_gzip(request.headers.get("accept-encoding", ""))
        if exposition.is_fresh(gzip):
            chunks, content_type = exposition.render(accept, gzip)
        else:
            chunks, content_type = await run_in_threadpool(exposition.render, accept, gzip)
        headers = {"Vary": "Accept, Accept-Encoding"}
        if gzip:
            headers["Content-Encoding"] = "gzip"
        return ChunkedBody(chunks, content_type, headers)

    @app.api_route("/-/healthy", methods=["GET", "HEAD"], include_in_schema=False)
    async def healthy() -> Response:
        return Response("Healthy.\n", media_type="text/plain")

    @app.api_route("/-/ready", methods=["GET", "HEAD"], include_in_schema=False)
    async def ready() -> Response:
        if state.storage_error is not None:
            return Response(f"Not ready: storage failing: {state.storage_error}\n", 503, media_type="text/plain")
        return Response("Ready.\n", media_type="text/plain")

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def landing(request: Request) -> HTMLResponse:
        await current(request)  # it shows the deployments, so it needs what reading the JSON state needs
        page = status_page(state.snapshot(), settings.telemetry_path, clock(), state.storage_error)
        return HTMLResponse(page)

    @app.api_route("/docs", methods=["GET", "HEAD"], include_in_schema=False)
    async def docs() -> HTMLResponse:
        return HTMLResponse(api_reference(app.openapi()))

    return app


def create_app_from_environment() -> FastAPI:
    """The app of one worker process of ``serve --web.workers N``: settings come from the parent."""
    return create_app(Settings.from_environment())


def _rank(response: EngineCoreReadyResponse) -> int:
    rank = response.data_parallel_rank
    return rank if isinstance(rank, int) else 0
