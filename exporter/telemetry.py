"""The exporter's metrics about itself: build info, storage health, and what happened to ready responses."""

from __future__ import annotations

import platform
from collections.abc import Callable

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, PlatformCollector, ProcessCollector

from exporter import __version__

REJECTION_REASONS = (
    "malformed",
    "invalid",
    "invalid_request",
    "conflict",
    "limit",
    "unauthorized",
    "unsupported_media_type",
    "storage_unavailable",
)


class ExporterMetrics:
    """Metrics registered in the app's own registry (never the global one)."""

    def __init__(self, registry: CollectorRegistry, storage_healthy: Callable[[], bool]) -> None:
        self.accepted = Counter(
            "cache_config_exporter_ready_responses_accepted",
            "Ready responses accepted and committed to storage.",
            registry=registry,
        )
        self.rejected = Counter(
            "cache_config_exporter_ready_responses_rejected",
            "Ready responses refused, by reason; nothing was stored for them.",
            ("reason",),
            registry=registry,
        )
        for reason in REJECTION_REASONS:
            self.rejected.labels(reason)
        Gauge(
            "cache_config_exporter_storage_healthy",
            "1 while the store commits writes, 0 while it fails (ingest answers 503 then).",
            registry=registry,
        ).set_function(lambda: float(storage_healthy()))
        Gauge(
            "cache_config_exporter_build_info",
            "A metric with a constant 1 labelled by the exporter's version and runtime.",
            ("version", "python_version", "msgspec_version"),
            registry=registry,
        ).labels(__version__, platform.python_version(), msgspec.__version__).set(1)
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
