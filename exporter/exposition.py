"""What ``/metrics`` sends: content negotiation, and the cache that makes a scrape cost little.

Two formats are rendered, and negotiated here alone: Prometheus text 0.0.4 and
OpenMetrics 1.0.0. Any other ``Accept`` (other versions, broken parameters)
gets text 0.0.4, never an error and never a body labelled with a version it
is not.

The cache-config families (nearly all the bytes) are rendered, and for gzip
compressed, once per state change; a scrape adds only the exporter's own small
metrics. For gzip the compressor's state after the cached part is kept and
copied, so each scrape compresses just the small tail yet sends one valid gzip
stream. The cached part is identical in both formats (gauges only), so text and
OpenMetrics share it.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Sequence

from exporter.collector import CacheConfigCollector
from exporter.state import ExporterState
from exporter.telemetry import ExporterMetrics

TEXT = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"
# Media range -> (the version parameter it may carry, the content type served for it).
_FORMATS = {
    "application/openmetrics-text": ("1.0.0", OPENMETRICS),
    "text/plain": ("0.0.4", TEXT),
    "text/*": ("0.0.4", TEXT),
    "*/*": ("0.0.4", TEXT),
}
# Fast compression: it runs once per state change, and label-heavy text compresses well at any level.
GZIP_LEVEL = 1


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


def negotiate(accept: str) -> str:
    """The content type to serve: the supported media range of highest ``q`` (the first on a tie), else text."""
    best, best_quality = TEXT, 0.0
    for media_range in accept.split(","):
        kind, *parameter_list = (part.strip() for part in media_range.split(";"))
        parameters = dict(
            (name.strip().lower(), value.strip()) for name, _, value in (p.partition("=") for p in parameter_list)
        )
        supported = _FORMATS.get(kind.lower())
        if supported is None or parameters.get("version", supported[0]) != supported[0]:
            continue
        try:
            quality = float(parameters.get("q", "1"))
        except ValueError:
            continue
        if best_quality < quality <= 1:
            best, best_quality = supported[1], quality
    return best


class _Rendered:
    """The cache-config part of one state version, plain and (on first demand) gzip-compressed."""

    def __init__(self, version: int, body: bytes) -> None:
        self.version = version
        self.body = body
        self._gzip: tuple[bytes, zlib._Compress] | None = None
        self._lock = threading.Lock()

    @property
    def has_gzip(self) -> bool:
        return self._gzip is not None

    def gzip_prefix(self) -> tuple[bytes, zlib._Compress]:
        with self._lock:
            if self._gzip is None:
                compressor = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
                self._gzip = (compressor.compress(self.body), compressor)
            return self._gzip


class Exposition:
    """Renders ``/metrics`` bodies from a state, its collector and the exporter's own metrics."""

    def __init__(self, state: ExporterState, collector: CacheConfigCollector, metrics: ExporterMetrics) -> None:
        self._state = state
        self._collector = collector
        self._metrics = metrics
        self._rendered = _Rendered(-1, b"")
        self._lock = threading.Lock()

    def is_fresh(self, gzip: bool) -> bool:
        """True when ``render`` will neither re-render nor compress the large part (cheap on the event loop)."""
        rendered = self._rendered
        return rendered.version == self._state.version and (rendered.has_gzip or not gzip)

    def _current(self) -> _Rendered:
        rendered = self._rendered
        if rendered.version == self._state.version:
            return rendered
        with self._lock:
            # Read the version before the snapshot: the snapshot is then at least that new.
            version = self._state.version
            if self._rendered.version != version:
                self._rendered = _Rendered(version, self._collector.collect(self._state.snapshot()))
            return self._rendered

    def render(self, accept: str, gzip: bool) -> tuple[Sequence[bytes], str]:
        """The body (as chunks to send in order) and its content type."""
        content_type = negotiate(accept)
        rendered = self._current()
        tail = self._metrics.render(openmetrics=content_type == OPENMETRICS)
        if not gzip:
            return (rendered.body, tail), content_type
        prefix, compressor = rendered.gzip_prefix()
        finish = compressor.copy()
        return (prefix, finish.compress(tail) + finish.flush()), content_type
