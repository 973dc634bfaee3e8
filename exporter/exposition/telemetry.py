"""The exporter's metrics about itself, as prometheus_client metrics: ready responses accepted and refused,
replicas expired, storage health, build info, and the process.

Counters are counted where the events happen: ``accepted`` and ``expired`` when
the writer has committed them, refusals where a refusal becomes an HTTP answer.
With ``--web.workers N`` each worker counts into prometheus_client's
multiprocess files (``PROMETHEUS_MULTIPROC_DIR``, set by ``serve``) and every
worker's scrape shows the sums over all of them.
"""

from __future__ import annotations

import itertools
import os
import platform
from collections import Counter as Counts
from collections.abc import Callable, Iterator

import msgspec
from prometheus_client import CollectorRegistry, Counter, PlatformCollector, disable_created_metrics
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from exporter import __version__
from exporter.exposition.process_metrics import ProcessMetrics

MULTIPROCESS_ENVIRONMENT = "PROMETHEUS_MULTIPROC_DIR"
# No ``*_created`` series: a counter's start shows in process_start_time_seconds (and this process owns
# prometheus_client: nothing else in it renders metrics).
disable_created_metrics()
REJECTION_REASONS = (
    "malformed",
    "invalid",
    "invalid_request",
    "conflict",
    "limit",
    "unauthorized",
    "unsupported_media_type",
    "storage_unavailable",
    "too_large",
    "timeout",
    "client_disconnected",
    "host",
)


class _Health(Collector):
    """Storage health, where there is a store, and build info, read when collected."""

    def __init__(self, storage_healthy: Callable[[], bool] | None) -> None:
        self._storage_healthy = storage_healthy

    def collect(self) -> Iterator[Metric]:
        if self._storage_healthy is not None:
            yield GaugeMetricFamily(
                "cache_config_exporter_storage_healthy",
                "1 while the store commits writes, 0 while it fails (ingest answers 503 then).",
                value=float(self._storage_healthy()),
            )
        build = GaugeMetricFamily(
            "cache_config_exporter_build_info",
            "A metric with a constant 1 labelled by the exporter's version and runtime.",
            labels=["version", "python_version", "msgspec_version"],
        )
        build.add_metric([__version__, platform.python_version(), msgspec.__version__], 1.0)
        yield build


def register_own_metrics(registry: CollectorRegistry, storage_healthy: Callable[[], bool] | None = None) -> None:
    """What every exporter shows of itself: build info, storage health where it keeps a store (a probe-only one
    keeps none), the process, and with ``--web.workers N`` the counts of every worker."""
    shared = os.environ.get(MULTIPROCESS_ENVIRONMENT)
    if shared:
        MultiProcessCollector(registry, shared)
    registry.register(_Health(storage_healthy))
    registry.register(ProcessMetrics())
    PlatformCollector(registry=registry)


class Telemetry:
    """Counts what happens to ready responses and replicas into ``registry`` (with the process metrics).

    ``generation`` changes whenever a count does, so a rendering of the registry can be reused until then.
    """

    def __init__(self, registry: CollectorRegistry, storage_healthy: Callable[[], bool]) -> None:
        shared = os.environ.get(MULTIPROCESS_ENVIRONMENT)
        own = None if shared else registry
        self.accepted = Counter(
            "cache_config_exporter_ready_responses_accepted",
            "Ready responses accepted and committed to storage.",
            registry=own,
        )
        self.rejected = Counter(
            "cache_config_exporter_ready_responses_rejected",
            "Ready responses refused, by reason; nothing was stored for them.",
            ["reason"],
            registry=own,
        )
        for reason in REJECTION_REASONS:
            self.rejected.labels(reason)
        self.expired = Counter(
            "cache_config_exporter_replicas_expired",
            "Replicas removed because they missed their heartbeats without saying goodbye.",
            registry=own,
        )
        register_own_metrics(registry, storage_healthy)
        self._ticks = itertools.count(1)
        self.generation = 0

    def reject(self, reason: str) -> None:
        """Count a refused ready response."""
        self.rejected.labels(reason).inc()
        self.generation = next(self._ticks)

    def committed(self, counts: Counts[str]) -> None:
        """Count what one commit accepted and expired (called by the writer thread)."""
        self.accepted.inc(counts["accepted"])
        self.expired.inc(counts["expired"])
        self.generation = next(self._ticks)  # a new value from either thread, never a lost update
