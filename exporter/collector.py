"""Turns the exporter's state into metric families, fresh on every scrape.

Nothing is kept between scrapes, so a changed label set or a dropped engine
leaves no stale series behind.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from exporter.state import Deployment, ExporterState
from protocol import is_set, render_labels
from protocol.cache_config import LABEL_NAMES

# Per-engine figures: (field of the ready response and metric suffix, help text).
ENGINE_GAUGES = (
    ("block_size", "KV-cache block size in tokens this engine runs with."),
    ("mamba_block_size", "Mamba block size in tokens this engine runs with (absent for models without Mamba layers)."),
    ("num_gpu_blocks", "GPU KV-cache blocks of this engine alone (the info metric shows the deployment total)."),
    ("max_model_len", "Longest sequence this engine accepts, in tokens."),
    ("kv_cache_size_tokens", "KV-cache capacity of this engine in tokens."),
    ("kv_cache_max_concurrency", "Requests of max_model_len this engine's KV cache can hold at once."),
)


def _engine_value(deployment: Deployment, engine: int, field: str) -> float | None:
    """An engine's own figure; for a block size it did not report, the deployment's base value."""
    value = getattr(deployment.engines[engine].response, field)
    if value is msgspec.UNSET and field in ("block_size", "mamba_block_size"):
        value = getattr(deployment.base, field)
    return float(value) if is_set(value) else None


class CacheConfigCollector(Collector):
    """Collects ``cache_config_info`` and its numeric companions from an ``ExporterState``."""

    def __init__(self, state: ExporterState, prefix: str = "") -> None:
        self._state = state
        self._prefix = prefix

    def describe(self) -> list[Metric]:
        # Describing by collecting would run on registration; names alone are enough here.
        return []

    def collect(self) -> Iterator[Metric]:
        name = f"{self._prefix}cache_config_"
        deployments = self._state.snapshot()
        info = GaugeMetricFamily(
            f"{name}info",
            "Information of the LLMEngine CacheConfig, synced from the engines' ready responses.",
            labels=("deployment", "engine", *LABEL_NAMES),
        )
        gauges = {
            field: GaugeMetricFamily(f"{name}{field}", help_text, labels=("deployment", "engine"))
            for field, help_text in ENGINE_GAUGES
        }
        updated = GaugeMetricFamily(
            f"{name}last_update_timestamp_seconds",
            "When this engine's last ready response was accepted, in Unix seconds.",
            labels=("deployment", "engine"),
        )
        distinct = GaugeMetricFamily(
            f"{name}distinct_values",
            "Distinct values the engines of a deployment report for a field; above 1 they disagree "
            "and the lowest engine index wins.",
            labels=("deployment", "field"),
        )
        parallel = GaugeMetricFamily(
            f"{name}data_parallel_size",
            "Data-parallel size the engines of a deployment report (the largest, if they differ).",
            labels=("deployment",),
        )
        for deployment in deployments:
            if not deployment.engines:
                continue
            labels = render_labels(deployment.synced.config)
            label_values = [labels[label] for label in LABEL_NAMES]
            for engine in sorted(deployment.engines):
                report = deployment.engines[engine]
                key = [deployment.name, str(engine)]
                info.add_metric([*key, *label_values], 1.0)
                updated.add_metric(key, report.received_at)
                for field, gauge in gauges.items():
                    value = _engine_value(deployment, engine, field)
                    if value is not None:
                        gauge.add_metric(key, value)
            for field, count in deployment.synced.distinct_values.items():
                distinct.add_metric([deployment.name, field], float(count))
            sizes = [r.response.data_parallel_size for r in deployment.engines.values()]
            sizes = [size for size in sizes if is_set(size)]
            if sizes:
                parallel.add_metric([deployment.name], float(max(sizes)))
        yield info
        yield from gauges.values()
        yield updated
        yield distinct
        yield parallel
