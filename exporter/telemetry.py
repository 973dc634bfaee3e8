"""The exporter's metrics about itself: build info, storage health, and what happened to ready responses.

They are rendered by hand on every scrape (a few lines, microseconds); the
process and platform metrics come from prometheus_client and are sampled at
most once a second, since reading /proc costs more than the rest of a scrape.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable

import msgspec
from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector
from prometheus_client.exposition import generate_latest as text_latest
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest

from exporter import __version__
from exporter.collector import escape_label_value, format_value

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
PROCESS_SAMPLE_SECONDS = 1.0
_ACCEPTED = "cache_config_exporter_ready_responses_accepted"
_REJECTED = "cache_config_exporter_ready_responses_rejected"
_EXPIRED = "cache_config_exporter_replicas_expired"


def _family(name: str, kind: str, help_text: str, samples: str, openmetrics: bool) -> str:
    """One family; text format names a counter family with its ``_total`` suffix, OpenMetrics without."""
    family = name if openmetrics or kind != "counter" else f"{name}_total"
    return f"# HELP {family} {help_text}\n# TYPE {family} {kind}\n{samples}"


class ExporterMetrics:
    """Counters of ready responses, storage health and build info; ``registry`` holds the process metrics."""

    def __init__(
        self, registry: CollectorRegistry, storage_healthy: Callable[[], bool], replicas_expired: Callable[[], int]
    ) -> None:
        self.accepted = 0
        self._replicas_expired = replicas_expired
        self.rejected = dict.fromkeys(REJECTION_REASONS, 0)
        self._storage_healthy = storage_healthy
        self._registry = registry
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        self._sampled: dict[bool, tuple[float, str]] = {}
        labels = (("version", __version__), ("python_version", platform.python_version()),
                  ("msgspec_version", msgspec.__version__))  # fmt: skip
        self._build_info = ",".join(f'{name}="{escape_label_value(value)}"' for name, value in labels)

    def reject(self, reason: str) -> None:
        """Count a refused ready response (called from the event loop only)."""
        self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def _process(self, openmetrics: bool) -> str:
        now = time.monotonic()
        sampled = self._sampled.get(openmetrics)
        if sampled is None or now - sampled[0] >= PROCESS_SAMPLE_SECONDS:
            text = (openmetrics_latest if openmetrics else text_latest)(self._registry).decode()
            sampled = (now, text.removesuffix("# EOF\n"))
            self._sampled[openmetrics] = sampled
        return sampled[1]

    def render(self, openmetrics: bool) -> bytes:
        rejected = "".join(
            f'{_REJECTED}_total{{reason="{reason}"}} {format_value(count)}\n' for reason, count in self.rejected.items()
        )
        parts = (
            _family(_ACCEPTED, "counter", "Ready responses accepted and committed to storage.",
                    f"{_ACCEPTED}_total {format_value(self.accepted)}\n", openmetrics),
            _family(_REJECTED, "counter", "Ready responses refused, by reason; nothing was stored for them.",
                    rejected, openmetrics),
            _family(_EXPIRED, "counter",
                    "Replicas removed because they missed their heartbeats without saying goodbye.",
                    f"{_EXPIRED}_total {format_value(self._replicas_expired())}\n", openmetrics),
            _family("cache_config_exporter_storage_healthy", "gauge",
                    "1 while the store commits writes, 0 while it fails (ingest answers 503 then).",
                    f"cache_config_exporter_storage_healthy {format_value(self._storage_healthy())}\n", openmetrics),
            _family("cache_config_exporter_build_info", "gauge",
                    "A metric with a constant 1 labelled by the exporter's version and runtime.",
                    f"cache_config_exporter_build_info{{{self._build_info}}} 1.0\n", openmetrics),
            self._process(openmetrics),
            "# EOF\n" if openmetrics else "",
        )  # fmt: skip
        return "".join(parts).encode()
