"""The HTTP service: an app factory wiring request -> protocol decode -> sync -> store -> /metrics.

Every handler is thin: it turns HTTP into a call on ``ExporterState`` and the
protocol's errors into problem details. Blocking work (SQLite commits,
rendering the exposition) runs in the thread pool, off the event loop.
"""

from __future__ import annotations

import gzip
import html
import re
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Annotated

import msgspec
from fastapi import FastAPI, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from starlette.concurrency import run_in_threadpool
from starlette.convertors import PathConvertor, register_url_convertor
from starlette.exceptions import HTTPException

from exporter import __version__
from exporter.collector import CacheConfigCollector
from exporter.problems import Problem, handle_http_exception, handle_problem, handle_validation_error
from exporter.settings import Settings
from exporter.state import Deployment, ExporterState, StorageUnavailable, view
from exporter.storage import Store
from exporter.telemetry import ExporterMetrics
from protocol import (
    CacheConfigUpdate,
    EngineCoreReadyResponse,
    InvalidPayload,
    SyncConflict,
    check_engine_index,
    decode_cache_config_update,
    decode_ready_response,
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
EngineIndex = Annotated[
    int, Query(ge=0, lt=MAX_PARALLEL, description="Engine index for payloads without data_parallel_rank.")
]

_json = msgspec.json.Encoder()


class _AnyTextConvertor(PathConvertor):
    """Starlette's ``path`` convertor, but matching newlines too, so that such a name gets a 422, not a 404."""

    regex = "(?s:.+)"


register_url_convertor("name", _AnyTextConvertor())


def _json_response(value: object, status_code: int = 200) -> Response:
    return Response(_json.encode(value), status_code=status_code, media_type="application/json")


def _check_deployment_name(name: str) -> str:
    if len(name) > MAX_DEPLOYMENT_NAME or not _DEPLOYMENT.fullmatch(name) or "/engines/" in f"/{name}/":
        raise Problem(
            422,
            "Invalid deployment name",
            f"a deployment name has 1 to {MAX_DEPLOYMENT_NAME} characters: letters, digits and _.:@+- "
            "in /-separated segments, none of them 'engines'",
            "deployment",
            "invalid_request",
        )
    return name


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


def _invalid(error: InvalidPayload, title: str) -> Problem:
    if isinstance(error, SyncConflict):
        return Problem(409, "Conflicting engines", error.reason, error.field, "conflict")
    if error.malformed:
        return Problem(400, title, error.reason, error.field, "malformed")
    return Problem(422, title, error.reason, error.field, "invalid")


def _unavailable(error: StorageUnavailable) -> Problem:
    problem = Problem(503, "Storage unavailable", f"nothing was changed: {error}", None, "storage_unavailable")
    problem.headers["Retry-After"] = "1"
    return problem


def _landing_page(settings: Settings) -> str:
    path = html.escape(settings.telemetry_path)
    return (
        "<!doctype html><html><head><title>cache-config-exporter</title></head><body>"
        f"<h1>cache-config-exporter {__version__}</h1>"
        "<p>Publishes the KV-cache configuration vLLM engines really run with, synced from their ready responses.</p>"
        f'<ul><li><a href="{path}">Metrics</a></li>'
        '<li><a href="/api/v1/deployments">Deployments (JSON)</a></li>'
        '<li><a href="/-/healthy">Health</a></li><li><a href="/-/ready">Readiness</a></li>'
        '<li><a href="/docs">API documentation</a></li></ul></body></html>'
    )


def create_app(
    settings: Settings,
    registry: CollectorRegistry | None = None,
    clock: Callable[[], float] = time.time,
) -> FastAPI:
    """Build the exporter app with its own store, state and metrics registry."""
    registry = registry if registry is not None else CollectorRegistry()
    store = Store(settings.storage_path)
    state = ExporterState(store, settings.base_config(), clock)
    metrics = ExporterMetrics(registry)
    registry.register(CacheConfigCollector(state, settings.metric_prefix))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        store.close()

    app = FastAPI(title="cache-config-exporter", version=__version__, lifespan=lifespan)
    app.state.exporter = state
    app.add_exception_handler(Problem, handle_problem)
    app.add_exception_handler(HTTPException, handle_http_exception)
    app.add_exception_handler(RequestValidationError, handle_validation_error)

    def found(name: str) -> Deployment:
        deployment = state.get(name)
        if deployment is None:
            raise Problem(404, "Unknown deployment", f"no deployment named {name!r}", "deployment", "not_found")
        return deployment

    async def ingest(name: str, request: Request, engine: int | None) -> Response:
        try:
            _check_deployment_name(name)
            wire_format = _wire_format(request, READY_MEDIA_TYPES)
            try:
                response = decode_ready_response(await request.body(), wire_format)
                index = engine if engine is not None else _rank(response)
                check_engine_index(index, response)
                deployment = await run_in_threadpool(state.apply_ready, name, index, response)
            except InvalidPayload as error:
                raise _invalid(error, "Invalid ready response") from None
            except StorageUnavailable as error:
                raise _unavailable(error) from None
        except Problem as problem:
            metrics.rejected.labels(problem.reason).inc()
            raise
        metrics.accepted.inc()
        return _json_response(view(deployment))

    @app.post("/api/v1/ready", summary="Ingest a ready response for the deployment 'default'")
    async def post_default_ready(request: Request, engine: EngineIndex = None) -> Response:
        return await ingest("default", request, engine)

    @app.post("/api/v1/deployments/{deployment:name}/ready", summary="Ingest one engine's ready response")
    async def post_ready(deployment: str, request: Request, engine: EngineIndex = None) -> Response:
        return await ingest(deployment, request, engine)

    @app.put("/api/v1/deployments/{deployment:name}/cache-config", summary="Set a deployment's static cache config")
    async def put_cache_config(deployment: str, request: Request) -> Response:
        _check_deployment_name(deployment)
        _wire_format(request, {"application/json": JSON})
        try:
            update: CacheConfigUpdate = decode_cache_config_update(await request.body())
            result = await run_in_threadpool(state.set_static_config, deployment, update)
        except InvalidPayload as error:
            raise _invalid(error, "Invalid cache config") from None
        except StorageUnavailable as error:
            raise _unavailable(error) from None
        return _json_response(view(result))

    @app.get("/api/v1/deployments", summary="Every deployment's synced state")
    async def list_deployments() -> Response:
        return _json_response([view(deployment) for deployment in state.snapshot()])

    @app.delete("/api/v1/deployments/{deployment:name}/engines/{engine}", summary="Forget one engine")
    async def delete_engine(deployment: str, engine: int) -> Response:
        found(deployment)
        try:
            result = await run_in_threadpool(state.delete_engine, deployment, engine)
        except StorageUnavailable as error:
            raise _unavailable(error) from None
        if result is None:
            raise Problem(
                404, "Unknown engine", f"deployment {deployment!r} has no engine {engine}", "engine", "not_found"
            )
        return _json_response(view(result))

    @app.get("/api/v1/deployments/{deployment:name}", summary="One deployment's synced state")
    async def get_deployment(deployment: str) -> Response:
        return _json_response(view(found(deployment)))

    @app.delete("/api/v1/deployments/{deployment:name}", summary="Forget a deployment and its engines", status_code=204)
    async def delete_deployment(deployment: str) -> Response:
        found(deployment)
        try:
            await run_in_threadpool(state.delete_deployment, deployment)
        except StorageUnavailable as error:
            raise _unavailable(error) from None
        return Response(status_code=204)

    @app.get(settings.telemetry_path, summary="Prometheus metrics", include_in_schema=False)
    async def get_metrics(request: Request) -> Response:
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        body = await run_in_threadpool(encoder, registry)
        headers = {"Vary": "Accept, Accept-Encoding"}
        if "gzip" in request.headers.get("accept-encoding", ""):
            body = await run_in_threadpool(gzip.compress, body, 1)
            headers["Content-Encoding"] = "gzip"
        return Response(body, media_type=content_type, headers=headers)

    @app.get("/-/healthy", summary="Liveness", include_in_schema=False)
    async def healthy() -> Response:
        return Response("Healthy.\n", media_type="text/plain")

    @app.get("/-/ready", summary="Readiness", include_in_schema=False)
    async def ready() -> Response:
        return Response("Ready.\n", media_type="text/plain")

    @app.get("/", include_in_schema=False)
    async def landing() -> HTMLResponse:
        return HTMLResponse(_landing_page(settings))

    return app


def _rank(response: EngineCoreReadyResponse) -> int:
    rank = response.data_parallel_rank
    return rank if isinstance(rank, int) else 0
