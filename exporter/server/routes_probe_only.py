"""The routes of ``serve --probe.only``: ``/probe`` and what an operator needs around it, nothing that ingests or
reads stored state.

A probe-only exporter keeps nothing (``exporter/probe/prober.py`` reads each target anew), so it opens no store:
it runs on a read-only file system with no volume. Its ``/metrics`` is the exporter's own metrics (probes,
process, build), ``/-/ready`` holds from the start, and ``/`` is the API reference of the routes it has. The
ingest and state routes answer 404 saying why, for a plugin pointed at it by mistake.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from exporter.errors import NotFound
from exporter.exposition.formats import negotiate
from exporter.probe.options import probe_flag
from exporter.server.endpoints import Access, Endpoint
from exporter.server.routes import ENDPOINTS, Probing, docs

# The exporter's routes that need no state: they stay, as they are.
_STATELESS_PATHS = ("/probe", "/-/healthy", "/docs", "/openapi.json")


@dataclass(frozen=True)
class ProbeOnly(Probing):
    """What a probe-only app's handlers work with: its own metrics' registry besides the prober."""

    registry: CollectorRegistry


async def get_own_metrics(request: Request, exporter: ProbeOnly, _: None) -> Response:
    """The exporter's own metrics: its probes by result, the process and the build (it keeps no cache config)."""
    served = negotiate(request.headers.get("accept", ""))
    body = await run_in_threadpool(served.render, exporter.registry)  # the process metrics read /proc
    return Response(body, media_type=served.content_type, headers={"Vary": "Accept"})


async def ready_to_probe(request: Request, exporter: ProbeOnly, _: None) -> Response:
    """Readiness: 200 once it serves, as it waits for no store (for probes; no credentials needed)."""
    return PlainTextResponse("Ready.\n")


async def not_kept_here(request: Request, exporter: ProbeOnly, _: object) -> Response:
    """Ingest and the stored state: a probe-only exporter has neither."""
    raise NotFound(
        None, f"this exporter runs with {probe_flag('probe_only')}: it takes no ready responses, keeps no state"
    )


PROBE_ONLY_ENDPOINTS = (
    *(endpoint for endpoint in ENDPOINTS if endpoint.path in _STATELESS_PATHS),
    Endpoint("/-/ready", ("GET",), Access.OPEN, ready_to_probe, answers=("text/plain",)),
    Endpoint("/", ("GET",), Access.OPEN, docs, documented=False),
    *(
        endpoint._replace(access=Access.OPEN, handler=not_kept_here, query=None, documented=False)
        for endpoint in ENDPOINTS
        if endpoint.path.startswith("/api/")
    ),
)
