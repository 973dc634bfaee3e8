"""The exporter's metrics about itself: build info and what happened to the ready responses it was sent."""

from __future__ import annotations

import platform

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, PlatformCollector, ProcessCollector

from exporter import __version__

REJECTION_REASONS = (
    "malformed",
    "invalid",
    "invalid_request",
    "conflict",
    "unsupported_media_type",
    "storage_unavailable",
)


class ExporterMetrics:
    """Counters registered in the app's own registry (never the global one)."""

    def __init__(self, registry: CollectorRegistry) -> None:
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
            "cache_config_exporter_build_info",
            "A metric with a constant 1 labelled by the exporter's version and runtime.",
            ("version", "python_version", "msgspec_version"),
            registry=registry,
        ).labels(__version__, platform.python_version(), msgspec.__version__).set(1)
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
