"""The two formats ``/metrics`` speaks, negotiated here alone: Prometheus text 0.0.4 and OpenMetrics 1.0.0.

Any other ``Accept`` (other versions, broken parameters) gets text 0.0.4, never an error and never a body
labelled with a version it is not; gzip only where the client accepts it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest as text_latest
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest


class Format(NamedTuple):
    media_range: str
    version: str
    content_type: str
    render: Callable[[CollectorRegistry], bytes]
    end: bytes


TEXT = Format("text/plain", "0.0.4", "text/plain; version=0.0.4; charset=utf-8", text_latest, b"")
OPENMETRICS = Format(
    "application/openmetrics-text",
    "1.0.0",
    "application/openmetrics-text; version=1.0.0; charset=utf-8",
    openmetrics_latest,
    b"# EOF\n",
)
# Media range -> the format served for it.
_FORMATS = {"application/openmetrics-text": OPENMETRICS, "text/plain": TEXT, "text/*": TEXT, "*/*": TEXT}
# Fast compression: it runs once per state change, and label-heavy text compresses well at any level.
GZIP_LEVEL = 1
# A gzip member's header (RFC 1952): deflate, no flags, no time, no extra flags, operating system unknown.
GZIP_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"
# The exporter's own metrics are rendered again at least this often (process CPU, memory).
SELF_METRICS_SECONDS = 1.0


def accepts_gzip(accept_encoding: str) -> bool:
    """Whether an ``Accept-Encoding`` header takes gzip (``gzip;q=0`` refuses it)."""
    for coding in accept_encoding.lower().split(","):
        name, _, parameters = coding.partition(";")
        if name.strip() in ("gzip", "x-gzip"):
            quality = parameters.strip().removeprefix("q=")
            try:
                return not parameters.strip() or float(quality) > 0
            except ValueError:
                return False
    return False


def negotiate(accept: str) -> Format:
    """The format to serve: the supported media range of highest ``q`` (the first on a tie), else text."""
    best, best_quality = TEXT, 0.0
    for media_range in accept.split(","):
        kind, *parameter_list = (part.strip() for part in media_range.split(";"))
        parameters = dict(
            (name.strip().lower(), value.strip()) for name, _, value in (p.partition("=") for p in parameter_list)
        )
        supported = _FORMATS.get(kind.lower())
        if supported is None or parameters.get("version", supported.version) != supported.version:
            continue
        try:
            quality = float(parameters.get("q", "1"))
        except ValueError:
            continue
        if best_quality < quality <= 1:
            best, best_quality = supported, quality
    return best
